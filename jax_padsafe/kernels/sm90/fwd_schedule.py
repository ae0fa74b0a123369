"""The Hopper forward's tile scheduling: which query tiles a CTA computes and in which order.

Dense schedule: a linear tile index, m-block fastest (ceil(max_seqlen_q / block_m) per sequence), then head,
then sequence; each CTA takes tiles blockIdx.x + j * gridDim.x (`tile_info`), several per CTA only when there
are enough tiles for >= 2 waves of 132 SMs per tile-per-CTA.  Compact schedule (packed batches whose dense
grid would be mostly empty, `tile_schedule.use_compact_grid`): one wave of persistent CTAs whose producer warp
claims tiles from a counter and publishes each one decoded in a slot of the tile queue (`claim_published`),
which the consumers read (`published_info`).  `tile_info_lin` decodes a linear tile number for both.

The aux variants (masks as tensors, `fwd_aux`; both kinds) narrow each tile's key-tile range in `tile_info_lin` itself, so
the producer's loads and the consumers' steps (dense: both decode; compact: the consumers read what the
producer published) cover the same key tiles.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from ..common import bounds, tile_queue, tile_schedule
from . import fwd_aux


class FwdTile(NamedTuple):
    """One query tile of the forward's schedule, decoded once per tile (`tile_info`): which tile it is, its
    sequence's bounds, the key tiles [n_min, n_max) it visits.  `present` is False for a tile past the grid
    (`in_grid` False) or wholly past its sequence's valid length (nothing to compute: the consumers write its
    rows up to the slot end `q_slot` as zeros, lse is pre-zeroed).  The compact kernel's queue publishes these
    values, in this order, after the tile number; `batch` (the sequence) only in the aux variants, whose
    consumers need it for the mask and bias views (the plain kernel publishes the first 15)."""
    present: cutlass.Boolean
    m_block: cutlass.Int32
    head: cutlass.Int32
    head_kv: cutlass.Int32
    q_start: cutlass.Int32
    q_len: cutlass.Int32
    k_start: cutlass.Int32
    k_len: cutlass.Int32
    off: cutlass.Int32
    left: cutlass.Int32
    right: cutlass.Int32
    n_min: cutlass.Int32
    n_max: cutlass.Int32
    in_grid: cutlass.Boolean
    q_slot: cutlass.Int32
    batch: cutlass.Int32


def slot_values(aux) -> int:
    """Values of a tile-queue slot (compact schedule): the tile number, then the tile's FwdTile (without
    `batch` in the plain kernel).  `aux`: the kernel's aux kind (False, "mask" or "bias")."""
    return len(FwdTile._fields) + (1 if aux else 0)


class FwdSchedule(NamedTuple):
    """What the kernel's threads need to decode tile numbers (`tile_info_lin`).  `per_seq_or_head`: m-blocks
    per sequence (dense) or compact tiles per head (compact); `tiles_per_cta`: the dense schedule's tiles per
    CTA (1 in the compact one, whose CTAs claim tiles until the queue is empty)."""
    per_seq_or_head: cutlass.Int32
    num_heads: cutlass.Int32
    num_kv_heads: cutlass.Int32
    batch_size: cutlass.Int32
    tiles_per_cta: cutlass.Int32
    cu_q: cute.Tensor
    cu_k: cute.Tensor
    used_q: cute.Tensor
    used_k: cute.Tensor
    window_left: cutlass.Int32
    window_right: cutlass.Int32
    bottom_right: cutlass.Int32
    compact: bool
    aux: object = None  # the aux variants' fwd_aux.FwdAux, else None


class FwdTileSchedule:
    """Mixin of `FlashFwdSm90`: the launch of each schedule and the decoding of tile numbers."""

    @cute.jit
    def launch_schedule(self, compact: cutlass.Constexpr, per_seq_or_head, num_heads, batch, tma_atom_Q, tma_Q,
                        tma_atom_K, tma_K, tma_atom_V, tma_V, mK, mQ, mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK,
                        mTileCounter, score_mul, cap_mul, window_left, window_right, bottom_right, sQ_layout,
                        sKV_layout, tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes: cutlass.Constexpr,
                        kv_bytes: cutlass.Constexpr, SharedStorage: cutlass.Constexpr, stream, aux_in=None):
        """Launch the kernel of one schedule: dense (per_seq_or_head = m-blocks per sequence) or compact
        (per_seq_or_head = compact tiles per head).  `aux_in`: the aux variants' fwd_aux.FwdAux (the kernel's
        last argument, absent from the plain kernel's)."""
        total = per_seq_or_head * num_heads
        if cutlass.const_expr(not compact):
            total = total * batch
        if cutlass.const_expr(compact):
            # Persistent CTAs that claim their tiles one at a time from a counter (`claim_published`): as many
            # as one wave (one CTA per SM; 132 on an H100 SXM / H200; on a part with fewer SMs the extra
            # CTAs start once the counter is spent and find nothing left).
            tiles_per_cta = cutlass.Int32(1)  # unused by this schedule (but the pins' opaque zero reads it)
            grid = (cutlass.min(total, self.persistent_ctas), 1, 1)
        elif cutlass.const_expr(self.max_tiles_per_cta > 1):
            tiles_per_cta = cutlass.max(cutlass.min(total // self.multi_tile_min_tiles, self.max_tiles_per_cta), 1)
            grid = (cute.ceil_div(total, tiles_per_cta), 1, 1)
        else:
            tiles_per_cta = cutlass.Int32(1)
            grid = (total, 1, 1)
        aux_arg = ()
        if cutlass.const_expr(self.aux):
            aux_arg = (aux_in,)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK, mTileCounter, mK.shape[1], mQ.shape[1], per_seq_or_head,
            batch, tiles_per_cta, score_mul, cap_mul, window_left, window_right, bottom_right,
            sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv, copy_out, q_bytes, kv_bytes, SharedStorage, compact,
            *aux_arg,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.jit
    def tile_info(self, j: cutlass.Int32, sched):
        """The FwdTile of this CTA's j-th tile.  Producer and consumers derive the same sequence of tiles from it
        (the compact kernel's queue: tile_info_lin of the claimed numbers)."""
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
        """The FwdTile of the tile with linear number `lin` (below the schedule's tile count, or a tile past
        the grid: in_grid False)."""
        BM, BN = self.block_m, self.block_n
        (n_mb, num_heads, num_kv_heads, batch_size, tiles_per_cta, mCuQ, mCuK, mUsedQ, mUsedK,
         window_left, window_right, bottom_right, compact, aux) = sched
        # Dense: m-block fastest, then head, then sequence.  Compact: head, then the compact tiles of
        # all sequences (in sequence order, m-block fastest).
        if cutlass.const_expr(compact):
            per_head = n_mb  # the compact kernel's argument in that place
            # Last tiles first: the last m-blocks of a causal sequence are its heaviest.
            lin = per_head * num_heads - 1 - lin
            head = cutlass.min(lin // per_head, num_heads - 1)
            batch, m_block = tile_schedule.compact_tile(lin - head * per_head, mCuQ, batch_size, BM)
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
        if cutlass.const_expr(self.aux):
            # Here, not in the consumers alone: the producer must load exactly the key tiles they visit.
            n_min, n_max = fwd_aux.key_range(aux, present, batch, head, num_heads, m_block, BM, BN, n_min, n_max)
        head_kv = head // (num_heads // num_kv_heads)
        return FwdTile(present, m_block, head, head_kv, q_start, q_len, k_start, k_len, off, left, right, n_min,
                       n_max, in_grid, q_slot, batch)

    def queue_length(self, sched):
        """The compact schedule's tile count (compact tiles per head x heads): claims at or past it end."""
        return sched.per_seq_or_head * sched.num_heads

    @cute.jit
    def claim_published(self, queue, state_tile, sched):
        """Producer warp: claim tile numbers until one names a tile inside its sequence's slot (a hole of the
        compact schedule, tile_schedule.compact_tile, needs nothing: skipped here, so the consumers never see
        one) or the end, and publish it with its FwdTile for the consumers, who then need no search or length
        loads of their own at a tile's start.  Returns (number, FwdTile, slot state)."""
        total = self.queue_length(sched)
        lin = tile_queue.take(queue)
        info = self.tile_info_lin(lin, sched)
        hole = (lin < total) & (info.m_block * self.block_m >= info.q_slot)
        while hole:
            lin = tile_queue.take(queue)
            info = self.tile_info_lin(lin, sched)
            hole = (lin < total) & (info.m_block * self.block_m >= info.q_slot)
        values = (lin,) + tuple(cutlass.Int32(x) for x in info)
        # The consumers read the range from here (published_info): in the aux variants it is the narrowed one.
        state_tile = tile_queue.publish(queue, state_tile, values[:slot_values(self.aux)])
        return lin, info, state_tile

    @cute.jit
    def published_info(self, queue, state_tile):
        """Consumer thread: the FwdTile that the producer published in the held slot `state_tile`."""
        v = tuple(tile_queue.field(queue, state_tile, 1 + i) for i in range(slot_values(self.aux) - 1))
        batch = cutlass.Int32(0)  # the plain kernel's consumers never read it
        if cutlass.const_expr(self.aux):
            batch = v[15]
        return FwdTile(v[0] != 0, *v[1:13], v[13] != 0, v[14], batch)
