"""The Hopper forward's aux variants (`FlashFwdSm90(aux="mask" | "bias")`): masks and biases given as tensors.

The pieces here are used only where `FlashFwdSm90.aux` is set (every use is behind `cutlass.const_expr`), so
the plain kernel's code does not change.  Both kinds take the same entry (`call_aux`) and tensors.  What they
do differently from the plain kernel (common/aux_scores.py has the tensors' layout, broadcasting and
pad-safety rules):
  * both kinds: the key-tile range of a query tile is narrowed to the key tiles where the mask's block summary
    shows the tile a visible cell (`key_range`), inside the tile info that the producer and the consumers both
    decode, so both walk the same tiles; the epilogue writes the row max and ln(row sum) in natural units
    (mRowMax, mLogSum) besides lse, for the valid rows;
  * "bias": the consumers turn q.k into natural-unit scores q.k * scale + bias, -inf where the mask hides the
    pair (`tile_scores`), before the visibility mask; the softmax then runs in natural units (mul = log2 e,
    exact differences), and the row statistics let the backward recompute P exactly;
  * "mask" (no bias tensor: a mask and / or ALiBi): the scores stay raw q.k, with the ALiBi term in raw units
    and -inf where the mask hides the pair (`tile_mask_scores`), and the softmax is the plain kernel's
    (mul = score_mul = scale * log2 e): a tile the mask shows whole costs nothing more than its class.
Each key tile's class (aux_scores.tile_class) is loaded right after its S GEMM is issued (`tile_class_entry`) and
voted on after the wait for S (`tile_class_vote`).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from ..common import aux_scores
from . import common as sc


class FwdAux(NamedTuple):
    """The aux inputs and extra outputs of one call, handed to the kernel as one argument.  Layouts are the
    aux ABI's: mask / bias / bias32 / tile_map / row_range 4-D (broadcast batch, broadcast head, rows, cols);
    row_max and log_sum [N, total_q] float32 like lse; slopes (ALiBi) [Bx, N, 1, 1] float32."""
    mask: cute.Tensor
    bias: cute.Tensor
    bias32: cute.Tensor
    tile_map: cute.Tensor
    row_range: cute.Tensor
    row_max: cute.Tensor
    log_sum: cute.Tensor
    slopes: cute.Tensor
    flags: cutlass.Int32


class FwdAuxEntry:
    """Mixin of `FlashFwdSm90`: the aux variants' entry point (FlashFwdSm90 binds it as the instance's
    `__call__` when aux is set, either kind)."""

    @cute.jit
    def call_aux(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mTileCounter: cute.Tensor,
        mMask: cute.Tensor,
        mBias: cute.Tensor,
        mBias32: cute.Tensor,
        mTileMap: cute.Tensor,
        mRowRange: cute.Tensor,
        mRowMax: cute.Tensor,
        mLogSum: cute.Tensor,
        mSlopes: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        aux_flags: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """The aux variants' entry (the aux ABI's order).  score_mul: the softmax scale ("bias", natural units)
        or the plain kernel's scale * log2 e ("mask", raw scores); cap_mul is unused (no softcap)."""
        aux_in = FwdAux(mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum, mSlopes, aux_flags)
        self.launch(mQ, mK, mV, mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, score_mul, cap_mul,
                    window_left, window_right, bottom_right, max_seqlen_q, stream, aux_in)


@cute.jit
def tile_view(aux: FwdAux, batch: cutlass.Int32, head: cutlass.Int32, num_heads: cutlass.Int32):
    """The AuxView of (sequence `batch`, query head `head`).  The forward reads no column ranges (that is the
    dK/dV kernels' narrowing), so the row ranges stand in for them."""
    return aux_scores.view(aux.mask, aux.bias, aux.bias32, aux.tile_map, aux.row_range, aux.row_range,
                           aux.slopes, aux.flags, batch, head, num_heads)


@cute.jit
def key_range(aux: FwdAux, present: cutlass.Boolean, batch: cutlass.Int32, head: cutlass.Int32,
              num_heads: cutlass.Int32, m_block: cutlass.Int32, block_m: cutlass.Constexpr,
              block_n: cutlass.Constexpr, n_min: cutlass.Int32, n_max: cutlass.Int32):
    """[n_min, n_max) narrowed by the mask's row ranges (aux_scores.key_tiles) for a present tile.  A tile that
    is not present (past the grid, a compact hole, wholly past its valid length) keeps its range unread: its
    decoded sequence, head or m-block may name no row of the summary, and nothing computes it anyway."""
    lo = n_min
    hi = n_max
    if present:
        narrowed = aux_scores.key_tiles(tile_view(aux, batch, head, num_heads), m_block, block_m, block_n,
                                        n_min, n_max)
        lo = narrowed[0]
        hi = narrowed[1]
    return lo, hi


@cute.jit
def tile_class_entry(view, m_block: cutlass.Int32, n_block: cutlass.Int32, block_m: cutlass.Constexpr,
                     block_n: cutlass.Constexpr) -> cutlass.Int32:
    """The load half of aux_scores.tile_class for tile (m_block, n_block), issued right after the tile's S GEMM;
    `tile_class_vote` completes it after the wait for S.  Voting right after the load stalled each warp on
    it before it could issue the previous tile's P V GEMM: 15-17% of the forward's time with an all-visible
    mask (H200, head dims 64 and 128)."""
    return aux_scores.tile_class_entry(view, m_block, n_block, block_m, block_n)


@cute.jit
def tile_class_vote(view, entry: cutlass.Int32, block_m: cutlass.Constexpr,
                    block_n: cutlass.Constexpr) -> cutlass.Int32:
    """aux_scores.tile_class from the lanes' entries.  Called by every consumer thread (it is warp-collective);
    the class is the whole query tile's, which covers both consumer warpgroups' rows."""
    return aux_scores.tile_class_vote(view, entry, block_m, block_n)


@cute.jit
def tile_scores(s_mn: cute.Tensor, c_mn: cute.Tensor, view, cls: cutlass.Int32, m_block: cutlass.Int32,
                n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
                q_len: cutlass.Int32, k_len: cutlass.Int32, score_mul: cutlass.Float32, stage=None,
                n_min: cutlass.Int32 = None, tidx: cutlass.Int32 = None):
    """In place: raw q.k of tile (m_block, n_block) of class `cls` (tile_class) -> natural-unit scores with bias
    and mask (the caller then applies the visibility mask).  With `stage` (the kernel stages the bias, a
    bias_stage.BiasStage of the calling warpgroup: `stage_tile_bias` filled it for this tile), the bias comes
    from shared memory, and the copies of the next key tile, n_block - 1, are issued if it is at least n_min."""
    wg_tidx = None
    if cutlass.const_expr(stage is not None):
        wg_tidx = tidx % 128
    aux_scores.key_tile_scores(s_mn, c_mn, view, m_block * block_m, n_block, block_n, q_len, k_len, score_mul, cls,
                               sc.map_group(0), stage, n_min, wg_tidx)


@cute.jit
def stage_tile_bias(stage, view, m_block: cutlass.Int32, n_block: cutlass.Int32, block_m: cutlass.Constexpr,
                    block_n: cutlass.Constexpr, q_len: cutlass.Int32, k_len: cutlass.Int32, tidx: cutlass.Int32):
    """The calling warpgroup's copies of tile (m_block, n_block)'s bias (aux_scores.stage_bias); `tidx` the
    consumer thread index."""
    aux_scores.stage_bias(stage._replace(parity=n_block % 2), view, m_block * block_m, n_block * block_n, q_len,
                          k_len, tidx % 128)


@cute.jit
def tile_mask_scores(s_mn: cute.Tensor, c_mn: cute.Tensor, view, cls: cutlass.Int32, m_block: cutlass.Int32,
                     n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
                     q_len: cutlass.Int32, k_len: cutlass.Int32, offs: cute.Tensor):
    """The "mask" kind's `tile_scores`: in place, raw q.k of tile (m_block, n_block) of class `cls` stay raw,
    -inf where the mask hides the pair (the caller then applies the visibility mask).  On a tile wholly on one
    side of the diagonal the query part of the ALiBi term goes to `offs` (zeroed by the caller), which the
    softmax adds to each row's max and subtrahend (aux_scores.AlibiFold)."""
    aux_scores.mask_scores(s_mn, c_mn, view, m_block * block_m, n_block * block_n, q_len, k_len, cls, 0,
                           sc.map_group(0), aux_scores.AlibiFold(offs, cutlass.Float32(1.0)), (block_m, block_n))


@cute.jit
def store_row_stats(aux: FwdAux, max_rows: cute.Tensor, logsum_rows: cute.Tensor, c_mn: cute.Tensor,
                    m0: cutlass.Int32, head: cutlass.Int32, q_start: cutlass.Int32, q_len: cutlass.Int32):
    """The backward's exact row statistics of the valid rows, written exactly where lse is (by a quad's first
    thread, rows i < q_len only: padded rows keep the zeros the handler writes)."""
    for r in cutlass.range_constexpr(cute.size(max_rows)):
        i = m0 + c_mn[r, 0][0]
        if i < q_len:
            aux.row_max[head, q_start + i] = max_rows[r]
            aux.log_sum[head, q_start + i] = logsum_rows[r]
