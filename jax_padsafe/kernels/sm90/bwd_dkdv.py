"""Hopper backward, dK/dV kernel (`BwdDKDVSm90`); see bwd_base for the backward's structure."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import cpasync

from ..common import aux_scores, bias_stage, bounds, tile_queue, tile_schedule, tiles
from . import bwd_aux
from . import common as sc
from .bwd_base import Sm90BwdBase
from .bwd_dkdv_ahead import PlainStepsAhead
from .bwd_dkdv_steps import DKDVSteps


class BwdDKDVSm90(Sm90BwdBase, DKDVSteps, PlainStepsAhead):
    """dK, dV for one key tile (all query heads of its GQA group), in one of two warpgroup splits:

    * block_n = 128 (head dims up to 128): each consumer warpgroup owns 64 keys: its own S^T / dP^T rows and
      the dK / dV rows of those keys (2 x 64 x head_dim fp32 accumulators per warpgroup).
    * block_n = 64 (`split_head_dim`, head dims 192 / 256): each warpgroup accumulates dK / dV of the 64 keys
      for its half of the head dim.  At head dim 256 the key split would need 256 accumulator registers per
      thread; this split keeps 128 (96 at head dim 192).  Warpgroup 0 computes S^T and P^T, warpgroup 1
      dP^T and dS^T, and they swap them through shared memory (`exchange_step`), so each GEMM is computed once.
    """

    def __new__(cls, *args, aux=False, **kwargs):
        # The aux variants' __call__ takes more arguments (the aux ABI, the same for both kinds); cute.compile
        # traces the class's __call__, so those variants are a subclass that only adds its own.
        if aux and cls is BwdDKDVSm90:
            cls = BwdDKDVSm90Aux
        return super().__new__(cls)

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_stages: int, has_softcap: bool, *,
                 pin_waits: bool, queue_dense: bool, steps_ahead: bool = False, aux=False):
        super().__init__(dtype, head_dim, block_m, block_n, num_stages, has_softcap, aux)
        assert block_n in (64, 128)
        # Every layout takes the queued compact schedule, dense ones too (see bwd_base); the
        # FFI handler then zeroes the counter on every call (the registry's `queue_all`).
        self.queue_dense = queue_dense
        # The queued kernel stages dK / dV through tiles of their own (64 KB at head dim 128), so a tile's K / V
        # can be released, and the next tile's loaded, before its epilogue.  Not at head dims 192 / 256 (block_n
        # 64): their shared memory is full, and they stage through sK / sV after the last step.
        self.separate_out = block_n == 128
        # The wait for dP^T pinned after P^T is converted to the input dtype (common.wgmma_wait_after):
        # ptxas sinks those conversions below the wait, between the dV wgmmas that read them.
        self.pin_waits = pin_waits
        self.split_head_dim = block_n == 64
        # The plain kind's steps with the next step's S^T and dP^T issued under the current dK (`plain_steps_ahead`,
        # a tuning choice per head dim); else each step waits for its dK first.
        self.steps_ahead = steps_ahead and not self.split_head_dim and not has_softcap and not aux
        # "bias": each consumer warpgroup stages its 64 keys x block_m queries of the next step's bias in shared
        # memory a step ahead (common/bias_stage.py), in two buffers where they fit (34 KB at 64 x 128: head dims
        # up to 96), else in one (17 KB: head dim 128, where the kernel already takes 192 KB); not with the
        # head-dim split, whose tiles differ.
        elem = dtype.width // 8
        smem_used = elem * (2 * block_n * head_dim + 2 * num_stages * block_m * head_dim
                            + (2 * block_n * head_dim if self.separate_out else 0))
        self.bias_buffers = 0
        if self.aux == "bias" and not self.split_head_dim:
            for n in (1, 2):
                if smem_used + elem * bias_stage.smem_elems(block_m, block_n, n) + 4096 <= 227 * 1024:
                    self.bias_buffers = n
        self.stage_bias = self.bias_buffers > 0
        # Each warpgroup's half of the head dim is whole swizzle atoms (hd192: 32-column atoms, 3 per half).
        assert not self.split_head_dim or (head_dim // 2) % 32 == 0

    def _exchange_layouts(self):
        """`split_head_dim`: the shared tiles of `exchange_step`, (keys, queries), swizzled: fp32 P^T (with softcap
        P^T (1 - tanh^2)), and one in the input dtype for dS^T (with softcap first P^T, then dS^T)."""
        return (sc.smem_layout(cutlass.Float32, self.block_n, self.block_m),
                sc.smem_layout(self.dtype, self.block_n, self.block_m))

    def _mma_s(self):
        """S^T / dP^T (keys, queries), A = K / V (K-major), B = Q / dO (K-major): one warpgroup per 64 keys,
        or (split_head_dim) one warpgroup tile of all 64 keys (warpgroup 0 computes S^T, warpgroup 1 dP^T)."""
        if cutlass.const_expr(self.split_head_dim):
            return sc.make_mma(self.dtype, 1, self.block_n, self.block_m, b_major_mn=False, a_from_regs=False)
        return sc.make_mma(self.dtype, 2, self.block_n // 2, self.block_m, b_major_mn=False, a_from_regs=False)

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
        mTileCounter: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_k: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, score_mul,
                     cap_mul, dscale, window_left, window_right, bottom_right, max_seqlen_k, stream, None)

    @cute.jit
    def _launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mCuQ: cute.Tensor, mCuK: cute.Tensor,
                mUsedQ: cute.Tensor, mUsedK: cute.Tensor, mTileCounter: cute.Tensor, score_mul: cutlass.Float32,
                cap_mul: cutlass.Float32, dscale: cutlass.Float32, window_left: cutlass.Int32,
                window_right: cutlass.Int32, bottom_right: cutlass.Int32, max_seqlen_k: cutlass.Int32,
                stream: cuda.CUstream, aux):
        """The launch, shared by both variants' __call__; `aux`: the aux variant's bwd_aux.BwdAux, else None."""
        dt = self.dtype
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        # The aux variants' kernel takes their inputs as one more argument after `compact`; the bias kind stages
        # three row statistics per query (ln l * log2 e, Delta, m: bwd_aux.stat_load) where the plain kernel and
        # the mask kind stage two (lse2, Delta).
        extra = ()
        n_stats = 2
        if cutlass.const_expr(aux is not None):
            extra = (aux,)
        if cutlass.const_expr(self.aux == "bias"):
            n_stats = 3
        # split_head_dim: a warpgroup's half of the head dim is whole swizzle atoms of Q / dO (the dK / dV GEMMs'
        # B operand) and of K / V (which stage the dK / dV epilogue).
        half = HD // 2 if self.split_head_dim else 0
        sQ_layout = sc.smem_layout(dt, BM, HD, self.num_stages, half)
        sK_layout = sc.smem_layout(dt, BN, HD, 0, half)
        q_box = cute.select(sQ_layout, mode=[0, 1])
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mQ), q_box, (BM, HD), 1)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mdO), q_box, (BM, HD), 1)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mK), sK_layout, (BN, HD))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mV), sK_layout, (BN, HD))
        q_bytes = cute.size_in_bytes(dt, q_box)
        k_bytes = cute.size_in_bytes(dt, sK_layout)
        mma_s = self._mma_s()
        # dV / dK: (keys, head_dim), A = P^T / dS^T from registers, B = dO^T / Q^T (MN-major); warpgroups
        # stacked along the keys, or side by side along the head dim (split_head_dim).
        if cutlass.const_expr(self.split_head_dim):
            mma_kv = sc.make_mma_split_n(dt, BN, HD // 2, 2, a_major_mn=False, b_major_mn=True, a_from_regs=True)
        else:
            mma_kv = sc.make_mma(dt, 2, BN // 2, HD, b_major_mn=True, a_from_regs=True)
        copy_out = tiles.gmem_tiled_copy(dt, HD, self.num_consumer_threads, async_copy=False)
        stages = self.num_stages
        # sdS / sdQ: the exchange tiles of the head-dim split.  Without the split they hold 8 and 4 unused
        # elements, so that the fields after them keep their offsets (and the compiled kernels their code).
        ds_elems = 8
        dq_elems = 4
        if cutlass.const_expr(self.split_head_dim):
            # sdQ holds the fp32 tile, sdS the other; hd256: 192 KB + 16 KB + 8 KB (+ 2 KB of row statistics and
            # 1 KB of barriers and padding: 227 KB is the limit).
            sPx_layout, sdSx_layout = self._exchange_layouts()
            ds_elems = cute.cosize(sdSx_layout)
            dq_elems = cute.cosize(sPx_layout)

        @cute.struct
        class SharedStorage:
            mbar_res: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_str: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            # Per consumer warpgroup, double-buffered: lse2 and Delta (aux "bias": ln l * log2 e, Delta, m) of the
            # step's block_m queries.
            sStat: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BM * n_stats * 2 * 2], 16]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, ds_elems], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, dq_elems], 1024]
            # Unused (8 bytes that keep the offsets of the queue's barriers and slots).
            sPad: cute.struct.MemRange[cutlass.Int32, 2]
            # The compact kernel's tile queue (tile_queue): two slots of (tile number, sequence, key tile, kv
            # head, k_start, k_len, k_slot, a run-time 0 for `epilogue_rows`), their barriers.
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            sSlots: cute.struct.MemRange[cutlass.Int32, 2 * 8]
            # The staged bias's buffers (bias_stage: one or two).
            sBias: cute.struct.Align[cute.struct.MemRange[
                dt, bias_stage.smem_elems(BM, BN, self.bias_buffers) if self.stage_bias else 0], 128]

        group = cute.size(mQ.shape[1]) // cute.size(mK.shape[1])
        # Key tiles: dense (ceil(max_seqlen_k / BN) per sequence) or, where that launches at least twice as many
        # CTAs, compact (tile_schedule.compact_tile), each its own kernel (see FlashFwdSm90.__call__).
        batch, total_k, heads_kv = cute.size(mUsedK.shape[0]), cute.size(mK.shape[0]), cute.size(mK.shape[1])
        grid = (cute.ceil_div(max_seqlen_k, BN), heads_kv, batch)
        args = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
                mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, group,
                score_mul, cap_mul, dscale, window_left, window_right, bottom_right,
                sQ_layout, sK_layout, mma_s, mma_kv, copy_out, q_bytes, k_bytes, SharedStorage)
        # The dK / dV staging tiles (`kernel`) of the compact kernel.
        compact = (args, max_seqlen_k, total_k, heads_kv, batch, BN, 2 * k_bytes, SharedStorage, stream, extra)
        if cutlass.const_expr(self.queue_dense):
            self._launch_compact(*compact)
        else:
            if tile_schedule.use_compact_grid(max_seqlen_k, total_k, batch, BN) != 0:
                self._launch_compact(*compact)
            else:
                self.kernel(*args, False, *extra).launch(
                    grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(),
                    stream=stream, min_blocks_per_mp=1)

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
        mdK: cute.Tensor,
        mdV: cute.Tensor,
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
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        mma_s: cute.TiledMma,
        mma_kv: cute.TiledMma,
        copy_out: cute.TiledCopy,
        q_bytes: cutlass.Constexpr,
        k_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
        compact: cutlass.Constexpr,
        aux=None,
    ):
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_dO)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        # Compact: the producer warp finds each claimed tile's (sequence, key tile) and publishes it in the
        # queue's slot, which the consumers hold (and read where they need it, `key_tile`) until the tile is done.
        queue = None
        slots = None
        if cutlass.const_expr(compact):
            slots = storage.sSlots.get_tensor(cute.make_layout((2, 8), stride=(8, 1)))
            queue = tile_queue.create(storage.mbar_tile.data_ptr(), slots, mTileCounter, self.num_consumer_threads)
        pipe_kv, pipe_q = self._pipes(storage, 2 * k_bytes, 2 * q_bytes)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        n_stats = 2
        if cutlass.const_expr(self.aux == "bias"):
            n_stats = 3
        # (query, lse2|Delta (aux "bias": ln l * log2 e|Delta|m), parity, wg)
        sStat = storage.sStat.get_tensor(cute.make_layout((BM, n_stats, 2, 2)))
        sdS = None
        sdQ = None
        if cutlass.const_expr(self.split_head_dim):
            sPx_layout, sdSx_layout = self._exchange_layouts()
            sdS = storage.sdS.get_tensor(sdSx_layout.outer, swizzle=sdSx_layout.inner)
            sdQ = storage.sdQ.get_tensor(sPx_layout.outer, swizzle=sPx_layout.inner)

        tmas = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V)
        seqs = (mCuQ, mCuK, mUsedQ, mUsedK, window_left, window_right, bottom_right)
        sBias = None
        if cutlass.const_expr(self.stage_bias):
            sBias = storage.sBias.get_tensor(bias_stage.layout(BM, BN, self.bias_buffers))

        if cutlass.const_expr(compact):
            # Compact tiles per kv head (tile_schedule.compact_tiles_per_head) x kv heads, claimed head by head, each
            # head's tiles in increasing order (tile_schedule.claimed_compact_tile).
            batch_size = cute.size(mUsedK.shape[0])
            per_head = cute.size(tma_K.shape[0]) // BN + batch_size
            sched = (per_head, cute.size(tma_K.shape[2]), group, batch_size)
            out_tiles = None
            if cutlass.const_expr(self.separate_out):
                out_tiles = tuple(smem.allocate_tensor(self.dtype, sK_layout.outer, 1024, sK_layout.inner)
                                  for _ in range(2))
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.produce_claimed(tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, seqs, queue, sched, aux)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume_claimed(sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s,
                                     mma_kv, copy_out, score_mul, cap_mul, dscale, seqs, queue, slots, sched, out_tiles,
                                     aux, sBias)
        else:
            n_block, head_kv, batch = cute.arch.block_idx()
            tb = bounds.key_tile(*seqs, batch, n_block, BM, BN)
            n_m = tb.hi - tb.lo
            total = group * n_m
            n0 = n_block * BN
            aux_tile = None
            if cutlass.const_expr(aux is not None):
                # Aux: the steps left after each query head's range is narrowed by its mask, counted here, before
                # the producer and the consumers part, so both take the same branch and walk the same steps.
                total = self.aux_steps(aux, batch, head_kv, group, n_block, tb.k_len, tb.lo, tb.hi)
                aux_tile = (aux, batch, tb.hi, tb.q_len, tb.k_len, sBias)
            # A key tile past k_len, or one no valid query sees: dK = dV = 0; the CTA writes the zeros of its rows
            # up to the slot end (the handler's memset may have done so already) and computes nothing.
            if n0 < tb.k_len and total > 0:
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp_idx == 0:
                        self.produce_tile(tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q,
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages),
                                          n_block, head_kv, group, n_m, tb.lo, total, tb.q_start, tb.k_start, True,
                                          aux_tile)
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    self.consume(sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s, mma_kv,
                                 copy_out, score_mul, cap_mul, dscale, n_block, None, head_kv, group, n_m, total, tb,
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages), False,
                                 None, aux_tile)
            else:
                tidx, _, _ = cute.arch.thread_idx()
                if tidx < self.num_consumer_threads:
                    for out in (mdK, mdV):
                        g = cute.local_tile(cute.domain_offset((tb.k_start, 0), out[None, head_kv, None]), (BN, HD),
                                            (n_block, 0))
                        sc.zero_rows_global(self.dtype, BN, HD, copy_out, g, n0, tb.slot, tidx)

    @cute.jit
    def produce_tile(self, tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, state_kv, state, n_block, head_kv, group, n_m,
                     m_min, total, q_start, k_start, kv_first: cutlass.Constexpr, aux_tile=None):
        """Producer warp: the loads of one key tile: K / V (resident), then Q / dO of every step (query head of
        the group, query tile).  Without `kv_first` (the queue) Q / dO of the first steps go first: K / V wait
        for the previous tile's consumers to release sK / sV (after its last step with staging tiles, after its
        epilogue at head dims 192 / 256), and these loads need not.  `aux_tile` (aux variant: (BwdAux, sequence,
        m_max, q_len, k_len)): the steps walk each query head's narrowed range (bwd_aux.dkdv_first / dkdv_next),
        as the consumers do; the "bias" kind prefetches each step's bias into L2 with its Q / dO loads.
        Returns the advanced pipeline states."""
        BN, HD = self.block_n, self.head_dim
        tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V = tmas
        # The aux variant's step cursor: (query head, query tile, end of that head's range).
        c_head = None
        c_m = None
        c_hi = None
        if cutlass.const_expr(aux_tile is not None):
            c_head, c_m, c_hi = self.aux_first(aux_tile, head_kv, group, n_block, m_min)
        n_ahead = cutlass.Int32(0)
        if cutlass.const_expr(not kv_first):
            n_ahead = cutlass.min(total, self.num_stages)
            for it in cutlass.range(n_ahead, unroll=1):
                if cutlass.const_expr(aux_tile is None):
                    state = self.produce_step(tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start)
                else:
                    state = self.produce_step_at(tmas, sQ, sdO, pipe_q, state, c_head, c_m, q_start)
                    self.prefetch_bias(aux_tile, c_head, c_m, n_block)
                    c_head, c_m, c_hi = self.aux_next(aux_tile, head_kv, group, n_block, m_min, c_head, c_m, c_hi)
        gK = cute.local_tile(cute.domain_offset((k_start, 0), tma_K[None, None, head_kv]), (BN, HD), (n_block, 0))
        gV = cute.local_tile(cute.domain_offset((k_start, 0), tma_V[None, None, head_kv]), (BN, HD), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        pipe_kv.producer_acquire(state_kv)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(state_kv))
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(state_kv))
        state_kv.advance()
        if cutlass.const_expr(aux_tile is not None):
            for it in cutlass.range(n_ahead, total, 1, unroll=1):
                state = self.produce_step_at(tmas, sQ, sdO, pipe_q, state, c_head, c_m, q_start)
                self.prefetch_bias(aux_tile, c_head, c_m, n_block)
                c_head, c_m, c_hi = self.aux_next(aux_tile, head_kv, group, n_block, m_min, c_head, c_m, c_hi)
        elif cutlass.const_expr(kv_first):
            for it in cutlass.range(total, unroll=1):
                state = self.produce_step(tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start)
        else:
            for it in cutlass.range(n_ahead, total, 1, unroll=1):
                state = self.produce_step(tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start)
        return state_kv, state

    @cute.jit
    def prefetch_bias(self, aux_tile, head, m_block, n_block):
        """The "bias" kind: L2 prefetch of query head `head`'s bias for the step (m_block, n_block)."""
        if cutlass.const_expr(self.aux == "bias"):
            aux, batch, _, q_len, k_len = aux_tile[:5]
            aux_scores.prefetch_bias_l2(bwd_aux.view(aux, batch, head), m_block, n_block, self.block_m,
                                        self.block_n, q_len, k_len)

    @cute.jit
    def produce_step(self, tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start):
        """Producer warp: Q / dO of step `it` (query head head_kv * group + it // n_m, query tile
        m_min + it % n_m) into stage `state`; returns the advanced state."""
        head = head_kv * group + it // n_m
        m_block = m_min + it % n_m
        return self.produce_step_at(tmas, sQ, sdO, pipe_q, state, head, m_block, q_start)

    @cute.jit
    def produce_step_at(self, tmas, sQ, sdO, pipe_q, state, head, m_block, q_start):
        """Producer warp: Q / dO of query tile m_block of query head `head` into stage `state`; returns the
        advanced state."""
        BM, HD = self.block_m, self.head_dim
        tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, _, _, _, _ = tmas
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), tma_Q[None, None, head]), (BM, HD), (m_block, 0))
        gdO = cute.local_tile(cute.domain_offset((q_start, 0), tma_dO[None, None, head]), (BM, HD), (m_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_dO, 0, cute.make_layout(1), cute.group_modes(sdO, 0, 2),
                                           cute.group_modes(gdO, 0, 2))
        pipe_q.producer_acquire(state)
        cute.copy(tma_atom_Q, tQgQ, tQsQ[None, state.index], tma_bar_ptr=pipe_q.producer_get_barrier(state))
        cute.copy(tma_atom_dO, tOgO, tOsO[None, state.index], tma_bar_ptr=pipe_q.producer_get_barrier(state))
        state.advance()
        return state

    # ---------------------------------------------------------------- the aux variant's query-tile ranges

    @cute.jit
    def aux_steps(self, aux, batch, head_kv, group, n_block, k_len, m_min, m_max):
        """Steps of key tile n_block (its visibility range of query tiles [m_min, m_max)) once every query head's
        range is narrowed by its mask; 0 for a tile with nothing to compute (past k_len, or no visible pair),
        whose dK / dV are then zeros, as without aux.  The producer and the consumers both call this on the
        same values."""
        total = cutlass.Int32(0)
        if n_block * self.block_n < k_len and m_max > m_min:
            total = bwd_aux.dkdv_steps(aux, batch, head_kv, group, n_block, self.block_m, self.block_n, m_min, m_max)
        return total

    @cute.jit
    def aux_first(self, aux_tile, head_kv, group, n_block, m_min):
        """The first step's (query head, query tile, end of the head's range) of a tile with aux_steps > 0."""
        aux, batch, m_max = aux_tile[:3]
        return bwd_aux.dkdv_first(aux, batch, head_kv, group, n_block, self.block_m, self.block_n, m_min, m_max)

    @cute.jit
    def aux_next(self, aux_tile, head_kv, group, n_block, m_min, head, m_block, m_hi):
        """The step after (head, m_block, m_hi) (bwd_aux.dkdv_next)."""
        aux, batch, m_max = aux_tile[:3]
        return bwd_aux.dkdv_next(aux, batch, head_kv, group, n_block, self.block_m, self.block_n, m_min, m_max, head,
                                 m_block, m_hi)

    @cute.jit
    def claim_key_tile(self, queue, seqs, sched):
        """Producer warp: the next claimed key tile inside its sequence's slot, or the end (holes skipped:
        tile_queue.take_compact_tile); returns (number, sequence, key tile, kv head)."""
        per_head, heads_kv, _, batch_size = sched
        lin, head_kv, batch, n_block = tile_queue.take_compact_tile(queue, per_head, heads_kv, seqs[1], batch_size,
                                                                    self.block_n, False)
        return lin, batch, n_block, head_kv

    @cute.jit
    def produce_claimed(self, tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, seqs, queue, sched, aux=None):
        """The compact kernel's producer: claims a key tile, publishes its (number, sequence, key tile, kv
        head) for the consumers, issues its loads, and claims the next one once they are issued (as the
        forward's `produce_claimed`, which says why).  Aux: the steps are those of the narrowed ranges, which
        the consumers derive from the published values in the same way (`aux_steps`)."""
        per_head, heads_kv, group, _ = sched
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        state_tile = tile_queue.producer_state()
        total_tiles = per_head * heads_kv
        lin, batch, n_block, head_kv = self.claim_key_tile(queue, seqs, sched)
        q_start, q_len, k_start, k_len, k_slot, _, _, _, m_min, m_max = bounds.key_tile(*seqs, batch, n_block,
                                                                                    self.block_m, self.block_n)
        state_tile = tile_queue.publish(queue, state_tile, (lin, batch, n_block, head_kv, k_start, k_len, k_slot,
                                                                cutlass.Int32(0)))
        while lin < total_tiles:
            n_m = m_max - m_min
            if cutlass.const_expr(aux is None):
                if n_block * self.block_n < k_len and n_m > 0:
                    state_kv, state = self.produce_tile(tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, state_kv, state,
                                                        n_block, head_kv, group, n_m, m_min, group * n_m, q_start,
                                                        k_start, False)
            else:
                steps = self.aux_steps(aux, batch, head_kv, group, n_block, k_len, m_min, m_max)
                if steps > 0:
                    state_kv, state = self.produce_tile(tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, state_kv, state,
                                                        n_block, head_kv, group, n_m, m_min, steps, q_start, k_start,
                                                        False, (aux, batch, m_max, q_len, k_len))
            lin, batch, n_block, head_kv = self.claim_key_tile(queue, seqs, sched)
            q_start, q_len, k_start, k_len, k_slot, _, _, _, m_min, m_max = bounds.key_tile(*seqs, batch, n_block,
                                                                                        self.block_m, self.block_n)
            state_tile = tile_queue.publish(queue, state_tile, (lin, batch, n_block, head_kv, k_start, k_len, k_slot,
                                                                cutlass.Int32(0)))

    @cute.jit
    def consume_claimed(self, sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s,
                        mma_kv, copy_out, score_mul, cap_mul, dscale, seqs, queue, slots, sched, out_tiles, aux=None,
                        sBias=None):
        """The compact kernel's consumers: the key tiles the producer claimed, in its order, until a claim past
        the end.  The slot of the current tile stays held until its epilogue is done: `key_tile` and
        `epilogue_rows` read the tile's values from it (`slot`, a view of the slot's values after the tile
        number).  A tile with nothing to compute gets its zeros (rows up to the slot end)."""
        BN, HD = self.block_n, self.head_dim
        per_head, heads_kv, group, _ = sched
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        state_tile = tile_queue.consumer_state()
        total_tiles = per_head * heads_kv
        lin = tile_queue.peek(queue, state_tile)
        while lin < total_tiles:
            batch = tile_queue.field(queue, state_tile, 1)
            n_block = tile_queue.field(queue, state_tile, 2)
            head_kv = tile_queue.field(queue, state_tile, 3)
            # (sequence, key tile, kv head, k_start, k_len, k_slot, 0) of the held slot (`key_tile`,
            # `epilogue_rows`).
            slot = cute.make_tensor(slots.iterator + (state_tile.index * 8 + 1), cute.make_layout(7))
            tb = bounds.key_tile(*seqs, batch, n_block, self.block_m, BN)
            n_m = tb.hi - tb.lo
            n0 = n_block * BN
            steps = n_m
            aux_tile = None
            if cutlass.const_expr(aux is not None):
                # The producer's steps, derived in the same way (`produce_claimed`).
                steps = self.aux_steps(aux, batch, head_kv, group, n_block, tb.k_len, tb.lo, tb.hi)
                aux_tile = (aux, batch, tb.hi, tb.q_len, tb.k_len, sBias)
            if n0 < tb.k_len and steps > 0:
                total = group * n_m
                if cutlass.const_expr(aux is not None):
                    total = steps
                state_kv, state = self.consume(sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK,
                                               mdV, mma_s, mma_kv, copy_out, score_mul, cap_mul, dscale, n_block,
                                               slot, head_kv, group, n_m, total, tb, state_kv, state, True,
                                               out_tiles, aux_tile)
            else:
                for out in (mdK, mdV):
                    g = cute.local_tile(cute.domain_offset((tb.k_start, 0), out[None, head_kv, None]), (BN, HD),
                                        (n_block, 0))
                    sc.zero_rows_global(self.dtype, BN, HD, copy_out, g, n0, tb.slot, tidx)
            state_tile = tile_queue.release(queue, state_tile)
            lin = tile_queue.peek(queue, state_tile)


class BwdDKDVSm90Aux(BwdDKDVSm90):
    """`BwdDKDVSm90(..., aux="mask" | "bias")`: masks and biases as tensors (bwd_aux).  Only the exported signature
    differs (the aux ABI, the same for both kinds: the aux tensors after mTileCounter, aux_flags after
    max_seqlen_k); score_mul is the plain softmax scale (natural units) for "bias", scale * log2(e) as in the
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
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mTileCounter: cute.Tensor,
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
        aux = bwd_aux.make(self.aux, mMask, mBias, mBias32, mTileMap, mColRange, mRowMax, mLogSum, mSlopes, mLSE,
                           aux_flags)
        self._launch(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, score_mul,
                     cap_mul, dscale, window_left, window_right, bottom_right, max_seqlen_k, stream, aux)
