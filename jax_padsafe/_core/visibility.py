"""The visibility rule of the pad-safety contract, written once.

Key ``j`` is visible to query ``i`` iff both rows are valid (segment ``>= 0``), their segments
match, and the causal/window predicates on their positions hold (:func:`positions_visible`); the
pure-JAX path further applies the optional boolean ``mask`` and hides keys where ``bias`` is
``-inf``. Every use in the library goes through this module: the pure-JAX blocks
(:func:`visible`), the ring's test for chunk pairs that can be skipped (:func:`may_see`), and the
sanitising selects.

Masks are applied with ``jnp.where`` (a select): a masked logit is replaced, never multiplied by
zero, so a NaN that sits behind a mask cannot leak (``0 * NaN = NaN`` but
``where(False, NaN, 0) = 0``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_padsafe._core.spec import AttentionSpec


def row_is_valid(seg):
  """A row takes part in attention iff its segment id is non-negative."""
  return seg >= 0


def positions_visible(spec: AttentionSpec, q_pos, k_pos, *, upper=True, lower=True, cap=None):
  """The causal and window predicates on positions (broadcasting), ``True`` where they hold.

  ``upper``: the bounds above the query (causal ``k <= q``, right window ``k <= q + right``);
  ``lower``: the left window ``k >= q - left``. ``cap`` bounds the window sizes (callers that compare
  sentinel positions use it to keep the int32 arithmetic from overflowing).
  """
  size = (lambda w: w) if cap is None else (lambda w: min(w, cap))
  vis = True
  if upper and spec.causal:
    vis &= k_pos <= q_pos
  if lower and spec.window_left is not None:
    vis &= k_pos >= q_pos - size(spec.window_left)
  if upper and spec.window_right is not None:
    vis &= k_pos <= q_pos + size(spec.window_right)
  return vis


def visible(spec: AttentionSpec, q_seg, k_seg, q_pos, k_pos):
  """Boolean ``[B, T, S]`` visibility from per-row segments ``[B, T]`` / ``[B, S]`` and positions."""
  qs = q_seg[:, :, None]
  ks = k_seg[:, None, :]
  vis = row_is_valid(qs) & row_is_valid(ks) & (qs == ks)
  return vis & positions_visible(spec, q_pos[:, :, None], k_pos[:, None, :])


def may_see(spec: AttentionSpec, q_seg, q_pos, k_seg, k_pos, *, big: int):
  """Scalar bool: False only if no (query, key) pair of these row blocks can be visible.

  Conservative (ranges over the whole block, batch included): a True block may still be fully
  masked. Computed from segments and positions only, so it never depends on what padded memory
  holds. ``big`` bounds positions and window sizes (no int32 overflow).
  """
  qv, kv = row_is_valid(q_seg), row_is_valid(k_seg)
  cap, big = int(big), jnp.int32(big)
  qmin = jnp.min(jnp.where(qv, q_pos, big))
  qmax = jnp.max(jnp.where(qv, q_pos, -big))
  kmin = jnp.min(jnp.where(kv, k_pos, big))
  kmax = jnp.max(jnp.where(kv, k_pos, -big))
  ok = jnp.any(qv) & jnp.any(kv)
  # The rule's upper bounds are easiest met by the latest query and the earliest key, its lower
  # bound by the earliest query and the latest key.
  ok &= positions_visible(spec, qmax, kmin, lower=False, cap=cap)
  ok &= positions_visible(spec, qmin, kmax, upper=False, cap=cap)
  # Segments: the id ranges of the two blocks must overlap.
  ok &= jnp.max(jnp.where(qv, q_seg, -1)) >= jnp.min(jnp.where(kv, k_seg, big))
  ok &= jnp.max(jnp.where(kv, k_seg, -1)) >= jnp.min(jnp.where(qv, q_seg, big))
  return ok


def select_rows(x, valid):
  """``x [batch..., L, features...]`` with rows where ``valid [batch..., L]`` is False replaced by
  exact zeros: a select, so NaN/Inf there cannot leak and the gradient routed to them is 0."""
  valid = valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim))
  return jnp.where(valid, x, jnp.zeros((), x.dtype))


def zero_invalid_rows(x, seg):
  """Replace rows of ``x [B, L, ...]`` whose segment is negative by exact zeros (a select)."""
  return select_rows(x, row_is_valid(seg))


def zero_padded_inputs(q, k, v, q_seg, k_seg):
  """``(q, k, v)`` with their padded rows replaced by exact zeros: what the pure-JAX path needs
  before any arithmetic (it computes on whole blocks, padded rows included)."""
  return (zero_invalid_rows(q, q_seg), zero_invalid_rows(k, k_seg), zero_invalid_rows(v, k_seg))
