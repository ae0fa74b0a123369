"""Randomised contract cases: every feature drawn at random, the whole contract checked on each.

The hand-written suites (test_contract, test_varlen) pin one feature per test; this file draws
combinations nobody wrote down: odd T != S, lengths 0 / 1 / full, GQA ratios, causal in both
alignments with windows of any side, softcap, scale, packed segment ids with padding between
documents, bias and boolean masks (pure-JAX path), all head dims (GPU kernels). Each case is checked
against the float64 oracle (accuracy rule), for exact zeros, and for bitwise invariance under every
poison value (``helpers.check_problem``).

Cases are reproducible from their seed.  The draws for the GPU kernels (``impl="cute"``) take only
what the kernels support (no bias or mask, head dims 64..256, bf16/fp16, segment layouts the kernels
can express), so that ``implementation="cute"`` never falls back or raises; ``tests/gpu/test_fuzz.py``
runs them on a GPU from fresh seeds, and :func:`test_gpu_draws_reach_the_kernels` checks here, on the
CPU, that such draws lower to the kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers
from tests.test_dispatch import _lowered, _targets

CPU_SEEDS = range(12)
GPU_SEEDS = range(100, 132)  # draws whose lowering test_gpu_draws_reach_the_kernels checks


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


def draw_problem(seed, impl, max_len=None):
  """A random dense problem; sequence lengths below ``max_len`` (default 200 on the kernels, 70 in pure JAX;
  ``tests/gpu/test_fuzz.py`` also draws longer ones, spanning several tiles and CTAs)."""
  rng = np.random.default_rng(seed)
  gpu = impl == "cute"
  top = max_len or (200 if gpu else 70)
  b = int(rng.integers(1, 4))
  t = int(rng.integers(1, top))
  s = t if rng.random() < 0.4 else int(rng.integers(1, top))
  kh = int(rng.choice([1, 2, 4]))
  n = kh * int(rng.choice([1, 2, 3]))
  h = int(rng.choice([64, 80, 96, 128, 192, 256] if gpu else [16, 32, 64, 80]))
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


def draw_packed(seed, impl, max_len=None):
  """A random packed (varlen) problem: per-sequence capacities and used lengths (gaps between the
  used rows and the next sequence), empty sequences, tails past cu_seqlens[-1].  Capacities below
  ``max_len`` (default 160 on the kernels, 40 in pure JAX)."""
  rng = np.random.default_rng(seed)
  gpu = impl == "cute"
  nseq = int(rng.integers(1, 5))
  top = max_len or (160 if gpu else 40)
  caps_q, caps_k = rng.integers(0, top, size=nseq), rng.integers(0, top, size=nseq)
  used_q = np.minimum(caps_q, np.where(rng.random(nseq) < 0.5, caps_q, rng.integers(0, top, size=nseq)))
  used_k = np.minimum(caps_k, np.where(rng.random(nseq) < 0.5, caps_k, rng.integers(0, top, size=nseq)))
  kh = int(rng.choice([1, 2, 4]))
  kw = dict(causal=bool(rng.random() < 0.5), bottom_right=bool(rng.random() < 0.5))
  if rng.random() < 0.3:
    w = max(40, top // 4)
    kw["window"] = (int(rng.integers(0, w)), None if rng.random() < 0.5 else int(rng.integers(0, w)))
  if rng.random() < 0.3:
    kw["softcap"] = float(rng.uniform(2.0, 50.0))
  d = helpers.build_packed(rng, caps_q, used_q, caps_k, used_k, tail_q=int(rng.integers(0, 9)),
                        tail_k=int(rng.integers(0, 9)), n=kh * int(rng.choice([1, 2])), k=kh,
                        h=int(rng.choice([64, 128, 256] if gpu else [32, 64])), **kw)
  dtype = rng.choice([jnp.bfloat16, jnp.float16] + ([] if gpu else [jnp.float32]))
  # Half the draws leave max_seqlen_q / max_seqlen_k at their default, the packed length (all a jitted step
  # with traced offsets knows): the kernels then size their grids from the buffer and may take the compact
  # tile schedule (kernels/common/bounds.py), whose holes and searches a tight bound never reaches.
  d["loose_bounds"] = bool(rng.random() < 0.5)
  return d, dtype, rng


def _run_packed(seed, impl):
  d, dtype, rng = draw_packed(seed, impl)
  helpers.check_packed(d, dtype, impl, rng)


def _run(seed, impl):
  p, dtype = draw_problem(seed, impl)
  helpers.check_problem(p, dtype, impl, seed=seed)


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_random_contract_xla(seed):
  _run(seed, "xla")


@pytest.mark.parametrize("seed", CPU_SEEDS[:6])
def test_random_packed_contract_xla(seed):
  _run_packed(seed, "xla")


def _reaches_kernels(fn, dtype, *arrays):
  """Whether ``jax.grad(sum(fn(q, k, v)))``, lowered for CUDA (on any machine), calls the forward and the
  backward kernel, not the pure-JAX path."""
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32))

  args = [jax.ShapeDtypeStruct(x.shape, dtype) for x in arrays]
  targets = _targets(_lowered(jax.grad(loss, (0, 1, 2)), *args))
  return "jax_padsafe_fwd" in targets and "jax_padsafe_bwd" in targets


def dense_reaches_kernels(p, dtype):
  """Whether a dense draw lowers (for CUDA) to the forward and backward kernels, not the pure-JAX path."""
  kw = helpers.api_kwargs(p, "cute")
  fn = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, **kw)  # noqa: E731
  return _reaches_kernels(fn, dtype, p.q, p.k, p.v)


def packed_reaches_kernels(d, dtype):
  """The same for a packed draw (``varlen_attention``)."""
  kw = helpers.packed_kwargs(d, "cute")
  cu_q, cu_k = jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"])
  fn = lambda q, k, v: jax_padsafe.varlen_attention(q, k, v, cu_q, cu_k, **kw)  # noqa: E731
  return _reaches_kernels(fn, dtype, d["q"], d["k"], d["v"])


def test_gpu_draws_reach_the_kernels(kernels_built):
  """Every GPU case lowers (for CUDA, on the CPU) to the forward and backward custom calls under
  implementation="cute": the GPU fuzz really tests the kernels, never a fallback."""
  for seed in GPU_SEEDS:
    p, dtype = draw_problem(seed, "cute")
    assert dense_reaches_kernels(p, dtype), (seed, p.shape)
  for seed in GPU_SEEDS[:16]:
    d, dtype, _ = draw_packed(seed, "cute")
    assert packed_reaches_kernels(d, dtype), seed
