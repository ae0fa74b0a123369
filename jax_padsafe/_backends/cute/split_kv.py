"""Few query rows against many keys (decoding): pack GQA heads into rows and split the keys.

The forward kernels give a CTA ``block_m = 128`` query rows of one head and walk every key of its
sequence. With a handful of query rows per sequence (one per decode step) that grid has ``B * N``
CTAs of nearly empty tiles, each streaming a whole KV cache: on an H100 one 128k-token sequence took
1.3 ms against cuDNN's 0.19 ms (2026-11-25). Two rewrites of the call, exact
in what is visible, fix the shape of the grid without touching a kernel:

* **GQA packing.** The ``G = N / K`` query heads that share a key/value head become ``T * G`` query
  rows of one head (row ``t * G + g`` is query row ``t`` of head ``k * G + g``), so a tile holds
  ``G`` times the useful rows and each key/value tile is read once per group. Row ``t * G + g`` is
  valid iff ``t < q_len``, i.e. iff it is below ``q_len * G``: still a prefix.
* **Split keys** (flash-decoding). Each sequence's keys are cut into ``P`` chunks of ``C`` rows. The
  packed layout describes the chunks in place (chunk ``p`` of row ``b`` starts at key row
  ``b * S + p * C`` and holds ``clamp(kv_len - p * C, 0, C)`` valid keys), so K and V are not
  copied; the query rows are repeated per chunk (few rows: cheap). The ``P`` partial results are
  merged through their lse with selects only: a chunk without valid keys reports lse ``-inf`` and
  gets weight 0 by select, never by multiplying a value by 0.

Both apply only where the rewritten call needs no mask: every valid query row of a sequence sees one
contiguous range ``[lo, hi)`` of its keys, the chunks split that range, and the kernels run them
without causal masking or a window. That holds without causal masking or a window (``[0, kv_len)``),
and for one query row with any mask: its position ``off`` (``kv_len - 1`` with bottom-right
alignment, else 0) sees ``[off - left, off + right]`` (``right = 0`` when causal), which covers
decoding with a KV cache, sliding-window layers included; the chunks then cover only the window.
Several rows with bottom-right causal masking (speculative decoding, small prefill chunks) all see the
keys before ``kv_len - q_len + 1``: those are split as above, and the last ``q_len - 1`` keys (the
diagonal) go to one more kernel call with causal masking in the same alignment, unpacked, whose result
is merged like a chunk's.
Attention sinks (one logit per query head) go to the kernels where the plan leaves the call unchanged; a
rewritten call's chunks see part of each row (and a packed tile mixes heads), so the sinks join the merged
result instead (``sinks.forward``).
``eligible`` checks that and that the rows come from lengths (one run per batch row starting at
row 0, the problem's ``lengths`` layout: ``split_kv_to_runs``) or from the packed layout (``split_kv_packed``:
each sequence's query rows, at most ``max_seqlen_q``, are gathered into a dense block and the results
scattered back); the plan (``plan``) is made from the shapes the function is traced with, which under
``custom_partitioning`` are the local shard's. The backward is unchanged: it recomputes from q, k, v
and the merged o and lse, which are the unsplit call's up to rounding.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax.numpy as jnp

from jax_padsafe._backends import partitioning
from jax_padsafe._backends.cute import sinks as sink_ops
from jax_padsafe._core import visibility

# Query rows per kernel tile (block_m of the kernels that run on the GPUs we ship for: sm90 and the
# SM80-class hd64-128 tiles; at hd192/256 the SM80-class tile is 64 rows, where packing only helps more).
_TILE_ROWS = 128
# Split only a grid of less than one wave of query tiles (one per SM of an H100 / H200, 132 SMs), and then
# into about two waves, so that every SM streams keys and the last wave is not a lone one.  A grid of a
# wave or more gains nothing from more, shorter CTAs: only the merge's cost.
_ONE_WAVE = 132
_TARGET_TILES = 264
# The smallest chunk: two key tiles of 128, so that a chunk's fixed costs (loading Q, the epilogue, the
# merge) stay small next to its streaming.
_MIN_CHUNK = 256
_MAX_SPLITS = 128
_F32 = jnp.float32


class Plan(NamedTuple):
  """How a call is rewritten: GQA packing on or off, and ``splits`` chunks of ``chunk`` keys."""
  pack: bool
  splits: int
  chunk: int

  @property
  def changes_call(self) -> bool:
    return self.pack or self.splits > 1


def eligible(spec, problem) -> bool:
  """Whether the rewrite keeps this call's visibility (see the module docstring): the packed layout, or
  the padded one with lengths (one run per batch row from row 0)."""
  if problem.kernel is None or not (problem.packed or problem.dense_rows):
    return False
  if problem.max_seqlen_q == 1 or not (spec.causal or spec.has_window):
    return True
  # Several rows with bottom-right causal masking (speculative decoding, chunked prefill): the keys
  # before the diagonal are split, the diagonal is one more small causal call.
  return spec.causal and spec.bottom_right and not spec.has_window


def _row_range_bounds(causal: bool, window_left: int, window_right: int):
  """(left, right) reach of a one-row call's visible keys around its position (None: unbounded),
  with the kernels' folding of causal into the window (right = 0)."""
  left = window_left if window_left >= 0 else None
  right = 0 if causal else (window_right if window_right >= 0 else None)
  return left, right


def visible_keys(keys: int, num_query_rows: int, causal: bool, window_left: int, window_right: int) -> int:
  """A static bound on how many keys one sequence's rows see: the key range the chunks split."""
  if num_query_rows != 1:
    return keys
  left, right = _row_range_bounds(causal, window_left, window_right)
  if left is None or right is None:
    return keys
  return max(0, min(keys, left + right + 1))


def plan(batch: int, rows: int, heads: int, kv_heads: int, keys: int) -> Plan:
  """The rewrite for local shapes ``q [batch, rows, heads, H]``, ``k [batch, keys, kv_heads, H]``."""
  if keys == 0 or rows == 0:
    return Plan(False, 1, keys)
  group = heads // kv_heads
  pack = group > 1 and rows * group <= _TILE_ROWS
  rows_eff, heads_eff = (rows * group, kv_heads) if pack else (rows, heads)
  if rows_eff > _TILE_ROWS:  # more than one query tile per (sequence, head): not a few-rows call
    return Plan(False, 1, keys)
  tiles = batch * heads_eff
  splits = 1
  if tiles < _ONE_WAVE and keys >= 2 * _MIN_CHUNK:
    splits = min(math.ceil(_TARGET_TILES / tiles), keys // _MIN_CHUNK, _MAX_SPLITS)
  # Chunks of whole key tiles; the last one may be shorter.
  chunk = -(-keys // splits) if splits > 1 else keys
  chunk = -(-chunk // _TILE_ROWS) * _TILE_ROWS if splits > 1 else chunk
  splits = -(-keys // chunk) if keys else 1
  return Plan(pack, splits, chunk)


def merge_partials(o, lse):
  """Merge ``P`` partial attention results over disjoint key sets (selects only).

  Args:
    o: ``[P, ..., H]`` partial outputs (any float dtype).
    lse: ``[P, ...]`` float32 log-sum-exps of the partials; ``-inf`` where a partial saw no key.

  Returns:
    ``(o [..., H] float32, lse [...])``: a row no partial saw anything of gets o = 0, lse = -inf.
  """
  ninf = _F32(-jnp.inf)
  mx = jnp.max(lse, axis=0)
  empty = mx == ninf
  mx_safe = jnp.where(empty, _F32(0), mx)  # finite, so never -inf - -inf below
  w = jnp.where(lse == ninf, _F32(0), jnp.exp(lse - mx_safe))
  tot = jnp.where(empty, _F32(1), jnp.sum(w, axis=0))  # >= 1 wherever a partial saw a key
  part = jnp.where((lse == ninf)[..., None], _F32(0), w[..., None] * o.astype(_F32))
  out = jnp.where(empty[..., None], _F32(0), jnp.sum(part, axis=0) / tot[..., None])
  return out, jnp.where(empty, ninf, mx_safe + jnp.log(tot))


def _rewritten_call(packed_fn, p: Plan, q, q_len, k, v, k_base, k_end, kv_len, static, sinks=None):
  """The rewritten kernel call(s) for dense query rows and keys in place.

  Args:
    packed_fn: the kernels' packed forward (``forward.flash_forward``'s signature).
    p: the plan (``changes_call``).
    q: ``[B, T, N, H]``; rows ``t < q_len[b]`` of batch row ``b`` are valid.
    k, v: ``[total_k, K, H]``; sequence ``b``'s keys are rows ``k_base[b] + [0, kv_len[b])``, inside its
      slot ``[k_base[b], k_end[b])`` (slots in order, not overlapping).
    static: the call's static arguments (``flash_forward``'s keywords).
    sinks: the attention sinks ``[N]`` float32, joined to the merged result, or None.

  Returns:
    ``o [B, T, N, H]`` (q's dtype) and ``lse [B, N, T]`` float32, padded rows exactly 0.
  """
  b, t = q.shape[:2]
  kv_len = jnp.clip(kv_len, 0, k_end - k_base)
  causal, br = static["causal"], static["bottom_right"]
  # The keys [lo, hi) that every valid row of a sequence sees whole (see the module docstring), in the
  # kernels' semantics: 0 <= j < kv_len and i + off - left <= j <= i + off + right.
  lo, hi = jnp.zeros_like(kv_len), kv_len
  diagonal = False
  if t == 1:
    left, right = _row_range_bounds(causal, static["window_left"], static["window_right"])
    off = (kv_len - q_len) if br else jnp.zeros_like(kv_len)
    if left is not None:
      lo = jnp.clip(off - left, 0, kv_len)
    if right is not None:
      hi = jnp.clip(off + right + 1, lo, kv_len)
  elif causal:
    # Several rows, causal, bottom-right (``eligible``): row t sees j <= kv_len - q_len + t. Every row
    # sees the keys before kv_len - q_len + 1; the last q_len - 1 keys form the diagonal, one more
    # kernel call with causal masking in the same alignment.
    hi = jnp.clip(kv_len - q_len + 1, 0, kv_len)
    diagonal = True
  o, lse = _chunked_partial(packed_fn, p, q, q_len, k, v, k_base, lo, hi, static)
  if diagonal:
    o_d, lse_d = _diagonal_partial(packed_fn, q, q_len, k, v, k_base, hi, kv_len, static)
    o, lse = merge_partials(jnp.stack([o, o_d]), jnp.stack([lse, lse_d]))
  # Padded rows: o exactly 0 and lse exactly 0 (the contract), by select.
  valid = _valid_rows(t, q_len)
  o = visibility.select_rows(o, valid).astype(q.dtype)
  lse = visibility.select_rows(lse, valid).transpose(0, 2, 1)
  if sinks is not None:
    o, lse, _ = sink_ops.forward(o, lse, sinks, valid)
  return o, lse


def _valid_rows(rows, q_len):
  return jnp.arange(rows, dtype=jnp.int32)[None, :] < q_len[:, None]  # [B, rows]


def _chunked_partial(packed_fn, p: Plan, q, q_len, k, v, k_base, lo, hi, static):
  """Attention of every row to keys ``[lo, hi)`` of its sequence (no mask), in the plan's chunks, with
  GQA packing per the plan: ``(o [B, T, N, H] float32, lse [B, T, N])``, lse ``-inf`` for rows that saw
  nothing, padded rows included."""
  b, t, n, h = q.shape
  nk = k.shape[1]
  group = n // nk
  if p.pack:  # [B, T, K*G, H] -> [B, T*G, K, H]: row t*G + g of kv head k is query head k*G + g
    q = q.reshape(b, t, nk, group, h).transpose(0, 1, 3, 2, 4).reshape(b, t * group, nk, h)
    q_len = q_len * group
  rows, heads = q.shape[1], q.shape[2]
  splits, chunk = p.splits, p.chunk
  # Sequence (b, c) of the rewritten call: the query rows of b again, and keys [lo + c*C, lo + (c+1)*C)
  # of b, cut at hi, in place: it starts at row k_base[b] + lo + c*C of the buffer, or at k_base[b] + hi
  # for an empty chunk, so the offsets never decrease and a chunk's used keys end where the next chunk
  # starts (the last one's inside b's slot).
  qs = jnp.broadcast_to(q[:, None], (b, splits) + q.shape[1:]).reshape(b * splits * rows, heads, h)
  cu_q = jnp.arange(b * splits + 1, dtype=jnp.int32) * rows
  lo, hi = lo.astype(jnp.int32)[:, None], hi.astype(jnp.int32)[:, None]
  c0 = lo + jnp.arange(splits, dtype=jnp.int32)[None, :] * chunk
  starts = k_base.astype(jnp.int32)[:, None] + jnp.minimum(c0, hi)
  cu_k = jnp.concatenate([starts.reshape(-1), jnp.full((1,), k.shape[0], jnp.int32)])
  used_q = jnp.repeat(q_len.astype(jnp.int32), splits)
  used_k = jnp.clip(hi - c0, 0, chunk).reshape(-1)
  call = dict(static, max_seqlen_q=rows, max_seqlen_k=chunk, causal=False, bottom_right=False,
              window_left=-1, window_right=-1, rows_covered=True)
  o, lse = packed_fn(qs, k, v, cu_q, cu_k, used_q, used_k, **call)
  # o [B*P*R, heads, H] -> [P, B, R, heads, H]; lse [heads, B*P*R] -> [P, B, R, heads].
  o = o.reshape(b, splits, rows, heads, o.shape[-1]).transpose(1, 0, 2, 3, 4)
  lse = lse.reshape(heads, b, splits, rows).transpose(2, 1, 3, 0)
  # Padded query rows report lse 0 from every chunk: for the merge they saw nothing.
  lse = jnp.where(_valid_rows(rows, q_len)[None, :, :, None], lse, _F32(-jnp.inf))
  o, lse = merge_partials(o, lse)
  if p.pack:  # [B, T*G, K, H] -> [B, T, K*G, H]; lse [B, T*G, K] -> [B, T, K*G]
    o = o.reshape(b, t, group, nk, o.shape[-1]).transpose(0, 1, 3, 2, 4).reshape(b, t, n, o.shape[-1])
    lse = lse.reshape(b, t, group, nk).transpose(0, 1, 3, 2).reshape(b, t, n)
  return o, lse


def _diagonal_partial(packed_fn, q, q_len, k, v, k_base, d0, kv_len, static):
  """Attention of the rows to the diagonal keys ``[d0, kv_len)`` of their sequence (causal, bottom-right:
  row t sees up to key kv_len - q_len + t, so in the diagonal's own coordinates the offset is its length
  minus q_len, which is what the kernels' bottom-right alignment computes); one kernel call, no packing
  (the mask depends on the row). ``(o [B, T, N, H] float32, lse [B, T, N])``, lse ``-inf`` where a row
  saw nothing."""
  b, t, n, h = q.shape
  cu_q = jnp.arange(b + 1, dtype=jnp.int32) * t
  starts = k_base.astype(jnp.int32) + d0.astype(jnp.int32)
  cu_k = jnp.concatenate([starts, jnp.full((1,), k.shape[0], jnp.int32)])
  call = dict(static, max_seqlen_q=t, max_seqlen_k=t, causal=True, bottom_right=True, window_left=-1,
              window_right=-1, rows_covered=True)
  o, lse = packed_fn(q.reshape(b * t, n, h), k, v, cu_q, cu_k, q_len.astype(jnp.int32),
                     (kv_len - d0).astype(jnp.int32), **call)
  lse = lse.reshape(n, b, t).transpose(1, 2, 0)
  lse = jnp.where(_valid_rows(t, q_len)[:, :, None], lse, _F32(-jnp.inf))
  return o.reshape(b, t, n, o.shape[-1]).astype(_F32), lse


def _plan_for(static, batch, rows, heads, kv_heads, keys):
  return plan(batch, rows, heads, kv_heads,
              visible_keys(keys, rows, static["causal"], static["window_left"], static["window_right"]))


def split_kv_to_runs(packed_fn):
  """A runs forward (``partitioning.packed_to_runs``'s signature, the problem's ``Runs``) that applies
  the plan; calls it leaves unchanged go to ``packed_to_runs(packed_fn)``.

  Only for calls that ``eligible`` accepted: one run per batch row, starting at row 0.
  """
  plain = partitioning.packed_to_runs(packed_fn)

  @functools.wraps(packed_fn)
  def padded(q, k, v, q_start, q_used, k_start, k_used, *sinks, **static):
    b, t, n, h = q.shape
    s, nk = k.shape[1], k.shape[2]
    p = _plan_for(static, b, t, n, nk, s)
    if not p.changes_call or q_used.shape[1] != 1:
      return plain(q, k, v, q_start, q_used, k_start, k_used, *sinks, **static)
    base = jnp.arange(b, dtype=jnp.int32) * s
    return _rewritten_call(packed_fn, p, q, jnp.clip(q_used[:, 0], 0, t), k.reshape(b * s, nk, h),
                           v.reshape(b * s, nk, v.shape[-1]), base, base + s, k_used[:, 0], static,
                           sinks[0] if sinks else None)

  return padded


def split_kv_packed(packed_fn):
  """A packed forward (``flash_forward``'s signature) that applies the plan to the packed layout: the
  query rows of each sequence (at most ``max_seqlen_q``) are gathered into a dense ``[B, max_seqlen_q]``
  block, and the results are scattered back (rows outside every sequence's used rows: exact zeros).
  Calls the plan leaves unchanged go to ``packed_fn`` itself."""

  @functools.wraps(packed_fn)
  def packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks=None, **static):
    total_q, n, h = q.shape
    nk = k.shape[1]
    b, rows = seqused_q.shape[0], int(static["max_seqlen_q"])
    p = _plan_for(static, b, rows, n, nk, int(static["max_seqlen_k"]))
    if not p.changes_call or b == 0 or total_q == 0:
      return packed_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, **static)
    cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
    q_len = jnp.clip(seqused_q, 0, jnp.minimum(cu_q[1:] - cu_q[:-1], rows))
    r = jnp.arange(rows, dtype=jnp.int32)[None, :]
    row_of = cu_q[:-1, None] + r  # [B, R]: where sequence b's row r lives in the packed buffer
    used = _valid_rows(rows, q_len)
    # Rows past a sequence's used rows are padding of the rewritten call: any in-bounds row will do.
    qd = q[jnp.clip(row_of, 0, total_q - 1)]
    o, lse = _rewritten_call(packed_fn, p, qd, q_len, k, v, cu_k[:-1], cu_k[1:], seqused_k, static, sinks)
    # Back to the packed rows: each used row once; the rest (and rows of no sequence) stay exactly 0.
    dest = jnp.where(used, row_of, total_q).reshape(-1)
    o_packed = jnp.zeros((total_q, n, o.shape[-1]), o.dtype).at[dest].set(
        o.reshape(b * rows, n, o.shape[-1]), mode="drop")
    lse_packed = jnp.zeros((n, total_q), jnp.float32).at[:, dest].set(
        lse.transpose(1, 0, 2).reshape(n, b * rows), mode="drop")
    return o_packed, lse_packed

  return packed
