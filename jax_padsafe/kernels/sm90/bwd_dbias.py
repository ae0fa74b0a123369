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
  for every pair of the tile, is read into registers once per tile; the next active pair is found, and its row
  statistics loaded, under the current pair's GEMMs (a pair's work is short: its latencies, not its FLOPs, set
  the pace).
* A pair whose tile lies wholly inside its valid rectangle, with every cell visible (no mask cell hides one, no
  window or causal edge crosses it: bounds.tile_interior, aux_scores.tile_plain) and no ALiBi term, takes a path
  without tests or selects: the score FFMA as the general path forms it, P from bwd_scores.probs_exact_interior,
  and dS added to the accumulator as it is formed; no cell there needs a select (its Q, dO, K and V rows are all
  valid).  The
  general path's per-cell tests and selects took the pair loop to 749 instructions per warp at hd64, the
  interior path 419 (H200 profile, 2026-11-29).  Which path a pair takes depends on its lengths and the mask's
  block summary only, so poison in the padding changes no bit.
* Several tiles per CTA (`tiles_per_cta`, strided over the grid, m-block fastest): the producer loads the next
  tile's pairs while the consumers finish and store the current one, and the launch and pipeline fill are paid
  once per CTA instead of once per tile (a [1, N, T, S] bias over a batch of 4 gives a tile only 4 pairs).

Pad-safety under TMA (TMA zero-fills only outside the whole tensor; rows past a sequence's valid length inside
it hold anything): Q / dO rows past q_len reach only S / dP rows whose P and dS are 0 by select (the row
statistics are read for valid rows only), K / V rows past k_len only S / dP columns that the visibility rule
turns into P = 0, dS = 0 by select.  No GEMM multiplies dS or P by an operand afterwards, so nothing needs
zeroing in shared memory: a poisoned value never leaves the score it lands in, and the select drops it.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import aux_scores, bounds, bwd_scores, dbias_pairs, masking
from . import common as sc


class TileSchedule(NamedTuple):
    """The CTA's tiles: blockIdx.x + j * gridDim.x for j < tiles_per_cta, of `total` numbered m-block fastest
    (n_m per key tile), then key tile (n_n per slice), then (bx, hx) slice."""
    n_m: cutlass.Int32
    n_n: cutlass.Int32
    total: cutlass.Int32
    tiles_per_cta: cutlass.Int32


class BwdDBiasSm90:
    """dbias for (block_m x block_n) tiles of the (bx, hx) slices of the live dbias tensor."""

    # Tiles per CTA = clamp(total tiles // multi_tile_min_tiles, 1, max_tiles_per_cta): one CTA-wave of 132 SMs
    # x 2 per extra tile (a host-side performance choice; the device code is the same), as in the forward.
    multi_tile_min_tiles = 264
    max_tiles_per_cta = 8

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

        # The tiles of every (bx, hx) slice of the live dbias tensor (the placeholder's Bx * Hx is 1), numbered
        # m-block fastest, then key tile, then slice; CTA c takes tiles c + j * gridDim.x, j < tiles_per_cta.
        slices = cutlass.max(cute.size(mdBias.shape[0]) * cute.size(mdBias.shape[1]),
                             cute.size(mdBias32.shape[0]) * cute.size(mdBias32.shape[1]))
        n_m = cute.ceil_div(max_seqlen_q, BM)
        n_n = cute.ceil_div(max_seqlen_k, BN)
        total = n_m * n_n * slices
        tiles_per_cta = cutlass.max(cutlass.min(total // self.multi_tile_min_tiles, self.max_tiles_per_cta), 1)
        grid = (cute.ceil_div(total, tiles_per_cta), 1, 1)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mDelta, mCuQ, mCuK, mUsedQ, mUsedK, mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum,
            mSlopes, mdBias, mdBias32, score_mul, window_left, window_right, bottom_right, aux_flags,
            cute.size(mQ.shape[1]), cute.size(mK.shape[1]), n_m, n_n, total, tiles_per_cta, sQ_layout, sK_layout,
            mma_s, stage_bytes, SharedStorage,
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
        n_m: cutlass.Int32,
        n_n: cutlass.Int32,
        total: cutlass.Int32,
        tiles_per_cta: cutlass.Int32,
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
        pair_in = (mCuQ, mCuK, mUsedQ, mUsedK, mMask, mBias, mBias32, mTileMap, mRowRange, mSlopes, mdBias, mdBias32,
                   aux_flags, window_left, window_right, bottom_right, num_heads)
        sched = TileSchedule(n_m, n_n, total, tiles_per_cta)

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
                self.produce(tmas, sQ, sdO, sK, sV, pipe, pair_in, sched, num_heads // num_kv_heads)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(sQ, sdO, sK, sV, pipe, pair_in, sched, mma_s, mRowMax, mLogSum, mDelta, mdBias, mdBias32,
                         score_mul, aux_flags)

    @cute.jit
    def tile_pairs(self, j: cutlass.Int32, pair_in, sched: TileSchedule):
        """(present, pairs) of the CTA's j-th tile: tile blockIdx.x + j * gridDim.x of the numbering in
        `__call__`; `present` is False past the last tile (its pairs are then those of tile 0, unused)."""
        n_m, n_n, total = sched.n_m, sched.n_n, sched.total
        t = cute.arch.block_idx()[0] + j * cute.arch.grid_dim()[0]
        present = t < total
        t = cutlass.min(t, total - 1)
        m_block = t % n_m
        rest = t // n_m
        args = dbias_pairs.make(*pair_in, m_block, rest % n_n, rest // n_n)
        return present, args

    @cute.jit
    def produce(self, tmas, sQ, sdO, sK, sV, pipe, pair_in, sched: TileSchedule, group: cutlass.Int32):
        """Producer warp: for each tile of the CTA, each active pair's Q, dO (query tile) and K, V (key tile) into
        the next stage; the stages run on across tiles."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for j in cutlass.range(sched.tiles_per_cta, unroll=1):
            present, args = self.tile_pairs(j, pair_in, sched)
            if present:
                state = self.produce_tile(tmas, sQ, sdO, sK, sV, pipe, state, args, group)

    @cute.jit
    def produce_tile(self, tmas, sQ, sdO, sK, sV, pipe, state, args: dbias_pairs.Pairs, group: cutlass.Int32):
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V = tmas
        # The tile's bias into L2: the producer runs a stage or more ahead of the consumers, whose once-per-tile
        # bias read (clamped to the tensor, not to a pair's lengths: so is the prefetch) then hits L2.
        view = dbias_pairs.pair_view(args.b_first, args.h_first, args)
        aux_scores.prefetch_bias_l2(view, args.m_block, args.n_block, BM, BN, (args.m_block + 1) * BM, view.width)
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
        return state

    @cute.jit
    def consume(self, sQ, sdO, sK, sV, pipe, pair_in, sched: TileSchedule, mma_s, mRowMax, mLogSum, mDelta, mdBias,
                mdBias32, score_mul, aux_flags):
        """Consumer warpgroups: per tile of the CTA, acc_dB += dS of every active pair, then the tile's store."""
        BM, BN = self.block_m, self.block_n
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)

        mma_s0 = sc.make_mma(self.dtype, 2, BM // 2, BN, b_major_mn=False, a_from_regs=False)
        mma_s0.set(warpgroup.Field.ACCUMULATE, False)
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        wg_s = mma_s.get_slice(wg * 128)
        thr_s = mma_s.get_slice(tidx)
        frags = (wg_s.make_fragment_A(wg_s.partition_A(sQ)), wg_s.make_fragment_A(wg_s.partition_A(sdO)),
                 wg_s.make_fragment_B(wg_s.partition_B(sK)), wg_s.make_fragment_B(wg_s.partition_B(sV)))
        s_shape = thr_s.partition_shape_C((BM, BN))
        accs = (cute.make_rmem_tensor(s_shape, cutlass.Float32), cute.make_rmem_tensor(s_shape, cutlass.Float32),
                cute.make_rmem_tensor(s_shape, cutlass.Float32))
        cS_mn = masking.acc_mn_view_sm90(thr_s.partition_C(cute.make_identity_tensor((BM, BN))))
        n_rows = cute.size(cS_mn, mode=[0])
        # This pair's row max, ln l * log2(e) and Delta, and the next active pair's as loaded (under the current
        # pair's GEMMs).
        stats = tuple(cute.make_rmem_tensor((n_rows,), cutlass.Float32) for _ in range(6))
        bias_mn = masking.acc_mn_view_sm90(cute.make_rmem_tensor(s_shape, cutlass.Float32))
        ops = (pipe, mma_s0, mma_s, frags, mRowMax, mLogSum, mDelta, cS_mn, score_mul, aux_flags)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        for j in cutlass.range(sched.tiles_per_cta, unroll=1):
            present, args = self.tile_pairs(j, pair_in, sched)
            if present:
                state = self.consume_tile(ops, state, args, accs, stats, bias_mn)
                dbias_pairs.store_tile(accs[2], masking.acc_mn_view_sm90, cS_mn, mdBias, mdBias32, aux_flags,
                                       args.bx, args.hx, args.m_block * BM, args.n_block * BN)

    @cute.jit
    def consume_tile(self, ops, state, args: dbias_pairs.Pairs, accs, stats, bias_mn):
        """acc_dB (accs[2]) = the sum of dS over the tile's active pairs; returns the pipeline state."""
        BM, BN = self.block_m, self.block_n
        pipe, mma_s0, mma_s, frags, mRowMax, mLogSum, mDelta, cS_mn, score_mul, aux_flags = ops
        tSrQ, tSrdO, tSrK, tSrV = frags
        acc_S, acc_dP, acc_dB = accs
        row_max, log_sum2, delta, next_max, next_sum2, next_delta = stats
        m_block, n_block = args.m_block, args.n_block
        m0 = m_block * BM
        n0 = n_block * BN
        s_mn = masking.acc_mn_view_sm90(acc_S)
        dp_mn = masking.acc_mn_view_sm90(acc_dP)
        db_mn = masking.acc_mn_view_sm90(acc_dB)
        acc_dB.fill(0.0)
        # The first pair's row statistics, then the bias tile, the same for every pair of the tile (they all map
        # to its slice; read once): both in flight together, so the tile's start waits for one round trip.
        p = dbias_pairs.next_active(cutlass.Int32(0), args, BM, BN)
        if p < args.n_pairs:
            self.load_stats(p, args, mRowMax, mLogSum, mDelta, m0, cS_mn, next_max, next_sum2, next_delta)
        aux_scores.load_bias(bias_mn, cS_mn, dbias_pairs.pair_view(args.b_first, args.h_first, args), m0, n0)
        while p < args.n_pairs:
            b, h, q_start, q_len, _, k_len, off, left, right = dbias_pairs.pair_bounds(p, args)
            view = dbias_pairs.pair_view(b, h, args)
            # The statistics loaded a pair ago, the empty-row rule applied here, where they have landed.
            bwd_scores.finish_row_stats_exact(next_max, next_sum2, next_delta, row_max, log_sum2, delta)
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
            need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
            # Uniform over the CTA: the whole tile inside the pair's valid rectangle (and the bias's columns),
            # every cell visible (the backward's interior path), and no ALiBi term: its scores are the bias FFMA.
            interior = (bounds.tile_interior(m_block, BM, q_len, need) and aux_scores.tile_plain(view, cls, n0 + BN)
                        and (aux_flags & aux_scores.FLAG_ALIBI) == 0)
            warpgroup.wait_group(1)
            if interior:
                # The score FFMA as aux_scores.scores forms it inside the rectangle, without its tests.
                for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                        s_mn[r, c] = cute.math.fma(s_mn[r, c], score_mul, bias_mn[r, c])
                bwd_scores.probs_exact_interior(s_mn, row_max, log_sum2, 0)
            else:
                # Natural-unit scores, then P with the visibility rule; a HIDDEN tile inside the range gives P = 0.
                aux_scores.scores(s_mn, cS_mn, view, m0, n0, q_len, k_len, score_mul, cls, 0, bias_mn,
                                  map_group=sc.map_group(0))
                bwd_scores.probs_exact(s_mn, cS_mn, row_max, log_sum2, m0, n0, k_len, off, left, right, need, 0)
            warpgroup.wait_group(0)
            # Both GEMMs have read the stage: the producer may refill it while dS is formed.
            pipe.consumer_release(state)
            state.advance()
            if interior:
                # dbias += dS in one FFMA per cell (dscores_interior's dS, added as it is formed).
                for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                        db_mn[r, c] = db_mn[r, c] + s_mn[r, c] * (dp_mn[r, c] - delta[r])
            else:
                # dS = P * (dP - Delta), 0 by select wherever P = 0 (no softcap in the aux kinds).
                bwd_scores.dscores(s_mn, dp_mn, dp_mn, delta, 0, False)
                acc_dB.store(acc_dB.load() + acc_dP.load())
            p = q
        return state

    @cute.jit
    def load_stats(self, p, args: dbias_pairs.Pairs, mRowMax, mLogSum, mDelta, m0, cS_mn, raw_max, raw_log_sum,
                   raw_delta):
        """Pair p's forward row max, ln l and Delta as stored, for valid rows only (finished where used)."""
        _, h, q_start, q_len, _, _, _, _, _ = dbias_pairs.pair_bounds(p, args)
        bwd_scores.load_row_stats_exact_raw(mRowMax, mLogSum, mDelta, h, q_start, q_len, m0, cS_mn, raw_max,
                                            raw_log_sum, raw_delta, 0)
