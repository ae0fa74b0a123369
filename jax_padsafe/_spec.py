"""Static description of an attention problem, shared by every backend.

Every public entry point (padded, packed, segment ids) is reduced to one canonical problem before a
backend sees it:

* ``q [B, T, N, H]``, ``k``/``v`` ``[B, S, K, H]`` (packed inputs become ``B = 1``),
* per-row int32 *segment* arrays ``q_seg [B, T]`` / ``k_seg [B, S]``: ``-1`` marks a padded row,
  any other value is the segment (sequence) the row belongs to,
* per-row int32 *position* arrays ``q_pos`` / ``k_pos``: the coordinate the causal and window masks
  compare. Query positions already include the alignment offset (``kv_len - q_len`` for
  bottom-right), so the masks never look at padded shapes.

Key ``j`` is visible to query ``i`` iff both rows are valid, their segments match, the causal/window
predicates on ``(q_pos[i], k_pos[j])`` hold, the optional boolean ``mask`` allows it and the optional
``bias`` is not ``-inf`` there. ``AttentionSpec`` carries the static (hashable) part of that rule.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Static parameters of one attention call (hashable: used as a ``custom_vjp`` nondiff arg)."""

  scale: float
  causal: bool = False
  # (left, right) window sizes; ``None`` on a side means unbounded on that side.
  window_left: int | None = None
  window_right: int | None = None
  softcap: float | None = None
  # Number of keys processed per step of the blockwise (flash-style) loop of the pure-JAX path.
  block_k: int = 512
  # Kernel-only facts (the pure-JAX path has them folded into the position arrays already).
  bottom_right: bool = False
  # Bitwise-reproducible gradients (the pure-JAX path always is; kernels may use atomics otherwise).
  deterministic: bool = False
  packed: bool = False  # packed (varlen) layout: canonical B == 1 holding every sequence
  max_seqlen_q: int | None = None
  max_seqlen_k: int | None = None
  # The kernels' view of the rows is dense: batch row b owns query rows [b*T, (b+1)*T) and key rows
  # [b*S, (b+1)*S) as one sequence (the lengths path). Then the kernels' tiles cover every row, and
  # kernels that write their tiles' padded rows as zeros need no memset of o/dq/dk/dv first.
  dense_rows: bool = False

  @property
  def has_window(self) -> bool:
    return self.window_left is not None or self.window_right is not None
