"""The visibility rule of the pad-safety contract, written once.

All masking in the pure-JAX path goes through :func:`visible` and is applied with ``jnp.where``
(a select): a masked logit is replaced, never multiplied by zero, so a NaN that sits behind a mask
cannot leak (``0 * NaN = NaN`` but ``where(False, NaN, 0) = 0``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_padsafe._spec import AttentionSpec


def row_is_valid(seg):
  """A row takes part in attention iff its segment id is non-negative."""
  return seg >= 0


def visible(spec: AttentionSpec, q_seg, k_seg, q_pos, k_pos):
  """Boolean ``[..., T, S]`` visibility from per-row segment ids and positions.

  ``q_seg``/``q_pos`` have shape ``[B, T]``; ``k_seg``/``k_pos`` have shape ``[B, S]``. The result
  has shape ``[B, T, S]``.
  """
  qs = q_seg[:, :, None]
  ks = k_seg[:, None, :]
  vis = (qs >= 0) & (ks >= 0) & (qs == ks)
  qp = q_pos[:, :, None]
  kp = k_pos[:, None, :]
  if spec.causal:
    vis &= kp <= qp
  if spec.window_left is not None:
    vis &= kp >= qp - spec.window_left
  if spec.window_right is not None:
    vis &= kp <= qp + spec.window_right
  return vis


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
