"""Randomised contract cases: every feature drawn at random, the whole contract checked on each.

The hand-written suites (test_contract, test_varlen) pin one feature per test; this file draws
combinations nobody wrote down: odd T != S, lengths 0 / 1 / full, GQA ratios, causal in both
alignments with windows of any side, softcap, scale, packed segment ids with padding between
documents, bias and boolean masks (pure-JAX path), all head dims (GPU kernels). Each case is checked
against the float64 oracle (accuracy rule), for exact zeros, and for bitwise invariance under every
poison value (``helpers.check_problem``).

Cases are reproducible from their seed; the GPU cases draw only what the kernels support (no bias
or mask, head dims 64..256, bf16/fp16, segment layouts the kernels can express), so that
``implementation="cute"`` never falls back or raises.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers
from tests.conftest import _cute_ready
from tests.test_dispatch import _lowered, _targets, kernels_built  # noqa: F401 (fixture)

CPU_SEEDS = range(12)
GPU_SEEDS = range(100, 140)


def _lengths(rng, b, n_max):
  """Per-row lengths mixing the edge cases (0, 1, full) with random values."""
  choices = [0, 1, n_max, n_max - 1] if n_max > 1 else [0, n_max]
  return np.array([rng.choice(choices) if rng.random() < 0.35 else rng.integers(0, n_max + 1)
                   for _ in range(b)], np.int32)


def _contiguous_ids(rng, b, length, n_docs):
  """Packed documents: ``n_docs`` contiguous runs of ids 0.. per row, with padding (-1) gaps."""
  ids = np.full((b, length), -1, np.int32)
  for r in range(b):
    cuts = np.sort(rng.integers(0, length + 1, size=2 * n_docs))
    for d in range(n_docs):
      ids[r, cuts[2 * d]:cuts[2 * d + 1]] = d
  return ids


def draw_problem(seed, impl):
  rng = np.random.default_rng(seed)
  gpu = impl == "cute"
  b = int(rng.integers(1, 4))
  t = int(rng.integers(1, 200 if gpu else 70))
  s = t if rng.random() < 0.4 else int(rng.integers(1, 200 if gpu else 70))
  kh = int(rng.choice([1, 2, 4]))
  n = kh * int(rng.choice([1, 2, 3]))
  h = int(rng.choice([64, 96, 128, 192, 256] if gpu else [16, 32, 64, 80]))
  p = helpers.random_problem(rng, b=b, t=t, s=s, n=n, k=kh, h=h, q_len=_lengths(rng, b, t),
                             kv_len=_lengths(rng, b, s))
  p.causal = bool(rng.random() < 0.5)
  p.bottom_right = bool(rng.random() < 0.5)
  if rng.random() < 0.3:
    draw = lambda: None if rng.random() < 0.3 else int(rng.integers(0, max(t, s) + 1))
    p.window = (draw(), draw())
  if rng.random() < 0.3:
    p.softcap = float(rng.uniform(2.0, 50.0))
  if rng.random() < 0.3:
    p.scale = float(rng.uniform(0.02, 0.5))
  if rng.random() < 0.35:
    n_docs = int(rng.integers(1, 4))
    p.q_ids = _contiguous_ids(rng, b, t, n_docs)
    # Masked pairs compare positions; the kernels need the documents to sit at the same place on
    # both sides then (self-attention packing), so share the ids.  Otherwise draw key ids apart.
    masked = p.causal or p.window is not None
    p.kv_ids = p.q_ids.copy() if (masked and s == t) else _contiguous_ids(rng, b, s, n_docs)
    if masked and s != t:
      p.q_ids = p.kv_ids = None
    elif masked and gpu:
      p.bottom_right = False  # bottom-right offsets come from the row lengths, not the documents
  if not gpu and rng.random() < 0.2:
    bias = rng.standard_normal((1, n, t, s))
    bias[rng.random(bias.shape) < 0.1] = -np.inf
    p.bias = bias
  if not gpu and p.bias is None and rng.random() < 0.2:
    p.mask = rng.random((b, 1, t, s)) < 0.8
  dtype = rng.choice([jnp.bfloat16, jnp.float16] + ([] if gpu else [jnp.float32]))
  return p, dtype


def _run(seed, impl):
  p, dtype = draw_problem(seed, impl)
  helpers.check_problem(p, dtype, impl, seed=seed)


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_random_contract_xla(seed):
  _run(seed, "xla")


@pytest.mark.skipif(not _cute_ready()[0], reason=_cute_ready()[1] or "no GPU")
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_random_contract_cute(seed):
  _run(seed, "cute")


def test_gpu_draws_reach_the_kernels(kernels_built):
  """Every GPU case lowers (for CUDA, on the CPU) to the forward and backward custom calls under
  implementation="cute": the GPU fuzz really tests the kernels, never a fallback."""
  for seed in GPU_SEEDS:
    p, dtype = draw_problem(seed, "cute")
    kw = helpers.api_kwargs(p, "cute")

    def loss(q, k, v):
      return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, **kw).astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(x.shape, dtype) for x in (p.q, p.k, p.v)]
    targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), *args))
    assert "jax_padsafe_fwd" in targets, (seed, p.shape)
    if p.shape[3] <= 128:  # head dims 192/256: see test_dispatch for the backward's head dims
      assert "jax_padsafe_bwd" in targets, (seed, p.shape)
