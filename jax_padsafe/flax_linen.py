"""Flax linen integration: a pad-safe ``attention_fn`` and a multi-head attention module.

Three ways in, from least to most change to existing code:

1. ``nn.MultiHeadDotProductAttention(..., attention_fn=jax_padsafe.flax_linen.attention_fn)``: the
   one-line swap. Takes linen's boolean ``mask`` (on the kernels; a mask cannot tell padding from
   masked keys, so NaN in masked-out keys/values can still reach valid rows).
2. ``attention_fn=make_attention_fn(query_seq_lengths=..., key_value_seq_lengths=..., is_causal=True)``:
   declares the padding, so the pad-safety contract holds, and lengths + causal + window + softcap
   run on the GPU kernels where they are built (see docs/features.md).
3. :class:`MultiHeadAttention`: a linen module with the same parameters as
   ``nn.MultiHeadDotProductAttention`` (same names, shapes, initialisers, so checkpoints load) that
   takes lengths / segment ids per call, selects padded input rows to zero before the projections
   (so parameter gradients stay finite when the padding holds NaN) and returns exact zeros in padded
   output rows.

Requires ``flax`` (``pip install "jax_padsafe[flax]"``). Attention-weight dropout is not supported
(flash attention never forms the weights): ``dropout_rate > 0`` with ``deterministic=False`` raises
``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

try:
  import flax.linen as nn
except ImportError as e:  # pragma: no cover - exercised only without flax
  raise ImportError("jax_padsafe.flax_linen needs Flax: pip install 'jax_padsafe[flax]'") from e

from jax_padsafe import attention
from jax_padsafe._core import layers as _layers

__all__ = ["attention_fn", "make_attention_fn", "MultiHeadAttention"]


def _promote(query, key, value, dtype):
  if dtype is None:
    dtype = jnp.result_type(query, key, value)
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def make_attention_fn(*, query_seq_lengths=None, key_value_seq_lengths=None,
                      query_segment_ids=None, key_value_segment_ids=None, is_causal: bool = False,
                      causal_alignment: str = "top_left", local_window_size=None, softcap=None,
                      scale=None, implementation: str | None = None) -> Callable[..., Any]:
  """An ``attention_fn`` for ``nn.MultiHeadDotProductAttention`` / ``nnx.MultiHeadAttention``.

  The options are those of :func:`jax_padsafe.dot_product_attention`. Lengths broadcast to the
  batch dims of the query (``[batch...]``), segment ids to ``[batch..., length]``. Build it inside
  the parent's ``__call__`` when the lengths are per-batch data::

      out = nn.MultiHeadDotProductAttention(
          num_heads=8, attention_fn=make_attention_fn(query_seq_lengths=lens,
                                                      key_value_seq_lengths=lens,
                                                      is_causal=True))(x)

  Fast GPU kernels: lengths, causal (both alignments), window, softcap, GQA, and a ``mask`` or
  ``bias`` passed by the calling module (e.g. linen's causal and padding masks, its ``decode=True``
  cache mask) without segment ids or softcap (``dbias`` runs on the pure-JAX path).
  """
  options = dict(is_causal=is_causal, causal_alignment=causal_alignment,
                 local_window_size=local_window_size, softcap=softcap, scale=scale,
                 implementation=implementation)

  def padsafe_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                           dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                           precision=None, module=None, force_fp32_for_softmax=False,
                           qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                           is_causal=False):
    """Pad-safe drop-in for ``flax.linen.dot_product_attention`` (see :func:`make_attention_fn`).

    ``precision`` and ``force_fp32_for_softmax`` are accepted and ignored: the softmax always runs
    in float32. ``is_causal=True`` (passed by ``nnx.MultiHeadAttention``) adds a causal mask.
    """
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    _layers.check_no_dropout(dropout_rate, deterministic, "jax_padsafe attention_fn")
    if module is not None:
      raise NotImplementedError(
          "jax_padsafe attention_fn cannot sow attention weights (sow_weights=True): flash "
          "attention never forms them. Call the module with sow_weights=False.")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise NotImplementedError("jax_padsafe attention_fn does not take custom einsums "
                                "(qk_attn_weights_einsum / attn_weights_value_einsum)")
    query, key, value = _promote(query, key, value, dtype)
    kw = dict(options)
    kw["is_causal"] = bool(options["is_causal"] or is_causal)
    return attention.attend(
        query, key, value, bias=bias, mask=mask, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids, **kw)

  return padsafe_attention_fn


#: Drop-in for ``flax.linen.dot_product_attention`` with no padding declared (uses ``mask``).
attention_fn = make_attention_fn()


class MultiHeadAttention(nn.Module):
  """Pad-safe multi-head attention; parameters identical to ``nn.MultiHeadDotProductAttention``.

  Submodules ``query``, ``key``, ``value`` (``DenseGeneral`` to ``(heads, head_dim)``) and ``out``,
  plus ``query_ln`` / ``key_ln`` with ``normalize_qk=True``: the same names, shapes and initialisers
  as Flax's module, so its parameters load unchanged (with ``num_kv_heads`` left at ``None``).

  Attributes (Flax's, plus):
    num_kv_heads: key/value heads for grouped-query attention (``num_heads % num_kv_heads == 0``).
    is_causal, causal_alignment, local_window_size, softcap, scale, implementation: as in
      :func:`jax_padsafe.dot_product_attention`.
    use_sinks: add the parameter ``sinks`` ``[num_heads]`` (``sinks_init``, zeros by default): one
      sink logit per query head (the ``sinks`` argument of :func:`jax_padsafe.dot_product_attention`,
      pure-JAX path). Off by default.

  Calls also take ``alibi_slopes`` (``[num_heads]`` or ``[batch..., num_heads]``, pure-JAX path).

  Call with ``query_seq_lengths`` / ``key_value_seq_lengths`` (int ``[batch...]``) and/or segment
  ids (``[batch..., length]``, negative = padding). Padded input rows are replaced by zeros (a
  select) before the projections; padded output rows are exactly zero. Without lengths or segment
  ids every row is valid and the layer computes the same function as Flax's on the same params.
  """

  num_heads: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  precision: Any = None
  kernel_init: Callable = nn.linear.default_kernel_init
  out_kernel_init: Callable | None = None
  bias_init: Callable = nn.initializers.zeros_init()
  out_bias_init: Callable | None = None
  use_bias: bool = True
  normalize_qk: bool = False
  is_causal: bool = False
  causal_alignment: str = "top_left"
  local_window_size: Any = None
  softcap: float | None = None
  scale: float | None = None
  implementation: str | None = None
  use_sinks: bool = False
  sinks_init: Callable = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, query_seq_lengths=None,
               key_value_seq_lengths=None, query_segment_ids=None, key_value_segment_ids=None,
               mask=None, bias=None, alibi_slopes=None, deterministic: bool | None = None):
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None if inputs_v is given")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    self_attention = inputs_k is inputs_q
    if self_attention and key_value_seq_lengths is None and key_value_segment_ids is None:
      key_value_seq_lengths, key_value_segment_ids = query_seq_lengths, query_segment_ids
    det = nn.merge_param("deterministic", self.deterministic, deterministic) \
        if self.dropout_rate > 0.0 else True
    _layers.check_no_dropout(self.dropout_rate, det, "jax_padsafe.flax_linen.MultiHeadAttention")

    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                       f"({self.num_heads})")
    head_dim = qkv_features // self.num_heads
    num_kv_heads = self.num_kv_heads or self.num_heads
    if self.num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                       f"({num_kv_heads})")

    batch_q, batch_k = inputs_q.shape[:-2], inputs_k.shape[:-2]
    valid_q = _layers.valid_rows(batch_q, inputs_q.shape[-2], query_seq_lengths, query_segment_ids)
    valid_k = _layers.valid_rows(batch_k, inputs_k.shape[-2], key_value_seq_lengths,
                                 key_value_segment_ids)
    inputs_q = _layers.select_rows(inputs_q, valid_q)
    inputs_k = _layers.select_rows(inputs_k, valid_k)
    inputs_v = _layers.select_rows(inputs_v, valid_k)

    def dense(heads, name):
      return nn.DenseGeneral(axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
                             features=(heads, head_dim), kernel_init=self.kernel_init,
                             bias_init=self.bias_init, use_bias=self.use_bias,
                             precision=self.precision, name=name)

    query = dense(self.num_heads, "query")(inputs_q)
    key = dense(num_kv_heads, "key")(inputs_k)
    value = dense(num_kv_heads, "value")(inputs_v)
    if self.normalize_qk:
      query = nn.LayerNorm(name="query_ln", use_bias=False, dtype=self.dtype,
                           param_dtype=self.param_dtype)(query)
      key = nn.LayerNorm(name="key_ln", use_bias=False, dtype=self.dtype,
                         param_dtype=self.param_dtype)(key)
    query, key, value = _promote(query, key, value, self.dtype)
    sinks = None
    if self.use_sinks:
      sinks = self.param("sinks", self.sinks_init, (self.num_heads,), self.param_dtype)
    x = attention.attend(
        query, key, value, mask=mask, bias=bias, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids, is_causal=self.is_causal,
        causal_alignment=self.causal_alignment, local_window_size=self.local_window_size,
        softcap=self.softcap, scale=self.scale, implementation=self.implementation, sinks=sinks,
        alibi_slopes=alibi_slopes)
    out = nn.DenseGeneral(features=features, axis=(-2, -1),
                          kernel_init=self.out_kernel_init or self.kernel_init,
                          bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
                          dtype=self.dtype, param_dtype=self.param_dtype,
                          precision=self.precision, name="out")(x)
    return _layers.select_rows(out, valid_q)
