"""The compact tile schedule of the Hopper kernels (`jax_padsafe/kernels/bounds.py`), checked on the CPU.

The kernels run `bounds.compact_tile` on the GPU (tests/gpu/check_forward.py and check_backward.py, the
`compact_*` cases, run it against the float64 oracle). Here a line-by-line NumPy model of the same search
(32 lanes, one ballot per round) checks the claims the schedule rests on, for random packed layouts:

* every tile that starts inside its sequence's slot has exactly one compact index, and every other index is
  a hole (a tile at or past its slot's end, which the kernels skip);
* every compact index is below `compact_tiles_per_head` (total rows // block + batch), the grid the host
  launches without reading the offsets;
* the search takes at most ceil(log32(batch)) rounds.
"""

import numpy as np
import pytest

BLOCK = 128


def compact_tile_model(v, cu, batch, block):
  """NumPy model of bounds.compact_tile: (b, m, rounds)."""
  lanes = np.arange(32)
  lo, count, rounds = 0, batch, 0
  while count > 1:
    stride = (count + 31) // 32
    cand = lo + lanes * stride
    inside = cand < lo + count
    f = cu[np.minimum(cand, batch - 1)] // block + cand
    hit = inside & (f <= v)
    k = max(int(hit.sum()) - 1, 0)
    # the model also checks what the kernel assumes: the hits are a prefix of the lanes
    assert not hit[k + 1:].any() and hit[:k + 1].all() or k == 0
    new_lo = lo + k * stride
    count = min(stride, lo + count - new_lo)
    lo = new_lo
    rounds += 1
  m = v - (cu[lo] // block + lo)
  if m < 0:
    m = -(-max(int(cu[lo + 1] - cu[lo]), 0) // block)
  return lo, m, rounds


def random_layout(rng, batch, max_len):
  """Non-decreasing offsets with empty slots, unused leading rows and a tail, as the API passes them."""
  slots = rng.integers(0, max_len + 1, batch)
  slots[rng.random(batch) < 0.2] = 0
  lead = int(rng.choice([0, 5, 127, 128, 300, 1000]))
  cu = np.concatenate([[0], np.cumsum(slots)]).astype(np.int64) + lead
  total = int(cu[-1]) + int(rng.integers(0, 200))
  return cu, total


@pytest.mark.parametrize("seed,batch,max_len", [(0, 1, 5000), (1, 2, 300), (2, 9, 1300), (3, 33, 700),
                                                (4, 200, 400), (5, 1025, 90), (6, 3000, 260)])
def test_compact_schedule_covers_every_tile_once(seed, batch, max_len):
  rng = np.random.default_rng(seed)
  cu, total = random_layout(rng, batch, max_len)
  per_head = total // BLOCK + batch          # bounds.compact_tiles_per_head
  want = {(b, m) for b in range(batch) for m in range(-(-int(cu[b + 1] - cu[b]) // BLOCK))}
  seen = {}
  max_rounds = int(np.ceil(np.log(batch) / np.log(32) - 1e-9)) if batch > 1 else 0
  for v in range(per_head + 3 * BLOCK):      # past the grid too: those must be holes or absent
    b, m, rounds = compact_tile_model(v, cu, batch, BLOCK)
    assert rounds <= max_rounds
    if m * BLOCK < cu[b + 1] - cu[b]:         # a tile with rows
      assert (b, m) not in seen, f"tile {(b, m)} at v={seen.get((b, m))} and v={v}"
      assert v < per_head, f"tile {(b, m)} at v={v} is past the grid of {per_head} per head"
      seen[(b, m)] = v
  assert set(seen) == want


def test_compact_schedule_halves_a_skewed_grid():
  """The host's choice (bounds.use_compact_grid): the compact grid where it launches at most half the dense one."""
  lens = [8192] + [128] * 64                  # benchmarks/bench_varlen.py's "one_long"
  batch, total = len(lens), sum(lens)
  dense = -(-max(lens) // BLOCK) * batch
  compact = total // BLOCK + batch
  assert 2 * compact <= dense                 # taken: 193 tiles per head instead of 4160
  balanced = [2048] * 8                       # a balanced batch keeps the dense grid (and its kernel)
  assert not 2 * (sum(balanced) // BLOCK + 8) <= -(-2048 // BLOCK) * 8
