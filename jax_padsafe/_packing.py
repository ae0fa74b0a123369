"""How the padded layout reaches the kernels, which only know the packed (varlen) layout.

The kernels take ``cu_seqlens`` (where each sequence starts) and ``seqused`` (how many of its rows
are valid). A padded batch ``[B, T, ...]`` is described per batch row by up to ``R`` *runs*:
``(start, used)`` pairs, start-sorted, of query rows and of key rows; run ``r`` of the query side
attends to run ``r`` of the key side and nothing else. Then

* lengths only (``query_seq_lengths``): one run per row, ``(0, q_len)`` and ``(0, kv_len)``;
* segment ids (sequence packing): one run per contiguous block of one non-negative id, paired with
  the key block of the same id (:func:`runs_from_segments`).

:func:`packed_view` turns runs into the kernels' arguments for rows flattened to ``[B*T, ...]``:
sequence ``b*R + r`` starts at row ``b*T + start``. Unused run slots start where the next run (or
the row) starts and have ``used = 0``, so ``cu_seqlens`` stays non-decreasing and
``cu_seqlens[i+1] - cu_seqlens[i] >= used[i]`` (the kernels cap ``used`` by that difference).
This module is the one place where the padded-to-packed mapping is written; the partitioned
kernel calls apply it to their shard-local batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

# Runs per batch row assumed for traced segment ids when the caller gives no bound (see
# ``dot_product_attention(max_segments=...)``). Rows with more runs take the pure-JAX path.
DEFAULT_TRACED_MAX_RUNS = 32


class Runs(NamedTuple):
  """Start-sorted runs per batch row, all int32 ``[B, R]``; run r of q pairs with run r of k."""
  q_start: jnp.ndarray
  q_used: jnp.ndarray
  k_start: jnp.ndarray
  k_used: jnp.ndarray


def runs_from_lengths(q_len, kv_len) -> Runs:
  """One run per batch row: rows ``[0, q_len)`` attend to keys ``[0, kv_len)``."""
  zero = jnp.zeros((q_len.shape[0], 1), jnp.int32)
  return Runs(zero, q_len.astype(jnp.int32)[:, None], zero, kv_len.astype(jnp.int32)[:, None])


def packed_view(runs: Runs, t: int, s: int):
  """``(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)`` for rows flattened to ``[B*T]``/``[B*S]``."""

  def offsets(start, rows):
    b = start.shape[0]
    flat = (jnp.arange(b, dtype=jnp.int32)[:, None] * rows + start.astype(jnp.int32)).reshape(-1)
    return jnp.concatenate([flat, jnp.full((1,), b * rows, jnp.int32)])

  return (offsets(runs.q_start, t), offsets(runs.k_start, s),
          runs.q_used.reshape(-1).astype(jnp.int32), runs.k_used.reshape(-1).astype(jnp.int32))


def count_runs(seg):
  """Runs of one non-negative id per batch row of canonical segments ``seg [B, T]`` (-1 = padding)."""
  prev = jnp.concatenate([jnp.full(seg.shape[:1] + (1,), -1, seg.dtype), seg[:, :-1]], axis=1)
  return ((seg >= 0) & (seg != prev)).sum(axis=1)


def runs_from_segments(q_seg, k_seg, q_pos, k_pos, *, max_runs: int, positional: bool,
                       bottom_right: bool):
  """Runs for canonical segments, and whether they describe the problem exactly.

  Args:
    q_seg, k_seg: int32 ``[B, T]`` / ``[B, S]`` canonical segments (-1 = padding).
    q_pos, k_pos: the canonical positions (alignment offset included).
    max_runs: static ``R``, the run slots per batch row.
    positional: whether causal/window masks are on (then positions must agree, see below).
    bottom_right: the kernels' alignment flag for this call.

  Returns:
    ``(runs, exact)``: ``exact`` (a bool scalar, traced or not) is True iff in every row (1) each
    non-negative query id forms one contiguous run and there are at most ``R`` runs, (2) the keys of
    each of those ids form one contiguous run (or none), in the same order as the query runs,
    and (3) with causal/window masks, the kernels' in-sequence offset (0, or ``k_used - q_used``
    for bottom-right alignment) equals the canonical position difference of the runs' first rows.
    When it is False the runs must not be used (the caller falls back to the pure-JAX path).
  """
  b, t = q_seg.shape
  s = k_seg.shape[1]
  r_slots = max(int(max_runs), 1)
  rows_q = jnp.arange(t, dtype=jnp.int32)
  prev = jnp.concatenate([jnp.full((b, 1), -1, q_seg.dtype), q_seg[:, :-1]], axis=1)
  is_start = (q_seg >= 0) & (q_seg != prev)
  n_runs = is_start.sum(axis=1)
  # Start rows of the runs, ascending; missing slots hold t (an empty run at the row's end).
  starts = jnp.sort(jnp.where(is_start, rows_q[None, :], t), axis=1)
  if t < r_slots:
    starts = jnp.pad(starts, ((0, 0), (0, r_slots - t)), constant_values=t)
  q_start = starts[:, :r_slots].astype(jnp.int32)
  slot = jnp.arange(r_slots, dtype=jnp.int32)[None, :]
  live = slot < n_runs[:, None]
  if t:
    run_id = jnp.where(live, jnp.take_along_axis(q_seg, jnp.minimum(q_start, t - 1), axis=1), -1)
  else:
    run_id = jnp.full((b, r_slots), -1, jnp.int32)
  # A run is the id's rows from its start up to the next start (rows in between are padding), so
  # its length is its rows counted by run index; the id is contiguous iff that is all its rows.
  run_index = jnp.cumsum(is_start, axis=1) - 1
  in_run = (run_index[:, :, None] == slot[:, None, :]) & (q_seg >= 0)[:, :, None]
  q_used = jnp.where(live, in_run.sum(axis=1), 0).astype(jnp.int32)
  q_total = (q_seg[:, None, :] == run_id[:, :, None]).sum(axis=2)
  exact = jnp.all(n_runs <= r_slots) & jnp.all(~live | (q_total == q_used))

  # Keys of each run's id: one contiguous block, in the query runs' order.
  k_match = (k_seg[:, None, :] == run_id[:, :, None]) & live[:, :, None]
  k_used = k_match.sum(axis=2).astype(jnp.int32)
  has_keys = k_used > 0
  k_first = jnp.argmax(k_match, axis=2).astype(jnp.int32)
  k_last = (s - 1 - jnp.argmax(k_match[:, :, ::-1], axis=2)).astype(jnp.int32)
  exact &= jnp.all(~has_keys | (k_last - k_first + 1 == k_used))
  # Slots without keys start where the next keyed run starts, which keeps the offsets monotone.
  k_start = lax.cummin(jnp.where(has_keys, k_first, s), axis=1, reverse=True).astype(jnp.int32)
  k_next = jnp.concatenate([k_start[:, 1:], jnp.full((b, 1), s, jnp.int32)], axis=1)
  exact &= jnp.all(~has_keys | ((k_start == k_first) & (k_next >= k_first + k_used)))

  if positional and t and s:
    # Canonical visibility compares q_pos - k_pos; the kernels compare in-sequence indices plus
    # their offset. They agree iff the offset equals the position difference of the first rows.
    dq = jnp.take_along_axis(q_pos, jnp.minimum(q_start, t - 1), axis=1)
    dk = jnp.take_along_axis(k_pos, jnp.minimum(k_first, s - 1), axis=1)
    kernel_off = (k_used - q_used) if bottom_right else jnp.zeros_like(k_used)
    exact &= jnp.all(~(live & has_keys & (q_used > 0)) | (dq - dk == kernel_off))
  return Runs(q_start, q_used, k_start, k_used), exact
