"""A bias tile staged in shared memory one key tile ahead of its use (the Hopper forward and dQ kernels).

Why: read from global memory in the accumulator's layout, each load instruction of a warp touches 8 rows of 16
bytes, 8 L1 wavefronts, and a 128 x 128 tile costs the SM's eight consumer warps 2048 of them: more cycles
than the tile's two GEMMs take at head dim 64, where the bias forward ran at 2-3x the plain kernel's time.
Here each consumer warpgroup copies its rows of the next key tile's bias with 16-byte `cp.async` (a warp's copy
covers two whole rows: 4 wavefronts), one key tile ahead, into one of two buffers; when its copies have landed
(each thread's wait, then a warpgroup barrier), each thread reads its fragment's cells from shared memory.

Pad safety: a warpgroup stages a tile only when each cell of its rows x the tile's keys lies inside the valid
rectangle (`fits`: also S a multiple of 8 and the tensor's start 16-byte aligned, so every copy is one aligned
16-byte row segment of the tensor); otherwise it copies nothing and the caller reads the cells itself, as it
does without staging.  Nothing outside the rectangle is read, and the cells added are the same, bitwise.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

# Elements after each row of a buffer: rows 16 bytes apart modulo 128, so a warp's reads of one fragment
# column (8 rows x 16 bytes) hit 32 distinct banks.
ROW_PAD = 8


class BiasStage(NamedTuple):
    """One warpgroup's view of the staging buffers: `buffers` (block_m, block_n, 2), key tile n in buffer n % 2;
    the warpgroup owns rows [row0, row0 + rows) of the tile; `barrier` is its named barrier (128 threads)."""
    buffers: cute.Tensor
    row0: cutlass.Int32
    rows: int
    block_n: int
    barrier: cutlass.Int32


def smem_elems(block_m: int, block_n: int) -> int:
    """Elements of the two buffers."""
    return 2 * block_m * (block_n + ROW_PAD)


def layout(block_m: int, block_n: int):
    """(row, key, buffer) of the two buffers, rows padded by ROW_PAD."""
    row = block_n + ROW_PAD
    return cute.make_layout((block_m, block_n, 2), stride=(row, 1, block_m * row))


@cute.jit
def fits(bias: cute.Tensor, q0: cutlass.Int32, rows: cutlass.Constexpr, k0: cutlass.Int32, cols: cutlass.Constexpr,
         q_len: cutlass.Int32, k_lim: cutlass.Int32) -> cutlass.Boolean:
    """Whether rows [q0, q0 + rows) x keys [k0, k0 + cols) of `bias` (Tx, S) lie inside the valid rectangle
    (q_len x k_lim) and copy as aligned 16-byte segments.  Uniform over the warpgroup (so are its inputs)."""
    seg = 128 // bias.element_type.width
    aligned = cute.size(bias.shape[1]) % seg == 0 and bias.iterator.toint() % 16 == 0
    return aligned and q0 + rows <= q_len and k0 + cols <= k_lim


@cute.jit
def copy(stage: BiasStage, bias: cute.Tensor, q0: cutlass.Int32, k0: cutlass.Int32, n_block: cutlass.Int32,
         wg_tidx: cutlass.Int32):
    """The warpgroup's copies of rows [q0, q0 + stage.rows) x keys [k0, k0 + block_n) of `bias` (a broadcast
    Tx = 1 reads its one row) into buffer n_block % 2, rows stage.row0 onward; the caller checked `fits`.
    Thread t copies segments t, t + 128, ... of the row-major tile."""
    elem = bias.element_type
    seg = 128 // elem.width
    per_row = stage.block_n // seg
    t_last = cute.size(bias.shape[0]) - 1
    buf = stage.buffers[None, None, n_block % 2]
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), elem,
                               num_bits_per_copy=128)
    for p in cutlass.range_constexpr(stage.rows * per_row // 128):
        idx = p * 128 + wg_tidx
        r = idx // per_row
        c = (idx % per_row) * seg
        src_addr = (bias.iterator + cute.crd2idx((cutlass.min(q0 + r, t_last), k0 + c), bias.layout)).toint()
        src = cute.make_tensor(cute.make_ptr(elem, src_addr, cute.AddressSpace.gmem, assumed_align=16),
                               cute.make_layout(seg))
        dst_addr = (buf.iterator + cute.crd2idx((stage.row0 + r, c), buf.layout)).toint()
        dst = cute.make_tensor(cute.make_ptr(elem, dst_addr, cute.AddressSpace.smem, assumed_align=16),
                               cute.make_layout(seg))
        cute.copy(atom, src, dst)


@cute.jit
def add(s_mn: cute.Tensor, c_mn: cute.Tensor, stage: BiasStage, n_block: cutlass.Int32):
    """s += the staged bias of key tile n_block at each fragment cell (c_mn: tile coordinates, queries as rows),
    two adjacent keys per read."""
    buf = stage.buffers[None, None, n_block % 2]
    elem = buf.element_type
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1]) // 2):
            addr = (buf.iterator + cute.crd2idx((c_mn[r, 2 * c][0], c_mn[r, 2 * c][1]), buf.layout)).toint()
            two = cute.make_tensor(cute.make_ptr(elem, addr, cute.AddressSpace.smem, assumed_align=4),
                                   cute.make_layout(2)).load()
            s_mn[r, 2 * c] = s_mn[r, 2 * c] + two[0].to(cutlass.Float32)
            s_mn[r, 2 * c + 1] = s_mn[r, 2 * c + 1] + two[1].to(cutlass.Float32)
