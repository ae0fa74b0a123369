"""Masks and additive biases given as tensors (the kernels' "aux" inputs), and the mask's block summary.

Two kinds of aux variants: "bias" (a bias tensor, with or without a mask and ALiBi) forms natural-unit scores
q.k * scale + bias (`scores`) with the exact softmax of softmax.py; "mask" (no bias tensor: a mask and / or ALiBi)
keeps the plain kernels' raw scores and exp2-domain softmax, adds the ALiBi term in raw units and selects -inf
where the mask hides a pair (`mask_scores`), so a tile the mask shows whole costs what it costs without a mask.
Both take the same arguments.

The aux variants of the kernels take the padded layout only: sequence b's query i is row i of the mask and
bias, its key j column j.  Per call (the FFI handler's arguments, `_backends/cute/aux.py` builds them):
  mask      Uint8 (Bx, Hx, Tx, S): 0 hides key j from query i (FLAG_MASK);
  bias      input dtype (Bx, Hx, Tx, S) (FLAG_BIAS) or bias32 Float32 (FLAG_BIAS32): added to the score;
  tile_map  Uint8 (Bx, Hx, Mx, Nx): the mask per block of MAP_ROWS queries x MAP_COLS keys, HIDDEN / MIXED /
            VISIBLE (cells past the tensor's end do not count); Mx = ceil(Tx / MAP_ROWS), Nx = ceil(S / MAP_COLS);
  row_range Int32 (Bx, Hx, Mx, 2): per row block, [lo, hi) of the column blocks holding a visible cell
            ((Nx, 0) when none); col_range Int32 (Bx, Hx, Nx, 2): per column block, the row blocks ((Mx, 0)).
  slopes    Float32 (Bx, N, 1, 1): ALiBi slopes (FLAG_ALIBI): the score of (i, j) gains -slope * |i + off - j|,
            computed from the indices (no T x S tensor), off = k_len - q_len with FLAG_ALIBI_BOTTOM_RIGHT, else 0;
            in the units of the kind's scores: natural for "bias", divided by the softmax scale for "mask".
A tensor that is absent is a (1, 1, 1, 1) placeholder with its flag clear.  Broadcasting: Bx in {1, B},
Hx in {1, N} (shared or per query head; the caller broadcasts a per-key/value-head tensor to N, see
_backends/cute/aux.py), Tx in {1, T}; the element of (b, head, i, j) is [min(b, Bx - 1), head if Hx = N else 0,
min(i, Tx - 1), j].

Pad safety: every mask or bias load reads a cell of the valid rectangle (i < q_len, j < k_len: the pair
itself, or for a pair outside the rectangle the nearest cell inside, whose value a select then discards),
one element or one aligned pair per load (no vector load can straddle a row or the end of the tensor at any S
or alignment).  The staged bias (bias_stage.py) copies 16-byte row segments only of tiles wholly inside the
rectangle, with S a multiple of 8.  Everything outside the rectangle is hidden by the visibility mask, with
selects.  The block summary is computed over the whole tensor, padding included: a poisoned padding
cell can only turn a HIDDEN or VISIBLE block into MIXED (more work, the same values bitwise: a block whose
every pair is hidden contributes exact zeros and leaves the softmax state unchanged).
"""

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from . import bias_stage

LOG2_E = math.log2(math.e)

FLAG_MASK = 1
FLAG_BIAS = 2
FLAG_BIAS32 = 4
FLAG_ALIBI = 8
FLAG_ALIBI_BOTTOM_RIGHT = 16  # the ALiBi distance uses the bottom-right offset k_len - q_len

MAP_ROWS = 32  # divides every kernel's query tile
MAP_COLS = 16  # divides every kernel's key tile (80 and 112 included)

HIDDEN = 0
MIXED = 1
VISIBLE = 2


class AuxView(NamedTuple):
    """The aux inputs of one (sequence, query head): 2-D views (rows, cols) and the call's flags."""
    mask: cute.Tensor  # (Tx, S)
    bias: cute.Tensor  # (Tx, S)
    bias32: cute.Tensor  # (Tx, S)
    tile_map: cute.Tensor  # (Mx, Nx)
    row_range: cute.Tensor  # (Mx, 2)
    col_range: cute.Tensor  # (Nx, 2)
    flags: cutlass.Int32
    width: cutlass.Int32  # S of the live mask / bias tensors (2^30 without either)
    slope: cutlass.Float32  # the head's ALiBi slope (0 without FLAG_ALIBI)


@cute.jit
def view(mMask: cute.Tensor, mBias: cute.Tensor, mBias32: cute.Tensor, mTileMap: cute.Tensor,
         mRowRange: cute.Tensor, mColRange: cute.Tensor, mSlopes: cute.Tensor, flags: cutlass.Int32,
         batch: cutlass.Int32, head: cutlass.Int32, num_heads: cutlass.Int32) -> AuxView:
    """The AuxView of query head `head` of sequence `batch`.  Each tensor broadcasts on its own (a placeholder
    is (1, 1, 1, 1)), so index each with its own sizes."""

    def bh(t):
        b = cutlass.min(batch, cute.size(t.shape[0]) - 1)
        # Per query head or shared: a select, no integer division (the dK/dV kernels build a view per step, and
        # a division per tensor there cost a chain of dependent uniform instructions between the GEMM issue and
        # the tile-class vote).
        h = cutlass.Int32(0)
        if cute.size(t.shape[1]) == num_heads:
            h = head
        return t[b, h, None, None]

    # Without a mask or bias tensor (ALiBi alone) nothing is read and no key is past the width: 2^30 lets such
    # tiles take the backward's interior path (tile_plain), where a placeholder's width of 1 kept them out.
    width = cutlass.Int32(1 << 30)
    if (flags & FLAG_BIAS32) != 0:
        width = cute.size(mBias32.shape[3])
    if (flags & FLAG_BIAS) != 0:
        width = cute.size(mBias.shape[3])
    if (flags & FLAG_MASK) != 0:
        width = cute.size(mMask.shape[3])
    # Read only with FLAG_ALIBI: the dK/dV kernels build a view per step, and an unconditional read put a
    # global load, and the wait for it, in every step of every call.
    slopes = bh(mSlopes)
    slope = cutlass.Float32(0.0)
    if (flags & FLAG_ALIBI) != 0:
        slope = slopes[0, 0]
    return AuxView(bh(mMask), bh(mBias), bh(mBias32), bh(mTileMap), bh(mRowRange), bh(mColRange), flags, width,
                   slope)


@cute.jit
def has_mask(v: AuxView) -> cutlass.Boolean:
    return (v.flags & FLAG_MASK) != 0


@cute.jit
def tile_class(v: AuxView, m_block: cutlass.Int32, n_block: cutlass.Int32, block_m: cutlass.Constexpr,
               block_n: cutlass.Constexpr) -> cutlass.Int32:
    """HIDDEN, MIXED or VISIBLE for the (block_m x block_n) tile (m_block, n_block); VISIBLE without a mask.

    Warp-collective (every lane of the calling warp must call it): lane x reads the x-th map entry of the
    tile (block_m / MAP_ROWS x block_n / MAP_COLS <= 32 entries for every kernel tile), two votes combine them.
    Rows and columns past the map's end are clamped to its last entry, which the tile already covers, so they
    change nothing (and a broadcast Tx = 1 reads its one row).  The two halves, `tile_class_entry` (the load)
    and `tile_class_vote`, may run apart, so that the load's latency hides under other work."""
    return tile_class_vote(v, tile_class_entry(v, m_block, n_block, block_m, block_n), block_m, block_n)


@cute.jit
def tile_class_entry(v: AuxView, m_block: cutlass.Int32, n_block: cutlass.Int32, block_m: cutlass.Constexpr,
                     block_n: cutlass.Constexpr) -> cutlass.Int32:
    """This lane's map entry for `tile_class` (MIXED where the lane reads none); no load without a mask."""
    rows = block_m // MAP_ROWS
    cols = block_n // MAP_COLS
    assert rows * cols <= 32 and rows * MAP_ROWS == block_m and cols * MAP_COLS == block_n
    e = cutlass.Int32(MIXED)
    if has_mask(v):
        lane = cute.arch.lane_idx()
        if lane < rows * cols:
            r = cutlass.min(m_block * rows + lane // cols, cute.size(v.tile_map.shape[0]) - 1)
            c = cutlass.min(n_block * cols + lane % cols, cute.size(v.tile_map.shape[1]) - 1)
            e = cutlass.Int32(v.tile_map[r, c])
    return e


@cute.jit
def tile_class_vote(v: AuxView, e: cutlass.Int32, block_m: cutlass.Constexpr,
                    block_n: cutlass.Constexpr) -> cutlass.Int32:
    """`tile_class` from each lane's `tile_class_entry` (warp-collective)."""
    n = (block_m // MAP_ROWS) * (block_n // MAP_COLS)
    cls = cutlass.Int32(VISIBLE)
    if has_mask(v):
        lane = cute.arch.lane_idx()
        all_visible = cute.arch.vote_all_sync(e == VISIBLE or lane >= n)
        all_hidden = cute.arch.vote_all_sync(e == HIDDEN or lane >= n)
        cls = cutlass.Int32(MIXED)
        if all_visible:
            cls = cutlass.Int32(VISIBLE)
        if all_hidden:
            cls = cutlass.Int32(HIDDEN)
    return cls


@cute.jit
def tile_plain(v: AuxView, cls: cutlass.Int32, k_end: cutlass.Int32) -> cutlass.Boolean:
    """Whether the aux inputs hide no pair of a tile: its class is VISIBLE and its keys end (k_end) within the
    tensors' width.  With bounds.tile_interior, the backward's interior path: the bias and the ALiBi term are
    finite there, added to the scores (`scores`, `mask_scores`) before P is formed without selects."""
    return cls == VISIBLE and k_end <= v.width


@cute.jit
def key_tiles(v: AuxView, m_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
              n_min: cutlass.Int32, n_max: cutlass.Int32):
    """[n_min, n_max) narrowed to the key tiles where the mask shows query tile m_block a visible cell (no mask:
    unchanged).  Empty: n_max == n_min."""
    lo_t = n_min
    hi_t = n_max
    if has_mask(v):
        last = cute.size(v.row_range.shape[0]) - 1
        lo = cute.size(v.tile_map.shape[1])
        hi = cutlass.Int32(0)
        for a in cutlass.range_constexpr(block_m // MAP_ROWS):
            r = cutlass.min(m_block * (block_m // MAP_ROWS) + a, last)
            lo = cutlass.min(lo, v.row_range[r, 0])
            hi = cutlass.max(hi, v.row_range[r, 1])
        lo_t = cutlass.max(n_min, lo * MAP_COLS // block_n)
        hi_t = cutlass.min(n_max, (hi * MAP_COLS + block_n - 1) // block_n)
        if hi_t < lo_t:
            hi_t = lo_t
    return lo_t, hi_t


@cute.jit
def query_tiles(v: AuxView, n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
                m_min: cutlass.Int32, m_max: cutlass.Int32):
    """[m_min, m_max) narrowed to the query tiles where the mask shows key tile n_block a visible cell (no mask:
    unchanged).  A mask broadcast over queries (Tx = 1) narrows nothing unless no query sees the key tile."""
    lo_t = m_min
    hi_t = m_max
    if has_mask(v):
        last = cute.size(v.col_range.shape[0]) - 1
        lo = cute.size(v.tile_map.shape[0])
        hi = cutlass.Int32(0)
        for a in cutlass.range_constexpr(block_n // MAP_COLS):
            c = cutlass.min(n_block * (block_n // MAP_COLS) + a, last)
            lo = cutlass.min(lo, v.col_range[c, 0])
            hi = cutlass.max(hi, v.col_range[c, 1])
        if cute.size(v.mask.shape[0]) == 1 and hi > lo:
            lo = cutlass.Int32(0)
            hi = (m_max * block_m + MAP_ROWS - 1) // MAP_ROWS
        lo_t = cutlass.max(m_min, lo * MAP_ROWS // block_m)
        hi_t = cutlass.min(m_max, (hi * MAP_ROWS + block_m - 1) // block_m)
        if hi_t < lo_t:
            hi_t = lo_t
    return lo_t, hi_t


@cute.jit
def _pair(c_mn: cute.Tensor, r, c, q0, k0, query_mode: cutlass.Constexpr):
    """(query, key) of element (r, c) of a score fragment."""
    i = q0 + c_mn[r, c][0]
    j = k0 + c_mn[r, c][1]
    if cutlass.const_expr(query_mode == 1):
        i = q0 + c_mn[r, c][1]
        j = k0 + c_mn[r, c][0]
    return i, j


@cute.jit
def _pairs_inside(c_mn: cute.Tensor, t: cute.Tensor, q0, k0, q_end, k_end) -> cutlass.Boolean:
    """Whether this thread's fragment (queries as rows) can load its bias or mask `t` as aligned pairs: every
    pair of it lies inside [0, q_end) x [0, k_end), its columns come as pairs of adjacent keys starting at an
    even key, and the rows are an even number of elements apart (S even), so each pair is one aligned load of
    two cells of the valid rectangle (4 bytes for a bf16 bias, 8 for float32, 2 for the mask)."""
    ok = cute.size(t.shape[1]) % 2 == 0
    i_hi = cutlass.Int32(0)
    for r in cutlass.range_constexpr(cute.size(c_mn, mode=[0])):
        i_hi = cutlass.max(i_hi, q0 + c_mn[r, 0][0])
    for c in cutlass.range_constexpr(cute.size(c_mn, mode=[1]) // 2):
        j = k0 + c_mn[0, 2 * c][1]
        j1 = k0 + c_mn[0, 2 * c + 1][1]
        ok = ok and j % 2 == 0 and j1 == j + 1 and j1 < k_end
    return ok and i_hi < q_end


@cute.jit
def _scale_add_bias(s_mn: cute.Tensor, c_mn: cute.Tensor, bias: cute.Tensor, q0, k0, q_last, k_last, q_len, k_len,
                    scale: cutlass.Float32, query_mode: cutlass.Constexpr):
    """Raw q.k -> q.k * scale + bias[i, j] in one rounding (FFMA) inside the valid rectangle, q.k * scale
    outside it.  Every load reads the clamped pair (min(i, q_last), min(j, k_last)), a cell of the rectangle,
    unconditionally, and a select keeps it only for the pair itself: no branch around the loads, so they issue
    back to back, and none reads padding.  With queries as rows, a fragment wholly inside the rectangle loads
    two adjacent keys per load (_pairs_inside): half the loads, and fewer L1 wavefronts per warp."""
    t_last = cute.size(bias.shape[0]) - 1
    paired = cutlass.Boolean(False)
    if cutlass.const_expr(query_mode == 0 and cute.size(s_mn, mode=[1]) % 2 == 0):
        paired = _pairs_inside(c_mn, bias, q0, k0, cutlass.min(q_len, t_last + 1), k_len)
    if paired:
        width = bias.element_type.width // 8
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1]) // 2):
                i, j = _pair(c_mn, r, 2 * c, q0, k0, query_mode)
                addr = (bias.iterator + cute.crd2idx((i, j), bias.layout)).toint()
                two = cute.make_tensor(cute.make_ptr(bias.element_type, addr, cute.AddressSpace.gmem,
                                                     assumed_align=2 * width), cute.make_layout(2)).load()
                s_mn[r, 2 * c] = cute.math.fma(s_mn[r, 2 * c], scale, two[0].to(cutlass.Float32))
                s_mn[r, 2 * c + 1] = cute.math.fma(s_mn[r, 2 * c + 1], scale, two[1].to(cutlass.Float32))
    else:
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                i, j = _pair(c_mn, r, c, q0, k0, query_mode)
                b = bias[cutlass.min(cutlass.min(i, q_last), t_last), cutlass.min(j, k_last)].to(cutlass.Float32)
                x = s_mn[r, c]
                s = x * scale
                if i < q_len and j < k_len:
                    s = cute.math.fma(x, scale, b)
                s_mn[r, c] = s


@cute.jit
def stage_bias(stage: bias_stage.BiasStage, v: AuxView, q0: cutlass.Int32, k0: cutlass.Int32,
               q_len: cutlass.Int32, k_len: cutlass.Int32, wg_tidx: cutlass.Int32):
    """The copies of the warpgroup's part of the bias tile at (q0, k0) (its first query and key) into buffer
    stage.parity, where the bias is of the input dtype and `bias_stage.fits`; commits one copy group either way.
    `scores(..., staged=stage)` adds them a step later."""
    k_lim = cutlass.min(k_len, v.width)
    if (v.flags & FLAG_BIAS) != 0:
        if bias_stage.fits(stage, v.bias, q0, k0, q_len, k_lim):
            bias_stage.copy(stage, v.bias, q0, k0, wg_tidx)
    cute.arch.cp_async_commit_group()


@cute.jit
def key_tile_scores(s_mn: cute.Tensor, c_mn: cute.Tensor, v: AuxView, q0: cutlass.Int32, n_block: cutlass.Int32,
                    block_n: cutlass.Constexpr, q_len: cutlass.Int32, k_len: cutlass.Int32, scale: cutlass.Float32,
                    cls: cutlass.Int32, map_group: cutlass.Constexpr, stage=None, n_min: cutlass.Int32 = None,
                    wg_tidx: cutlass.Int32 = None):
    """`scores` (queries as rows) of key tile n_block of a kernel that walks its key tiles downwards (the Hopper
    forward and dQ kernels).  With `stage` (the warpgroup's bias_stage.BiasStage), the bias comes from buffer
    n_block % 2, which `stage_bias` filled a tile earlier, and once it is read the copies of key tile
    n_block - 1 go into the other buffer, if that tile is at least n_min."""
    staged = None
    if cutlass.const_expr(stage is not None):
        staged = stage._replace(parity=n_block % 2)
    scores(s_mn, c_mn, v, q0, n_block * block_n, q_len, k_len, scale, cls, 0, staged=staged, map_group=map_group)
    if cutlass.const_expr(stage is not None):
        if n_block > n_min:
            stage_bias(stage._replace(parity=(n_block - 1) % 2), v, q0, (n_block - 1) * block_n, q_len, k_len,
                       wg_tidx)


@cute.jit
def alibi_offset(v: AuxView, q_len: cutlass.Int32, k_len: cutlass.Int32) -> cutlass.Int32:
    """The ALiBi distance's query offset: k_len - q_len with FLAG_ALIBI_BOTTOM_RIGHT (the causal mask's
    alignment), else 0."""
    off = cutlass.Int32(0)
    if (v.flags & FLAG_ALIBI_BOTTOM_RIGHT) != 0:
        off = k_len - q_len
    return off


@cute.jit
def _add_alibi(s_mn: cute.Tensor, c_mn: cute.Tensor, slope: cutlass.Float32, off: cutlass.Int32, q0, k0,
               query_mode: cutlass.Constexpr):
    """s -= slope * |i + off - j| (ALiBi), from the indices: nothing is loaded.

    A fragment's row index depends on its row only and its column index on its column only, and its columns
    sit at fixed offsets from its first one.  So `i + off - j` is one float per row (the distance to the
    fragment's first column, converted once per row) plus or minus a compile-time constant per column
    (`c_mn[0, c] - c_mn[0, 0]` folds): each score costs an FADD with an immediate and an FFMA with |.|, and no
    conversion (an integer-to-float conversion per column and tile ran at the quarter rate of the exp2's unit
    and cost more than the arithmetic).  Exact below 2**24.  Pairs outside the valid rectangle get the term
    too; the caller's visibility mask hides them (the term is finite)."""
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    # query_mode 0: rows are queries, i + off - j = base_r - d_c with base_r = (q0 + i_r + off) - (k0 + j_0),
    # d_c = j_c - j_0.  query_mode 1: rows are keys, i + off - j = base_r + d_c with base_r = (q0 + i_0 + off) -
    # (k0 + j_r), d_c = i_c - i_0.
    first = c_mn[0, 0][1]
    base = []
    for r in cutlass.range_constexpr(rows):
        if cutlass.const_expr(query_mode == 0):
            base.append(cutlass.Float32(q0 + c_mn[r, 0][0] + off - k0 - first))
        else:
            base.append(cutlass.Float32(q0 + first + off - k0 - c_mn[r, 0][0]))
    for c in cutlass.range_constexpr(cols):
        d = cutlass.Float32(c_mn[0, c][1] - first)
        for r in cutlass.range_constexpr(rows):
            x = base[r] - d
            if cutlass.const_expr(query_mode == 1):
                x = base[r] + d
            s_mn[r, c] = s_mn[r, c] - slope * cute.math.absf(x)


class AlibiFold(NamedTuple):
    """Where a mask-kind kernel takes the query-dependent part of the ALiBi term (`mask_scores(..., fold=)`):
    `terms[x] += k * part` for each query coordinate x of the fragment (rows with queries as rows, columns
    with queries as columns).  The forward passes zeroed row offsets and k = 1 (the softmax adds them to the
    row's max and its exp2 subtrahend), the backward kernels their lse2 and k = -score_mul."""
    terms: cute.Tensor
    k: cutlass.Float32


@cute.jit
def _add_alibi_folded(s_mn: cute.Tensor, c_mn: cute.Tensor, slope: cutlass.Float32, off: cutlass.Int32, q0, k0,
                      q_span: cutlass.Constexpr, k_span: cutlass.Constexpr, query_mode: cutlass.Constexpr,
                      fold: AlibiFold):
    """`_add_alibi` with one FFMA or FADD per score on a tile that lies wholly on one side of every row's
    position ([q0, q0 + q_span) x [k0, k0 + k_span), the test uniform over the tile): there |i + off - j| is
    +-(i + off - j), a query part plus a key part.  The key part joins the scores in place and the query part
    goes to `fold`, which the caller applies once per query (the softmax's max and subtrahend, or lse2): the
    probabilities come out as those of the full term, up to the rounding of where the sum is formed.  A tile
    that the diagonal crosses takes `_add_alibi`.

    With queries as rows (query_mode 0) the key part is +-slope * d_c, a compile-time multiple of the slope per
    column (an FFMA with an immediate per score), the query part -+slope * base_r per row.  With queries as
    columns (1) the key part is -+slope * base_r, one register per row (an FADD per score), the query part
    -+slope * d_c per column.  The parts are large only where the distance is, and the probability then
    small: the rounding of a part of size D raw units moves P by about 2**-24 D scale P, at most ~1e-8 of
    the row's largest probability.  Pairs outside the valid rectangle get the term too; the visibility mask
    hides them."""
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    left = q0 + off - (k0 + k_span - 1) >= 0  # every i + off - j >= 0
    right = q0 + q_span - 1 + off - k0 <= 0  # every i + off - j <= 0
    if left or right:
        sign = cutlass.Float32(1.0)
        if right:
            sign = cutlass.Float32(-1.0)
        first = c_mn[0, 0][1]
        # x = i + off - j = sign * |x|; the term -slope * |x| = -sign * slope * x.
        a = -sign * slope
        if cutlass.const_expr(query_mode == 0):
            # x = base_r - d_c: the term is a * base_r - a * d_c.
            ak = a * fold.k
            for r in cutlass.range_constexpr(rows):
                base = cutlass.Float32(q0 + c_mn[r, 0][0] + off - k0 - first)
                fold.terms[r] = cute.math.fma(ak, base, fold.terms[r])
            for c in cutlass.range_constexpr(cols):
                d = cutlass.Float32(c_mn[0, c][1] - first)
                for r in cutlass.range_constexpr(rows):
                    s_mn[r, c] = cute.math.fma(-a, d, s_mn[r, c])
        else:
            # x = base_r + d_c: the term is a * base_r + a * d_c.
            ak = a * fold.k
            for c in cutlass.range_constexpr(cols):
                d = cutlass.Float32(c_mn[0, c][1] - first)
                fold.terms[c] = cute.math.fma(ak, d, fold.terms[c])
            for r in cutlass.range_constexpr(rows):
                t = a * cutlass.Float32(q0 + first + off - k0 - c_mn[r, 0][0])
                for c in cutlass.range_constexpr(cols):
                    s_mn[r, c] = s_mn[r, c] + t
    else:
        _add_alibi(s_mn, c_mn, slope, off, q0, k0, query_mode)


@cute.jit
def load_bias(out_mn: cute.Tensor, c_mn: cute.Tensor, v: AuxView, q0: cutlass.Int32, k0: cutlass.Int32):
    """out_mn[r, c] = the bias (float32) at this thread's fragment cell (query q0 + row, key k0 + col), clamped
    into the tensor (rows to Tx - 1, columns to its S - 1), so no load leaves the allocation whatever the tile;
    0 without a bias tensor.  For a kernel whose tile meets one bias slice for many (sequence, head) pairs (the
    bias gradient kernels): loaded once, then `scores(..., bias_mn=out_mn)` adds it per pair inside that pair's
    valid rectangle, so the clamped cells of the padding are never used."""
    out_mn.fill(0.0)
    if (v.flags & FLAG_BIAS32) != 0:
        _load_clamped(out_mn, c_mn, v.bias32, q0, k0)
    if (v.flags & FLAG_BIAS) != 0:
        _load_clamped(out_mn, c_mn, v.bias, q0, k0)


@cute.jit
def _load_clamped(out_mn: cute.Tensor, c_mn: cute.Tensor, t: cute.Tensor, q0, k0):
    """Two adjacent keys per load where the thread's fragment lies inside the tensor as aligned pairs
    (_pairs_inside), else one clamped cell per load: the same values either way."""
    t_last = cute.size(t.shape[0]) - 1
    k_last = cute.size(t.shape[1]) - 1
    paired = cutlass.Boolean(False)
    if cutlass.const_expr(cute.size(out_mn, mode=[1]) % 2 == 0):
        paired = _pairs_inside(c_mn, t, q0, k0, t_last + 1, k_last + 1)
    if paired:
        width = t.element_type.width // 8
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(out_mn, mode=[1]) // 2):
                i, j = _pair(c_mn, r, 2 * c, q0, k0, 0)
                addr = (t.iterator + cute.crd2idx((i, j), t.layout)).toint()
                two = cute.make_tensor(cute.make_ptr(t.element_type, addr, cute.AddressSpace.gmem,
                                                     assumed_align=2 * width), cute.make_layout(2)).load()
                out_mn[r, 2 * c] = two[0].to(cutlass.Float32)
                out_mn[r, 2 * c + 1] = two[1].to(cutlass.Float32)
    else:
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(out_mn, mode=[1])):
                i = cutlass.min(q0 + c_mn[r, c][0], t_last)
                j = cutlass.min(k0 + c_mn[r, c][1], k_last)
                out_mn[r, c] = t[i, j].to(cutlass.Float32)


@cute.jit
def _apply_mask(s_mn: cute.Tensor, c_mn: cute.Tensor, v: AuxView, q0, k0, q_len, k_len,
                query_mode: cutlass.Constexpr, group: cutlass.Constexpr):
    """s = -inf where the mask hides a pair of the valid rectangle [0, q_len) x [0, k_len) (k_len within the
    tensor's width): loads as in _scale_add_bias, pairs included.

    `group` > 0: the fragment's columns come in runs of `group` that each lie in one map block, with both of its
    rows (the Hopper accumulator's layout, sm90/common.map_group), and coordinates that grow along rows and
    columns.  Each run inside the rectangle then reads its block's summary entry first: VISIBLE costs nothing
    more, HIDDEN is a fill of -inf, and only MIXED reads the mask's cells.  A diagonal or boundary tile is
    MIXED as a whole, but few of its blocks are (on a causal diagonal, those the diagonal crosses).  Whether a
    run lies in one block is checked from its first and last element, so another layout only costs the cell
    loads.  `group` 0: the whole fragment reads its cells."""
    mask = v.mask
    q_last = q_len - 1
    k_last = k_len - 1
    t_last = cute.size(mask.shape[0]) - 1
    m_last = cute.size(v.tile_map.shape[0]) - 1
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    run = cols
    if cutlass.const_expr(group > 0):
        run = group
    assert cols % run == 0 and (run % 2 == 0 or run == cols)
    paired = cutlass.Boolean(False)
    if cutlass.const_expr(query_mode == 0 and cols % 2 == 0):
        paired = _pairs_inside(c_mn, mask, q0, k0, cutlass.min(q_len, t_last + 1), k_len)
    for g in cutlass.range_constexpr(cols // run):
        c_lo = g * run
        e = cutlass.Int32(MIXED)
        if cutlass.const_expr(group > 0):
            i0, j0 = _pair(c_mn, 0, c_lo, q0, k0, query_mode)
            i1, j1 = _pair(c_mn, rows - 1, c_lo + run - 1, q0, k0, query_mode)
            if (i0 // MAP_ROWS == i1 // MAP_ROWS and j0 // MAP_COLS == j1 // MAP_COLS and i1 < q_len
                    and j1 < k_len):
                e = cutlass.Int32(v.tile_map[cutlass.min(i0 // MAP_ROWS, m_last), j0 // MAP_COLS])
        if e == HIDDEN:
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(c_lo, c_lo + run):
                    s_mn[r, c] = -cutlass.Float32.inf
        elif e != VISIBLE:
            if paired:
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(c_lo // 2, (c_lo + run) // 2):
                        i, j = _pair(c_mn, r, 2 * c, q0, k0, query_mode)
                        addr = (mask.iterator + cute.crd2idx((i, j), mask.layout)).toint()
                        two = cute.make_tensor(cute.make_ptr(mask.element_type, addr, cute.AddressSpace.gmem,
                                                             assumed_align=2), cute.make_layout(2)).load()
                        s0 = s_mn[r, 2 * c]
                        s1 = s_mn[r, 2 * c + 1]
                        if two[0] == 0:
                            s0 = -cutlass.Float32.inf
                        if two[1] == 0:
                            s1 = -cutlass.Float32.inf
                        s_mn[r, 2 * c] = s0
                        s_mn[r, 2 * c + 1] = s1
            else:
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(c_lo, c_lo + run):
                        i, j = _pair(c_mn, r, c, q0, k0, query_mode)
                        hidden = mask[cutlass.min(cutlass.min(i, q_last), t_last), cutlass.min(j, k_last)] == 0
                        s = s_mn[r, c]
                        if hidden and i < q_len and j < k_len:
                            s = -cutlass.Float32.inf
                        s_mn[r, c] = s


@cute.jit
def scores(s_mn: cute.Tensor, c_mn: cute.Tensor, v: AuxView, q0: cutlass.Int32, k0: cutlass.Int32,
           q_len: cutlass.Int32, k_len: cutlass.Int32, scale: cutlass.Float32, cls: cutlass.Int32,
           query_mode: cutlass.Constexpr, bias_mn=None, staged=None, map_group: cutlass.Constexpr = 0):
    """In place: raw scores q.k -> natural-unit scores q.k * scale + bias (+ the ALiBi term), -inf where the mask
    hides the pair.

    `c_mn` holds the tile-local coordinates matching `s_mn`; `query_mode` 0: queries are rows (query q0 + row,
    key k0 + col), 1: queries are columns.  Only cells inside the valid rectangle are read; pairs outside it
    keep q.k * scale, and the caller's visibility mask (after this) hides them.  `cls` is the tile's
    tile_class: VISIBLE skips the mask loads, HIDDEN and MIXED take them.  `bias_mn` (queries as
    rows): the tile's bias already in registers (load_bias), added inside the valid rectangle as the loads
    would add it, bitwise.  `staged` (a bias_stage.BiasStage, its parity this tile's): the calling warpgroup's
    staged bias, which `stage_bias` filled for this tile where it fits; its cells are added as the loads would
    add them, bitwise.  Every thread of the warpgroup must call it then (it waits at the warpgroup's
    barrier).  `map_group`: a MIXED or HIDDEN tile reads the mask block by block (_apply_mask)."""
    # A VISIBLE tile without a bias (most tiles of a causal or padding mask) costs one multiplication per
    # score.  A HIDDEN tile (one inside a row's range of tiles) takes the mask loads of a MIXED one, which hide
    # every pair of it: a fill of -inf in a branch of its own made ptxas materialize the -inf fragment and a
    # copy of the scores on every tile (see mask_scores).  The key bound includes the tensor's width: the FFI
    # handler checks shapes against the call, not the lengths in device memory, so this keeps every load
    # inside the allocation whatever they hold.
    k_lim = cutlass.min(k_len, v.width)
    if cutlass.const_expr(staged is not None):
        # The warpgroup copied this tile's bias a key tile ahead (stage_bias) where it fits; each thread waits
        # for its copies, the barrier for everyone's.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier(barrier_id=staged.barrier, number_of_threads=128)
    # Each score is q.k * scale + bias in one rounding (an FFMA) inside the valid rectangle, q.k * scale outside
    # it, whichever way the bias arrives (staged, registers, paired or single loads): every kernel, forward
    # and backward, then forms the same score bitwise, which the backward's P = exp(s - m - ln l) needs under
    # huge finite biases.  A bias is of the input dtype (FLAG_BIAS) or float32 (FLAG_BIAS32), never both.
    if (v.flags & (FLAG_BIAS | FLAG_BIAS32)) != 0 and q_len > 0 and k_lim > 0:
        if cutlass.const_expr(bias_mn is not None):
            rows = cute.size(s_mn, mode=[0])
            cols = cute.size(s_mn, mode=[1])
            # This thread's last row and column.
            i_hi = q0 + c_mn[0, 0][0]
            j_hi = k0 + c_mn[0, 0][1]
            for r in cutlass.range_constexpr(rows):
                i_hi = cutlass.max(i_hi, q0 + c_mn[r, 0][0])
            for c in cutlass.range_constexpr(cols):
                j_hi = cutlass.max(j_hi, k0 + c_mn[0, c][1])
            if i_hi < q_len and j_hi < k_lim:
                # This thread's cells all lie inside the rectangle.
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(cols):
                        s_mn[r, c] = cute.math.fma(s_mn[r, c], scale, bias_mn[r, c])
            else:
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(cols):
                        x = s_mn[r, c]
                        t = x * scale
                        if q0 + c_mn[r, c][0] < q_len and k0 + c_mn[r, c][1] < k_lim:
                            t = cute.math.fma(x, scale, bias_mn[r, c])
                        s_mn[r, c] = t
        else:
            if (v.flags & FLAG_BIAS32) != 0:
                _scale_add_bias(s_mn, c_mn, v.bias32, q0, k0, q_len - 1, k_lim - 1, q_len, k_lim, scale,
                                query_mode)
            else:
                if cutlass.const_expr(staged is not None):
                    if bias_stage.fits(staged, v.bias, q0, k0, q_len, k_lim):
                        bias_stage.add(s_mn, c_mn, staged, scale, query_mode)
                    else:
                        _scale_add_bias(s_mn, c_mn, v.bias, q0, k0, q_len - 1, k_lim - 1, q_len, k_lim, scale,
                                        query_mode)
                else:
                    _scale_add_bias(s_mn, c_mn, v.bias, q0, k0, q_len - 1, k_lim - 1, q_len, k_lim, scale,
                                    query_mode)
    else:
        s_mn.store(s_mn.load() * scale)
    if (v.flags & FLAG_ALIBI) != 0:
        _add_alibi(s_mn, c_mn, v.slope, alibi_offset(v, q_len, k_len), q0, k0, query_mode)
    if q_len > 0 and k_lim > 0:
        if cls != VISIBLE:
            _apply_mask(s_mn, c_mn, v, q0, k0, q_len, k_lim, query_mode, map_group)


@cute.jit
def mask_scores(s_mn: cute.Tensor, c_mn: cute.Tensor, v: AuxView, q0: cutlass.Int32, k0: cutlass.Int32,
                q_len: cutlass.Int32, k_len: cutlass.Int32, cls: cutlass.Int32, query_mode: cutlass.Constexpr,
                map_group: cutlass.Constexpr = 0, fold: AlibiFold = None, spans=None):
    """The mask kind's `scores`: raw scores q.k stay raw (the plain kernels' exp2-domain softmax and row
    statistics apply unchanged), -inf where the mask hides a pair of the valid rectangle; a VISIBLE tile
    costs nothing.  A HIDDEN tile (inside a row's range of tiles) takes the mask loads of a MIXED one, which
    hide all of it: filling it with -inf in a branch of its own made ptxas materialize the -inf fragment and
    copy the scores on every tile, VISIBLE ones included (an H200 ran the forward 1.3-1.45x slower than the
    plain kernel with an all-visible mask).  With ALiBi the raw scores gain -slope * |i + off - j| with the slope
    in raw units (the view's slope is the call's slope divided by the softmax scale): a subtraction and an
    FFMA per score; with `fold` (an AlibiFold) and `spans` (the tile's (queries, keys)), one per score on the
    tiles that lie on one side of the diagonal (`_add_alibi_folded`), the query part left in `fold`.
    `map_group`: as in `scores`."""
    k_lim = cutlass.min(k_len, v.width)
    if (v.flags & FLAG_ALIBI) != 0:
        if cutlass.const_expr(fold is None):
            _add_alibi(s_mn, c_mn, v.slope, alibi_offset(v, q_len, k_len), q0, k0, query_mode)
        else:
            _add_alibi_folded(s_mn, c_mn, v.slope, alibi_offset(v, q_len, k_len), q0, k0, spans[0], spans[1],
                              query_mode, fold)
    if q_len > 0 and k_lim > 0:
        if cls != VISIBLE:
            _apply_mask(s_mn, c_mn, v, q0, k0, q_len, k_lim, query_mode, map_group)


@cute.jit
def prefetch_bias_l2(view, m_block: cutlass.Int32, n_block: cutlass.Int32, block_m: cutlass.Constexpr,
                     block_n: cutlass.Constexpr, q_len: cutlass.Int32, k_len: cutlass.Int32):
    """L2 prefetch of the bias of the (block_m queries x block_n keys) tile (m_block, n_block), by a Hopper
    kernel's producer warp as it issues that step's TMA loads (a stage or two before the consumers read the
    bias element by element, so their loads hit L2).  Each lane takes every 32nd query row of the tile and
    prefetches the 128-byte lines of its row's keys.  Only cells of the valid rectangle are addressed (rows and
    columns clamped to it, as the loads are); a prefetch brings a line into L2 and loads no value, so it changes
    no result."""
    k_lim = cutlass.min(k_len, view.width)
    if q_len > 0 and k_lim > 0:
        if (view.flags & FLAG_BIAS32) != 0:
            _prefetch_rows(view.bias32, m_block * block_m, n_block * block_n, block_m, block_n, 32, q_len - 1,
                           k_lim - 1)
        if (view.flags & FLAG_BIAS) != 0:
            _prefetch_rows(view.bias, m_block * block_m, n_block * block_n, block_m, block_n,
                           128 // (view.bias.element_type.width // 8), q_len - 1, k_lim - 1)


@cute.jit
def _prefetch_rows(bias: cute.Tensor, m0: cutlass.Int32, n0: cutlass.Int32, block_m: cutlass.Constexpr,
                   block_n: cutlass.Constexpr, per_line: cutlass.Constexpr, q_last: cutlass.Int32,
                   k_last: cutlass.Int32):
    lane = cute.arch.lane_idx()
    t_last = cute.size(bias.shape[0]) - 1
    for r in cutlass.range_constexpr(block_m // 32):
        i = cutlass.min(cutlass.min(m0 + r * 32 + lane, q_last), t_last)
        for c in cutlass.range_constexpr((block_n + per_line - 1) // per_line):
            j = cutlass.min(n0 + c * per_line, k_last)
            ptr = bias.iterator + cute.crd2idx((i, j), bias.layout)
            cute.arch.prefetch(ptr.llvm_ptr, cache_level="L2")
