"""A bias tile staged in shared memory one step ahead of its use (the Hopper forward, dQ and dK/dV kernels).

Why: read from global memory in the accumulator's layout, each load instruction of a warp touches 8 rows of 16
bytes (queries as rows) or 16 rows of 2 bytes (the dK/dV kernels, queries as columns): 8 or 16 L1 wavefronts,
and a 128 x 128 tile costs the SM's eight consumer warps 2048 or more of them, more cycles than the tile's two
GEMMs take at head dim 64, where the bias forward ran at 2-3x the plain kernel's time.  Here each consumer
warpgroup copies its part of the next step's bias tile with 16-byte `cp.async` (a warp's copy covers whole
128-byte lines), one step ahead, into one of two buffers; when its copies have landed (each thread's wait,
then a warpgroup barrier), each thread reads its fragment's cells from shared memory.  Where two buffers do
not fit (the dK/dV kernel at head dim 128), one does: the warpgroup then meets at its barrier once more after
its reads, before it issues the next step's copies into the same buffer.

Pad safety: a warpgroup stages its part of a tile only when each cell of it lies inside the valid rectangle
(`fits`: also S a multiple of 8 and the tensor's start 16-byte aligned, so every copy is one aligned 16-byte
row segment of the tensor); otherwise it copies nothing and the caller reads the cells itself, as it does
without staging.  Nothing outside the rectangle is read, and the cells added are the same, bitwise.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental import primitives as prims

# Elements after each row (one query) of a buffer: rows 16 bytes apart modulo 128, so a warp's reads of one
# fragment column (8 rows x 16 bytes; with queries as columns 4 rows x 16 bytes) hit distinct banks.
ROW_PAD = 8


class BiasStage(NamedTuple):
    """One warpgroup's part of the staging buffers `buffers` (queries, keys, 2) of a tile: `part`, the view of
    queries [row0, row0 + rows) x keys [col0, col0 + cols) (its static shape carries rows and cols through the
    kernels' loops, where plain integers in a tuple become run-time values); buffer `parity` (alternating from
    step to step, set by the caller per step; always 0 with one buffer, `buffer_count`); `barrier`, the
    warpgroup's named barrier (128 threads).  Made by `make`."""
    buffers: cute.Tensor
    part: cute.Tensor
    row0: object
    col0: object
    barrier: object
    parity: object = 0


@cute.jit
def make(buffers: cute.Tensor, row0, rows: cutlass.Constexpr, col0, cols: cutlass.Constexpr, barrier) -> BiasStage:
    """The BiasStage of queries [row0, row0 + rows) x keys [col0, col0 + cols) of `buffers` (layout())."""
    part = cute.make_tensor(buffers.iterator + cute.crd2idx((row0, col0, 0), buffers.layout),
                            cute.make_layout((rows, cols, cute.size(buffers.shape[2])),
                                             stride=buffers.layout.stride))
    return BiasStage(buffers, part, row0, col0, barrier, 0)


def buffer_count(stage: BiasStage) -> int:
    """1 or 2 (static)."""
    return cute.size(stage.part.shape[2])


def smem_elems(queries: int, keys: int, buffers: int = 2) -> int:
    """Elements of the buffers of a (queries x keys) tile."""
    return buffers * queries * (keys + ROW_PAD)


def layout(queries: int, keys: int, buffers: int = 2):
    """(query, key, buffer) of the buffers, rows padded by ROW_PAD."""
    row = keys + ROW_PAD
    return cute.make_layout((queries, keys, buffers), stride=(row, 1, queries * row))


@cute.jit
def fits(stage: BiasStage, bias: cute.Tensor, q0: cutlass.Int32, k0: cutlass.Int32, q_len: cutlass.Int32,
         k_lim: cutlass.Int32) -> cutlass.Boolean:
    """Whether the warpgroup's part of the tile at (q0, k0) (its first query and key) lies inside the valid
    rectangle (q_len x k_lim) of `bias` (Tx, S) and copies as aligned 16-byte segments.  Uniform over the
    warpgroup (so are its inputs)."""
    seg = 128 // bias.element_type.width
    aligned = cute.size(bias.shape[1]) % seg == 0 and bias.iterator.toint() % 16 == 0
    rows = cute.size(stage.part.shape[0])
    cols = cute.size(stage.part.shape[1])
    return aligned and q0 + stage.row0 + rows <= q_len and k0 + stage.col0 + cols <= k_lim


@cute.jit
def copy(stage: BiasStage, bias: cute.Tensor, q0: cutlass.Int32, k0: cutlass.Int32, wg_tidx: cutlass.Int32):
    """The warpgroup's copies of its part of the tile at (q0, k0) of `bias` (a broadcast Tx = 1 reads its one
    row) into buffer stage.parity; the caller checked `fits`.  Thread t copies segments t, t + 128, ... of the
    row-major part."""
    elem = bias.element_type
    seg = 128 // elem.width
    rows = cute.size(stage.part.shape[0])
    per_row = cute.size(stage.part.shape[1]) // seg
    t_last = cute.size(bias.shape[0]) - 1
    buf = stage.part[None, None, stage.parity]
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), elem,
                               num_bits_per_copy=128)
    q0 = q0 + stage.row0
    k0 = k0 + stage.col0
    for p in cutlass.range_constexpr(rows * per_row // 128):
        idx = p * 128 + wg_tidx
        r = idx // per_row
        c = (idx % per_row) * seg
        src_addr = (bias.iterator + cute.crd2idx((cutlass.min(q0 + r, t_last), k0 + c), bias.layout)).toint()
        src = cute.make_tensor(cute.make_ptr(elem, src_addr, cute.AddressSpace.gmem, assumed_align=16),
                               cute.make_layout(seg))
        dst_addr = (buf.iterator + cute.crd2idx((r, c), buf.layout)).toint()
        dst = cute.make_tensor(cute.make_ptr(elem, dst_addr, cute.AddressSpace.smem, assumed_align=16),
                               cute.make_layout(seg))
        cute.copy(atom, src, dst)


@cute.jit
def add(s_mn: cute.Tensor, c_mn: cute.Tensor, stage: BiasStage, scale: cutlass.Float32,
        query_mode: cutlass.Constexpr):
    """Raw q.k -> q.k * scale + the staged bias at each fragment cell, in one rounding (c_mn: tile coordinates).
    query_mode 0 (queries as rows): two adjacent keys per read; 1 (keys as rows): one cell per read."""
    buf = stage.buffers[None, None, stage.parity]
    elem = buf.element_type
    if cutlass.const_expr(query_mode == 0):
        # bf16 -> float32 is the 16 bits shifted up: one shift or one mask per value (the generic conversion
        # took a byte permute and a multiply for the upper one).
        words = cute.make_rmem_tensor((2,), cutlass.Uint32)
        floats = cute.recast_tensor(words, cutlass.Float32)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1]) // 2):
                addr = (buf.iterator + cute.crd2idx((c_mn[r, 2 * c][0], c_mn[r, 2 * c][1]), buf.layout)).toint()
                if cutlass.const_expr(elem == cutlass.BFloat16):
                    w = cute.make_tensor(cute.make_ptr(cutlass.Uint32, addr, cute.AddressSpace.smem,
                                                       assumed_align=4), cute.make_layout(1)).load()[0]
                    words[0] = w << 16
                    words[1] = w & cutlass.Uint32(0xFFFF0000)
                    b0 = floats[0]
                    b1 = floats[1]
                else:
                    two = cute.make_tensor(cute.make_ptr(elem, addr, cute.AddressSpace.smem, assumed_align=4),
                                           cute.make_layout(2)).load()
                    b0 = two[0].to(cutlass.Float32)
                    b1 = two[1].to(cutlass.Float32)
                s_mn[r, 2 * c] = cute.math.fma(s_mn[r, 2 * c], scale, b0)
                s_mn[r, 2 * c + 1] = cute.math.fma(s_mn[r, 2 * c + 1], scale, b1)
    elif cutlass.const_expr(elem == cutlass.BFloat16):
        _add_keys_as_rows(s_mn, c_mn, buf, scale)
    else:
        # float16 keeps one 2-byte read per cell: its ldmatrix variant gave wrong dK on an H200 (2026-11-29;
        # the bf16 one is checked by the GPU suite).
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                b = buf[c_mn[r, c][1], c_mn[r, c][0]].to(cutlass.Float32)
                s_mn[r, c] = cute.math.fma(s_mn[r, c], scale, b)


@cute.jit
def _add_keys_as_rows(s_mn: cute.Tensor, c_mn: cute.Tensor, buf: cute.Tensor, scale: cutlass.Float32):
    """`add` with keys as rows (the dK/dV kernels' S^T): a thread's fragment is the Hopper wgmma accumulator's
    (sm90/common.map_group): keys k and k + 8 of its warp's 16 as rows, queries 8 (c // 2) + 2 (lane % 4) + c % 2
    as columns.  The buffer holds queries as rows, so the two queries of a column pair are a row apart, and each
    cell took a 2-byte load of its own (32 per thread and step at block_m 64).  `ldmatrix .trans` reads an 8 x 8
    block of the buffer (8 queries x 8 keys, one 16-byte row segment per query) and hands lane l the block's
    transpose at (key l / 4, queries 2 (l % 4), + 1): exactly a column pair of the fragment.  So one
    `ldmatrix.x4.trans` reads four of the thread's pairs (both key rows, two query blocks), an eighth of the
    loads.  The buffer's row segments are 16-byte aligned (rows of keys + ROW_PAD elements) and its rows 16
    bytes apart modulo 128, so the eight rows of a block hit distinct banks."""
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    assert rows == 2 and cols % 4 == 0 and buf.element_type == cutlass.BFloat16
    lane = cute.arch.lane_idx()
    # The warp's first key (its 16 keys start at a multiple of 16) and this lane's part of the addresses: lanes
    # 8 t .. 8 t + 7 give the rows of matrix t of an x4 load; matrix t is key block t % 2, query block t // 2
    # of the load's two.
    key0 = (c_mn[0, 0][0] // 16) * 16 + 8 * ((lane // 8) % 2)
    q_lane = 8 * (lane // 16) + lane % 8
    floats = cute.make_rmem_tensor((2,), cutlass.Uint32)
    as_f32 = cute.recast_tensor(floats, cutlass.Float32)
    for i in cutlass.range_constexpr(cols // 4):
        ptr = buf.iterator + cute.crd2idx((16 * i + q_lane, key0), buf.layout)
        regs = prims.ldmatrix(ptr.llvm_ptr, 4, prims.MMALayout.COL)
        for t in cutlass.range_constexpr(4):
            r = t % 2
            c = 2 * (2 * i + t // 2)
            w = cutlass.Uint32(regs[t])
            # bf16 -> float32 is the 16 bits shifted up (see the queries-as-rows branch).
            floats[0] = w << 16
            floats[1] = w & cutlass.Uint32(0xFFFF0000)
            b0 = as_f32[0]
            b1 = as_f32[1]
            s_mn[r, c] = cute.math.fma(s_mn[r, c], scale, b0)
            s_mn[r, c + 1] = cute.math.fma(s_mn[r, c + 1], scale, b1)
