"""Public entry points: argument checking, reduction to the canonical problem, backend dispatch.

Both layouts end in one call of :func:`jax_padsafe._xla.attention` (a ``jax.custom_vjp``) with a
``Backend`` (forward + backward) chosen by ``_backends``: the pure-JAX one, or the GPU kernels
(``implementation="cute"``), which ``lax.platform_dependent`` turns back into the pure-JAX code on
non-CUDA platforms so a program stays portable.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from jax_padsafe import _backends
from jax_padsafe import _masking
from jax_padsafe import _packing
from jax_padsafe import _validation as V
from jax_padsafe import _xla
from jax_padsafe._spec import AttentionSpec


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    softcap: float | None = None,
    causal_alignment: str = "top_left",
    query_segment_ids=None,
    key_value_segment_ids=None,
    return_lse: bool = False,
    deterministic: bool = False,
    block_k: int = 512,
    max_segments: int | None = None,
):
  r"""Pad-safe scaled dot-product attention; a drop-in for ``jax.nn.dot_product_attention``.

  Shapes follow ``jax.nn``: ``query [B, T, N, H]``, ``key``/``value`` ``[B, S, K, H]`` with
  ``N % K == 0`` (MHA, GQA, MQA); rank-3 inputs ``[T, N, H]`` are treated as a batch of one.

  Args:
    query, key, value: bfloat16, float16 or float32 arrays of one dtype.
    bias: optional additive bias broadcastable to ``[B, N, T, S]``; ``-inf`` hides a key exactly
      like the mask. Differentiable.
    mask: optional boolean mask broadcastable to ``[B, N, T, S]`` (``True`` = attend).
    scale: logit scale, default ``1 / sqrt(H)``.
    is_causal: causal masking ``j <= i + off`` (see ``causal_alignment``).
    query_seq_lengths, key_value_seq_lengths: int ``[B]`` valid lengths; rows at or past them are
      padding. Concrete out-of-range values raise ``ValueError``; traced ones are clamped.
    local_window_size: ``int`` or ``(left, right)``: key ``j`` is visible to query ``i`` iff
      ``i + off - left <= j <= i + off + right``. A negative (or ``None``) side is unbounded.
    implementation: ``None`` (the kernels where they apply, else pure JAX), ``"xla"`` (pure JAX),
      ``"cute"`` (GPU kernels; ``NotImplementedError`` for unsupported feature combinations).
    softcap: if set (> 0), logits become ``softcap * tanh(logits / softcap)`` before the bias;
      ``None`` or ``0`` disables it.
    causal_alignment: ``"top_left"`` (``off = 0``, as ``jax.nn``) or ``"bottom_right"``
      (``off = kv_len - q_len`` per sequence, FlashAttention's convention for KV-cache decoding).
    query_segment_ids, key_value_segment_ids: int ``[B, T]`` / ``[B, S]``; a query sees only keys
      with the same id; a negative id marks padding (it matches nothing, not even another negative id).
      The GPU kernels run them when every non-negative id forms one contiguous run of rows per batch
      row, on both sides, with the key runs in the query runs' order (sequence packing), and, with
      causal or window masks, when the runs of one id start at the same position (e.g. identical
      query and key ids). Other layouts run on the pure-JAX path: chosen at trace time when the ids
      are concrete (``implementation="cute"`` then raises), at run time when they are traced.
    return_lse: also return the log-sum-exp ``[B, N, T]`` float32 (differentiable).
    deterministic: gradients bitwise identical across repeated calls. The pure-JAX path always is;
      GPU backward kernels that accumulate with atomics switch to an ordered reduction.
    block_k: keys per step of the pure-JAX blockwise loop (memory ~ ``T * block_k`` per head).
    max_segments: static bound on the segment-id runs per batch row that the kernels are sized for
      (their grid grows with it). Default: counted from concrete ids, else 32 for traced ids. Rows
      with more runs take the pure-JAX path at run time.

  Returns:
    ``out`` with ``query``'s shape and dtype, or ``(out, lse)`` with ``return_lse=True``. Padded
    query rows give ``out = 0`` and ``lse = 0``; valid rows with no visible key give ``out = 0``
    and ``lse = -inf``. Every result is bitwise independent of what padded memory holds.
  """
  V.check_implementation(implementation)
  V.check_alignment(causal_alignment)
  V.check_flags(return_lse=return_lse, deterministic=deterministic)
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  unbatched = query.ndim == 3
  if unbatched:
    if key.ndim != 3 or value.ndim != 3:
      raise ValueError(
          f"query of rank 3 [T, N, H] needs key and value of rank 3 [S, K, H], got {key.shape}, {value.shape}")
    query, key, value = query[None], key[None], value[None]
  V.check_float_inputs(query, key, value, rank=4, layout="[B, T, N, H]")
  b, t, n, h = query.shape
  s = key.shape[1]
  if key.shape[0] != b:
    raise ValueError(f"query batch ({b}) and key/value batch ({key.shape[0]}) differ")

  bias = None if bias is None else V.broadcastable_4d(
      "bias", bias[None] if unbatched and jnp.ndim(bias) == 3 else bias, (b, n, t, s), bool_dtype=False)
  mask = None if mask is None else V.broadcastable_4d(
      "mask", mask[None] if unbatched and jnp.ndim(mask) == 3 else mask, (b, n, t, s), bool_dtype=True)

  if (query_segment_ids is None) != (key_value_segment_ids is None):
    raise ValueError("query_segment_ids and key_value_segment_ids must be given together")
  raw_rows = (query_seq_lengths, key_value_seq_lengths, query_segment_ids, key_value_segment_ids)
  rows = functools.partial(_canonical_rows, b, t, s, causal_alignment, *raw_rows)
  q_len, kv_len, q_seg, k_seg, q_pos, k_pos = rows()

  spec = _make_spec(h, scale, is_causal, local_window_size, softcap, block_k,
                    bottom_right=causal_alignment == "bottom_right", max_seqlen_q=t, max_seqlen_k=s,
                    deterministic=bool(deterministic), dense_rows=query_segment_ids is None)
  # The kernels see the padded layout as runs of rows per batch row (_packing): one per row for
  # lengths, one per packed segment for segment ids.
  segments_reason, kernel_args = None, None
  if implementation == "xla":
    pass
  elif query_segment_ids is None:
    kernel_args = dict(_packing.runs_from_lengths(q_len, kv_len)._asdict())
  else:
    # Concrete ids (and lengths) are mapped while tracing, so that a layout the kernels cannot
    # express is known now; traced ones leave the choice to a run-time predicate.
    concrete = all(x is None or V.is_concrete(x) for x in raw_rows)
    if concrete:
      with jax.ensure_compile_time_eval():
        kernel_args, segments_reason = _segment_runs(spec, *rows()[2:], max_segments)
    else:
      kernel_args, segments_reason = _segment_runs(spec, q_seg, k_seg, q_pos, k_pos, max_segments)
  backend = _backends.choose_backend(
      implementation, spec, query, key, bias=bias, mask=mask, segments_reason=segments_reason)

  out, lse = _run(spec, backend, query, key, value, bias, mask, q_seg, k_seg, q_pos, k_pos,
                  kernel_args)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_lse else out


def varlen_attention(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q=None,
    seqused_k=None,
    scale: float | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    local_window_size: int | tuple[int, int] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
    block_k: int = 512,
):
  r"""Pad-safe attention over a packed (variable-length) batch.

  ``query [total_q, N, H]``, ``key``/``value`` ``[total_k, K, H]``. Sequence ``b`` owns query rows
  ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1`` and key rows ``cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1``
  (int32, length ``B+1``, non-decreasing). Optional ``seqused_q``/``seqused_k`` (int ``[B]``) say
  how many leading rows of each sequence are used; the rest of the sequence, and every row at or
  past ``cu_seqlens[-1]``, is padding: output 0, lse 0, zero gradients, never read.

  ``max_seqlen_q``/``max_seqlen_k`` (static ints) bound the sequence lengths; the GPU kernels need
  them to size their grid (default: ``total_q``/``total_k``; where that bound would launch mostly tiles
  past short sequences, the Hopper kernels number only tiles inside sequences instead, so a loose bound
  costs little there). A smaller bound raises ``ValueError``
  when the offsets are concrete; under ``jit`` (traced offsets) the rows of a sequence past the bound
  are padding, in every implementation. Positions used by the causal and
  window masks are counted from each sequence's start. Returns ``out [total_q, N, H]`` and, with
  ``return_lse=True``, ``lse [N, total_q]`` float32. Other arguments as in
  :func:`dot_product_attention`.
  """
  V.check_implementation(implementation)
  V.check_alignment(causal_alignment)
  V.check_flags(return_lse=return_lse, deterministic=deterministic)
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  V.check_float_inputs(query, key, value, rank=3, layout="packed [total, N, H]")
  total_q, n, h = query.shape
  total_k = key.shape[0]

  cu_q = V.int_vector("cu_seqlens_q", cu_seqlens_q, None, what="int32 offsets, length B+1")
  if cu_q.shape[0] < 1:
    raise ValueError("cu_seqlens_q must have length B+1 >= 1")
  nseq = cu_q.shape[0] - 1
  cu_k = V.int_vector("cu_seqlens_k", cu_seqlens_k, nseq + 1, what="int32 offsets, length B+1")
  _check_cu_seqlens("cu_seqlens_q", cu_q, total_q)
  _check_cu_seqlens("cu_seqlens_k", cu_k, total_k)
  # Traced offsets are made safe: clamped into range and forced non-decreasing.
  cu_q = lax.cummax(jnp.clip(cu_q, 0, total_q))
  cu_k = lax.cummax(jnp.clip(cu_k, 0, total_k))
  cap_q = cu_q[1:] - cu_q[:-1]
  cap_k = cu_k[1:] - cu_k[:-1]
  used_q = _seqused("seqused_q", seqused_q, nseq, cap_q)
  used_k = _seqused("seqused_k", seqused_k, nseq, cap_k)

  max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q, total_q, cap_q)
  max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k, total_k, cap_k)
  # Traced offsets cannot be checked against the bounds at trace time.  A longer sequence then has its
  # rows past the bound treated as padding by every implementation alike (the kernels' grid stops at
  # the bound), rather than computed by one implementation and dropped by another.
  used_q = jnp.minimum(used_q, max_seqlen_q)
  used_k = jnp.minimum(used_k, max_seqlen_k)

  offset = (used_k - used_q) if causal_alignment == "bottom_right" else jnp.zeros_like(used_q)
  q_seg, q_pos = _packed_rows(cu_q, used_q, total_q, offset)
  k_seg, k_pos = _packed_rows(cu_k, used_k, total_k, jnp.zeros_like(used_k))

  spec = _make_spec(h, scale, is_causal, local_window_size, softcap, block_k,
                    bottom_right=causal_alignment == "bottom_right", packed=True,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                    deterministic=bool(deterministic))
  kernel_args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)
  backend = _backends.choose_backend(implementation, spec, query, key, bias=None, mask=None)
  out, lse = _run(spec, backend, query[None], key[None], value[None], None, None,
                  q_seg[None], k_seg[None], q_pos[None], k_pos[None], kernel_args)
  out, lse = out[0], lse[0]
  return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(spec, backend, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, kernel_args):
  # Jitted so that eager calls compile once per configuration (under an outer jit it is inlined).
  # The pure-JAX path sanitises before any arithmetic: padded rows become exact zeros by select, and
  # gradients flow back through the select, which routes exact zeros to the padded rows. The
  # kernels need no such pass (three extra reads and writes of q/k/v, and three more of the
  # gradients): they never compute from padded rows and zero the padded outputs themselves.
  if not backend.reads_padding_safely:
    q, k, v = _masking.zero_padded_inputs(q, k, v, q_seg, k_seg)
  return _xla.attention(spec, backend, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos,
                        kernel_args)


def _make_spec(head_dim, scale, is_causal, local_window_size, softcap, block_k, **kernel_facts):
  scale = V.check_scalar("scale", scale)
  if scale is None:
    scale = _xla.default_scale(head_dim)
  # softcap=0 means "no softcap" (FlashAttention's convention); negative values are rejected.
  if softcap is not None and not isinstance(softcap, jax.core.Tracer) and softcap == 0:
    softcap = None
  softcap = V.check_scalar("softcap", softcap, positive=True)
  left, right = V.normalize_window(local_window_size)
  if not isinstance(block_k, (int, np.integer)) or isinstance(block_k, (bool, np.bool_)) or block_k <= 0:
    raise ValueError(f"block_k must be a positive int, got {block_k!r}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
  return AttentionSpec(scale=scale, causal=bool(is_causal), window_left=left, window_right=right,
                       softcap=softcap, block_k=int(block_k), **kernel_facts)


def _lengths(name, lengths, batch, upper):
  if lengths is None:
    return jnp.full((batch,), upper, jnp.int32)
  lengths = V.int_vector(name, lengths, batch, what="one length per batch element")
  V.check_lengths_in_range(name, lengths, upper)
  return jnp.clip(lengths, 0, upper)


def _segment_ids(name, ids, shape):
  if ids is None:
    return None
  ids = jnp.asarray(ids)
  if ids.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {ids.shape}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {ids.dtype}")
  return ids.astype(jnp.int32)


def _segments_from_lengths(rows, lengths, ids):
  """Row segment: ``-1`` past the length or where the id is negative, else the id (or 0)."""
  valid = rows < lengths[:, None]
  if ids is None:
    return jnp.where(valid, 0, -1).astype(jnp.int32)
  return jnp.where(valid & (ids >= 0), ids, -1).astype(jnp.int32)


def _canonical_rows(b, t, s, alignment, q_lengths, kv_lengths, q_ids, kv_ids):
  """Lengths, canonical segments (-1 = padding) and positions of the padded layout's rows."""
  q_len = _lengths("query_seq_lengths", q_lengths, b, t)
  kv_len = _lengths("key_value_seq_lengths", kv_lengths, b, s)
  q_ids = _segment_ids("query_segment_ids", q_ids, (b, t))
  kv_ids = _segment_ids("key_value_segment_ids", kv_ids, (b, s))
  rows_q = jnp.arange(t, dtype=jnp.int32)[None, :]
  rows_k = jnp.arange(s, dtype=jnp.int32)[None, :]
  q_seg = _segments_from_lengths(rows_q, q_len, q_ids)
  k_seg = _segments_from_lengths(rows_k, kv_len, kv_ids)
  offset = (kv_len - q_len) if alignment == "bottom_right" else jnp.zeros_like(q_len)
  q_pos = jnp.broadcast_to(rows_q + offset[:, None], (b, t))
  k_pos = jnp.broadcast_to(rows_k, (b, s))
  return q_len, kv_len, q_seg, k_seg, q_pos, k_pos


def _segment_runs(spec, q_seg, k_seg, q_pos, k_pos, max_segments):
  """Kernel arguments for segment ids: ``(kernel_args, reason)``; ``reason`` is a sentence when
  concrete ids cannot run on the kernels. Traced ids add ``runs_exact`` for a run-time choice."""
  concrete = V.is_concrete(q_seg) and V.is_concrete(k_seg)
  if max_segments is not None:
    if not isinstance(max_segments, (int, np.integer)) or isinstance(max_segments, bool) \
        or max_segments < 1:
      raise ValueError(f"max_segments must be a positive Python int, got {max_segments!r}")
    max_runs = int(max_segments)
  elif concrete:  # the next power of two of the runs counted, to share compilations
    max_runs = 1 << max(int(np.max(np.asarray(_packing.count_runs(q_seg)), initial=1)) - 1, 0).bit_length()
  else:
    max_runs = _packing.DEFAULT_TRACED_MAX_RUNS
  max_runs = max(1, min(max_runs, q_seg.shape[1]))
  runs, exact = _packing.runs_from_segments(
      q_seg, k_seg, q_pos, k_pos, max_runs=max_runs,
      positional=spec.causal or spec.has_window, bottom_right=spec.bottom_right)
  kernel_args = dict(runs._asdict())
  if concrete and V.is_concrete(exact):
    if not bool(exact):
      return kernel_args, (
          "these segment ids are not contiguous runs that the kernels can express (each "
          f"non-negative id one run of rows per batch row on both sides, at most {max_runs} runs, "
          "key runs in the query runs' order, and with causal/window masks runs of one id "
          "starting at the same position; see `max_segments`)")
    return kernel_args, None
  kernel_args["runs_exact"] = exact
  return kernel_args, None


def _check_cu_seqlens(name, cu, total):
  if not V.is_concrete(cu):
    return
  arr = np.asarray(cu)
  if arr[0] < 0 or arr[-1] > total or np.any(np.diff(arr) < 0):
    raise ValueError(
        f"{name} must be non-decreasing offsets within [0, {total}], got {arr.tolist()}")


def _seqused(name, used, nseq, capacity):
  if used is None:
    return capacity
  used = V.int_vector(name, used, nseq, what="rows used per sequence")
  if V.is_concrete(used) and V.is_concrete(capacity):
    u, c = np.asarray(used), np.asarray(capacity)
    if np.any(u < 0) or np.any(u > c):
      raise ValueError(f"{name} must lie in [0, cu_seqlens[b+1]-cu_seqlens[b]] = {c.tolist()}, "
                       f"got {u.tolist()}")
  return jnp.clip(used, 0, capacity)


def _max_seqlen(name, value, total, capacity):
  if value is None:
    return max(int(total), 1)
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < 2 ** 31:
    raise ValueError(f"{name} must be a Python int in [0, 2**31) (static; offsets are int32), got {value!r}")
  if V.is_concrete(capacity) and np.asarray(capacity).size and int(np.max(np.asarray(capacity))) > value:
    raise ValueError(f"{name}={value} is smaller than the longest sequence "
                     f"({int(np.max(np.asarray(capacity)))})")
  return int(value)


def _packed_rows(cu, used, total, offset):
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


def canonical_attention(query, key, value, *, q_segment, k_segment, q_position, k_position,
                        scale=None, is_causal=False, local_window_size=None, softcap=None,
                        implementation="xla", block_k: int = 512):
  """Differentiable ``(out [B, T, N, H], lse [B, N, T])`` on the canonical problem (see ``_spec``).

  For building blocks such as ring attention that need explicit per-row segments (``-1`` =
  padding) and positions (the causal/window coordinates, alignment offset already added). Only the
  pure-JAX forward is available here (``implementation="xla"``); padding rows of the inputs are
  sanitised like in the public functions, so the same contract holds.
  """
  if implementation != "xla":
    raise NotImplementedError("canonical_attention runs on the pure-JAX path only")
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  V.check_float_inputs(query, key, value, rank=4, layout="[B, T, N, H]")
  spec = _make_spec(query.shape[-1], scale, is_causal, local_window_size, softcap, block_k)
  segs = [jnp.asarray(x, jnp.int32) for x in (q_segment, k_segment, q_position, k_position)]
  for name, x, like in zip(("q_segment", "k_segment", "q_position", "k_position"), segs,
                           (query, key, query, key)):
    if x.shape != like.shape[:2]:
      raise ValueError(f"{name} must have shape {like.shape[:2]}, got {x.shape}")
  return _run(spec, _xla.XLA, query, key, value, None, None, *segs, None)
