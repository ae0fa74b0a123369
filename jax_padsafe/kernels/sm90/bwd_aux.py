"""The Hopper backward's aux variants (`BwdDKDVSm90(aux=...)`, `BwdDQSm90(aux=...)`): masks and biases as tensors.

Everything here is used only where the kernel's `aux` is set (every use is behind `cutlass.const_expr`), so the
plain kernels' code does not change.  What the variants do differently (common/aux_scores.py has the tensors'
layout, broadcasting and pad-safety rules):
  * both kinds: the tile range is narrowed by the mask's block summary: the dK/dV kernel's query tiles of a key
    tile, per query head of its kv group (`dkdv_range`, walked by `dkdv_first` / `dkdv_next`), the dQ kernel's
    key tiles of a query tile (`dq_range`).  The producer and the consumers call the same functions on the same
    inputs, so both walk the same tiles in the same order;
  * "bias": S becomes natural-unit scores q.k * scale + bias, -inf where the mask hides the pair
    (aux_scores.scores), and P is recomputed from the forward's separate row max m and ln l
    (bwd_scores.probs_exact, `stat_load` / `stat_finish` here), so a huge finite bias gives the same P as a
    small one;
  * "mask": S stays raw, -inf where the mask hides the pair (aux_scores.mask_scores), and P comes from lse as in
    the plain kernel (a hidden pair's exp2(-inf) is 0); the forward's m and ln l are not read.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from ..common import aux_scores, bwd_scores


class BwdAux(NamedTuple):
    """The aux inputs of one backward call, handed to the kernel as one argument (the ABI's order).  `ranges` is
    the dK/dV kernel's mColRange or the dQ kernel's mRowRange: each kernel narrows along one side only.  The
    mask kind reads neither row_max nor log_sum; its kernels get mLSE in both slots (`make`)."""
    mask: cute.Tensor
    bias: cute.Tensor
    bias32: cute.Tensor
    tile_map: cute.Tensor
    ranges: cute.Tensor
    row_max: cute.Tensor
    log_sum: cute.Tensor
    slopes: cute.Tensor
    flags: cutlass.Int32


def make(kind, mMask, mBias, mBias32, mTileMap, mRanges, mRowMax, mLogSum, mSlopes, mLSE, flags) -> BwdAux:
    """The BwdAux of an aux __call__.  The mask kind takes mRowMax / mLogSum (the ABI is the same for both kinds)
    but reads neither: mLSE takes their slots, so its kernels have no argument they do not use, and `view`'s
    head count (row_max's rows) is lse's, whatever the caller passes for the unused tensors."""
    if kind == "mask":
        mRowMax = mLSE
        mLogSum = mLSE
    return BwdAux(mMask, mBias, mBias32, mTileMap, mRanges, mRowMax, mLogSum, mSlopes, flags)


@cute.jit
def view(aux: BwdAux, batch: cutlass.Int32, head: cutlass.Int32):
    """The AuxView of (sequence `batch`, query head `head`).  The kernel has one of the two range tensors; it
    fills both slots (query_tiles reads only col_range, key_tiles only row_range, and each kernel calls one).
    The query heads are row_max's rows (N, like lse)."""
    return aux_scores.view(aux.mask, aux.bias, aux.bias32, aux.tile_map, aux.ranges, aux.ranges, aux.slopes,
                           aux.flags, batch, head, cute.size(aux.row_max.shape[0]))


# ---------------------------------------------------------------- the dK/dV kernel: query tiles per query head

@cute.jit
def dkdv_range(aux: BwdAux, batch: cutlass.Int32, head: cutlass.Int32, n_block: cutlass.Int32,
               block_m: cutlass.Constexpr, block_n: cutlass.Constexpr, m_min: cutlass.Int32, m_max: cutlass.Int32):
    """The query tiles of key tile n_block that query head `head` visits: the visibility range [m_min, m_max)
    narrowed by that head's mask (aux_scores.query_tiles)."""
    return aux_scores.query_tiles(view(aux, batch, head), n_block, block_m, block_n, m_min, m_max)


@cute.jit
def dkdv_steps(aux: BwdAux, batch: cutlass.Int32, head_kv: cutlass.Int32, group: cutlass.Int32,
               n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
               m_min: cutlass.Int32, m_max: cutlass.Int32):
    """Steps of one key tile: the narrowed ranges' lengths summed over the query heads of kv head head_kv.
    0 means nothing to compute (the tile writes zeros, as an empty tile does without aux)."""
    total = cutlass.Int32(0)
    for g in cutlass.range(group, unroll=1):
        lo, hi = dkdv_range(aux, batch, head_kv * group + g, n_block, block_m, block_n, m_min, m_max)
        total = total + (hi - lo)
    return total


@cute.jit
def _dkdv_skip(aux: BwdAux, batch: cutlass.Int32, head_kv: cutlass.Int32, group: cutlass.Int32,
               n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
               m_min: cutlass.Int32, m_max: cutlass.Int32, head: cutlass.Int32, m_block: cutlass.Int32,
               m_hi: cutlass.Int32):
    """From (head, m_block) with m_block possibly at its head's end m_hi: on to the next query head of the group
    whose narrowed range is not empty.  Never reads a head past the group: after the last step the cursor stays
    at (last head, its end), and nobody loads that step."""
    head_end = (head_kv + 1) * group
    while m_block >= m_hi and head + 1 < head_end:
        head = head + 1
        m_block, m_hi = dkdv_range(aux, batch, head, n_block, block_m, block_n, m_min, m_max)
    return head, m_block, m_hi


@cute.jit
def dkdv_first(aux: BwdAux, batch: cutlass.Int32, head_kv: cutlass.Int32, group: cutlass.Int32,
               n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
               m_min: cutlass.Int32, m_max: cutlass.Int32):
    """The first step (query head, query tile, that head's range end) of a key tile with dkdv_steps > 0."""
    head = head_kv * group
    m_block, m_hi = dkdv_range(aux, batch, head, n_block, block_m, block_n, m_min, m_max)
    return _dkdv_skip(aux, batch, head_kv, group, n_block, block_m, block_n, m_min, m_max, head, m_block, m_hi)


@cute.jit
def dkdv_next(aux: BwdAux, batch: cutlass.Int32, head_kv: cutlass.Int32, group: cutlass.Int32,
              n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
              m_min: cutlass.Int32, m_max: cutlass.Int32, head: cutlass.Int32, m_block: cutlass.Int32,
              m_hi: cutlass.Int32):
    """The step after (head, m_block): the next query tile of the head, else the first of the next head with
    a non-empty range (the order dkdv_steps counts)."""
    return _dkdv_skip(aux, batch, head_kv, group, n_block, block_m, block_n, m_min, m_max, head, m_block + 1, m_hi)


@cute.jit
def stat_load(aux: BwdAux, mDelta: cute.Tensor, head: cutlass.Int32, q_start: cutlass.Int32,
              q_len: cutlass.Int32, i: cutlass.Int32, kind: cutlass.Int32):
    """The bias kind's dK/dV row statistics (the kernel's `stat_load`), from the forward's m and ln l: kind 0 loads
    (ln l, m) of query i, kind 1 (Delta, 0).  Padded queries (i >= q_len) load nothing: ln l = +inf, m = 0,
    Delta = 0, as bwd_scores.load_row_stats_exact gives them."""
    v = cutlass.Float32(0.0)
    w = cutlass.Float32(0.0)
    if kind == 0:
        v = cutlass.Float32.inf
    if i < q_len:
        if kind == 0:
            v = aux.log_sum[head, q_start + i]
            w = aux.row_max[head, q_start + i]
        else:
            v = mDelta[head, q_start + i]
    return v, w


@cute.jit
def stat_finish(v: cutlass.Float32, w: cutlass.Float32, kind: cutlass.Int32):
    """kind 0: (ln l * log2(e), m) as bwd_scores.load_row_stats_exact forms them (+inf and 0 for padded queries
    and rows without a visible key, whose P then is 0 by select); kind 1: (Delta, 0).  Delta stays as loaded
    for an empty row: it reaches dS only where P != 0, and dscores selects 0 where P = 0."""
    a = v
    b = w
    if kind == 0:
        a = cutlass.Float32.inf
        b = cutlass.Float32(0.0)
        if v != cutlass.Float32.inf:
            a = v * bwd_scores.LOG2_E
            b = w
    return a, b


# ---------------------------------------------------------------- the dQ kernel: key tiles of a query tile

@cute.jit
def dq_range(aux: BwdAux, tb, batch: cutlass.Int32, head: cutlass.Int32, m_block: cutlass.Int32,
             block_m: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """`tb` (bounds.TileBounds of query tile m_block) with its key tiles [lo, hi) narrowed by the mask of query
    head `head` (aux_scores.key_tiles)."""
    lo, hi = aux_scores.key_tiles(view(aux, batch, head), m_block, block_m, block_n, tb.lo, tb.hi)
    return tb._replace(lo=lo, hi=hi)
