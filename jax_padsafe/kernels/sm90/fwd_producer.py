"""The Hopper forward's producer warp: TMA loads of Q, K and V into the shared-memory pipelines, the claim of
the compact kernel's next tile, and the L2 prefetch of the next tile's first blocks.

It loads the key tiles [n_min, n_max) of the tile info (fwd_schedule), which in the aux variants is already
narrowed by the mask's block summary: the same range the consumers walk, so every stage it fills is consumed."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from ..common import aux_scores, tile_queue
from . import fwd_aux


class FwdProducer:
    """Mixin of `FlashFwdSm90`: the producer warp's side of the kernel."""

    @cute.jit
    def produce(
        self,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipe_q,
        pipe_k,
        pipe_v,
        sched,
    ):
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for j in cutlass.range(sched.tiles_per_cta, unroll=1):
            (present, m_block, head, head_kv, q_start, q_len, k_start, k_len, off, left, right, n_min,
             n_max, _, _, batch) = self.tile_info(j, sched)
            if present:
                state_q, state = self.produce_tile(
                    tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                    state_q, state, m_block, head, head_kv, q_start, k_start, n_min, n_max, j, sched,
                    bias_tile=self.bias_tile(sched, batch, head, q_len, k_len))

    @cute.jit
    def produce_claimed(self, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV, pipe_q, pipe_k,
                        pipe_v, sched, queue):
        """The compact kernel's producer: tiles in the order they are claimed (the first claims are the last
        compact tiles, the heaviest of causal sequences), the next one claimed when the current one's loads
        are issued (produce_tile), while the consumers still have num_stages blocks to work on.

        Why a queue: with one compact tile per CTA, the launch, pipeline fill and epilogue of every tile
        are exposed (costly for short sequences: a tile of a 300-token document has 3 key blocks), while
        a fixed share of several tiles per CTA left a tail on skewed batches.  Claiming balances like the
        hardware's dispatch of one-tile CTAs, with the multi-tile CTAs' overlap between tiles."""
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        state_tile = tile_queue.producer_state()
        total = self.queue_length(sched)
        lin, info, state_tile = self.claim_published(queue, state_tile, sched)
        while lin < total:
            (present, m_block, head, head_kv, q_start, q_len, k_start, k_len, off, left, right, n_min,
             n_max, _, _, batch) = info
            next_lin = lin
            next_info = info
            if present:
                # produce_tile claims the next tile once this one's loads are issued.
                state_q, state, state_tile, next_lin, next_info = self.produce_tile(
                    tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                    state_q, state, m_block, head, head_kv, q_start, k_start, n_min, n_max, cutlass.Int32(0), sched,
                    queue, state_tile, bias_tile=self.bias_tile(sched, batch, head, q_len, k_len))
            else:
                next_lin, next_info, state_tile = self.claim_published(queue, state_tile, sched)
            lin = next_lin
            info = next_info

    @cute.jit
    def produce_tile(
        self,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipe_q,
        pipe_k,
        pipe_v,
        state_q,
        state,
        m_block: cutlass.Int32,
        head: cutlass.Int32,
        head_kv: cutlass.Int32,
        q_start: cutlass.Int32,
        k_start: cutlass.Int32,
        n_min: cutlass.Int32,
        n_max: cutlass.Int32,
        j: cutlass.Int32,
        sched,
        queue=None,
        state_tile=None,
        bias_tile=None,
    ):
        """Loads of one tile.  `bias_tile` (the "bias" kind: bias_tile()'s) prefetches each key block's bias
        into L2 as its K load is issued.  With the compact kernel's `queue` it also claims the next tile once this
        tile's loads are issued, prefetches that one into L2 instead of this CTA's tile j + 1 (below head dim
        128), and returns (state_q, state, state_tile, the next tile's number)."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_Q[None, None, head]), (BM, HD), (m_block, 0))
        gK = cute.local_tile(cute.domain_offset((k_start, 0), tma_K[None, None, head_kv]), (BN, HD), (None, 0))
        gV = cute.local_tile(cute.domain_offset((k_start, 0), tma_V[None, None, head_kv]), (BN, HD), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        n_tiles = n_max - n_min
        # K of the first (= last in key order) tile, then Q, so the first QK^T can start early.
        if n_tiles > 0:
            pipe_k.producer_acquire(state)
            cute.copy(tma_atom_K, tKgK[None, n_max - 1], tKsK[None, state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state))
            self.prefetch_bias(bias_tile, m_block, n_max - 1)
        pipe_q.producer_acquire(state_q)
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(state_q))
        state_q.advance()
        # Order of use with overlap: K[n], then K[n-1] before V[n].
        for it in cutlass.range(n_tiles - 1, unroll=1):
            n = n_max - 1 - it
            state_prev = state.clone()
            state.advance()
            pipe_k.producer_acquire(state)
            cute.copy(tma_atom_K, tKgK[None, n - 1], tKsK[None, state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state))
            self.prefetch_bias(bias_tile, m_block, n - 1)
            pipe_v.producer_acquire(state_prev)
            cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, state_prev.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state_prev))
            if cutlass.const_expr(self.prefetch_next):
                # After the tile's first step is issued, where the producer would otherwise wait for a
                # free stage (issued before it, the prefetch delayed the step's loads: slower).  A tile of
                # one K block issues none.
                if it == 0:
                    if cutlass.const_expr(queue is None):
                        self.prefetch_tile_l2(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK,
                                              j + 1, sched)
        if n_tiles > 0:
            pipe_v.producer_acquire(state)
            cute.copy(tma_atom_V, tVgV[None, n_min], tVsV[None, state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()
        if cutlass.const_expr(queue is None):
            return state_q, state
        else:
            # The next tile is claimed only now, with this tile's last loads issued (the producer runs
            # num_stages blocks ahead of the consumers, which covers the counter's round trip): claimed at
            # this tile's start, a CTA busy with a long tile held its next one too, and a batch's last
            # long tiles ended in a tail twice as long (one 8k document among short ones: -6 to -11%, H100).
            next_lin, next_info, state_tile = self.claim_published(queue, state_tile, sched)
            if cutlass.const_expr(self.prefetch_next):
                self.prefetch_info_l2(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, next_info,
                                      next_lin < self.queue_length(sched))
            return state_q, state, state_tile, next_lin, next_info

    @cute.jit
    def bias_tile(self, sched, batch, head, q_len, k_len):
        """What prefetch_bias needs of a tile: (its AuxView, q_len, k_len) in the "bias" kind, else None."""
        if cutlass.const_expr(self.aux == "bias"):
            return (fwd_aux.tile_view(sched.aux, batch, head, sched.num_heads), q_len, k_len)
        return None

    @cute.jit
    def prefetch_bias(self, bias_tile, m_block, n_block):
        if cutlass.const_expr(bias_tile is not None):
            aux_scores.prefetch_bias_l2(bias_tile[0], m_block, n_block, self.block_m, self.block_n, bias_tile[1],
                                        bias_tile[2])

    @cute.jit
    def prefetch_tile_l2(self, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, j, sched):
        """TMA prefetch into L2 (no shared memory, no barrier) of the CTA's tile j's Q and of the K / V block
        it visits first; nothing if the CTA has no tile j or it has nothing to load."""
        info = self.tile_info(j, sched)
        self.prefetch_info_l2(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, info,
                              j < sched.tiles_per_cta)

    @cute.jit
    def prefetch_info_l2(self, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, info, wanted):
        """prefetch_tile_l2 of the tile that `info` (a FwdTile) describes, if `wanted`."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        (present, m_block, head, head_kv, q_start, _, k_start, _, _, _, _, n_min, n_max, _, _, _) = info
        if wanted:
            if present:
                gQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_Q[None, None, head]), (BM, HD), (m_block, 0))
                _, tQgQ = cpasync.tma_partition(
                    tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                cute.prefetch(tma_atom_Q, tQgQ)
                if n_max > n_min:
                    gK = cute.local_tile(cute.domain_offset((k_start, 0), tma_K[None, None, head_kv]), (BN, HD), (None, 0))
                    gV = cute.local_tile(cute.domain_offset((k_start, 0), tma_V[None, None, head_kv]), (BN, HD), (None, 0))
                    _, tKgK = cpasync.tma_partition(
                        tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                    # sK stands in for sV: both have one layout, and only its shape matters here.
                    _, tVgV = cpasync.tma_partition(
                        tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gV, 0, 2))
                    cute.prefetch(tma_atom_K, tKgK[None, n_max - 1])
                    cute.prefetch(tma_atom_V, tVgV[None, n_max - 1])
