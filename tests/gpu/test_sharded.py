"""The kernels under sharding on GPUs: ring attention over the sequence, and batch/head-sharded meshes.  Tests that
need two or more GPUs skip themselves on one; the ring of one device runs anywhere.

* Ring attention (``sharding.ring_attention``) with the kernels on each chunk pair, on a ring of 1 and of 2 GPUs:
  causal contiguous and zigzag layouts, lengths and packed segment ids, non-causal, bottom-right alignment (whose
  off-diagonal pairs are not expressible and run on the pure-JAX blocks), and two random lengths-only rings at odd
  chunk sizes (seeds from JPS_FUZZ_SEED, default random): forward and gradients against the float64 oracle (the
  accuracy rule), exact zeros, bitwise poison invariance, the kernels' custom calls in the compiled program, and
  no conditional in a lengths-only top-left ring (the grouped plan).
* A jitted training step (vjp of ``(out, lse)``) on meshes of 2 or 4 GPUs with the batch, the heads or both
  sharded, for the padded layout with lengths, packed segment ids and ``varlen_attention``: the compiled program
  calls both kernels and holds no collective (MQA's backward gathers its heads, the documented cost), results
  bitwise equal to the same step on one GPU, and bitwise unchanged by NaN or 1e30 in every padded row.

About 20 s on one H100 (the ring of one), 90 s on two.
"""

import os
import re
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_padsafe
from jax_padsafe import sharding
from tests import helpers, oracle
from tests.gpu import cases

pytestmark = cases.needs_kernels()

_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def collectives(hlo):
  return sorted(set(_COLLECTIVE.findall(hlo)))


def kernel_calls(hlo):
  return sorted(set(re.findall(r'custom_call_target="(jax_padsafe_\w+)"', hlo)))


def _need_gpus(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} GPUs, found {len(jax.devices())}")
  return jax.devices()[:n]


RING_CASES = {
    # name: (random_problem kwargs, layout, segment ids?)
    "causal_contiguous_gqa_hd128": (
        dict(b=2, t=256, s=256, n=8, k=2, h=128, q_len=[256, 150], kv_len=[256, 150], causal=True),
        "contiguous", False),
    "causal_zigzag_cross_lengths_hd128": (  # the grouped plan: no run-time control flow
        dict(b=2, t=512, s=512, n=8, k=2, h=128, q_len=[512, 300], kv_len=[470, 333], causal=True),
        "zigzag", False),
    "causal_zigzag_segments_hd64": (
        dict(b=2, t=256, s=256, n=4, k=4, h=64, q_len=[256, 201], kv_len=[256, 201], causal=True),
        "zigzag", True),
    "full_contiguous_cross_lengths_hd128": (
        dict(b=2, t=128, s=128, n=4, k=1, h=128, q_len=[128, 77], kv_len=[100, 128]),
        "contiguous", False),
    "causal_bottom_right_zigzag_hd64": (
        dict(b=2, t=128, s=128, n=4, k=2, h=64, q_len=[128, 60], kv_len=[128, 101], causal=True,
             bottom_right=True),
        "zigzag", False),
}

RING_SEED = int(os.environ.get("JPS_FUZZ_SEED") or secrets.randbelow(10 ** 6) * 100)


def random_ring_case(seed, ways):
  """A random lengths-only ring (the grouped plan) at odd chunk sizes: run starts and lengths that are no
  multiple of a tile, T != S without causal, GQA/MQA, softcap, empty and keyless rows."""
  rng = np.random.default_rng(seed)
  causal = bool(rng.integers(2))
  layout = ("contiguous", "zigzag")[rng.integers(2)]
  unit = ways * (2 if layout == "zigzag" else 1)
  t = unit * int(rng.integers(20, 200))
  s = t if causal else unit * int(rng.integers(10, 200))
  b = int(rng.integers(1, 4))
  k = int(rng.choice([1, 2, 4]))
  kw = dict(b=b, t=t, s=s, n=k * int(rng.choice([1, 2, 4])), k=k, h=int(rng.choice([64, 128])), causal=causal,
            q_len=[t] + [int(x) for x in rng.integers(0, t + 1, size=b - 1)],
            kv_len=[s] + [int(x) for x in rng.integers(0, s + 1, size=b - 1)])
  if rng.integers(3) == 0:
    kw["softcap"] = 20.0
  return kw, layout, False


def _ring_params():
  params = [pytest.param(ways, name, RING_CASES[name], id=f"ring{ways}-{name}") for ways in (1, 2)
            for name in RING_CASES]
  params += [pytest.param(2, f"random{i}", None, id=f"ring2-random{i}") for i in range(2)]
  return params


@pytest.mark.parametrize("ways,name,case", _ring_params())
def test_ring_attention_on_kernels(ways, name, case):
  devs = _need_gpus(ways)
  seed = RING_SEED + int(name[len("random"):]) if case is None else len(name)
  kw, layout, with_ids = case if case is not None else random_ring_case(seed, ways)
  mesh = jax.make_mesh((ways,), ("seq",), devices=devs, axis_types=(jax.sharding.AxisType.Auto,))
  dtype = jnp.bfloat16
  rng = np.random.default_rng(seed)
  p = helpers.random_problem(rng, **kw)
  if with_ids:  # two packed documents per row
    ids = np.where(np.arange(p.q.shape[1]) < 100, 0, 1)[None].repeat(p.q.shape[0], 0)
    p.q_ids, p.kv_ids = ids, ids.copy()
  t, s = p.q.shape[1], p.k.shape[1]
  idx_q = sharding.zigzag_indices(t, ways) if layout == "zigzag" else np.arange(t)
  idx_k = sharding.zigzag_indices(s, ways) if layout == "zigzag" else np.arange(s)
  inv_q, inv_k = np.argsort(idx_q), np.argsort(idx_k)
  api = helpers.api_kwargs(p, None)
  if "query_segment_ids" in api:
    api["query_segment_ids"] = api["query_segment_ids"][:, idx_q]
    api["key_value_segment_ids"] = api["key_value_segment_ids"][:, idx_k]

  def run(q, k, v, do, dl):
    f = lambda q, k, v: sharding.ring_attention(q, k, v, mesh=mesh, axis_name="seq", layout=layout,  # noqa: E731
                                                return_lse=True, **api)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + vjp((do, dl))

  d_out, d_lse = helpers.cotangents(p, rng)
  x, ls = P(None, "seq", None, None), P(None, None, "seq")
  specs = (x, x, x, x, ls)

  def inputs(poison):
    qv, kv = p.q_valid(), p.k_valid()
    q, k, v = (helpers.poison_rows(a, val, poison, rng) for a, val in ((p.q, qv), (p.k, kv), (p.v, kv)))
    do = helpers.poison_rows(d_out, qv, poison, rng)
    dl = np.where(qv[:, None, :], d_lse, helpers.poison_like(d_lse.shape, poison, rng))
    xs = (q[:, idx_q], k[:, idx_k], v[:, idx_k], do[:, idx_q], dl[:, :, idx_q])
    return [jax.device_put(jnp.asarray(a, dtype if i < 4 else jnp.float32), NamedSharding(mesh, sp))
            for i, (a, sp) in enumerate(zip(xs, specs))]

  compiled = jax.jit(run).lower(*inputs("zero")).compile()
  hlo = compiled.as_text()
  calls = kernel_calls(hlo)
  assert "jax_padsafe_fwd" in calls and "jax_padsafe_bwd" in calls, f"kernels not called: {calls}"
  if not with_ids and not kw.get("bottom_right", False):
    # Lengths-only rings in top-left alignment take the grouped plan: no conditional at all (each one would copy
    # its predicate to the host and wait).
    assert not re.findall(r"\bconditional\(", hlo), "conditionals in a grouped ring"

  def results(poison):
    o, lse, dq, dk, dv = (np.asarray(r) for r in compiled(*inputs(poison)))
    return dict(out=o[:, inv_q], lse=lse[:, :, inv_q], dq=dq[:, inv_q], dk=dk[:, inv_k], dv=dv[:, inv_k])

  names = ["out", "lse", "dq", "dk", "dv"]
  base = results("zero")
  ref, naive = oracle.expected(p, dtype, d_out, d_lse)
  try:
    oracle.assert_close(base, ref, naive, dtype, names)
    helpers.assert_contract_zeros(p, base, ref)
    for poison in ("nan", "inf", "1e30", "huge"):
      got = results(poison)
      for nm in names:
        helpers.assert_bitwise_equal(got[nm], base[nm], f"{nm} with {poison} in the padding")
  except AssertionError as e:
    raise AssertionError(f"ring case {name} (seed {seed}, JPS_FUZZ_SEED={RING_SEED}): {e}") from e


def _problem(rng, layout, b, t, n, kh, h):
  mk = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  q, k, v, do = mk(b, t, n, h), mk(b, t, kh, h), mk(b, t, kh, h), mk(b, t, n, h)
  dl = mk(b, n, t)
  lens = rng.integers(t // 3, t + 1, size=b).astype(np.int32)
  lens[0] = t
  valid = np.arange(t)[None] < lens[:, None]
  kw = dict(query_seq_lengths=jnp.asarray(lens), key_value_seq_lengths=jnp.asarray(lens))
  if layout == "segments":  # two packed documents per row, then padding
    ids = np.where(np.arange(t)[None] < (lens[:, None] // 2), 0, 1).astype(np.int32)
    ids = np.where(valid, ids, -1)
    kw = dict(query_segment_ids=jnp.asarray(ids), key_value_segment_ids=jnp.asarray(ids))
  return (q, k, v, do, dl), valid, kw, lens


def _step(layout, kw, lens, b, t):
  def attention(q, k, v):
    if layout == "varlen":
      cu = jnp.arange(b + 1, dtype=jnp.int32) * t
      n, h = q.shape[2], q.shape[3]
      flat = lambda x: x.reshape((b * t,) + x.shape[2:])  # noqa: E731
      used = jnp.asarray(lens)
      o, lse = jax_padsafe.varlen_attention(
          flat(q), flat(k), flat(v), cu, cu, seqused_q=used, seqused_k=used, max_seqlen_q=t, max_seqlen_k=t,
          is_causal=True, return_lse=True, implementation="cute")
      return o.reshape(b, t, n, h), lse.reshape(n, b, t).transpose(1, 0, 2)
    return jax_padsafe.dot_product_attention(q, k, v, is_causal=True, return_lse=True, implementation="cute", **kw)

  def step(q, k, v, do, dl):
    (o, lse), vjp = jax.vjp(attention, q, k, v)
    return (o, lse) + tuple(vjp((do.astype(o.dtype), dl)))

  return step


def _mesh_params():
  params = []
  for layout in ("lengths", "segments", "varlen"):
    for heads in ("gqa", "mqa"):
      for mesh in ("batch", "heads", "batch_heads"):
        if layout == "varlen" and mesh != "heads":
          continue  # the packed layout has no batch axis to shard
        params.append(pytest.param(layout, heads, mesh, id=f"{layout}-{heads}-{mesh}"))
  return params


@pytest.mark.parametrize("layout,heads,mesh_name", _mesh_params())
def test_batch_and_head_sharding(layout, heads, mesh_name):
  _need_gpus(4 if mesh_name == "batch_heads" else 2)
  devs = jax.devices()
  g = min(4, len(devs))
  b, t, h = max(4, g), 384, 128
  n, kh = (16, max(4, g)) if heads == "gqa" else (8, 1)  # GQA: as many kv heads as head shards; MQA: gathered
  shape, qspec = {"batch": ((g, 1), P("d", None, None, None)), "heads": ((1, g), P(None, None, "m", None)),
                  "batch_heads": ((2, g // 2), P("d", None, "m", None))}[mesh_name]
  rng = np.random.default_rng(0)
  (q, k, v, do, dl), valid, kw, lens = _problem(rng, layout, b, t, n, kh, h)
  step = _step(layout, kw, lens, b, t)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
  single = jax.jit(step)(bf(q), bf(k), bf(v), bf(do), jnp.asarray(dl))
  # Auto axes (jax.make_mesh defaults to Explicit from jax 0.10): the jit decides layouts.
  mesh = jax.make_mesh(shape, ("d", "m"), devices=devs[:shape[0] * shape[1]],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  kvspec = qspec if kh % shape[1] == 0 else P(qspec[0], None, None, None)
  specs = (qspec, kvspec, kvspec, qspec, P(qspec[0], qspec[2], None))

  def placed(poison):
    rows = lambda x: np.where(valid[:, :, None, None], x, poison)  # noqa: E731
    xs = (bf(rows(q)), bf(rows(k)), bf(rows(v)), bf(rows(do)),
          jnp.asarray(np.where(valid[:, None, :], dl, poison), jnp.float32))
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, specs)]

  compiled = jax.jit(step).lower(*placed(0.0)).compile()
  hlo = compiled.as_text()
  assert kernel_calls(hlo) == ["jax_padsafe_bwd", "jax_padsafe_fwd"], kernel_calls(hlo)
  if not (kh == 1 and shape[1] > 1):  # MQA's backward split by heads gathers them (documented)
    assert collectives(hlo) == [], f"batch/head-sharded attention must not communicate: {collectives(hlo)}"
  base = compiled(*placed(0.0))
  for name, a, s in zip(("out", "lse", "dq", "dk", "dv"), base, single):
    helpers.assert_bitwise_equal(np.asarray(a), np.asarray(s), f"{name}: sharded vs one GPU")
  for poison in (np.nan, 1e30):
    for name, a, s in zip(("out", "lse", "dq", "dk", "dv"), compiled(*placed(poison)), base):
      helpers.assert_bitwise_equal(np.asarray(a), np.asarray(s), f"{name} with {poison} in the padding")
