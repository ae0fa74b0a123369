"""Framework-free helpers shared by the Flax (linen, NNX) and Equinox layers.

Nothing here imports Flax or Equinox. The layers accept the frameworks' ``[batch..., length, heads,
head_dim]`` layouts (any number of leading batch dimensions, including none); these helpers fold the
batch dimensions into one, call :func:`jax_padsafe.dot_product_attention`, and unfold the result.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_padsafe._core import checks
from jax_padsafe._core import visibility
from jax_padsafe.attention import dot_product_attention

#: Options of :func:`jax_padsafe.dot_product_attention` that the layers forward unchanged.
ATTENTION_OPTIONS = ("scale", "is_causal", "causal_alignment", "local_window_size", "softcap",
                     "implementation")


def _fold(x, batch_shape, trailing):
  """``x`` broadcast to ``batch_shape + trailing`` and folded to ``[prod(batch), *trailing]``."""
  x = jnp.asarray(x)
  x = jnp.broadcast_to(x, tuple(batch_shape) + tuple(trailing))
  return x.reshape((math.prod(batch_shape),) + tuple(trailing))


def _fold_pairwise(name, x, batch_shape):
  """A mask or bias broadcastable to ``[batch..., N, T, S]`` folded to ``[B', n, t, s]``."""
  x = jnp.asarray(x)
  want = len(batch_shape) + 3
  if x.ndim > want:
    raise ValueError(f"{name} of shape {x.shape} has more dimensions than "
                     f"[batch..., heads, q_length, kv_length] = {want}")
  x = x.reshape((1,) * (want - x.ndim) + x.shape)
  return _fold(x, batch_shape, x.shape[len(batch_shape):])


def attend(query, key, value, *, bias=None, mask=None, query_seq_lengths=None,
           key_value_seq_lengths=None, query_segment_ids=None, key_value_segment_ids=None,
           **options):
  """:func:`dot_product_attention` on ``[batch..., T, N, H]`` inputs with any number of batch dims.

  Lengths broadcast to ``batch...``; segment ids to ``[batch..., T]`` / ``[batch..., S]``; ``mask``
  and ``bias`` to ``[batch..., N, T, S]`` (the Flax convention).
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  if query.ndim < 3:
    raise ValueError(f"query must be [batch..., length, heads, head_dim], got shape {query.shape}")
  if key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError(f"query, key and value must have the same rank, got {query.shape}, "
                     f"{key.shape}, {value.shape}")
  batch_shape = query.shape[:-3]
  if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
    raise ValueError(f"query, key and value batch dims differ: {query.shape}, {key.shape}, "
                     f"{value.shape}")
  t, s = query.shape[-3], key.shape[-3]
  fq, fk, fv = (_fold(x, batch_shape, x.shape[-3:]) for x in (query, key, value))
  kw = dict(options)
  if query_seq_lengths is not None:
    kw["query_seq_lengths"] = _fold(query_seq_lengths, batch_shape, ())
  if key_value_seq_lengths is not None:
    kw["key_value_seq_lengths"] = _fold(key_value_seq_lengths, batch_shape, ())
  if query_segment_ids is not None:
    kw["query_segment_ids"] = _fold(query_segment_ids, batch_shape, (t,))
  if key_value_segment_ids is not None:
    kw["key_value_segment_ids"] = _fold(key_value_segment_ids, batch_shape, (s,))
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:  # Flax builds float masks (nn.make_causal_mask): nonzero = attend
      mask = mask != 0
    kw["mask"] = _fold_pairwise("mask", mask, batch_shape)
  if bias is not None:
    kw["bias"] = _fold_pairwise("bias", bias, batch_shape)
  if "query_seq_lengths" in kw:
    checks.check_lengths_in_range("query_seq_lengths", kw["query_seq_lengths"], t)
  if "key_value_seq_lengths" in kw:
    checks.check_lengths_in_range("key_value_seq_lengths", kw["key_value_seq_lengths"], s)
  static = {name: kw.pop(name) for name in ATTENTION_OPTIONS if name in kw}
  try:
    hash(tuple(static.items()))
  except TypeError:  # a traced scale/softcap: call directly
    out = dot_product_attention(fq, fk, fv, **kw, **static)
  else:
    # One compiled function per configuration: an eager call otherwise dispatches (and compiles)
    # every operation of the blockwise loop separately, which is slow outside jit.
    out = _dot_product_attention_jit(fq, fk, fv, **kw, **static)
  return out.reshape(tuple(batch_shape) + out.shape[1:])


_dot_product_attention_jit = jax.jit(dot_product_attention, static_argnames=ATTENTION_OPTIONS)


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

