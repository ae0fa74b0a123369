"""The padded layout (lengths, segment-id runs) mapped onto the kernels' packed layout, on the CPU.

The kernels only know ``cu_seqlens``/``seqused``; ``jax_padsafe._core.problem`` describes a padded batch
as runs per row. Here the mapping is run through pure-JAX stand-ins with the kernels' signatures
and compared with the canonical pure-JAX attention on the same inputs (outputs, lse, gradients),
for random packed layouts; layouts the kernels cannot express must be reported as not exact.
"""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_padsafe
from jax_padsafe._backends import partitioning
from jax_padsafe._core import checks, problem
from tests import helpers


def _random_runs(rng, t, ids, gap=True):
  """Row of length t: contiguous runs of the given ids (random lengths), -1 gaps, -1 tail."""
  row, cuts = [], np.sort(rng.choice(np.arange(1, t), size=len(ids), replace=False))
  bounds = [0] + list(cuts)
  for i, seg in enumerate(ids):
    lo, hi = bounds[i], bounds[i + 1]
    pad = rng.integers(0, 2) if gap and hi - lo > 2 else 0
    row += [seg] * (hi - lo - pad) + [-1] * pad
  return np.array(row + [-1] * (t - len(row)))


def _problem(rng, b, t, s, n, k, h):
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return mk(b, t, n, h), mk(b, s, k, h), mk(b, s, k, h), mk(b, t, n, h), mk(b, n, t)


def _through_runs(q, k, v, do, dl, q_ids, k_ids, **kw):
  """Outputs and gradients computed by the runs mapping over the stand-in kernels, or None."""
  b, t, n, h = q.shape
  s = k.shape[1]
  spec = checks.make_spec(h, None, kw.get("is_causal", False), kw.get("local_window_size"), None,
                          512, bottom_right=kw.get("causal_alignment") == "bottom_right")
  _, _, q_seg, k_seg, q_pos, k_pos = problem.padded_rows(
      b, t, s, kw.get("causal_alignment", "top_left"), kw.get("query_seq_lengths"), None,
      q_ids, k_ids)
  runs, exact = problem.runs_from_segments(
      q_seg, k_seg, q_pos, k_pos, max_runs=t, positional=spec.causal or spec.has_window,
      bottom_right=spec.bottom_right)
  if not bool(exact):
    return None
  static = dict(max_seqlen_q=t, max_seqlen_k=s, scale=spec.scale, causal=spec.causal,
                bottom_right=spec.bottom_right,
                window_left=-1 if spec.window_left is None else spec.window_left,
                window_right=-1 if spec.window_right is None else spec.window_right, softcap=0.0)
  fwd = partitioning.packed_to_runs(helpers.standin_flash_forward)
  bwd = partitioning.packed_backward_to_runs(helpers.standin_flash_backward)
  o, lse = fwd(q, k, v, *runs, **static)
  grads = bwd(q, k, v, o, lse, do, dl, *runs, **static)
  return (o, lse) + tuple(grads)


def _reference(q, k, v, do, dl, q_ids, k_ids, **kw):
  f = lambda q, k, v: jax_padsafe.dot_product_attention(
      q, k, v, query_segment_ids=q_ids, key_value_segment_ids=k_ids, return_lse=True,
      implementation="xla", **kw)
  (o, lse), vjp = jax.vjp(f, q, k, v)
  return (o, lse) + tuple(vjp((do, dl)))


def _assert_same(got, ref):
  for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("seed", range(6))
def test_self_attention_packing_matches_canonical(seed):
  """Identical query/key ids (sequence packing), causal or not, both alignments, windows."""
  rng = np.random.default_rng(seed)
  b, t, n, kh, h = 3, 24, 4, 2, 8
  ids = np.stack([_random_runs(rng, t, rng.permutation(9)[:rng.integers(1, 5)]) for _ in range(b)])
  kw = [dict(), dict(is_causal=True), dict(is_causal=True, causal_alignment="bottom_right"),
        dict(local_window_size=(3, 1)), dict(is_causal=True, local_window_size=(5, 0)),
        dict(is_causal=True, query_seq_lengths=jnp.array([24, 13, 0], jnp.int32))][seed]
  q, k, v, do, dl = _problem(rng, b, t, t, n, kh, h)
  got = _through_runs(q, k, v, do, dl, ids, ids, **kw)
  assert got is not None, f"contiguous identical ids must map exactly: {ids}"
  _assert_same(got, _reference(q, k, v, do, dl, ids, ids, **kw))


@pytest.mark.parametrize("seed", range(4))
def test_cross_layouts_without_masks(seed):
  """Different query and key layouts (T != S, ids missing on one side) map exactly without
  causal/window masks: a query run whose id has no keys gets lse = -inf and zero output."""
  rng = np.random.default_rng(100 + seed)
  b, t, s = 2, 20, 27
  ids = [rng.permutation(6)[:4] for _ in range(b)]
  q_ids = np.stack([_random_runs(rng, t, i) for i in ids])
  k_ids = np.stack([_random_runs(rng, s, [x for x in i if rng.random() < 0.8]) for i in ids])
  q, k, v, do, dl = _problem(rng, b, t, s, 4, 1, 8)
  got = _through_runs(q, k, v, do, dl, q_ids, k_ids)
  assert got is not None
  _assert_same(got, _reference(q, k, v, do, dl, q_ids, k_ids))


@pytest.mark.parametrize("q_ids,k_ids,kw", [
    ([[0, 0, 1, 1, 0, 0]], [[0, 0, 1, 1, 1, 1]], {}),                 # id 0 twice in the queries
    ([[0, 0, 1, 1, 1, 1]], [[0, 1, 1, 0, -1, -1]], {}),              # id 0 twice in the keys
    ([[0, 0, 0, 1, 1, 1]], [[1, 1, 1, 0, 0, 0]], {}),                # key runs in another order
    ([[0, 0, 0, 1, 1, 1]], [[0, 0, 1, 1, 1, 1]], dict(is_causal=True)),  # runs start apart
], ids=["query_repeat", "key_repeat", "key_order", "causal_misaligned"])
def test_inexpressible_layouts_are_not_exact(q_ids, k_ids, kw):
  rng = np.random.default_rng(7)
  q, k, v, do, dl = _problem(rng, 1, 6, 6, 2, 1, 8)
  assert _through_runs(q, k, v, do, dl, np.array(q_ids), np.array(k_ids), **kw) is None
  # The same layout without the masks that need positions is fine when the runs are contiguous.
  if kw:
    got = _through_runs(q, k, v, do, dl, np.array(q_ids), np.array(k_ids))
    _assert_same(got, _reference(q, k, v, do, dl, np.array(q_ids), np.array(k_ids)))


def test_too_many_runs_is_not_exact():
  ids = jnp.array([[0, 1, 2, 3, -1, 5]], jnp.int32)
  pos = jnp.arange(6, dtype=jnp.int32)[None]
  _, exact = problem.runs_from_segments(ids, ids, pos, pos, max_runs=4, positional=False,
                                        bottom_right=False)
  assert not bool(exact)
  runs, exact = problem.runs_from_segments(ids, ids, pos, pos, max_runs=8, positional=False,
                                           bottom_right=False)
  assert bool(exact)
  np.testing.assert_array_equal(runs.q_start[0], [0, 1, 2, 3, 5, 6, 6, 6])
  np.testing.assert_array_equal(runs.q_used[0], [1, 1, 1, 1, 1, 0, 0, 0])


def test_packed_view_of_lengths_is_the_plain_padded_mapping():
  runs = problem.runs_from_lengths(jnp.array([3, 0, 5]), jnp.array([7, 2, 0]))
  cu_q, cu_k, used_q, used_k = problem.packed_view(runs, 5, 7)
  np.testing.assert_array_equal(cu_q, [0, 5, 10, 15])
  np.testing.assert_array_equal(cu_k, [0, 7, 14, 21])
  np.testing.assert_array_equal(used_q, [3, 0, 5])
  np.testing.assert_array_equal(used_k, [7, 2, 0])
