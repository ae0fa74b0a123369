"""Hopper backward, dbias kernel (`BwdDBiasSm90`): the gradient of an additive bias for the "bias" kind.

The same computation, walk and exported ABI as the SM80-class `sm80.bwd_dbias.BwdDBias` (see it for why dbias
is a kernel of its own): one CTA owns one (block_m x block_n) tile of one (bx, hx) slice of dbias and sums dS
over the (sequence, query head) pairs that map to it, in the fixed order of `dbias_pairs` (no atomics, no
T x S scratch, every cell of the tile inside the tensor written once).  What differs is how the two GEMMs per
pair run:

* Warpgroup 0 is the producer: one warp walks the active pairs and loads each one's Q and dO rows of the
  query tile and K and V rows of the key tile with TMA into one stage of a `num_stages`-deep pipeline
  (PipelineTmaAsync), so the next pairs' tiles land while the current one is computed.
* Warpgroups 1 and 2 consume, each owning 64 of the tile's rows: S = Q K^T and dP = dO V^T as two wgmma
  groups (both operands in shared memory); while dP runs, S becomes natural-unit scores with the mask, the
  bias and ALiBi (aux_scores.scores) and P comes from the forward's row max and ln l (bwd_scores.probs_exact);
  then dS = P (dP - Delta) by select, added to the fp32 dbias accumulator in registers.  The bias tile, the same
  for every pair of the CTA, is read into registers once; the next active pair is found, and its row statistics
  loaded, under the current pair's GEMMs (a pair's work is short: its latencies, not its FLOPs, set the pace).

Pad-safety under TMA (TMA zero-fills only outside the whole tensor; rows past a sequence's valid length inside
it hold anything): Q / dO rows past q_len reach only S / dP rows whose P and dS are 0 by select (the row
statistics are read for valid rows only), K / V rows past k_len only S / dP columns that the visibility rule
turns into P = 0, dS = 0 by select.  No GEMM multiplies dS or P by an operand afterwards, so nothing needs
zeroing in shared memory: a poisoned value never leaves the score it lands in, and the select drops it.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import aux_scores, bounds, bwd_scores, dbias_pairs, masking
from . import common as sc


class BwdDBiasSm90:
    """dbias for one (block_m x block_n) tile of one (bx, hx) slice of the live dbias tensor."""

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_stages: int):
        assert head_dim % 16 == 0 and block_m == 128 and block_n % 16 == 0
        assert block_m % aux_scores.MAP_ROWS == 0 and block_n % aux_scores.MAP_COLS == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.block_n = block_n
        self.num_stages = num_stages
        self.num_consumer_threads = 256  # two warpgroups of 64 rows each
        self.num_threads = 128 + self.num_consumer_threads
        self.producer_regs = 24
        self.consumer_regs = 240

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
        dt = self.dtype
        BM, BN, HD, stages = self.block_m, self.block_n, self.head_dim, self.num_stages
        sQ_layout = sc.smem_layout(dt, BM, HD, stages)
        sK_layout = sc.smem_layout(dt, BN, HD, stages)
        q_box = cute.select(sQ_layout, mode=[0, 1])
        k_box = cute.select(sK_layout, mode=[0, 1])
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mQ), q_box, (BM, HD), 1)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mdO), q_box, (BM, HD), 1)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mK), k_box, (BN, HD), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mV), k_box, (BN, HD), 1)
        stage_bytes = 2 * cute.size_in_bytes(dt, q_box) + 2 * cute.size_in_bytes(dt, k_box)
        # S / dP: (queries, keys), A = Q / dO, B = K / V (shared memory, both K-major).
        mma_s = sc.make_mma(dt, 2, BM // 2, BN, b_major_mn=False, a_from_regs=False)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]

        # One CTA per tile of each (bx, hx) slice of the live dbias tensor (the placeholder's Bx * Hx is 1).
        slices = cutlass.max(cute.size(mdBias.shape[0]) * cute.size(mdBias.shape[1]),
                             cute.size(mdBias32.shape[0]) * cute.size(mdBias32.shape[1]))
        grid = (cute.ceil_div(max_seqlen_q, BM), cute.ceil_div(max_seqlen_k, BN), slices)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mDelta, mCuQ, mCuK, mUsedQ, mUsedK, mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum,
            mSlopes, mdBias, mdBias32, score_mul, window_left, window_right, bottom_right, aux_flags,
            cute.size(mQ.shape[1]), cute.size(mK.shape[1]), sQ_layout, sK_layout, mma_s, stage_bytes,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
                 min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        tma_dO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
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
        num_heads: cutlass.Int32,
        num_kv_heads: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        mma_s: cute.TiledMma,
        stage_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_dO)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)
        m_block, n_block, slice_idx = cute.arch.block_idx()
        args = dbias_pairs.make(mCuQ, mCuK, mUsedQ, mUsedK, mMask, mBias, mBias32, mTileMap, mRowRange, mSlopes,
                                mdBias, mdBias32, aux_flags, window_left, window_right, bottom_right, num_heads,
                                m_block, n_block, slice_idx)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32),
            tx_count=stage_bytes, defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                tmas = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V)
                self.produce(tmas, sQ, sdO, sK, sV, pipe, args, num_heads // num_kv_heads)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(sQ, sdO, sK, sV, pipe, args, mma_s, mRowMax, mLogSum, mDelta, mdBias, mdBias32,
                         score_mul, aux_flags)

    @cute.jit
    def produce(self, tmas, sQ, sdO, sK, sV, pipe, args: dbias_pairs.Pairs, group: cutlass.Int32):
        """Producer warp: each active pair's Q, dO (query tile) and K, V (key tile) into the next stage."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V = tmas
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        p = dbias_pairs.next_active(cutlass.Int32(0), args, BM, BN)
        while p < args.n_pairs:
            _, h, q_start, _, k_start, _, _, _, _ = dbias_pairs.pair_bounds(p, args)
            h_kv = h // group
            gQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_Q[None, None, h]), (BM, HD), (args.m_block, 0))
            gdO = cute.local_tile(cute.domain_offset((q_start, 0), tma_dO[None, None, h]), (BM, HD),
                                  (args.m_block, 0))
            gK = cute.local_tile(cute.domain_offset((k_start, 0), tma_K[None, None, h_kv]), (BN, HD),
                                 (args.n_block, 0))
            gV = cute.local_tile(cute.domain_offset((k_start, 0), tma_V[None, None, h_kv]), (BN, HD),
                                 (args.n_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tOsO, tOgO = cpasync.tma_partition(tma_atom_dO, 0, cute.make_layout(1), cute.group_modes(sdO, 0, 2),
                                               cute.group_modes(gdO, 0, 2))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                               cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ[None, state.index], tma_bar_ptr=bar)
            cute.copy(tma_atom_dO, tOgO, tOsO[None, state.index], tma_bar_ptr=bar)
            cute.copy(tma_atom_K, tKgK, tKsK[None, state.index], tma_bar_ptr=bar)
            cute.copy(tma_atom_V, tVgV, tVsV[None, state.index], tma_bar_ptr=bar)
            state.advance()
            p = dbias_pairs.next_active(p + 1, args, BM, BN)

    @cute.jit
    def consume(self, sQ, sdO, sK, sV, pipe, args: dbias_pairs.Pairs, mma_s, mRowMax, mLogSum, mDelta, mdBias,
                mdBias32, score_mul, aux_flags):
        """Consumer warpgroups: acc_dB += dS of every active pair, then the tile's store."""
        BM, BN = self.block_m, self.block_n
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        m_block, n_block = args.m_block, args.n_block
        m0 = m_block * BM
        n0 = n_block * BN

        mma_s0 = sc.make_mma(self.dtype, 2, BM // 2, BN, b_major_mn=False, a_from_regs=False)
        mma_s0.set(warpgroup.Field.ACCUMULATE, False)
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        wg_s = mma_s.get_slice(wg * 128)
        thr_s = mma_s.get_slice(tidx)
        tSrQ = wg_s.make_fragment_A(wg_s.partition_A(sQ))
        tSrdO = wg_s.make_fragment_A(wg_s.partition_A(sdO))
        tSrK = wg_s.make_fragment_B(wg_s.partition_B(sK))
        tSrV = wg_s.make_fragment_B(wg_s.partition_B(sV))
        s_shape = thr_s.partition_shape_C((BM, BN))
        acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_dB = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_dB.fill(0.0)
        cS_mn = masking.acc_mn_view_sm90(thr_s.partition_C(cute.make_identity_tensor((BM, BN))))
        n_rows = cute.size(cS_mn, mode=[0])
        row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        log_sum2 = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        delta = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        s_mn = masking.acc_mn_view_sm90(acc_S)
        dp_mn = masking.acc_mn_view_sm90(acc_dP)

        # The bias tile is the same for every pair of the CTA (they all map to its slice): read once.
        bias_mn = masking.acc_mn_view_sm90(cute.make_rmem_tensor(s_shape, cutlass.Float32))
        aux_scores.load_bias(bias_mn, cS_mn, dbias_pairs.pair_view(args.b_first, args.h_first, args), m0, n0)
        # The next pair's row statistics are loaded while the current pair is computed.
        next_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        next_sum2 = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        next_delta = cute.make_rmem_tensor((n_rows,), cutlass.Float32)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        p = dbias_pairs.next_active(cutlass.Int32(0), args, BM, BN)
        if p < args.n_pairs:
            self.load_stats(p, args, mRowMax, mLogSum, mDelta, m0, cS_mn, next_max, next_sum2, next_delta)
        while p < args.n_pairs:
            b, h, q_start, q_len, _, k_len, off, left, right = dbias_pairs.pair_bounds(p, args)
            view = dbias_pairs.pair_view(b, h, args)
            row_max.store(next_max.load())
            log_sum2.store(next_sum2.load())
            delta.store(next_delta.load())
            pipe.consumer_wait(state)
            stage = state.index
            sc.gemm(mma_s0, mma_s, acc_S, tSrQ[None, None, None, stage], tSrK[None, None, None, stage], True)
            sc.gemm(mma_s0, mma_s, acc_dP, tSrdO[None, None, None, stage], tSrV[None, None, None, stage], True)
            # Under the GEMMs: the next active pair and the loads of its statistics, and this tile's mask class
            # (its map loads; every lane of each warp: it votes).
            q = dbias_pairs.next_active(p + 1, args, BM, BN)
            if q < args.n_pairs:
                self.load_stats(q, args, mRowMax, mLogSum, mDelta, m0, cS_mn, next_max, next_sum2, next_delta)
            cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
            warpgroup.wait_group(1)
            # Natural-unit scores, then P with the visibility rule; a HIDDEN tile inside the range gives P = 0.
            aux_scores.scores(s_mn, cS_mn, view, m0, n0, q_len, k_len, score_mul, cls, 0, bias_mn,
                              map_group=sc.map_group(0))
            need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
            bwd_scores.probs_exact(s_mn, cS_mn, row_max, log_sum2, m0, n0, k_len, off, left, right, need, 0)
            warpgroup.wait_group(0)
            # Both GEMMs have read the stage: the producer may refill it while dS is formed.
            pipe.consumer_release(state)
            state.advance()
            # dS = P * (dP - Delta), 0 by select wherever P = 0 (no softcap in the aux kinds).
            bwd_scores.dscores(s_mn, dp_mn, dp_mn, delta, 0, False)
            acc_dB.store(acc_dB.load() + acc_dP.load())
            p = q

        if (aux_flags & aux_scores.FLAG_BIAS) != 0:
            rB = cute.make_fragment_like(acc_dB, self.dtype)
            rB.store(acc_dB.load().to(self.dtype))
            dbias_pairs.store(masking.acc_mn_view_sm90(rB), cS_mn, mdBias, args.bx, args.hx, m0, n0)
        elif (aux_flags & aux_scores.FLAG_BIAS32) != 0:
            dbias_pairs.store(masking.acc_mn_view_sm90(acc_dB), cS_mn, mdBias32, args.bx, args.hx, m0, n0)

    @cute.jit
    def load_stats(self, p, args: dbias_pairs.Pairs, mRowMax, mLogSum, mDelta, m0, cS_mn, row_max, log_sum2, delta):
        """Pair p's forward row max and ln l (log_sum2 holds ln l * log2 e) and Delta, for valid rows only."""
        _, h, q_start, q_len, _, _, _, _, _ = dbias_pairs.pair_bounds(p, args)
        bwd_scores.load_row_stats_exact(mRowMax, mLogSum, mDelta, h, q_start, q_len, m0, cS_mn, row_max, log_sum2,
                                        delta, 0)
