"""Two numerical hazards of flash attention's row statistics, and the precision of the matrix products.

* Huge finite biases (-1e30, ``finfo.min``, the way many codebases mask) are additive: a row whose
  every visible score carries one is still a softmax over those keys.  Its ``lse = m + log(l)`` rounds
  to ``m`` in float32, so a backward that recomputes ``P = exp(s - lse)`` gets 1 instead of ``1 / l``;
  the probabilities must come from the max and the log-sum kept apart.
* Cancellation: logits around -120 whose keys share one large component make dQ a small difference of
  large terms (the shared component cancels in ``sum_j dS_j k_j`` only if ``sum_j dS_j`` is ~0, i.e.
  if Delta agrees with the probabilities and dP the backward recomputes).

Each case runs the whole contract (``helpers.check_problem``): every result against the float64
oracle with the accuracy rule, exact zeros, bitwise poison invariance.  On ``impl="cute"`` the bias
cases run on the kernels' aux variants (their forward keeps the row max and log-sum apart for the
backward); a combination the kernels do not take skips, as in ``test_contract``.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_padsafe
from tests import oracle
from tests.helpers import contract, random_problem, random_sinks


DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


def huge_bias_problem(seed, value):
  """Rows of four kinds: every key's bias ``value``; ``value`` on some keys and a normal bias on the
  rest (those win, the others underflow to 0); ``value`` on every key but a few at ``-inf`` (hidden);
  and a plain normal bias."""
  rng = np.random.default_rng(seed)
  p = random_problem(rng, b=2, t=24, s=40, n=4, k=2, h=64, q_len=[24, 13], kv_len=[40, 17],
                     causal=True, bottom_right=True)
  shape = (2, 4, 24, 40)
  bias = 0.5 * rng.standard_normal(shape)
  kind = rng.integers(0, 4, size=shape[:3])[..., None]
  some = rng.random(shape) < 0.5
  hidden = rng.random(shape) < 0.15
  bias = np.where(kind == 0, value, bias)
  bias = np.where((kind == 1) & some, value, bias)
  bias = np.where(kind == 2, np.where(hidden, -np.inf, value), bias)
  p.bias = bias
  return p


HUGE = {"1e30": -1e30, "f32_min": float(np.finfo(np.float32).min)}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("value", list(HUGE), ids=list(HUGE))
def test_huge_finite_bias(impl, dtype, value):
  """A float32 bias of -1e30 or finfo(float32).min is added, forward and backward (dbias included):
  ``s - m`` stays finite (``s >= m`` within a row) and P is recomputed from ``m`` and ``log l``."""
  p = huge_bias_problem(31, HUGE[value])
  base, ref = contract(p, dtype, impl)
  rows = np.all(np.where(ref["visible"], p.bias == HUGE[value], True), axis=-1) & ref["visible"].any(-1)
  assert rows.sum() > 10, "the problem must hold rows whose every visible key carries the huge bias"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("value", ["1e30", "bf16_min"])
def test_huge_finite_bias_bf16(impl, dtype, value):
  """The same with a bfloat16 bias (-1e30 rounded to bfloat16, and finfo(bfloat16).min): it is read in
  float32, and dbias comes back in bfloat16."""
  huge = {"1e30": -1e30, "bf16_min": float(ml_dtypes.finfo(jnp.bfloat16).min)}[value]
  p = huge_bias_problem(32, huge)
  p.bias = oracle.round_to(p.bias, jnp.bfloat16)
  base, _ = contract(p, dtype, impl, bias_dtype=jnp.bfloat16)
  assert base["dbias"].dtype == jnp.bfloat16


def cancellation_problem(seed, causal, bias):
  """Every key's first component is 15 and every query's is 0, so it adds nothing to the logits but
  is all of dQ's first component: ``scale * 15 * sum_j dS_j``, zero exactly, computed as a sum of
  terms ~15 |dS|; values ``4 + N(0, 1)`` make Delta = rowsum(dO * O) large against each dP_j - Delta.
  With ``bias``, a bias of ``-120 + N(0, 1)`` puts the logits around -120 (where lse's float32
  rounding, ~4e-6, is no longer small against the sum of dS_j)."""
  rng = np.random.default_rng(seed)
  p = random_problem(rng, b=2, t=24, s=40, n=4, k=2, h=64, q_len=[24, 13], kv_len=[40, 17],
                     causal=causal)
  p.q[..., 0] = 0.0
  p.k[..., 0] = 15.0
  p.v = 4.0 + p.v
  if bias:
    p.bias = -120.0 + rng.standard_normal((1, 4, 24, 40))
  return p


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cancellation(impl, dtype, causal):
  """dQ of keys with a shared large component: Delta's error must not reach dQ times that component (the
  kernels form Delta from the output rounded to bf16/fp16 and shift dQ to a reference key; the pure-JAX path
  corrects dQ to rowsum(P * dP))."""
  contract(cancellation_problem(33, causal, bias=False), dtype, impl)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cancellation_logits_minus_120(impl, dtype):
  """The same with logits around -120 (through a bias), lse differentiated as well."""
  contract(cancellation_problem(34, True, bias=True), dtype, impl)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cancellation_large_logits(impl, dtype, request):
  """The same with the shared component seen by the queries: every logit of a row moves by ~90 (scale * 50 *
  15), which the softmax removes but P's float32 rounding does not (exp of s - lse at |s| ~ 90)."""
  if impl == "xla" and dtype == jnp.float32:
    # A known gap of the pure-JAX path in float32 that depends on the CPU: dK along the queries' shared
    # component, scale * 50 * sum_i dS_ij, was 3.3x the naive attention's error on one CPU (2026-11-26; 1.2x at
    # a shared component of 10, 6x at 30) and 1.2x on another (2026-11-28). The logits are the cause: XLA's
    # float32 dot of q and k was off by 3.4e-5 at |s| ~ 97 where NumPy's (the naive attention's) was off by
    # 1.8e-5, and the summation order of XLA's CPU dot is the machine's. bf16 / fp16 pass. Not strict, since
    # it passes where the dot sums favourably (docs/design.md: the centred keys that fix it, not used).
    request.applymarker(pytest.mark.xfail(strict=False, reason="pure-JAX float32 P at logits ~90 (CPU-dependent)"))
  p = cancellation_problem(38, True, bias=False)
  p.q[..., 0] = 50.0
  contract(p, dtype, impl)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cancellation_softcap(impl, dtype):
  """The same soft-capped: dS carries the cap's derivative, so its row sum is not the softmax's."""
  p = cancellation_problem(37, True, bias=False)
  p.softcap = 3.0
  contract(p, dtype, impl)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
def test_cancellation_with_sinks(impl, dtype, masked):
  """The same with sinks (the keys' P then sum to 1 - P_sink, and the sinks' gradient reads Delta), with and
  without a mask (the kernels' plain and mask kinds), lse differentiated as well."""
  rng = np.random.default_rng(35 + masked)
  p = cancellation_problem(35 + masked, True, bias=False)
  p.sinks = random_sinks(rng, 4)
  if masked:
    p.mask = rng.random((2, 1, 24, 40)) < 0.8
  contract(p, dtype, impl)


def test_delta_from_probabilities():
  """The pure-JAX backward given the kernels' statistics (no float32 output) forms Delta from the P and dP it
  recomputes: the same gradients, dbias included, as from the float32 output, to float32 rounding."""
  from jax_padsafe._backends import xla
  from jax_padsafe._core import problem as canonical
  from jax_padsafe._core.spec import AttentionSpec
  rng = np.random.default_rng(36)
  b, t, s, n, kh, h = 2, 24, 40, 4, 2, 32
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, h)))
  bias = jnp.asarray(rng.standard_normal((b, n, t, s)), jnp.float32)
  mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.8)
  spec = AttentionSpec(scale=0.2, causal=True)
  prob = canonical.from_padded(spec, b, t, s, "top_left", jnp.array([24, 13]), jnp.array([40, 17]), None, None,
                               kernel_view=False)
  o, lse, stats = xla.forward_with_stats(spec, q, k, v, bias, mask, *prob.rows())
  do, dl = jnp.asarray(rng.standard_normal(o.shape), jnp.float32), jnp.asarray(rng.standard_normal(lse.shape),
                                                                                jnp.float32)
  with_o = xla.backward(spec, q, k, v, bias, mask, *prob.rows(), o, lse, do, dl, stats)
  from_p = xla.backward(spec, q, k, v, bias, mask, *prob.rows(), o, lse, do, dl, stats._replace(o=None))
  for name, a, e in zip(("dq", "dk", "dv", "dbias"), from_p, with_o):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-4, atol=2e-5, err_msg=name)


def _dots(jaxpr):
  """Every dot_general of a jaxpr, nested jaxprs (scan bodies, custom_vjp) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn)
    for sub in _sub_jaxprs(eqn.params):
      found += _dots(sub)
  return found


def _sub_jaxprs(params):
  """The jaxprs among an equation's parameters (a ``Jaxpr`` or ``ClosedJaxpr``, alone or in a tuple),
  found by their attributes: the helper jax once had for this is gone from newer versions."""
  for value in params.values():
    for x in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(x, "eqns"):
        yield x
      elif hasattr(getattr(x, "jaxpr", None), "eqns"):
        yield x.jaxpr


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matmul_precision(dtype):
  """The pure-JAX path multiplies low-precision inputs in their own dtype with float32 accumulation
  at default precision (as the kernels and jax.nn do); float32 inputs at full float32 precision."""
  rng = np.random.default_rng(35)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), dtype) for _ in range(3))
  bias = jnp.asarray(rng.standard_normal((1, 2, 8, 8)), jnp.float32)

  def loss(q, k, v, bias):
    o, lse = jax_padsafe.dot_product_attention(q, k, v, bias, implementation="xla", return_lse=True,
                                               query_seq_lengths=jnp.array([6]))
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

  dots = _dots(jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, bias).jaxpr)
  assert len(dots) >= 7, "forward QK^T, PV; backward QK^T, dO V^T, dS K, dS^T Q, P^T dO"
  for eqn in dots:
    operands = {x.aval.dtype for x in eqn.invars}
    assert operands == {jnp.dtype(dtype)}, f"operands {operands} for {dtype.__name__} inputs"
    assert eqn.params["preferred_element_type"] == jnp.float32
    precision = eqn.params["precision"]
    highest = precision is not None and jax.lax.Precision.HIGHEST in tuple(precision)
    assert highest == (jnp.dtype(dtype) == jnp.float32), f"precision {precision}"
