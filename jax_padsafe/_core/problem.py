"""The canonical problem: every layout reduced once to the rows that attend to each other.

:func:`from_padded` (lengths and/or segment ids on ``[B, T]`` / ``[B, S]``) and :func:`from_packed`
(``cu_seqlens`` / ``seqused`` on ``[total, ...]``, seen as a batch of one) build one
:class:`Problem`. It carries two views of the same rows:

* **per row** (the pure-JAX path, the ring, the visibility rule): int32 *segments*
  ``q_seg [B, T]`` / ``k_seg [B, S]``, ``-1`` for a padded row, else the sequence the row belongs to;
  and *positions* ``q_pos`` / ``k_pos``, the coordinates the causal and window masks compare (query
  positions include the alignment offset, ``kv_len - q_len`` for bottom-right);
* **for the kernels**, which only know the packed layout's ``cu_seqlens`` (where each sequence
  starts) and ``seqused`` (how many of its rows are valid): the packed layout's own arguments
  (:class:`SeqLens`), or, for the padded layout, up to ``R`` *runs* per batch row (:class:`Runs`):
  ``(start, used)`` pairs, start-sorted, of query rows and of key rows; run ``r`` of the query side
  attends to run ``r`` of the key side and nothing else. Lengths give one run per row,
  ``(0, q_len)`` and ``(0, kv_len)``; segment ids one run per contiguous block of one non-negative
  id, paired with the key block of the same id (:func:`runs_from_segments`).

Runs stay per batch row so that a batch-sharded kernel call can turn them into ``cu_seqlens`` for
its local shard (:func:`packed_view`, inside the partitioned call): sequence ``b*R + r`` starts at
row ``b*T + start``. Unused run slots start where the next run (or the row) starts and have
``used = 0``, so ``cu_seqlens`` stays non-decreasing and ``cu_seqlens[i+1] - cu_seqlens[i] >=
used[i]`` (the kernels cap ``used`` by that difference).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from jax_padsafe._core import checks
from jax_padsafe._core import visibility
from jax_padsafe._core.spec import AttentionSpec

# Runs per batch row assumed for traced segment ids when the caller gives no bound (see
# ``dot_product_attention(max_segments=...)``). Rows with more runs take the pure-JAX path.
DEFAULT_TRACED_MAX_RUNS = 32


class Runs(NamedTuple):
  """Start-sorted runs per batch row, all int32 ``[B, R]``; run r of q pairs with run r of k."""
  q_start: jax.Array
  q_used: jax.Array
  k_start: jax.Array
  k_used: jax.Array


class SeqLens(NamedTuple):
  """The kernels' own arguments: int32 offsets ``[B+1]`` and used rows ``[B]`` per sequence."""
  cu_seqlens_q: jax.Array
  cu_seqlens_k: jax.Array
  seqused_q: jax.Array
  seqused_k: jax.Array


LAYOUTS = ("lengths", "segments", "packed")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q_seg", "k_seg", "q_pos", "k_pos", "kernel", "runs_exact"],
    meta_fields=["layout", "max_seqlen_q", "max_seqlen_k", "unsupported"])
@dataclasses.dataclass(frozen=True)
class Problem:
  """The rows of one attention call (a pytree: arrays are leaves, the rest is static).

  Attributes:
    q_seg, k_seg: int32 ``[B, T]`` / ``[B, S]`` segments, ``-1`` = padding.
    q_pos, k_pos: int32 positions compared by the causal and window masks.
    kernel: the kernels' view: :class:`Runs` (padded layout), :class:`SeqLens` (packed layout), or
      ``None`` when no kernel will run (``implementation="xla"``, building blocks).
    runs_exact: for traced segment ids, a bool scalar: whether ``kernel`` describes the layout
      exactly (a run-time choice between the kernels and the pure-JAX path); else ``None``.
    layout: ``"lengths"`` (one run per batch row from row 0: the kernels' tiles cover every row),
      ``"segments"`` or ``"packed"`` (``B == 1`` holding every sequence).
    max_seqlen_q, max_seqlen_k: static bounds on the sequence lengths (the kernels' grid).
    unsupported: why the kernels cannot express this layout (concrete segment ids), else ``None``.
  """
  q_seg: jax.Array
  k_seg: jax.Array
  q_pos: jax.Array
  k_pos: jax.Array
  kernel: Runs | SeqLens | None = None
  runs_exact: jax.Array | None = None
  layout: str = "segments"
  max_seqlen_q: int = 0
  max_seqlen_k: int = 0
  unsupported: str | None = None

  @property
  def packed(self) -> bool:
    return self.layout == "packed"

  @property
  def dense_rows(self) -> bool:
    """Batch row b owns query rows [b*T, (b+1)*T) and key rows [b*S, (b+1)*S) as one sequence (the
    lengths layout): the kernels' tiles cover every row, and kernels that write their tiles' padded
    rows as zeros need no memset of o/dq/dk/dv first."""
    return self.layout == "lengths"

  def rows(self):
    """The per-row view ``(q_seg, k_seg, q_pos, k_pos)``."""
    return self.q_seg, self.k_seg, self.q_pos, self.k_pos


# --------------------------------------------------------------------------------------------------
# Padded layout: lengths and segment ids on [B, T] / [B, S]
# --------------------------------------------------------------------------------------------------

def row_segments(rows, lengths, ids):
  """Row segment: ``-1`` past the length or where the id is negative, else the id (or 0)."""
  valid = rows < lengths[:, None]
  if ids is None:
    return jnp.where(valid, 0, -1).astype(jnp.int32)
  return jnp.where(valid & (ids >= 0), ids, -1).astype(jnp.int32)


def padded_rows(b, t, s, alignment, q_lengths, kv_lengths, q_ids, kv_ids, *, rows_q=None,
                rows_k=None):
  """Checked lengths and the per-row view of the padded layout: ``(q_len, kv_len, q_seg, k_seg,
  q_pos, k_pos)``. ``rows_q`` / ``rows_k`` (``[1, T]`` / ``[1, S]``): the natural position of every
  row (default: its index; the ring's zigzag layout permutes them). Lengths count natural positions."""
  q_len = checks.lengths("query_seq_lengths", q_lengths, b, t)
  kv_len = checks.lengths("key_value_seq_lengths", kv_lengths, b, s)
  q_ids = checks.segment_ids("query_segment_ids", q_ids, (b, t))
  kv_ids = checks.segment_ids("key_value_segment_ids", kv_ids, (b, s))
  rows_q = jnp.arange(t, dtype=jnp.int32)[None, :] if rows_q is None else rows_q
  rows_k = jnp.arange(s, dtype=jnp.int32)[None, :] if rows_k is None else rows_k
  q_seg = row_segments(rows_q, q_len, q_ids)
  k_seg = row_segments(rows_k, kv_len, kv_ids)
  offset = (kv_len - q_len) if alignment == "bottom_right" else jnp.zeros_like(q_len)
  q_pos = jnp.broadcast_to(rows_q + offset[:, None], (b, t)).astype(jnp.int32)
  k_pos = jnp.broadcast_to(rows_k, (b, s)).astype(jnp.int32)
  return q_len, kv_len, q_seg, k_seg, q_pos, k_pos


def from_padded(spec: AttentionSpec, b, t, s, alignment, q_lengths, kv_lengths, q_ids, kv_ids, *,
                kernel_view: bool = True, max_segments=None, positions=(None, None)) -> Problem:
  """The problem of the padded layout (see the module docstring).

  ``kernel_view=False`` leaves ``kernel`` empty (``implementation="xla"``, and the ring, which maps
  its chunk pairs to runs on each device). Concrete segment ids are mapped to runs while tracing, so
  that a layout the kernels cannot express is known now (``unsupported``); traced ones leave the
  choice to a run-time predicate (``runs_exact``). ``positions``: the natural positions of the rows
  (``rows_q``, ``rows_k`` of :func:`padded_rows`).
  """
  raw = (q_lengths, kv_lengths, q_ids, kv_ids)
  rows = functools.partial(padded_rows, b, t, s, alignment, *raw, rows_q=positions[0],
                           rows_k=positions[1])
  q_len, kv_len, q_seg, k_seg, q_pos, k_pos = rows()
  layout = "lengths" if q_ids is None else "segments"
  kernel = exact = reason = None
  if kernel_view and q_ids is None:
    kernel = runs_from_lengths(q_len, kv_len)
  elif kernel_view:
    if all(x is None or checks.is_concrete(x) for x in raw):
      # Under an outer jit the rows above are traced even for concrete ids: map them eagerly.
      with jax.ensure_compile_time_eval():
        kernel, exact, reason = _segment_runs(spec, *rows()[2:], max_segments)
    else:
      kernel, exact, reason = _segment_runs(spec, q_seg, k_seg, q_pos, k_pos, max_segments)
  return Problem(q_seg, k_seg, q_pos, k_pos, kernel, exact, layout=layout, max_seqlen_q=t,
                 max_seqlen_k=s, unsupported=reason)


def _segment_runs(spec, q_seg, k_seg, q_pos, k_pos, max_segments):
  """``(runs, runs_exact, reason)`` for segment ids: ``reason`` is a sentence when concrete ids
  cannot run on the kernels; ``runs_exact`` is the run-time predicate for traced ids, else None."""
  concrete = checks.is_concrete(q_seg) and checks.is_concrete(k_seg)
  max_runs = checks.max_segments(max_segments)
  if max_runs is None and concrete:  # the next power of two of the runs counted, to share compilations
    max_runs = 1 << max(int(np.max(np.asarray(count_runs(q_seg)), initial=1)) - 1, 0).bit_length()
  elif max_runs is None:
    max_runs = DEFAULT_TRACED_MAX_RUNS
  max_runs = max(1, min(max_runs, q_seg.shape[1]))
  runs, exact = runs_from_segments(
      q_seg, k_seg, q_pos, k_pos, max_runs=max_runs,
      positional=spec.causal or spec.has_window, bottom_right=spec.bottom_right)
  if concrete and checks.is_concrete(exact):
    if not bool(exact):
      return runs, None, (
          "these segment ids are not contiguous runs that the kernels can express (each "
          f"non-negative id one run of rows per batch row on both sides, at most {max_runs} runs, "
          "key runs in the query runs' order, and with causal/window masks runs of one id "
          "starting at the same position; see `max_segments`)")
    return runs, None, None
  return runs, exact, None


# --------------------------------------------------------------------------------------------------
# Packed layout: cu_seqlens / seqused on [total, ...]
# --------------------------------------------------------------------------------------------------

def from_packed(cu_q, cu_k, used_q, used_k, total_q, total_k, *, max_seqlen_q: int,
                max_seqlen_k: int, alignment: str) -> Problem:
  """The problem of ``varlen_attention`` (checked offsets and used rows) as a batch of one."""
  offset = (used_k - used_q) if alignment == "bottom_right" else jnp.zeros_like(used_q)
  q_seg, q_pos = packed_rows(cu_q, used_q, total_q, offset)
  k_seg, k_pos = packed_rows(cu_k, used_k, total_k, jnp.zeros_like(used_k))
  return Problem(q_seg[None], k_seg[None], q_pos[None], k_pos[None],
                 SeqLens(cu_q, cu_k, used_q, used_k), layout="packed", max_seqlen_q=max_seqlen_q,
                 max_seqlen_k=max_seqlen_k)


def packed_rows(cu, used, total, offset):
  """Segment and position of every packed row; rows outside ``[cu[b], cu[b]+used[b])`` get -1."""
  nseq = cu.shape[0] - 1
  rows = jnp.arange(total, dtype=jnp.int32)
  if nseq == 0:
    return jnp.full((total,), -1, jnp.int32), jnp.zeros((total,), jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu, rows, side="right").astype(jnp.int32) - 1, 0, nseq - 1)
  local = rows - cu[seq]
  valid = (rows >= cu[0]) & (rows < cu[-1]) & (local >= 0) & (local < used[seq])
  seg = jnp.where(valid, seq, -1).astype(jnp.int32)
  pos = jnp.where(valid, local + offset[seq], 0).astype(jnp.int32)
  return seg, pos


# --------------------------------------------------------------------------------------------------
# Runs: the padded layout as the kernels' sequences
# --------------------------------------------------------------------------------------------------

def runs_from_lengths(q_len, kv_len) -> Runs:
  """One run per batch row: rows ``[0, q_len)`` attend to keys ``[0, kv_len)``."""
  zero = jnp.zeros((q_len.shape[0], 1), jnp.int32)
  return Runs(zero, q_len.astype(jnp.int32)[:, None], zero, kv_len.astype(jnp.int32)[:, None])


def packed_view(runs: Runs, t: int, s: int) -> SeqLens:
  """The kernels' arguments for runs of rows flattened to ``[B*T]`` / ``[B*S]``."""

  def offsets(start, rows):
    b = start.shape[0]
    flat = (jnp.arange(b, dtype=jnp.int32)[:, None] * rows + start.astype(jnp.int32)).reshape(-1)
    return jnp.concatenate([flat, jnp.full((1,), b * rows, jnp.int32)])

  return SeqLens(offsets(runs.q_start, t), offsets(runs.k_start, s),
                 runs.q_used.reshape(-1).astype(jnp.int32), runs.k_used.reshape(-1).astype(jnp.int32))


def count_runs(seg):
  """Runs of one non-negative id per batch row of canonical segments ``seg [B, T]`` (-1 = padding)."""
  prev = jnp.concatenate([jnp.full(seg.shape[:1] + (1,), -1, seg.dtype), seg[:, :-1]], axis=1)
  return (visibility.row_is_valid(seg) & (seg != prev)).sum(axis=1)


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
  is_start = visibility.row_is_valid(q_seg) & (q_seg != prev)
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
  in_run = (run_index[:, :, None] == slot[:, None, :]) & visibility.row_is_valid(q_seg)[:, :, None]
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
