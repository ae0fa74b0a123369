"""Hopper (sm_90a) flash-attention forward: TMA + wgmma, warp-specialised, pad-safe.

The ABI of `sm80.fwd.FlashFwdSm80` (packed / varlen layout) plus a tile counter:
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
    The QK^T of tile n-1 is issued before the P V of tile n, so the softmax of one tile runs while the
    tensor cores work on the next (at head dim 128 the wait for that P V is pinned after the softmax,
    `pin_pv_wait`, since ptxas would otherwise issue it first).  The two consumer warpgroups do not take
    turns issuing their GEMMs (ping-pong): on an H100 that measured 1.5-7% slower at hd128 on top of this
    overlap, and hd128 3-5% / hd64 6-10% slower with the pinned wait and the early O rescale.

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

The aux variants (masks and biases as tensors; fwd_aux, common/aux_scores.py), `aux="mask"` or `aux="bias"`,
take the mask, bias, bias32, tile map and row-range tensors (the same entry for both kinds) and write the row
max and ln(row sum) in natural units besides lse (mRowMax, mLogSum); each tile's key range is narrowed by the
mask's block summary.  "bias": natural-unit scores (q.k * scale + bias) and a softmax of exact differences.
"mask": the plain kernel's raw scores and exp2-domain softmax, with -inf selected where the mask hides a pair,
so a tile the mask shows whole costs what it costs without a mask.  Mask and bias cells are read inside the
valid rectangle only (the bias staged in shared memory a key tile ahead where it fits, common/bias_stage.py).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import aux_scores, bias_stage, bounds, masking, softmax, tile_queue, tile_schedule, tiles
from . import common as sc
from . import fwd_aux
from .fwd_producer import FwdProducer
from .fwd_schedule import FwdSchedule, FwdTileSchedule, slot_values

# Named barrier ids (0 is __syncthreads).
_BAR_CONSUMERS = 1  # both consumer warpgroups (256 threads)
_BAR_WG_BASE = 2  # + consumer warpgroup index: one consumer warpgroup (128 threads)


class FlashFwdSm90(FwdTileSchedule, FwdProducer, fwd_aux.FwdAuxEntry):
    """The forward kernel.  Scheduling (which tiles a CTA takes, the compact kernel's queue) is
    `fwd_schedule.FwdTileSchedule`, the producer warp's loads `fwd_producer.FwdProducer`; the consumers'
    work (softmax, GEMMs, epilogue) is here; the aux variants' entry point and pieces are `fwd_aux`.

    Per head dim (the build's variant table): `prefetch_next_tile`, `pin_pv_wait`, `rescale_o_early`."""

    # Tiles per CTA of the dense schedule = clamp(total tiles // multi_tile_min_tiles, 1, max_tiles_per_cta):
    # one CTA-wave of 132 SMs x 2 per extra tile (a host-side performance choice; the device code is the same).
    multi_tile_min_tiles = 264
    persistent_ctas = 132  # SMs of an H100 SXM / H200; more than a smaller part holds is harmless

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_stages: int, has_softcap: bool, *,
                 prefetch_next_tile: bool, pin_pv_wait: bool, rescale_o_early: bool, aux=False):
        assert head_dim % 16 == 0 and block_m == 128
        # aux: masks and biases as tensors (fwd_aux), False or the kind, "mask" or "bias" (True: "bias", the
        # single aux variant's old spelling); built without softcap only.  Every kind-specific branch below is
        # a compile-time one, so aux=False compiles to the plain kernel.
        if aux is True:
            aux = "bias"
        if not aux:
            aux = False  # "" (the build table's no-aux) and None alike: the plain kernel
        assert aux in (False, "mask", "bias"), aux
        assert not (aux and has_softcap)
        self.aux = aux
        # "bias": natural-unit scores and the exact softmax; "mask": the plain kernel's scores and softmax.
        self.aux_exact = aux == "bias"
        if aux:
            # The aux variants' entry point takes more arguments (the aux ABI) than `__call__`.  cute.compile
            # resolves a callable object through `obj.__call__`, which finds this instance attribute first; the
            # entry's own parameter names name the exported tensor structs.
            self.__call__ = self.call_aux
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.block_n = block_n
        self.num_stages = num_stages
        self.has_softcap = has_softcap
        self.num_consumer_wg = 2
        self.num_threads = 128 * (1 + self.num_consumer_wg)
        self.num_consumer_threads = 128 * self.num_consumer_wg
        elem = dtype.width // 8
        smem_qkvo = elem * (2 * block_m * head_dim + 2 * num_stages * block_n * head_dim)
        self.separate_o = smem_qkvo + 2048 <= 227 * 1024
        # Several query tiles per CTA (strided over the grid), so the next tile's K/V (and, with a separate
        # O staging buffer, Q) load while the current tile's epilogue runs, and the launch, pipeline fill
        # and epilogue latency are paid once per CTA instead of once per tile: 4 where O has its own staging
        # buffer (head dims <= 128: +3-11% on an H100 at 2k-8k tokens), else 1 (hd256 was 1-12% slower with 4:
        # without the buffer the next Q cannot load during the epilogue).
        self.max_tiles_per_cta = 4 if self.separate_o else 1
        # "bias": the consumer warpgroups stage each key tile's bias in shared memory a tile ahead
        # (common/bias_stage.py) where its two buffers fit (68 KB at 128 x 128: head dims up to 96; at 128 the
        # kernel already takes 192 KB and reads the bias from global memory at the softmax).
        smem_used = smem_qkvo - (0 if self.separate_o else elem * block_m * head_dim)
        self.stage_bias = (aux == "bias"
                           and smem_used + elem * bias_stage.smem_elems(block_m, block_n) + 4096 <= 227 * 1024)
        # With several tiles per CTA, the producer asks L2 for the next tile's Q and first K / V block once
        # the current tile's first step is issued: the next tile usually belongs to another head, whose
        # first loads would otherwise come from HBM just when the consumers need them.  Measured on an H100:
        # hd64 +5-10% at >= 2k tokens, hd96 neutral, hd128 neutral at >= 2k and 5-9% slower at 512; hence on
        # below head dim 128 only.  A prefetch only fills L2: it cannot change a result (TMA clips the box at
        # the tensor's bounds, and nothing reads it into a GEMM).
        self.prefetch_next = prefetch_next_tile and self.max_tiles_per_cta > 1
        # pin_pv_wait: keep the wait for P V after the softmax that overlaps it (common.wgmma_wait_after):
        # without it ptxas issues that wait before the softmax, so a warpgroup's exp2 never ran under its own
        # P V.  rescale_o_early: rescale O by the previous step's alpha between issuing S and issuing P V (O is
        # not in flight there: the previous P V was waited for), as FlashAttention-3 does, instead of after the
        # wait for P V, where the FMULs delay the next step's GEMM issue.  Neither changes an operation or its
        # order: O and lse are bitwise the same.  Measured together on an H100: hd128 +3-5% at 2k-16k, causal
        # and not; hd64 -5% to +3%; hd96, 192 and 256 2-7% slower (each alone: no better).  Hence on at head
        # dim 128 only.
        self.pin_pv_wait = pin_pv_wait
        self.rescale_o_early = rescale_o_early
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
        mSinks: cute.Tensor,
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
        self.launch(mQ, mK, mV, mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, score_mul, cap_mul,
                    window_left, window_right, bottom_right, max_seqlen_q, stream)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSinks: cute.Tensor, mCuQ: cute.Tensor, mCuK: cute.Tensor, mUsedQ: cute.Tensor, mUsedK: cute.Tensor,
               mTileCounter: cute.Tensor, score_mul: cutlass.Float32, cap_mul: cutlass.Float32,
               window_left: cutlass.Int32, window_right: cutlass.Int32, bottom_right: cutlass.Int32,
               max_seqlen_q: cutlass.Int32, stream: cuda.CUstream, aux_in=None):
        """The host side of both entries (`aux_in`: the aux variants' fwd_aux.FwdAux, else None)."""
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
            # The compact kernel's tile queue: two slots of (tile number, the tile's FwdTile), full / empty
            # barriers.
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            sTileSlots: cute.struct.MemRange[cutlass.Int32, 2 * slot_values(self.aux)]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout) if self.separate_o else 0], 1024]
            # The staged bias's two buffers (bias_stage).
            sBias: cute.struct.Align[cute.struct.MemRange[
                dt, bias_stage.smem_elems(BM, BN) if self.stage_bias else 0], 128]

        # Linear tile index, dense: m-block fastest (ceil(max_seqlen_q / BM) per sequence), then head, then
        # sequence.  Where that would launch mostly tiles past short sequences, compact instead: head, then
        # the tiles of that head's sequences that start inside them (tile_schedule.compact_tile).  Each CTA takes
        # tiles blockIdx.x + j * gridDim.x, j < tiles_per_cta; several per CTA only when there are enough
        # tiles for >= 2 waves of 132 SMs (H100 SXM / H200) per tile-per-CTA (a performance choice only).
        n_mb = cute.ceil_div(max_seqlen_q, BM)
        num_heads = cute.size(mQ.shape[1])
        batch = cute.size(mUsedQ.shape[0])
        compact_per_head = tile_schedule.compact_tiles_per_head(cute.size(mQ.shape[0]), batch, BM)
        # Two kernels, one per schedule (the dense one unchanged by the compact one's search, which would
        # otherwise hold the tile's coordinates in registers that ptxas now rematerialises from blockIdx).
        # The compact kernel takes its tiles per head where the dense one takes n_mb.
        if tile_schedule.use_compact_grid(max_seqlen_q, cute.size(mQ.shape[0]), batch, BM) != 0:
            self.launch_schedule(True, compact_per_head, num_heads, batch, tma_atom_Q, tma_Q, tma_atom_K, tma_K,
                                 tma_atom_V, tma_V, mK, mQ, mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK,
                                 mTileCounter, score_mul, cap_mul, window_left, window_right, bottom_right,
                                 sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes, kv_bytes, SharedStorage, stream,
                                 aux_in)
        else:
            self.launch_schedule(False, n_mb, num_heads, batch, tma_atom_Q, tma_Q, tma_atom_K, tma_K,
                                 tma_atom_V, tma_V, mK, mQ, mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK,
                                 mTileCounter, score_mul, cap_mul, window_left, window_right, bottom_right,
                                 sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes, kv_bytes, SharedStorage, stream,
                                 aux_in)

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
        mSinks: cute.Tensor,
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
        aux_in=None,
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
        if cutlass.const_expr(compact):
            # The producer warp claims a tile, decodes it and publishes it in a slot; every consumer thread
            # reads it and frees the slot (tile_queue).
            queue = tile_queue.create(
                storage.mbar_tile.data_ptr(),
                storage.sTileSlots.get_tensor(cute.make_layout((2, slot_values(self.aux)),
                                                               stride=(slot_values(self.aux), 1))),
                mTileCounter, self.num_consumer_threads)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sO = sQ
        if cutlass.const_expr(self.separate_o):
            sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sched = FwdSchedule(n_mb, num_heads, num_kv_heads, batch_size, tiles_per_cta, mCuQ, mCuK, mUsedQ, mUsedK,
                            window_left, window_right, bottom_right, compact, aux_in)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                if cutlass.const_expr(compact):
                    self.produce_claimed(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV,
                                         pipe_q, pipe_k, pipe_v, sched, queue)
                else:
                    self.produce(tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK, sV,
                                 pipe_q, pipe_k, pipe_v, sched)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            sBias = None
            if cutlass.const_expr(self.stage_bias):
                sBias = storage.sBias.get_tensor(bias_stage.layout(self.block_m, self.block_n))
            self.consume(sQ, sK, sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, mSinks, tiled_mma_qk, tiled_mma_pv,
                         copy_out, score_mul, cap_mul, sched, queue, sBias)

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
        mSinks: cute.Tensor,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        copy_out: cute.TiledCopy,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        sched,
        queue=None,
        sBias=None,
    ):
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        raw_scores = not self.has_softcap
        mul = cutlass.Float32(1.0)
        if cutlass.const_expr(raw_scores):
            mul = score_mul
        if cutlass.const_expr(self.aux_exact):
            # Natural-unit scores (fwd_aux.tile_scores applies the scale): the softmax's exp2 takes log2 e.  The
            # mask kind keeps raw scores, so mul stays score_mul (scale * log2 e, as in the plain kernel).
            mul = cutlass.Float32(aux_scores.LOG2_E)

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
        opaque_zero = sched.tiles_per_cta >> 30  # < 2^30: 0, but a kernel argument, so no compiler knows it
        stage = None
        if cutlass.const_expr(self.stage_bias):
            # This warpgroup's rows of the staged bias.
            rows = BM // self.num_consumer_wg
            stage = bias_stage.make(sBias, wg * rows, rows, 0, BN, _BAR_WG_BASE + wg)
        ctx = (sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, mSinks, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv,
               copy_out, copy_r2s, thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha,
               rP, tOrP, score_mul, cap_mul, mul, tidx, wg, opaque_zero, stage)
        if cutlass.const_expr(queue is None):
            for j in cutlass.range(sched.tiles_per_cta, unroll=1):
                state_q, state = self.consume_or_zero(self.tile_info(j, sched), ctx, state_q, state, sched)
        else:
            # The compact kernel's queue: the tiles the producer claimed, in its order, until a claim past
            # the end.
            state_tile = tile_queue.consumer_state()
            total = self.queue_length(sched)
            lin = tile_queue.peek(queue, state_tile)
            while lin < total:
                info = self.published_info(queue, state_tile)
                state_tile = tile_queue.release(queue, state_tile)
                state_q, state = self.consume_or_zero(info, ctx, state_q, state, sched)
                lin = tile_queue.peek(queue, state_tile)

    @cute.jit
    def consume_or_zero(self, info, ctx, state_q, state, sched):
        """The consumers' part of one tile (`info`: its FwdTile): compute it, or, for a tile wholly past the
        valid length, write the zeros of its rows up to the slot end (none for a compact hole)."""
        BM, HD = self.block_m, self.head_dim
        (present, m_block, head, _, q_start, q_len, _, k_len, off, left, right, n_min, n_max, in_grid,
         q_slot, batch) = info
        (sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, mSinks, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv, copy_out,
         copy_r2s, thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha, rP, tOrP,
         score_mul, cap_mul, mul, tidx, wg, opaque_zero, stage) = ctx
        if present:
            aux_tile = None
            if cutlass.const_expr(self.aux):
                # The mask / bias of this tile's (sequence, query head); [n_min, n_max) is already narrowed.
                aux_tile = (fwd_aux.tile_view(sched.aux, batch, head, sched.num_heads), sched.aux, stage)
            state_q, state = self.consume_tile(
                sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, mSinks, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv,
                copy_out, copy_r2s, thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha, rP,
                tOrP, state_q, state, score_mul, cap_mul, mul, tidx, wg, opaque_zero,
                m_block, head, q_start, q_len, q_slot, k_len, off, left, right, n_min, n_max, aux_tile)
        elif in_grid:
            gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), (BM, HD), (m_block, 0))
            sc.zero_rows_global(self.dtype, BM, HD, copy_out, gO, m_block * BM, q_slot, tidx)
        return state_q, state

    @cute.jit
    def consume_tile(
        self, sV, sO, pipe_q, pipe_k, pipe_v, mO, mLSE, mSinks, tiled_mma_qk0, tiled_mma_qk, tiled_mma_pv,
        copy_out, copy_r2s, thr_r2s, tSrQ, tSrK, tOrVt, acc_O, o_mn, cS_mn, cO_mn, row_max, row_sum, alpha, rP,
        tOrP, state_q, state, score_mul, cap_mul, mul, tidx, wg, opaque_zero,
        m_block, head, q_start, q_len, q_slot, k_len, off, left, right, n_min, n_max, aux_tile=None,
    ):
        """One present tile: the key tiles [n_min, n_max) (none: O = 0, lse = -inf), then the epilogue.
        `aux_tile`: the aux variants' (AuxView of the tile, fwd_aux.FwdAux), else None."""
        BM, HD = self.block_m, self.head_dim
        view = None
        stage = None
        if cutlass.const_expr(self.aux):
            view = aux_tile[0]
            stage = aux_tile[2]
        m0 = m_block * BM
        s_shape = rP.shape
        n_rows = cute.size(row_max)
        acc_O.fill(0.0)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        # The mask kind's folded ALiBi term per row (aux_scores.AlibiFold), zeroed per key tile.
        offs = None
        if cutlass.const_expr(self.aux == "mask"):
            offs = cute.make_rmem_tensor(row_max.layout, cutlass.Float32)
        n_tiles = n_max - n_min
        if cutlass.const_expr(self.stage_bias):
            # The first key tile's bias copies, before the waits for Q and K (transform_and_mask stages the next).
            if n_tiles > 0:
                fwd_aux.stage_tile_bias(stage, view, m_block, n_max - 1, BM, self.block_n, q_len, k_len, tidx)
        pipe_q.consumer_wait(state_q)
        if n_tiles > 0:
            # Prologue: S and P of the first tile (acc_O is still zero: no rescale needed).
            pipe_k.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
            self.gemm_qk(tiled_mma_qk0, tiled_mma_qk, acc_S, tSrQ, tSrK, state.index)
            cls = self.aux_tile_class(view, m_block, n_max - 1)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(state)
            s_mn = self.transform_and_mask(acc_S, cS_mn, score_mul, cap_mul, n_max - 1, m_block, q_len,
                                           k_len, off, left, right, view, cls, opaque_zero, stage, n_min, tidx, offs)
            softmax.online_softmax_step_alpha(s_mn, row_max, row_sum, alpha, mul, exact=self.aux_exact,
                                              row_offset=offs)
            rP.store(acc_S.load().to(self.dtype))
            for it in cutlass.range(n_tiles - 1, unroll=1):
                n_cur = n_max - 2 - it
                state_v = state.clone()
                state.advance()
                pipe_k.consumer_wait(state)
                acc_S2 = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                self.gemm_qk(tiled_mma_qk0, tiled_mma_qk, acc_S2, tSrQ, tSrK, state.index)
                cls2 = self.aux_tile_class(view, m_block, n_cur)
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
                                                k_len, off, left, right, view, cls2, opaque_zero, stage, n_min,
                                                tidx, offs)
                softmax.online_softmax_step_alpha(s_mn2, row_max, row_sum, alpha, mul, exact=self.aux_exact,
                                                  row_offset=offs)
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

        if cutlass.const_expr(self.separate_o):
            # Every GEMM of this tile is complete: the producer may load the next tile's Q now.
            pipe_q.consumer_release(state_q)

        # ---- epilogue
        lse_rows = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        # The head's attention sink joins each row's denominator here (-inf: the call has none).
        sink = softmax.read_sink(mSinks, head)
        if cutlass.const_expr(self.aux):
            # lse, and the row max and ln(row sum) in natural units apart (a row with no visible key: O = 0,
            # lse = -inf, m = 0, ln l = +inf), written for the valid rows by both kinds alike.  "bias": lse =
            # m + ln l from natural-unit scores; "mask": the plain kernel's lse from raw scores, the statistics
            # converted (m * score_mul * ln 2).
            max_rows = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            logsum_rows = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            if cutlass.const_expr(self.aux_exact):
                softmax.finalize_exact(o_mn, row_max, row_sum, lse_rows, max_rows, logsum_rows, sink)
            else:
                softmax.finalize_with_stats(o_mn, row_max, row_sum, lse_rows, mul, max_rows, logsum_rows,
                                            sink)
        else:
            softmax.finalize(o_mn, row_max, row_sum, lse_rows, mul, sink)
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                i = m0 + cO_mn[r, 0][0]
                if i < q_len:
                    mLSE[head, q_start + i] = lse_rows[r]
            if cutlass.const_expr(self.aux):
                fwd_aux.store_row_stats(aux_tile[1], max_rows, logsum_rows, cO_mn, m0, head, q_start, q_len)

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
        common.gemm on a stage view of tSrK: that compiles to different SASS, and this is the GPU-checked one.)"""
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
    def aux_tile_class(self, view, m_block: cutlass.Int32, n_block: cutlass.Int32):
        """The aux variants' load of key tile n_block's block-map entries (fwd_aux.tile_class_entry; None
        otherwise), issued right after the tile's S GEMM: the load then runs under the GEMMs, and
        transform_and_mask votes on it after the wait for S."""
        entry = None
        if cutlass.const_expr(self.aux):
            entry = fwd_aux.tile_class_entry(view, m_block, n_block, self.block_m, self.block_n)
        return entry

    @cute.jit
    def transform_and_mask(self, acc_S: cute.Tensor, cS_mn: cute.Tensor, score_mul: cutlass.Float32,
                           cap_mul: cutlass.Float32, n_block: cutlass.Int32, m_block: cutlass.Int32,
                           q_len: cutlass.Int32, k_len: cutlass.Int32, off: cutlass.Int32, left: cutlass.Int32,
                           right: cutlass.Int32, view=None, cls=None, opaque_zero=None, stage=None, n_min=None,
                           tidx=None, offs=None):
        """Scores of one tile as the softmax takes them (soft-capped or raw; aux "bias": natural units with bias
        and mask; aux "mask": raw with the mask; `view` the tile's AuxView, `cls` its aux_tile_class entry, voted
        on here), -inf where a key is not visible.  `stage`: the warpgroup's staged bias (bias_stage.BiasStage,
        where the "bias" kind stages it; the next key tile's copies are issued here, down to n_min).  `offs`
        (aux "mask"): the rows' offsets that the softmax adds (aux_scores.AlibiFold), set here."""
        BM, BN = self.block_m, self.block_n
        if cutlass.const_expr(self.aux):
            # The vote reads the entry OR'ed with (a score's bits & opaque_zero), the entry itself at run time
            # (opaque_zero is 0): ptxas otherwise hoists the vote above the wait for S, back between the GEMM
            # issues, where it stalls on the entry's load.
            pinned = cls | (cute.recast_tensor(acc_S, cutlass.Int32)[0] & opaque_zero)
            cls = fwd_aux.tile_class_vote(view, pinned, BM, BN)
        if cutlass.const_expr(self.has_softcap):
            acc_S.store(cute.math.tanh(acc_S.load() * score_mul, fastmath=False) * cap_mul)
        s_mn = masking.acc_mn_view_sm90(acc_S)
        if cutlass.const_expr(self.aux_exact):
            # Bias and mask first (they read only inside the valid rectangle), then the visibility mask as in
            # the plain kernel: pairs outside the rectangle become -inf by select whatever they hold.
            fwd_aux.tile_scores(s_mn, cS_mn, view, cls, m_block, n_block, BM, BN, q_len, k_len, score_mul, stage,
                                n_min, tidx)
        if cutlass.const_expr(self.aux == "mask"):
            # The mask alone on the raw scores (the softmax applies score_mul), then the visibility mask.
            offs.fill(0.0)
            fwd_aux.tile_mask_scores(s_mn, cS_mn, view, cls, m_block, n_block, BM, BN, q_len, k_len, offs)
        if bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right):
            masking.apply_visibility_mask(s_mn, cS_mn, m_block * BM, n_block * BN, k_len, off, left, right)
        return s_mn
