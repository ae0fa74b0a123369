"""A queue of tiles claimed from a global counter: the persistent CTAs of the Hopper kernels' compact schedules.

Why: a compact schedule (tile_schedule.compact_tile) of a packed batch of short documents has many tiles of a few
blocks each.  One CTA per tile exposes every tile's launch, pipeline fill and epilogue; a fixed share of
tiles per CTA leaves a tail on skewed batches (one long document among short ones).  Persistent CTAs that
claim one tile at a time balance like the hardware's dispatch of one-tile CTAs and overlap a tile's loads
with the previous tile's work.

How: the producer warp claims a tile number with one atomic add on an int32 counter (zero-filled by the FFI
handler before the launch, `take`), decodes it, and publishes the number with what the consumers need of its
decoding in one of two shared-memory slots guarded by mbarriers (`publish`; `PipelineAsync`: one producer
thread, every consumer thread).  The consumer warpgroups read the slot (`peek`, `field`) and free it
(`release`), at once or, to re-read a value from shared memory instead of keeping it in a register, after the
tile.  Numbers that name no tile (the compact schedule's holes) are skipped by the producer and never
published: a hole costs the consumers nothing, and no decoding (searches, length loads) delays the consumers
at a tile's start.  A number at or past the schedule's tile count means "no more tiles" and ends both loops.

Every kernel that takes a queue claims tiles in a fixed order (`tile_schedule.claimed_compact_tile`; the forward
and dQ kernels last first): which CTA computes a tile depends on timing, but no result does: each output tile is
written by exactly one CTA, in the same way.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from . import bounds, tile_schedule


def create(barrier_ptr, slots: cute.Tensor, counter: cute.Tensor, num_consumer_threads: int):
    """The queue (pipeline, slots, counter).  `barrier_ptr`: 4 int64 mbarriers (full / empty of two slots);
    `slots`: int32 shared memory, (2, values) (the tile number, then the kernel's decoded values); `counter`:
    the int32[1] global counter.  Needs the caller's mbarrier_init_fence + CTA barrier (defer_sync)."""
    pipe = pipeline.PipelineAsync.create(
        barrier_storage=barrier_ptr, num_stages=2,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
        defer_sync=True,
    )
    return (pipe, slots, counter)


def producer_state():
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)


def consumer_state():
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)


@cute.jit
def _take_number(counter: cute.Tensor):
    """Lane 0: the next tile number (a relaxed atomic add: the slot's mbarrier orders what follows)."""
    return cute.arch.atomic_add(counter.iterator, cutlass.Int32(1), sem="relaxed", scope="gpu")


@cute.jit
def take(queue):
    """Producer warp (all 32 lanes): the next tile number (lane 0's atomic add), in every lane; no slot is
    involved, so a producer may skip numbers that name no tile (`publish` only the ones that do)."""
    _, _, counter = queue
    claimed = cutlass.Int32(0)
    if cute.arch.lane_idx() == 0:
        claimed = _take_number(counter)
    return cute.arch.shuffle_sync(claimed, 0)


@cute.jit
def take_compact_tile(queue, per_head: cutlass.Int32, num_heads: cutlass.Int32, cu: cute.Tensor,
                      batch: cutlass.Int32, block: cutlass.Constexpr, last_first: cutlass.Constexpr):
    """Producer warp: `take` numbers until one names a compact tile inside its sequence's slot
    (tile_schedule.claimed_compact_tile), or the end (a number at or past per_head x num_heads); returns (number,
    head, sequence, tile).  The compact schedule's holes are skipped here, so the consumers never wait for one:
    each costs the producer, which runs ahead of them, one atomic add and one search."""
    total = per_head * num_heads
    lin = take(queue)
    head, b, m = tile_schedule.claimed_compact_tile(lin, per_head, num_heads, cu, batch, block, last_first)
    hole = (lin < total) & (m * block >= bounds.slot_length(cu, b))
    while hole:
        lin = take(queue)
        head, b, m = tile_schedule.claimed_compact_tile(lin, per_head, num_heads, cu, batch, block, last_first)
        hole = (lin < total) & (m * block >= bounds.slot_length(cu, b))
    return lin, head, b, m


@cute.jit
def publish(queue, state, values):
    """Producer warp (all 32 lanes): wait for slot `state` to be free, fill it with `values` (a tuple of int32:
    the tile number, then what the consumers need of its decoding) and hand it to the consumers.  Returns the
    advanced slot state."""
    pipe, slots, _ = queue
    pipe.producer_acquire(state)
    if cute.arch.lane_idx() == 0:
        for i in cutlass.range_constexpr(len(values)):
            slots[state.index, i] = values[i]
        # mbarrier.arrive releases the stores above to the consumers' wait (acquire).
        pipe.producer_commit(state)
    state.advance()
    return state


@cute.jit
def peek(queue, state):
    """Consumer thread: wait for slot `state` and return its tile number (value 0); the slot stays held (its
    other values are `field(queue, state, i)`) until `release`."""
    pipe, slots, _ = queue
    pipe.consumer_wait(state)
    return slots[state.index, 0]


@cute.jit
def field(queue, state, i: cutlass.Constexpr):
    """Value i of the held slot `state` (a shared-memory load; 0 is the tile number)."""
    _, slots, _ = queue
    return slots[state.index, i]


@cute.jit
def release(queue, state):
    """Consumer thread: free the held slot `state`; returns the advanced state."""
    pipe, _, _ = queue
    pipe.consumer_release(state)
    state.advance()
    return state
