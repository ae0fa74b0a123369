"""The contract's additions on the pure-JAX path: sinks, a value head dim of its own, ALiBi slopes.

Each case runs the whole contract (``helpers.check_problem`` / ``helpers.check_packed``): outputs and
every gradient (the sinks' included) against the float64 oracle with the accuracy rule, exact zeros
(lse = the sink for valid rows without keys), and bitwise poison invariance.  On ``impl="cute"`` (a GPU) the
cases run on the kernels: sinks joined in the forward kernels' epilogue on every layout, ALiBi on the aux
kernels of the padded layout; a combination the kernels do not take (or the library was built without)
makes dispatch raise ``NotImplementedError`` and the case skips, as in ``test_contract``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers
from tests.helpers import contract, random_problem, random_sinks


# --------------------------------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("bottom_right", [False, True], ids=["top_left", "bottom_right"])
def test_sinks_causal_gqa(impl, dtype, bottom_right):
  """GQA (each query head its own sink), causal in both alignments, lengths with keyless rows (kv_len 0,
  and bottom-right rows before the first key)."""
  rng = np.random.default_rng(101 + bottom_right)
  p = random_problem(rng, b=3, t=29, s=23, n=6, k=2, q_len=[29, 12, 5], kv_len=[0, 23, 3], causal=True,
                     bottom_right=bottom_right, sinks=random_sinks(rng, 6))
  base, ref = contract(p, dtype, impl)
  assert ref["empty"].sum() > 10, "the problem must hold valid rows that see no key"


def test_sinks_window_segments(impl):
  """Sinks with a window and segment ids (a negative id is padding: its row gets lse 0, not the sink)."""
  rng = np.random.default_rng(102)
  ids = np.array([[0] * 8 + [1] * 10 + [-1] * 3 + [2] * 9, [4] * 12 + [-1] * 6 + [5] * 12])
  p = random_problem(rng, b=2, t=30, s=30, n=4, k=4, q_len=[30, 27], kv_len=[30, 30], causal=True,
                     window=(4, 0), sinks=random_sinks(rng, 4))
  p.q_ids, p.kv_ids = ids, ids.copy()
  contract(p, jnp.float32, impl)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_sinks_with_bias_and_mask(impl, dtype):
  """Sinks next to a bias (with -inf entries) and a boolean mask: both hide keys, the sink stays.  On the
  kernels the bias gradient comes from the bias kind's kernels, whose Delta is corrected for the sink."""
  rng = np.random.default_rng(103)
  p = random_problem(rng, b=2, t=17, s=21, n=4, k=2, q_len=[17, 9], kv_len=[21, 13],
                     sinks=random_sinks(rng, 4))
  bias = rng.standard_normal((2, 4, 17, 21))
  bias[rng.random(bias.shape) < 0.1] = -np.inf
  p.bias = bias
  p.mask = rng.random((2, 1, 17, 21)) < 0.6
  p.mask[0, :, 3] = False  # a valid row whose every key is masked: lse = the sink
  contract(p, dtype, impl)


@pytest.mark.parametrize("sink", [1e4, -1e30, 30.0, -40.0], ids=["1e4", "-1e30", "30", "-40"])
def test_huge_sinks(impl, sink):
  """Sinks far above every logit (all weight on the sink: out ~ 0, lse = sink) or far below (no weight):
  max-shifted sums, no overflow, no NaN, gradients finite and matching the oracle."""
  rng = np.random.default_rng(104)
  sinks = np.array([sink, 0.3, sink, -np.inf])
  p = random_problem(rng, b=2, t=21, s=19, n=4, k=2, q_len=[21, 7], kv_len=[19, 0], causal=True,
                     sinks=sinks)
  base, _ = contract(p, jnp.float32, impl)
  assert np.all(np.isfinite(base["dsinks"]))
  if sink == 1e4:  # all the weight on the sink: lse is the sink and the output vanishes
    np.testing.assert_array_equal(base["lse"][0, 0, :21], np.float32(sink))
    assert np.all(np.abs(base["out"][:, :, 0]) < 1e-30)


def test_sinks_empty_rows_exact(impl):
  """A valid row that sees no key: out 0, lse = sink, dQ 0, and d lse / d sink = 1 there, so with only
  such rows dsinks is exactly the sum of their lse cotangents (dO contributes nothing: out is 0)."""
  rng = np.random.default_rng(105)
  b, t, s, n, h = 2, 6, 8, 4, 32
  sinks = jnp.asarray([0.25, -3.0, 7.5, -np.inf], jnp.float32)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, n, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, s, n, h)), jnp.float32)
  q_len, kv_len = jnp.array([6, 4]), jnp.array([0, 0])
  dl = jnp.asarray(rng.standard_normal((b, n, t)), jnp.float32)
  do = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)

  def f(q, sinks):
    return jax_padsafe.dot_product_attention(q, k, v, sinks=sinks, query_seq_lengths=q_len,
                                             key_value_seq_lengths=kv_len, return_lse=True,
                                             implementation="xla")

  (o, lse), vjp = jax.vjp(f, q, sinks)
  dq, dsinks = vjp((do, dl))
  assert np.all(np.asarray(o) == 0) and np.all(np.asarray(dq) == 0)
  valid = np.arange(t)[None, :] < np.asarray(q_len)[:, None]       # [B, T]
  want = np.where(valid[:, None, :], np.asarray(sinks)[None, :, None], 0.0)
  np.testing.assert_array_equal(np.asarray(lse), want.astype(np.float32))
  dl_valid = np.where(valid[:, None, :], np.asarray(dl, np.float64), 0.0).sum(axis=(0, 2))
  dl_valid[3] = 0.0  # the head without a sink (-inf) has no softmax at all: nothing flows to it
  np.testing.assert_allclose(np.asarray(dsinks), dl_valid, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_packed(impl, causal):
  """varlen_attention with sinks: lead, gaps and tail rows are padding (lse 0, not the sink), an empty
  sequence's rows that have no key get the sink."""
  rng = np.random.default_rng(106 + causal)
  d = helpers.build_packed(rng, [9, 4, 12], [7, 4, 10], [11, 5, 3], [11, 0, 3], lead_q=2, lead_k=1,
                           n=4, k=2, h=32, causal=causal, bottom_right=causal,
                           sinks=random_sinks(rng, 4))
  helpers.contract_packed(d, jnp.float32, impl, rng)


def test_sinks_jit_vmap_deterministic():
  """Sinks under jit and vmap (a batch of problems sharing the sinks, and one set of sinks per mapped
  problem) give the per-problem results bitwise; repeated gradients are bitwise identical."""
  rng = np.random.default_rng(107)
  m, b, t, s, n, h = 3, 2, 9, 11, 4, 16
  q = jnp.asarray(rng.standard_normal((m, b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((m, b, s, 2, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((m, b, s, 2, h)), jnp.float32)
  sinks = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  lengths = jnp.array([9, 5])

  def loss(q, k, v, sinks):
    o, lse = jax_padsafe.dot_product_attention(q, k, v, sinks=sinks, is_causal=True,
                                               query_seq_lengths=lengths, return_lse=True,
                                               implementation="xla", block_k=4)
    return jnp.sum(o * o) + jnp.sum(jnp.sin(lse))

  grad = jax.jit(jax.grad(loss, (0, 3)))
  mapped = jax.vmap(grad)(q, k, v, sinks)
  shared = jax.vmap(grad, in_axes=(0, 0, 0, None))(q, k, v, sinks[0])
  for i in range(m):
    one = grad(q[i], k[i], v[i], sinks[i])
    for a, e in zip(mapped, one):
      helpers.assert_bitwise_equal(np.asarray(a[i]), np.asarray(e), f"vmap problem {i}")
    for a, e in zip(shared, grad(q[i], k[i], v[i], sinks[0])):
      helpers.assert_bitwise_equal(np.asarray(a[i]), np.asarray(e), f"vmap shared sinks {i}")
  again = jax.vmap(grad)(q, k, v, sinks)
  for a, e in zip(again, mapped):
    helpers.assert_bitwise_equal(np.asarray(a), np.asarray(e), "repeated gradients")


# --------------------------------------------------------------------------------------------------
# Value head dim
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,hv,dtype", [(192, 128, jnp.bfloat16), (32, 80, jnp.float32), (64, 8, jnp.float16)],
                         ids=["192_128_bf16", "32_80_f32", "64_8_f16"])
def test_value_head_dim(impl, h, hv, dtype):
  """``value [B, S, K, Hv]`` with Hv != H: out and dV have Hv, dQ and dK have H; GQA, bottom-right causal,
  lengths with keyless rows."""
  rng = np.random.default_rng(h * 1000 + hv)
  p = random_problem(rng, b=2, t=19, s=27, n=4, k=2, h=h, hv=hv, q_len=[19, 8], kv_len=[27, 3],
                     causal=True, bottom_right=True)
  base, _ = contract(p, dtype, impl)
  assert base["out"].shape == (2, 19, 4, hv) and base["dv"].shape == (2, 27, 2, hv)
  assert base["dq"].shape == (2, 19, 4, h) and base["dk"].shape == (2, 27, 2, h)


def test_value_head_dim_with_everything(impl):
  """Hv != H with sinks, a bias, a mask, a window, softcap and segment ids at once."""
  rng = np.random.default_rng(111)
  ids = np.array([[0] * 9 + [1] * 11 + [-1] * 4, [2] * 24])
  p = random_problem(rng, b=2, t=24, s=24, n=4, k=1, h=16, hv=40, q_len=[24, 20], kv_len=[24, 17],
                     window=(6, 2), softcap=3.0, sinks=random_sinks(rng, 4))
  p.q_ids, p.kv_ids = ids, ids.copy()
  p.bias = rng.standard_normal((1, 4, 24, 24))
  p.mask = rng.random((2, 1, 24, 24)) < 0.8
  contract(p, jnp.float32, impl)


def test_value_head_dim_packed(impl):
  rng = np.random.default_rng(112)
  d = helpers.build_packed(rng, [7, 10, 5], [7, 6, 5], [9, 4, 8], [9, 4, 0], n=4, k=2, h=24, hv=56,
                           causal=True, tail_q=2, tail_k=4)
  base, _ = helpers.contract_packed(d, jnp.float32, impl, rng)
  assert base["out"].shape[-1] == 56 and base["dv"].shape[-1] == 56 and base["dq"].shape[-1] == 24


def test_value_head_dim_bad_shapes():
  """Value shapes are checked but for the head dim; errors name the argument."""
  q = jnp.zeros((2, 8, 4, 16))
  k = jnp.zeros((2, 10, 2, 16))
  with pytest.raises(ValueError, match="value shape"):
    jax_padsafe.dot_product_attention(q, k, jnp.zeros((2, 9, 2, 32)))
  with pytest.raises(ValueError, match="value shape"):
    jax_padsafe.dot_product_attention(q, k, jnp.zeros((2, 10, 1, 32)))
  with pytest.raises(ValueError, match="head dims must be positive"):
    jax_padsafe.dot_product_attention(q, k, jnp.zeros((2, 10, 2, 0)))
  with pytest.raises(ValueError, match="value shape"):
    jax_padsafe.varlen_attention(q[0], k[0], jnp.zeros((9, 2, 32)), jnp.array([0, 8]), jnp.array([0, 10]))


# --------------------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------------------

def random_slopes(rng, shape):
  """ALiBi's geometric slopes (2^(-8h/N)), shuffled and scaled at random so that heads and rows differ."""
  n = shape[-1]
  base = 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
  return base * rng.uniform(0.5, 2.0, size=shape)


@pytest.mark.parametrize("slopes", ["per_head", "per_batch"])
@pytest.mark.parametrize("bottom_right", [False, True], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("t,s", [(23, 31), (31, 13)], ids=["k_longer", "q_longer"])
def test_alibi(impl, slopes, bottom_right, t, s):
  """``-slope * |i + off - j|`` with the causal alignment's offset from the valid lengths (bottom-right:
  kv_len - q_len per row, never the padded shapes), GQA, causal."""
  rng = np.random.default_rng(121 + 2 * bottom_right + (t > s))
  shape = (4,) if slopes == "per_head" else (3, 4)
  p = random_problem(rng, b=3, t=t, s=s, n=4, k=2, q_len=[t, t // 2, 2], kv_len=[s - 3, s, 5],
                     causal=True, bottom_right=bottom_right, alibi=random_slopes(rng, shape))
  contract(p, jnp.float32, impl)


def test_alibi_no_causal_softcap_bias_mask_sinks(impl):
  """ALiBi without a causal mask (both sides of the diagonal), after the softcap, together with a bias
  (and its -inf entries), a mask, a window and sinks; bfloat16."""
  rng = np.random.default_rng(122)
  p = random_problem(rng, b=2, t=20, s=26, n=4, k=4, q_len=[20, 11], kv_len=[26, 17], softcap=2.0,
                     window=(None, 6), bottom_right=True, alibi=random_slopes(rng, (2, 4)),
                     sinks=random_sinks(rng, 4))
  p.q *= 2
  p.bias = rng.standard_normal((2, 1, 20, 26))
  p.bias[rng.random(p.bias.shape) < 0.05] = -np.inf
  p.mask = rng.random((1, 4, 20, 26)) < 0.85
  contract(p, jnp.bfloat16, impl)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_bias_mask_sinks_several_tiles(impl, dtype, causal):
  """ALiBi (per-sequence slopes, bottom-right offset) with a per-head bias, a mask and sinks over several
  query and key tiles of the kernels, in the kernels' dtypes (the sinks' gradient takes Delta from the
  kernels' rowsum(P * dP): from the output rounded to float16 it was 2.3x over the bound here)."""
  rng = np.random.default_rng(124 + causal)
  p = random_problem(rng, b=2, t=150, s=261, n=4, k=2, q_len=[150, 77], kv_len=[261, 140], causal=causal,
                     bottom_right=True, alibi=random_slopes(rng, (2, 4)), sinks=random_sinks(rng, 4))
  p.bias = rng.standard_normal((1, 4, 150, 261))
  p.mask = rng.random((2, 1, 150, 261)) < 0.9
  contract(p, dtype, impl)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_bias_interior_tiles(impl, causal):
  """ALiBi with a bias and no mask over several tiles: on the kernels the tiles inside the valid rectangle take
  the backward's interior path (no selects) with the ALiBi term in their scores."""
  rng = np.random.default_rng(130 + causal)
  p = random_problem(rng, b=2, t=300, s=290, n=4, k=2, q_len=[300, 203], kv_len=[290, 270], causal=causal,
                     bottom_right=True, alibi=random_slopes(rng, (2, 4)))
  p.bias = rng.standard_normal((1, 4, 300, 290))
  contract(p, jnp.bfloat16, impl)


@pytest.mark.parametrize("with_mask", [False, True], ids=["alone", "mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_without_bias_several_tiles(impl, with_mask, causal):
  """ALiBi without a bias tensor, alone and with a mask (the kernels' mask kind: the slopes, divided by the
  scale, join the raw scores q.k), with sinks, over several query and key tiles; top-left offset with more
  queries than keys, so that rows past the keys have their nearest key far away (a large row max)."""
  rng = np.random.default_rng(126 + 2 * causal + with_mask)
  p = random_problem(rng, b=2, t=300, s=200, n=4, k=2, q_len=[300, 150], kv_len=[200, 61], causal=causal,
                     alibi=random_slopes(rng, (4,)), sinks=random_sinks(rng, 4))
  if with_mask:
    p.mask = rng.random((2, 1, 300, 200)) < 0.9
  contract(p, jnp.bfloat16, impl)


def test_alibi_segment_ids(impl):
  """With segment ids the distance is between row positions (the contract's i and j), as for causal."""
  rng = np.random.default_rng(123)
  ids = np.array([[0] * 7 + [1] * 13 + [-1] * 4, [3] * 10 + [4] * 14])
  p = random_problem(rng, b=2, t=24, s=24, n=2, k=1, q_len=[24, 24], kv_len=[24, 21], causal=True,
                     alibi=random_slopes(rng, (2,)))
  p.q_ids, p.kv_ids = ids, ids.copy()
  contract(p, jnp.float32, impl)


@pytest.mark.parametrize("slopes", ["per_head", "per_sequence"])
def test_alibi_packed(impl, slopes):
  """varlen_attention: positions from each sequence's start, one row of slopes per sequence or shared."""
  rng = np.random.default_rng(124 + (slopes == "per_sequence"))
  d = helpers.build_packed(rng, [9, 4, 12], [7, 4, 12], [11, 5, 6], [10, 5, 6], lead_q=1, n=4, k=2, h=32,
                           causal=True, bottom_right=True,
                           alibi=random_slopes(rng, (4,) if slopes == "per_head" else (3, 4)))
  helpers.contract_packed(d, jnp.float32, impl, rng)


def test_alibi_slopes_get_no_gradient_and_no_t_by_s_array():
  """The slopes are not differentiated (their cotangent is zero), and the pure-JAX path builds the
  bias per key block: no float array of T x S elements in the program."""
  rng = np.random.default_rng(125)
  b, t, s, n, h = 1, 64, 96, 2, 8
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, n, h)), jnp.float32)
  slopes = jnp.asarray([0.5, 0.25], jnp.float32)

  def loss(q, slopes):
    return jnp.sum(jax_padsafe.dot_product_attention(q, k, k, alibi_slopes=slopes, implementation="xla",
                                                     block_k=16) ** 2)

  dq, dslopes = jax.grad(loss, (0, 1))(q, slopes)
  assert np.all(np.asarray(dslopes) == 0) and np.any(np.asarray(dq) != 0)
  text = jax.jit(jax.grad(loss)).lower(q, slopes).as_text()
  assert f"{t}x{s}xf32" not in text and f"{s}x{t}xf32" not in text


def test_alibi_bad_shapes():
  q = jnp.zeros((2, 8, 4, 16))
  with pytest.raises(ValueError, match="alibi_slopes"):
    jax_padsafe.dot_product_attention(q, q, q, alibi_slopes=jnp.zeros((3,)))
  with pytest.raises(ValueError, match="alibi_slopes"):
    jax_padsafe.dot_product_attention(q, q, q, alibi_slopes=jnp.zeros((3, 4)))
  with pytest.raises(TypeError, match="alibi_slopes"):
    jax_padsafe.dot_product_attention(q, q, q, alibi_slopes=jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="sinks"):
    jax_padsafe.dot_product_attention(q, q, q, sinks=jnp.zeros((2,)))
  with pytest.raises(ValueError, match="alibi_slopes"):
    jax_padsafe.varlen_attention(q[0], q[0], q[0], jnp.array([0, 3, 8]), jnp.array([0, 4, 8]),
                                 alibi_slopes=jnp.zeros((3, 4)))


# --------------------------------------------------------------------------------------------------
# The kernel backend's own code for these features, on the CPU
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["sinks", "sinks_mask_alibi", "sinks_value_head_dim"])
def test_kernel_backend_features_on_cpu(kernels_built, case):
  """What the kernel backend does around the kernels, checked on the CPU, where its calls lower to the
  pure-JAX fallback of ``lax.platform_dependent``: sinks joined to the results without sinks (``cute/sinks.py``,
  the aux kernels' row statistics included), their gradient, ALiBi slopes in the aux operands, and a value
  head dim zero-padded to a compiled width. The whole contract against the float64 oracle, poison included."""
  rng = np.random.default_rng(130)
  kw = dict(b=2, t=21, s=27, n=4, k=2, q_len=[21, 9], kv_len=[27, 0], causal=True, bottom_right=True,
            sinks=random_sinks(rng, 4))
  if case == "sinks_value_head_dim":
    kw.update(h=72, hv=40)
  if case == "sinks_mask_alibi":
    kw["alibi"] = random_slopes(rng, (2, 4))
  p = random_problem(rng, **kw)
  if case == "sinks_mask_alibi":
    p.mask = rng.random((2, 1, 21, 27)) < 0.8
    p.mask[0, :, 4] = False  # a valid row whose every key is masked: lse = the sink
  helpers.check_problem(p, jnp.bfloat16, "cute")
