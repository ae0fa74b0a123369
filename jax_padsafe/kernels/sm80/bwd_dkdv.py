"""SM80-class flash-attention backward (mma.sync + ldmatrix + cp.async), pad-safe and deterministic.

Three kernels, launched in this order by the FFI handler (ffi/jps_bwd.cc) after it zero-fills
dq, dk, dv and the Delta buffer (cudaMemsetAsync):

1. `BwdPreprocess`: Delta[h, i] = rowsum(dO * O) - dlse for valid rows with lse != -inf, from
   zero-filled loads; every other row keeps the memset's 0.
2. `BwdDKDV`: one CTA per (key tile, kv head, sequence).  Loops over the query heads of its GQA group
   and over the query tiles that can see the key tile; recomputes S^T = K Q^T, P^T, dP^T = V dO^T,
   dS^T and accumulates dV += P^T dO, dK += dS^T Q in registers; writes the valid key rows once.
   For head dims > 128 the two accumulators (16 x HD fp32 each per warp: 256 registers per thread at
   hd256) cannot both live in registers, so the same class is compiled twice with `outputs="dv"`
   (S^T, P^T, dV += P^T dO; V is never loaded) and `outputs="dk"` (S^T, dP^T, dS^T, dK += dS^T Q) and the
   handler launches both: 128 accumulator registers each, S^T computed once more.
3. `BwdDQ`: one CTA per (query tile, head, sequence).  Loops over key tiles; recomputes S, P, dP, dS
   and accumulates dQ += dS K in registers; writes the valid query rows once.

No atomics and no global fp32 accumulator: every output element is produced by exactly one CTA in a
fixed order, so results are bitwise reproducible (deterministic by construction).  The cost is that
S = QK^T and dP = dO V^T are computed twice (7 GEMMs instead of FlashAttention-2's 5).

Layout (packed): q/o/do [total_q, N, H], k/v [total_k, K, H], lse/dlse/delta [N, total_q] float32.

`aux` builds the variants that take masks and biases as tensors (common/aux_scores.py; classes BwdDKDVAux
and bwd_dq.BwdDQAux), in two kinds with one ABI: "bias" (natural-unit scores, P from the forward's exact row
statistics, row max and ln of the row sum) and "mask" (the plain kernel's raw scores and P from lse, -inf
where the mask hides a pair; mRowMax / mLogSum are passed and not read).  Both narrow the tile ranges to the
tiles where the mask shows a visible cell.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from ..common import aux_scores, bounds, bwd_scores, masking, tiles
from . import bwd_common as bc


class BwdDKDV(bc.BwdBase):
    """dK, dV for one key tile (all query heads of its GQA group, all query tiles that see it).

    `outputs`: "dkdv" (both accumulators, one pass), "dv" (dV only: no V load, no dP^T) or "dk" (dK only:
    no dV GEMM).  The split passes keep one 16 x HD fp32 accumulator per warp instead of two, which is
    what makes head dims 192 and 256 fit in the 255 registers of a thread; each pass writes only its own
    output (the other one is left as the handler's memset made it) and runs the same tile schedule.
    """

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_threads: int, has_softcap: bool,
                 outputs: str = "dkdv", *, aux=False):
        super().__init__(dtype, head_dim, block_m, block_n, num_threads, has_softcap, aux=aux)
        assert outputs in ("dkdv", "dv", "dk")
        self.outputs = outputs
        self.do_dk = outputs in ("dkdv", "dk")
        self.do_dv = outputs in ("dkdv", "dv")

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_k: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        sQ_layout = tiles.smem_layout(dtype, self.block_m, self.head_dim)
        sK_layout = tiles.smem_layout(dtype, self.block_n, self.head_dim)
        # Buffers a pass does not use are not allocated: the second Q/dO stage with one stage, V in the dV
        # pass (V only enters dP^T = V dO^T, which only dK needs).
        bufs = [(n, sQ_layout) for n in ["sQ", "sdO", "sQ1", "sdO1"]]
        bufs += [("sK", sK_layout)] + ([("sV", sK_layout)] if self.do_dk else [])
        SharedStorage = bc.smem_tiles_struct(dtype, dict(bufs))

        copy_in = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=True)
        copy_out = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=False)
        tiled_mma = bc.make_mma(dtype, self.num_threads)
        grid = (cute.ceil_div(max_seqlen_k, self.block_n), cute.size(mK.shape[1]), cute.size(mUsedK.shape[0]))
        self.kernel(
            mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK,
            score_mul, cap_mul, dscale, window_left, window_right, bottom_right,
            sQ_layout, sK_layout, copy_in, copy_out, tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        self.body(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, score_mul, cap_mul, dscale,
                  window_left, window_right, bottom_right, sQ_layout, sK_layout, copy_in, copy_out, tiled_mma,
                  SharedStorage)

    @cute.jit
    def body(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        aux_in=None,
    ):
        """One key tile.  `aux_in` (aux variant only): see bwd_common.aux_view."""
        BM = self.block_m
        BN = self.block_n
        HD = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        k_start, k_len = bounds.used_length(mCuK, mUsedK, batch)
        if n_block * BN < k_len:
            q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
            off, left, right = bounds.window_bounds(q_len, k_len, window_left, window_right, bottom_right)
            m_min, m_max = bounds.m_block_range(n_block, BM, BN, q_len, k_len, off, left, right)
            group = mQ.shape[1] // mK.shape[1]
            n0 = n_block * BN
            if cutlass.const_expr(self.aux):
                # The loop below walks one query-tile range for every query head of the group, while the mask
                # is per query head: narrow to the union of the heads' ranges (a HIDDEN tile inside it is
                # computed, P = 0).  No head sees the key tile: an empty range, zeros written as today.
                lo = m_max
                hi = m_min
                for g in cutlass.range(group, unroll=1):
                    lo_g, hi_g = aux_scores.query_tiles(bc.aux_view(aux_in, batch, head_kv * group + g, mQ.shape[1]),
                                                        n_block, BM, BN, m_min, m_max)
                    if hi_g > lo_g:
                        lo = cutlass.min(lo, lo_g)
                        hi = cutlass.max(hi, hi_g)
                if hi < lo:
                    hi = lo
                m_min = lo
                m_max = hi

            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head_kv, None]), (BN, HD), (n_block, 0))

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sK = storage.sK.get_tensor(sK_layout)
            # Q / dO stages: with two, tile it+1 is loaded (cp.async) while tile it is computed.
            sQs = [storage.sQ.get_tensor(sQ_layout)]
            sdOs = [storage.sdO.get_tensor(sQ_layout)]
            sQs.append(storage.sQ1.get_tensor(sQ_layout))
            sdOs.append(storage.sdO1.get_tensor(sQ_layout))

            thr_in = copy_in.get_slice(tidx)
            tKsK = thr_in.partition_D(sK)
            tKcK = thr_in.partition_S(cute.make_identity_tensor((BN, HD)))
            tQcQ = thr_in.partition_S(cute.make_identity_tensor((BM, HD)))
            tQsQ = [thr_in.partition_D(x) for x in sQs]
            tdOsdO = [thr_in.partition_D(x) for x in sdOs]

            thr_mma = tiled_mma.get_slice(tidx)
            # GEMM operands: S^T = K Q^T, dP^T = V dO^T (A from smem), dV += P^T dO, dK += dS^T Q (B = X^T).
            tSrK = thr_mma.make_fragment_A(thr_mma.partition_A(sK))
            tSrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQs[0]))
            copy_a, copy_b, copy_bt = tiles.smem_tiled_copies(self.dtype, tiled_mma)
            sa = copy_a.get_slice(tidx)
            sb = copy_b.get_slice(tidx)
            sbt = copy_bt.get_slice(tidx)
            tSsK, tSrK_v = sa.partition_S(sK), sa.retile(tSrK)
            tSrQ_v = sb.retile(tSrQ)
            tSsQ = [sb.partition_S(x) for x in sQs]

            # Operands and accumulators of the outputs this pass computes (Python lists: the ones a pass
            # does not need are never created).
            tPrV, tPrdO, tKrQt, acc_dK = None, None, None, None
            tVrdOt, acc_dV = None, None
            sV = sK
            if cutlass.const_expr(self.do_dk):
                sV = storage.sV.get_tensor(sK_layout)
                gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head_kv, None]), (BN, HD),
                                     (n_block, 0))
                tVsV = thr_in.partition_D(sV)
                tPrV = thr_mma.make_fragment_A(thr_mma.partition_A(sV))
                tPrdO = thr_mma.make_fragment_B(thr_mma.partition_B(sdOs[0]))
                tKrQt = thr_mma.make_fragment_B(thr_mma.partition_B(bc.transposed(sQs[0], BM, HD)))
                acc_dK = cute.make_rmem_tensor(thr_mma.partition_shape_C((BN, HD)), cutlass.Float32)
                acc_dK.fill(0.0)
                tPsV, tPrV_v = sa.partition_S(sV), sa.retile(tPrV)
                tPrdO_v, tKrQt_v = sb.retile(tPrdO), sbt.retile(tKrQt)
                tPsdO = [sb.partition_S(x) for x in sdOs]
                tKsQt = [sbt.partition_S(bc.transposed(x, BM, HD)) for x in sQs]
            if cutlass.const_expr(self.do_dv):
                tVrdOt = thr_mma.make_fragment_B(thr_mma.partition_B(bc.transposed(sdOs[0], BM, HD)))
                acc_dV = cute.make_rmem_tensor(thr_mma.partition_shape_C((BN, HD)), cutlass.Float32)
                acc_dV.fill(0.0)
                tVrdOt_v = sbt.retile(tVrdOt)
                tVsdOt = [sbt.partition_S(bc.transposed(x, BM, HD)) for x in sdOs]

            # (key, query) coordinates of this thread's S^T fragment.
            cS_mn = masking.acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((BN, BM))))
            n_cols = cute.size(cS_mn, mode=[1])
            lse2 = cute.make_rmem_tensor((n_cols,), cutlass.Float32)
            delta = cute.make_rmem_tensor((n_cols,), cutlass.Float32)
            row_max = None
            if cutlass.const_expr(self.aux == "bias"):
                row_max = cute.make_rmem_tensor((n_cols,), cutlass.Float32)

            n_m = m_max - m_min
            total = group * n_m
            tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gK), tKsK, tKcK, n0, k_len)
            if cutlass.const_expr(self.do_dk):
                tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gV), tVsV, tKcK, n0, k_len)
            if total > 0:
                self._load_q_do(mQ, mdO, copy_in, thr_in, tQsQ[0], tdOsdO[0], tQcQ, head_kv * group, m_min,
                                q_start, q_len)
            cute.arch.cp_async_commit_group()

            for pair in cutlass.range((total + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):
                    it = pair * 2 + par
                    st = par  # the stage holding tile it (Python int)
                    if it < total:
                        head = head_kv * group + it // n_m
                        m_block = m_min + it % n_m
                        m0 = m_block * BM
                        cute.arch.barrier()  # every warp is done with the stage this iteration overwrites
                        if it + 1 < total:
                            self._load_q_do(mQ, mdO, copy_in, thr_in, tQsQ[1 - par], tdOsdO[1 - par], tQcQ,
                                            head_kv * group + (it + 1) // n_m, m_min + (it + 1) % n_m, q_start,
                                            q_len)
                            cute.arch.cp_async_commit_group()
                        view = None
                        if cutlass.const_expr(self.aux):
                            view = bc.aux_view(aux_in, batch, head, mQ.shape[1])  # this query head's mask and bias
                        if cutlass.const_expr(self.aux == "bias"):
                            # The forward's m and ln l (lse2 holds ln l * log2 e here), so that P = exp(s - m - ln l)
                            # stays exact for biases of any magnitude.
                            bwd_scores.load_row_stats_exact(aux_in[5], aux_in[6], mDelta, head, q_start, q_len, m0,
                                                            cS_mn, row_max, lse2, delta, 1)
                        else:
                            bwd_scores.load_row_stats(mLSE, mDelta, head, q_start, q_len, m0, cS_mn, lse2, delta, 1)
                        if it + 1 < total:
                            cute.arch.cp_async_wait_group(1)
                        else:
                            cute.arch.cp_async_wait_group(0)
                        cute.arch.barrier()

                        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((BN, BM)), cutlass.Float32)
                        acc_S.fill(0.0)
                        bc.gemm_ss(tiled_mma, acc_S, copy_a, tSsK, tSrK_v, tSrK, copy_b, tSsQ[st], tSrQ_v, tSrQ)
                        acc_T = cute.make_rmem_tensor(thr_mma.partition_shape_C((BN, BM)), cutlass.Float32)
                        need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
                        s_mn = masking.acc_mn_view(acc_S)
                        if cutlass.const_expr(self.aux == "bias"):
                            # S^T is keys x queries (query_mode 1).  tile_class is warp-collective: every thread
                            # runs it for every tile.
                            cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
                            aux_scores.scores(s_mn, cS_mn, view, m0, n0, q_len, k_len, score_mul, cls, 1)
                            bwd_scores.probs_exact(s_mn, cS_mn, row_max, lse2, m0, n0, k_len, off, left, right, need,
                                                   1)
                        else:
                            if cutlass.const_expr(self.aux == "mask"):
                                # -inf on the raw S^T where the mask hides a pair (exp2 gives P = 0), then the plain
                                # P with the plain score_mul.  tile_class as above.
                                cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
                                aux_scores.mask_scores(s_mn, cS_mn, view, m0, n0, q_len, k_len, cls, 1)
                            bwd_scores.probs_and_dscale(s_mn, masking.acc_mn_view(acc_T), cS_mn, lse2, m0, n0, k_len,
                                                        off, left, right, score_mul, cap_mul, need, 1,
                                                        self.has_softcap)

                        if cutlass.const_expr(self.do_dk):
                            acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((BN, BM)), cutlass.Float32)
                            acc_dP.fill(0.0)
                            bc.gemm_ss(tiled_mma, acc_dP, copy_a, tPsV, tPrV_v, tPrV, copy_b, tPsdO[st], tPrdO_v,
                                       tPrdO)

                        if cutlass.const_expr(self.do_dv):
                            # dV += P^T dO
                            rP = cute.make_fragment_like(acc_S, self.dtype)
                            rP.store(acc_S.load().to(self.dtype))
                            bc.gemm_rs(tiled_mma, acc_dV, cute.make_tensor(rP.iterator, bc.c_to_a_layout(rP.layout)),
                                       copy_bt, tVsdOt[st], tVrdOt_v, tVrdOt)
                        if cutlass.const_expr(self.do_dk):
                            # dS^T = P^T (dP^T - Delta) [* (1 - tanh^2)];  dK += dS^T Q
                            bwd_scores.dscores(s_mn, masking.acc_mn_view(acc_dP), masking.acc_mn_view(acc_T), delta, 1,
                                       self.has_softcap)
                            rdS = cute.make_fragment_like(acc_dP, self.dtype)
                            rdS.store(acc_dP.load().to(self.dtype))
                            bc.gemm_rs(tiled_mma, acc_dK,
                                       cute.make_tensor(rdS.iterator, bc.c_to_a_layout(rdS.layout)),
                                       copy_bt, tKsQt[st], tKrQt_v, tKrQt)

            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            # Each output goes out through a shared tile this CTA no longer reads (dK through sK, dV through
            # sV, or through sK when the pass has no sV).
            if cutlass.const_expr(self.do_dk):
                gdK = cute.local_tile(cute.domain_offset((k_start, 0), mdK[None, head_kv, None]), (BN, HD),
                                      (n_block, 0))
                bc.store_rows(acc_dK, dscale, self.dtype, tiled_mma, copy_out, sK, gdK, BN, HD, n0, k_len, tidx)
            if cutlass.const_expr(self.do_dv):
                gdV = cute.local_tile(cute.domain_offset((k_start, 0), mdV[None, head_kv, None]), (BN, HD),
                                      (n_block, 0))
                bc.store_rows(acc_dV, cutlass.Float32(1.0), self.dtype, tiled_mma, copy_out, sV, gdV, BN, HD, n0,
                              k_len, tidx)

    @cute.jit
    def _load_q_do(self, mQ, mdO, copy_in, thr_in, tQsQ, tdOsdO, tQcQ, head, m_block, q_start, q_len):
        """cp.async the (m_block, head) tiles of Q and dO into one stage; rows >= q_len are zero-filled."""
        BM = self.block_m
        HD = self.head_dim
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]), (BM, HD), (m_block, 0))
        gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, head, None]), (BM, HD), (m_block, 0))
        tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gQ), tQsQ, tQcQ, m_block * BM, q_len)
        tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gdO), tdOsdO, tQcQ, m_block * BM, q_len)


class BwdDKDVAux(BwdDKDV):
    """The aux variants (what BwdDKDV(..., aux="mask" | "bias") builds, any `outputs`): the extra tensors after
    mUsedK, aux_flags after max_seqlen_k.  The bias kind reads mRowMax and mLogSum (mLSE unused), the mask kind
    mLSE (mRowMax and mLogSum unused)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mMask: cute.Tensor,
        mBias: cute.Tensor,
        mBias32: cute.Tensor,
        mTileMap: cute.Tensor,
        mColRange: cute.Tensor,
        mRowMax: cute.Tensor,
        mLogSum: cute.Tensor,
        mSlopes: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_k: cutlass.Int32,
        aux_flags: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        sQ_layout = tiles.smem_layout(dtype, self.block_m, self.head_dim)
        sK_layout = tiles.smem_layout(dtype, self.block_n, self.head_dim)
        bufs = [(n, sQ_layout) for n in ["sQ", "sdO", "sQ1", "sdO1"]]
        bufs += [("sK", sK_layout)] + ([("sV", sK_layout)] if self.do_dk else [])
        SharedStorage = bc.smem_tiles_struct(dtype, dict(bufs))

        copy_in = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=True)
        copy_out = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=False)
        tiled_mma = bc.make_mma(dtype, self.num_threads)
        grid = (cute.ceil_div(max_seqlen_k, self.block_n), cute.size(mK.shape[1]), cute.size(mUsedK.shape[0]))
        self.kernel_aux(
            mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK,
            mMask, mBias, mBias32, mTileMap, mColRange, mRowMax, mLogSum, mSlopes,
            score_mul, cap_mul, dscale, window_left, window_right, bottom_right, aux_flags,
            sQ_layout, sK_layout, copy_in, copy_out, tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel_aux(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mMask: cute.Tensor,
        mBias: cute.Tensor,
        mBias32: cute.Tensor,
        mTileMap: cute.Tensor,
        mColRange: cute.Tensor,
        mRowMax: cute.Tensor,
        mLogSum: cute.Tensor,
        mSlopes: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        aux_flags: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        self.body(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, score_mul, cap_mul, dscale,
                  window_left, window_right, bottom_right, sQ_layout, sK_layout, copy_in, copy_out, tiled_mma,
                  SharedStorage, (mMask, mBias, mBias32, mTileMap, mColRange, mRowMax, mLogSum, aux_flags,
                                  mSlopes))


BwdDKDV.aux_class = BwdDKDVAux
