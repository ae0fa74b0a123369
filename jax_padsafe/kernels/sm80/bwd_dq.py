"""SM80-class backward, dQ kernel (see bwd_dkdv for the backward's structure).

`aux` builds BwdDQAux: masks and biases as tensors (common/aux_scores.py), the key-tile range narrowed to the
tiles where the mask shows the query tile a visible cell, in two kinds with one ABI: "bias" (natural-unit
scores, P from the forward's exact row statistics) and "mask" (the plain kernel's raw scores and P from lse,
-inf where the mask hides a pair).
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from ..common import aux_scores, bounds, bwd_scores, dq_shift, masking, tiles
from . import bwd_common as bc


def kref_layout(dtype, head_dim: int):
    """A buffer of `dtype` elements holding head_dim float32 values (dQ's reference key)."""
    return cute.make_layout(head_dim * 32 // dtype.width)


class BwdDQ(bc.BwdBase):
    """dQ for one query tile of one head (loops over the key tiles it sees)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdLSE: cute.Tensor,
        mdQ: cute.Tensor,
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
        max_seqlen_q: cutlass.Int32,
        partial_keys: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        sQ_layout = tiles.smem_layout(dtype, self.block_m, self.head_dim)
        sK_layout = tiles.smem_layout(dtype, self.block_n, self.head_dim)
        names = ["sK", "sV", "sK1", "sV1"]
        SharedStorage = bc.smem_tiles_struct(
            dtype, dict([("sQ", sQ_layout), ("sdO", sQ_layout)] + [(n, sK_layout) for n in names]
                        + [("sKref", kref_layout(dtype, self.head_dim))]))

        copy_in = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=True)
        copy_out = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=False)
        tiled_mma = bc.make_mma(dtype, self.num_threads)
        grid = (cute.ceil_div(max_seqlen_q, self.block_m), cute.size(mQ.shape[1]), cute.size(mUsedQ.shape[0]))
        self.kernel(
            mQ, mK, mV, mdO, mLSE, mDelta, mdLSE, mdQ, mCuQ, mCuK, mUsedQ, mUsedK,
            score_mul, cap_mul, dscale, window_left, window_right, bottom_right, partial_keys,
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
        mdLSE: cute.Tensor,
        mdQ: cute.Tensor,
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
        partial_keys: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        self.body(mQ, mK, mV, mdO, mLSE, mDelta, mdQ, mCuQ, mCuK, mUsedQ, mUsedK, score_mul, cap_mul, dscale,
                  window_left, window_right, bottom_right, sQ_layout, sK_layout, copy_in, copy_out, tiled_mma,
                  SharedStorage, (mdLSE, partial_keys))

    @cute.jit
    def body(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdQ: cute.Tensor,
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
        shift_args,
        aux_in=None,
    ):
        """One query tile.  `shift_args` (mdLSE, partial_keys): dQ against a reference key, and rowsum(P dP)
        into mDelta (dq_shift).  `aux_in` (aux variant only): see bwd_common.aux_view."""
        BM = self.block_m
        BN = self.block_n
        HD = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block_rev, head, batch = cute.arch.block_idx()
        # Highest query tiles first: under causal / bottom-right masks they visit the most key tiles, so
        # the long CTAs start early and the short ones fill the tail (each CTA's result is independent of
        # the order, so this changes no bit).
        m_block = cute.arch.grid_dim()[0] - 1 - m_block_rev
        q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
        if m_block * BM < q_len:
            k_start, k_len = bounds.used_length(mCuK, mUsedK, batch)
            off, left, right = bounds.window_bounds(q_len, k_len, window_left, window_right, bottom_right)
            n_min, n_max = bounds.n_block_range(m_block, BM, BN, q_len, k_len, off, left, right)
            view = None
            if cutlass.const_expr(self.aux):
                # Skip the key tiles where the mask shows this query tile nothing (an empty range writes zeros,
                # as an empty visibility range does).
                view = bc.aux_view(aux_in, batch, head, mQ.shape[1])
                n_min, n_max = aux_scores.key_tiles(view, m_block, BM, BN, n_min, n_max)
            head_kv = head // (mQ.shape[1] // mK.shape[1])
            m0 = m_block * BM

            gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]), (BM, HD), (m_block, 0))
            gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, head, None]), (BM, HD), (m_block, 0))
            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head_kv, None]), (BN, HD), (None, 0))
            gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head_kv, None]), (BN, HD), (None, 0))

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sdO = storage.sdO.get_tensor(sQ_layout)
            # K / V stages: with two, tile it+1 is loaded (cp.async) while tile it is computed.
            sKs = [storage.sK.get_tensor(sK_layout)]
            sVs = [storage.sV.get_tensor(sK_layout)]
            sKs.append(storage.sK1.get_tensor(sK_layout))
            sVs.append(storage.sV1.get_tensor(sK_layout))
            # dQ's reference key (dq_shift.reference_key), float32 per column in a buffer of the input dtype.
            sKref = cute.recast_tensor(storage.sKref.get_tensor(kref_layout(self.dtype, HD)), cutlass.Float32)

            thr_in = copy_in.get_slice(tidx)
            tQsQ = thr_in.partition_D(sQ)
            tdOsdO = thr_in.partition_D(sdO)
            tKsK = [thr_in.partition_D(x) for x in sKs]
            tVsV = [thr_in.partition_D(x) for x in sVs]
            tKgK = thr_in.partition_S(gK)
            tVgV = thr_in.partition_S(gV)
            tQcQ = thr_in.partition_S(cute.make_identity_tensor((BM, HD)))
            tKcK = thr_in.partition_S(cute.make_identity_tensor((BN, HD)))

            thr_mma = tiled_mma.get_slice(tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKs[0]))
            tPrdO = thr_mma.make_fragment_A(thr_mma.partition_A(sdO))
            tPrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVs[0]))
            tQrKt = thr_mma.make_fragment_B(thr_mma.partition_B(bc.transposed(sKs[0], BN, HD)))
            acc_dQ = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, HD)), cutlass.Float32)
            acc_dQ.fill(0.0)

            copy_a, copy_b, copy_bt = tiles.smem_tiled_copies(self.dtype, tiled_mma)
            sa = copy_a.get_slice(tidx)
            sb = copy_b.get_slice(tidx)
            sbt = copy_bt.get_slice(tidx)
            tSsQ, tSrQ_v = sa.partition_S(sQ), sa.retile(tSrQ)
            tPsdO, tPrdO_v = sa.partition_S(sdO), sa.retile(tPrdO)
            tSrK_v, tPrV_v, tQrKt_v = sb.retile(tSrK), sb.retile(tPrV), sbt.retile(tQrKt)
            tSsK = [sb.partition_S(x) for x in sKs]
            tPsV = [sb.partition_S(x) for x in sVs]
            tQsKt = [sbt.partition_S(bc.transposed(x, BN, HD)) for x in sKs]

            cS_mn = masking.acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((BM, BN))))
            n_rows = cute.size(cS_mn, mode=[0])
            lse2 = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            delta = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            row_max = None
            if cutlass.const_expr(self.aux == "bias"):
                # The forward's m and ln l (lse2 holds ln l * log2 e here): P = exp(s - m - ln l) stays exact
                # for biases of any magnitude.
                row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
                bwd_scores.load_row_stats_exact(aux_in[5], aux_in[6], mDelta, head, q_start, q_len, m0, cS_mn,
                                                row_max, lse2, delta, 0)
            else:
                bwd_scores.load_row_stats(mLSE, mDelta, head, q_start, q_len, m0, cS_mn, lse2, delta, 0)

            sums = dq_shift.make_sums(n_rows, self.has_softcap)
            mdLSE, partial_keys = shift_args
            dlse = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            dq_shift.load_dlse(mdLSE, head, q_start, q_len, m0, cS_mn, partial_keys, dlse)

            total = n_max - n_min
            tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gQ), tQsQ, tQcQ, m0, q_len)
            tiles.load_rows_zero_fill(copy_in, thr_in.partition_S(gdO), tdOsdO, tQcQ, m0, q_len)
            if total > 0:
                tiles.load_rows_zero_fill(copy_in, tKgK[None, None, None, n_max - 1], tKsK[0], tKcK,
                                          (n_max - 1) * BN, k_len)
                tiles.load_rows_zero_fill(copy_in, tVgV[None, None, None, n_max - 1], tVsV[0], tKcK,
                                          (n_max - 1) * BN, k_len)
            cute.arch.cp_async_commit_group()
            if total > 0:
                # dQ's reference key from the first key tile (n_max - 1) once it has landed; the loop's barriers
                # order these stores before the epilogue reads them.
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                dq_shift.reference_key(sKs[0], cutlass.min(k_len - (n_max - 1) * BN, BN), sKref, tidx,
                                       self.num_threads, HD)

            for pair in cutlass.range((total + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):
                    it = pair * 2 + par
                    st = par  # the stage holding tile it (Python int)
                    if it < total:
                        n_block = n_max - 1 - it
                        n0 = n_block * BN
                        cute.arch.barrier()  # every warp is done with the stage this iteration overwrites
                        if it + 1 < total:
                            tiles.load_rows_zero_fill(copy_in, tKgK[None, None, None, n_block - 1], tKsK[1 - par],
                                                      tKcK, n0 - BN, k_len)
                            tiles.load_rows_zero_fill(copy_in, tVgV[None, None, None, n_block - 1], tVsV[1 - par],
                                                      tKcK, n0 - BN, k_len)
                            cute.arch.cp_async_commit_group()
                            cute.arch.cp_async_wait_group(1)
                        else:
                            cute.arch.cp_async_wait_group(0)
                        cute.arch.barrier()

                        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
                        acc_S.fill(0.0)
                        bc.gemm_ss(tiled_mma, acc_S, copy_a, tSsQ, tSrQ_v, tSrQ, copy_b, tSsK[st], tSrK_v, tSrK)
                        acc_T = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
                        need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
                        s_mn = masking.acc_mn_view(acc_S)
                        if cutlass.const_expr(self.aux == "bias"):
                            # Natural-unit scores (tile_class is warp-collective: every thread runs it), then
                            # P with the visibility rule; a HIDDEN tile inside the range gives P = 0.
                            cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
                            aux_scores.scores(s_mn, cS_mn, view, m0, n0, q_len, k_len, score_mul, cls, 0)
                            bwd_scores.probs_exact(s_mn, cS_mn, row_max, lse2, m0, n0, k_len, off, left, right, need,
                                                   0)
                        else:
                            if cutlass.const_expr(self.aux == "mask"):
                                # -inf on the raw S where the mask hides a pair (exp2 gives P = 0), then the plain P
                                # with the plain score_mul.  tile_class as above.
                                cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
                                aux_scores.mask_scores(s_mn, cS_mn, view, m0, n0, q_len, k_len, cls, 0)
                            bwd_scores.probs_and_dscale(s_mn, masking.acc_mn_view(acc_T), cS_mn, lse2, m0, n0, k_len,
                                                        off, left, right, score_mul, cap_mul, need, 0,
                                                        self.has_softcap)

                        acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), cutlass.Float32)
                        acc_dP.fill(0.0)
                        bc.gemm_ss(tiled_mma, acc_dP, copy_a, tPsdO, tPrdO_v, tPrdO, copy_b, tPsV[st], tPrV_v, tPrV)
                        bwd_scores.dscores(s_mn, masking.acc_mn_view(acc_dP), masking.acc_mn_view(acc_T), delta, 0,
                                           self.has_softcap, sums)
                        rdS = cute.make_fragment_like(acc_dP, self.dtype)
                        rdS.store(acc_dP.load().to(self.dtype))
                        bc.gemm_rs(tiled_mma, acc_dQ, cute.make_tensor(rdS.iterator, bc.c_to_a_layout(rdS.layout)),
                                   copy_bt, tQsKt[st], tQrKt_v, tQrKt)

            cute.arch.cp_async_wait_group(0)
            f = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            dq_shift.finish(sums, delta, dlse, mDelta, head, q_start, q_len, m0, cS_mn, partial_keys, f)
            if total > 0:
                dq_shift.shift(masking.acc_mn_view(acc_dQ),
                               masking.acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((BM, HD)))), f, sKref)
            cute.arch.barrier()
            gdQ = cute.local_tile(cute.domain_offset((q_start, 0), mdQ[None, head, None]), (BM, HD), (m_block, 0))
            bc.store_rows(acc_dQ, dscale, self.dtype, tiled_mma, copy_out, sQ, gdQ, BM, HD, m0, q_len, tidx)


class BwdDQAux(BwdDQ):
    """The aux variants (what BwdDQ(..., aux="mask" | "bias") builds): the extra tensors after mUsedK, aux_flags
    after max_seqlen_q.  The bias kind reads mRowMax and mLogSum (mLSE unused), the mask kind mLSE (mRowMax and
    mLogSum unused)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdLSE: cute.Tensor,
        mdQ: cute.Tensor,
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
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        partial_keys: cutlass.Int32,
        aux_flags: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        sQ_layout = tiles.smem_layout(dtype, self.block_m, self.head_dim)
        sK_layout = tiles.smem_layout(dtype, self.block_n, self.head_dim)
        names = ["sK", "sV", "sK1", "sV1"]
        SharedStorage = bc.smem_tiles_struct(
            dtype, dict([("sQ", sQ_layout), ("sdO", sQ_layout)] + [(n, sK_layout) for n in names]
                        + [("sKref", kref_layout(dtype, self.head_dim))]))

        copy_in = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=True)
        copy_out = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=False)
        tiled_mma = bc.make_mma(dtype, self.num_threads)
        grid = (cute.ceil_div(max_seqlen_q, self.block_m), cute.size(mQ.shape[1]), cute.size(mUsedQ.shape[0]))
        self.kernel_aux(
            mQ, mK, mV, mdO, mLSE, mDelta, mdLSE, mdQ, mCuQ, mCuK, mUsedQ, mUsedK,
            mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum, mSlopes,
            score_mul, cap_mul, dscale, window_left, window_right, bottom_right, partial_keys, aux_flags,
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
        mdLSE: cute.Tensor,
        mdQ: cute.Tensor,
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
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        partial_keys: cutlass.Int32,
        aux_flags: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        self.body(mQ, mK, mV, mdO, mLSE, mDelta, mdQ, mCuQ, mCuK, mUsedQ, mUsedK, score_mul, cap_mul, dscale,
                  window_left, window_right, bottom_right, sQ_layout, sK_layout, copy_in, copy_out, tiled_mma,
                  SharedStorage, (mdLSE, partial_keys),
                  (mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum, aux_flags, mSlopes))


BwdDQ.aux_class = BwdDQAux
