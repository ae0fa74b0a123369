"""The static options of one attention call (hashable: a ``jit`` / ``custom_vjp`` static argument).

The rows of the call (which are padding, which segment and position each has, and how the kernels
see them) are the canonical problem, :class:`jax_padsafe._core.problem.Problem`; the rule that
combines both into "key ``j`` is visible to query ``i``" is :mod:`jax_padsafe._core.visibility`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Scale, masks, softcap and score terms of one call, as checked by ``checks.make_spec``."""

  scale: float
  causal: bool = False
  # (left, right) window sizes; ``None`` on a side means unbounded on that side.
  window_left: int | None = None
  window_right: int | None = None
  softcap: float | None = None
  # Number of keys processed per step of the blockwise (flash-style) loop of the pure-JAX path.
  block_k: int = 512
  # Bottom-right causal alignment. The per-row positions already include its offset; the kernels
  # take the flag and compute the offset from their sequence lengths.
  bottom_right: bool = False
  # Bitwise-reproducible gradients (the pure-JAX path always is; kernels may use atomics otherwise).
  deterministic: bool = True
  # Per-head sink logits are given (an array next to the bias): one more term in every row's softmax
  # denominator. Static, so that dispatch can tell without the array which backends take the call.
  sinks: bool = False
  # ALiBi slopes are given (an array next to the bias): the score bias -slope * |q_pos - k_pos|.
  alibi: bool = False

  @property
  def has_window(self) -> bool:
    return self.window_left is not None or self.window_right is not None
