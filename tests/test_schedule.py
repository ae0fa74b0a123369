"""The kernels' tile schedules (`jax_padsafe/kernels/common/bounds.py`), checked on the CPU.

The kernels run `bounds.compact_tile` on the GPU (tests/gpu/test_schedules.py, the `compact` cases, run it
against the float64 oracle). Here a line-by-line NumPy model of the same search
(32 lanes, one ballot per round) checks the claims the schedule rests on, for random packed layouts:

* every tile that starts inside its sequence's slot has exactly one compact index, and every other index is
  a hole (a tile at or past its slot's end, which the kernels skip);
* every compact index is below `compact_tiles_per_head` (total rows // block + batch), the grid the host
  launches without reading the offsets;
* the search takes at most ceil(log32(batch)) rounds;
* the rows the row-zeroing kernel finds (`kernels/common/row_zeroing.py`) and the rows either grid's tiles write make up
  every row, and no valid row is zeroed (the claim behind skipping the memsets of the outputs);
* a float64 replay of the SM80-class backward's tile loop (which tiles each CTA visits, which skip the mask)
  gives the oracle's gradients.
"""

import dataclasses

import numpy as np
import pytest

from tests import helpers, oracle

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


def claimed_compact_tile_model(lin, per_head, heads, cu, batch, block, last_first):
  """NumPy model of bounds.claimed_compact_tile: (head, b, m) of the lin-th claim of a tile queue."""
  if last_first:
    lin = per_head * heads - 1 - lin
  head = min(lin // per_head, heads - 1)
  b, m, _ = compact_tile_model(lin - head * per_head, cu, batch, block)
  return head, b, m


@pytest.mark.parametrize("last_first", [False, True])
@pytest.mark.parametrize("seed,batch,max_len,heads", [(10, 3, 900, 5), (11, 70, 300, 3), (12, 400, 200, 2)])
def test_tile_queue_claims_cover_every_tile_once_in_launch_order(seed, batch, max_len, heads, last_first):
  """The persistent CTAs of the compact schedules (kernels/tile_queue.py) claim numbers 0, 1, ... from a counter
  until per_head x heads, and skip the holes (a tile at or past its slot's end).  The tiles they take are every
  (head, sequence, tile) with rows, exactly once, in the order the one-CTA-per-tile kernels were launched
  (blockIdx.x fastest, then the head in blockIdx.y; `last_first`: that order reversed, as the forward and the
  dQ kernel take it)."""
  rng = np.random.default_rng(seed)
  cu, total = random_layout(rng, batch, max_len)
  per_head = total // BLOCK + batch
  claimed = []
  for lin in range(per_head * heads):
    head, b, m = claimed_compact_tile_model(lin, per_head, heads, cu, batch, BLOCK, last_first)
    if m * BLOCK < cu[b + 1] - cu[b]:        # not a hole: the producer publishes it
      claimed.append((head, b, m))
  launched = []
  for y in range(heads):
    for x in range(per_head):
      b, m, _ = compact_tile_model(x, cu, batch, BLOCK)
      if m * BLOCK < cu[b + 1] - cu[b]:
        launched.append((y, b, m))
  assert claimed == (launched[::-1] if last_first else launched)
  assert len(set(claimed)) == len(claimed) == heads * sum(-(-int(cu[b + 1] - cu[b]) // BLOCK) for b in range(batch))


def test_compact_schedule_halves_a_skewed_grid():
  """The host's choice (bounds.use_compact_grid): the compact grid where it launches at most half the dense one."""
  lens = [8192] + [128] * 64                  # benchmarks/bench_varlen.py's "one_long"
  batch, total = len(lens), sum(lens)
  dense = -(-max(lens) // BLOCK) * batch
  compact = total // BLOCK + batch
  assert 2 * compact <= dense                 # taken: 193 tiles per head instead of 4160
  balanced = [2048] * 8                       # a balanced batch keeps the dense grid (and its kernel)
  assert not 2 * (sum(balanced) // BLOCK + 8) <= -(-2048 // BLOCK) * 8


# --------------------------------------------------------------------------------------------------------
# The row zeroing (`jax_padsafe/kernels/common/row_zeroing.py`): on packed layouts the handlers skip the memsets of
# O, dQ, dK, dV under the Hopper kernels and zero only the rows `row_outside_tiles` finds.  That is the
# memset's result only if those rows and the rows the tiles write together make up every row, for either
# grid, and if the zeroed rows never include a valid one.  The GPU checks run the kernels themselves with
# NaN-filled outputs (JAX_PADSAFE_POISON_OUTPUTS=1); here NumPy models check the claim for random layouts.


def row_outside_tiles_model(cu, batch, row, bound):
  """NumPy model of row_zeroing.row_outside_tiles (the same bracketing search)."""
  if not (cu[0] <= row < cu[batch]):
    return True
  lo, hi = 0, batch
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if cu[mid] <= row:
      lo = mid
    else:
      hi = mid
  assert cu[lo] <= row < cu[lo + 1]
  return row - cu[lo] >= bound


def rows_of_tiles(cu, batch, tiles_of, block):
  """Rows the kernels write: tile m of sequence b writes [cu[b] + m block, cu[b] + (m + 1) block) clipped to its
  slot end (valid rows computed, the rest as zeros)."""
  rows = set()
  for b in range(batch):
    for m in tiles_of(b):
      rows.update(range(int(cu[b]) + m * block, min(int(cu[b]) + (m + 1) * block, int(cu[b + 1]))))
  return rows


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("block", [64, 80, 112, 128])
def test_row_zeroing_and_tiles_cover_every_row(seed, block):
  rng = np.random.default_rng(100 + seed)
  batch = int(rng.choice([1, 2, 7, 40]))
  cu, total = random_layout(rng, batch, int(rng.choice([50, 300, 1300])))
  slots = np.diff(cu)
  # The bound the kernels get: at least every used length; below the longest slot in half the draws (traced
  # offsets with a sequence past max_seqlen, segment-id runs), the buffer's length in some.
  used = np.minimum(slots, rng.integers(0, slots.max(initial=0) + 1, batch))
  bound = int(rng.choice([max(int(used.max(initial=0)), 1), max(int(slots.max(initial=0)), 1), total]))
  used = np.minimum(used, bound)
  zeroed = {r for r in range(total) if row_outside_tiles_model(cu, batch, r, bound)}
  dense = rows_of_tiles(cu, batch, lambda b: range(-(-bound // block)), block)
  compact = rows_of_tiles(cu, batch, lambda b: range(-(-int(slots[b]) // block)), block)
  valid = {int(cu[b]) + i for b in range(batch) for i in range(int(used[b]))}
  for grid in (dense, compact):
    assert grid | zeroed == set(range(total))
    assert grid <= set(range(total))
  # Rows both zeroed and in a tile (a dense tile reaching past the bound into a longer slot) are padding: the
  # tile writes them as zeros too, after the row zeroing (stream order), so the result is still exact zeros.
  assert not zeroed & valid


# --------------------------------------------------------------------------------------------------
# The SM80-class backward: which tiles each CTA visits, replayed in float64 against the oracle
# --------------------------------------------------------------------------------------------------

def emulate_tiles(q, k, v, o, lse, do, dlse, cu_q, cu_k, uq, uk, *, scale, causal, bottom_right, left, right,
         softcap, BM=64, BN=64):
  """float64 NumPy replay of the SM80-class backward kernels' tile schedule (jax_padsafe/kernels/sm80/ and
  kernels/common/bounds.py): which tiles each CTA visits (m_block_range / n_block_range), when masking is skipped
  (tile_needs_mask), zero-filled rows, the lse sentinel and the selects.  Checks the index logic on the
  CPU; it says nothing about the DSL code generation."""
  total_q, N, H = q.shape
  K = k.shape[1]
  g = N // K
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(k.shape)
  for b in range(len(uq)):
    q_start, k_start = int(cu_q[b]), int(cu_k[b])
    q_len = min(max(int(uq[b]), 0), max(int(cu_q[b + 1] - cu_q[b]), 0))
    k_len = min(max(int(uk[b]), 0), max(int(cu_k[b + 1] - cu_k[b]), 0))
    off = k_len - q_len if bottom_right else 0
    big = q_len + k_len
    lw = left if left is not None and left >= 0 else big
    rw = 0 if causal else (right if right is not None and right >= 0 else big)
    if causal and right is not None and right >= 0:
      rw = 0

    def rows(x, start, r0, n, limit):  # zero-filled tile load
      t = np.zeros((n,) + x.shape[1:])
      m = max(0, min(n, limit - r0))
      t[:m] = x[start + r0:start + r0 + m]
      return t

    def stats(h, r0):
      l2 = np.full(BM, np.inf)
      d = np.zeros(BM)
      for x in range(BM):
        i = r0 + x
        if i < q_len and lse[h, q_start + i] != -np.inf:
          l2[x] = lse[h, q_start + i]
          d[x] = (do[q_start + i, h] * o[q_start + i, h]).sum() - dlse[h, q_start + i]
      return l2, d

    def needs_mask(nb, mb):
      m0, m_last, n0 = mb * BM, min(mb * BM + BM, q_len) - 1, nb * BN
      n_last = n0 + BN - 1
      return n_last >= k_len or n_last > m0 + off + rw or n0 < m_last + off - lw

    def tile(h, hk, mb, nb):
      m0, n0 = mb * BM, nb * BN
      qt, dot = rows(q[:, h], q_start, m0, BM, q_len), rows(do[:, h], q_start, m0, BM, q_len)
      kt, vt = rows(k[:, hk], k_start, n0, BN, k_len), rows(v[:, hk], k_start, n0, BN, k_len)
      l2, d = stats(h, m0)
      s = qt @ kt.T * scale
      t = None
      if softcap:
        th = np.tanh(s / softcap)
        t, s = 1 - th * th, softcap * th
      with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - l2[:, None])
      p[np.isinf(l2)] = 0
      if needs_mask(nb, mb):
        i = m0 + np.arange(BM)[:, None] + off
        j = n0 + np.arange(BN)[None, :]
        vis = (j >= np.maximum(i - lw, 0)) & (j < np.minimum(i + rw + 1, k_len))
        p = np.where(vis, p, 0.0)
      dp = dot @ vt.T
      ds = np.where(p == 0, 0.0, p * (dp - d[:, None]) * (1 if t is None else t))
      return qt, dot, kt, p, ds

    for hk in range(K):  # dK/dV kernel: one CTA per key tile
      for nb in range((k_len + BN - 1) // BN):
        n0 = nb * BN
        n_last = min(n0 + BN, k_len) - 1
        m_lo, m_hi = max(n0 - off - rw, 0), min(n_last - off + lw + 1, q_len)
        m_min = m_lo // BM
        m_max = (m_hi + BM - 1) // BM if m_hi > m_lo else m_min
        adk, adv = np.zeros((BN, H)), np.zeros((BN, H))
        for h in range(hk * g, hk * g + g):
          for mb in range(m_min, m_max):
            qt, dot, kt, p, ds = tile(h, hk, mb, nb)
            adv += p.T @ dot
            adk += ds.T @ qt
        nv = max(0, min(BN, k_len - n0))
        dk[k_start + n0:k_start + n0 + nv, hk] = scale * adk[:nv]
        dv[k_start + n0:k_start + n0 + nv, hk] = adv[:nv]
    for h in range(N):  # dQ kernel: one CTA per query tile
      for mb in range((q_len + BM - 1) // BM):
        m0 = mb * BM
        m_last = min(m0 + BM, q_len) - 1
        n_lo, n_hi = max(m0 + off - lw, 0), min(m_last + off + rw + 1, k_len)
        n_min = n_lo // BN
        n_max = (n_hi + BN - 1) // BN if n_hi > n_lo else n_min
        adq = np.zeros((BM, H))
        for nb in range(n_max - 1, n_min - 1, -1):
          _, _, kt, _, ds = tile(h, h // g, mb, nb)
          adq += ds @ kt
        nv = max(0, min(BM, q_len - m0))
        dq[q_start + m0:q_start + m0 + nv, h] = scale * adq[:nv]
  return dq, dk, dv


@pytest.mark.parametrize("seed", range(40))
def test_backward_tile_schedule_model(seed):
  """The replay of the backward's tile schedule (emulate_tiles) gives the oracle's gradients on random packed
  batches and masks: its index logic (tile ranges, skipped masks, zero-filled rows) drops no visible pair and
  adds none.  It says nothing about the DSL code generation (tests/gpu/ runs the kernels)."""
  rng = np.random.default_rng(seed)
  b = int(rng.integers(1, 4))
  q_lens, k_lens = rng.integers(0, 200, b), rng.integers(0, 200, b)
  if seed % 5 == 0:
    k_lens[0] = 0
  d = helpers.build_packed(rng, q_lens + rng.integers(0, 5, b), q_lens, k_lens + rng.integers(0, 5, b), k_lens,
                           tail_q=int(rng.integers(0, 4)), tail_k=int(rng.integers(0, 4)), n=4, k=2, h=16)
  feat = dict(causal=bool(rng.integers(0, 2)), bottom_right=bool(rng.integers(0, 2)),
              left=[None, 0, 7, 70][rng.integers(0, 4)], right=[None, 0, 5, 100][rng.integers(0, 4)],
              softcap=[0.0, 3.0][rng.integers(0, 2)], scale=0.3)
  pp = dataclasses.replace(d["packed"], causal=feat["causal"], bottom_right=feat["bottom_right"],
                           window=None if feat["left"] is None and feat["right"] is None else
                           (feat["left"], feat["right"]), softcap=feat["softcap"] or None, scale=feat["scale"])
  do = np.where(d["valid_q"][:, None, None], rng.standard_normal(d["q"].shape), 0.0)
  dlse = np.where(d["valid_q"][None], rng.standard_normal((4, len(d["valid_q"]))) * 0.3, 0.0)
  ref = oracle.reference_packed(pp, do, dlse)
  emu = emulate_tiles(d["q"], d["k"], d["v"], ref["out"], ref["lse"], do, dlse, d["cu_q"], d["cu_k"], d["used_q"],
                      d["used_k"], **feat)
  for name, a in zip(("dq", "dk", "dv"), emu):
    err = float(np.abs(a - ref[name]).max(initial=0.0))
    assert err < 1e-9, f"{name} error {err:.3g} ({feat}, lengths q {list(q_lens)} k {list(k_lens)})"
