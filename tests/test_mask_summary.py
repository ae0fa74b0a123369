"""The mask's block summary the kernels skip tiles by (``_backends/cute/aux.block_summary``), against a direct
count per block on random masks of odd sizes: a wrong HIDDEN or VISIBLE entry, or a range that misses a visible
cell, would make the kernels drop or mis-mask keys."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_padsafe._backends.cute import aux


def _counted(bx, tx, s, q_len, kv_len):
  """[Bx, Tx, S]: the cells inside a valid rectangle of a sequence the slice serves (a mask broadcast over
  queries, Tx = 1, stands for every row)."""
  rows = np.arange(tx)[:, None] if tx > 1 else np.zeros((1, 1), int)
  inside = (rows[None] < q_len[:, None, None]) & (np.arange(s)[None, None] < kv_len[:, None, None])
  return inside if bx > 1 else inside.any(axis=0, keepdims=True)


def _direct(mask, q_len=None, kv_len=None):
  """The summary counted cell by cell; with lengths, cells outside every valid rectangle of the sequences a
  slice serves do not count (a block without a counted cell is hidden)."""
  bx, hx, tx, s = mask.shape
  counted = np.ones((bx, tx, s), bool) if q_len is None else _counted(bx, tx, s, q_len, kv_len)
  mx, nx = -(-tx // aux.MAP_ROWS), -(-s // aux.MAP_COLS)
  tile_map = np.zeros((bx, hx, mx, nx), np.uint8)
  row_range = np.zeros((bx, hx, mx, 2), np.int32)
  col_range = np.zeros((bx, hx, nx, 2), np.int32)
  for b in range(bx):
    for h in range(hx):
      for r in range(mx):
        for c in range(nx):
          block = np.s_[r * aux.MAP_ROWS:(r + 1) * aux.MAP_ROWS, c * aux.MAP_COLS:(c + 1) * aux.MAP_COLS]
          cells = mask[b, h][block][counted[b][block]]
          tile_map[b, h, r, c] = (aux.VISIBLE if cells.size and cells.all() else aux.MIXED if cells.any()
                                  else aux.HIDDEN)
      seen = tile_map[b, h] != aux.HIDDEN
      for r in range(mx):
        cols = np.nonzero(seen[r])[0]
        row_range[b, h, r] = (cols.min(), cols.max() + 1) if cols.size else (nx, 0)
      for c in range(nx):
        rows = np.nonzero(seen[:, c])[0]
        col_range[b, h, c] = (rows.min(), rows.max() + 1) if rows.size else (mx, 0)
  return tile_map, row_range, col_range


# S = 72: a partial last block column of a width that is a multiple of 4; 256: whole block columns only.
@pytest.mark.parametrize("shape", [(2, 1, 100, 70), (1, 3, 1, 33), (1, 1, 64, 16), (3, 2, 37, 129),
                                   (2, 1, 50, 72), (1, 2, 40, 256)])
@pytest.mark.parametrize("kind", ["random", "causal", "sparse"])
def test_block_summary(shape, kind):
  rng = np.random.default_rng(sum(shape))
  if kind == "random":
    mask = rng.random(shape) < 0.7
  elif kind == "causal":
    mask = np.broadcast_to(np.tril(np.ones(shape[2:], bool), k=shape[3] - shape[2]), shape)
  else:
    mask = rng.random(shape) < 0.01
  got = aux.block_summary(jnp.asarray(mask))
  for name, a, e in zip(("tile_map", "row_range", "col_range"), got, _direct(np.asarray(mask))):
    np.testing.assert_array_equal(np.asarray(a), e, err_msg=name)


@pytest.mark.parametrize("shape", [(3, 1, 100, 70), (1, 2, 37, 129), (1, 1, 1, 33), (3, 1, 1, 40), (3, 2, 64, 48)])
def test_block_summary_counts_valid_cells_only(shape):
  """With the sequences' lengths, cells that every sequence a slice serves sees as padding do not count: any
  value there (here: random cells) leaves the summary as it is with those cells all False, so poisoned mask
  padding can neither widen a tile range nor change a tile's class."""
  rng = np.random.default_rng(sum(shape))
  q_len = np.array([0, shape[2] // 2, shape[2] - 1]) if shape[2] > 1 else np.array([0, 1, 1])
  kv_len = np.array([shape[3], 0, shape[3] - 7])
  mask = rng.random(shape) < 0.6
  got = aux.block_summary(jnp.asarray(mask), jnp.asarray(q_len, jnp.int32), jnp.asarray(kv_len, jnp.int32))
  want = _direct(mask, q_len, kv_len)
  for name, a, e in zip(("tile_map", "row_range", "col_range"), got, want):
    np.testing.assert_array_equal(np.asarray(a), e, err_msg=name)
  # The same summary with every uncounted cell flipped.
  inside = _counted(shape[0], shape[2], shape[3], q_len, kv_len)
  flipped = np.where(inside[:, None], mask, ~mask)
  again = aux.block_summary(jnp.asarray(flipped), jnp.asarray(q_len, jnp.int32), jnp.asarray(kv_len, jnp.int32))
  for name, a, e in zip(("tile_map", "row_range", "col_range"), again, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
