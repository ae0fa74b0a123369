"""Argument checking: every bad input becomes a ``ValueError``/``TypeError`` at trace time that names
the argument and what was expected (never a crash, a hang or a silent wrong answer).

The checks of every public entry point live here; :mod:`jax_padsafe._core.problem` calls the ones
for lengths, segment ids and offsets while it builds the canonical problem.
"""

from __future__ import annotations

import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from jax_padsafe._core.spec import AttentionSpec

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
IMPLEMENTATIONS = (None, "xla", "cute")
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def check_implementation(implementation):
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def check_flags(**flags):
  """Static switches must be Python bools: a traced or string value would be taken as truthy silently."""
  for name, value in flags.items():
    if not isinstance(value, (bool, np.bool_)):
      raise TypeError(f"{name} must be a Python bool, got {type(value).__name__} {value!r}")


def check_alignment(causal_alignment):
  if causal_alignment not in CAUSAL_ALIGNMENTS:
    raise ValueError(
        f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")


def check_float_inputs(query, key, value, *, rank: int, layout: str):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != rank:
      raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {x.shape}")
    if x.dtype not in SUPPORTED_DTYPES:
      raise TypeError(
          f"{name} dtype must be one of bfloat16, float16, float32, got {x.dtype}")
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError(
        f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
  if key.shape[:-1] != value.shape[:-1]:
    raise ValueError(f"value shape {value.shape} must equal key shape {key.shape} but in the last "
                     "dimension (value's head dim may differ)")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(
        f"query head dim {query.shape[-1]} must equal key head dim {key.shape[-1]}")
  if query.shape[-1] == 0 or value.shape[-1] == 0:
    raise ValueError(f"head dims must be positive, got {query.shape[-1]} (query/key) and "
                     f"{value.shape[-1]} (value)")
  n, k = query.shape[-2], key.shape[-2]
  if k == 0 or n % k != 0:
    raise ValueError(
        f"number of query heads ({n}) must be a positive multiple of the number of key/value "
        f"heads ({k})")


def normalize_window(local_window_size):
  """``None | int | (left, right)`` -> ``(left, right)`` with ``None`` for an unbounded side."""
  if local_window_size is None:
    return None, None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    left = right = int(local_window_size)
  elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
    left, right = local_window_size
    for side in (left, right):  # a float would be truncated and a bool taken as 0 / 1: neither is a size
      if side is not None and (not isinstance(side, (int, np.integer)) or isinstance(side, (bool, np.bool_))):
        raise ValueError("local_window_size sides must be ints or None (a negative or None side is "
                         f"unbounded), got {local_window_size!r}")
    left = None if left is None or left < 0 else int(left)
    right = None if right is None or right < 0 else int(right)
    return _unbounded_past_int32(left), _unbounded_past_int32(right)
  else:
    raise ValueError(
        "local_window_size must be None, an int, or a (left, right) pair of ints "
        f"(a negative or None side is unbounded), got {local_window_size!r}")
  if left < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size}")
  return _unbounded_past_int32(left), _unbounded_past_int32(right)


def _unbounded_past_int32(side):
  """A window side of 2**31 - 1 or more reaches past every int32 position: exactly an unbounded side
  (and the kernels take int32 window sizes)."""
  return None if side is not None and side >= 2 ** 31 - 1 else side


def check_scalar(name, value, *, positive=False):
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python float (static), got {value!r}")
  try:
    value = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(f"{name} must be a Python float (static), got {value!r}") from e
  if not np.isfinite(value) or (positive and value <= 0):
    raise ValueError(f"{name} must be a finite{' positive' if positive else ''} number, got {value}")
  return value


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def int_vector(name, x, length: int | None, *, what: str):
  """Checks an integer vector argument (lengths, cu_seqlens); returns it as int32."""
  if not isinstance(x, jax.Array):
    try:
      x = np.asarray(x)  # checked before jnp: a 64-bit value past int32 would otherwise wrap silently
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      x = jnp.asarray(x)  # a sequence holding traced scalars
  if x.ndim != 1 or (length is not None and x.shape[0] != length):
    expected = f"[{length}]" if length is not None else "rank 1"
    raise ValueError(f"{name} must have shape {expected} ({what}), got {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {x.dtype}")
  if jnp.iinfo(x.dtype).max >= 2 ** 31 and is_concrete(x) and x.size:  # 64-bit, or unsigned 32-bit
    arr = np.asarray(x)
    if arr.min() < -2 ** 31 or arr.max() >= 2 ** 31:
      raise ValueError(f"{name} must fit in int32 ({what}), got values in [{arr.min()}, {arr.max()}]")
  return jnp.asarray(x).astype(jnp.int32)


def check_lengths_in_range(name, lengths, upper: int):
  """Concrete lengths outside ``[0, upper]`` raise; traced ones are clamped by the caller."""
  if lengths is None or not is_concrete(lengths):
    return
  arr = np.asarray(lengths)
  if arr.size and (arr.min() < 0 or arr.max() > upper):
    raise ValueError(f"{name} must lie in [0, {upper}], got {arr.tolist()}")


def broadcastable_4d(name, x, target, *, bool_dtype: bool, num_kv_heads: int | None = None):
  """``bias``/``mask`` must be rank 4 (or rank 3 for unbatched inputs) and broadcast to ``target`` ``[B, N, T,
  S]``; with ``num_kv_heads`` its head dimension may also be ``K``, one entry per key/value head shared by that
  head's group of query heads."""
  x = jnp.asarray(x)
  if bool_dtype and x.dtype != jnp.bool_:
    raise TypeError(f"{name} must be a boolean array (True = attend), got {x.dtype}")
  if not bool_dtype and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating array, got {x.dtype}")
  if x.ndim != 4:
    raise ValueError(f"{name} must have rank 4 broadcastable to [B, N, T, S] = {target}, got {x.shape}")
  for axis, (have, want) in enumerate(zip(x.shape, target)):
    if have in (1, want) or (axis == 1 and have == num_kv_heads):
      continue
    per_group = "" if num_kv_heads is None else f" (its head dimension may also be K = {num_kv_heads})"
    raise ValueError(f"{name} of shape {x.shape} does not broadcast to [B, N, T, S] = {target}{per_group}")
  return x


def default_scale(head_dim: int) -> float:
  return 1.0 / math.sqrt(head_dim)


def make_spec(head_dim, scale, is_causal, local_window_size, softcap, block_k, *, bottom_right=False,
              deterministic=True, sinks=False, alibi=False) -> AttentionSpec:
  """The checked static options of one call."""
  scale = check_scalar("scale", scale)
  if scale is None:
    scale = default_scale(head_dim)
  # softcap=0 means "no softcap" (FlashAttention's convention); negative values are rejected.
  if softcap is not None and not isinstance(softcap, jax.core.Tracer) and softcap == 0:
    softcap = None
  softcap = check_scalar("softcap", softcap, positive=True)
  left, right = normalize_window(local_window_size)
  if not isinstance(block_k, (int, np.integer)) or isinstance(block_k, (bool, np.bool_)) or block_k <= 0:
    raise ValueError(f"block_k must be a positive int, got {block_k!r}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
  return AttentionSpec(scale=scale, causal=bool(is_causal), window_left=left, window_right=right,
                       softcap=softcap, block_k=int(block_k), bottom_right=bool(bottom_right),
                       deterministic=bool(deterministic), sinks=bool(sinks), alibi=bool(alibi))


def sinks(value, num_heads):
  """``sinks``: one float logit per query head, ``[N]``, as float32 (or ``None``). Differentiable: the
  cast is an ordinary JAX op, so a bfloat16 parameter gets its gradient back in bfloat16."""
  if value is None:
    return None
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"sinks must be a floating array (one logit per query head), got {value.dtype}")
  if value.shape != (num_heads,):
    raise ValueError(f"sinks must have shape [N] = ({num_heads},) (one logit per query head), "
                     f"got {value.shape}")
  return value.astype(jnp.float32)


def alibi_slopes(value, batch, num_heads, *, batch_name="B"):
  """``alibi_slopes``: ``[N]`` or ``[batch, N]`` floats, as float32 ``[1 | batch, N]`` (or ``None``).

  The slopes are not differentiated (``stop_gradient``): ALiBi fixes them (a geometric sequence per
  head), and a gradient would need a T x S reduction of dS weighted by distances."""
  if value is None:
    return None
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must be a floating array, got {value.dtype}")
  if value.shape not in ((num_heads,), (batch, num_heads)):
    raise ValueError(f"alibi_slopes must have shape [N] = ({num_heads},) or [{batch_name}, N] = "
                     f"({batch}, {num_heads}), got {value.shape}")
  return lax.stop_gradient(value.astype(jnp.float32)).reshape(-1, num_heads)


def lengths(name, value, batch, upper):
  """Valid lengths ``[batch]`` int32 in ``[0, upper]`` (``upper`` when not given)."""
  if value is None:
    return jnp.full((batch,), upper, jnp.int32)
  value = int_vector(name, value, batch, what="one length per batch element")
  check_lengths_in_range(name, value, upper)
  return jnp.clip(value, 0, upper)


def segment_ids(name, ids, shape):
  """Segment ids of ``shape`` as int32, or ``None``."""
  if ids is None:
    return None
  ids = jnp.asarray(ids)
  if ids.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {ids.shape}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
  return ids.astype(jnp.int32)


def check_segment_pair(query_segment_ids, key_value_segment_ids):
  if (query_segment_ids is None) != (key_value_segment_ids is None):
    raise ValueError("query_segment_ids and key_value_segment_ids must be given together")


def max_segments(value):
  """``max_segments``: a positive Python int (or ``None``)."""
  if value is None:
    return None
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"max_segments must be a positive Python int, got {value!r}")
  return int(value)


def cu_seqlens(name, cu, total):
  """Concrete offsets must be non-decreasing within ``[0, total]``; traced ones are made so by the caller."""
  if not is_concrete(cu):
    return
  arr = np.asarray(cu)
  if arr[0] < 0 or arr[-1] > total or np.any(np.diff(arr) < 0):
    raise ValueError(
        f"{name} must be non-decreasing offsets within [0, {total}], got {arr.tolist()}")


def seqused(name, used, nseq, capacity):
  """Rows used per sequence, ``[nseq]`` int32 within ``[0, capacity]`` (``capacity`` when not given)."""
  if used is None:
    return capacity
  used = int_vector(name, used, nseq, what="rows used per sequence")
  if is_concrete(used) and is_concrete(capacity):
    u, c = np.asarray(used), np.asarray(capacity)
    if np.any(u < 0) or np.any(u > c):
      raise ValueError(f"{name} must lie in [0, cu_seqlens[b+1]-cu_seqlens[b]] = {c.tolist()}, "
                       f"got {u.tolist()}")
  return jnp.clip(used, 0, capacity)


def max_seqlen(name, value, total, capacity):
  """The static bound on sequence lengths (default ``total``, at least 1)."""
  if value is None:
    return max(int(total), 1)
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < 2 ** 31:
    raise ValueError(f"{name} must be a Python int in [0, 2**31) (static; offsets are int32), got {value!r}")
  if is_concrete(capacity) and np.asarray(capacity).size and int(np.max(np.asarray(capacity))) > value:
    raise ValueError(f"{name}={value} is smaller than the longest sequence "
                     f"({int(np.max(np.asarray(capacity)))})")
  return int(value)
