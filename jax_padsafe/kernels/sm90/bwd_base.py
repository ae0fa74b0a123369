"""Hopper (sm_90a) flash-attention backward: TMA + wgmma, warp-specialised, pad-safe, deterministic.

Drop-in replacements for `sm80.bwd_dkdv.BwdDKDV` / `sm80.bwd_dq.BwdDQ` (same arguments plus a tile counter,
same exported ABI otherwise); the Delta preprocess stays `sm80.bwd_preprocess.BwdPreprocess`.  Same two-kernel
structure, no atomics: every output element is written by exactly one CTA after a fixed-order loop, so results are bitwise reproducible.

Both kernels use 3 warpgroups: warpgroup 0 is the producer (one warp issues TMA into mbarrier-guarded
shared-memory stages, PipelineTmaAsync; setmaxnreg down), warpgroups 1 and 2 consume (setmaxnreg up),
each owning 64 rows of the CTA's tile.

* `BwdDKDVSm90`: one CTA per (key tile of block_n, kv head, sequence), or for packed batches whose dense grid
  would be mostly empty one wave of persistent CTAs that claim (compact key tile, kv head) tiles from a counter
  (`tile_schedule.compact_tile`, `tile_queue`).  K and V resident; Q, dO tiles of
  block_m queries streamed for every (query head of the GQA group, query tile that sees the key tile), in
  that fixed order.  Per step: S^T = K Q^T and dP^T = V dO^T (wgmma, both operands in shared memory),
  P^T = exp2(S^T * scale_log2 - lse2) by select (0 where masked, where the query is padded or has
  lse = -inf), dS^T = P^T * (dP^T - Delta) by select, dV += P^T dO and dK += dS^T Q (wgmma, A from
  registers, B = dO^T / Q^T MN-major from shared memory).  Up to head dim 128 each consumer warpgroup owns
  64 of the tile's 128 keys; at 192 / 256 (block_n 64) each owns half of the head dim, warpgroup 0 computes
  S^T / P^T and warpgroup 1 dP^T / dS^T, and they swap them through shared memory (`exchange_step`).
* `BwdDQSm90`: one CTA per (query tile of block_m, head, sequence), or persistent CTAs that claim compact query
  tiles.  Q and dO resident, K and V streamed; S = Q K^T, dP = dO V^T, P, dS as above, dQ += dS K.

With the queue, a CTA's producer warp claims the next tile once the current one's loads are issued, skips the
compact schedule's holes itself, and loads the next tile's operands while the consumers finish the current one;
up to head dim 128 the consumers stage their outputs through tiles of their own (`separate_out`), so the
resident operands are released before the epilogue.  Which CTA computes a tile changes,
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
The aux variants (`aux="mask"` / `aux="bias"`, bwd_aux: masks and biases as tensors, no softcap; both take the
same arguments) narrow each kernel's tile range by the mask's block summary where the producer and the consumers
both derive it (the dK/dV kernel per query head of the kv group).  "bias" makes S natural-unit scores with the
mask and bias before the visibility mask and recomputes P from the forward's row max and ln(row sum); "mask"
keeps the plain kernels' raw scores, lse and exp2-domain P, and only sets S to -inf where the mask hides a pair
(so a tile the mask shows whole costs what it costs without one).  Every addition sits behind
`cutlass.const_expr`, so the plain kernels compile to the same code.

Outputs are staged through shared memory and written with 16-byte stores predicated per row: valid rows get
values, rows past the valid length up to the sequence's slot end (cu[b+1]) get zeros, and tiles with nothing
to compute write zeros, so padded rows are exactly 0 without a memset where the tiles cover every row (the
FFI handler zero-fills dq/dk/dv first otherwise).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from ..common import tile_schedule

# Named barrier ids (0 is __syncthreads).  4 and 5 are free.
BAR_CONSUMERS = 1  # both consumer warpgroups (256 threads)
BAR_WG_BASE = 2  # + consumer warpgroup index: one consumer warpgroup (128 threads)
# Head-dim split (BwdDKDVSm90.exchange_step): P^T is in shared memory (warpgroup 0 arrives, warpgroup 1
# waits) / dS^T is in shared memory (warpgroup 1 arrives, warpgroup 0 waits); both consumer warpgroups.
BAR_P_READY = 6
BAR_DS_READY = 7


def aux_kind(aux):
    """The `aux` keyword as a kind: False (plain kernel), "mask" or "bias"."""
    if aux is True:
        return "bias"
    if not aux:
        return False
    assert aux in ("mask", "bias"), aux
    return aux


class Sm90BwdBase:
    """What both Hopper backward kernels share: the warpgroup roles and register split, their two TMA pipelines
    (`_pipes`) and the launch of the queued compact schedule (`_launch_compact`)."""

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_stages: int, has_softcap: bool,
                 aux=False):
        assert head_dim % 16 == 0  # hd96: 32-column (64-byte) swizzle atoms, chosen by common.smem_layout
        # The aux variants (masks and biases as tensors, bwd_aux) are built without softcap only.  `aux` is the
        # kind: False (plain), "mask" or "bias" (True: "bias", the single aux variant's behaviour).
        self.aux = aux_kind(aux)
        assert not (self.aux and has_softcap)
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
        self.persistent_ctas = 132  # SMs of an H100 SXM / H200; more than a smaller part holds is harmless

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
                        SharedStorage, stream, extra=()):
        """Launch `self.kernel`'s compact schedule over `heads` heads of `block`-row tiles (key tiles for dK/dV,
        query tiles for dQ): one wave of persistent CTAs that claim the tiles from the queue (x: at most
        `persistent_ctas`).  `staging_bytes`: the output staging tiles' shared memory (`separate_out`); `extra`:
        the kernel's arguments after `compact` (the aux variant's inputs, bwd_aux.BwdAux; none otherwise).
        A plain method, traced inline by the caller's `__call__`: its `if`s are compile-time choices."""
        grid = tile_schedule.tile_grid(True, max_seqlen, total_rows, heads, batch, block)
        smem = SharedStorage.size_in_bytes()
        grid = (cutlass.min(grid[0] * grid[1], self.persistent_ctas), 1, 1)
        if self.separate_out:
            smem += staging_bytes + 1024  # 1024-byte aligned
        self.kernel(*args, True, *extra).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=smem, stream=stream, min_blocks_per_mp=1)
