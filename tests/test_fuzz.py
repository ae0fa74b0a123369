"""Randomised contract cases: every feature drawn at random, the whole contract checked on each.

The hand-written suites (test_contract, test_varlen) pin one feature per test; this file draws
combinations nobody wrote down: odd T != S, lengths 0 / 1 / full, GQA ratios, causal in both
alignments with windows of any side, softcap, scale, packed segment ids with padding between
documents, boolean masks and additive biases of every broadcast shape (with -inf cells, rows the mask
hides whole and rows whose every cell carries a huge finite negative bias), ALiBi slopes, attention
sinks, a value head dim of its own, all head dims (GPU kernels). Each case is checked against the
float64 oracle (accuracy rule), for exact zeros, and for bitwise invariance under every poison value
(``helpers.check_problem``).

Cases are reproducible from their seed.  The draws for the GPU kernels (``impl="cute"``) take only
what the kernels support (head dims 64..256, bf16/fp16, segment layouts the kernels can express; a
mask, bias or ALiBi slopes on the padded layout with lengths, without softcap; a bias per query or
per key/value head (Hx = N or 1), in q's dtype or float32), so that ``implementation="cute"`` never falls
back or raises; ``tests/gpu/test_fuzz.py`` runs them on a GPU from fresh seeds, and
:func:`test_gpu_draws_reach_the_kernels` checks here, on the CPU, that such draws lower to the kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers, oracle
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
  dtype = rng.choice([jnp.bfloat16, jnp.float16] + ([] if gpu else [jnp.float32]))
  # The kernels take a mask, bias or ALiBi slopes on the padded layout with lengths, without softcap.
  aux = not gpu or (p.q_ids is None and p.softcap is None)
  if aux and rng.random() < 0.25:
    p.mask = _draw_mask(rng, b, n, kh, t, s, gpu)
  bias_dtype = jnp.float32
  if aux and rng.random() < 0.25:
    bias_dtype = jnp.float32 if rng.random() < 0.5 else dtype
    p.bias = oracle.round_to(_draw_bias(rng, b, n, kh, t, s, gpu), bias_dtype)
  if aux and rng.random() < 0.2:
    p.alibi = 2.0 ** -rng.uniform(0.5, 8.0, size=(n,) if rng.random() < 0.5 else (b, n))
  if rng.random() < 0.2:
    p.sinks = helpers.random_sinks(rng, n)
  if rng.random() < 0.15:
    p.v = rng.standard_normal((b, s, kh, int(rng.choice([64, 96, 128, 192] if gpu else [8, 24, 48]))))
  return p, dtype, bias_dtype


def _broadcast_shape(rng, b, n, t, s, heads):
  """A mask / bias shape ``[1|B, heads, 1|T, S]`` (``heads``: the allowed head dims)."""
  return (int(rng.choice([1, b])), int(rng.choice(heads)), int(rng.choice([1, t])), s)


def _draw_mask(rng, b, n, kh, t, s, gpu):
  """A boolean mask: random cells at a random density, or a causal band with key padding (the way Flax
  builds them), and some rows hidden whole (valid rows that see no key)."""
  shape = _broadcast_shape(rng, b, n, t, s, [1, n] if gpu else [1, kh, n])
  if rng.random() < 0.5:
    mask = rng.random(shape) < rng.choice([0.3, 0.8, 0.97])
  else:
    rows = np.arange(shape[2])[:, None] + int(rng.integers(-4, max(s - t, 0) + 5))
    keys = np.arange(s)[None, :]
    cut = rng.integers(0, s + 1, size=(shape[0], 1, 1, 1))
    mask = np.broadcast_to((keys <= rows)[None, None] & (keys < cut), shape).copy()
  if rng.random() < 0.3:
    mask[..., rng.integers(0, shape[2]), :] = False
  return mask


def _draw_bias(rng, b, n, kh, t, s, gpu):
  """An additive bias: normal scores, sometimes with -inf cells and rows whose every cell carries a huge
  finite negative value (the backward must keep ``log(l)`` apart from the row max)."""
  shape = _broadcast_shape(rng, b, n, t, s, [1, n] if gpu else [1, kh, n])
  bias = rng.standard_normal(shape) * rng.choice([0.5, 3.0])
  if rng.random() < 0.3:
    bias[rng.random(shape) < 0.1] = -np.inf
  if rng.random() < 0.3:
    bias[..., rng.integers(0, shape[2]), :] += rng.choice([-1e30, -3e38, -1e4])
  return bias


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
  n = kh * int(rng.choice([1, 2]))
  if rng.random() < 0.2:
    kw["sinks"] = helpers.random_sinks(rng, n)
  d = helpers.build_packed(rng, caps_q, used_q, caps_k, used_k, tail_q=int(rng.integers(0, 9)),
                        tail_k=int(rng.integers(0, 9)), n=n, k=kh,
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
  p, dtype, bias_dtype = draw_problem(seed, impl)
  helpers.check_problem(p, dtype, impl, seed=seed, bias_dtype=bias_dtype)


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
  # The plain kernels' targets or the aux ones (a mask, bias or ALiBi: "jax_padsafe_fwd_aux", ...).
  return (any(t in ("jax_padsafe_fwd", "jax_padsafe_fwd_aux") for t in targets)
          and any(t in ("jax_padsafe_bwd", "jax_padsafe_bwd_aux") for t in targets))


def dense_reaches_kernels(p, dtype, bias_dtype=jnp.float32):
  """Whether a dense draw lowers (for CUDA) to the forward and backward kernels, not the pure-JAX path."""
  kw = helpers.api_kwargs(p, "cute")
  bias = None if p.bias is None else jnp.asarray(p.bias, bias_dtype)
  fn = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, bias, **kw)  # noqa: E731
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
    p, dtype, bias_dtype = draw_problem(seed, "cute")
    assert dense_reaches_kernels(p, dtype, bias_dtype), (seed, p.shape)
  for seed in GPU_SEEDS[:16]:
    d, dtype, _ = draw_packed(seed, "cute")
    assert packed_reaches_kernels(d, dtype), seed
