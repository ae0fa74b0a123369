"""SM80-class backward, dbias kernel: the gradient of an additive bias for the aux kernels' "bias" kind.

Why a kernel of its own: the bias is [Bx, Hx, Tx, S] with Bx in {1, B} and Hx in {1, N}, so one dbias cell
is the sum of dS over every (sequence, query head) that maps to it.  The dQ and dK/dV kernels own query or key
tiles of one (sequence, head); summing their dS into a shared bias would take atomics (not deterministic) or a
[B, N, T, S] scratch.  Here one CTA owns one (block_m x block_n) tile of one (bx, hx) slice of dbias and loops
over the (b, h) pairs that map to it in a fixed order (b ascending, then h ascending), accumulating dS in the
fp32 mma C fragment: bitwise deterministic, no atomics, no T x S scratch, and every cell of the tile inside
[0, Tx) x [0, S) is written (zeros where nothing contributes), so the output needs no memset.  The price is
the recomputation: two GEMMs (S = Q K^T, dP = dO V^T) per visible (b, h, tile), on top of the dQ and dK/dV
kernels' own.

Per pair, as the dQ kernel's bias kind: natural-unit scores s = q.k * scale + bias (-inf where the mask hides
a pair; aux_scores.scores), P = exp(s - m - ln l) from the forward's exact row statistics with the visibility
rule (bwd_scores.probs_exact), dS = P * (dP - Delta) (bwd_scores.dscores, 0 by select wherever P = 0).  A pair
is skipped (a CTA-uniform decision) unless the tile's rows start below the sequence's query length and its key
tile lies in the query tile's visible key-tile range narrowed by the mask's block summary.

Pipeline: with two shared-memory stages the four operand tiles (Q and dO rows of the query tile, K and V rows
of the key tile) of the next active pair are loaded with cp.async while the current pair is computed; with one
stage (hd256 on sm_80: 163 KB per block) each pair is loaded, waited for and computed.

Pad safety: Q / dO rows at or past q_len and K / V rows at or past k_len are zero-filled in shared memory and
never read; row statistics and Delta are read for valid rows only; mask / bias loads are the aux helpers'
clamped loads inside the valid rectangle; every exclusion is a select.  A pair that the poisoned block summary
lets in without a visible cell adds exact +0.0 to an accumulator that is never -0.0, so the bits are the same.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from ..common import aux_scores, bounds, bwd_scores, dbias_pairs, masking, tiles
from . import bwd_common as bc


def _storage(dtype, sQ_layout, sK_layout, stages: int):
    """Shared memory: Q, dO (block_m rows) and K, V (block_n rows) per stage (plain Python, see
    bc.smem_tiles_struct)."""
    fields = {}
    for st in range(stages):
        fields.update({f"sQ{st}": sQ_layout, f"sdO{st}": sQ_layout, f"sK{st}": sK_layout, f"sV{st}": sK_layout})
    return bc.smem_tiles_struct(dtype, fields)


class BwdDBias:
    """dbias for one (block_m x block_n) tile of one (bx, hx) slice of the live dbias tensor."""

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_threads: int, stages: int = 2):
        assert head_dim % 16 == 0 and stages in (1, 2)
        assert block_m == num_threads // 32 * 16  # one mma row block (16 rows) per warp
        assert block_m % aux_scores.MAP_ROWS == 0 and block_n % aux_scores.MAP_COLS == 0
        # The operand loads' copy tile (tiles.gmem_tiled_copy: 16-byte vectors over row_block(head_dim) columns)
        # must fit both tiles' rows: 256 threads over 16-column blocks (head dim 80) cover 128 rows.
        copy_rows = num_threads // (tiles.row_block(head_dim) * dtype.width // 128)
        assert block_m % copy_rows == 0 and block_n % copy_rows == 0, (block_m, block_n, copy_rows)
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.block_n = block_n
        self.num_threads = num_threads
        self.stages = stages

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mDelta: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mMask: cute.Tensor,
        mBias: cute.Tensor,
        mBias32: cute.Tensor,
        mTileMap: cute.Tensor,
        mRowRange: cute.Tensor,
        mRowMax: cute.Tensor,
        mLogSum: cute.Tensor,
        mSlopes: cute.Tensor,
        mdBias: cute.Tensor,
        mdBias32: cute.Tensor,
        score_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        max_seqlen_k: cutlass.Int32,
        aux_flags: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        sQ_layout = tiles.smem_layout(dtype, self.block_m, self.head_dim)
        sK_layout = tiles.smem_layout(dtype, self.block_n, self.head_dim)
        SharedStorage = _storage(dtype, sQ_layout, sK_layout, self.stages)

        copy_in = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=True)
        tiled_mma = bc.make_mma(dtype, self.num_threads)
        # One CTA per tile of each (bx, hx) slice of the live dbias tensor (the placeholder's Bx * Hx is 1).
        slices = cutlass.max(cute.size(mdBias.shape[0]) * cute.size(mdBias.shape[1]),
                             cute.size(mdBias32.shape[0]) * cute.size(mdBias32.shape[1]))
        grid = (cute.ceil_div(max_seqlen_q, self.block_m), cute.ceil_div(max_seqlen_k, self.block_n), slices)
        self.kernel(
            mQ, mK, mV, mdO, mDelta, mCuQ, mCuK, mUsedQ, mUsedK,
            mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum, mSlopes, mdBias, mdBias32,
            score_mul, window_left, window_right, bottom_right, aux_flags,
            sQ_layout, sK_layout, copy_in, tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mDelta: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mMask: cute.Tensor,
        mBias: cute.Tensor,
        mBias32: cute.Tensor,
        mTileMap: cute.Tensor,
        mRowRange: cute.Tensor,
        mRowMax: cute.Tensor,
        mLogSum: cute.Tensor,
        mSlopes: cute.Tensor,
        mdBias: cute.Tensor,
        mdBias32: cute.Tensor,
        score_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        aux_flags: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        BM = self.block_m
        BN = self.block_n
        HD = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, n_block, slice_idx = cute.arch.block_idx()
        m0 = m_block * BM
        n0 = n_block * BN

        num_heads = cute.size(mQ.shape[1])
        args = dbias_pairs.make(mCuQ, mCuK, mUsedQ, mUsedK, mMask, mBias, mBias32, mTileMap, mRowRange, mSlopes,
                                mdBias, mdBias32, aux_flags, window_left, window_right, bottom_right, num_heads,
                                m_block, n_block, slice_idx)
        n_pairs = args.n_pairs

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQs = [getattr(storage, f"sQ{st}").get_tensor(sQ_layout) for st in range(self.stages)]
        sdOs = [getattr(storage, f"sdO{st}").get_tensor(sQ_layout) for st in range(self.stages)]
        sKs = [getattr(storage, f"sK{st}").get_tensor(sK_layout) for st in range(self.stages)]
        sVs = [getattr(storage, f"sV{st}").get_tensor(sK_layout) for st in range(self.stages)]

        thr_in = copy_in.get_slice(tidx)
        # Per stage: the shared destinations of this thread's cp.async share of Q, dO, K, V.
        dst = [(thr_in.partition_D(sQs[st]), thr_in.partition_D(sdOs[st]), thr_in.partition_D(sKs[st]),
                thr_in.partition_D(sVs[st])) for st in range(self.stages)]
        tQcQ = thr_in.partition_S(cute.make_identity_tensor((BM, HD)))
        tKcK = thr_in.partition_S(cute.make_identity_tensor((BN, HD)))
        loads = (copy_in, thr_in, tQcQ, tKcK)

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQs[0]))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKs[0]))
        tPrdO = thr_mma.make_fragment_A(thr_mma.partition_A(sdOs[0]))
        tPrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVs[0]))
        copy_a, copy_b, _ = tiles.smem_tiled_copies(self.dtype, tiled_mma)
        sa = copy_a.get_slice(tidx)
        sb = copy_b.get_slice(tidx)
        tSrQ_v, tPrdO_v, tSrK_v, tPrV_v = sa.retile(tSrQ), sa.retile(tPrdO), sb.retile(tSrK), sb.retile(tPrV)
        # Per stage: the ldmatrix sources of the S GEMM (Q, K) and the dP GEMM (dO, V).
        src = [(sa.partition_S(sQs[st]), sb.partition_S(sKs[st]), sa.partition_S(sdOs[st]),
                sb.partition_S(sVs[st])) for st in range(self.stages)]

        cS_mn = masking.acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((BM, BN))))
        n_rows = cute.size(cS_mn, mode=[0])
        row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        log_sum2 = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        delta = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        acc_dB = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
        acc_dB.fill(0.0)

        mma = (tiled_mma, thr_mma, copy_a, copy_b, tSrQ_v, tSrQ, tSrK_v, tSrK, tPrdO_v, tPrdO, tPrV_v, tPrV)
        stats = (mRowMax, mLogSum, mDelta, cS_mn, row_max, log_sum2, delta)

        p = dbias_pairs.next_active(cutlass.Int32(0), args, BM, BN)
        if cutlass.const_expr(self.stages == 2):
            # Pair p's tiles sit in stage `par`; the next active pair's are loaded into the other stage while
            # pair p is computed.
            if p < n_pairs:
                self.load_pair(p, args, mQ, mK, mV, mdO, loads, dst[0])
            cute.arch.cp_async_commit_group()
            while p < n_pairs:
                for par in cutlass.range_constexpr(2):
                    if p < n_pairs:
                        q = dbias_pairs.next_active(p + 1, args, BM, BN)
                        cute.arch.barrier()  # every warp is done with the stage this iteration overwrites
                        if q < n_pairs:
                            self.load_pair(q, args, mQ, mK, mV, mdO, loads, dst[1 - par])
                            cute.arch.cp_async_commit_group()
                            cute.arch.cp_async_wait_group(1)
                        else:
                            cute.arch.cp_async_wait_group(0)
                        cute.arch.barrier()
                        self.accumulate(p, args, score_mul, mma, src[par], stats, acc_dB)
                        p = q
        else:
            while p < n_pairs:
                cute.arch.barrier()  # every warp is done with the previous pair's tiles
                self.load_pair(p, args, mQ, mK, mV, mdO, loads, dst[0])
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                self.accumulate(p, args, score_mul, mma, src[0], stats, acc_dB)
                p = dbias_pairs.next_active(p + 1, args, BM, BN)

        # Element stores (S may be odd and the tensor only element-aligned), every cell of the tile inside the
        # live tensor, to the live tensor only.
        dbias_pairs.store_tile(acc_dB, masking.acc_mn_view, cS_mn, mdBias, mdBias32, aux_flags, args.bx, args.hx, m0,
                               n0)

    # ------------------------------------------------------------------------------------------ per pair

    @cute.jit
    def load_pair(self, p: cutlass.Int32, args: dbias_pairs.Pairs, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                  mdO: cute.Tensor, loads, dst):
        """cp.async pair p's Q and dO rows of the query tile and K and V rows of the key tile into one stage;
        rows past q_len / k_len are zero-filled in shared memory, never read."""
        BM = self.block_m
        BN = self.block_n
        HD = self.head_dim
        copy_in, thr_in, tQcQ, tKcK = loads
        m_block, n_block = args.m_block, args.n_block
        _, h, q_start, q_len, k_start, k_len, _, _, _ = dbias_pairs.pair_bounds(p, args)
        h_kv = h // (mQ.shape[1] // mK.shape[1])
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, h, None]), (BM, HD), (m_block, 0))
        gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, h, None]), (BM, HD), (m_block, 0))
        gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, h_kv, None]), (BN, HD), (n_block, 0))
        gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, h_kv, None]), (BN, HD), (n_block, 0))
        tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gQ), dst[0], tQcQ, m_block * BM, q_len)
        tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gdO), dst[1], tQcQ, m_block * BM, q_len)
        tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gK), dst[2], tKcK, n_block * BN, k_len)
        tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gV), dst[3], tKcK, n_block * BN, k_len)

    @cute.jit
    def accumulate(self, p: cutlass.Int32, args: dbias_pairs.Pairs, score_mul: cutlass.Float32, mma, src, stats,
                   acc_dB: cute.Tensor):
        """acc_dB += dS of pair p (its tiles in shared memory, the stage's ldmatrix sources `src`)."""
        BM = self.block_m
        BN = self.block_n
        m_block, n_block = args.m_block, args.n_block
        m0 = m_block * BM
        n0 = n_block * BN
        b, h, q_start, q_len, _, k_len, off, left, right = dbias_pairs.pair_bounds(p, args)
        view = dbias_pairs.pair_view(b, h, args)
        tiled_mma, thr_mma, copy_a, copy_b, tSrQ_v, tSrQ, tSrK_v, tSrK, tPrdO_v, tPrdO, tPrV_v, tPrV = mma
        tSsQ, tSsK, tPsdO, tPsV = src
        mRowMax, mLogSum, mDelta, cS_mn, row_max, log_sum2, delta = stats
        # The forward's m and ln l (log_sum2 holds ln l * log2 e) and Delta, for valid rows only.
        bwd_scores.load_row_stats_exact(mRowMax, mLogSum, mDelta, h, q_start, q_len, m0, cS_mn, row_max, log_sum2,
                                        delta, 0)

        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
        acc_S.fill(0.0)
        bc.gemm_ss(tiled_mma, acc_S, copy_a, tSsQ, tSrQ_v, tSrQ, copy_b, tSsK, tSrK_v, tSrK)
        # Natural-unit scores (tile_class is warp-collective: every thread runs it), then P with the
        # visibility rule; a HIDDEN tile inside the range gives P = 0.
        cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
        s_mn = masking.acc_mn_view(acc_S)
        aux_scores.scores(s_mn, cS_mn, view, m0, n0, q_len, k_len, score_mul, cls, 0)
        need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
        bwd_scores.probs_exact(s_mn, cS_mn, row_max, log_sum2, m0, n0, k_len, off, left, right, need, 0)

        acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
        acc_dP.fill(0.0)
        bc.gemm_ss(tiled_mma, acc_dP, copy_a, tPsdO, tPrdO_v, tPrdO, copy_b, tPsV, tPrV_v, tPrV)
        # dS = P * (dP - Delta), 0 by select wherever P = 0 (the softcap factor is unused: no softcap here).
        bwd_scores.dscores(s_mn, masking.acc_mn_view(acc_dP), masking.acc_mn_view(acc_dP), delta, 0, False)
        acc_dB.store(acc_dB.load() + acc_dP.load())
