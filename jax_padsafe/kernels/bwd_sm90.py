"""Hopper (sm_90a) flash-attention backward: TMA + wgmma, warp-specialised, pad-safe, deterministic.

Drop-in replacements for `bwd_sm80.BwdDKDV` / `bwd_sm80.BwdDQ` (same arguments, same exported ABI); the
Delta preprocess stays `bwd_sm80.BwdPreprocess`.  Same two-kernel structure, no atomics: every output
element is written by exactly one CTA after a fixed-order loop, so results are bitwise reproducible.

Both kernels use 3 warpgroups: warpgroup 0 is the producer (one warp issues TMA into mbarrier-guarded
shared-memory stages, PipelineTmaAsync; setmaxnreg down), warpgroups 1 and 2 consume (setmaxnreg up),
each owning 64 rows of the CTA's tile.

* `BwdDKDVSm90`: one CTA per (key tile of block_n, kv head, sequence), or for packed batches whose dense grid
  would be mostly empty one wave of persistent CTAs that claim (compact key tile, kv head) tiles from a counter
  (`bounds.compact_tile`, `tile_queue`).  K and V resident; Q, dO tiles of
  block_m queries streamed for every (query head of the GQA group, query tile that sees the key tile), in
  that fixed order.  Per step: S^T = K Q^T and dP^T = V dO^T (wgmma, both operands in shared memory),
  P^T = exp2(S^T * scale_log2 - lse2) by select (0 where masked, where the query is padded or has
  lse = -inf), dS^T = P^T * (dP^T - Delta) by select, dV += P^T dO and dK += dS^T Q (wgmma, A from
  registers, B = dO^T / Q^T MN-major from shared memory).  Up to head dim 128 each consumer warpgroup owns
  64 of the tile's 128 keys; at 192 / 256 (block_n 64) each owns half of the head dim, warpgroup 0 computes
  S^T / P^T and warpgroup 1 dP^T / dS^T, and they swap them through shared memory (`exchange_step`).
* `BwdDQSm90`: one CTA per (query tile of block_m, head, sequence), or persistent CTAs that claim compact query
  tiles.  Q and dO resident, K and V streamed; S = Q K^T, dP = dO V^T, P, dS as above, dQ += dS K.

With the queue (`dynamic_compact`), a CTA's producer warp claims the next tile once the current one's loads are
issued, skips the compact schedule's holes itself, and loads the next tile's operands while the consumers finish
the current one; up to head dim 128 the consumers stage their outputs through tiles of their own
(`stage_out`), so the resident operands are released before the epilogue.  Which CTA computes a tile changes,
how it is computed does not: the results are bitwise those of one CTA per tile.  Where measured faster
(`queue_dense`), the dense layouts take the same queued schedule: a dense batch's compact tiles are its dense
tiles plus one hole per sequence, so the persistent CTAs also overlap one key (query) tile's epilogue with the
next one's loads there, which one CTA per dense tile cannot.

Pad-safety under TMA (TMA zero-fills only outside the whole tensor; rows past a sequence's valid length
inside it hold anything: NaN, Inf, the next sequence):
  * dK/dV: Q and dO rows past q_len would meet P^T = 0 / dS^T = 0 columns in dV += P^T dO and
    dK += dS^T Q (0 * NaN = NaN): the consumers zero them in shared memory (fence.proxy.async + barrier)
    before any GEMM reads the stage.  K / V rows past k_len only produce S^T / dP^T rows of keys that are
    masked by select (P^T = 0, dS^T = 0) and never written.
  * dQ: K rows past k_len meet dS = 0 in dQ += dS K: zeroed in shared memory the same way.  V rows past
    k_len only reach dP columns that the select drops; Q / dO rows past q_len only reach dQ rows that are
    never written (and the lse sentinel turns their P, dS into 0 by select).
Outputs are staged through shared memory and written with 16-byte stores predicated per row: valid rows get
values, rows past the valid length up to the sequence's slot end (cu[b+1]) get zeros, and tiles with nothing
to compute write zeros, so padded rows are exactly 0 without a memset where the tiles cover every row (the
FFI handler zero-fills dq/dk/dv first otherwise).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import bounds, masking, tile_queue, tiles
from . import bwd_common as bc
from . import sm90_common as sc

# Named barrier ids (0 is __syncthreads).
_BAR_CONSUMERS = 1  # both consumer warpgroups (256 threads)
_BAR_WG_BASE = 2  # + consumer warpgroup index: one consumer warpgroup (128 threads)
# Fused dQ: the consumers' partial is in sdQ (consumers arrive, the reducer warp waits) / sdQ is free again
# (the reducer warp arrives, the consumers wait): 256 consumer threads + the reducer warp.
_BAR_DQ_FULL = 4
_BAR_DQ_EMPTY = 5
_DQ_SYNC_THREADS = 256 + 32
# Head-dim split (BwdDKDVSm90.exchange_step): P^T is in shared memory (warpgroup 0 arrives, warpgroup 1
# waits) / dS^T is in shared memory (warpgroup 1 arrives, warpgroup 0 waits); both consumer warpgroups.
_BAR_P_READY = 6
_BAR_DS_READY = 7


class _Sm90BwdBase:
    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_stages: int, has_softcap: bool):
        assert head_dim % 32 == 0  # hd96: 32-column (64-byte) swizzle atoms, chosen by sm90_common.smem_layout
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.block_n = block_n
        self.num_stages = num_stages
        self.has_softcap = has_softcap
        self.num_consumer_wg = 2
        self.num_threads = 128 * (1 + self.num_consumer_wg)
        self.num_consumer_threads = 128 * self.num_consumer_wg
        self.producer_regs = 24
        self.consumer_regs = 240

    def _pipes(self, storage, res_bytes, stream_bytes):
        """(resident pipe: 1 stage, stream pipe: num_stages); the consumers arrive once per warp."""
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        pipe_res = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_res.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=res_bytes, defer_sync=True,
        )
        pipe_str = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_str.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=consumers, tx_count=stream_bytes, defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return pipe_res, pipe_str

    def _launch_compact(self, args, max_seqlen, total_rows, heads, batch, block: int, staging_bytes: int,
                        SharedStorage, stream):
        """Launch `self.kernel`'s compact schedule over `heads` heads of `block`-row tiles (key tiles for dK/dV,
        query tiles for dQ): one wave of queued persistent CTAs (`dynamic_compact`; x: tiles per head times heads),
        or one CTA per compact tile.  `staging_bytes`: the output staging tiles' shared memory (`separate_out`).
        A plain method, traced inline by the caller's `__call__`: its `if`s are compile-time choices."""
        grid = bounds.tile_grid(True, max_seqlen, total_rows, heads, batch, block)
        smem = SharedStorage.size_in_bytes()
        if self.dynamic_compact:
            grid = (cutlass.min(grid[0] * grid[1], self.persistent_ctas), 1, 1)
        if self.separate_out:
            smem += staging_bytes + 1024  # 1024-byte aligned
        self.kernel(*args, True).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=smem, stream=stream, min_blocks_per_mp=1)


class BwdDKDVSm90(_Sm90BwdBase):
    """dK, dV for one key tile (all query heads of its GQA group), in one of two warpgroup splits:

    * block_n = 128 (head dims up to 128): each consumer warpgroup owns 64 keys: its own S^T / dP^T rows and
      the dK / dV rows of those keys (2 x 64 x head_dim fp32 accumulators per warpgroup).
    * block_n = 64 (`split_head_dim`, head dims 192 / 256): each warpgroup accumulates dK / dV of the 64 keys
      for its half of the head dim.  At head dim 256 the key split would need 256 accumulator registers per
      thread; this split keeps 128 (96 at head dim 192).  Warpgroup 0 computes S^T and P^T, warpgroup 1
      dP^T and dS^T, and they swap them through shared memory (`exchange_step`), so each GEMM is computed once.
    """

    ordered = True  # the fused-dQ subclass's reduction order (BwdDKDVQSm90)

    def __init__(self, dtype, head_dim: int, block_m: int = 64, block_n: int = 128, num_stages: int = 2,
                 has_softcap: bool = False, pin_waits: bool = False, dynamic_compact: bool = True,
                 stage_out: bool = True, queue_dense: bool = False):
        super().__init__(dtype, head_dim, block_m, block_n, num_stages, has_softcap)
        assert block_n in (64, 128)
        # The compact schedule with persistent CTAs that claim their key tiles from a counter (tile_queue);
        # False: one CTA per compact tile (the schedule until session 20).  The fused-dQ kernel stays dense.
        self.dynamic_compact = dynamic_compact
        # Every layout takes the queued compact schedule, dense ones too (see the module docstring); the
        # FFI handler then zeroes the counter on every call (the registry's `queue_all`).
        self.queue_dense = dynamic_compact and queue_dense
        self.persistent_ctas = 132  # SMs of an H100 SXM / H200; more than a smaller part holds is harmless
        # The queued kernel stages dK / dV through tiles of their own (64 KB at head dim 128), so a tile's K / V
        # can be released, and the next tile's loaded, before its epilogue.  Not at head dims 192 / 256 (block_n
        # 64): their shared memory is full, and they stage through sK / sV after the last step.
        self.separate_out = dynamic_compact and stage_out and block_n == 128
        # The wait for dP^T pinned after P^T is converted to the input dtype (sm90_common.wgmma_wait_after):
        # ptxas sinks those conversions below the wait, between the dV wgmmas that read them.
        self.pin_waits = pin_waits
        self.split_head_dim = block_n == 64
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
        self._launch(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, None, None, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter,
                     score_mul, cap_mul, dscale, window_left, window_right, bottom_right, max_seqlen_k, stream)

    @cute.jit
    def _launch(self, mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mdQacc, mSem, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter,
                score_mul, cap_mul, dscale, window_left, window_right, bottom_right, max_seqlen_k, stream):
        """Everything but the argument list: TMA atoms, wgmma tilers, the shared-memory struct, the launch.
        With `mdQacc` / `mSem` (the fused-dQ subclass) also the dQ partial tile, its TMA reduce-add atom
        and the per-(sequence, head, query tile) semaphores."""
        fused = mdQacc is not None
        dt = self.dtype
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
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
        # Fused dQ: dS^T (keys, queries; double-buffered) and the fp32 dQ partial (queries, head_dim).
        sdS_layout = sc.smem_layout(dt, BN, BM, 2)
        sdQ_layout = sc.smem_layout(cutlass.Float32, BM, HD)
        ds_elems = cute.cosize(sdS_layout) if fused else 8
        dq_elems = cute.cosize(sdQ_layout) if fused else 4
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
            # Per consumer warpgroup, double-buffered: lse2 and Delta of the step's block_m queries.
            sStat: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BM * 2 * 2 * 2], 16]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, ds_elems], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, dq_elems], 1024]
            # The compact kernel's (sequence, key tile) (see `body`).
            sTile: cute.struct.MemRange[cutlass.Int32, 2]
            # The compact kernel's tile queue (tile_queue): two slots of (tile number, sequence, key tile, kv
            # head, k_start, k_len, k_slot, a run-time 0 for `epilogue_rows`), their barriers.
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            sSlots: cute.struct.MemRange[cutlass.Int32, 2 * 8]

        group = cute.size(mQ.shape[1]) // cute.size(mK.shape[1])
        # Key tiles: dense (ceil(max_seqlen_k / BN) per sequence) or, where that launches at least twice as many
        # CTAs, compact (bounds.compact_tile), each its own kernel (see FlashFwdSm90.__call__).  The fused-dQ
        # kernel stays dense: its reduction order is the launch order of a head's key tiles.
        batch, total_k, heads_kv = cute.size(mUsedK.shape[0]), cute.size(mK.shape[0]), cute.size(mK.shape[1])
        grid = (cute.ceil_div(max_seqlen_k, BN), heads_kv, batch)
        if cutlass.const_expr(fused):
            s2g_add = cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD)
            tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(s2g_add, sc.rows_dim_heads(mdQacc), sdQ_layout,
                                                              (BM, HD))
            self.kernel_fused(
                tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_dQ, tma_dQ,
                mSem, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, group,
                score_mul, cap_mul, dscale, window_left, window_right, bottom_right,
                sQ_layout, sK_layout, sdS_layout, sdQ_layout, mma_s, mma_kv, copy_out, q_bytes, k_bytes,
                SharedStorage,
            ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
                     min_blocks_per_mp=1)
        else:
            args = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
                    mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, group,
                    score_mul, cap_mul, dscale, window_left, window_right, bottom_right,
                    sQ_layout, sK_layout, mma_s, mma_kv, copy_out, q_bytes, k_bytes, SharedStorage)
            # The dK / dV staging tiles (`body`) of the compact kernel.
            compact = (args, max_seqlen_k, total_k, heads_kv, batch, BN, 2 * k_bytes, SharedStorage, stream)
            if cutlass.const_expr(self.queue_dense):
                self._launch_compact(*compact)
            else:
                if bounds.use_compact_grid(max_seqlen_k, total_k, batch, BN) != 0:
                    self._launch_compact(*compact)
                else:
                    self.kernel(*args, False).launch(
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
    ):
        self.body(tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V, None, None, None,
                  mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, group, score_mul, cap_mul, dscale,
                  window_left, window_right, bottom_right, sQ_layout, sK_layout, None, None, mma_s, mma_kv,
                  copy_out, q_bytes, k_bytes, SharedStorage, compact)

    @cute.kernel
    def kernel_fused(
        self,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        tma_dO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        tma_atom_dQ: cute.CopyAtom,
        tma_dQ: cute.Tensor,
        mSem: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        group: cutlass.Int32,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        mma_s: cute.TiledMma,
        mma_kv: cute.TiledMma,
        copy_out: cute.TiledCopy,
        q_bytes: cutlass.Constexpr,
        k_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
    ):
        self.body(tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_dQ, tma_dQ,
                  mSem, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, None, group, score_mul, cap_mul, dscale,
                  window_left, window_right, bottom_right, sQ_layout, sK_layout, sdS_layout, sdQ_layout, mma_s,
                  mma_kv, copy_out, q_bytes, k_bytes, SharedStorage, False)

    @cute.jit
    def body(self, tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_dQ, tma_dQ,
             mSem, mLSE, mDelta, mdK, mdV, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, group, score_mul, cap_mul, dscale,
             window_left, window_right, bottom_right, sQ_layout, sK_layout, sdS_layout, sdQ_layout, mma_s, mma_kv,
             copy_out, q_bytes: cutlass.Constexpr, k_bytes: cutlass.Constexpr, SharedStorage: cutlass.Constexpr,
             compact: cutlass.Constexpr):
        fused = tma_atom_dQ is not None
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_dO)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        queued = compact and self.dynamic_compact
        # Compact, one tile per CTA: warp 0 finds the tile's (sequence, key tile) and leaves it in shared
        # memory, where every thread reads it after the pipelines' barrier and the consumers again where they
        # need it (`key_tile`).  The first sequences' tiles first, each sequence's first (under causal masks,
        # longest) first.  Compact with the queue: the producer warp finds each claimed tile's and publishes
        # it in the queue's slot, which the consumers hold (and read the same way) until the tile is done.
        sTile = None
        queue = None
        slots = None
        if cutlass.const_expr(queued):
            slots = storage.sSlots.get_tensor(cute.make_layout((2, 8), stride=(8, 1)))
            queue = tile_queue.create(storage.mbar_tile.data_ptr(), slots, mTileCounter, self.num_consumer_threads)
        elif cutlass.const_expr(compact):
            sTile = storage.sTile.get_tensor(cute.make_layout(2))
            if warp_idx == 0:
                b, n = bounds.compact_tile(cute.arch.block_idx()[0], mCuK, cute.size(mUsedK.shape[0]), BN)
                if cute.arch.lane_idx() == 0:
                    sTile[0] = b
                    sTile[1] = n
        pipe_kv, pipe_q = self._pipes(storage, 2 * k_bytes, 2 * q_bytes)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sStat = storage.sStat.get_tensor(cute.make_layout((BM, 2, 2, 2)))  # (query, lse2|Delta, parity, wg)
        sdS = None
        sdQ = None
        if cutlass.const_expr(fused):
            sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        if cutlass.const_expr(self.split_head_dim):
            sPx_layout, sdSx_layout = self._exchange_layouts()
            sdS = storage.sdS.get_tensor(sdSx_layout.outer, swizzle=sdSx_layout.inner)
            sdQ = storage.sdQ.get_tensor(sPx_layout.outer, swizzle=sPx_layout.inner)

        tmas = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V)
        seqs = (mCuQ, mCuK, mUsedQ, mUsedK, window_left, window_right, bottom_right)

        if cutlass.const_expr(queued):
            # Compact tiles per kv head (bounds.compact_tiles_per_head) x kv heads, claimed in the one-tile
            # CTAs' launch order.
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
                    self.produce_claimed(tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, seqs, queue, sched)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume_claimed(sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s,
                                     mma_kv, copy_out, score_mul, cap_mul, dscale, seqs, queue, slots, sched, out_tiles)
        else:
            n_block, head_kv, batch = cute.arch.block_idx()
            if cutlass.const_expr(compact):
                batch = sTile[0]
                n_block = sTile[1]
            # Fused dQ with a bounded right window (causal): key tiles in reverse launch order, and the dQ partials
            # of a query tile are added from the highest key tile down.  Key tile n first meets query tile
            # m_min(n), which grows with n, so the highest key tiles reach every query tile first: adding in that
            # order means no CTA waits for another in steady state, and every CTA waits only on CTAs launched
            # before it (lower blockIdx.x).  Without a right bound all key tiles see the same query tiles, in
            # increasing key order.
            descending = window_right >= 0
            if cutlass.const_expr(fused and self.ordered):
                if descending:
                    n_block = cute.arch.grid_dim()[0] - 1 - n_block
            k_start, k_len, k_slot, q_start, q_len, off, left, right, m_min, m_max = self.key_bounds(batch, n_block,
                                                                                                      seqs)
            n_m = m_max - m_min
            total = group * n_m
            n0 = n_block * BN
            # A key tile past k_len, or one no valid query sees: dK = dV = 0; the CTA writes the zeros of its rows
            # up to the slot end (the handler's memset may have done so already) and computes nothing.
            if n0 < k_len and total > 0:
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp_idx == 0:
                        self.produce_tile(tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q,
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages),
                                          n_block, head_kv, group, n_m, m_min, total, q_start, k_start, True)
                    if cutlass.const_expr(fused):
                        if warp_idx == 1:
                            self.reduce_dq(tma_atom_dQ, tma_dQ, sdQ, mSem, mUsedQ, n_block, head_kv, group, batch, n_m,
                                           m_min, total, q_start, q_len, k_len, off, left, right, descending)
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    self.consume(sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s, mma_kv,
                                 copy_out, score_mul, cap_mul, dscale, n_block, sTile, head_kv, group, n_m, m_min, total,
                                 q_start, q_len, k_start, k_len, k_slot, off, left, right, fused,
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages), False)
            else:
                tidx, _, _ = cute.arch.thread_idx()
                if tidx < self.num_consumer_threads:
                    for out in (mdK, mdV):
                        g = cute.local_tile(cute.domain_offset((k_start, 0), out[None, head_kv, None]), (BN, HD),
                                            (n_block, 0))
                        sc.zero_rows_global(self.dtype, BN, HD, copy_out, g, n0, k_slot, tidx)

    @cute.jit
    def key_bounds(self, batch, n_block, seqs):
        """(k_start, k_len, k_slot, q_start, q_len, off, left, right, m_min, m_max) of key tile n_block of
        sequence `batch`: the rows it covers and the query tiles that see it."""
        mCuQ, mCuK, mUsedQ, mUsedK, window_left, window_right, bottom_right = seqs
        k_start, k_len = bounds.used_length(mCuK, mUsedK, batch)
        k_slot = bounds.slot_length(mCuK, batch)
        q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
        off, left, right = bounds.window_bounds(q_len, k_len, window_left, window_right, bottom_right)
        m_min, m_max = bc.m_block_range(n_block, self.block_m, self.block_n, q_len, k_len, off, left, right)
        return k_start, k_len, k_slot, q_start, q_len, off, left, right, m_min, m_max

    @cute.jit
    def produce_tile(self, tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, state_kv, state, n_block, head_kv, group, n_m,
                     m_min, total, q_start, k_start, kv_first: cutlass.Constexpr):
        """Producer warp: the loads of one key tile: K / V (resident), then Q / dO of every step (query head of
        the group, query tile).  Without `kv_first` (the queue) Q / dO of the first steps go first: K / V wait
        for the previous tile's consumers to release sK / sV (after its last step with staging tiles, after its
        epilogue at head dims 192 / 256), and these loads need not.  Returns the advanced pipeline states."""
        BN, HD = self.block_n, self.head_dim
        tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V = tmas
        n_ahead = cutlass.Int32(0)
        if cutlass.const_expr(not kv_first):
            n_ahead = cutlass.min(total, self.num_stages)
            for it in cutlass.range(n_ahead, unroll=1):
                state = self.produce_step(tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start)
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
        if cutlass.const_expr(kv_first):
            for it in cutlass.range(total, unroll=1):
                state = self.produce_step(tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start)
        else:
            for it in cutlass.range(n_ahead, total, 1, unroll=1):
                state = self.produce_step(tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start)
        return state_kv, state

    @cute.jit
    def produce_step(self, tmas, sQ, sdO, pipe_q, state, it, head_kv, group, n_m, m_min, q_start):
        """Producer warp: Q / dO of step `it` (query head head_kv * group + it // n_m, query tile
        m_min + it % n_m) into stage `state`; returns the advanced state."""
        BM, HD = self.block_m, self.head_dim
        tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, _, _, _, _ = tmas
        head = head_kv * group + it // n_m
        m_block = m_min + it % n_m
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

    @cute.jit
    def claim_key_tile(self, queue, seqs, sched):
        """Producer warp: the next claimed key tile inside its sequence's slot, or the end (holes skipped:
        tile_queue.take_compact_tile); returns (number, sequence, key tile, kv head)."""
        per_head, heads_kv, _, batch_size = sched
        lin, head_kv, batch, n_block = tile_queue.take_compact_tile(queue, per_head, heads_kv, seqs[1], batch_size,
                                                                    self.block_n, False)
        return lin, batch, n_block, head_kv

    @cute.jit
    def produce_claimed(self, tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, seqs, queue, sched):
        """The compact kernel's producer: claims a key tile, publishes its (number, sequence, key tile, kv
        head) for the consumers, issues its loads, and claims the next one once they are issued (as the
        forward's `produce_claimed`, which says why)."""
        per_head, heads_kv, group, _ = sched
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        state_tile = tile_queue.producer_state()
        total_tiles = per_head * heads_kv
        lin, batch, n_block, head_kv = self.claim_key_tile(queue, seqs, sched)
        k_start, k_len, k_slot, q_start, _, _, _, _, m_min, m_max = self.key_bounds(batch, n_block, seqs)
        state_tile = tile_queue.publish(queue, state_tile, (lin, batch, n_block, head_kv, k_start, k_len, k_slot,
                                                                cutlass.Int32(0)))
        while lin < total_tiles:
            n_m = m_max - m_min
            if n_block * self.block_n < k_len and n_m > 0:
                state_kv, state = self.produce_tile(tmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, state_kv, state, n_block,
                                                    head_kv, group, n_m, m_min, group * n_m, q_start, k_start, False)
            lin, batch, n_block, head_kv = self.claim_key_tile(queue, seqs, sched)
            k_start, k_len, k_slot, q_start, _, _, _, _, m_min, m_max = self.key_bounds(batch, n_block, seqs)
            state_tile = tile_queue.publish(queue, state_tile, (lin, batch, n_block, head_kv, k_start, k_len, k_slot,
                                                                cutlass.Int32(0)))

    @cute.jit
    def consume_claimed(self, sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s,
                        mma_kv, copy_out, score_mul, cap_mul, dscale, seqs, queue, slots, sched, out_tiles):
        """The compact kernel's consumers: the key tiles the producer claimed, in its order, until a claim past
        the end.  The slot of the current tile stays held until its epilogue is done: `key_tile` reads the
        key tile from it (a view of the slot's (sequence, key tile) stands in for the one-tile kernel's
        sTile).  A tile with nothing to compute gets its zeros (rows up to the slot end)."""
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
            sTile = cute.make_tensor(slots.iterator + (state_tile.index * 8 + 1), cute.make_layout(7))
            k_start, k_len, k_slot, q_start, q_len, off, left, right, m_min, m_max = self.key_bounds(batch, n_block,
                                                                                                      seqs)
            n_m = m_max - m_min
            n0 = n_block * BN
            if n0 < k_len and n_m > 0:
                state_kv, state = self.consume(sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK,
                                               mdV, mma_s, mma_kv, copy_out, score_mul, cap_mul, dscale, n_block,
                                               sTile, head_kv, group, n_m, m_min, group * n_m, q_start, q_len,
                                               k_start, k_len, k_slot, off, left, right, False, state_kv, state, True,
                                               out_tiles)
            else:
                for out in (mdK, mdV):
                    g = cute.local_tile(cute.domain_offset((k_start, 0), out[None, head_kv, None]), (BN, HD),
                                        (n_block, 0))
                    sc.zero_rows_global(self.dtype, BN, HD, copy_out, g, n0, k_slot, tidx)
            state_tile = tile_queue.release(queue, state_tile)
            lin = tile_queue.peek(queue, state_tile)

    @cute.jit
    def reduce_dq(self, tma_atom_dQ, tma_dQ, sdQ, mSem, mUsedQ, n_block, head_kv, group, batch, n_m, m_min, total,
                  q_start, q_len, k_len, off, left, right, descending):
        """Fused dQ, the producer warpgroup's second warp: add each step's fp32 dQ partial (sdQ, written by
        the consumers) into the global accumulator with one TMA reduce-add, in a fixed order.

        Determinism: fp32 addition does not commute bit for bit, so the partials of one (sequence, head,
        query tile) are added in a fixed key-tile order: increasing, or decreasing where `descending` (see
        `body`).  Before adding, this CTA waits until the tile's semaphore counts exactly the key tiles
        before it in that order that contribute to the query tile (computed with the same `m_block_range`
        the contributors iterate with); after its add is complete it increments the semaphore (release).
        A CTA only waits on CTAs of lower blockIdx.x, launched before it, so the wait cannot deadlock.
        Rows of the tile past q_len hold exact zeros (dS = 0 there, K rows past k_len are zeroed): adding
        them into a neighbouring sequence's rows changes no bit, whatever the order."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        lane = cute.arch.lane_idx()
        n_heads = cute.size(tma_dQ.shape[2])
        n_mb = cute.size(mSem.shape[0]) // (cute.size(mUsedQ.shape[0]) * n_heads)
        for it in cutlass.range(total, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            # Contributors before this CTA in the adding order: each lane tests every 32nd key tile.
            before = cutlass.Int32(0)
            c_lo = cutlass.Int32(0)
            c_hi = n_block
            if descending:
                c_lo = n_block + 1
                c_hi = (k_len + BN - 1) // BN
            for j in cutlass.range((c_hi - c_lo + 31) // 32, unroll=1):
                nn = c_lo + j * 32 + lane
                if nn < c_hi:
                    lo, hi = bc.m_block_range(nn, BM, BN, q_len, k_len, off, left, right)
                    if m_block >= lo and m_block < hi:
                        before += 1
            before = cute.arch.warp_reduction_sum(before)
            sem = mSem.iterator + ((batch * n_heads + head) * n_mb + m_block)
            cute.arch.barrier(barrier_id=_BAR_DQ_FULL, number_of_threads=_DQ_SYNC_THREADS)
            if cutlass.const_expr(self.ordered):
                seen = cute.arch.load(sem, cutlass.Int32, sem="acquire", scope="gpu")
                while seen != before:
                    seen = cute.arch.load(sem, cutlass.Int32, sem="acquire", scope="gpu")
            cute.arch.fence_proxy("async.global")
            gD = cute.local_tile(cute.domain_offset((q_start, 0), tma_dQ[None, None, head]), (BM, HD), (m_block, 0))
            tDsD, tDgD = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                                               cute.group_modes(gD, 0, 2))
            cute.copy(tma_atom_dQ, tDsD, tDgD)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            # sdQ may be overwritten now; the consumers wait for this before their next write.
            if it + 1 < total:
                cute.arch.barrier_arrive(barrier_id=_BAR_DQ_EMPTY, number_of_threads=_DQ_SYNC_THREADS)
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            cute.arch.fence_proxy("async.global")
            if lane == 0:
                cute.arch.atomic_add(sem, cutlass.Int32(1), sem="release", scope="gpu")
            cute.arch.sync_warp()

    @cute.jit
    def consume(self, sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s, mma_kv,
                copy_out, score_mul, cap_mul, dscale, n_block, sTile, head_kv, group, n_m, m_min, total, q_start,
                q_len, k_start, k_len, k_slot, off, left, right, fused: cutlass.Constexpr, state_kv, state,
                release_kv: cutlass.Constexpr, out_tiles=None):
        """The consumers' part of one key tile; returns the advanced pipeline states.  `release_kv`: free the
        K / V stage for the next tile: right after the last step's GEMMs where `out_tiles` (two staging tiles of
        sK's layout) take dK / dV, else once the epilogue, staged through sK / sV, has read them."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        dt = self.dtype
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        n0 = n_block * BN


        # Accumulate flags are fixed per TiledMma object (never set inside staged control flow): the first
        # k-block of S^T / dP^T uses mma_s0 (overwrite), everything else accumulates.
        mma_s0 = self._mma_s()
        mma_s0.set(warpgroup.Field.ACCUMULATE, False)
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        mma_kv.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(self.split_head_dim):
            # mma_s is one warpgroup's tile: S^T in warpgroup 0, dP^T in warpgroup 1.
            wg_s = mma_s.get_slice(0)
            thr_s = mma_s.get_slice(tidx % 128)
        else:
            wg_s = mma_s.get_slice(wg * 128)
            thr_s = mma_s.get_slice(tidx)
        wg_kv = mma_kv.get_slice(wg * 128)
        thr_kv = mma_kv.get_slice(tidx)
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))
        tSrV = wg_s.make_fragment_A(wg_s.partition_A(sV))
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ))
        tSrdO = wg_s.make_fragment_B(wg_s.partition_B(sdO))
        tKrQt = wg_kv.make_fragment_B(wg_kv.partition_B(sc.transposed(sQ)))
        tVrdOt = wg_kv.make_fragment_B(wg_kv.partition_B(sc.transposed(sdO)))
        acc_dK = thr_kv.make_fragment_C(thr_kv.partition_shape_C((BN, HD)))
        acc_dV = thr_kv.make_fragment_C(thr_kv.partition_shape_C((BN, HD)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        s_shape = thr_s.partition_shape_C((BN, BM))
        # (key, query) coordinates of this thread's S^T fragment (the warpgroup's 64 keys included).
        cS_mn = masking.acc_mn_view_sm90(thr_s.partition_C(cute.make_identity_tensor((BN, BM))))
        n_cols = cute.size(cS_mn, mode=[1])
        lse2 = cute.make_rmem_tensor((n_cols,), cutlass.Float32)
        delta = cute.make_rmem_tensor((n_cols,), cutlass.Float32)
        rP = cute.make_rmem_tensor(s_shape, dt)
        tPrP = cute.make_tensor(rP.iterator, sc.c_to_a_layout(rP.layout))
        rdS = cute.make_rmem_tensor(s_shape, dt)
        tPrdS = cute.make_tensor(rdS.iterator, sc.c_to_a_layout(rdS.layout))

        # Row statistics of a step (lse2 / Delta of block_m queries) go through shared memory: each of the
        # warpgroup's threads loads one value from global memory one step ahead (1 register instead of
        # 2 x 16), stores it, and the fragments read them back right before use (register pressure: the
        # dK and dV accumulators take 128 registers per thread).
        t_wg = tidx % 128
        stat_kind = t_wg // BM
        stat_row = t_wg % BM
        stat = self.stat_load(mLSE, mDelta, head_kv * group, q_start, q_len, m_min * BM + stat_row, stat_kind)

        # Fused dQ (dQ partial = dS K per step): dS^T goes to shared memory (both warpgroups' 64 keys are the
        # GEMM's k extent), each warpgroup computes half of the head dim, the partial goes to sdQ for the
        # reducer warp (reduce_dq).
        mma_dq = None
        mma_dq0 = None
        tQrdS = None
        tQrKt = None
        copy_ds = None
        copy_dq = None
        dq_shape = None
        if cutlass.const_expr(fused):
            mma_dq = sc.make_mma_split_n(dt, BM, HD // 2, 2, a_major_mn=True, b_major_mn=True)
            mma_dq0 = sc.make_mma_split_n(dt, BM, HD // 2, 2, a_major_mn=True, b_major_mn=True)
            mma_dq0.set(warpgroup.Field.ACCUMULATE, False)
            mma_dq.set(warpgroup.Field.ACCUMULATE, True)
            wg_dq = mma_dq.get_slice(wg * 128)
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sc.transposed(sdS)))
            tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sc.transposed(sK)))
            dq_shape = mma_dq.get_slice(tidx).partition_shape_C((BM, HD))
            copy_ds = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt), mma_s)
            copy_dq = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32),
                                             mma_dq)

        # Head-dim split: per-thread views of P^T (fp32) and dS^T in shared memory,
        # in the S^T fragment's layout (the same thread of the other warpgroup reads what this one wrote).
        copy_px = None
        copy_dsx = None
        if cutlass.const_expr(self.split_head_dim):
            copy_px = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32),
                                             mma_s)
            copy_dsx = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt), mma_s)

        pipe_kv.consumer_wait(state_kv)
        if cutlass.const_expr(fused):
            if n0 + BN > k_len:
                # Key rows past k_len meet dS = 0 in dQ += dS K (0 * NaN = NaN): zeros first (each warpgroup
                # zeroes all of them; same values), then both warpgroups meet before any GEMM.
                sc.zero_rows_from(dt, BN, HD, sK, k_len - n0, tidx % 128, _BAR_WG_BASE + wg)
            cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
        # (query head, query tile) of the step, advanced by counting (no integer division per step).
        head = head_kv * group
        m_block = m_min
        for it in cutlass.range(total, unroll=1):
            m0 = m_block * BM
            par = it % 2
            if t_wg < 2 * BM:
                sStat[stat_row, stat_kind, par, wg] = self.stat_finish(stat, stat_kind)
            cute.arch.barrier(barrier_id=_BAR_WG_BASE + wg, number_of_threads=128)
            next_head = head
            next_m = m_block + 1
            if next_m == m_min + n_m:
                next_m = m_min
                next_head = head + 1
            if it + 1 < total:
                # Issued a step ahead; nothing reads the loaded values before the next step's store.
                stat = self.stat_load(mLSE, mDelta, next_head, q_start, q_len, next_m * BM + stat_row, stat_kind)
            pipe_q.consumer_wait(state)
            stage = state.index
            if m0 + BM > q_len:
                # Query rows past q_len: zeros before any GEMM reads the stage (0 * NaN = NaN otherwise).
                sc.zero_rows_from(dt, BM, HD, sQ[None, None, stage], q_len - m0, tidx % 128, _BAR_WG_BASE + wg)
                sc.zero_rows_from(dt, BM, HD, sdO[None, None, stage], q_len - m0, tidx % 128, _BAR_WG_BASE + wg)
            if cutlass.const_expr(self.split_head_dim):
                self.exchange_step(wg, tidx % 128, stage, par, sStat, sdQ, sdS, copy_px, copy_dsx, mma_s0, mma_s,
                                   mma_kv, tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, acc_dK, acc_dV, rP, rdS, tPrP,
                                   tPrdS, cS_mn, lse2, delta, s_shape, self.key_tile(n_block, sTile), m_block,
                                   q_len, k_len, off, left, right, score_mul, cap_mul)
            else:
                acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                sc.gemm(mma_s0, mma_s, acc_S, tSrK, tSrQ[None, None, None, stage], True)
                acc_dP = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                sc.gemm(mma_s0, mma_s, acc_dP, tSrV, tSrdO[None, None, None, stage], True)
                # Shared-memory reads of the row statistics before the waits, so their latency hides under the
                # GEMMs (Nsight Compute, session 8: read after the wait, the exp2's FFMA stalled on them).  With
                # softcap they stay after the waits, where the GPU-checked softcap kernels have them: that
                # kernel spills either way (ptxas 152 B of stack, early or late), and early reads were not
                # timed there.
                early_stats = not self.has_softcap
                if cutlass.const_expr(early_stats):
                    for x in cutlass.range_constexpr(n_cols):
                        lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
                n_step = self.key_tile(n_block, sTile)
                need = bounds.tile_needs_mask(n_step, m_block, BM, BN, q_len, k_len, off, left, right)
                warpgroup.wait_group(1)
                if cutlass.const_expr(not early_stats):
                    for x in cutlass.range_constexpr(n_cols):
                        lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
                s_mn = masking.acc_mn_view_sm90(acc_S)
                t_mn = s_mn
                if cutlass.const_expr(self.has_softcap):
                    acc_T = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                    t_mn = masking.acc_mn_view_sm90(acc_T)
                n0_step = self.key_tile(n_block, sTile) * BN
                bc.probs_and_dscale(s_mn, t_mn, cS_mn, lse2, m0, n0_step, k_len, off, left, right, score_mul, cap_mul,
                                    need, 1, self.has_softcap)
                rP.store(acc_S.load().to(dt))
                if cutlass.const_expr(early_stats):
                    for x in cutlass.range_constexpr(n_cols):
                        delta[x] = sStat[cS_mn[0, x][1], 1, par, wg]
                if cutlass.const_expr(self.pin_waits):
                    sc.wgmma_wait_after(rP, cute.size(mLSE.shape[1]) >> 30, 0)  # total query rows < 2^30
                warpgroup.wait_group(0)
                if cutlass.const_expr(not early_stats):
                    for x in cutlass.range_constexpr(n_cols):
                        delta[x] = sStat[cS_mn[0, x][1], 1, par, wg]
                # dV += P^T dO runs while dS^T is formed.
                sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
                bc.dscores(s_mn, masking.acc_mn_view_sm90(acc_dP), t_mn, delta, 1, self.has_softcap)
                rdS.store(acc_dP.load().to(dt))
                sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
            if cutlass.const_expr(fused):
                thr_ds = copy_ds.get_slice(tidx)
                cute.copy(copy_ds, thr_ds.retile(rdS), thr_ds.partition_D(sdS[None, None, par]))
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
                acc_dQ = cute.make_rmem_tensor(dq_shape, cutlass.Float32)
                sc.gemm(mma_dq0, mma_dq, acc_dQ, tQrdS[None, None, None, par], tQrKt, True)
                warpgroup.wait_group(0)
                if it > 0:
                    cute.arch.barrier(barrier_id=_BAR_DQ_EMPTY, number_of_threads=_DQ_SYNC_THREADS)
                thr_dq = copy_dq.get_slice(tidx)
                cute.copy(copy_dq, thr_dq.retile(acc_dQ), thr_dq.partition_D(sdQ))
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier_arrive(barrier_id=_BAR_DQ_FULL, number_of_threads=_DQ_SYNC_THREADS)
            warpgroup.wait_group(0)
            pipe_q.consumer_release(state)
            state.advance()
            head = next_head
            m_block = next_m

        # Epilogue: dK (times the softmax scale) and dV through sK / sV, or the staging tiles (every consumer's
        # GEMMs are complete after the barrier; with staging tiles it also orders this tile's writes after the
        # previous tile's reads): valid key rows, then zeros up to the slot end.
        sOutK, sOutV = sK, sV
        if cutlass.const_expr(release_kv and out_tiles is not None):
            # This warp's GEMMs that read sK / sV are complete (the last step waited for them): the producer
            # may load the next tile's K / V once every consumer warp has arrived, while this one stores.
            pipe_kv.consumer_release(state_kv)
            sOutK, sOutV = out_tiles
        cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
        n_block = self.key_tile(n_block, sTile)
        n0 = n_block * BN
        head_kv, k_start, k_len, k_slot, tidx_e = self.epilogue_rows(sTile, head_kv, k_start, k_len, k_slot, tidx)
        gdK = cute.local_tile(cute.domain_offset((k_start, 0), mdK[None, head_kv, None]), (BN, HD), (n_block, 0))
        gdV = cute.local_tile(cute.domain_offset((k_start, 0), mdV[None, head_kv, None]), (BN, HD), (n_block, 0))
        sc.store_rows_via_smem(acc_dK, dscale, dt, mma_kv, copy_out, sOutK, gdK, BN, HD, n0, k_len, tidx_e,
                               _BAR_CONSUMERS, self.num_consumer_threads, k_slot)
        sc.store_rows_via_smem(acc_dV, cutlass.Float32(1.0), dt, mma_kv, copy_out, sOutV, gdV, BN, HD, n0, k_len,
                               tidx_e, _BAR_CONSUMERS, self.num_consumer_threads, k_slot)
        if cutlass.const_expr(release_kv and out_tiles is None):
            # Every consumer has read sK / sV out: the producer may load the next tile's K / V.
            cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
            pipe_kv.consumer_release(state_kv)
        state_kv.advance()
        return state_kv, state


    @cute.jit
    def key_tile(self, n_block, sTile):
        """The consumers' key tile, where a step or the epilogue needs it.  The dense kernel's is blockIdx.x,
        which ptxas re-reads from SR_CTAID at each use; the compact kernel's comes from the search (`body`), and
        a register holding it through the loop would compete with the dK / dV accumulators.  So the compact
        kernel loads it from shared memory (`sTile`, written before the pipelines' barrier) at each use; the
        loop's barriers keep those loads inside the loop.  (Session 16's compact kernel, in which every warp
        searched and kept the result, spilled 19 values in the loop; this one spills 3 at hd128.)"""
        if cutlass.const_expr(sTile is None):
            return n_block
        return sTile[1]

    @cute.jit
    def epilogue_rows(self, sTile, head_kv, k_start, k_len, k_slot, tidx):
        """(kv head, k_start, k_len, k_slot, thread index) where the epilogue needs them.  The queued kernel
        re-reads them from its tile's slot, after the epilogue's barrier, and adds the slot's run-time 0 to the
        thread index, so that ptxas computes the epilogue's addresses in the epilogue: it hoisted them out of
        the tile loop otherwise, and at head dim 128, with no register to spare across the step loop, kept 35 of
        them per thread in local memory, reloaded by every tile's epilogue."""
        if cutlass.const_expr(sTile is None or cute.size(sTile) == 2):
            return head_kv, k_start, k_len, k_slot, tidx
        return sTile[2], sTile[3], sTile[4], sTile[5], tidx + sTile[6]

    @cute.jit
    def exchange_step(self, wg, tidx_wg, stage, par, sStat, sPx, sdSx, copy_px, copy_dsx, mma_s0, mma_s, mma_kv, tSrK,
                      tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, acc_dK, acc_dV, rP, rdS, tPrP, tPrdS, cS_mn, lse2, delta,
                      s_shape, n_block, m_block, q_len, k_len, off, left, right, score_mul, cap_mul):
        """One step of the head-dim split.  Warpgroup 0: S^T = K Q^T, P^T (masks by select), P^T -> sPx,
        dV_0 += P^T dO_0 (its half of the head dim), then dS^T <- sdSx and dK_0 += dS^T Q_0.  Warpgroup 1:
        dP^T = V dO^T, P^T <- sPx, dS^T = P^T (dP^T - Delta) (0 where P^T = 0, by select), dS^T -> sdSx,
        dV_1 += P^T dO_1, dK_1 += dS^T Q_1.  Each shared tile has one writer and one reader per step; the named
        barriers order them, and a warpgroup writes the next step's tile only after it has waited for the
        other's tile of this step, which the other wrote after reading this step's (so one buffer each is
        enough).  Without softcap P^T crosses in fp32, so dS^T is the same expression on the same values as in
        a kernel that computes both.  With softcap the fp32 tile carries P^T (1 - tanh^2) instead (0 by select
        where P^T = 0, so a NaN score of a key past its length cannot reach it), and P^T crosses in the input
        dtype for warpgroup 1's dV GEMM, through the dS^T tile: each thread of warpgroup 1 reads its elements of
        P^T there before it writes its elements of dS^T to the same addresses, and warpgroup 0 writes the next
        P^T there only after reading dS^T."""
        BM, BN = self.block_m, self.block_n
        dt = self.dtype
        n_cols = cute.size(cS_mn, mode=[1])
        acc_X = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        x_mn = masking.acc_mn_view_sm90(acc_X)
        thr_px = copy_px.get_slice(tidx_wg)
        thr_dsx = copy_dsx.get_slice(tidx_wg)
        if wg == 0:
            sc.gemm(mma_s0, mma_s, acc_X, tSrK, tSrQ[None, None, None, stage], True)
            need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
            for x in cutlass.range_constexpr(n_cols):
                lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
            warpgroup.wait_group(0)
            if cutlass.const_expr(self.has_softcap):
                acc_T = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                t_mn = masking.acc_mn_view_sm90(acc_T)
                bc.probs_and_dscale(x_mn, t_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off, left, right,
                                    score_mul, cap_mul, need, 1, True)
                for r in cutlass.range_constexpr(cute.size(x_mn, mode=[0])):
                    for c in cutlass.range_constexpr(n_cols):
                        p = x_mn[r, c]
                        pt = p * t_mn[r, c]
                        if p == cutlass.Float32(0.0):
                            pt = cutlass.Float32(0.0)
                        t_mn[r, c] = pt
                cute.copy(copy_px, thr_px.retile(acc_T), thr_px.partition_D(sPx))
                rP.store(acc_X.load().to(dt))
                cute.copy(copy_dsx, thr_dsx.retile(rP), thr_dsx.partition_D(sdSx))
                cute.arch.barrier_arrive(barrier_id=_BAR_P_READY, number_of_threads=self.num_consumer_threads)
            else:
                bc.probs_and_dscale(x_mn, x_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off, left, right,
                                    score_mul, cap_mul, need, 1, False)
                cute.copy(copy_px, thr_px.retile(acc_X), thr_px.partition_D(sPx))
                cute.arch.barrier_arrive(barrier_id=_BAR_P_READY, number_of_threads=self.num_consumer_threads)
                rP.store(acc_X.load().to(dt))
            # dV_0 += P^T dO_0 runs while warpgroup 1 forms dS^T.
            sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
            cute.arch.barrier(barrier_id=_BAR_DS_READY, number_of_threads=self.num_consumer_threads)
            cute.copy(copy_dsx, thr_dsx.partition_S(sdSx), thr_dsx.retile(rdS))
            sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
            # Retire every wgmma group inside the branch: with a group in flight across the branches' merge
            # ptxas serialises every wgmma of the kernel (a wait after each HGMMA in SASS).
            warpgroup.wait_group(0)
        else:
            sc.gemm(mma_s0, mma_s, acc_X, tSrV, tSrdO[None, None, None, stage], True)
            for x in cutlass.range_constexpr(n_cols):
                delta[x] = sStat[cS_mn[0, x][1], 1, par, wg]
            acc_P = cute.make_rmem_tensor(s_shape, cutlass.Float32)
            warpgroup.wait_group(0)
            cute.arch.barrier(barrier_id=_BAR_P_READY, number_of_threads=self.num_consumer_threads)
            cute.copy(copy_px, thr_px.partition_S(sPx), thr_px.retile(acc_P))
            if cutlass.const_expr(self.has_softcap):
                cute.copy(copy_dsx, thr_dsx.partition_S(sdSx), thr_dsx.retile(rP))
            p_mn = masking.acc_mn_view_sm90(acc_P)
            # With softcap p_mn holds P^T (1 - tanh^2): the same select, one multiplication fewer.
            bc.dscores(p_mn, x_mn, p_mn, delta, 1, False)
            rdS.store(acc_X.load().to(dt))
            cute.copy(copy_dsx, thr_dsx.retile(rdS), thr_dsx.partition_D(sdSx))
            cute.arch.barrier_arrive(barrier_id=_BAR_DS_READY, number_of_threads=self.num_consumer_threads)
            if cutlass.const_expr(not self.has_softcap):
                rP.store(acc_P.load().to(dt))
            sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
            sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
            warpgroup.wait_group(0)

    @cute.jit
    def stat_load(self, mLSE: cute.Tensor, mDelta: cute.Tensor, head: cutlass.Int32, q_start: cutlass.Int32,
                  q_len: cutlass.Int32, i: cutlass.Int32, kind: cutlass.Int32):
        """The raw value for `stat_finish`: kind 0 the lse of query i, kind 1 its Delta.  No branch depends on
        the loaded value, so the load stays in flight until the next step stores it (Nsight Compute, session
        8: testing lse right after the load exposed the global-memory latency every step).  Padded queries
        (i >= q_len) load nothing and get lse = -inf, Delta = 0."""
        v = cutlass.Float32(0.0)
        if kind == 0:
            v = -cutlass.Float32.inf
        if i < q_len:
            if kind == 0:
                v = mLSE[head, q_start + i]
            else:
                v = mDelta[head, q_start + i]
        return v

    @cute.jit
    def stat_finish(self, v: cutlass.Float32, kind: cutlass.Int32):
        """kind 0: lse2 = lse * log2(e), with the sentinel +inf for padded queries and queries with lse = -inf
        (their P and dS become 0 by select); kind 1: Delta as loaded (only reaches dS where P != 0, i.e. rows
        with a finite lse)."""
        r = v
        if kind == 0:
            r = cutlass.Float32.inf
            if v != -cutlass.Float32.inf:
                r = v * bc.LOG2_E
        return r


class BwdDKDVQSm90(BwdDKDVSm90):
    """dK, dV and the fp32 dQ partials of one key tile (the 5-GEMM backward): `BwdDKDVSm90` plus, per step,
    dQ_partial = dS K (wgmma, dS^T staged in shared memory) added into the zero-filled fp32 accumulator
    `mdQacc` ([total_q, N, head_dim]) by a TMA reduce-add in key-tile order (`reduce_dq`; `mSem`: int32
    semaphores, zero-filled, [batch * N * ceil(max_seqlen_q / block_m)]).  `DqConvertSm90` then writes dQ."""

    def __init__(self, dtype, head_dim: int, block_m: int = 64, block_n: int = 128, num_stages: int = 2,
                 has_softcap: bool = False, ordered: bool = True):
        super().__init__(dtype, head_dim, block_m, block_n, num_stages, has_softcap)
        # The fused dQ GEMM splits the head dim between the warpgroups over the 128-key tile's dS^T, and its
        # shared tiles are the ones the head-dim split's exchange uses: the two do not combine.
        assert not self.split_head_dim, "the fused-dQ kernel needs block_n = 128"
        # ordered=False (experiments only, JPS_SM90F_UNORDERED=1): no semaphore wait and natural launch order,
        # to measure what the ordering costs.  Not deterministic, so it breaks the contract's bitwise
        # guarantees; never built by default.
        self.ordered = ordered

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
        mdQacc: cute.Tensor,
        mSem: cute.Tensor,
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
        self._launch(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mdQacc, mSem, mCuQ, mCuK, mUsedQ, mUsedK, None,
                     score_mul, cap_mul, dscale, window_left, window_right, bottom_right, max_seqlen_k, stream)


class DqConvertSm90:
    """dQ = dscale * dQ_accum in the input dtype, for every row of [total_q, N, head_dim]: the accumulator is
    zero-filled and only ever receives exact zeros in padded rows and gaps, so padded rows of dQ come out
    exactly 0 and no memset of dQ is needed.  One thread per 8 consecutive values (two 16-byte loads, one
    16-byte store); one CTA per (8 x 256 / head_dim rows, head)."""

    num_threads = 256

    def __init__(self, dtype, head_dim: int):
        assert head_dim % 8 == 0 and (self.num_threads * 8) % head_dim == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.rows = self.num_threads * 8 // head_dim

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, dscale: cutlass.Float32, stream: cuda.CUstream):
        HD, R = self.head_dim, self.rows
        thr = cute.make_layout((R, HD // 8), stride=(HD // 8, 1))
        val = cute.make_layout((1, 8))
        copy_in = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=128), thr, val)
        copy_out = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128), thr, val)
        grid = (cute.ceil_div(cute.size(mAcc.shape[0]), R), cute.size(mAcc.shape[1]), 1)
        self.kernel(mAcc, mdQ, dscale, copy_in, copy_out).launch(grid=grid, block=[self.num_threads, 1, 1],
                                                                 stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, dscale: cutlass.Float32, copy_in: cute.TiledCopy,
               copy_out: cute.TiledCopy):
        HD, R = self.head_dim, self.rows
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, _ = cute.arch.block_idx()
        total = cute.size(mAcc.shape[0])
        gA = cute.local_tile(mAcc[None, head, None], (R, HD), (row_block, 0))
        gD = cute.local_tile(mdQ[None, head, None], (R, HD), (row_block, 0))
        cA = cute.local_tile(cute.make_identity_tensor((total, HD)), (R, HD), (row_block, 0))
        thr_in = copy_in.get_slice(tidx)
        thr_out = copy_out.get_slice(tidx)
        tAg = thr_in.partition_S(gA)
        tAc = thr_in.partition_S(cA)
        tDg = thr_out.partition_D(gD)
        if tAc[0][0] < total:
            r = cute.make_fragment_like(tAg)
            cute.copy(copy_in, tAg, r)
            o = cute.make_fragment_like(tDg)
            o.store((r.load() * dscale).to(self.dtype))
            cute.copy(copy_out, o, tDg)


class BwdDQSm90(_Sm90BwdBase):
    """dQ for one query tile of block_m = 2 x 64 queries of one head."""

    def __init__(self, dtype, head_dim: int, block_m: int = 128, block_n: int = 64, num_stages: int = 2,
                 has_softcap: bool = False, operands_in_regs: bool = False, overlap_steps: bool = False,
                 pin_waits: bool = False, dynamic_compact: bool = True, stage_out: bool = True,
                 queue_dense: bool = False):
        """Two options, off in the build (`bwd_build.SM90_BWD_DQ_OPTS`): neither changed forward+backward beyond
        the +-2% noise on the H100 (session 8), as this kernel already runs at ~620 TFLOP/s of executed GEMM
        work (benchmarks/NOTES_sm90_bwd.md).
        operands_in_regs: Q and dO (resident for the whole CTA) are copied once into registers and S = Q K^T,
        dP = dO V^T run with A from registers, so a step reads only K and V from shared memory (96 instead of
        160 KB at hd128; the hypothesis was a shared-memory bound, which the measurement did not bear out).
        Costs HD / 2 registers per thread (hd <= 128).
        overlap_steps: S and dP of the next key tile are issued before dQ += dS K of the current one, so that
        P (exp2) of the next tile runs under dP and the dQ GEMM; every wgmma group retires inside the
        iteration (ptxas keeps them asynchronous: 5 WARPGROUP.DEPBAR in SASS).  The current stage is released
        one step later, so it needs >= 3 stages to keep the loads ahead."""
        super().__init__(dtype, head_dim, block_m, block_n, num_stages, has_softcap)
        assert block_m == 128
        assert not overlap_steps or num_stages >= 3, "overlap_steps holds two K/V stages per step: use >= 3"
        self.operands_in_regs = operands_in_regs
        self.overlap_steps = overlap_steps
        # The wait for dP pinned after P (sm90_common.wgmma_wait_after): ptxas issues it after ~9 of the 32
        # exp2 otherwise, so most of P is computed after dP is complete instead of under it.
        self.pin_waits = pin_waits
        # The compact schedule with persistent CTAs that claim their query tiles from a counter (tile_queue),
        # as the forward's; False: one CTA per compact tile (the schedule until session 20).
        self.dynamic_compact = dynamic_compact
        # Every layout takes the queued compact schedule, dense ones too (as BwdDKDVSm90.queue_dense).
        self.queue_dense = dynamic_compact and queue_dense
        self.persistent_ctas = 132  # SMs of an H100 SXM / H200; more than a smaller part holds is harmless
        # The queued kernel stages dQ through a tile of its own (32 KB at head dim 128), so a tile's Q / dO can
        # be released, and the next tile's loaded, before its epilogue; not above head dim 128 (no room).
        self.separate_out = dynamic_compact and stage_out and head_dim <= 128

    @cute.jit
    def __call__(
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
        mTileCounter: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        dscale: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        stream: cuda.CUstream,
    ):
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
        # S / dP: (queries, keys), A = Q / dO (shared memory, or registers), B = K / V (both K-major).
        mma_s = sc.make_mma(dt, 2, BM // 2, BN, b_major_mn=False, a_from_regs=self.operands_in_regs)
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

        group = cute.size(mQ.shape[1]) // cute.size(mK.shape[1])
        # Query tiles: dense (ceil(max_seqlen_q / BM) per sequence) or, where that launches at least twice as
        # many CTAs, compact (bounds.compact_tile), each its own kernel (see FlashFwdSm90.__call__).
        batch, total_q = cute.size(mUsedQ.shape[0]), cute.size(mQ.shape[0])
        args = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
                mLSE, mDelta, mdQ, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, group,
                score_mul, cap_mul, dscale, window_left, window_right, bottom_right,
                sQ_layout, sK_layout, mma_s, mma_q, copy_out, q_bytes, k_bytes, SharedStorage)
        heads = cute.size(mQ.shape[1])
        # The dQ staging tile (`kernel`) of the compact kernel.
        compact = (args, max_seqlen_q, total_q, heads, batch, BM, q_bytes, SharedStorage, stream)
        if cutlass.const_expr(self.queue_dense):
            self._launch_compact(*compact)
        else:
            if bounds.use_compact_grid(max_seqlen_q, total_q, batch, BM) != 0:
                self._launch_compact(*compact)
            else:
                self.kernel(*args, False).launch(
                    grid=bounds.tile_grid(False, max_seqlen_q, total_q, heads, batch, BM),
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
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        mma_s: cute.TiledMma,
        mma_q: cute.TiledMma,
        copy_out: cute.TiledCopy,
        q_bytes: cutlass.Constexpr,
        k_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
        compact: cutlass.Constexpr,
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
        queued = compact and self.dynamic_compact
        queue = None
        if cutlass.const_expr(queued):
            # The producer warp claims query tiles and publishes them decoded.
            queue = tile_queue.create(storage.mbar_tile.data_ptr(),
                                      storage.sSlots.get_tensor(cute.make_layout((2, 4), stride=(4, 1))),
                                      mTileCounter, self.num_consumer_threads)
        pipe_q, pipe_kv = self._pipes(storage, 2 * q_bytes, 2 * k_bytes)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        tmas = (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V)
        seqs = (mCuQ, mCuK, mUsedQ, mUsedK, window_left, window_right, bottom_right)

        if cutlass.const_expr(queued):
            # Compact tiles per head (bounds.compact_tiles_per_head) x heads, each head's highest tile first.
            num_heads = cute.size(mLSE.shape[0])
            per_head = cute.size(mLSE.shape[1]) // BM + cute.size(mUsedQ.shape[0])
            sched = (per_head, num_heads, group, cute.size(mUsedQ.shape[0]))
            sOut = None
            if cutlass.const_expr(self.separate_out):
                sOut = smem.allocate_tensor(self.dtype, sQ_layout.outer, 1024, sQ_layout.inner)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.produce_claimed(tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, seqs, queue, sched)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume_claimed(sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out,
                                     score_mul, cap_mul, dscale, seqs, queue, sched, sOut)
        else:
            m_block_rev, head, batch = cute.arch.block_idx()
            # Highest query tiles first: under causal masks they visit the most key tiles (the order of CTAs
            # changes no bit of any result).  Compact: the last sequences' tiles first, each sequence's last
            # first.
            m_block = cute.arch.grid_dim()[0] - 1 - m_block_rev
            batch, m_block = bounds.tile_of_cta(compact, m_block, batch, mCuQ, cute.size(mUsedQ.shape[0]), BM)
            q_start, q_len, q_slot, k_start, k_len, off, left, right, n_min, n_max = self.tile_bounds(
                batch, m_block, seqs)
            head_kv = head // group
            m0 = m_block * BM
            # A query tile past q_len, or one whose queries see no key: dQ = 0, written for the tile's rows up
            # to the slot end (the handler's memset may have done so already); nothing is computed.
            if m0 < q_len and n_max > n_min:
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp_idx == 0:
                        self.produce_tile(tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv,
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                                       self.num_stages),
                                          m_block, head, head_kv, q_start, k_start, n_min, n_max)
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    self.consume(sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out,
                                 score_mul, cap_mul, dscale, m_block, head, q_start, q_len, q_slot, k_len, off, left,
                                 right, n_min, n_max,
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages),
                                 False)
            else:
                tidx, _, _ = cute.arch.thread_idx()
                if tidx < self.num_consumer_threads:
                    gdQ = cute.local_tile(cute.domain_offset((q_start, 0), mdQ[None, head, None]), (BM, HD),
                                          (m_block, 0))
                    sc.zero_rows_global(self.dtype, BM, HD, copy_out, gdQ, m0, q_slot, tidx)

    @cute.jit
    def tile_bounds(self, batch, m_block, seqs):
        """(q_start, q_len, q_slot, k_start, k_len, off, left, right, n_min, n_max) of query tile m_block of
        sequence `batch`: the rows it covers and the key tiles it visits."""
        mCuQ, mCuK, mUsedQ, mUsedK, window_left, window_right, bottom_right = seqs
        q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
        q_slot = bounds.slot_length(mCuQ, batch)
        k_start, k_len = bounds.used_length(mCuK, mUsedK, batch)
        off, left, right = bounds.window_bounds(q_len, k_len, window_left, window_right, bottom_right)
        n_min, n_max = bounds.n_block_range(m_block, self.block_m, self.block_n, q_len, k_len, off, left, right)
        return q_start, q_len, q_slot, k_start, k_len, off, left, right, n_min, n_max

    @cute.jit
    def produce_tile(self, tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, state_q, state, m_block, head, head_kv, q_start,
                     k_start, n_min, n_max):
        """Producer warp: the loads of one query tile (K / V of its first key tile, Q / dO, the other key
        tiles in decreasing order).  Returns the advanced pipeline states."""
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
            state.advance()
        return state_q, state

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
    def produce_claimed(self, tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, seqs, queue, sched):
        """The compact kernel's producer: tiles in the order they are claimed (each head's highest query tile
        first, as the one-tile CTAs were launched; the heads last first), each published as (number, sequence, query tile, head), the next
        one claimed once the current one's loads are issued (as the forward's `produce_claimed`, which says
        why)."""
        per_head, num_heads, group, _ = sched
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        state_tile = tile_queue.producer_state()
        total = per_head * num_heads
        lin, batch, m_block, head = self.claim_query_tile(queue, seqs, sched)
        state_tile = tile_queue.publish(queue, state_tile, (lin, batch, m_block, head))
        while lin < total:
            q_start, q_len, _, k_start, _, _, _, _, n_min, n_max = self.tile_bounds(batch, m_block, seqs)
            if m_block * self.block_m < q_len and n_max > n_min:
                state_q, state = self.produce_tile(tmas, sQ, sdO, sK, sV, pipe_q, pipe_kv, state_q, state, m_block,
                                                   head, head // group, q_start, k_start, n_min, n_max)
            lin, batch, m_block, head = self.claim_query_tile(queue, seqs, sched)
            state_tile = tile_queue.publish(queue, state_tile, (lin, batch, m_block, head))

    @cute.jit
    def consume_claimed(self, sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out,
                        score_mul, cap_mul, dscale, seqs, queue, sched, sOut):
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
            q_start, q_len, q_slot, _, k_len, off, left, right, n_min, n_max = self.tile_bounds(batch, m_block, seqs)
            m0 = m_block * BM
            if m0 < q_len and n_max > n_min:
                state_q, state = self.consume(sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q,
                                              copy_out, score_mul, cap_mul, dscale, m_block, head, q_start, q_len,
                                              q_slot, k_len, off, left, right, n_min, n_max, state_q, state, True,
                                              sOut)
            else:
                gdQ = cute.local_tile(cute.domain_offset((q_start, 0), mdQ[None, head, None]), (BM, HD), (m_block, 0))
                sc.zero_rows_global(self.dtype, BM, HD, copy_out, gdQ, m0, q_slot, tidx)
            lin = tile_queue.peek(queue, state_tile)

    @cute.jit
    def consume(self, sQ, sdO, sK, sV, pipe_q, pipe_kv, mLSE, mDelta, mdQ, mma_s, mma_q, copy_out, score_mul,
                cap_mul, dscale, m_block, head, q_start, q_len, q_slot, k_len, off, left, right, n_min, n_max,
                state_q, state, release_q: cutlass.Constexpr, sOut=None):
        """The consumers' part of one query tile; returns the advanced pipeline states.  `release_q`: free the
        Q / dO stage for the next tile: right after the last step's GEMMs where `sOut` (a staging tile of sQ's
        layout) takes dQ, else once the epilogue, staged through sQ, has read it."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        dt = self.dtype
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        m0 = m_block * BM

        mma_s0 = sc.make_mma(dt, 2, BM // 2, BN, b_major_mn=False, a_from_regs=self.operands_in_regs)
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
        bc.load_row_stats(mLSE, mDelta, head, q_start, q_len, m0, cS_mn, lse2, delta, 0)
        rdS = cute.make_rmem_tensor(s_shape, dt)
        tQrdS = cute.make_tensor(rdS.iterator, sc.c_to_a_layout(rdS.layout))

        pipe_q.consumer_wait(state_q)
        tSrQ = None
        tSrdO = None
        if cutlass.const_expr(self.operands_in_regs):
            # The (queries, head_dim) tile in the C-fragment layout of mma_q (64 rows per warpgroup, N = HD) is
            # the register A operand of an M = 64, K = HD GEMM (c_to_a_layout), read once from shared memory.
            copy_qr = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt), mma_q)
            thr_qr = copy_qr.get_slice(tidx)
            rQ = cute.make_rmem_tensor(thr_q.partition_shape_C((BM, HD)), dt)
            rdO = cute.make_rmem_tensor(thr_q.partition_shape_C((BM, HD)), dt)
            cute.copy(copy_qr, thr_qr.partition_S(sQ), thr_qr.retile(rQ))
            cute.copy(copy_qr, thr_qr.partition_S(sdO), thr_qr.retile(rdO))
            tSrQ = cute.make_tensor(rQ.iterator, sc.c_to_a_layout(rQ.layout))
            tSrdO = cute.make_tensor(rdO.iterator, sc.c_to_a_layout(rdO.layout))
        else:
            tSrQ = wg_s.make_fragment_A(wg_s.partition_A(sQ))
            tSrdO = wg_s.make_fragment_A(wg_s.partition_A(sdO))
        acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_T = None
        if cutlass.const_expr(self.has_softcap):
            acc_T = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        n_steps = n_max - n_min
        opaque_zero = cute.size(mLSE.shape[1]) >> 30  # total query rows < 2^30: a run-time 0 (wgmma_wait_after)
        if cutlass.const_expr(self.overlap_steps):
            # Key tiles n_max - 1 down to n_min.  Step j: S / dP of tile j + 1 and dQ += dS_j K_j are in flight
            # together; tile j's stage is released once dQ_j is complete.
            state_rel = state.clone()
            n_block = n_max - 1
            self.dq_scores_issue(pipe_kv, state, sK, mma_s0, mma_s, acc_S, acc_dP, tSrQ, tSrdO, tSrK, tSrV, n_block,
                                 k_len, tidx, wg)
            state.advance()
            warpgroup.wait_group(1)
            self.dq_probs(acc_S, acc_T, cS_mn, lse2, m_block, n_block, q_len, k_len, off, left, right, score_mul,
                          cap_mul)
            warpgroup.wait_group(0)
            self.dq_dscores(acc_S, acc_dP, acc_T, delta, rdS)
            for it in cutlass.range(n_steps - 1, unroll=1):
                n_block = n_max - 2 - it
                self.dq_scores_issue(pipe_kv, state, sK, mma_s0, mma_s, acc_S, acc_dP, tSrQ, tSrdO, tSrK, tSrV,
                                     n_block, k_len, tidx, wg)
                state.advance()
                sc.gemm(mma_q, mma_q, acc_dQ, tQrdS, tQrKt[None, None, None, state_rel.index], False)
                warpgroup.wait_group(2)
                self.dq_probs(acc_S, acc_T, cS_mn, lse2, m_block, n_block, q_len, k_len, off, left, right,
                              score_mul, cap_mul)
                warpgroup.wait_group(0)
                pipe_kv.consumer_release(state_rel)
                state_rel.advance()
                self.dq_dscores(acc_S, acc_dP, acc_T, delta, rdS)
            sc.gemm(mma_q, mma_q, acc_dQ, tQrdS, tQrKt[None, None, None, state_rel.index], False)
            warpgroup.wait_group(0)
            pipe_kv.consumer_release(state_rel)
        else:
            for it in cutlass.range(n_steps, unroll=1):
                n_block = n_max - 1 - it
                self.dq_scores_issue(pipe_kv, state, sK, mma_s0, mma_s, acc_S, acc_dP, tSrQ, tSrdO, tSrK, tSrV,
                                     n_block, k_len, tidx, wg)
                warpgroup.wait_group(1)
                self.dq_probs(acc_S, acc_T, cS_mn, lse2, m_block, n_block, q_len, k_len, off, left, right,
                              score_mul, cap_mul)
                if cutlass.const_expr(self.pin_waits):
                    sc.wgmma_wait_after(acc_S, opaque_zero, 0)
                warpgroup.wait_group(0)
                self.dq_dscores(acc_S, acc_dP, acc_T, delta, rdS)
                sc.gemm(mma_q, mma_q, acc_dQ, tQrdS, tQrKt[None, None, None, state.index], False)
                warpgroup.wait_group(0)
                pipe_kv.consumer_release(state)
                state.advance()

        # Epilogue: dQ (times the softmax scale) through sQ, or the staging tile (every consumer's GEMMs are
        # complete after the barrier; with the staging tile it also orders this tile's writes after the
        # previous tile's reads): valid query rows, then zeros up to the slot end.
        sStage = sQ
        if cutlass.const_expr(release_q and sOut is not None):
            # This warp's GEMMs that read sQ / sdO are complete (the last step waited for them): the producer
            # may load the next tile's Q / dO once every consumer warp has arrived, while this one stores.
            pipe_q.consumer_release(state_q)
            sStage = sOut
        cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
        gdQ = cute.local_tile(cute.domain_offset((q_start, 0), mdQ[None, head, None]), (BM, HD), (m_block, 0))
        sc.store_rows_via_smem(acc_dQ, dscale, dt, mma_q, copy_out, sStage, gdQ, BM, HD, m0, q_len, tidx,
                               _BAR_CONSUMERS, self.num_consumer_threads, q_slot)
        if cutlass.const_expr(release_q and sOut is None):
            # Every consumer has read sQ out: the producer may load the next tile's Q / dO.
            cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
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
            sc.zero_rows_from(self.dtype, BN, HD, sK[None, None, stage], k_len - n0, tidx % 128, _BAR_WG_BASE + wg)
        sc.gemm(mma_s0, mma_s, acc_S, tSrQ, tSrK[None, None, None, stage], True)
        sc.gemm(mma_s0, mma_s, acc_dP, tSrdO, tSrV[None, None, None, stage], True)

    @cute.jit
    def dq_probs(self, acc_S, acc_T, cS_mn, lse2, m_block, n_block, q_len, k_len, off, left, right, score_mul,
                 cap_mul):
        """S -> P in place (select: 0 where masked or the query is padded / empty); with softcap acc_T gets
        1 - tanh^2 for dS."""
        BM, BN = self.block_m, self.block_n
        s_mn = masking.acc_mn_view_sm90(acc_S)
        t_mn = s_mn
        if cutlass.const_expr(self.has_softcap):
            t_mn = masking.acc_mn_view_sm90(acc_T)
        need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
        bc.probs_and_dscale(s_mn, t_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off, left, right, score_mul,
                            cap_mul, need, 0, self.has_softcap)

    @cute.jit
    def dq_dscores(self, acc_S, acc_dP, acc_T, delta, rdS):
        """dS = P (dP - Delta) [(1 - tanh^2)] by select (0 where P = 0), into rdS in the input dtype."""
        s_mn = masking.acc_mn_view_sm90(acc_S)
        t_mn = s_mn
        if cutlass.const_expr(self.has_softcap):
            t_mn = masking.acc_mn_view_sm90(acc_T)
        bc.dscores(s_mn, masking.acc_mn_view_sm90(acc_dP), t_mn, delta, 0, self.has_softcap)
        rdS.store(acc_dP.load().to(self.dtype))
