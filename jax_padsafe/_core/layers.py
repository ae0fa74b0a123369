"""Framework-free helpers shared by the Flax (linen, NNX) and Equinox layers: valid-row masks,
row selection, positions from segment ids, rotary embeddings, the dropout check.

Nothing here imports Flax or Equinox, nor the API above it: the layers call
:func:`jax_padsafe.attention.attend` (attention over any number of batch dimensions) themselves.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_padsafe._core import visibility


def valid_rows(batch_shape, length, lengths=None, segment_ids=None):
  """Boolean ``[batch..., length]``: rows before ``lengths`` with a non-negative segment id.

  ``None`` when neither is given (every row valid). Mirrors the contract's rule for padding.
  """
  if lengths is None and segment_ids is None:
    return None
  rows = jnp.arange(length, dtype=jnp.int32)
  valid = jnp.ones(tuple(batch_shape) + (length,), bool)
  if lengths is not None:
    lengths = jnp.broadcast_to(jnp.asarray(lengths), tuple(batch_shape))
    valid = valid & (rows < lengths[..., None])
  if segment_ids is not None:
    valid = valid & visibility.row_is_valid(jnp.broadcast_to(jnp.asarray(segment_ids), valid.shape))
  return valid


def select_rows(x, valid):
  """``x`` (``[batch..., length, features...]``) with invalid rows replaced by exact zeros.

  A select, never a multiply, so NaN/Inf in padded rows cannot leak (0 * NaN = NaN), and the
  gradient routed to padded rows is exactly zero.
  """
  if valid is None:
    return x
  return visibility.select_rows(x, valid)


def positions_from_segments(segment_ids):
  """Position of each row within its segment (rows of a segment must be contiguous).

  ``[..., T]`` int32: 0 at the first row of every run of equal ids, counting up within the run.
  """
  ids = jnp.asarray(segment_ids)
  t = ids.shape[-1]
  rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), ids.shape)
  prev = jnp.concatenate([jnp.full(ids.shape[:-1] + (1,), -2, ids.dtype), ids[..., :-1]], axis=-1)
  starts = jnp.where(ids != prev, rows, 0)
  starts = lax.cummax(starts, axis=ids.ndim - 1)
  return rows - starts


def apply_rope(x, positions, *, theta: float = 10000.0):
  """Rotary position embedding (the "rotate half" form used by GPT-NeoX and Llama).

  Args:
    x: ``[batch..., T, heads, head_dim]`` with an even ``head_dim``.
    positions: int ``[batch..., T]`` (broadcastable), the position of every row.
    theta: the base of the frequencies.

  The rotation is computed in float32 and cast back to ``x.dtype``; NaN in a padded row of ``x``
  stays in that row (rows are rotated independently).
  """
  h = x.shape[-1]
  if h % 2:
    raise ValueError(f"apply_rope needs an even head_dim, got {h}")
  half = h // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / h)
  pos = jnp.asarray(positions, jnp.float32)
  angles = pos[..., None, None] * freqs  # [batch..., T, 1, half]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def check_no_dropout(dropout_rate, deterministic, where):
  """Attention-weight dropout cannot be done honestly without forming the weights; refuse it."""
  if dropout_rate and dropout_rate > 0.0 and not deterministic:
    raise NotImplementedError(
        f"{where}: dropout on the attention weights (dropout_rate={dropout_rate}) is not "
        "supported: flash attention never forms the weight matrix. Use dropout_rate=0.0, or run "
        "deterministically (deterministic=True / inference=True), or apply dropout to the "
        "attention output instead.")

