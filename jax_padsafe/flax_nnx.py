"""Flax NNX integration: pad-safe multi-head attention with per-sequence KV-cache decoding.

:class:`MultiHeadAttention` has the parameters of ``flax.nnx.MultiHeadAttention`` (``query``,
``key``, ``value``, ``out`` as ``LinearGeneral``, optional ``query_ln``/``key_ln``; same shapes,
initialisers and RNG use, so the same ``nnx.Rngs`` seed gives the same parameters) and adds:

* per-call ``query_seq_lengths`` / ``key_value_seq_lengths`` (int ``[batch...]``) and segment ids
  (``[batch..., length]``, negative = padding); padded input rows are selected to zero before the
  projections and padded output rows are exactly zero;
* causal masking (``is_causal``, both alignments), sliding window, softcap, GQA (``num_kv_heads``);
* optional attention sinks (``use_sinks=True``): a learnable logit per query head, ``sinks``, added to
  every row's softmax denominator (a row may attend to nothing), and ALiBi slopes per call
  (``alibi_slopes=``); both run on the pure-JAX path;
* KV-cache decoding with a length **per sequence**: :meth:`MultiHeadAttention.init_cache`, then
  calls with ``decode=True`` append ``query_seq_lengths[b]`` new tokens (default: all) to sequence
  ``b``'s cache and attend causally with bottom-right alignment (the new tokens sit at the end of
  each sequence's valid cache);
* rotary embeddings, **optional**: pass ``rope=apply_rope`` (or any ``rope(x, positions)``
  callable) to rotate queries and keys; positions default to ``0..T-1`` (the position within the
  segment with segment ids, and the cache offset in decode mode). With ``rope=None`` (default) the
  layer adds no positional information: that is left to the model.

Requires ``flax`` (``pip install "jax_padsafe[flax]"``). Attention-weight dropout is not supported:
``dropout_rate > 0`` with ``deterministic=False`` raises ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

try:
  from flax import nnx
  from flax.nnx.nn import initializers
  from flax.nnx.nn.linear import default_kernel_init
except ImportError as e:  # pragma: no cover - exercised only without flax
  raise ImportError("jax_padsafe.flax_nnx needs Flax: pip install 'jax_padsafe[flax]'") from e

from jax_padsafe._core import checks
from jax_padsafe import attention
from jax_padsafe._core import layers as _layers
from jax_padsafe._core.layers import apply_rope, positions_from_segments

__all__ = ["MultiHeadAttention", "apply_rope", "positions_from_segments"]


class MultiHeadAttention(nnx.Module):
  """Pad-safe multi-head attention for Flax NNX (see the module docstring).

  Args (``nnx.MultiHeadAttention``'s, plus):
    is_causal: causal masking (``j <= i + off``).
    causal_alignment: ``"top_left"`` (default, as ``jax.nn``) or ``"bottom_right"``. Decode calls
      always use ``"bottom_right"``.
    local_window_size, softcap, scale, implementation: as in
      :func:`jax_padsafe.dot_product_attention`.
    rope: ``None`` (no rotary embedding) or a callable ``rope(x, positions) -> x`` applied to the
      projected queries and keys, e.g. :func:`apply_rope` or ``functools.partial(apply_rope,
      theta=500_000.0)``.
    use_sinks: add the parameter ``sinks`` ``[num_heads]`` (in ``param_dtype``, initialised by
      ``sinks_init``, zeros by default): one sink logit per query head (see the ``sinks`` argument of
      :func:`jax_padsafe.dot_product_attention`). Off by default.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      dropout_rate: float = 0.0,
      deterministic: bool | None = None,
      precision: Any = None,
      kernel_init: Callable = default_kernel_init,
      out_kernel_init: Callable | None = None,
      bias_init: Callable = initializers.zeros_init(),
      out_bias_init: Callable | None = None,
      use_bias: bool = True,
      normalize_qk: bool = False,
      is_causal: bool = False,
      causal_alignment: str = "top_left",
      local_window_size: Any = None,
      softcap: float | None = None,
      scale: float | None = None,
      implementation: str | None = None,
      rope: Callable | None = None,
      decode: bool = False,
      use_sinks: bool = False,
      sinks_init: Callable = initializers.zeros_init(),
      rngs: nnx.Rngs,
  ):
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = qkv_features if qkv_features is not None else in_features
    self.out_features = out_features if out_features is not None else in_features
    self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
    self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads "
                       f"({self.num_kv_heads})")
    if self.qkv_features % num_heads:
      raise ValueError(f"qkv_features ({self.qkv_features}) must be divisible by num_heads "
                       f"({num_heads})")
    self.head_dim = self.qkv_features // num_heads
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    self.normalize_qk = normalize_qk
    self.is_causal = is_causal
    self.causal_alignment = causal_alignment
    self.local_window_size = local_window_size
    self.softcap = softcap
    self.scale = scale
    self.implementation = implementation
    self.rope = rope
    self.decode = decode

    linear = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                  bias_init=bias_init, use_bias=use_bias, precision=precision, rngs=rngs)
    # Same construction order as nnx.MultiHeadAttention, so one seed gives the same parameters.
    self.query = nnx.LinearGeneral(self.in_features, (num_heads, self.head_dim), **linear)
    self.key = nnx.LinearGeneral(self.in_kv_features, (self.num_kv_heads, self.head_dim), **linear)
    self.value = nnx.LinearGeneral(self.in_kv_features, (self.num_kv_heads, self.head_dim),
                                   **linear)
    if normalize_qk:
      ln = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      self.query_ln = nnx.LayerNorm(self.head_dim, **ln)
      self.key_ln = nnx.LayerNorm(self.head_dim, **ln)
    else:
      self.query_ln = nnx.data(None)
      self.key_ln = nnx.data(None)
    self.out = nnx.LinearGeneral(
        (num_heads, self.head_dim), self.out_features, axis=(-2, -1),
        kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
        use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
    # After every parameter of nnx.MultiHeadAttention, so that those stay what one seed gives there.
    self.sinks = (nnx.Param(sinks_init(rngs.params(), (num_heads,), param_dtype)) if use_sinks
                  else nnx.data(None))
    self.cached_key = nnx.data(None)
    self.cached_value = nnx.data(None)
    self.cache_lengths = nnx.data(None)

  # ------------------------------------------------------------------------------------------------
  def init_cache(self, input_shape, dtype: Any = jnp.float32, lengths=None,
                 fill_value: float = 0.0):
    """Allocates the KV cache for ``input_shape = (batch, max_length, features)``.

    ``lengths`` (int ``[batch]``, default zeros) are the tokens already in each sequence's cache.
    The buffers hold ``fill_value`` (default 0), but nothing relies on it: rows at or past a
    sequence's length are padding and never read (``fill_value=float("nan")`` changes nothing).
    """
    if len(input_shape) != 3:
      raise ValueError(f"init_cache expects (batch, max_length, features), got {input_shape}")
    b, max_length = input_shape[0], input_shape[1]
    shape = (b, max_length, self.num_kv_heads, self.head_dim)
    self.cached_key = nnx.Cache(jnp.full(shape, fill_value, dtype))
    self.cached_value = nnx.Cache(jnp.full(shape, fill_value, dtype))
    lengths = jnp.zeros((b,), jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    self.cache_lengths = nnx.Cache(jnp.broadcast_to(lengths, (b,)))

  # ------------------------------------------------------------------------------------------------
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, query_seq_lengths=None,
               key_value_seq_lengths=None, query_segment_ids=None, key_value_segment_ids=None,
               positions=None, kv_positions=None, mask=None, bias=None, alibi_slopes=None,
               decode: bool | None = None, deterministic: bool | None = None):
    """Attention over ``inputs_q [batch..., T, in_features]`` (self-attention if ``inputs_k`` is None).

    In self-attention, key lengths / segment ids default to the query's. With ``decode=True``
    (self-attention, one batch dim), ``inputs_q [B, T_new, F]`` holds up to ``T_new`` new tokens per
    sequence, ``query_seq_lengths[b]`` of them valid (default ``T_new``); they are appended to the
    cache at each sequence's own length, and the cache lengths advance by ``query_seq_lengths``.
    ``alibi_slopes``: ``[num_heads]`` or ``[batch..., num_heads]`` (see
    :func:`jax_padsafe.dot_product_attention`); in decode mode distances count cache positions.
    """
    deterministic = self.deterministic if deterministic is None else deterministic
    if self.dropout_rate > 0.0 and deterministic is None:
      raise ValueError("dropout_rate > 0 needs deterministic=True/False (constructor or call)")
    _layers.check_no_dropout(self.dropout_rate, deterministic,
                             "jax_padsafe.flax_nnx.MultiHeadAttention")
    decode = self.decode if decode is None else decode
    if decode:
      if inputs_k is not None or inputs_v is not None:
        raise ValueError("decode=True is for self-attention: leave inputs_k/inputs_v as None")
      return self._decode(inputs_q, query_seq_lengths, positions, mask, bias, alibi_slopes)

    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None if inputs_v is given")
      inputs_k = inputs_q
      if key_value_seq_lengths is None and key_value_segment_ids is None:
        key_value_seq_lengths, key_value_segment_ids = query_seq_lengths, query_segment_ids
      if kv_positions is None:
        kv_positions = positions
    if inputs_v is None:
      inputs_v = inputs_k
    self._check_features(inputs_q, inputs_k)

    t, s = inputs_q.shape[-2], inputs_k.shape[-2]
    valid_q = _layers.valid_rows(inputs_q.shape[:-2], t, query_seq_lengths, query_segment_ids)
    valid_k = _layers.valid_rows(inputs_k.shape[:-2], s, key_value_seq_lengths,
                                 key_value_segment_ids)
    query, key, value = self._project(_layers.select_rows(inputs_q, valid_q),
                                      _layers.select_rows(inputs_k, valid_k),
                                      _layers.select_rows(inputs_v, valid_k))
    if self.rope is not None:
      if positions is None:
        positions = _default_positions(t, query_segment_ids)
      if kv_positions is None:
        kv_positions = _default_positions(s, key_value_segment_ids)
      query, key = self.rope(query, positions), self.rope(key, kv_positions)
    x = attention.attend(
        query, key, value, mask=mask, bias=bias, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids, alibi_slopes=alibi_slopes, **self._options())
    return _layers.select_rows(self.out(x), valid_q)

  # ------------------------------------------------------------------------------------------------
  def _decode(self, inputs, new_lengths, positions, mask, bias, alibi_slopes):
    if self.cached_key is None:
      raise ValueError("KV cache not initialised: call init_cache(input_shape) first")
    if inputs.ndim != 3:
      raise ValueError(f"decode expects inputs [batch, new_tokens, features], got {inputs.shape}")
    self._check_features(inputs, inputs)
    b, t_new = inputs.shape[0], inputs.shape[1]
    cache_k, cache_v = self.cached_key[...], self.cached_value[...]
    max_length = cache_k.shape[1]
    if cache_k.shape[0] != b:
      raise ValueError(f"decode batch ({b}) differs from the cache batch ({cache_k.shape[0]})")
    cache_len = self.cache_lengths[...]
    if new_lengths is None:
      new_lengths = jnp.full((b,), t_new, jnp.int32)
    new_lengths = jnp.clip(jnp.broadcast_to(jnp.asarray(new_lengths, jnp.int32), (b,)), 0, t_new)
    total = cache_len + new_lengths
    if checks.is_concrete(total) and int(np.max(np.asarray(total), initial=0)) > max_length:
      raise ValueError(f"KV cache overflow: cache lengths + new tokens = {np.asarray(total)} > "
                       f"max_length {max_length}")
    total = jnp.minimum(total, max_length)

    valid_q = _layers.valid_rows((b,), t_new, new_lengths)
    query, key, value = self._project(*([_layers.select_rows(inputs, valid_q)] * 3))
    if self.rope is not None:
      if positions is None:
        positions = cache_len[:, None] + jnp.arange(t_new, dtype=jnp.int32)[None, :]
      query, key = self.rope(query, positions), self.rope(key, positions)
    # Scatter the valid new rows to each sequence's own offset; others are dropped (index past end).
    rows = cache_len[:, None] + jnp.arange(t_new, dtype=jnp.int32)[None, :]
    rows = jnp.where(valid_q, rows, max_length)
    batch_idx = jnp.broadcast_to(jnp.arange(b)[:, None], rows.shape)
    cache_k = cache_k.at[batch_idx, rows].set(key.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[batch_idx, rows].set(value.astype(cache_v.dtype), mode="drop")
    self.cached_key[...] = cache_k
    self.cached_value[...] = cache_v
    self.cache_lengths[...] = total

    opts = self._options()
    opts["causal_alignment"] = "bottom_right"
    k_all, v_all = cache_k.astype(query.dtype), cache_v.astype(query.dtype)
    x = attention.attend(query, k_all, v_all, mask=mask, bias=bias, query_seq_lengths=new_lengths,
                         key_value_seq_lengths=total, alibi_slopes=alibi_slopes, **opts)
    return _layers.select_rows(self.out(x), valid_q)

  def _check_features(self, inputs_q, inputs_k):
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"inputs_q has {inputs_q.shape[-1]} features, the module expects "
                       f"{self.in_features}")
    if inputs_k.shape[-1] != self.in_kv_features:
      raise ValueError(f"inputs_k has {inputs_k.shape[-1]} features, the module expects "
                       f"{self.in_kv_features}")

  def _project(self, inputs_q, inputs_k, inputs_v):
    query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    dtype = self.dtype if self.dtype is not None else jnp.result_type(query, key, value)
    return tuple(x.astype(dtype) for x in (query, key, value))

  def _options(self):
    return dict(is_causal=self.is_causal, causal_alignment=self.causal_alignment,
                local_window_size=self.local_window_size, softcap=self.softcap, scale=self.scale,
                implementation=self.implementation,
                sinks=None if self.sinks is None else self.sinks[...])


def _default_positions(length, segment_ids):
  if segment_ids is None:
    return jnp.arange(length, dtype=jnp.int32)
  return _layers.positions_from_segments(segment_ids)

