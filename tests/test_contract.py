"""The pad-safety contract on the padded layout, for every implementation (``impl`` fixture).

Each case checks the whole contract: outputs and all gradients against the float64 oracle (the
accuracy rule), exact zeros for padded rows and never-seen keys, lse = -inf for valid empty rows,
and bitwise identical results for NaN, +-Inf, 1e30 and random huge values in every padded region
(Q, K, V, dO, dlse, bias).
"""

import numpy as np
import pytest
import jax.numpy as jnp

from tests import helpers
from tests.helpers import contract, random_problem


DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lengths_dtypes(impl, dtype, causal):
  rng = np.random.default_rng(1)
  p = random_problem(rng, b=3, t=37, s=53, q_len=[37, 20, 1], kv_len=[53, 11, 40], causal=causal)
  contract(p, dtype, impl)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(impl, head_dim):
  rng = np.random.default_rng(head_dim)
  p = random_problem(rng, b=2, t=19, s=29, n=2, k=1, h=head_dim, q_len=[19, 7], kv_len=[5, 29],
                     causal=True)
  contract(p, jnp.bfloat16, impl, poisons=("nan", "huge"))


def test_gqa_ratio_7(impl):
  """28 query heads over 4 key/value heads: dK/dV are summed over each group of 7."""
  rng = np.random.default_rng(7)
  p = random_problem(rng, b=2, t=21, s=26, n=28, k=4, h=64, q_len=[21, 9], kv_len=[17, 26])
  contract(p, jnp.float32, impl)


@pytest.mark.parametrize("bottom_right", [False, True], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("t,s", [(40, 17), (17, 40)], ids=["q_longer", "k_longer"])
def test_causal_alignment(impl, bottom_right, t, s):
  rng = np.random.default_rng(t * s + bottom_right)
  p = random_problem(rng, b=3, t=t, s=s, q_len=[t, t // 2, 3], kv_len=[s, 2, s - 1],
                     causal=True, bottom_right=bottom_right)
  contract(p, jnp.float32, impl)


@pytest.mark.parametrize("window", [(3, 2), (0, 0), (5, None), (None, 4)],
                         ids=["3_2", "0_0", "left_only", "right_only"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_windows(impl, window, causal):
  rng = np.random.default_rng(11)
  p = random_problem(rng, b=2, t=31, s=31, q_len=[31, 18], kv_len=[25, 31], window=window,
                     causal=causal, bottom_right=True)
  contract(p, jnp.float32, impl)


def test_window_symmetric_int(impl):
  """An int window means (w, w), as in jax.nn."""
  rng = np.random.default_rng(12)
  p = random_problem(rng, b=1, t=20, s=20, q_len=[20], kv_len=[14], window=(4, 4))
  base, _ = contract(p, jnp.float32, impl, poisons=())
  import jax_padsafe
  kw = helpers.api_kwargs(p, impl)
  kw["local_window_size"] = 4
  dtype = helpers.dtype_for(impl, jnp.float32)
  out = jax_padsafe.dot_product_attention(jnp.asarray(p.q, dtype), jnp.asarray(p.k, dtype),
                                          jnp.asarray(p.v, dtype), **kw)
  helpers.assert_bitwise_equal(np.asarray(out), base["out"], "int window vs (4, 4)")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap(impl, causal):
  rng = np.random.default_rng(13)
  p = random_problem(rng, b=2, t=23, s=29, q_len=[23, 10], kv_len=[29, 6], softcap=2.5,
                     causal=causal, scale=0.9)
  p.q *= 3  # make the cap bite
  contract(p, jnp.float32, impl)


@pytest.mark.parametrize("bias_shape", ["full", "heads", "batch_free", "key_only"])
def test_bias(impl, bias_shape):
  rng = np.random.default_rng(14)
  p = random_problem(rng, b=2, t=17, s=21, n=4, k=2, q_len=[17, 9], kv_len=[21, 13], causal=True)
  shape = {"full": (2, 4, 17, 21), "heads": (1, 4, 17, 21), "batch_free": (1, 1, 17, 21),
           "key_only": (2, 1, 1, 21)}[bias_shape]
  bias = rng.standard_normal(shape)
  bias[rng.random(shape) < 0.1] = -np.inf  # -inf hides a key exactly like a mask
  p.bias = bias
  contract(p, jnp.float32, impl)


def test_boolean_mask(impl):
  rng = np.random.default_rng(15)
  p = random_problem(rng, b=2, t=19, s=23, n=2, k=2, q_len=[19, 4], kv_len=[23, 9])
  p.mask = rng.random((2, 1, 19, 23)) < 0.7
  contract(p, jnp.float32, impl)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 2, 17, 21), (1, 2, 1, 21)], ids=["full", "per_key"])
def test_mask_and_bias_per_kv_head(impl, dtype, shape):
  """A mask and a bias given per key/value head (``[Bx, K, Tx, S]``, GQA 3 query heads per group): every query
  head of a group reads its key/value head's entry, and dbias sums the group (kernels: not taken yet, the case
  skips)."""
  rng = np.random.default_rng(17)
  p = random_problem(rng, b=2, t=17, s=21, n=6, k=2, q_len=[17, 9], kv_len=[21, 13], causal=True)
  p.bias = rng.standard_normal(shape)
  p.bias[rng.random(shape) < 0.1] = -np.inf
  p.mask = rng.random(shape) < 0.8
  contract(p, dtype, impl)


def test_mask_head_dim_other_than_1_k_or_n_raises():
  import jax_padsafe
  q = jnp.zeros((1, 4, 6, 8))
  k = jnp.zeros((1, 5, 2, 8))
  with pytest.raises(ValueError, match="may also be K = 2"):
    jax_padsafe.dot_product_attention(q, k, k, mask=jnp.ones((1, 3, 4, 5), bool))


def test_segment_ids(impl):
  """Packed sequences in the padded layout; negative ids are padding and match nothing."""
  rng = np.random.default_rng(16)
  t = 30
  ids = np.array([[0] * 10 + [1] * 12 + [2] * 5 + [-1] * 3,
                  [5] * 7 + [-1] * 4 + [6] * 15 + [-2] * 4])
  p = random_problem(rng, b=2, t=t, s=t, q_len=[30, 26], kv_len=[30, 30], causal=True)
  p.q_ids, p.kv_ids = ids, ids.copy()
  contract(p, jnp.float32, impl)


def test_segment_ids_cross(impl):
  """Different query/key segmentations; a valid query whose segment has no key gets lse = -inf."""
  rng = np.random.default_rng(17)
  p = random_problem(rng, b=1, t=12, s=16, q_len=[12], kv_len=[16])
  p.q_ids = np.array([[0, 0, 0, 1, 1, 1, 2, 2, 9, 9, -1, -1]])
  p.kv_ids = np.array([[0, 0, 1, 1, 1, 1, 1, 2, 2, 2, -3, -3, 0, 0, 2, -1]])
  contract(p, jnp.float32, impl)


@pytest.mark.parametrize("layout", ["packed", "noncontiguous"])
def test_segment_ids_traced(impl, layout):
  """Segment ids as arguments of the jitted step (traced): packed runs take the kernels, a layout
  they cannot express (id 3 comes back after id 4) is sent to the pure-JAX path at run time."""
  rng = np.random.default_rng(19)
  t = 40
  ids = np.array([[0] * 9 + [1] * 14 + [-1] * 2 + [2] * 12 + [-1] * 3,
                  [3] * 20 + [4] * 20 if layout == "packed" else [3] * 10 + [4] * 20 + [3] * 10])
  p = random_problem(rng, b=2, t=t, s=t, n=4, k=2, q_len=[40, 37], kv_len=[40, 40], causal=True)
  p.q_ids, p.kv_ids = ids, ids.copy()
  contract(p, jnp.bfloat16, impl, traced_ids=True)


def test_segment_ids_cross_contiguous(impl):
  """Query and key layouts differ (T != S, one id without keys) but every id is one run on each
  side, in the same order: the kernels run it (no causal mask, so positions do not matter)."""
  rng = np.random.default_rng(20)
  p = random_problem(rng, b=2, t=21, s=30, n=4, k=1, q_len=[21, 21], kv_len=[30, 25])
  p.q_ids = np.array([[0] * 5 + [1] * 9 + [2] * 7, [7] * 11 + [-1] * 3 + [8] * 7])
  p.kv_ids = np.array([[0] * 12 + [-1] * 2 + [2] * 16, [7] * 4 + [8] * 26])
  contract(p, jnp.bfloat16, impl)


def test_irregular_lengths(impl):
  """Lengths 0, 1, 127, 129 and T - 1 in one batch (tiles cut at every boundary).  T = 4096 for the
  GPU kernels; 2048 on the pure-JAX path (still many key blocks; at 4096 the CPU case took ~45 s of
  CI's time)."""
  rng = np.random.default_rng(18)
  t = 4096 if impl == "cute" else 2048
  p = random_problem(rng, b=5, t=t, s=t, n=1, k=1, h=16,
                     q_len=[0, 1, 127, 129, t - 1], kv_len=[t - 1, 129, 1, 127, 0], causal=True,
                     bottom_right=True)
  contract(p, jnp.float32, impl, poisons=("nan", "huge"))


def test_empty_and_keyless_rows(impl):
  """q_len 0, kv_len 0 with q_len > 0 (every valid row keyless), and a window that sees nothing."""
  rng = np.random.default_rng(19)
  p = random_problem(rng, b=3, t=9, s=9, q_len=[0, 5, 9], kv_len=[9, 0, 9], causal=True)
  base, _ = contract(p, jnp.float32, impl)
  assert np.all(np.isneginf(base["lse"][1, :, :5]))
  # causal with a key sequence shorter than the query offset: early rows see nothing
  p2 = random_problem(rng, b=1, t=8, s=8, q_len=[8], kv_len=[3], causal=True, bottom_right=True)
  contract(p2, jnp.float32, impl)


@pytest.mark.parametrize("which", ["no_queries", "no_keys", "nothing"])
def test_degenerate_batches(impl, which):
  """Batches with no work at all: every query length 0, every key length 0, or both.  No tile of the
  kernels' grids has anything to compute, yet every output is written: exact zeros (lse -inf for valid rows
  without keys; with no valid row at all the whole output is padding) and bitwise poison invariance."""
  rng = np.random.default_rng(23)
  q_len, kv_len = dict(no_queries=([0, 0, 0], [5, 130, 1]), no_keys=([7, 129, 1], [0, 0, 0]),
                       nothing=([0, 0, 0], [0, 0, 0]))[which]
  for causal in (False, True):
    p = random_problem(rng, b=3, t=130, s=131, q_len=q_len, kv_len=kv_len, causal=causal, bottom_right=causal)
    base, _ = contract(p, jnp.float32, impl, poisons=("nan", "huge"))
    assert np.all(base["out"] == 0) and np.all(base["dq"] == 0)
    assert np.all(base["dk"] == 0) and np.all(base["dv"] == 0)
    if which == "no_keys":
      for b, n in enumerate(q_len):
        assert np.all(np.isneginf(base["lse"][b, :, :n])), "valid rows without keys must have lse -inf"


def test_no_lengths_matches_jax_nn(impl):
  """With no padding at all, results equal jax.nn.dot_product_attention's."""
  import jax
  import jax_padsafe
  rng = np.random.default_rng(20)
  dtype = helpers.dtype_for(impl, jnp.float32)
  q = jnp.asarray(rng.standard_normal((2, 16, 4, 64)), dtype)
  k = jnp.asarray(rng.standard_normal((2, 24, 2, 64)), dtype)
  v = jnp.asarray(rng.standard_normal((2, 24, 2, 64)), dtype)
  tol = 2e-6 if dtype == jnp.float32 else 2e-2
  for causal in (False, True):
    ours = jax_padsafe.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    theirs = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                          v.astype(jnp.float32), is_causal=causal,
                                          implementation="xla")
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs), atol=tol, rtol=tol)


@pytest.mark.parametrize("scale", [1e10, 1e30], ids=["1e10", "1e30"])
def test_huge_logits(impl, scale):
  """Finite logits far past exp's range (a huge ``scale``): the rows come out as the float64 softmax gives
  them (all weight on the largest logit), with the whole contract, and no NaN or Inf in any gradient.

  The pure-JAX path handles any finite logit.  The kernels compute exp2(s * c - max * c) as one FMA
  (FlashAttention's form), whose rounding gap grows with |s|: as accurate as cuDNN to |s| ~ 2e4, one bf16
  ulp off beyond, NaN possible past ~6e8 (docs/contract.md; an exact form cost the hd64 forward 13-17%),
  so they are not held to this case."""
  import jax
  import jax_padsafe
  if impl == "cute":
    pytest.skip("the kernels' fused exp2 argument limits the logit range (documented in contract.md)")
  rng = np.random.default_rng(5)
  p = random_problem(rng, b=2, t=33, s=47, n=4, k=2, h=64, q_len=[30, 0], kv_len=[47, 20], causal=True)
  p.scale = scale
  contract(p, jnp.float32, impl, grads=False)
  kw = helpers.api_kwargs(p, impl)
  grads = jax.grad(lambda q, k, v: jnp.sum(jax_padsafe.dot_product_attention(q, k, v, **kw) ** 2),
                   (0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (p.q, p.k, p.v)))
  for name, g in zip(("dq", "dk", "dv"), grads):
    assert np.isfinite(np.asarray(g)).all(), f"{name} is not finite"


@pytest.mark.parametrize("where", ["key", "query", "bias"])
def test_nan_in_valid_data_propagates(impl, where):
  """NaN in *valid* data is not padding: the rows that see it come out NaN (output and lse, as plain
  attention gives them), never a silent "empty row" with output 0 and lse -inf; every other row is
  bitwise unchanged; and the gradients carry the NaN instead of zeros."""
  import jax
  import jax_padsafe
  rng = np.random.default_rng(21)
  dtype = helpers.dtype_for(impl, jnp.float32)
  b, t, s, n, h = 1, 12, 12, 2, 64
  q = rng.standard_normal((b, t, n, h))
  k = rng.standard_normal((b, s, n, h))
  v = rng.standard_normal((b, s, n, h))
  bias = None
  if where == "key":      # key 5: seen (causal) by rows 5..9, the valid rows
    k[0, 5, 0, 3] = np.nan
    hit = np.arange(t)[(np.arange(t) >= 5) & (np.arange(t) < 10)]
  elif where == "query":  # query row 3
    q[0, 3, 0, 7] = np.nan
    hit = np.array([3])
  else:                   # one visible entry of row 7's bias
    if impl == "cute":
      pytest.skip("the kernels take no bias")
    bias = np.zeros((b, n, t, s))
    bias[0, 0, 7, 2] = np.nan
    hit = np.array([7])
  kw = dict(is_causal=True, query_seq_lengths=jnp.array([10]), key_value_seq_lengths=jnp.array([10]),
            implementation=impl, return_lse=True)
  if bias is not None:
    kw["bias"] = jnp.asarray(bias, jnp.float32)
  args = [jnp.asarray(x, dtype) for x in (q, k, v)]
  clean = [jnp.asarray(np.nan_to_num(x), dtype) for x in (q, k, v)]
  try:
    o, lse = jax_padsafe.dot_product_attention(*args, **kw)
  except NotImplementedError as e:
    if impl == "cute":
      pytest.skip(str(e))
    raise
  kw_clean = dict(kw, bias=jnp.asarray(np.nan_to_num(bias), jnp.float32)) if bias is not None else kw
  o0, lse0 = jax_padsafe.dot_product_attention(*clean, **kw_clean)
  o, lse, o0, lse0 = (np.asarray(x, np.float32) for x in (o, lse, o0, lse0))
  rows = np.zeros(t, bool)
  rows[hit] = True
  assert np.all(np.isnan(o[0, rows, 0])) and np.all(np.isnan(lse[0, 0, rows])), "NaN rows must stay NaN"
  helpers.assert_bitwise_equal(o[0, ~rows, 0], o0[0, ~rows, 0], "rows that do not see the NaN")
  helpers.assert_bitwise_equal(o[:, :, 1], o0[:, :, 1], "the other head")
  assert np.all(o[0, 10:] == 0) and np.all(lse[0, :, 10:] == 0), "padded rows stay exactly 0"
  grads = jax.grad(lambda q, k, v: jnp.sum(
      jax_padsafe.dot_product_attention(q, k, v, **dict(kw, return_lse=False)).astype(jnp.float32)),
      (0, 1, 2))(*args)
  assert np.isnan(np.asarray(grads[0], np.float32)[0, hit, 0]).all(), "dq of the NaN rows"
