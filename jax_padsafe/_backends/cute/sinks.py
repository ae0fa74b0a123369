"""Attention sinks around the kernels: joining a sink to a result computed without it, and the sinks' gradient.

The forward kernels join the sinks in their epilogue (``kernels/common/softmax.py``); :func:`forward` joins them
where no kernel could: decoding's split-key rewrite (chunks see part of each row) and the pure-JAX fallback.
A sink adds ``exp(sink_h)`` to every valid row's denominator. From ``(o, lse)`` without it,
``lse' = logaddexp(lse, sink)`` and ``o' = o * exp(lse - lse')``: the output is the same weighted sum of V
with every weight scaled by ``exp(lse - lse')``. In the backward, the kernels take ``o'`` and ``lse'``: they
recompute ``P = exp(s - lse')``, the probabilities *with* the sink, and ``Delta = rowsum(dO * o')`` is
``sum_j P_j dP_j`` (the sink has no value, so its ``dP`` is 0), so dQ, dK and dV come out exact without a
change to any kernel. The sink's own gradient is ``sum_i P_sink,i (dlse_i - Delta_i)`` over valid rows, with
``P_sink = exp(sink - lse')``; Delta is formed from the dQ kernel's float32 ``rowsum(P * dP)`` where the
kernels ran, rather than from ``o'`` rounded to float16 / bfloat16.

Every combination is a select on the row's state (valid with keys, valid without keys, padded), never a
multiplication by a mask: a valid row without keys gets ``o' = 0`` and ``lse' = sink`` (``-inf`` where the
head has no sink), padded rows keep ``o = 0`` and ``lse = 0``.
"""

from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32


def _heads_rows(x):
  """``[N]`` -> ``[1, N, 1]``, to broadcast against ``[B, N, T]`` row statistics."""
  return x.astype(_F32)[None, :, None]


def forward(o, lse, sinks, q_valid, stats=None):
  """``(o', lse', stats')``: the kernels' ``o [B, T, N, Hv]``, ``lse [B, N, T]`` and (aux kernels) exact row
  statistics ``(row_max, log_sum)`` with the sinks ``[N]`` joined; ``q_valid [B, T]``.

  The statistics keep their meaning (``P = exp(s - row_max - log_sum)``): ``row_max' = max(row_max, sink)``
  and ``log_sum' = log(exp(row_max - row_max' + log_sum) + exp(sink - row_max'))``, differences taken before
  the exponentials so that huge finite biases stay exact. Rows without keys keep ``(0, +inf)``."""
  sink = _heads_rows(sinks)
  valid = q_valid[:, None, :]
  has_keys = valid & (lse != -jnp.inf)
  lse_new = jnp.logaddexp(lse, sink)
  # exp(lse - lse') in (0, 1] for rows with keys; nothing else has an output to scale.
  scale = jnp.where(has_keys & (lse_new != -jnp.inf), jnp.exp(lse - jnp.where(has_keys, lse_new, 0.0)), 0.0)
  lse_new = jnp.where(valid, jnp.where(has_keys, lse_new, jnp.broadcast_to(sink, lse.shape)), 0.0)
  o_new = jnp.where(has_keys.transpose(0, 2, 1)[..., None],
                    o.astype(_F32) * jnp.transpose(scale, (0, 2, 1))[..., None], 0.0).astype(o.dtype)
  if stats is None:
    return o_new, lse_new, None
  row_max, log_sum = stats
  m_new = jnp.maximum(row_max, sink)
  log_sum_new = jnp.logaddexp((row_max - m_new) + log_sum, sink - m_new)
  row_max = jnp.where(has_keys, m_new, row_max)
  log_sum = jnp.where(has_keys, log_sum_new, log_sum)
  return o_new, lse_new, (row_max, log_sum)


def _p_sink_delta(sinks, o, lse, do, dlse, q_valid, rowsum_p_dp=None):
  """``(P_sink, Delta)`` per row ``[B, N, T]``: the sink's probability and ``rowsum(dO * o) - dlse``, 0 where
  the row has no softmax (padded, or neither keys nor a sink).  ``rowsum_p_dp`` ``[B, N, T]``: the kernels'
  ``rowsum(P * dP)`` of their recomputed P and dP, the same quantity in float32 throughout, taken instead of
  ``rowsum(dO * o)`` from ``o`` rounded to its dtype."""
  valid = q_valid[:, None, :] & (lse != -jnp.inf)
  if rowsum_p_dp is None:
    rowsum_p_dp = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1).transpose(0, 2, 1)
  delta = rowsum_p_dp.astype(_F32) - dlse.astype(_F32)
  p_sink = jnp.exp(_heads_rows(sinks) - jnp.where(valid, lse, 0.0))
  return jnp.where(valid, p_sink, 0.0), jnp.where(valid, delta, 0.0)


def sink_share(sinks, o, lse, do, dlse, q_valid, rowsum_p_dp=None):
  """``P_sink * Delta`` per row ``[B, N, T]`` (see :func:`_p_sink_delta`)."""
  p_sink, delta = _p_sink_delta(sinks, o, lse, do, dlse, q_valid, rowsum_p_dp)
  return p_sink * delta


def gradient(sinks, o, lse, do, dlse, q_valid, rowsum_p_dp=None):
  """d loss / d sinks ``[N]`` from the output ``o' [B, T, N, Hv]``, ``lse' [B, N, T]`` (sinks included) and the
  cotangents (``rowsum_p_dp``: see :func:`_p_sink_delta`); padded rows contribute exactly 0 (selected out,
  whatever they hold)."""
  return jnp.sum(-sink_share(sinks, o, lse, do, dlse, q_valid, rowsum_p_dp), axis=(0, 2)).astype(sinks.dtype)
