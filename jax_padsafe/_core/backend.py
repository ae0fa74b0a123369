"""The Backend type: a forward and a backward on the canonical problem."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Backend:
  """A forward and a backward on the canonical problem (hashable: a ``custom_vjp`` nondiff arg).

  ``forward(spec, q, k, v, bias, mask, sinks, alibi, problem) -> (o, lse)``;
  ``backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse) -> (dq, dk, dv,
  dbias, dsinks)``, with ``q [B, T, N, H]``, ``k`` ``[B, S, K, H]``, ``v`` ``[B, S, K, Hv]``,
  ``sinks`` float32 ``[N]`` or ``None`` (then ``dsinks`` is ``None``), ``alibi`` the ALiBi slopes per
  query row, float32 ``[1|B, N, 1|T]`` or ``None`` (no gradient), and ``problem`` a
  :class:`jax_padsafe._core.problem.Problem` (the pure-JAX functions read its per-row view, the
  kernels its kernel view).

  ``reads_padding_safely``: the backend never computes from padded rows of q/k/v (the kernels
  load them with predicated zero-fill or zero them in shared memory, and mask by select) and
  writes exact zeros to the padded rows of o/dq/dk/dv itself, so the caller need not zero padded
  input rows first. The pure-JAX functions need that zeroing (``attention._run`` does it for them).

  ``forward_with_stats``: optional ``forward`` for the VJP that also returns what its backward
  reads beyond ``(o, lse)`` (``-> (o, lse, stats)``); ``backward`` then takes ``stats=`` (the
  pure-JAX path keeps the row max, log-sum and float32 output: ``_backends.xla.RowStats``).
  """
  name: str
  forward: Callable
  backward: Callable
  reads_padding_safely: bool = False
  forward_with_stats: Callable | None = None
