"""The differentiable entry to every backend: one ``jax.custom_vjp`` on the canonical problem."""

from __future__ import annotations

import functools

import jax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attention(spec, backend, q, k, v, bias, mask, sinks, alibi, problem):
  """Differentiable pad-safe attention; returns ``(o, lse)``.

  ``spec`` (:class:`AttentionSpec`) and ``backend`` (:class:`Backend`) are static; ``problem`` (a
  :class:`Problem` pytree of int32 arrays) and ``alibi`` (ALiBi slopes, float32 ``[1|B, N, 1|T]`` or
  ``None``: not differentiated) get no gradient; ``bias`` and ``sinks`` (float32 ``[N]`` or ``None``)
  do.
  """
  return backend.forward(spec, q, k, v, bias, mask, sinks, alibi, problem)


def _attention_fwd(spec, backend, q, k, v, bias, mask, sinks, alibi, problem):
  if backend.forward_with_stats is None:
    o, lse = backend.forward(spec, q, k, v, bias, mask, sinks, alibi, problem)
    return (o, lse), (q, k, v, bias, mask, sinks, alibi, problem, o, lse, None)
  o, lse, stats = backend.forward_with_stats(spec, q, k, v, bias, mask, sinks, alibi, problem)
  return (o, lse), (q, k, v, bias, mask, sinks, alibi, problem, o, lse, stats)


def _attention_bwd(spec, backend, res, cotangents):
  do, dlse = cotangents
  *res, stats = res
  kw = {} if stats is None else {"stats": stats}
  dq, dk, dv, dbias, dsinks = backend.backward(spec, *res, do, dlse, **kw)
  return dq, dk, dv, dbias, None, dsinks, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
