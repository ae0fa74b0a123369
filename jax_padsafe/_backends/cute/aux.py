"""Masks and biases for the kernels: their operands in kernel form and the mask's block summary.

The aux kernel variants (``jax_padsafe/kernels/common/aux_scores.py``) read a boolean mask and an
additive bias ``[Bx, Hx, Tx, S]`` (``Bx`` in {1, B}, ``Hx`` in {1, N}, ``Tx`` in {1, T}: the broadcast
dimensions stay size 1, nothing of size T x S is materialised) element by element inside the valid
rectangle only. Before the kernels, :func:`block_summary` reads the mask once and classifies every
block of ``MAP_ROWS`` queries x ``MAP_COLS`` keys as hidden, mixed or visible, with the first and last
block holding a visible cell per block row and per block column. The kernels narrow their tile ranges
to those (a hidden tile at the start or end of a row of tiles is never loaded or computed) and skip the
mask load and select on visible tiles, so a causal + padding mask costs about what ``is_causal`` plus
lengths cost. The summary is tiny (``T/32 x S/16`` bytes per (Bx, Hx)); the block sizes divide every
kernel tile, so one summary serves every kernel and direction.

The summary counts only the cells inside some valid rectangle its slice serves (``q_len`` x ``kv_len`` of a
sequence; with ``Bx = 1`` of any sequence): a cell every sequence sees as padding may hold anything, and it
must not move a tile range. The dQ kernels take their reference key (``kernels/common/dq_shift.py``) from the
first key tile they visit, so a poisoned padding cell that widened a range would change dQ's rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

MAP_ROWS = 32  # = aux_scores.MAP_ROWS
MAP_COLS = 16  # = aux_scores.MAP_COLS
HIDDEN, MIXED, VISIBLE = 0, 1, 2  # = aux_scores.HIDDEN, MIXED, VISIBLE


class AuxOperands(NamedTuple):
  """The aux kernels' operands; an absent mask or bias is a ``(1, 1, 1, 1)`` placeholder."""
  mask: jax.Array       # bool [Bx, Hx, Tx, S]
  bias: jax.Array       # q's dtype or float32 [Bx, Hx, Tx, S]
  tile_map: jax.Array   # uint8 [Bx, Hx, ceil(Tx/32), ceil(S/16)]
  row_range: jax.Array  # int32 [Bx, Hx, ceil(Tx/32), 2]
  col_range: jax.Array  # int32 [Bx, Hx, ceil(S/16), 2]
  slopes: jax.Array     # float32 [Bx, N, 1, 1]: ALiBi slopes (the kernels compute each score's term)
  has_mask: bool
  has_bias: bool
  has_alibi: bool = False

  @property
  def arrays(self) -> tuple:
    """The operands in the kernels' order (mask, bias, block map, row ranges, column ranges, slopes)."""
    return (self.mask, self.bias, self.tile_map, self.row_range, self.col_range, self.slopes)

  @property
  def flags(self) -> dict:
    """The static flags the kernel calls take with them."""
    return dict(has_mask=self.has_mask, has_bias=self.has_bias, has_alibi=self.has_alibi)


def unsupported_reason(problem, q, bias, mask) -> str | None:
  """Why the aux kernels cannot take this call's mask / bias (None: they can; ALiBi slopes need only the
  padded layout with lengths)."""
  if problem.packed or not problem.dense_rows:
    return ("the CuTe kernels take a mask, bias or ALiBi slopes on the padded layout with lengths only (not "
            "with segment ids or the packed layout)")
  n = q.shape[2]
  for name, x in (("mask", mask), ("bias", bias)):
    if x is None:
      continue
    if x.shape[3] == 1 and problem.max_seqlen_k != 1:
      return f"the CuTe kernels need the {name} given per key (its last dimension is 1)"
    if x.shape[1] not in (1, n):
      return f"the CuTe kernels need the {name}'s head dimension to be 1 or {n}"
  if bias is not None and bias.dtype not in (q.dtype, jnp.float32):
    return f"the CuTe kernels take a bias of q's dtype ({q.dtype}) or float32, not {bias.dtype}"
  return None


def block_summary(mask, q_len=None, kv_len=None):
  """``(tile_map, row_range, col_range)`` of a boolean mask ``[Bx, Hx, Tx, S]`` (module docstring).

  One pass over the mask. With the sequences' lengths (int32 ``[B]`` each) only cells inside a valid
  rectangle count; without them, every cell inside the tensor. A block without a counted cell is hidden.
  Cells past the tensor's end (the last block row / column) count as neither visible nor hidden."""
  bx, hx, tx, s = mask.shape
  mx, nx = -(-tx // MAP_ROWS), -(-s // MAP_COLS)
  # keys[., i]: the number of leading keys of row i that some sequence the slice serves sees (row i of a
  # mask broadcast over queries stands for every row).
  if q_len is None:
    keys = jnp.full((bx, tx), s, jnp.int32)
  else:
    rows = jnp.arange(tx, dtype=jnp.int32)[None, :]
    seen = jnp.where(rows < (q_len[:, None] if tx > 1 else jnp.minimum(q_len[:, None], 1)), kv_len[:, None], 0)
    keys = seen if bx > 1 else jnp.max(seen, axis=0, keepdims=True)
    keys = jnp.minimum(keys, s).astype(jnp.int32)

  # One pass: the number of visible counted cells per block (keys first, the contiguous axis, then rows; one
  # reduction over a 6-D view's axes (3, 5) measured ~3x slower), against the number of the block's counted
  # cells.  H100, a [4, 1, 4096, 4096] mask: 0.054 ms, where separate `any` and `all` passes took 0.067 ms
  # (0.165 / 0.170 ms at 8192).
  x = mask
  if q_len is not None:
    x = x & (jnp.arange(s, dtype=jnp.int32)[None, None, None, :] < keys[:, None, :, None])
  x = x.astype(jnp.int32)
  if s % MAP_COLS:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, nx * MAP_COLS - s)))
  x = jnp.sum(x.reshape(bx, hx, tx, nx, MAP_COLS), axis=4)
  if tx % MAP_ROWS:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, mx * MAP_ROWS - tx), (0, 0)))
  count = jnp.sum(x.reshape(bx, hx, mx, MAP_ROWS, nx), axis=3)
  # Counted cells per block: per row, the block column's share of the row's leading keys.
  per_row = jnp.clip(keys[:, :, None] - MAP_COLS * jnp.arange(nx, dtype=jnp.int32), 0, MAP_COLS)
  if tx % MAP_ROWS:
    per_row = jnp.pad(per_row, ((0, 0), (0, mx * MAP_ROWS - tx), (0, 0)))
  counted = jnp.sum(per_row.reshape(per_row.shape[0], mx, MAP_ROWS, nx), axis=2)[:, None]
  any_visible = count > 0
  all_visible = (count == counted) & any_visible
  tile_map = jnp.where(all_visible, VISIBLE, jnp.where(any_visible, MIXED, HIDDEN)).astype(jnp.uint8)
  cols = jnp.arange(nx, dtype=jnp.int32)
  rows = jnp.arange(mx, dtype=jnp.int32)[:, None]
  # Empty block rows get (nx, 0) and empty columns (mx, 0): min / max over several of them stay empty.
  row_range = jnp.stack([jnp.min(jnp.where(any_visible, cols, nx), axis=3),
                         jnp.max(jnp.where(any_visible, cols + 1, 0), axis=3)], axis=-1)
  col_range = jnp.stack([jnp.min(jnp.where(any_visible, rows, mx), axis=2),
                         jnp.max(jnp.where(any_visible, rows + 1, 0), axis=2)], axis=-1)
  return tile_map, row_range.astype(jnp.int32), col_range.astype(jnp.int32)


def operands(bias, mask, summary=(), alibi_slopes=None, lengths=(None, None)) -> AuxOperands:
  """The kernels' aux operands for a call with ``bias``, ``mask`` (rank 4, broadcastable) and / or ALiBi
  slopes (``[N]`` or ``[B, N]``); ``summary``: the mask's :func:`block_summary` where the forward made it
  already; ``lengths``: the sequences' ``(q_len, kv_len)`` that summary counts cells by."""
  has_mask, has_bias, has_alibi = mask is not None, bias is not None, alibi_slopes is not None
  if has_mask:
    tile_map, row_range, col_range = summary or block_summary(mask, *lengths)
  else:
    mask = jnp.ones((1, 1, 1, 1), jnp.bool_)
    tile_map = jnp.full((1, 1, 1, 1), VISIBLE, jnp.uint8)
    row_range = col_range = jnp.zeros((1, 1, 1, 2), jnp.int32)
  if not has_bias:
    bias = jnp.zeros((1, 1, 1, 1), jnp.float32)
  if has_alibi:
    slopes = jnp.asarray(alibi_slopes, jnp.float32)
    slopes = slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape + (1, 1))
  else:
    slopes = jnp.zeros((1, 1, 1, 1), jnp.float32)
  return AuxOperands(mask, bias, tile_map, row_range, col_range, slopes, has_mask, has_bias, has_alibi)
