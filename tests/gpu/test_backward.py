"""The kernels' forward and backward on a GPU over every head dim, both dtypes and every feature set: the whole
contract (outputs and gradients against the float64 oracle by the accuracy rule, exact zeros, bitwise invariance
under NaN, +-Inf, 1e30 and random huge values in every padded row of q, k, v, dO and dlse, dirty memory), through
``varlen_attention`` / ``dot_product_attention`` with ``implementation="cute"``, each case first checked to call
the forward and backward kernels (never the pure-JAX path).

* packed GQA 7 batch (tests/gpu/cases.py GQA7_LAYOUT): irregular lengths, valid queries without keys, gaps, a lead
  and a tail.  bf16 runs every feature set at every head dim; fp16 (the same kernel code in another dtype) runs
  four of them, softcap among them, at every head dim.
* padded layout with lengths (DENSE_LAYOUT), where the kernels write the padded rows' zeros themselves.
* deterministic: gradients bitwise reproducible, ``deterministic=True`` and ``False`` alike (the backward uses no
  atomics either way).
* the backward kernel given poison in the padded rows of its own inputs o and lse as well.

About 250 s on an H100.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers
from tests import test_fuzz
from tests.gpu import cases
from tests.gpu.cases import DTYPES, FEATURES, HEAD_DIMS

pytestmark = cases.needs_kernels()

FP16_FEATURES = ("plain", "causal_br", "window_tl", "softcap_causal")
MATRIX = [("bf16", h, f) for h in HEAD_DIMS for f in FEATURES] + [("fp16", h, f) for h in HEAD_DIMS
                                                                   for f in FP16_FEATURES]
DENSE_FEATURES = ("plain", "causal_tl", "window_causal_br", "softcap_causal")
DENSE_MATRIX = [("bf16", h, f) for h in HEAD_DIMS for f in DENSE_FEATURES] + [("fp16", h, f) for h in HEAD_DIMS
                                                                               for f in ("causal_tl", "softcap_causal")]


def _ids(params):
  return [f"{dt}-hd{h}-{f}" for dt, h, f in params]


@pytest.mark.parametrize("dtype,h,feature", MATRIX, ids=_ids(MATRIX))
def test_packed_gqa7(dtype, h, feature):
  d = cases.packed_case(h, cases.GQA7_LAYOUT, h, feature)
  assert test_fuzz.packed_reaches_kernels(d, DTYPES[dtype]), "does not lower to both kernels"
  helpers.check_packed(d, DTYPES[dtype], "cute", np.random.default_rng(h), dirty=feature == "plain")


@pytest.mark.parametrize("dtype,h,feature", DENSE_MATRIX, ids=_ids(DENSE_MATRIX))
def test_padded_lengths(dtype, h, feature):
  p = helpers.random_problem(np.random.default_rng(h), h=h, **cases.DENSE_LAYOUT, **FEATURES[feature])
  assert test_fuzz.dense_reaches_kernels(p, DTYPES[dtype]), "does not lower to both kernels"
  helpers.check_problem(p, DTYPES[dtype], "cute", seed=h, dirty=True)


OTHER_DIMS = [("bf16", h, f) for h in (8, 40, 72, 80, 104, 136, 200) for f in ("plain", "causal_tl")] + [
    ("fp16", 80, "window_causal_br")]


@pytest.mark.parametrize("dtype,h,feature", OTHER_DIMS, ids=_ids(OTHER_DIMS))
def test_head_dims_between_built_ones(dtype, h, feature):
  """Head dims without a kernel of their own run zero-padded on the next wider one: the whole contract."""
  p = helpers.random_problem(np.random.default_rng(h), h=h, **cases.DENSE_LAYOUT, **FEATURES[feature])
  assert test_fuzz.dense_reaches_kernels(p, DTYPES[dtype]), "does not lower to both kernels"
  helpers.check_problem(p, DTYPES[dtype], "cute", seed=h, dirty=True)


@pytest.mark.parametrize("h", [64, 128, 256], ids=lambda h: f"hd{h}")
def test_deterministic(h):
  d = cases.packed_case(h, cases.GQA7_LAYOUT, h, "causal_br")
  rng = np.random.default_rng(h)
  d_out, d_lse = rng.standard_normal(d["q"].shape), rng.standard_normal((d["q"].shape[1], d["q"].shape[0]))
  run = lambda det: helpers.run_packed(d, jnp.bfloat16, helpers.make_packed_runner(  # noqa: E731
      d, "cute", deterministic=det), "zero", rng, d_out, d_lse)
  first = run(True)
  for det, again in ((True, run(True)), (False, run(False)), (False, run(False))):
    for name in first:
      helpers.assert_bitwise_equal(again[name], first[name], f"{name}, deterministic={det}, second call")


@pytest.mark.parametrize("h", [64, 128, 256], ids=lambda h: f"hd{h}")
def test_backward_ignores_padded_residuals(h):
  """The backward kernel reads no padded row of any input, o and lse (the forward's residuals) included:
  poison there leaves dq, dk, dv bitwise unchanged."""
  from jax_padsafe._backends.cute.backward import flash_backward  # the residuals are not reachable otherwise
  from jax_padsafe._backends.cute.forward import flash_forward
  d = cases.packed_case(h, cases.GQA7_LAYOUT, h, "window_causal_br")
  p = d["packed"]
  static = dict(max_seqlen_q=int(np.max(np.diff(d["cu_q"]))), max_seqlen_k=int(np.max(np.diff(d["cu_k"]))),
                scale=h ** -0.5, causal=True, bottom_right=True, window_left=p.window[0], window_right=-1,
                softcap=0.0)
  meta = [jnp.asarray(d[x]) for x in ("cu_q", "cu_k", "used_q", "used_k")]
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
  o, lse = jax.jit(lambda q, k, v: flash_forward(q, k, v, *meta, **static))(bf(d["q"]), bf(d["k"]), bf(d["v"]))
  o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
  rng = np.random.default_rng(h)
  do, dlse = rng.standard_normal(d["q"].shape), rng.standard_normal(lse.shape)
  bwd = jax.jit(lambda *a: flash_backward(*a, *meta, deterministic=True, **static))
  vq, vk = d["valid_q"][None], d["valid_k"][None]

  def grads(poison):
    rows = lambda x, valid: helpers.poison_rows(x[None], valid, poison, rng)[0]  # noqa: E731
    cols = lambda x: rows(x.T, vq).T  # noqa: E731  ([N, total_q]: poison padded columns)
    args = [bf(rows(d["q"], vq)), bf(rows(d["k"], vk)), bf(rows(d["v"], vk)), bf(rows(o, vq)),
            jnp.asarray(cols(lse), jnp.float32), bf(rows(do, vq)), jnp.asarray(cols(dlse), jnp.float32)]
    return [np.asarray(g) for g in bwd(*args)[:3]]

  base = grads("zero")
  for poison in helpers.POISONS:
    for name, a, b in zip(("dq", "dk", "dv"), grads(poison), base):
      helpers.assert_bitwise_equal(a, b, f"{name} with {poison} in the padded rows of every input")
