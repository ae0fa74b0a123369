"""Hopper backward, dQ kernel (`BwdDQSm90`); see bwd_base for the backward's structure."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import aux_scores, bias_stage, bounds, bwd_scores, dq_shift, masking, tile_queue, tile_schedule, tiles
from . import bwd_aux
from . import common as sc
from .bwd_base import BAR_CONSUMERS, BAR_WG_BASE, Sm90BwdBase


class BwdDQSm90(Sm90BwdBase):
    """dQ for one query tile of block_m = 2 x 64 queries of one head."""

    def __new__(cls, *args, aux=False, **kwargs):
        # The aux variants' __call__ takes more arguments (the aux ABI, the same for both kinds); cute.compile
        # traces the class's __call__, so those variants are a subclass that only adds its own.
        if aux and cls is BwdDQSm90:
            cls = BwdDQSm90Aux
        return super().__new__(cls)

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_stages: int, has_softcap: bool, *,
                 pin_waits: bool, queue_dense: bool, aux=False):
        super().__init__(dtype, head_dim, block_m, block_n, num_stages, has_softcap, aux)
        assert block_m == 128
        # The wait for dP pinned after P (common.wgmma_wait_after): ptxas issues it after ~9 of the 32
        # exp2 otherwise, so most of P is computed after dP is complete instead of under it.
        self.pin_waits = pin_waits
        # Every layout takes the queued compact schedule, dense ones too (as BwdDKDVSm90.queue_dense).
        self.queue_dense = queue_dense
        # The queued kernel stages dQ through a tile of its own (32 KB at head dim 128), so a tile's Q / dO can
        # be released, and the next tile's loaded, before its epilogue; not above head dim 128 (no room).
        self.separate_out = head_dim <= 128
        # "bias": the consumer warpgroups stage each key tile's bias in shared memory a tile ahead
        # (common/bias_stage.py) where its two buffers fit (36 KB at 128 x 64: every head dim up to 128).
        elem = dtype.width // 8
        smem_used = elem * (2 * block_m * head_dim + 2 * num_stages * block_n * head_dim
                            + (block_m * head_dim if self.separate_out else 0))
        self.stage_bias = (self.aux == "bias"
                           and smem_used + elem * bias_stage.smem_elems(block_m, block_n) + 4096 <= 227 * 1024)

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
        mTileCounter: cute.Tensor,
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
        self._launch(mQ, mK, mV, mdO, mLSE, mDelta, mdLSE, mdQ, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, score_mul,
                     cap_mul, dscale, window_left, window_right, bottom_right, max_seqlen_q, partial_keys, stream,
                     None)

    @cute.jit
    def _launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                mDelta: cute.Tensor, mdLSE: cute.Tensor, mdQ: cute.Tensor, mCuQ: cute.Tensor, mCuK: cute.Tensor,
                mUsedQ: cute.Tensor, mUsedK: cute.Tensor, mTileCounter: cute.Tensor, score_mul: cutlass.Float32,
                cap_mul: cutlass.Float32, dscale: cutlass.Float32, window_left: cutlass.Int32,
                window_right: cutlass.Int32, bottom_right: cutlass.Int32, max_seqlen_q: cutlass.Int32,
                partial_keys: cutlass.Int32, stream: cuda.CUstream, aux):
        """The launch, shared by both variants' __call__; `aux`: the aux variant's bwd_aux.BwdAux, else None
        (the kernel then takes it as one more argument after `compact`)."""
        extra = ()
        if cutlass.const_expr(aux is not None):
            extra = (aux,)
        dt = self.dtype
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        sQ_layout = sc.smem_layout(dt, BM, HD)
        sK_layout = sc.smem_layout(dt, BN, HD, self.num_stages)
        k_box = cute.select(sK_layout, mode=[0, 1])
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mQ), sQ_layout, (BM, HD))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mdO), sQ_layout, (BM, HD))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mK), k_box, (BN, HD), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mV), k_box, (BN, HD), 1)
        q_bytes = cute.size_in_bytes(dt, sQ_layout)
        k_bytes = cute.size_in_bytes(dt, k_box)
        # S / dP: (queries, keys), A = Q / dO, B = K / V (shared memory, both K-major).
        mma_s = sc.make_mma(dt, 2, BM // 2, BN, b_major_mn=False, a_from_regs=False)
        # dQ: (queries, head_dim), A = dS from registers, B = K^T (MN-major).
        mma_q = sc.make_mma(dt, 2, BM // 2, HD, b_major_mn=True, a_from_regs=True)
        copy_out = tiles.gmem_tiled_copy(dt, HD, self.num_consumer_threads, async_copy=False)
        stages = self.num_stages

        @cute.struct
        class SharedStorage:
            mbar_res: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_str: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            # The compact kernel's tile queue (tile_queue): two slots of (tile number, sequence, query tile,
            # head), their barriers.
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            sSlots: cute.struct.MemRange[cutlass.Int32, 2 * 4]
            # dQ's reference key (dq_shift.reference_key), float32 per column.
            sKref: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, HD], 16]
            # The staged bias's two buffers (bias_stage).
            sBias: cute.struct.Align[cute.struct.MemRange[
                dt, bias_stage.smem_elems(BM, BN) if self.stage_bias else 0], 128]

        group = cute.size(mQ.shape[1]) // cute.size(mK.shape[1])
        # Query tiles: dense (ceil(max_seqlen_q / BM) per sequence) or, where that launches at least twice as
        # many CTAs, compact (tile_schedule.compact_tile), each its own kernel (see FlashFwdSm90.__call__).
        batch, total_q = cute.size(mUsedQ.shape[0]), cute.size(mQ.shape[0])
        args = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
                mLSE, mDelta, mdQ, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, group,
                score_mul, cap_mul, dscale, window_left, window_right, bottom_right, (mdLSE, partial_keys),
                sQ_layout, sK_layout, mma_s, mma_q, copy_out, q_bytes, k_bytes, SharedStorage)
        heads = cute.size(mQ.shape[1])
        # The dQ staging tile (`kernel`) of the compact kernel.
        compact = (args, max_seqlen_q, total_q, heads, batch, BM, q_bytes, SharedStorage, stream, extra)
        if cutlass.const_expr(self.queue_dense):
            self._launch_compact(*compact)
        else:
            if tile_schedule.use_compact_grid(max_seqlen_q, total_q, batch, BM) != 0:
                self._launch_compact(*compact)
            else:
                self.kernel(*args, False, *extra).launch(
                    grid=tile_schedule.tile_grid(False, max_seqlen_q, total_q, heads, batch, BM),
                    block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
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
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdQ: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mTileCounter: cute.Tensor,
        group: cutlass.Int32,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        shift_args,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        mma_s: cute.TiledMma,
        mma_q: cute.TiledMma,
        copy_out: cute.TiledCopy,
        q_bytes: cutlass.Constexpr,
        k_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
        compact: cutlass.Constexpr,
        aux=None,
    ):
        BM, HD = self.block_m, self.head_dim
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_dO)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        queue = None
        if cutlass.const_expr(compact):
            # The producer warp claims query tiles and publishes them decoded.
            queue = tile_queue.create(storage.mbar_tile.data_ptr(),
                                      storage.sSlots.get_tensor(cute.make_layout((2, 4), stride=(4, 1))),
                                      mTileCounter, self.num_consumer_threads)
        pipe_q, pipe_kv = self._pipes(storage, 2 * q_bytes, 2 * k_bytes)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # (mdLSE, partial_keys, dQ's reference key in shared memory): see consume.
        shift_args = (shift_args[0], shift_args[1], storage.sKref.get_tensor(cute.make_layout(HD)))
        tmas = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V)
        seqs = (mCuQ, mCuK, mUsedQ, mUsedK, window_left, window_right, bottom_right)
        sBias = None
        if cutlass.const_expr(self.stage_bias):
            sBias = storage.sBias.get_tensor(bias_stage.layout(self.block_m, self.block_n))

        if cutlass.const_expr(compact):
            # Compact tiles per head (tile_schedule.compact_tiles_per_head) x heads, each head's highest tile first.
            num_heads = cute.size(mLSE.shape[0])
            per_head = cute.size(mLSE.shape[1]) // BM + cute.size(mUsedQ.shape[0])
            sched = (per_head, num_heads, group, cute.size(mUsedQ.shape[0]))
            sOut = None
            if cutlass.const_expr(self.separate_out):
                sOut = smem.allocate_tensor(self.dtype, sQ_layout.outer, 1024, sQ_layout.inner)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.produce_claimed(tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, seqs, queue, sched, aux)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume_claimed(sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out,
                                     score_mul, cap_mul, dscale, seqs, queue, sched, sOut, shift_args, aux, sBias)
        else:
            m_block_rev, head, batch = cute.arch.block_idx()
            # Highest query tiles first: under causal masks they visit the most key tiles (the order of CTAs
            # changes no bit of any result).
            m_block = cute.arch.grid_dim()[0] - 1 - m_block_rev
            tb = self.query_bounds(seqs, batch, m_block, head, aux)
            head_kv = head // group
            m0 = m_block * BM
            # A query tile past q_len, or one whose queries see no key: dQ = 0, written for the tile's rows up
            # to the slot end (the handler's memset may have done so already); nothing is computed.
            if m0 < tb.q_len and tb.hi > tb.lo:
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp_idx == 0:
                        self.produce_tile(tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv,
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                                       self.num_stages),
                                          m_block, head, head_kv, tb.q_start, tb.k_start, tb.lo, tb.hi,
                                          self.bias_tile(aux, batch, head, tb))
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    self.consume(sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out,
                                 score_mul, cap_mul, dscale, m_block, head, tb,
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages),
                                 False, None, shift_args, aux, batch, sBias)
            else:
                tidx, _, _ = cute.arch.thread_idx()
                if tidx < self.num_consumer_threads:
                    gdQ = cute.local_tile(cute.domain_offset((tb.q_start, 0), mdQ[None, head, None]), (BM, HD),
                                          (m_block, 0))
                    sc.zero_rows_global(self.dtype, BM, HD, copy_out, gdQ, m0, tb.slot, tidx)
                    dq_shift.zero_row_sums(mDelta, head, tb.q_start, tb.q_len, m0, BM, tidx,
                                           self.num_consumer_threads, shift_args[1])

    @cute.jit
    def query_bounds(self, seqs, batch, m_block, head, aux):
        """bounds.TileBounds of query tile m_block; aux: its key tiles [lo, hi) narrowed by head `head`'s mask
        (bwd_aux.dq_range).  Where the producer and the consumers each decide whether the tile has work and which
        key tiles it visits, they call this on the same values, so both walk the same tiles; a tile left with an
        empty range writes zeros, as an empty tile does without aux."""
        tb = bounds.query_tile(*seqs, batch, m_block, self.block_m, self.block_n)
        if cutlass.const_expr(aux is not None):
            tb = bwd_aux.dq_range(aux, tb, batch, head, m_block, self.block_m, self.block_n)
        return tb

    @cute.jit
    def produce_tile(self, tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, state_q, state, m_block, head, head_kv, q_start,
                     k_start, n_min, n_max, bias_tile=None):
        """Producer warp: the loads of one query tile (K / V of its first key tile, Q / dO, the other key
        tiles in decreasing order).  `bias_tile` (the "bias" kind: bias_tile()'s) prefetches each key tile's
        bias into L2 with its K / V loads.  Returns the advanced pipeline states."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V = tmas
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_Q[None, None, head]), (BM, HD), (m_block, 0))
        gdO = cute.local_tile(cute.domain_offset((q_start, 0), tma_dO[None, None, head]), (BM, HD), (m_block, 0))
        gK = cute.local_tile(cute.domain_offset((k_start, 0), tma_K[None, None, head_kv]), (BN, HD), (None, 0))
        gV = cute.local_tile(cute.domain_offset((k_start, 0), tma_V[None, None, head_kv]), (BN, HD), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_dO, 0, cute.make_layout(1), cute.group_modes(sdO, 0, 2),
                                           cute.group_modes(gdO, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        # K/V of the first (= last in key order) tile, then Q/dO.
        pipe_kv.producer_acquire(state)
        cute.copy(tma_atom_K, tKgK[None, n_max - 1], tKsK[None, state.index],
                  tma_bar_ptr=pipe_kv.producer_get_barrier(state))
        cute.copy(tma_atom_V, tVgV[None, n_max - 1], tVsV[None, state.index],
                  tma_bar_ptr=pipe_kv.producer_get_barrier(state))
        self.prefetch_bias(bias_tile, m_block, n_max - 1)
        state.advance()
        # (With the queue, this waits until the consumers have stored the previous tile's dQ through sQ.)
        pipe_q.producer_acquire(state_q)
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(state_q))
        cute.copy(tma_atom_dO, tOgO, tOsO, tma_bar_ptr=pipe_q.producer_get_barrier(state_q))
        state_q.advance()
        for it in cutlass.range(n_max - n_min - 1, unroll=1):
            n = n_max - 2 - it
            pipe_kv.producer_acquire(state)
            cute.copy(tma_atom_K, tKgK[None, n], tKsK[None, state.index],
                      tma_bar_ptr=pipe_kv.producer_get_barrier(state))
            cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, state.index],
                      tma_bar_ptr=pipe_kv.producer_get_barrier(state))
            self.prefetch_bias(bias_tile, m_block, n)
            state.advance()
        return state_q, state

    @cute.jit
    def bias_tile(self, aux, batch, head, tb):
        """What prefetch_bias needs of a query tile: (its AuxView, q_len, k_len) in the "bias" kind, else None."""
        if cutlass.const_expr(aux is not None and self.aux == "bias"):
            return (bwd_aux.view(aux, batch, head), tb.q_len, tb.k_len)
        return None

    @cute.jit
    def prefetch_bias(self, bias_tile, m_block, n_block):
        if cutlass.const_expr(bias_tile is not None):
            aux_scores.prefetch_bias_l2(bias_tile[0], m_block, n_block, self.block_m, self.block_n, bias_tile[1],
                                        bias_tile[2])

    @cute.jit
    def claim_query_tile(self, queue, seqs, sched):
        """Producer warp: the next claimed query tile inside its sequence's slot, or the end (holes skipped:
        tile_queue.take_compact_tile; each head's highest tile first); returns (number, sequence, query tile,
        head)."""
        per_head, num_heads, _, batch_size = sched
        lin, head, batch, m_block = tile_queue.take_compact_tile(queue, per_head, num_heads, seqs[0], batch_size,
                                                                 self.block_m, True)
        return lin, batch, m_block, head

    @cute.jit
    def produce_claimed(self, tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, seqs, queue, sched, aux=None):
        """The compact kernel's producer: tiles in the order they are claimed (each head's highest query tile
        first; the heads last first), each published as (number, sequence, query tile, head), the next one
        claimed once the current one's loads are issued (as the forward's `produce_claimed`, which says why)."""
        per_head, num_heads, group, _ = sched
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        state_tile = tile_queue.producer_state()
        total = per_head * num_heads
        lin, batch, m_block, head = self.claim_query_tile(queue, seqs, sched)
        state_tile = tile_queue.publish(queue, state_tile, (lin, batch, m_block, head))
        while lin < total:
            tb = self.query_bounds(seqs, batch, m_block, head, aux)
            if m_block * self.block_m < tb.q_len and tb.hi > tb.lo:
                state_q, state = self.produce_tile(tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, state_q, state, m_block,
                                                   head, head // group, tb.q_start, tb.k_start, tb.lo, tb.hi,
                                                   self.bias_tile(aux, batch, head, tb))
            lin, batch, m_block, head = self.claim_query_tile(queue, seqs, sched)
            state_tile = tile_queue.publish(queue, state_tile, (lin, batch, m_block, head))

    @cute.jit
    def consume_claimed(self, sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out,
                        score_mul, cap_mul, dscale, seqs, queue, sched, sOut, shift_args, aux=None, sBias=None):
        """The compact kernel's consumers: the tiles the producer published, in its order, until the end; a
        tile with nothing to compute gets its zeros (rows up to the slot end)."""
        BM, HD = self.block_m, self.head_dim
        per_head, num_heads, _, _ = sched
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        state_tile = tile_queue.consumer_state()
        total = per_head * num_heads
        lin = tile_queue.peek(queue, state_tile)
        while lin < total:
            batch = tile_queue.field(queue, state_tile, 1)
            m_block = tile_queue.field(queue, state_tile, 2)
            head = tile_queue.field(queue, state_tile, 3)
            state_tile = tile_queue.release(queue, state_tile)
            tb = self.query_bounds(seqs, batch, m_block, head, aux)
            m0 = m_block * BM
            if m0 < tb.q_len and tb.hi > tb.lo:
                state_q, state = self.consume(sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q,
                                              copy_out, score_mul, cap_mul, dscale, m_block, head, tb, state_q, state,
                                              True, sOut, shift_args, aux, batch, sBias)
            else:
                gdQ = cute.local_tile(cute.domain_offset((tb.q_start, 0), mdQ[None, head, None]), (BM, HD),
                                      (m_block, 0))
                sc.zero_rows_global(self.dtype, BM, HD, copy_out, gdQ, m0, tb.slot, tidx)
                dq_shift.zero_row_sums(mDelta, head, tb.q_start, tb.q_len, m0, BM, tidx, self.num_consumer_threads,
                                       shift_args[1])
            lin = tile_queue.peek(queue, state_tile)

    @cute.jit
    def consume(self, sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out, score_mul,
                cap_mul, dscale, m_block, head, tb, state_q, state, release_q: cutlass.Constexpr, sOut=None,
                shift_args=None, aux=None, batch=None, sBias=None):
        """The consumers' part of one query tile (`tb`: its bounds.TileBounds); returns the advanced pipeline
        states.  `release_q`: free the
        Q / dO stage for the next tile: right after the last step's GEMMs where `sOut` (a staging tile of sQ's
        layout) takes dQ, else once the epilogue, staged through sQ, has read it.  `aux` (aux variants: its
        bwd_aux.BwdAux, with the tile's sequence `batch`): "bias": S becomes natural-unit scores with the head's
        mask and bias, and P comes from the forward's m and ln l; "mask": S gets -inf where the head's mask hides
        a pair, and P comes from lse as in the plain kernel (`dq_probs`).  `shift_args` (mdLSE, partial_keys,
        sKref): dQ against a reference key, and rowsum(P dP) into mDelta (dq_shift).  `sBias`: the staged bias's
        buffers (bias_stage), else None."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        q_start, q_len, _, k_len, q_slot, off, left, right, n_min, n_max = tb
        dt = self.dtype
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        m0 = m_block * BM

        mma_s0 = sc.make_mma(dt, 2, BM // 2, BN, b_major_mn=False, a_from_regs=False)
        mma_s0.set(warpgroup.Field.ACCUMULATE, False)
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        mma_q.set(warpgroup.Field.ACCUMULATE, True)
        wg_s = mma_s.get_slice(wg * 128)
        wg_q = mma_q.get_slice(wg * 128)
        thr_s = mma_s.get_slice(tidx)
        thr_q = mma_q.get_slice(tidx)
        tSrK = wg_s.make_fragment_B(wg_s.partition_B(sK))
        tSrV = wg_s.make_fragment_B(wg_s.partition_B(sV))
        tQrKt = wg_q.make_fragment_B(wg_q.partition_B(sc.transposed(sK)))
        acc_dQ = thr_q.make_fragment_C(thr_q.partition_shape_C((BM, HD)))
        acc_dQ.fill(0.0)
        s_shape = thr_s.partition_shape_C((BM, BN))
        cS_mn = masking.acc_mn_view_sm90(thr_s.partition_C(cute.make_identity_tensor((BM, BN))))
        n_rows = cute.size(cS_mn, mode=[0])
        lse2 = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        delta = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_max = None
        view = None
        if cutlass.const_expr(aux is None or self.aux == "mask"):
            bwd_scores.load_row_stats(mLSE, mDelta, head, q_start, q_len, m0, cS_mn, lse2, delta, 0)
        else:
            # The forward's exact statistics: lse2 holds ln l * log2(e), row_max m.
            row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            bwd_scores.load_row_stats_exact(aux.row_max, aux.log_sum, mDelta, head, q_start, q_len, m0, cS_mn, row_max,
                                            lse2, delta, 0)
        stage = None
        if cutlass.const_expr(aux is not None):
            view = bwd_aux.view(aux, batch, head)
        if cutlass.const_expr(self.stage_bias):
            # This warpgroup's rows of the staged bias, and the first key tile's copies, before the waits for K
            # and Q (dq_probs stages the next ones).
            rows = BM // 2
            stage = bias_stage.make(sBias, wg * rows, rows, 0, BN, BAR_WG_BASE + wg)
            if n_max > n_min:
                aux_scores.stage_bias(stage._replace(parity=(n_max - 1) % 2), view, m0, (n_max - 1) * BN, q_len,
                                      k_len, tidx % 128)
        sums = dq_shift.make_sums(n_rows, self.has_softcap)
        mdLSE, partial_keys, sKref = shift_args
        dlse = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        dq_shift.load_dlse(mdLSE, head, q_start, q_len, m0, cS_mn, partial_keys, dlse)
        rdS = cute.make_rmem_tensor(s_shape, dt)
        tQrdS = cute.make_tensor(rdS.iterator, sc.c_to_a_layout(rdS.layout))

        # dQ's reference key from the first key tile (n_max - 1) once it has landed; the epilogue's barrier orders
        # these stores before its reads.
        pipe_kv.consumer_wait(state)
        dq_shift.reference_key(sK[None, None, state.index], cutlass.min(k_len - (n_max - 1) * BN, BN), sKref, tidx,
                                 self.num_consumer_threads, HD)
        pipe_q.consumer_wait(state_q)
        tSrQ = wg_s.make_fragment_A(wg_s.partition_A(sQ))
        tSrdO = wg_s.make_fragment_A(wg_s.partition_A(sdO))
        acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_T = None
        if cutlass.const_expr(self.has_softcap):
            acc_T = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        n_steps = n_max - n_min
        opaque_zero = cute.size(mLSE.shape[1]) >> 30  # total query rows < 2^30: a run-time 0 (wgmma_wait_after)
        for it in cutlass.range(n_steps, unroll=1):
            n_block = n_max - 1 - it
            self.dq_scores_issue(pipe_kv, state, sK, mma_s0, mma_s, acc_S, acc_dP, tSrQ, tSrdO, tSrK, tSrV,
                                 n_block, k_len, tidx, wg)
            cls = None
            if cutlass.const_expr(aux is not None):
                # The tile's mask class; its map loads run under the GEMMs (every lane of each warp: it votes).
                cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
            warpgroup.wait_group(1)
            interior = self.dq_probs(acc_S, acc_T, cS_mn, lse2, m_block, n_block, q_len, k_len, off, left, right,
                                     score_mul, cap_mul, view, cls, row_max, stage, n_min, tidx)
            if cutlass.const_expr(self.pin_waits):
                sc.wgmma_wait_after(acc_S, opaque_zero, 0)
            warpgroup.wait_group(0)
            self.dq_dscores(acc_S, acc_dP, acc_T, delta, rdS, sums, interior)
            sc.gemm(mma_q, mma_q, acc_dQ, tQrdS, tQrKt[None, None, None, state.index], False)
            warpgroup.wait_group(0)
            pipe_kv.consumer_release(state)
            state.advance()

        f = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        dq_shift.finish(sums, delta, dlse, mDelta, head, q_start, q_len, m0, cS_mn, partial_keys, f)
        # Epilogue: dQ (times the softmax scale) through sQ, or the staging tile (every consumer's GEMMs are
        # complete after the barrier; with the staging tile it also orders this tile's writes after the
        # previous tile's reads): valid query rows, then zeros up to the slot end.
        sStage = sQ
        if cutlass.const_expr(release_q and sOut is not None):
            # This warp's GEMMs that read sQ / sdO are complete (the last step waited for them): the producer
            # may load the next tile's Q / dO once every consumer warp has arrived, while this one stores.
            pipe_q.consumer_release(state_q)
            sStage = sOut
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
        dq_shift.shift(masking.acc_mn_view_sm90(acc_dQ),
                       masking.acc_mn_view_sm90(thr_q.partition_C(cute.make_identity_tensor((BM, HD)))), f, sKref)
        gdQ = cute.local_tile(cute.domain_offset((q_start, 0), mdQ[None, head, None]), (BM, HD), (m_block, 0))
        sc.store_rows_via_smem(acc_dQ, dscale, dt, mma_q, copy_out, sStage, gdQ, BM, HD, m0, q_len, tidx,
                               BAR_CONSUMERS, self.num_consumer_threads, q_slot)
        if cutlass.const_expr(release_q and sOut is None):
            # Every consumer has read sQ out: the producer may load the next tile's Q / dO.
            cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
            pipe_q.consumer_release(state_q)
        state_q.advance()
        return state_q, state

    @cute.jit
    def dq_scores_issue(self, pipe_kv, state, sK, mma_s0, mma_s, acc_S, acc_dP, tSrQ, tSrdO, tSrK, tSrV, n_block,
                        k_len, tidx, wg):
        """Wait for key tile n_block's stage, zero its key rows past k_len (they meet dS = 0 in dQ += dS K:
        0 * NaN = NaN otherwise) and issue S = Q K^T and dP = dO V^T (two wgmma groups)."""
        BN, HD = self.block_n, self.head_dim
        pipe_kv.consumer_wait(state)
        stage = state.index
        n0 = n_block * BN
        if n0 + BN > k_len:
            sc.zero_rows_from(self.dtype, BN, HD, sK[None, None, stage], k_len - n0, tidx % 128, BAR_WG_BASE + wg)
        sc.gemm(mma_s0, mma_s, acc_S, tSrQ, tSrK[None, None, None, stage], True)
        sc.gemm(mma_s0, mma_s, acc_dP, tSrdO, tSrV[None, None, None, stage], True)

    @cute.jit
    def dq_probs(self, acc_S, acc_T, cS_mn, lse2, m_block, n_block, q_len, k_len, off, left, right, score_mul,
                 cap_mul, view=None, cls=None, row_max=None, stage=None, n_min=None, tidx=None):
        """S -> P in place (select: 0 where masked or the query is padded / empty); with softcap acc_T gets
        1 - tanh^2 for dS.  Aux "bias" (`view`, the tile's `cls`, `row_max` m; lse2 holds ln l * log2 e):
        natural-unit scores with the mask and bias first (aux_scores.scores), then P from m and ln l
        (probs_exact); aux "mask" (lse2 as in the plain kernel): raw scores with -inf where the mask hides a pair
        (aux_scores.mask_scores), then the plain kernel's P.  The visibility rule applies after, as in the
        plain kernel.  `stage`: the warpgroup's staged bias (bias_stage.BiasStage) holding this tile's; the copies
        of key tile n_block - 1 are issued after its read, if that tile is at least n_min.  Returns whether the
        tile took the interior path (for dq_dscores; None with softcap, which has none)."""
        BM, BN = self.block_m, self.block_n
        s_mn = masking.acc_mn_view_sm90(acc_S)
        t_mn = s_mn
        if cutlass.const_expr(self.has_softcap):
            t_mn = masking.acc_mn_view_sm90(acc_T)
        need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
        # The interior path (no softcap): the tile inside the valid rectangle with every pair visible (and, with
        # aux inputs, VISIBLE): P and dS without per-score selects.  Uniform over the CTA.
        interior = None
        if cutlass.const_expr(not self.has_softcap):
            interior = bounds.tile_interior(m_block, BM, q_len, need)
            if cutlass.const_expr(view is not None):
                interior = interior and aux_scores.tile_plain(view, cls, n_block * BN + BN)
        if cutlass.const_expr(view is None):
            if cutlass.const_expr(interior is not None):
                if interior:
                    bwd_scores.probs_interior(s_mn, lse2, score_mul, 0)
                else:
                    bwd_scores.probs_and_dscale(s_mn, t_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off,
                                                left, right, score_mul, cap_mul, need, 0, False)
            else:
                bwd_scores.probs_and_dscale(s_mn, t_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off, left,
                                            right, score_mul, cap_mul, need, 0, True)
        elif cutlass.const_expr(self.aux == "mask"):
            # score_mul is the plain kernels' scale * log2(e); a hidden pair's -inf gives P = exp2(-inf) = 0.  The
            # tile's lse2 takes the folded ALiBi term's query part (aux_scores.AlibiFold; +inf stays +inf).  On an
            # interior tile (VISIBLE) mask_scores adds the ALiBi term only.
            lse2_t = cute.make_rmem_tensor(lse2.layout, cutlass.Float32)
            lse2_t.store(lse2.load())
            aux_scores.mask_scores(s_mn, cS_mn, view, m_block * BM, n_block * BN, q_len, k_len, cls, 0,
                                   sc.map_group(0), aux_scores.AlibiFold(lse2_t, -score_mul), (BM, BN))
            if interior:
                bwd_scores.probs_interior(s_mn, lse2_t, score_mul, 0)
            else:
                bwd_scores.probs_and_dscale(s_mn, t_mn, cS_mn, lse2_t, m_block * BM, n_block * BN, k_len, off, left,
                                            right, score_mul, cap_mul, need, 0, False)
        else:
            wg_tidx = None
            if cutlass.const_expr(stage is not None):
                wg_tidx = tidx % 128
            aux_scores.key_tile_scores(s_mn, cS_mn, view, m_block * BM, n_block, BN, q_len, k_len, score_mul, cls,
                                       sc.map_group(0), stage, n_min, wg_tidx)
            if interior:
                bwd_scores.probs_exact_interior(s_mn, row_max, lse2, 0)
            else:
                bwd_scores.probs_exact(s_mn, cS_mn, row_max, lse2, m_block * BM, n_block * BN, k_len, off, left,
                                       right, need, 0)
        return interior

    @cute.jit
    def dq_dscores(self, acc_S, acc_dP, acc_T, delta, rdS, sums, interior=None):
        """dS = P (dP - Delta) [(1 - tanh^2)] by select (0 where P = 0), into rdS in the input dtype; the row
        sums of dq_shift added to `sums`.  `interior` (from dq_probs; None with softcap): without the select."""
        s_mn = masking.acc_mn_view_sm90(acc_S)
        t_mn = s_mn
        if cutlass.const_expr(self.has_softcap):
            t_mn = masking.acc_mn_view_sm90(acc_T)
        dp_mn = masking.acc_mn_view_sm90(acc_dP)
        if cutlass.const_expr(interior is None):
            bwd_scores.dscores(s_mn, dp_mn, t_mn, delta, 0, self.has_softcap, sums)
        else:
            if interior:
                bwd_scores.dscores_interior(s_mn, dp_mn, delta, 0, sums)
            else:
                bwd_scores.dscores(s_mn, dp_mn, t_mn, delta, 0, False, sums)
        rdS.store(acc_dP.load().to(self.dtype))


class BwdDQSm90Aux(BwdDQSm90):
    """`BwdDQSm90(..., aux="mask" | "bias")`: masks and biases as tensors (bwd_aux).  Only the exported signature
    differs (the aux ABI, the same for both kinds: the aux tensors after mTileCounter, aux_flags after
    max_seqlen_q); score_mul is the plain softmax scale (natural units) for "bias", scale * log2(e) as in the
    plain kernel for "mask"; cap_mul is unused."""

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
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        partial_keys: cutlass.Int32,
        aux_flags: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        aux = bwd_aux.make(self.aux, mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum, mSlopes, mLSE,
                           aux_flags)
        self._launch(mQ, mK, mV, mdO, mLSE, mDelta, mdLSE, mdQ, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, score_mul,
                     cap_mul, dscale, window_left, window_right, bottom_right, max_seqlen_q, partial_keys, stream, aux)
