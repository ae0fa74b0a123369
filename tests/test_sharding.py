"""Sharding on 4 devices: fake CPU devices in CI (``tests/conftest.py`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=4``), or 4 real GPUs.

* Batch/head sharding of ``dot_product_attention`` / ``varlen_attention``: the compiled HLO of the
  forward+backward has no all-gather/all-reduce, and results equal the single-device results.
* The custom_partitioning mechanism for opaque (FFI) forwards, on a pure-JAX stand-in.
* Ring attention (``jax_padsafe.sharding``): outputs, lse and gradients against the float64 oracle
  and the single-device path, the contract's exact zeros, bitwise poison invariance, and only
  collective-permutes in the HLO (and with sinks one all-reduce, of their gradient); contiguous and
  zigzag layouts, MHA and GQA, causal in both alignments, window, softcap, sinks, lengths and segment
  ids.

Sharded results are compared with single-device results within float rounding (XLA fuses the
per-shard programs differently, so they are not bitwise equal); poison invariance *is* bitwise.
Every case compiles once and reuses the executable for all poisons (small shapes: the file runs in
about a minute on two CPU cores).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_padsafe
from jax_padsafe._backends import partitioning as _partitioning
from jax_padsafe import sharding
from tests import helpers, oracle

# Runs on 4 fake CPU devices in CI and on real GPUs where a machine has 4 or more.
pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4,
    reason="needs 4 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4)")

POISONS = ("nan", "inf", "huge")
_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(-start)?\(")


def collectives(hlo_text):
  return sorted({m.group(1) for m in _COLLECTIVE.finditer(hlo_text)})


def make_mesh(shape, names, explicit=False):
  kinds = getattr(jax.sharding, "AxisType", None)
  if kinds is None:
    return jax.make_mesh(shape, names)
  kind = kinds.Explicit if explicit else kinds.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def place(x, mesh, spec, dtype=None):
  return jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, spec))


def compile_for(fn, mesh, args, specs):
  """AOT-compiles ``fn`` for arguments placed on ``specs``; returns (executable, HLO text)."""
  placed = [place(a, mesh, s) for a, s in zip(args, specs)]
  compiled = jax.jit(fn).lower(*placed).compile()
  return compiled, compiled.as_text()


def poisoned_inputs(p, dtype, poison, rng, d_out, d_lse):
  """Q, K, V, dO, dlse (natural order, NumPy) with every padded row poisoned."""
  qv, kv = p.q_valid(), p.k_valid()
  q = helpers.poison_rows(p.q, qv, poison, rng)
  k = helpers.poison_rows(p.k, kv, poison, rng)
  v = helpers.poison_rows(p.v, kv, poison, rng)
  do = helpers.poison_rows(d_out, qv, poison, rng)
  dl = np.where(qv[:, None, :], d_lse, helpers.poison_like(d_lse.shape, poison, rng))
  return [np.asarray(jnp.asarray(x, dtype)) for x in (q, k, v, do)] + [np.asarray(dl, np.float32)]


def assert_matches_single_device(ours, single, dtype, names):
  for name in names:
    a, b = np.asarray(ours[name], np.float64), np.asarray(single[name], np.float64)
    assert np.array_equal(np.isfinite(a), np.isfinite(b)), f"{name}: non-finite pattern differs"
    fin = np.isfinite(b)
    assert np.array_equal(a[~fin], b[~fin]), name
    tol = (4 * float(jnp.finfo(dtype).eps) + 1e-6) * max(1.0, float(np.max(np.abs(b[fin]), initial=0)))
    np.testing.assert_allclose(a[fin], b[fin], rtol=0, atol=tol, err_msg=name)


# --------------------------------------------------------------------------------------------------
# Batch / head sharding of the public functions
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["mha_batch_heads", "gqa_batch_heads_segments"])
def test_batch_head_sharded_padded(case):
  rng = np.random.default_rng(11)
  if case == "mha_batch_heads":
    p = helpers.random_problem(rng, b=4, t=24, s=40, n=4, k=4, h=16, q_len=[24, 9, 0, 3],
                               kv_len=[40, 5, 7, 0], causal=True, bottom_right=True, softcap=20.0)
  else:
    ids = np.repeat(np.array([[0, 1, 2, -1]]), 6, axis=1).repeat(4, 0)
    p = helpers.random_problem(rng, b=4, t=24, s=24, n=8, k=2, h=16, q_len=[24, 20, 1, 13],
                               kv_len=[24, 11, 24, 5], causal=True, window=(6, None),
                               q_ids=ids, kv_ids=ids[:, ::-1].copy())
  mesh = make_mesh((2, 2), ("data", "model"))
  x, lse = P("data", None, "model", None), P("data", "model", None)
  runner = helpers.make_runner(p, "xla")
  d_out, d_lse = helpers.cotangents(p, rng)
  dtype = jnp.float32

  inputs = poisoned_inputs(p, dtype, "zero", rng, d_out, d_lse)
  args = inputs[:3] + [None, None] + inputs[3:]  # no bias, no mask
  placed = [None if a is None else place(a, mesh, s)
            for a, s in zip(args, (x, x, x, None, None, x, lse))]
  compiled = jax.jit(runner).lower(*placed).compile()
  assert collectives(compiled.as_text()) == [], "batch/head-sharded attention must not communicate"
  forward_only = jax.jit(lambda q, k, v: jax_padsafe.dot_product_attention(
      q, k, v, return_lse=True, **helpers.api_kwargs(p, "xla"))).lower(*placed[:3]).compile()
  assert collectives(forward_only.as_text()) == []

  def run(poison):
    inp = poisoned_inputs(p, dtype, poison, rng, d_out, d_lse)
    args = inp[:3] + [None, None] + inp[3:]
    res = compiled(*[None if a is None else place(a, mesh, s)
                     for a, s in zip(args, (x, x, x, None, None, x, lse))])
    assert res["out"].sharding.spec[:3] == ("data", None, "model")
    return {k: np.asarray(v) for k, v in res.items()}

  base = run("zero")
  single = helpers.run_padded(p, dtype, runner, d_out=d_out, d_lse=d_lse)
  names = ["out", "lse", "dq", "dk", "dv"]
  assert_matches_single_device(base, single, dtype, names)
  ref = oracle.reference(p, d_out, d_lse)
  helpers.assert_contract_zeros(p, base, ref)
  for poison in POISONS:
    got = run(poison)
    for name in names:
      helpers.assert_bitwise_equal(got[name], base[name], f"{name} with {poison} in the padding")


def test_head_sharded_varlen():
  rng = np.random.default_rng(5)
  n, kh, h = 4, 2, 16
  cu = np.array([0, 10, 30, 40], np.int32)
  used = np.array([10, 15, 7], np.int32)
  total = 48
  valid = np.zeros(total, bool)
  for i in range(3):
    valid[cu[i]:cu[i] + used[i]] = True
  q, k, v = (rng.standard_normal((total, m, h)) for m in (n, kh, kh))
  do, dl = rng.standard_normal((total, n, h)), rng.standard_normal((n, total))

  def run(q, k, v, do, dl):
    f = lambda q, k, v: jax_padsafe.varlen_attention(
        q, k, v, jnp.asarray(cu), jnp.asarray(cu), seqused_q=jnp.asarray(used),
        seqused_k=jnp.asarray(used), is_causal=True, return_lse=True, implementation="xla",
        block_k=8)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + vjp((do, dl))

  mesh = make_mesh((2, 2), ("data", "model"))
  x, lse = P(None, "model", None), P("model", None)
  specs = (x, x, x, x, lse)

  def inputs(poison):
    vm = valid[None]
    pq, pk, pv, pdo = (helpers.poison_rows(a[None], vm, poison, rng)[0] for a in (q, k, v, do))
    pdl = np.where(valid[None], dl, helpers.poison_like(dl.shape, poison, rng))
    return [pq, pk, pv, pdo, pdl]

  compiled, hlo = compile_for(run, mesh, [np.float32(a) for a in inputs("zero")], specs)
  assert collectives(hlo) == []
  base = [np.asarray(r) for r in compiled(*[place(a, mesh, s, jnp.float32)
                                             for a, s in zip(inputs("zero"), specs)])]
  single = [np.asarray(r) for r in jax.jit(run)(*[jnp.float32(a) for a in inputs("zero")])]
  names = ["out", "lse", "dq", "dk", "dv"]
  assert_matches_single_device(dict(zip(names, base)), dict(zip(names, single)), jnp.float32, names)
  assert np.all(base[0][~valid] == 0) and np.all(base[1][:, ~valid] == 0)
  for poison in POISONS:
    got = compiled(*[place(a, mesh, s, jnp.float32) for a, s in zip(inputs(poison), specs)])
    for name, a, b in zip(names, got, base):
      helpers.assert_bitwise_equal(a, b, f"{name} with {poison} in the padding")


@pytest.mark.parametrize("heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("implementation", [None, "xla"], ids=["default", "xla"])
def test_explicit_mesh_under_set_mesh(heads, implementation):
  """jax.make_mesh's default (Explicit axes) with jax.set_mesh, as JAX's sharding-in-types guide
  does it: a batch- and head-sharded training step traces (the pure-JAX path's scan carries keep
  their sharding type; MQA's dK/dV reduction over sharded heads is given its output sharding) and
  matches the unsharded step."""
  if not hasattr(jax, "set_mesh"):
    pytest.skip("jax.set_mesh not available")
  n, kh = heads
  rng = np.random.default_rng(n + kh)
  mesh = make_mesh((2, 2), ("data", "model"), explicit=True)
  q = rng.standard_normal((4, 24, n, 16)).astype(np.float32)
  k = rng.standard_normal((4, 24, kh, 16)).astype(np.float32)
  v = rng.standard_normal((4, 24, kh, 16)).astype(np.float32)
  lens = jnp.array([24, 3, 17, 0], jnp.int32)

  def loss(q, k, v):
    o = jax_padsafe.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lens,
                                          implementation=implementation)
    return jnp.sum(o * o)

  step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
  expected = step(q, k, v)
  kv_spec = P("data", None, "model" if kh % 2 == 0 else None, None)
  with jax.set_mesh(mesh):
    args = (place(q, mesh, P("data", None, "model", None)), place(k, mesh, kv_spec),
            place(v, mesh, kv_spec))
    got = step(*args)
  for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# custom_partitioning mechanism for opaque forwards (stand-in for the FFI kernel)
# --------------------------------------------------------------------------------------------------

standin_flash_forward = helpers.standin_flash_forward


_STATIC = dict(max_seqlen_q=16, max_seqlen_k=16, scale=0.25, causal=True, bottom_right=True,
               window_left=-1, window_right=-1, softcap=0.0)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (6, 3)], ids=["gqa", "mqa", "gqa_unshardable"])
def test_partitioned_forward(layout, heads):
  n, kh = heads
  rng = np.random.default_rng(n * kh)
  mesh = make_mesh((2, 2), ("data", "model"))
  b, t = 4, 16
  lens = jnp.array([16, 5, 0, 9], jnp.int32)
  q = jnp.asarray(rng.standard_normal((b, t, n, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kh, 8)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, kh, 8)), jnp.float32)
  kv_heads = "model" if kh % 2 == 0 else None
  if layout == "packed":
    fn = _partitioning.partition_packed_forward(standin_flash_forward)
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    args = (q.reshape(b * t, n, 8), k.reshape(b * t, kh, 8), v.reshape(b * t, kh, 8), cu, cu, lens,
            lens)
    specs = (P(None, "model"), P(None, kv_heads), P(None, kv_heads), P(), P(), P(), P())
    expected = standin_flash_forward(*args, **_STATIC)
  else:
    fn = _partitioning.partition_padded_forward(_partitioning.packed_to_padded(standin_flash_forward))
    args = (q, k, v, lens, lens)
    specs = (P("data", None, "model"), P("data", None, kv_heads), P("data", None, kv_heads),
             P("data"), P("data"))
    expected = _partitioning.packed_to_padded(standin_flash_forward)(*args, **_STATIC)
  call = lambda *a: fn(*a, **_STATIC)
  compiled, hlo = compile_for(call, mesh, args, specs)
  got = compiled(*[place(a, mesh, s) for a, s in zip(args, specs)])
  for a, e in zip(got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)
  if kh % 2 == 0 or kh == 1:
    assert collectives(hlo) == [], "whole-group head sharding must run shard-local"
    assert got[0].sharding.spec[1 if layout == "packed" else 2] == "model"
  else:
    # 3 key/value heads cannot be split 2 ways: documented re-shard (heads gathered), still right.
    assert "all-gather" in collectives(hlo)
    strict = _partitioning.partition_packed_forward(standin_flash_forward, head_sharding="strict") \
        if layout == "packed" else _partitioning.partition_padded_forward(
            _partitioning.packed_to_padded(standin_flash_forward), head_sharding="strict")
    with pytest.raises(Exception, match="whole groups"):
      compile_for(lambda *a: strict(*a, **_STATIC), mesh, args, specs)


@pytest.mark.parametrize("heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
def test_partitioned_runs_forward_and_backward(heads):
  """Segment-id runs (the padded layout's route to the kernels): batch- and head-sharded forward
  and backward run shard-local, with results equal to the unsharded call. The MQA backward sums
  dK/dV over every query head, so it is not split by heads (heads gathered), and still right."""
  n, kh = heads
  rng = np.random.default_rng(40 + n)
  mesh = make_mesh((2, 2), ("data", "model"))
  b, t, h = 4, 16, 8
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v, do = mk(b, t, n, h), mk(b, t, kh, h), mk(b, t, kh, h), mk(b, t, n, h)
  dl = mk(b, n, t)
  # Two runs per row (packed sequences); the last row holds one.
  q_start = jnp.array([[0, 7], [0, 3], [2, 10], [0, 16]], jnp.int32)
  q_used = jnp.array([[7, 9], [3, 13], [5, 4], [16, 0]], jnp.int32)
  runs = (q_start, q_used, q_start, q_used)
  fwd = _partitioning.packed_to_runs(standin_flash_forward)
  bwd = _partitioning.packed_backward_to_runs(helpers.standin_flash_backward)
  o, lse = fwd(q, k, v, *runs, **_STATIC)
  expected = bwd(q, k, v, o, lse, do, dl, *runs, **_STATIC)
  kv_heads = "model" if kh % 2 == 0 else None
  qs, kvs, ls, rs = P("data", None, "model"), P("data", None, kv_heads), P("data", "model"), P("data")
  fn = _partitioning.partition_runs_forward(fwd)
  compiled, hlo = compile_for(lambda *a: fn(*a, **_STATIC), mesh, (q, k, v) + runs,
                              (qs, kvs, kvs) + (rs,) * 4)
  assert collectives(hlo) == []
  got = compiled(*[place(a, mesh, sp) for a, sp in zip((q, k, v) + runs, (qs, kvs, kvs) + (rs,) * 4)])
  for a, e in zip(got, (o, lse)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)
  fn = _partitioning.partition_runs_backward(bwd)
  args = (q, k, v, o, lse, do, dl) + runs
  specs = (qs, kvs, kvs, qs, ls, qs, ls) + (rs,) * 4
  compiled, hlo = compile_for(lambda *a: fn(*a, **_STATIC), mesh, args, specs)
  if kh % 2 == 0:
    assert collectives(hlo) == [], "whole-group head sharding must run shard-local"
  else:
    assert "all-reduce" not in collectives(hlo), "MQA dK/dV must not be partial sums"
  got = compiled(*[place(a, mesh, sp) for a, sp in zip(args, specs)])
  for name, a, e in zip(("dq", "dk", "dv"), got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5, err_msg=name)


def _standin_backward_delta(q, k, v, o, lse, do, dlse, cu_q, cu_k, used_q, used_k, **static):
  """The stand-in backward that also returns a Delta workspace ``[N, total_q]`` (rowsum(dO * o) here)."""
  grads = helpers.standin_flash_backward(q, k, v, o, lse, do, dlse, cu_q, cu_k, used_q, used_k, **static)
  return grads + (jnp.sum(do * o, axis=-1).T,)


def test_partitioned_runs_backward_with_delta():
  """The runs backward that returns its Delta workspace (the sinks' gradient reads it): batch- and
  head-sharded calls run shard-local, Delta split like lse, results equal to the unsharded call."""
  rng = np.random.default_rng(46)
  mesh = make_mesh((2, 2), ("data", "model"))
  b, t, n, kh, h = 4, 16, 8, 2, 8
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q, k, v, do, o = mk(b, t, n, h), mk(b, t, kh, h), mk(b, t, kh, h), mk(b, t, n, h), mk(b, t, n, h)
  lse, dl = mk(b, n, t), mk(b, n, t)
  q_start = jnp.array([[0, 7], [0, 3], [2, 10], [0, 16]], jnp.int32)
  q_used = jnp.array([[7, 9], [3, 13], [5, 4], [16, 0]], jnp.int32)
  runs = (q_start, q_used, q_start, q_used)
  bwd = _partitioning.packed_backward_to_runs(_standin_backward_delta, with_delta=True)
  expected = bwd(q, k, v, o, lse, do, dl, *runs, **_STATIC)
  assert len(expected) == 4 and expected[3].shape == (b, n, t)
  fn = _partitioning.partition_runs_backward_delta(bwd)
  qs, kvs, ls, rs = P("data", None, "model"), P("data", None, "model"), P("data", "model"), P("data")
  args = (q, k, v, o, lse, do, dl) + runs
  specs = (qs, kvs, kvs, qs, ls, qs, ls) + (rs,) * 4
  compiled, hlo = compile_for(lambda *a: fn(*a, **_STATIC), mesh, args, specs)
  assert collectives(hlo) == []
  got = compiled(*[place(a, mesh, sp) for a, sp in zip(args, specs)])
  for name, a, e in zip(("dq", "dk", "dv", "delta"), got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5, err_msg=name)


def _standin_aux_forward(q, k, v, cu_q, cu_k, used_q, used_k, mask, bias, tile_map, row_range, col_range, slopes,
                         *, has_mask, has_bias, has_alibi, **static):
  """Pure-JAX stand-in with the aux kernels' packed signature (padded layout: sequence b at rows b*T)."""
  del cu_k, tile_map, row_range, col_range, static
  b = used_q.shape[0]
  t, s = q.shape[0] // b, k.shape[0] // b
  rows = lambda x, l: x.reshape((b, l) + x.shape[1:])  # noqa: E731
  o, lse = jax_padsafe.dot_product_attention(
      rows(q, t), rows(k, s), rows(v, s), bias if has_bias else None, mask=mask if has_mask else None,
      query_seq_lengths=used_q, key_value_seq_lengths=used_k, implementation="xla", return_lse=True,
      alibi_slopes=slopes[0, :, 0, 0] if has_alibi else None)  # the test's slopes are shared by the batch
  lse_rows = jnp.transpose(lse, (1, 0, 2)).reshape(lse.shape[1], -1)
  return o.reshape(q.shape), lse_rows, lse_rows + 1.0, lse_rows * 2.0


def _standin_aux_backward(q, k, v, o, lse, do, dlse, cu_q, cu_k, used_q, used_k, mask, bias, tile_map,
                          row_range, col_range, slopes, row_max, log_sum, *, has_mask, has_bias, has_alibi,
                          **static):
  """A stand-in of the aux backward's signature: the VJP of the stand-in forward (the statistics unused)."""
  del o, lse, dlse, row_max, log_sum
  f = lambda q, k, v: _standin_aux_forward(q, k, v, cu_q, cu_k, used_q, used_k, mask, bias, tile_map,  # noqa
                                           row_range, col_range, slopes, has_mask=has_mask, has_bias=has_bias,
                                           has_alibi=has_alibi)[0]
  _, vjp = jax.vjp(f, q, k, v)
  return vjp(do)


def test_partitioned_runs_aux_forward_and_backward():
  """Masks, biases and ALiBi slopes on the kernels' route: batch- and head-sharded calls run shard-local, a mask
  that varies per sequence splits with the batch, a bias (and slopes) shared by the batch but given per head split
  with the heads."""
  rng = np.random.default_rng(47)
  mesh = make_mesh((2, 2), ("data", "model"))
  b, t, s, n, kh, h = 4, 16, 20, 8, 2, 8
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q, k, v, do = mk(b, t, n, h), mk(b, s, kh, h), mk(b, s, kh, h), mk(b, t, n, h)
  dl = mk(b, n, t)
  mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.8)
  bias = mk(1, n, t, s)
  from jax_padsafe._backends.cute import aux as aux_ops
  ops = aux_ops.operands(bias, mask, alibi_slopes=jnp.asarray(rng.uniform(0.1, 1.0, (1, n)), jnp.float32))
  lens_q, lens_k = jnp.array([16, 5, 0, 9], jnp.int32), jnp.array([20, 3, 7, 0], jnp.int32)
  zero = jnp.zeros((b, 1), jnp.int32)
  runs = (zero, lens_q[:, None], zero, lens_k[:, None])
  static = dict(_STATIC, **ops.flags)
  fwd = _partitioning.packed_to_runs_aux(_standin_aux_forward)
  bwd = _partitioning.packed_backward_to_runs_aux(_standin_aux_backward)
  aux_args = ops.arrays
  expected = fwd(q, k, v, *runs, *aux_args, **static)
  qs, kvs, ls, rs = P("data", None, "model"), P("data", None, "model"), P("data", "model"), P("data")
  aux_specs = (P("data"), P(None, "model"), P("data"), P("data"), P("data"), P(None, "model"))
  fn = _partitioning.partition_runs_forward_aux(fwd)
  args, specs = (q, k, v) + runs + aux_args, (qs, kvs, kvs) + (rs,) * 4 + aux_specs
  compiled, hlo = compile_for(lambda *a: fn(*a, **static), mesh, args, specs)
  assert collectives(hlo) == [], "batch- and head-sharded masks and biases must run shard-local"
  got = compiled(*[place(a, mesh, sp) for a, sp in zip(args, specs)])
  for a, e in zip(got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)
  o, lse, row_max, log_sum = expected
  expected = bwd(q, k, v, o, lse, do, dl, *runs, *aux_args, row_max, log_sum, **static)
  fn = _partitioning.partition_runs_backward_aux(bwd)
  args = (q, k, v, o, lse, do, dl) + runs + aux_args + (row_max, log_sum)
  specs = (qs, kvs, kvs, qs, ls, qs, ls) + (rs,) * 4 + aux_specs + (ls, ls)
  compiled, hlo = compile_for(lambda *a: fn(*a, **static), mesh, args, specs)
  assert collectives(hlo) == [], "whole-group head sharding must run shard-local"
  got = compiled(*[place(a, mesh, sp) for a, sp in zip(args, specs)])
  for name, a, e in zip(("dq", "dk", "dv"), got, expected):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5, err_msg=name)


def _standin_dbias(q, k, v, do, delta, cu_q, cu_k, used_q, used_k, mask, bias, tile_map, row_range, col_range,
                   slopes, row_max, log_sum, *, has_mask, has_bias, has_alibi, **static):
  """A stand-in of the bias gradient's signature: the bias's VJP of the stand-in forward."""
  del delta, row_max, log_sum
  f = lambda bias: _standin_aux_forward(q, k, v, cu_q, cu_k, used_q, used_k, mask, bias, tile_map,  # noqa
                                        row_range, col_range, slopes, has_mask=has_mask, has_bias=has_bias,
                                        has_alibi=has_alibi)[0]
  _, vjp = jax.vjp(f, bias)
  return vjp(do)[0]


@pytest.mark.parametrize("bias_batch", [1, 4], ids=["shared_bias", "per_sequence_bias"])
def test_partitioned_runs_dbias(bias_batch):
  """The bias gradient under batch and head sharding: a bias given per sequence and head splits with the
  call (shard-local); one shared by the batch is summed over the batch, so the batch is not split for it
  (every shard computes the sum: never a partial sum)."""
  rng = np.random.default_rng(53)
  mesh = make_mesh((2, 2), ("data", "model"))
  b, t, s, n, kh, h = 4, 16, 20, 8, 2, 8
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q, k, v, do = mk(b, t, n, h), mk(b, s, kh, h), mk(b, s, kh, h), mk(b, t, n, h)
  mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.8)
  bias = mk(bias_batch, n, t, s)
  from jax_padsafe._backends.cute import aux as aux_ops
  ops = aux_ops.operands(bias, mask)
  lens_q, lens_k = jnp.array([16, 5, 0, 9], jnp.int32), jnp.array([20, 3, 7, 0], jnp.int32)
  zero = jnp.zeros((b, 1), jnp.int32)
  runs = (zero, lens_q[:, None], zero, lens_k[:, None])
  static = dict(_STATIC, **ops.flags)
  dbias = _partitioning.packed_dbias_to_runs(_standin_dbias)
  stats = (mk(b, n, t),) * 3  # delta, row max, log sum: unused by the stand-in
  args = (q, k, v, do, stats[0]) + runs + ops.arrays + stats[1:]
  expected = dbias(*args, **static)
  assert expected.shape == bias.shape
  qs, kvs, ls, rs = P("data", None, "model"), P("data", None, "model"), P("data", "model"), P("data")
  bias_spec = P("data", "model") if bias_batch == b else P(None, "model")
  specs = (qs, kvs, kvs, qs, ls) + (rs,) * 4 + (P("data"), bias_spec, P("data"), P("data"), P("data"), P()) + (ls, ls)
  fn = _partitioning.partition_runs_dbias(dbias)
  compiled, hlo = compile_for(lambda *a: fn(*a, **static), mesh, args, specs)
  if bias_batch == b:
    assert collectives(hlo) == [], "a per-sequence, per-head bias gradient must run shard-local"
  got = compiled(*[place(a, mesh, sp) for a, sp in zip(args, specs)])
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_partitioned_forward_explicit_mesh():
  """The mechanism on a mesh with Explicit axes (jax.make_mesh's default from jax 0.10)."""
  rng = np.random.default_rng(3)
  mesh = make_mesh((2, 2), ("data", "model"), explicit=True)
  fn = _partitioning.partition_packed_forward(standin_flash_forward)
  cu = jnp.array([0, 16, 40, 64], jnp.int32)
  used = jnp.array([16, 20, 3], jnp.int32)
  args = (rng.standard_normal((64, 8, 8)), rng.standard_normal((64, 2, 8)),
          rng.standard_normal((64, 2, 8)))
  args = tuple(jnp.asarray(a, jnp.float32) for a in args) + (cu, cu, used, used)
  specs = (P(None, "model"), P(None, "model"), P(None, "model"), P(), P(), P(), P())
  compiled, hlo = compile_for(lambda *a: fn(*a, **_STATIC), mesh, args, specs)
  assert collectives(hlo) == []
  got = compiled(*[place(a, mesh, s) for a, s in zip(args, specs)])
  for a, e in zip(got, standin_flash_forward(*args, **_STATIC)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------------------

RING_CASES = {
    # name: (problem kwargs, dtype, mesh shape, mesh names, seq axis, batch axis, head axis, layout)
    "mha_full_contiguous": (
        dict(b=2, t=32, s=32, n=2, k=2, h=16, q_len=[32, 19], kv_len=[27, 32]),
        jnp.float32, (4,), ("seq",), "seq", None, None, "contiguous"),
    "gqa_causal_zigzag": (
        dict(b=2, t=32, s=32, n=4, k=2, h=16, q_len=[32, 21], kv_len=[32, 21], causal=True),
        jnp.float32, (4,), ("seq",), "seq", None, None, "zigzag"),
    "gqa_causal_bottom_right_zigzag_bf16": (
        dict(b=2, t=16, s=32, n=4, k=1, h=16, q_len=[16, 6], kv_len=[30, 9], causal=True,
             bottom_right=True),
        jnp.bfloat16, (4,), ("seq",), "seq", None, None, "zigzag"),
    "window_softcap_segments_data_x_seq": (
        dict(b=2, t=32, s=32, n=4, k=2, h=16, q_len=[32, 25], kv_len=[32, 30], causal=True,
             window=(5, None), softcap=15.0),
        jnp.float32, (2, 2), ("data", "seq"), "seq", "data", None, "zigzag"),
    "gqa_heads_x_seq_explicit_mesh": (
        dict(b=1, t=24, s=24, n=4, k=2, h=16, q_len=[17], kv_len=[23], causal=True),
        jnp.float32, (2, 2), ("model", "seq"), "seq", None, "model", "contiguous"),
    # The grouped plan (bf16 at a kernel head dim, lengths only): one call per group of chunk
    # pairs, selected by runs. On the CPU its calls run on the pure-JAX path with the runs as
    # segments, so these check the plan itself; tests/gpu/test_sharded.py runs it on the kernels.
    "gqa_causal_zigzag_cross_lengths_grouped_bf16": (
        dict(b=3, t=32, s=32, n=4, k=2, h=64, q_len=[32, 21, 0], kv_len=[27, 32, 5], causal=True),
        jnp.bfloat16, (4,), ("seq",), "seq", None, None, "zigzag"),
    "mqa_full_contiguous_t_ne_s_grouped_bf16": (
        dict(b=3, t=32, s=16, n=4, k=1, h=64, q_len=[32, 9, 20], kv_len=[13, 3, 0]),
        jnp.bfloat16, (4,), ("seq",), "seq", None, None, "contiguous"),
    "gqa_causal_zigzag_heads_x_seq_grouped_bf16": (
        dict(b=2, t=16, s=16, n=4, k=2, h=64, q_len=[16, 7], kv_len=[13, 16], causal=True),
        jnp.bfloat16, (2, 2), ("model", "seq"), "seq", None, "model", "zigzag"),
    "mha_causal_contiguous_data_x_seq_grouped_bf16": (
        dict(b=2, t=16, s=16, n=2, k=2, h=64, q_len=[16, 5], kv_len=[11, 16], causal=True),
        jnp.bfloat16, (2, 2), ("data", "seq"), "seq", "data", None, "contiguous"),
    # Sinks: merged after the ring; rows without keys (kv_len 0, bottom-right rows before the first
    # key) get lse = the sink; one head without a sink (-inf); heads sharded too.
    "sinks_gqa_causal_bottom_right_zigzag": (
        dict(b=2, t=16, s=32, n=4, k=2, h=16, q_len=[16, 11], kv_len=[30, 0], causal=True,
             bottom_right=True, sinks=np.array([0.7, -np.inf, 2.5, -1.0])),
        jnp.float32, (4,), ("seq",), "seq", None, None, "zigzag"),
    # A value head dim of its own: K and V travel side by side on the head dim.
    "value_head_dim_sinks_segments_contiguous": (
        dict(b=2, t=32, s=32, n=4, k=2, h=16, hv=24, q_len=[32, 25], kv_len=[32, 30], causal=True,
             softcap=15.0, sinks=np.array([0.2, 1.0, -np.inf, -0.5])),
        jnp.float32, (2, 2), ("data", "seq"), "seq", "data", None, "contiguous"),
    "sinks_heads_x_seq_grouped_bf16": (
        dict(b=2, t=16, s=16, n=4, k=2, h=64, q_len=[16, 7], kv_len=[13, 3], causal=True,
             sinks=np.array([1.5, 0.0, -2.0, 4.0])),
        jnp.bfloat16, (2, 2), ("model", "seq"), "seq", None, "model", "zigzag"),
}


def _ring_problem(name, rng):
  kw, *_ = RING_CASES[name]
  kw = dict(kw)
  if name.startswith("window_softcap_segments") or "_segments_" in name:
    t = kw["t"]
    ids = np.where(np.arange(t) < 13, 0, 1)[None].repeat(kw["b"], 0)
    ids[1, 29:] = -1
    kw.update(q_ids=ids, kv_ids=ids.copy())
  return helpers.random_problem(rng, **kw)


@pytest.mark.parametrize("name", list(RING_CASES))
def test_ring_attention(name):
  _, dtype, shape, names, axis, batch_axis, head_axis, layout = RING_CASES[name]
  rng = np.random.default_rng(len(name))
  p = _ring_problem(name, rng)
  mesh = make_mesh(shape, names, explicit=name.endswith("explicit_mesh"))
  ways = mesh.shape[axis]
  b, t, n, h, s, kh = p.shape
  idx_q = sharding.zigzag_indices(t, ways) if layout == "zigzag" else np.arange(t)
  idx_k = sharding.zigzag_indices(s, ways) if layout == "zigzag" else np.arange(s)
  inv_q, inv_k = np.argsort(idx_q), np.argsort(idx_k)

  kw = helpers.api_kwargs(p, "xla")
  del kw["implementation"]
  if "query_segment_ids" in kw:  # segment ids follow the layout; lengths stay natural
    kw["query_segment_ids"] = kw["query_segment_ids"][:, idx_q]
    kw["key_value_segment_ids"] = kw["key_value_segment_ids"][:, idx_k]
  has_sinks = kw.pop("sinks", None) is not None  # an argument of run: differentiated

  def run(q, k, v, do, dl, *sinks, skip=True):
    def f(q, k, v, *sinks):
      return sharding.ring_attention(
          q, k, v, mesh=mesh, axis_name=axis, batch_axis=batch_axis, head_axis=head_axis,
          layout=layout, return_lse=True, block_k=8, skip_masked_blocks=skip,
          sinks=sinks[0] if sinks else None, **kw)
    (o, lse), vjp = jax.vjp(f, q, k, v, *sinks)
    return (o, lse) + vjp((do, dl))

  x = P(batch_axis, axis, head_axis, None)
  lse_spec = P(batch_axis, head_axis, axis)
  specs = (x, x, x, x, lse_spec) + ((P(head_axis),) if has_sinks else ())
  d_out, d_lse = helpers.cotangents(p, rng)

  def layout_inputs(poison):
    q, k, v, do, dl = poisoned_inputs(p, dtype, poison, rng, d_out, d_lse)
    sinks = [np.asarray(p.sinks, np.float32)] if has_sinks else []
    return [q[:, idx_q], k[:, idx_k], v[:, idx_k], do[:, idx_q], dl[:, :, idx_q]] + sinks

  compiled, hlo = compile_for(run, mesh, layout_inputs("zero"), specs)
  # The sinks' gradient sums over every row: one all-reduce.
  assert collectives(hlo) == (["all-reduce"] if has_sinks else []) + ["collective-permute"], collectives(hlo)

  def results(poison, exe=compiled):
    o, lse, dq, dk, dv, *dsinks = (np.asarray(r) for r in exe(*[place(a, mesh, sp) for a, sp in
                                                                   zip(layout_inputs(poison), specs)]))
    res = dict(out=o[:, inv_q], lse=lse[:, :, inv_q], dq=dq[:, inv_q], dk=dk[:, inv_k],
               dv=dv[:, inv_k])
    if dsinks:
      res["dsinks"] = dsinks[0]
    return res

  base = results("zero")
  names = ["out", "lse", "dq", "dk", "dv"] + (["dsinks"] if has_sinks else [])
  ref, naive = oracle.expected(p, dtype, d_out, d_lse)
  oracle.assert_close(base, ref, naive, dtype, names)
  helpers.assert_contract_zeros(p, base, ref)
  single = helpers.run_padded(p, dtype, helpers.make_runner(p, "xla"), d_out=d_out, d_lse=d_lse)
  assert_matches_single_device(base, single, dtype, names)
  for poison in POISONS:
    got = results(poison)
    for nm in names:
      helpers.assert_bitwise_equal(got[nm], base[nm], f"{nm} with {poison} in the padding")

  if name == "gqa_causal_zigzag":
    # Skipping fully masked chunk pairs changes nothing but rounding (XLA fuses the two programs
    # differently); exact zeros and -inf entries are identical. Forward only, to save compile time.
    def fwd(q, k, v, skip):
      return sharding.ring_attention(q, k, v, mesh=mesh, axis_name=axis, layout=layout,
                                     return_lse=True, block_k=8, skip_masked_blocks=skip, **kw)
    args = [place(a, mesh, sp) for a, sp in zip(layout_inputs("zero")[:3], specs)]
    with_skip = jax.jit(lambda *a: fwd(*a, True))(*args)
    without = jax.jit(lambda *a: fwd(*a, False))(*args)
    assert_matches_single_device(dict(out=without[0], lse=without[1]),
                                 dict(out=with_skip[0], lse=with_skip[1]), dtype, ["out", "lse"])


def test_zigzag_roundtrip_and_balance():
  x = jnp.arange(2 * 16).reshape(2, 16)
  z = sharding.zigzag_permute(x, 4)
  assert np.array_equal(np.asarray(z[0]), [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
  assert np.array_equal(np.asarray(sharding.zigzag_unpermute(z, 4)), np.asarray(x))
  lse = jnp.arange(16.0).reshape(1, 1, 16)
  assert np.array_equal(np.asarray(sharding.zigzag_unpermute(sharding.zigzag_permute(lse, 4, -1), 4, -1)),
                        np.asarray(lse))
  # Causal work per device (visible pairs) is equal in the zigzag layout.
  idx = sharding.zigzag_indices(16, 4).reshape(4, 4)
  work = [int(sum(i + 1 for i in rows)) for rows in idx]
  assert len(set(work)) == 1
  with pytest.raises(ValueError, match="multiple of 2"):
    sharding.zigzag_permute(jnp.zeros((1, 12)), 4)


def test_ring_bad_inputs():
  mesh = make_mesh((4,), ("seq",))
  q = jnp.zeros((1, 16, 4, 8))
  kv = jnp.zeros((1, 16, 2, 8))
  with pytest.raises(ValueError, match="multiple of 8"):
    sharding.ring_attention(q[:, :12], kv, kv, mesh=mesh, axis_name="seq", layout="zigzag")
  with pytest.raises(ValueError, match="not an axis"):
    sharding.ring_attention(q, kv, kv, mesh=mesh, axis_name="sp")
  mesh2 = make_mesh((2, 2), ("model", "seq"))
  with pytest.raises(ValueError, match="whole GQA groups"):
    sharding.ring_attention(q, kv[:, :, :1], kv[:, :, :1], mesh=mesh2, axis_name="seq",
                            head_axis="model")
  with pytest.raises(ValueError, match="layout"):
    sharding.ring_attention(q, kv, kv, mesh=mesh, axis_name="seq", layout="striped")


def _draw_ring_case(seed):
  """A random lengths-only bf16 ring at a kernel head dim (the grouped plan): layout, ring size,
  causal or not, T != S when not causal, GQA/MQA, softcap, empty and full rows."""
  rng = np.random.default_rng(seed)
  causal = bool(rng.integers(2))
  layout = ("contiguous", "zigzag")[rng.integers(2)]
  ways = int(rng.choice([2, 4]))
  unit = ways * (2 if layout == "zigzag" else 1)
  t = unit * 2 * int(rng.integers(2, 6))
  s = t if causal else unit * 2 * int(rng.integers(1, 6))
  b = int(rng.integers(1, 4))
  k = int(rng.choice([1, 2]))
  kw = dict(b=b, t=t, s=s, n=k * int(rng.choice([1, 2, 3])), k=k, h=64, causal=causal,
            q_len=[int(x) for x in rng.integers(0, t + 1, size=b)],
            kv_len=[int(x) for x in rng.integers(0, s + 1, size=b)])
  kw["q_len"][0], kw["kv_len"][0] = t, s
  if rng.integers(3) == 0:
    kw["softcap"] = 20.0
  return kw, jnp.bfloat16, (ways,), ("seq",), "seq", None, None, layout


@pytest.mark.parametrize("seed", [20, 21, 28])  # drawn to cover empty rows, T != S zigzag, GQA causal zigzag
def test_ring_attention_random_grouped(seed, monkeypatch):
  """Random grouped rings through the whole ring check (oracle, zeros, poison, single device)."""
  name = f"random_{seed}_grouped_bf16"
  monkeypatch.setitem(RING_CASES, name, _draw_ring_case(seed))
  test_ring_attention(name)
