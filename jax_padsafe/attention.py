"""The public entry points: argument checks, the canonical problem, backend dispatch.

Both layouts are reduced once to the canonical problem (``_core.problem.Problem``: the per-row view
the pure-JAX path reads and the kernel view the GPU kernels take) and end in one call of
``_core.vjp.attention`` (a ``jax.custom_vjp``) with a ``Backend`` chosen by ``_backends``: the
pure-JAX one, or the GPU kernels (``implementation="cute"``), which ``lax.platform_dependent`` turns
back into the pure-JAX code on non-CUDA platforms so a program stays portable.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_padsafe import _backends
from jax_padsafe._core import checks
from jax_padsafe._core import problem as canonical
from jax_padsafe._core import visibility
from jax_padsafe._core import vjp


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
    deterministic: bool = True,
    block_k: int = 512,
    max_segments: int | None = None,
    sinks=None,
    alibi_slopes=None,
):
  r"""Pad-safe scaled dot-product attention; a drop-in for ``jax.nn.dot_product_attention``.

  Shapes follow ``jax.nn``: ``query [B, T, N, H]``, ``key [B, S, K, H]``, ``value [B, S, K, Hv]``
  with ``N % K == 0`` (MHA, GQA, MQA); rank-3 inputs ``[T, N, H]`` are treated as a batch of one.
  The value head dim ``Hv`` may differ from ``H`` (any pair on the pure-JAX path); the output has it.

  Args:
    query, key, value: bfloat16, float16 or float32 arrays of one dtype.
    bias: optional additive bias broadcastable to ``[B, N, T, S]``; ``-inf`` hides a key exactly
      like the mask. Differentiable. Its head dimension may also be ``K``: one entry per key/value
      head, shared by that head's group of query heads (then on the pure-JAX path).
    mask: optional boolean mask broadcastable to ``[B, N, T, S]`` (``True`` = attend), or given per
      key/value head like ``bias``.
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
    deterministic: ``True`` (default): gradients bitwise identical across repeated calls and bitwise
      independent of padding. ``False`` allows a backward whose reductions add in arrival order where one
      is offered (results then vary within rounding; poison still never reaches them). Every backward
      today is deterministic, so both give the same results.
    block_k: keys per step of the pure-JAX blockwise loop (memory ~ ``T * block_k`` per head).
    max_segments: static bound on the segment-id runs per batch row that the kernels are sized for
      (their grid grows with it). Default: counted from concrete ids, else 32 for traced ids. Rows
      with more runs take the pure-JAX path at run time.
    sinks: optional float ``[N]``, one sink logit per query head (with GQA each query head has its
      own): every valid row's softmax denominator gains ``exp(sinks[h])``, a key with a zero value
      that every valid row sees, so ``lse`` includes it and a row may attend to "nothing". Finite
      values or ``-inf`` (no sink for that head); differentiable. Runs on the pure-JAX path.
    alibi_slopes: optional float ``[N]`` or ``[B, N]`` ALiBi slopes: the score bias
      ``-slope * |i + off - j|`` (the ``off`` of ``causal_alignment``, from the valid lengths), added
      after the softcap like ``bias``. Not differentiated (``stop_gradient``). Computed blockwise
      from positions on the pure-JAX path (no ``T x S`` array).

  Returns:
    ``out [B, T, N, Hv]`` in ``query``'s dtype, or ``(out, lse)`` with ``return_lse=True``. Padded
    query rows give ``out = 0`` and ``lse = 0``; valid rows with no visible key give ``out = 0``
    and ``lse = -inf`` (``lse = sinks[h]`` with sinks). Every result is bitwise independent of what
    padded memory holds.
  """
  checks.check_implementation(implementation)
  checks.check_alignment(causal_alignment)
  checks.check_flags(return_lse=return_lse, deterministic=deterministic)
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  unbatched = query.ndim == 3
  if unbatched:
    if key.ndim != 3 or value.ndim != 3:
      raise ValueError(
          f"query of rank 3 [T, N, H] needs key and value of rank 3 [S, K, H], got {key.shape}, {value.shape}")
    query, key, value = query[None], key[None], value[None]
  checks.check_float_inputs(query, key, value, rank=4, layout="[B, T, N, H]")
  b, t, n, h = query.shape
  s = key.shape[1]
  if key.shape[0] != b:
    raise ValueError(f"query batch ({b}) and key/value batch ({key.shape[0]}) differ")

  kh = key.shape[2]
  bias = None if bias is None else checks.broadcastable_4d(
      "bias", bias[None] if unbatched and jnp.ndim(bias) == 3 else bias, (b, n, t, s), bool_dtype=False,
      num_kv_heads=kh)
  mask = None if mask is None else checks.broadcastable_4d(
      "mask", mask[None] if unbatched and jnp.ndim(mask) == 3 else mask, (b, n, t, s), bool_dtype=True,
      num_kv_heads=kh)
  checks.check_segment_pair(query_segment_ids, key_value_segment_ids)
  sinks = checks.sinks(sinks, n)
  alibi = checks.alibi_slopes(alibi_slopes, b, n)
  if alibi is not None:
    alibi = alibi[:, :, None]  # per query row: [1|B, N, 1]

  spec = checks.make_spec(h, scale, is_causal, local_window_size, softcap, block_k,
                          bottom_right=causal_alignment == "bottom_right",
                          deterministic=bool(deterministic), sinks=sinks is not None,
                          alibi=alibi is not None)
  problem = canonical.from_padded(
      spec, b, t, s, causal_alignment, query_seq_lengths, key_value_seq_lengths,
      query_segment_ids, key_value_segment_ids, kernel_view=implementation != "xla",
      max_segments=max_segments)
  backend = _backends.choose_backend(implementation, spec, problem, query, key, bias=bias,
                                     mask=mask, value=value)
  out, lse = _run(spec, backend, query, key, value, bias, mask, sinks, alibi, problem)
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
    deterministic: bool = True,
    block_k: int = 512,
    sinks=None,
    alibi_slopes=None,
):
  r"""Pad-safe attention over a packed (variable-length) batch.

  ``query [total_q, N, H]``, ``key [total_k, K, H]``, ``value [total_k, K, Hv]``. Sequence ``b``
  owns query rows ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1`` and key rows ``cu_seqlens_k[b] ..
  cu_seqlens_k[b+1]-1`` (int32, length ``B+1``, non-decreasing). Optional
  ``seqused_q``/``seqused_k`` (int ``[B]``) say how many leading rows of each sequence are used; the
  rest of the sequence, and every row at or past ``cu_seqlens[-1]``, is padding: output 0, lse 0,
  zero gradients, never read.

  ``max_seqlen_q``/``max_seqlen_k`` (static ints) bound the sequence lengths; the GPU kernels need
  them to size their grid (default: ``total_q``/``total_k``; where that bound would launch mostly tiles
  past short sequences, the Hopper kernels number only tiles inside sequences instead, so a loose bound
  costs little there). A smaller bound raises ``ValueError``
  when the offsets are concrete; under ``jit`` (traced offsets) the rows of a sequence past the bound
  are padding, in every implementation. Positions used by the causal and
  window masks (and by ALiBi) are counted from each sequence's start; ``alibi_slopes`` is ``[N]`` or
  ``[B, N]`` (one row of slopes per sequence). Returns ``out [total_q, N, Hv]`` and, with
  ``return_lse=True``, ``lse [N, total_q]`` float32. Other arguments as in
  :func:`dot_product_attention`.
  """
  checks.check_implementation(implementation)
  checks.check_alignment(causal_alignment)
  checks.check_flags(return_lse=return_lse, deterministic=deterministic)
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  checks.check_float_inputs(query, key, value, rank=3, layout="packed [total, N, H]")
  total_q, n, h = query.shape
  total_k = key.shape[0]
  sinks = checks.sinks(sinks, n)

  cu_q = checks.int_vector("cu_seqlens_q", cu_seqlens_q, None, what="int32 offsets, length B+1")
  if cu_q.shape[0] < 1:
    raise ValueError("cu_seqlens_q must have length B+1 >= 1")
  nseq = cu_q.shape[0] - 1
  cu_k = checks.int_vector("cu_seqlens_k", cu_seqlens_k, nseq + 1, what="int32 offsets, length B+1")
  checks.cu_seqlens("cu_seqlens_q", cu_q, total_q)
  checks.cu_seqlens("cu_seqlens_k", cu_k, total_k)
  # Traced offsets are made safe: clamped into range and forced non-decreasing.
  cu_q = lax.cummax(jnp.clip(cu_q, 0, total_q))
  cu_k = lax.cummax(jnp.clip(cu_k, 0, total_k))
  cap_q = cu_q[1:] - cu_q[:-1]
  cap_k = cu_k[1:] - cu_k[:-1]
  used_q = checks.seqused("seqused_q", seqused_q, nseq, cap_q)
  used_k = checks.seqused("seqused_k", seqused_k, nseq, cap_k)

  max_seqlen_q = checks.max_seqlen("max_seqlen_q", max_seqlen_q, total_q, cap_q)
  max_seqlen_k = checks.max_seqlen("max_seqlen_k", max_seqlen_k, total_k, cap_k)
  # Traced offsets cannot be checked against the bounds at trace time.  A longer sequence then has its
  # rows past the bound treated as padding by every implementation alike (the kernels' grid stops at
  # the bound), rather than computed by one implementation and dropped by another.
  used_q = jnp.minimum(used_q, max_seqlen_q)
  used_k = jnp.minimum(used_k, max_seqlen_k)

  alibi = checks.alibi_slopes(alibi_slopes, nseq, n)
  if alibi is not None and alibi.shape[0] == 0:
    alibi = None  # no sequence, every row is padding: nothing to bias
  spec = checks.make_spec(h, scale, is_causal, local_window_size, softcap, block_k,
                          bottom_right=causal_alignment == "bottom_right",
                          deterministic=bool(deterministic), sinks=sinks is not None,
                          alibi=alibi is not None)
  problem = canonical.from_packed(cu_q, cu_k, used_q, used_k, total_q, total_k,
                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                  alignment=causal_alignment)
  if alibi is not None and alibi.shape[0] > 1:
    # One row of slopes per sequence: each query row takes its sequence's (padded rows: 0, unread).
    seq = problem.q_seg[0]
    alibi = jnp.where(seq[:, None] >= 0, jnp.take(alibi, jnp.maximum(seq, 0), axis=0), 0.0).T[None]
  elif alibi is not None:
    alibi = alibi[:, :, None]
  backend = _backends.choose_backend(implementation, spec, problem, query, key, bias=None,
                                     mask=None, value=value)
  out, lse = _run(spec, backend, query[None], key[None], value[None], None, None, sinks, alibi, problem)
  out, lse = out[0], lse[0]
  return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(spec, backend, q, k, v, bias, mask, sinks, alibi, problem):
  # Jitted so that eager calls compile once per configuration (under an outer jit it is inlined).
  # The pure-JAX path sanitises before any arithmetic: padded rows become exact zeros by select, and
  # gradients flow back through the select, which routes exact zeros to the padded rows. The
  # kernels need no such pass (three extra reads and writes of q/k/v, and three more of the
  # gradients): they never compute from padded rows and zero the padded outputs themselves.
  if not backend.reads_padding_safely:
    q, k, v = visibility.zero_padded_inputs(q, k, v, problem.q_seg, problem.k_seg)
  return vjp.attention(spec, backend, q, k, v, bias, mask, sinks, alibi, problem)


# The layers (flax_linen, flax_nnx, equinox) take the frameworks' [batch..., length, heads, head_dim]
# layouts: `attend` folds the batch dimensions into one, calls dot_product_attention, and unfolds.

#: Options of :func:`dot_product_attention` that the layers forward unchanged.
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
  lead = len(batch_shape)
  if all(d == 1 for d in x.shape[:lead]):  # shared by the whole batch: stays one (no B copies for the kernels)
    return x.reshape((1,) + x.shape[lead:])
  return _fold(x, batch_shape, x.shape[lead:])


def attend(query, key, value, *, bias=None, mask=None, query_seq_lengths=None,
           key_value_seq_lengths=None, query_segment_ids=None, key_value_segment_ids=None,
           alibi_slopes=None, **options):
  """:func:`dot_product_attention` on ``[batch..., T, N, H]`` inputs with any number of batch dims.

  Lengths broadcast to ``batch...``; segment ids to ``[batch..., T]`` / ``[batch..., S]``; ``mask``
  and ``bias`` to ``[batch..., N, T, S]`` (the Flax convention); ``alibi_slopes`` is ``[N]`` or
  broadcasts to ``[batch..., N]``; ``sinks`` (``[N]``) passes through.
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
  if alibi_slopes is not None:
    alibi_slopes = jnp.asarray(alibi_slopes)
    kw["alibi_slopes"] = alibi_slopes if alibi_slopes.ndim == 1 else _fold(
        alibi_slopes, batch_shape, alibi_slopes.shape[-1:])
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
