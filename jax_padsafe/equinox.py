"""Equinox integration: pad-safe multi-head attention as an Equinox module.

:class:`MultiheadAttention` follows ``equinox.nn.MultiheadAttention``: a PyTree module whose
``__call__`` takes one **unbatched** sequence (``query [q_seq, query_size]``, ``key_``/``value``
``[kv_seq, key_size]``; ``jax.vmap`` it over a batch), ``key=`` is the PRNG key keyword, and the
projections ``query_proj``, ``key_proj``, ``value_proj``, ``output_proj`` are ``eqx.nn.Linear`` built
from the same key split, so the same ``key`` gives the same parameters as Equinox's layer.

Additions: ``query_length`` / ``kv_length`` (scalar ints: rows at or past them are padding) and
segment ids (``[q_seq]`` / ``[kv_seq]``, negative = padding); ``num_kv_heads`` for grouped-query
attention; ``is_causal``, ``causal_alignment``, ``local_window_size``, ``softcap``, ``scale``,
``implementation`` as in :func:`jax_padsafe.dot_product_attention`. Padded input rows are selected
to zero before the projections and padded output rows are exactly zero. Rotary embeddings go through
Equinox's ``process_heads`` hook (e.g. ``eqx.nn.RotaryPositionalEmbedding``), as in Equinox.

Requires ``equinox`` (``pip install "jax_padsafe[equinox]"``). Dropout on the attention weights is
not supported: ``dropout_p > 0`` outside inference mode raises ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

try:
  import equinox as eqx
except ImportError as e:  # pragma: no cover - exercised only without equinox
  raise ImportError("jax_padsafe.equinox needs Equinox: pip install 'jax_padsafe[equinox]'") from e

from jax_padsafe import attention
from jax_padsafe._core import layers as _layers

__all__ = ["MultiheadAttention"]


class MultiheadAttention(eqx.Module):
  """Pad-safe multi-head attention in Equinox's style (see the module docstring)."""

  query_proj: eqx.nn.Linear
  key_proj: eqx.nn.Linear
  value_proj: eqx.nn.Linear
  output_proj: eqx.nn.Linear

  num_heads: int = eqx.field(static=True)
  num_kv_heads: int = eqx.field(static=True)
  query_size: int = eqx.field(static=True)
  key_size: int = eqx.field(static=True)
  value_size: int = eqx.field(static=True)
  output_size: int = eqx.field(static=True)
  qk_size: int = eqx.field(static=True)
  vo_size: int = eqx.field(static=True)
  dropout_p: float = eqx.field(static=True)
  inference: bool
  is_causal: bool = eqx.field(static=True)
  causal_alignment: str = eqx.field(static=True)
  local_window_size: Any = eqx.field(static=True)
  softcap: float | None = eqx.field(static=True)
  scale: float | None = eqx.field(static=True)
  implementation: str | None = eqx.field(static=True)

  def __init__(self, num_heads: int, query_size: int, key_size: int | None = None,
               value_size: int | None = None, output_size: int | None = None,
               qk_size: int | None = None, vo_size: int | None = None,
               use_query_bias: bool = False, use_key_bias: bool = False,
               use_value_bias: bool = False, use_output_bias: bool = False,
               dropout_p: float = 0.0, inference: bool = False, dtype=None, *,
               num_kv_heads: int | None = None, is_causal: bool = False,
               causal_alignment: str = "top_left", local_window_size=None,
               softcap: float | None = None, scale: float | None = None,
               implementation: str | None = None, key):
    qkey, kkey, vkey, okey = jax.random.split(key, 4)
    key_size = query_size if key_size is None else key_size
    value_size = query_size if value_size is None else value_size
    qk_size = query_size // num_heads if qk_size is None else qk_size
    vo_size = query_size // num_heads if vo_size is None else vo_size
    output_size = query_size if output_size is None else output_size
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    self.query_proj = eqx.nn.Linear(query_size, num_heads * qk_size, use_bias=use_query_bias,
                                    dtype=dtype, key=qkey)
    self.key_proj = eqx.nn.Linear(key_size, num_kv_heads * qk_size, use_bias=use_key_bias,
                                  dtype=dtype, key=kkey)
    self.value_proj = eqx.nn.Linear(value_size, num_kv_heads * vo_size, use_bias=use_value_bias,
                                    dtype=dtype, key=vkey)
    self.output_proj = eqx.nn.Linear(num_heads * vo_size, output_size, use_bias=use_output_bias,
                                     dtype=dtype, key=okey)
    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
    self.query_size, self.key_size, self.value_size = query_size, key_size, value_size
    self.output_size, self.qk_size, self.vo_size = output_size, qk_size, vo_size
    self.dropout_p, self.inference = dropout_p, inference
    self.is_causal, self.causal_alignment = is_causal, causal_alignment
    self.local_window_size, self.softcap = local_window_size, softcap
    self.scale, self.implementation = scale, implementation

  def __call__(self, query, key_, value, mask=None, *, query_length=None, kv_length=None,
               query_segment_ids=None, kv_segment_ids=None, bias=None, sinks=None, alibi_slopes=None,
               key=None, inference: bool | None = None, process_heads: Callable | None = None):
    """**Arguments:** Equinox's (``query [q_seq, query_size]``, ``key_``/``value``
    ``[kv_seq, key/value_size]``, ``mask`` ``[q_seq, kv_seq]`` or ``[num_heads, q_seq, kv_seq]``,
    ``key``, ``inference``, ``process_heads``), plus ``query_length`` / ``kv_length`` (int scalars),
    ``query_segment_ids`` / ``kv_segment_ids``, an additive ``bias`` shaped like ``mask``, ``sinks``
    (``[num_heads]``, e.g. a field of the enclosing model: differentiable) and ``alibi_slopes``
    (``[num_heads]``), as in :func:`jax_padsafe.dot_product_attention` (pure-JAX path).

    **Returns:** ``[q_seq, output_size]``; rows at or past ``query_length`` (or with a negative
    segment id) are exactly zero.
    """
    del key  # only dropout would use it, and attention-weight dropout is not supported
    inference = self.inference if inference is None else inference
    _layers.check_no_dropout(self.dropout_p, inference, "jax_padsafe.equinox.MultiheadAttention")
    if query.ndim != 2 or key_.ndim != 2 or value.ndim != 2:
      raise ValueError("MultiheadAttention takes unbatched [seq, features] inputs (use jax.vmap); "
                       f"got {query.shape}, {key_.shape}, {value.shape}")
    if key_.shape[0] != value.shape[0]:
      raise ValueError("key and value must both be sequences of equal length.")
    q_seq, kv_seq = query.shape[0], key_.shape[0]
    valid_q = _layers.valid_rows((), q_seq, query_length, query_segment_ids)
    valid_k = _layers.valid_rows((), kv_seq, kv_length, kv_segment_ids)
    query = _layers.select_rows(query, valid_q)
    key_ = _layers.select_rows(key_, valid_k)
    value = _layers.select_rows(value, valid_k)

    q = jax.vmap(self.query_proj)(query).reshape(q_seq, self.num_heads, self.qk_size)
    k = jax.vmap(self.key_proj)(key_).reshape(kv_seq, self.num_kv_heads, self.qk_size)
    v = jax.vmap(self.value_proj)(value).reshape(kv_seq, self.num_kv_heads, self.vo_size)
    if process_heads is not None:
      shapes = (q.shape, k.shape, v.shape)
      q, k, v = process_heads(q, k, v)
      if (q.shape, k.shape, v.shape) != shapes:
        raise ValueError("process_heads must not change the shape of the heads.")
    dtype = jnp.result_type(q, k, v)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    if mask is not None and jnp.ndim(mask) == 2:
      mask = mask[None]
    if bias is not None and jnp.ndim(bias) == 2:
      bias = bias[None]
    attn = attention.attend(
        q, k, v, mask=mask, bias=bias, query_seq_lengths=query_length,
        key_value_seq_lengths=kv_length, query_segment_ids=query_segment_ids,
        key_value_segment_ids=kv_segment_ids, is_causal=self.is_causal,
        causal_alignment=self.causal_alignment, local_window_size=self.local_window_size,
        softcap=self.softcap, scale=self.scale, implementation=self.implementation, sinks=sinks,
        alibi_slopes=alibi_slopes)
    out = jax.vmap(self.output_proj)(attn.reshape(q_seq, self.num_heads * self.vo_size))
    return _layers.select_rows(out, valid_q)
