"""The compact tile schedule: which (sequence, tile) a CTA or a claimed tile number stands for.

A grid of ceil(max_seqlen / block) tiles per sequence launches, for a packed batch of a few long and many
short sequences (or a max_seqlen left at the packed length, all a jitted step with traced offsets knows),
mostly tiles past their sequence's end.  The compact schedule numbers only tiles that start inside their
sequence's slot: tile m of sequence b is v = cu[b] // block + b + m.  f(b) = cu[b] // block + b is strictly
increasing, and for non-decreasing offsets the last tile of b stays below f(b + 1) (ceil(L / block) <=
floor(L / block) + 1 for the slot length L), so v is one-to-one.  Every v is below
cu[B] // block + B <= total_rows // block + B: that bound, known on the host from the buffer's shape, sizes
the grid.  A v that falls past its sequence's slot (at most one per sequence, plus those before f(0)) is a
hole: the kernel finds m * block >= slot length and does nothing, exactly as for a dense tile past a
sequence's end.
"""

import cutlass
import cutlass.cute as cute

from .bounds import slot_length


def compact_tiles_per_head(total_rows, batch, block: int):
    """Host side: the compact schedule's tiles per head (an upper bound on the tiles that hold rows)."""
    return total_rows // block + batch


def use_compact_grid(max_seqlen, total_rows, batch, block: int):
    """Host side: 1 when the compact schedule launches at most half the dense grid of ceil(max_seqlen / block)
    tiles per sequence, else 0.  A hole or an empty dense tile costs a CTA (or a multi-tile CTA's turn) only its
    bounds; the compact search costs every tile one or two dependent loads, so it pays only where it removes
    many tiles."""
    dense_per_head = (max_seqlen + block - 1) // block * batch
    return cutlass.Int32(2 * compact_tiles_per_head(total_rows, batch, block) <= dense_per_head)


def tile_grid(compact: bool, max_seqlen, total_rows, heads, batch, block: int):
    """Host side: the (tiles, heads, sequences) grid of one schedule; compact grids put every sequence's
    tiles in x (tile_of_cta decodes them)."""
    if compact:
        return (compact_tiles_per_head(total_rows, batch, block), heads, 1)
    return ((max_seqlen + block - 1) // block, heads, batch)


@cute.jit
def tile_of_cta(compact: cutlass.Constexpr, x: cutlass.Int32, z: cutlass.Int32, cu: cute.Tensor,
                batch: cutlass.Int32, block: cutlass.Constexpr):
    """(sequence, tile) of the CTA at (x, ., z) of a tile_grid: tile x of sequence z (dense), or compact
    tile x (compact_tile).  All 32 lanes of each warp must call it (the compact search votes)."""
    if cutlass.const_expr(compact):
        return compact_tile(x, cu, batch, block)
    return z, x


@cute.jit
def compact_tile(v: cutlass.Int32, cu: cute.Tensor, batch: cutlass.Int32, block: cutlass.Constexpr):
    """(sequence b, tile m) of compact tile v: the largest b with f(b) = cu[b] // block + b <= v, and
    m = v - f(b).  A hole comes back as a tile at or past its sequence's slot end (m * block >= slot length),
    which every kernel already treats as a tile with nothing to compute or write; that includes a v before
    f(0) (offsets that start past row block - 1).

    Must be called by all 32 lanes of a warp with the same v: it searches with ballots, 32 candidates per
    round (one round up to 32 sequences, two up to 1024, at most four for 65535), so the tile costs one or two
    dependent loads of cu, not log2(batch)."""
    lane = cute.arch.lane_idx()
    lo = cutlass.Int32(0)
    count = batch
    while count > 1:
        stride = (count + 31) // 32
        cand = lo + lane * stride
        inside = cand < lo + count
        f = cu[cutlass.min(cand, batch - 1)] // block + cand
        hit = cute.arch.vote_ballot_sync(inside & (f <= v))
        k = cutlass.max(cute.arch.popc(hit) - 1, 0)  # hits are a prefix of the lanes: f is increasing
        new_lo = lo + k * stride
        count = cutlass.min(stride, lo + count - new_lo)
        lo = new_lo
    m = v - (cu[lo] // block + lo)
    if m < 0:
        m = (slot_length(cu, lo) + block - 1) // block
    # Uniform across the warp (every lane searched for the same v): ptxas may then keep them in uniform
    # registers, as it keeps blockIdx, instead of two of the consumers' general registers.
    return cute.arch.make_warp_uniform(lo), cute.arch.make_warp_uniform(m)


@cute.jit
def claimed_compact_tile(lin: cutlass.Int32, per_head: cutlass.Int32, num_heads: cutlass.Int32, cu: cute.Tensor,
                         batch: cutlass.Int32, block: cutlass.Constexpr, last_first: cutlass.Constexpr):
    """(head, sequence, tile) of the lin-th tile (lin < per_head * num_heads) that a compact schedule's queue
    hands out (tile_queue): head by head, each head's compact tiles in increasing order, or with `last_first`
    the whole order reversed (the last tiles of a sequence, under causal masks its heaviest query tiles,
    first).  Without `last_first` that is the order in which the hardware dispatches one-tile CTAs of the same
    schedule (x: compact tile, y: head); with it, each head's tiles come in that order reversed, as the one-tile
    CTAs of the forward and dQ kernels took them, and the heads last first.
    All 32 lanes of each warp must call it (compact_tile votes)."""
    if cutlass.const_expr(last_first):
        lin = per_head * num_heads - 1 - lin
    head = cutlass.min(lin // per_head, num_heads - 1)
    b, m = compact_tile(lin - head * per_head, cu, batch, block)
    return head, b, m
