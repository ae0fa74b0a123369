"""Hopper (sm_90a) flash-attention forward: TMA + wgmma, warp-specialised, pad-safe.

The ABI of `fwd_sm80.FlashFwdSm80` (packed / varlen layout) plus a tile counter:
  q [total_q, N, H], k/v [total_k, K, H], o [total_q, N, H], lse [N, total_q] float32,
  cu_seqlens_q/k int32 [B+1], seqused_q/k int32 [B], tile_counter int32 [1] (zero-filled by the handler
  before a compact launch).
A CTA computes query tiles of block_m rows of one (head, sequence) each (grid.x enumerates the tiles
linearly, m-block fastest; up to 4 tiles per CTA for head dims <= 128, see max_tiles_per_cta; with the
compact schedule of packed batches, persistent CTAs claim tiles from the counter instead, see
produce_claimed) with 3 warpgroups:
  * warpgroup 0 (producer; one warp issues TMA): Q once, then K and V tiles from the last visited
    K tile down to the first into a `num_stages`-deep shared-memory ring guarded by mbarriers
    (PipelineTmaAsync: "full" barriers with a transaction count, "empty" barriers released by the
    consumers).  It gives most of its registers away (setmaxnreg).  Below head dim 128, once a tile's first
    step is issued it also prefetches the CTA's next tile's Q and first K / V block into L2.
  * warpgroups 1 and 2 (consumers, block_m / 2 query rows each): S = Q K^T with wgmma (both operands
    in shared memory), masking + online softmax in registers, O += P V with wgmma (P from registers).
    With `intra_wg_overlap` the QK^T of tile n-1 is issued before the P V of tile n, so the softmax
    of one tile runs while the tensor cores work on the next (at head dim 128 the wait for that P V is
    pinned after the softmax, `pin_pv_wait`, since ptxas would otherwise issue it first).

Pad-safety under TMA.  TMA zero-fills only outside the whole tensor; rows of a tile past a
sequence's valid length (gaps, seqused, the next sequence in the packed layout) arrive with whatever
memory holds (NaN, Inf, ...):
  * K rows past k_len only produce score columns j >= k_len; the visibility mask replaces every
    such column by -inf with a select (never a multiplication), so their values never matter;
  * V rows past k_len would meet P = 0 in P V, and 0 * NaN = NaN: the consumers overwrite them with
    zeros in shared memory before the P V GEMM of the partial tile (then fence.proxy.async so the
    async proxy of wgmma sees the generic-proxy stores, and a warpgroup barrier);
  * Q rows past q_len only produce output rows whose values are never stored (rows are independent
    in both GEMMs and in the softmax): the epilogue writes zeros there instead, and lse keeps the
    zeros the FFI handler writes.
O is staged through shared memory and written with 16-byte stores predicated per row: valid rows get
O, rows past q_len up to the sequence's slot end (cu_seqlens_q[b+1]) get zeros, and a tile wholly past
q_len writes only zeros, so a partial tile never touches the rows of a neighbouring sequence, and
where the tiles cover every row (`rows_covered`) the handler skips the memset of O.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import bounds, masking, softmax, tile_queue, tiles
from . import sm90_common as sc

LOG2_E = math.log2(math.e)

# Named barrier ids (0 is __syncthreads).
_BAR_CONSUMERS = 1  # both consumer warpgroups (256 threads)
_BAR_WG_BASE = 2  # + consumer warpgroup index: one consumer warpgroup (128 threads)
_BAR_SCHED_BASE = 4  # + consumer warpgroup index: GEMM issue turn of that warpgroup (ping-pong)
# Values of a tile-queue slot (compact schedule): the tile number, then tile_info's 15 values.
_SLOT_VALUES = 16


class FlashFwdSm90:
    def __init__(
        self,
        dtype,
        head_dim: int,
        block_m: int,
        block_n: int,
        num_stages: int,
        has_softcap: bool,
        intra_wg_overlap: bool = True,
        pingpong: bool = False,
        max_tiles_per_cta: int | None = None,
        multi_tile_min_tiles: int = 264,
        prefetch_next_tile: bool | None = None,
        pin_pv_wait: bool | None = None,
        rescale_o_early: bool | None = None,
        dynamic_compact: bool = True,
    ):
        assert head_dim % 32 == 0 and block_m == 128
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.block_n = block_n
        self.num_stages = num_stages
        self.has_softcap = has_softcap
        self.intra_wg_overlap = intra_wg_overlap
        # Ping-pong: the two consumer warpgroups take turns issuing their GEMMs, so the softmax of one
        # runs while the tensor cores work for the other (needs intra_wg_overlap's loop structure).
        # Off by default: measured 1.5-7% slower on top of the intra-warpgroup overlap (H100, hd128,
        # benchmarks/NOTES_sm90.md), and again in session 10 with the pinned P V wait and the early O rescale
        # (hd128 -3-5%, hd64 -6-10% against the same without ping-pong).
        self.pingpong = pingpong and intra_wg_overlap
        self.num_consumer_wg = 2
        self.num_threads = 128 * (1 + self.num_consumer_wg)
        self.num_consumer_threads = 128 * self.num_consumer_wg
        elem = dtype.width // 8
        smem_qkvo = elem * (2 * block_m * head_dim + 2 * num_stages * block_n * head_dim)
        self.separate_o = smem_qkvo + 2048 <= 227 * 1024
        # Several query tiles per CTA (strided over the grid), so the next tile's K/V (and, with a separate
        # O staging buffer, Q) load while the current tile's epilogue runs, and the launch, pipeline fill
        # and epilogue latency are paid once per CTA instead of once per tile.  Default: 4 where O has its
        # own staging buffer (head dims <= 128: +3-11% on the H100 at 2k-8k tokens), 1 otherwise (hd256 was
        # 1-12% slower with 4: without the buffer the next Q cannot load during the epilogue);
        # benchmarks/NOTES_sm90.md, session 4.
        if max_tiles_per_cta is None:
            max_tiles_per_cta = 4 if self.separate_o else 1
        self.max_tiles_per_cta = max_tiles_per_cta
        # Tiles per CTA = clamp(total tiles // multi_tile_min_tiles, 1, max_tiles_per_cta): one CTA-wave
        # of 132 SMs x 2 per extra tile (a host-side performance choice; the device code is the same).
        self.multi_tile_min_tiles = multi_tile_min_tiles
        # With several tiles per CTA, the producer asks L2 for the next tile's Q and first K / V block once
        # the current tile's first step is issued: the next tile usually belongs to another head, whose
        # first loads would otherwise come from HBM just when the consumers need them.  Measured on the H100
        # (benchmarks/NOTES_sm90.md, session 9): hd64 +5-10% at >= 2k tokens, hd96 neutral, hd128 neutral at
        # >= 2k and 5-9% slower at 512; hence on below head dim 128 only.  A prefetch only fills L2: it cannot
        # change a result (TMA clips the box at the tensor's bounds, and nothing reads it into a GEMM).
        if prefetch_next_tile is None:
            prefetch_next_tile = head_dim < 128
        self.prefetch_next = prefetch_next_tile and self.max_tiles_per_cta > 1
        # Keep the wait for P V after the softmax that overlaps it (sm90_common.wgmma_wait_after): without
        # it ptxas issues that wait before the softmax, so a warpgroup's exp2 never ran under its own P V.
        # And rescale O by the previous step's alpha between issuing S and issuing P V (O is not in flight
        # there: the previous P V was waited for), as FlashAttention-3 does, instead of after the wait for
        # P V, where the FMULs delay the next step's GEMM issue.  Neither changes an operation or its order:
        # O and lse are bitwise the same (checked on the H100).  Measured together on the H100 (session 10,
        # benchmarks/NOTES_sm90.md): hd128 +3-5% at 2k-16k, causal and not; hd64 -5% to +3%; hd96, 192 and
        # 256 2-7% slower (each alone: no better).  Hence on at head dim 128 only.
        if pin_pv_wait is None:
            pin_pv_wait = head_dim == 128
        if rescale_o_early is None:
            rescale_o_early = head_dim == 128
        self.pin_pv_wait = pin_pv_wait and intra_wg_overlap
        self.rescale_o_early = rescale_o_early and intra_wg_overlap
        # The compact schedule (packed batches, bounds.use_compact_grid): persistent CTAs, one per SM, that
        # claim tiles from a counter (produce_claimed), instead of one CTA per tile.  False: one tile per CTA
        # (the schedule until session 19, for A/B comparisons).
        self.dynamic_compact = dynamic_compact
        self.persistent_ctas = 132  # SMs of an H100 SXM / H200; more than a smaller part holds is harmless
        assert self.max_tiles_per_cta < (1 << 30)  # so tiles_per_cta >> 30 is the run-time 0 the pin needs
        self.producer_regs = 24
        self.consumer_regs = 240

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mTileCounter: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dt = self.dtype
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        sQ_layout = sc.smem_layout(dt, BM, HD)
        sKV_layout = sc.smem_layout(dt, BN, HD, self.num_stages)

        # (rows, head_dim, heads) views: one TMA box is (rows, head_dim) of one head.
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mQ), sQ_layout, (BM, HD))
        kv_box = cute.select(sKV_layout, mode=[0, 1])
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mK), kv_box, (BN, HD), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, sc.rows_dim_heads(mV), kv_box, (BN, HD), 1)
        q_bytes = cute.size_in_bytes(dt, sQ_layout)
        kv_bytes = cute.size_in_bytes(dt, kv_box)

        tiled_mma_qk = self.make_mma_qk()
        tiled_mma_pv = self.make_mma_pv()
        copy_out = tiles.gmem_tiled_copy(dt, HD, self.num_consumer_threads, async_copy=False)

        stages = self.num_stages

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            # The compact kernel's tile queue: two slots of (tile number, the tile's tile_info), full / empty
            # barriers.
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            sTileSlots: cute.struct.MemRange[cutlass.Int32, 2 * _SLOT_VALUES]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout) if self.separate_o else 0], 1024]

        # Linear tile index, dense: m-block fastest (ceil(max_seqlen_q / BM) per sequence), then head, then
        # sequence.  Where that would launch mostly tiles past short sequences, compact instead: head, then
        # the tiles of that head's sequences that start inside them (bounds.compact_tile).  Each CTA takes
        # tiles blockIdx.x + j * gridDim.x, j < tiles_per_cta; several per CTA only when there are enough
        # tiles for >= 2 waves of 132 SMs (H100 SXM / H200) per tile-per-CTA (a performance choice only).
        n_mb = cute.ceil_div(max_seqlen_q, BM)
        num_heads = cute.size(mQ.shape[1])
        batch = cute.size(mUsedQ.shape[0])
        compact_per_head = bounds.compact_tiles_per_head(cute.size(mQ.shape[0]), batch, BM)
        # Two kernels, one per schedule (the dense one unchanged by the compact one's search, which would
        # otherwise hold the tile's coordinates in registers that ptxas now rematerialises from blockIdx).
        # The compact kernel takes its tiles per head where the dense one takes n_mb.
        if bounds.use_compact_grid(max_seqlen_q, cute.size(mQ.shape[0]), batch, BM) != 0:
            self.launch_schedule(True, compact_per_head, num_heads, batch, tma_atom_Q, tma_Q, tma_atom_K, tma_K,
                                 tma_atom_V, tma_V, mK, mQ, mO, mLSE, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter,
                                 score_mul, cap_mul, window_left, window_right, bottom_right, sQ_layout, sKV_layout,
                                 tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes, kv_bytes, SharedStorage, stream)
        else:
            self.launch_schedule(False, n_mb, num_heads, batch, tma_atom_Q, tma_Q, tma_atom_K, tma_K,
                                 tma_atom_V, tma_V, mK, mQ, mO, mLSE, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter,
                                 score_mul, cap_mul, window_left, window_right, bottom_right, sQ_layout, sKV_layout,
                                 tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes, kv_bytes, SharedStorage, stream)

    @cute.jit
    def launch_schedule(self, compact: cutlass.Constexpr, per_seq_or_head, num_heads, batch, tma_atom_Q, tma_Q,
                        tma_atom_K, tma_K, tma_atom_V, tma_V, mK, mQ, mO, mLSE, mCuQ, mCuK, mUsedQ, mUsedK,
                        mTileCounter, score_mul, cap_mul, window_left, window_right, bottom_right, sQ_layout,
                        sKV_layout, tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes: cutlass.Constexpr,
                        kv_bytes: cutlass.Constexpr, SharedStorage: cutlass.Constexpr, stream):
        """Launch the kernel of one schedule: dense (per_seq_or_head = m-blocks per sequence) or compact
        (per_seq_or_head = compact tiles per head)."""
        total = per_seq_or_head * num_heads
        if cutlass.const_expr(not compact):
            total = total * batch
        if cutlass.const_expr(compact and self.dynamic_compact):
            # Persistent CTAs that claim their tiles one at a time from a counter (`claim_published`): as many
            # as one wave (one CTA per SM; 132 on an H100 SXM / H200; on a part with fewer SMs the extra
            # CTAs start once the counter is spent and find nothing left).
            tiles_per_cta = cutlass.Int32(1)  # unused by this schedule (but the pins' opaque zero reads it)
            grid = (cutlass.min(total, self.persistent_ctas), 1, 1)
        elif cutlass.const_expr(compact):
            # One tile per CTA: the compact tiles of a skewed batch differ widely in work (a long sequence's
            # tiles against many short ones'), and the hardware's CTA dispatch balances them where a fixed
            # share of 4 tiles per CTA left a tail (measured: -17% on a long-tailed causal batch).
            tiles_per_cta = cutlass.Int32(1)
            grid = (total, 1, 1)
        elif cutlass.const_expr(self.max_tiles_per_cta > 1):
            tiles_per_cta = cutlass.max(cutlass.min(total // self.multi_tile_min_tiles, self.max_tiles_per_cta), 1)
            grid = (cute.ceil_div(total, tiles_per_cta), 1, 1)
        else:
            tiles_per_cta = cutlass.Int32(1)
            grid = (total, 1, 1)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mO, mLSE, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, mK.shape[1], mQ.shape[1], per_seq_or_head, batch,
            tiles_per_cta, score_mul, cap_mul, window_left, window_right, bottom_right,
            sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes, kv_bytes, SharedStorage, compact,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    def make_mma_qk(self):
        """S = Q K^T: both operands K-major in shared memory; each consumer warpgroup owns block_m / 2 rows."""
        return sc.make_mma(self.dtype, self.num_consumer_wg, self.block_m // self.num_consumer_wg, self.block_n,
                           b_major_mn=False, a_from_regs=False)

    def make_mma_pv(self):
        """O += P V: P from registers, V^T MN-major in shared memory."""
        return sc.make_mma(self.dtype, self.num_consumer_wg, self.block_m // self.num_consumer_wg, self.head_dim,
                           b_major_mn=True, a_from_regs=True)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mTileCounter: cute.Tensor,
        num_kv_heads: cutlass.Int32,
        num_heads: cutlass.Int32,
        n_mb: cutlass.Int32,
        batch_size: cutlass.Int32,
        tiles_per_cta: cutlass.Int32,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        copy_out: cute.TiledCopy,
        q_bytes: cutlass.Constexpr,
        kv_bytes: cutlass.Constexpr,
        SharedStorage: cutlass.Constexpr,
        compact: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # One arrive per consumer warp (PipelineTmaAsync signals from lane 0 of each warp).
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=q_bytes, defer_sync=True,
        )
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=consumers, tx_count=kv_bytes, defer_sync=True,
        )
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=consumers, tx_count=kv_bytes, defer_sync=True,
        )
        queue = None
        if cutlass.const_expr(compact and self.dynamic_compact):
            # The producer warp claims a tile, decodes it and publishes it in a slot; every consumer thread
            # reads it and frees the slot (tile_queue).
            queue = tile_queue.create(
                storage.mbar_tile.data_ptr(),
                storage.sTileSlots.get_tensor(cute.make_layout((2, _SLOT_VALUES), stride=(_SLOT_VALUES, 1))),
                mTileCounter, self.num_consumer_threads)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sO = sQ
        if cutlass.const_expr(self.separate_o):
            sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sched = (n_mb, num_heads, num_kv_heads, batch_size, tiles_per_cta, mCuQ, mCuK, mUsedQ, mUsedK,
                 window_left, window_right, bottom_right, compact)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                if cutlass.const_expr(compact and self.dynamic_compact):
                    self.produce_claimed(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV,
                                         pipe_q, pipe_k, pipe_v, sched, queue)
                else:
                    self.produce(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV,
                                 pipe_q, pipe_k, pipe_v, sched)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(sQ, sK, sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, tiled_mma_qk, tiled_mma_pv, copy_out,
                         score_mul, cap_mul, sched, queue)

    @cute.jit
    def tile_info(self, j: cutlass.Int32, sched):
        """(present, m_block, head, head_kv, q_start, q_len, k_start, k_len, off, left, right, n_min, n_max,
        in_grid, q_slot) of this CTA's j-th tile; present is False for a tile past the grid (in_grid False) or
        wholly past its sequence's valid length (nothing to compute: the consumers write its rows up to the
        slot end q_slot as zeros, lse is pre-zeroed).  Producer and consumers derive the same sequence of
        tiles from it (the compact kernel's queue: tile_info_lin of the claimed numbers)."""
        bid, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        # Snake order: even j walk the tiles forward, odd j backward, so with the m-block fastest in the
        # linear index a CTA's causal tiles pair a heavy m-block with a light one (equal work per CTA when
        # gridDim is a multiple of the m-block count), while the CTAs running at one time still share
        # the same heads' K/V in L2.
        lin = bid + j * gdim
        if cutlass.const_expr(self.max_tiles_per_cta > 1):
            if j % 2 == 1:
                lin = (j + 1) * gdim - 1 - bid
        return self.tile_info_lin(lin, sched)

    @cute.jit
    def tile_info_lin(self, lin: cutlass.Int32, sched):
        """tile_info of the tile with linear number `lin` (below the schedule's tile count, or a tile past
        the grid: in_grid False)."""
        BM, BN = self.block_m, self.block_n
        (n_mb, num_heads, num_kv_heads, batch_size, tiles_per_cta, mCuQ, mCuK, mUsedQ, mUsedK,
         window_left, window_right, bottom_right, compact) = sched
        # Dense: m-block fastest, then head, then sequence.  Compact: head, then the compact tiles of
        # all sequences (in sequence order, m-block fastest).
        if cutlass.const_expr(compact):
            per_head = n_mb  # the compact kernel's argument in that place
            # Last tiles first (one tile per CTA): the last m-blocks of a causal sequence are its heaviest.
            lin = per_head * num_heads - 1 - lin
            head = cutlass.min(lin // per_head, num_heads - 1)
            batch, m_block = bounds.compact_tile(lin - head * per_head, mCuQ, batch_size, BM)
            n_tiles_all = per_head * num_heads
        else:
            m_block = lin % n_mb
            rest = lin // n_mb
            head = rest % num_heads
            batch = cutlass.min(rest // num_heads, batch_size - 1)
            n_tiles_all = n_mb * num_heads * batch_size
        q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
        k_start, k_len = bounds.used_length(mCuK, mUsedK, batch)
        q_slot = bounds.slot_length(mCuQ, batch)
        present = cutlass.Boolean(False)
        in_grid = cutlass.Boolean(False)
        # in_grid and not present: zeros for the tile's rows up to the slot end, none for a compact hole.
        if lin < n_tiles_all:
            in_grid = cutlass.Boolean(True)
            if m_block * BM < q_len:
                present = cutlass.Boolean(True)
        off, left, right = bounds.window_bounds(q_len, k_len, window_left, window_right, bottom_right)
        n_min, n_max = bounds.n_block_range(m_block, BM, BN, q_len, k_len, off, left, right)
        head_kv = head // (num_heads // num_kv_heads)
        return (present, m_block, head, head_kv, q_start, q_len, k_start, k_len, off, left, right, n_min, n_max,
                in_grid, q_slot)

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
        for j in cutlass.range(sched[4], unroll=1):
            (present, m_block, head, head_kv, q_start, q_len, k_start, k_len, off, left, right, n_min,
             n_max, _, _) = self.tile_info(j, sched)
            if present:
                state_q, state = self.produce_tile(
                    tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                    state_q, state, m_block, head, head_kv, q_start, k_start, n_min, n_max, j, sched)

    def queue_length(self, sched):
        """The compact schedule's tile count (compact tiles per head x heads): claims at or past it end."""
        return sched[0] * sched[1]

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
             n_max, _, _) = info
            next_lin = lin
            next_info = info
            if present:
                # produce_tile claims the next tile once this one's loads are issued.
                state_q, state, state_tile, next_lin, next_info = self.produce_tile(
                    tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                    state_q, state, m_block, head, head_kv, q_start, k_start, n_min, n_max, cutlass.Int32(0), sched,
                    queue, state_tile)
            else:
                next_lin, next_info, state_tile = self.claim_published(queue, state_tile, sched)
            lin = next_lin
            info = next_info

    @cute.jit
    def claim_published(self, queue, state_tile, sched):
        """Producer warp: claim tile numbers until one names a tile inside its sequence's slot (a hole of the
        compact schedule, bounds.compact_tile, needs nothing: skipped here, so the consumers never see one) or
        the end, and publish it with its tile_info for the consumers, who then need no search or length loads
        of their own at a tile's start.  Returns (number, tile_info, slot state)."""
        total = self.queue_length(sched)
        lin = tile_queue.take(queue)
        info = self.tile_info_lin(lin, sched)
        hole = (lin < total) & (info[1] * self.block_m >= info[14])
        while hole:
            lin = tile_queue.take(queue)
            info = self.tile_info_lin(lin, sched)
            hole = (lin < total) & (info[1] * self.block_m >= info[14])
        values = (lin,) + tuple(cutlass.Int32(x) for x in info)
        state_tile = tile_queue.publish(queue, state_tile, values)
        return lin, info, state_tile

    @cute.jit
    def published_info(self, queue, state_tile):
        """Consumer thread: the tile_info that the producer published in the held slot `state_tile`."""
        v = tuple(tile_queue.field(queue, state_tile, 1 + i) for i in range(_SLOT_VALUES - 1))
        return (v[0] != 0,) + v[1:13] + (v[13] != 0, v[14])

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
    ):
        """Loads of one tile.  With the compact kernel's `queue` it also claims the next tile once this
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
        pipe_q.producer_acquire(state_q)
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(state_q))
        state_q.advance()
        if cutlass.const_expr(self.intra_wg_overlap):
            # Order of use with overlap: K[n], then K[n-1] before V[n].
            for it in cutlass.range(n_tiles - 1, unroll=1):
                n = n_max - 1 - it
                state_prev = state.clone()
                state.advance()
                pipe_k.producer_acquire(state)
                cute.copy(tma_atom_K, tKgK[None, n - 1], tKsK[None, state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state))
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
        else:
            for it in cutlass.range(n_tiles, unroll=1):
                n = n_max - 1 - it
                if it > 0:
                    pipe_k.producer_acquire(state)
                    cute.copy(tma_atom_K, tKgK[None, n], tKsK[None, state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(state))
                pipe_v.producer_acquire(state)
                cute.copy(tma_atom_V, tVgV[None, n], tVsV[None, state.index],
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
    def prefetch_tile_l2(self, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, j, sched):
        """TMA prefetch into L2 (no shared memory, no barrier) of the CTA's tile j's Q and of the K / V block
        it visits first; nothing if the CTA has no tile j or it has nothing to load."""
        info = self.tile_info(j, sched)
        self.prefetch_info_l2(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, info, j < sched[4])

    @cute.jit
    def prefetch_info_l2(self, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, info, wanted):
        """prefetch_tile_l2 of the tile that `info` (tile_info) describes, if `wanted`."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        (present, m_block, head, head_kv, q_start, _, k_start, _, _, _, _, n_min, n_max, _, _) = info
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

    @cute.jit
    def consume(
        self,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        pipe_q,
        pipe_k,
        pipe_v,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        copy_out: cute.TiledCopy,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        sched,
        queue=None,
    ):
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        raw_scores = not self.has_softcap
        mul = cutlass.Float32(1.0)
        if cutlass.const_expr(raw_scores):
            mul = score_mul

        # The wgmma accumulate flag is set once here, never inside staged control flow (a value set in a
        # loop or branch body cannot be used after it): the first k-block of S = Q K^T uses a second
        # TiledMma object that overwrites, every other GEMM accumulates.
        tiled_mma_qk0 = self.make_mma_qk()
        tiled_mma_qk0.set(warpgroup.Field.ACCUMULATE, False)
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        # Transposed view of V, (head_dim, block_n, stages), the MN-major B operand of P V.
        sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))
        # Operand descriptors are per warpgroup, accumulators per thread.
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BM, HD)))
        s_shape = thr_qk.partition_shape_C((BM, BN))
        tScS = thr_qk.partition_C(cute.make_identity_tensor((BM, BN)))
        cS_mn = masking.acc_mn_view_sm90(tScS)
        o_mn = masking.acc_mn_view_sm90(acc_O)

        n_rows = cute.size(o_mn, mode=[0])
        # Epilogue partitions, derived before the main loop sets the GEMMs' accumulate flag.
        cO_mn = masking.acc_mn_view_sm90(thr_pv.partition_C(cute.make_identity_tensor((BM, HD))))
        copy_r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma_pv)
        thr_r2s = copy_r2s.get_slice(tidx)
        row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), cutlass.Float32)

        # P in the input dtype: one register buffer, viewed as the A operand of the P V wgmma.
        rP = cute.make_rmem_tensor(s_shape, self.dtype)
        tOrP = cute.make_tensor(rP.iterator, sc.c_to_a_layout(rP.layout))
        alpha = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        opaque_zero = sched[4] >> 30  # tiles_per_cta < 2^30: 0, but a kernel argument, so no compiler knows it
        if cutlass.const_expr(self.pingpong):
            # The first warpgroup takes the first turn, once per CTA: every tile's turns end with warpgroup 1
            # arriving on warpgroup 0's barrier, which is the next tile's first turn (an arrive per tile, as
            # this was until session 10, left one unmatched arrive per tile and hung CTAs of several tiles).
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=_BAR_SCHED_BASE, number_of_threads=256)
        ctx = (sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv, copy_out, copy_r2s,
               thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha, rP, tOrP, score_mul,
               cap_mul, mul, tidx, wg, opaque_zero)
        if cutlass.const_expr(queue is None):
            for j in cutlass.range(sched[4], unroll=1):
                state_q, state = self.consume_or_zero(self.tile_info(j, sched), ctx, state_q, state)
        else:
            # The compact kernel's queue: the tiles the producer claimed, in its order, until a claim past
            # the end.
            state_tile = tile_queue.consumer_state()
            total = self.queue_length(sched)
            lin = tile_queue.peek(queue, state_tile)
            while lin < total:
                info = self.published_info(queue, state_tile)
                state_tile = tile_queue.release(queue, state_tile)
                state_q, state = self.consume_or_zero(info, ctx, state_q, state)
                lin = tile_queue.peek(queue, state_tile)

    @cute.jit
    def consume_or_zero(self, info, ctx, state_q, state):
        """The consumers' part of one tile (`info`: tile_info): compute it, or, for a tile wholly past the
        valid length, write the zeros of its rows up to the slot end (none for a compact hole)."""
        BM, HD = self.block_m, self.head_dim
        (present, m_block, head, _, q_start, q_len, _, k_len, off, left, right, n_min, n_max, in_grid,
         q_slot) = info
        (sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv, copy_out, copy_r2s,
         thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha, rP, tOrP, score_mul,
         cap_mul, mul, tidx, wg, opaque_zero) = ctx
        if present:
            state_q, state = self.consume_tile(
                sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv, copy_out,
                copy_r2s, thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha, rP,
                tOrP, state_q, state, score_mul, cap_mul, mul, tidx, wg, opaque_zero,
                m_block, head, q_start, q_len, q_slot, k_len, off, left, right, n_min, n_max)
        elif in_grid:
            gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), (BM, HD), (m_block, 0))
            sc.zero_rows_global(self.dtype, BM, HD, copy_out, gO, m_block * BM, q_slot, tidx)
        return state_q, state

    @cute.jit
    def consume_tile(
        self, sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv, copy_out,
        copy_r2s, thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha, rP,
        tOrP, state_q, state, score_mul, cap_mul, mul, tidx, wg, opaque_zero,
        m_block, head, q_start, q_len, q_slot, k_len, off, left, right, n_min, n_max,
    ):
        BM, HD = self.block_m, self.head_dim
        m0 = m_block * BM
        s_shape = rP.shape
        n_rows = cute.size(row_max)
        acc_O.fill(0.0)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        pipe_q.consumer_wait(state_q)
        n_tiles = n_max - n_min
        if cutlass.const_expr(self.intra_wg_overlap):
            if n_tiles > 0:
                # Prologue: S and P of the first tile (acc_O is still zero: no rescale needed).
                pipe_k.consumer_wait(state)
                acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                self.gemm_qk(tiled_mma_qk0, tiled_mma_qk, acc_S, tSrQ, tSrK, state.index)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(state)
                s_mn = self.transform_and_mask(acc_S, cS_mn, score_mul, cap_mul, n_max - 1, m_block, q_len,
                                               k_len, off, left, right)
                softmax.online_softmax_step_alpha(s_mn, row_max, row_sum, alpha, mul)
                rP.store(acc_S.load().to(self.dtype))
                for it in cutlass.range(n_tiles - 1, unroll=1):
                    n_cur = n_max - 2 - it
                    state_v = state.clone()
                    state.advance()
                    pipe_k.consumer_wait(state)
                    acc_S2 = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                    if cutlass.const_expr(self.pingpong):
                        # Both tiles resident (and V made safe) before this warpgroup takes its turn.
                        pipe_v.consumer_wait(state_v)
                        self.zero_partial_v(sV, state_v.index, n_cur + 1, k_len, wg, tidx)
                        cute.arch.barrier(barrier_id=_BAR_SCHED_BASE + wg, number_of_threads=256)
                        self.gemm_qk(tiled_mma_qk0, tiled_mma_qk, acc_S2, tSrQ, tSrK, state.index)
                        if cutlass.const_expr(self.rescale_o_early):
                            softmax.rescale_rows(o_mn, alpha)
                        self.gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrVt, state_v.index)
                        cute.arch.barrier_arrive(barrier_id=_BAR_SCHED_BASE + 1 - wg, number_of_threads=256)
                    else:
                        self.gemm_qk(tiled_mma_qk0, tiled_mma_qk, acc_S2, tSrQ, tSrK, state.index)
                        if cutlass.const_expr(self.rescale_o_early):
                            softmax.rescale_rows(o_mn, alpha)
                        pipe_v.consumer_wait(state_v)
                        self.zero_partial_v(sV, state_v.index, n_cur + 1, k_len, wg, tidx)
                        self.gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrVt, state_v.index)
                    warpgroup.wait_group(1)
                    pipe_k.consumer_release(state)
                    # Softmax of tile n_cur while P V of tile n_cur + 1 runs; acc_O (being written by
                    # that GEMM) and P are updated only after it completes.
                    s_mn2 = self.transform_and_mask(acc_S2, cS_mn, score_mul, cap_mul, n_cur, m_block, q_len,
                                                    k_len, off, left, right)
                    softmax.online_softmax_step_alpha(s_mn2, row_max, row_sum, alpha, mul)
                    if cutlass.const_expr(self.pin_pv_wait):
                        sc.wgmma_wait_after(row_sum, opaque_zero, 0)
                    warpgroup.wait_group(0)
                    pipe_v.consumer_release(state_v)
                    if cutlass.const_expr(not self.rescale_o_early):
                        softmax.rescale_rows(o_mn, alpha)
                    rP.store(acc_S2.load().to(self.dtype))
                if cutlass.const_expr(self.rescale_o_early):
                    softmax.rescale_rows(o_mn, alpha)
                pipe_v.consumer_wait(state)
                self.zero_partial_v(sV, state.index, n_min, k_len, wg, tidx)
                self.gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrVt, state.index)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(state)
                state.advance()
        else:
            for it in cutlass.range(n_tiles, unroll=1):
                n_cur = n_max - 1 - it
                pipe_k.consumer_wait(state)
                acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                self.gemm_qk(tiled_mma_qk0, tiled_mma_qk, acc_S, tSrQ, tSrK, state.index)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(state)
                s_mn = self.transform_and_mask(acc_S, cS_mn, score_mul, cap_mul, n_cur, m_block, q_len,
                                               k_len, off, left, right)
                softmax.online_softmax_step(s_mn, o_mn, row_max, row_sum, mul)
                rP.store(acc_S.load().to(self.dtype))
                pipe_v.consumer_wait(state)
                self.zero_partial_v(sV, state.index, n_cur, k_len, wg, tidx)
                self.gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrVt, state.index)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(state)
                state.advance()

        if cutlass.const_expr(self.separate_o):
            # Every GEMM of this tile is complete: the producer may load the next tile's Q now.
            pipe_q.consumer_release(state_q)

        # ---- epilogue
        lse_rows = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        softmax.finalize(o_mn, row_max, row_sum, lse_rows, mul)
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                i = m0 + cO_mn[r, 0][0]
                if i < q_len:
                    mLSE[head, q_start + i] = lse_rows[r]

        # O: registers -> shared (sO: its own buffer, or sQ) -> global, valid rows only.  The first barrier
        # orders this tile's writes after the previous tile's reads of sO and, when sO is sQ, after every
        # consumer's GEMMs of this tile.
        cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.copy(copy_r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
        cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
        gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), (BM, HD), (m_block, 0))
        thr_out = copy_out.get_slice(tidx)
        tOsO = thr_out.partition_S(sO)
        tOgO = thr_out.partition_D(gO)
        tOcO = thr_out.partition_D(cute.make_identity_tensor((BM, HD)))
        tOrO = cute.make_fragment_like(tOgO, self.dtype)
        cute.copy(copy_out, tOsO, tOrO)
        if cutlass.const_expr(not self.separate_o):
            # sQ (= sO) is read out: the producer may load the next tile's Q.
            cute.arch.barrier(barrier_id=_BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
            pipe_q.consumer_release(state_q)
        state_q.advance()
        # Valid rows get O; rows past q_len up to the slot end get exact zeros (their accumulator, computed
        # from unzeroed Q rows, is never stored), so no memset of O is needed where the tiles cover every row.
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            row = m0 + tOcO[0, m, 0][0]
            if row >= q_len:
                tOrO[None, m, None].fill(0)
            if row < q_slot:
                cute.copy(copy_out, tOrO[None, m, None], tOgO[None, m, None])
        return state_q, state

    # ---------------------------------------------------------------- pieces
    @cute.jit
    def gemm_qk(self, mma_first: cute.TiledMma, mma_acc: cute.TiledMma, acc: cute.Tensor, tSrQ: cute.Tensor,
                tSrK: cute.Tensor, stage: cutlass.Int32):
        """Issue S = Q K^T (the first k-block overwrites acc) for one K stage; the caller waits.  (Not
        sm90_common.gemm on a stage view of tSrK: that compiles to different SASS, and this is the GPU-checked one.)"""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma = mma_first if k == 0 else mma_acc
            cute.gemm(mma, acc, tSrQ[None, None, k], tSrK[None, None, k, stage], acc)
        warpgroup.commit_group()

    @cute.jit
    def gemm_pv(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, rP: cute.Tensor, tOrVt: cute.Tensor,
                stage: cutlass.Int32):
        """Issue O += P V for one V stage (acc_O starts at zero); the caller waits."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(rP, mode=[2])):
            cute.gemm(tiled_mma, acc, rP[None, None, k], tOrVt[None, None, k, stage], acc)
        warpgroup.commit_group()

    @cute.jit
    def zero_partial_v(self, sV: cute.Tensor, stage: cutlass.Int32, n_block: cutlass.Int32, k_len: cutlass.Int32,
                       wg: cutlass.Int32, tidx: cutlass.Int32):
        """Zero the rows of V stage `stage` (holding K tile n_block) at or past k_len.

        Both consumer warpgroups write the same zeros (benign); each makes its own stores visible to
        the async proxy (wgmma) and waits for its own 128 threads before issuing its P V GEMM."""
        n_valid = k_len - n_block * self.block_n
        if n_valid < self.block_n:
            sc.zero_rows_from(self.dtype, self.block_n, self.head_dim, sV[None, None, stage], n_valid, tidx % 128,
                              _BAR_WG_BASE + wg)

    @cute.jit
    def transform_and_mask(self, acc_S: cute.Tensor, cS_mn: cute.Tensor, score_mul: cutlass.Float32,
                           cap_mul: cutlass.Float32, n_block: cutlass.Int32, m_block: cutlass.Int32,
                           q_len: cutlass.Int32, k_len: cutlass.Int32, off: cutlass.Int32, left: cutlass.Int32,
                           right: cutlass.Int32):
        BM, BN = self.block_m, self.block_n
        if cutlass.const_expr(self.has_softcap):
            acc_S.store(cute.math.tanh(acc_S.load() * score_mul, fastmath=False) * cap_mul)
        s_mn = masking.acc_mn_view_sm90(acc_S)
        if bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right):
            masking.apply_visibility_mask(s_mn, cS_mn, m_block * BM, n_block * BN, k_len, off, left, right)
        return s_mn
