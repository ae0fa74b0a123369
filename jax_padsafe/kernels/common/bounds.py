"""Per-sequence lengths, visibility offsets and the tile ranges a tile visits.

`TileBounds` gathers what a kernel needs to know about one tile of one sequence, built once per tile by
`query_tile` (a query tile: the key tiles it visits) or `key_tile` (a key tile: the query tiles that see it),
in the manner of FlashAttention's SeqlenInfo / BlockInfo.  The pieces (`used_length`, `window_bounds`, ...)
stay callable on their own for kernels that need only some of them.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute


class TileBounds(NamedTuple):
    """One tile of one sequence.  Key j is visible to query i iff 0 <= j < k_len and
    i + off - left <= j <= i + off + right (`window_bounds`); [lo, hi) are the tiles of the other side that hold
    at least one visible pair (key tiles of a query tile, query tiles of a key tile); `slot` is the slot length
    of the tile's own side (the rows it writes, zeros past its valid length)."""
    q_start: cutlass.Int32
    q_len: cutlass.Int32
    k_start: cutlass.Int32
    k_len: cutlass.Int32
    slot: cutlass.Int32
    off: cutlass.Int32
    left: cutlass.Int32
    right: cutlass.Int32
    lo: cutlass.Int32
    hi: cutlass.Int32


@cute.jit
def used_length(cu: cute.Tensor, used: cute.Tensor, b: cutlass.Int32):
    """(start, valid length) of sequence b: min(max(seqused[b], 0), cu[b+1] - cu[b])."""
    start = cu[b]
    seg = cu[b + 1] - start
    n = cutlass.max(used[b], 0)
    n = cutlass.min(n, cutlass.max(seg, 0))
    return start, n


@cute.jit
def slot_length(cu: cute.Tensor, b: cutlass.Int32):
    """Rows of the buffer that belong to sequence b, cu[b+1] - cu[b] (>= its valid length): a kernel that
    writes zeros to its tiles' rows in [valid length, slot length) leaves no row of a covered layout
    unwritten (the cute backend's `rows_covered`)."""
    return cutlass.max(cu[b + 1] - cu[b], 0)


@cute.jit
def window_bounds(
    q_len: cutlass.Int32,
    k_len: cutlass.Int32,
    window_left: cutlass.Int32,
    window_right: cutlass.Int32,
    bottom_right: cutlass.Int32,
):
    """Offset and effective window sides.  Key j is visible to query i iff
    0 <= j < k_len and i + off - left <= j <= i + off + right.
    An unbounded side (-1) becomes q_len + k_len, which is never binding and cannot overflow int32
    for lengths below 2**30."""
    off = cutlass.Int32(0)
    if bottom_right != 0:
        off = k_len - q_len
    big = q_len + k_len
    left = big
    if window_left >= 0:
        left = window_left
    right = big
    if window_right >= 0:
        right = window_right
    return off, left, right


@cute.jit
def n_block_range(
    m_block: cutlass.Int32,
    block_m: cutlass.Constexpr,
    block_n: cutlass.Constexpr,
    q_len: cutlass.Int32,
    k_len: cutlass.Int32,
    off: cutlass.Int32,
    left: cutlass.Int32,
    right: cutlass.Int32,
):
    """[n_block_min, n_block_max) of K tiles that hold at least one key visible to some valid
    query of this m-block; tiles outside are wholly masked and are skipped."""
    m0 = m_block * block_m
    m_last = cutlass.min(m0 + block_m, q_len) - 1
    n_lo = cutlass.max(m0 + off - left, 0)
    n_hi = cutlass.min(m_last + off + right + 1, k_len)
    n_min = n_lo // block_n
    n_max = n_min
    if n_hi > n_lo:
        n_max = (n_hi + block_n - 1) // block_n
    return n_min, n_max


@cute.jit
def tile_needs_mask(
    n_block: cutlass.Int32,
    m_block: cutlass.Int32,
    block_m: cutlass.Constexpr,
    block_n: cutlass.Constexpr,
    q_len: cutlass.Int32,
    k_len: cutlass.Int32,
    off: cutlass.Int32,
    left: cutlass.Int32,
    right: cutlass.Int32,
):
    """True unless every (row, key) pair of the tile with a valid row is visible."""
    m0 = m_block * block_m
    m_last = cutlass.min(m0 + block_m, q_len) - 1
    n0 = n_block * block_n
    n_last = n0 + block_n - 1
    need = cutlass.Boolean(False)
    if n_last >= k_len:
        need = cutlass.Boolean(True)
    if n_last > m0 + off + right:
        need = cutlass.Boolean(True)
    if n0 < m_last + off - left:
        need = cutlass.Boolean(True)
    return need


@cute.jit
def tile_interior(m_block: cutlass.Int32, block_m: cutlass.Constexpr, q_len: cutlass.Int32,
                  need_mask: cutlass.Boolean):
    """Whether a tile with `tile_needs_mask` False also has every row valid: then every pair of it is visible
    and inside the valid rectangle, its Q, dO, K and V rows all hold valid data, and the backward forms P and
    dS without per-score selects (bwd_scores.probs_interior, dscores_interior)."""
    return not need_mask and m_block * block_m + block_m <= q_len


@cute.jit
def m_block_range(
    n_block: cutlass.Int32,
    block_m: cutlass.Constexpr,
    block_n: cutlass.Constexpr,
    q_len: cutlass.Int32,
    k_len: cutlass.Int32,
    off: cutlass.Int32,
    left: cutlass.Int32,
    right: cutlass.Int32,
):
    """[m_min, m_max) of query tiles holding at least one valid query that sees a valid key of this
    key tile.  Query i sees key j iff i + off - left <= j <= i + off + right (and both valid)."""
    n0 = n_block * block_n
    n_last = cutlass.min(n0 + block_n, k_len) - 1
    m_lo = cutlass.max(n0 - off - right, 0)
    m_hi = cutlass.min(n_last - off + left + 1, q_len)
    m_min = m_lo // block_m
    m_max = m_min
    if m_hi > m_lo:
        m_max = (m_hi + block_m - 1) // block_m
    return m_min, m_max


@cute.jit
def query_tile(cu_q: cute.Tensor, cu_k: cute.Tensor, used_q: cute.Tensor, used_k: cute.Tensor,
               window_left: cutlass.Int32, window_right: cutlass.Int32, bottom_right: cutlass.Int32,
               batch: cutlass.Int32, m_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """TileBounds of query tile m_block of sequence `batch` (slot: its query slot; [lo, hi): the key tiles)."""
    q_start, q_len = used_length(cu_q, used_q, batch)
    q_slot = slot_length(cu_q, batch)
    k_start, k_len = used_length(cu_k, used_k, batch)
    off, left, right = window_bounds(q_len, k_len, window_left, window_right, bottom_right)
    n_min, n_max = n_block_range(m_block, block_m, block_n, q_len, k_len, off, left, right)
    return TileBounds(q_start, q_len, k_start, k_len, q_slot, off, left, right, n_min, n_max)


@cute.jit
def key_tile(cu_q: cute.Tensor, cu_k: cute.Tensor, used_q: cute.Tensor, used_k: cute.Tensor,
             window_left: cutlass.Int32, window_right: cutlass.Int32, bottom_right: cutlass.Int32,
             batch: cutlass.Int32, n_block: cutlass.Int32, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """TileBounds of key tile n_block of sequence `batch` (slot: its key slot; [lo, hi): the query tiles)."""
    k_start, k_len = used_length(cu_k, used_k, batch)
    k_slot = slot_length(cu_k, batch)
    q_start, q_len = used_length(cu_q, used_q, batch)
    off, left, right = window_bounds(q_len, k_len, window_left, window_right, bottom_right)
    m_min, m_max = m_block_range(n_block, block_m, block_n, q_len, k_len, off, left, right)
    return TileBounds(q_start, q_len, k_start, k_len, k_slot, off, left, right, m_min, m_max)
