"""Multi-GPU check of the kernels under batch/head sharding (run on a machine with >= 2 GPUs).

    PYTHONPATH=. python tests/gpu/check_sharded.py [--json out.json]

A jitted training-style step (vjp of `(out, lse)` with random dO and dlse: gradients of q, k, v) with
`implementation="cute"` runs on a mesh of the GPUs, with the batch, the heads, or both sharded, for
the padded layout with lengths, packed segment ids, and the packed (`varlen_attention`) layout.
Checks, for each case:
  * the compiled HLO calls both kernel custom calls and holds no collective (all-gather,
    all-reduce, all-to-all, collective-permute, reduce-scatter): the partitioning rules keep
    attention shard-local;
  * outputs and gradients are bitwise equal to the same step on one GPU with unsharded inputs;
  * NaN and 1e30 in every padded row leave every result bitwise unchanged.
MQA is checked too: its backward is not split by heads (the heads are gathered for it, the
documented cost), and must still be bitwise equal.

Ring attention on the kernels (sequence sharded over 2 GPUs; `--ring-only` runs just this part,
`--ring-only --ring-gpus 1` a ring of one device on one GPU):
causal contiguous and zigzag layouts, lengths and packed segment ids, non-causal, and bottom-right
alignment (whose off-diagonal pairs are not expressible and run on the pure-JAX blocks): forward
and gradients against the float64 oracle (the contract's accuracy rule), exact zeros, bitwise
poison invariance, and the kernels' custom calls present in the compiled program.
Exit status 0 iff everything passed.
"""

import argparse
import json
import re
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_padsafe
from jax_padsafe import sharding
import tests.gpu  # noqa: F401  (JAX_PADSAFE_POISON_OUTPUTS=1: outputs not memset start as NaN)
from tests import helpers, oracle

_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                         r"(?:-start)?\(")


def collectives(hlo):
  return sorted(set(_COLLECTIVE.findall(hlo)))


def problem(rng, layout, b, t, n, kh, h):
  mk = lambda *s: rng.standard_normal(s).astype(np.float32)
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


def step_fn(layout, kw, lens, b, t):
  def attention(q, k, v):
    if layout == "varlen":
      cu = jnp.arange(b + 1, dtype=jnp.int32) * t
      n, h = q.shape[2], q.shape[3]
      flat = lambda x: x.reshape((b * t,) + x.shape[2:])
      used = jnp.asarray(lens)
      o, lse = jax_padsafe.varlen_attention(
          flat(q), flat(k), flat(v), cu, cu, seqused_q=used, seqused_k=used, max_seqlen_q=t,
          max_seqlen_k=t, is_causal=True, return_lse=True, implementation="cute")
      return o.reshape(b, t, n, h), lse.reshape(n, b, t).transpose(1, 0, 2)
    return jax_padsafe.dot_product_attention(q, k, v, is_causal=True, return_lse=True,
                                             implementation="cute", **kw)

  def step(q, k, v, do, dl):
    (o, lse), vjp = jax.vjp(attention, q, k, v)
    return (o, lse) + tuple(vjp((do.astype(o.dtype), dl)))

  return step


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


def add_random_ring_cases(count, seed, ways):
  """Random lengths-only rings (the grouped plan) at odd chunk sizes: run starts and lengths that
  are no multiple of a tile, T != S without causal, GQA/MQA, softcap, empty and keyless rows."""
  rng = np.random.default_rng(seed)
  names = []
  for i in range(count):
    causal = bool(rng.integers(2))
    layout = ("contiguous", "zigzag")[rng.integers(2)]
    unit = ways * (2 if layout == "zigzag" else 1)
    t = unit * int(rng.integers(20, 200))
    s = t if causal else unit * int(rng.integers(10, 200))
    b = int(rng.integers(1, 4))
    k = int(rng.choice([1, 2, 4]))
    kw = dict(b=b, t=t, s=s, n=k * int(rng.choice([1, 2, 4])), k=k, h=int(rng.choice([64, 128])),
              causal=causal, q_len=[t] + [int(x) for x in rng.integers(0, t + 1, size=b - 1)],
              kv_len=[s] + [int(x) for x in rng.integers(0, s + 1, size=b - 1)])
    if rng.integers(3) == 0:
      kw["softcap"] = 20.0
    name = f"random_{seed}_{i}"
    RING_CASES[name] = (kw, layout, False)
    names.append(name)
  return names


def check_ring(devs, ways=2, cases=tuple(RING_CASES)):
  """Ring attention with kernel chunk pairs on ``ways`` GPUs; returns (rows, all passed)."""
  mesh = jax.make_mesh((ways,), ("seq",), devices=devs[:ways],
                       axis_types=(jax.sharding.AxisType.Auto,))
  rows, ok = [], True
  dtype = jnp.bfloat16
  for name in cases:
    kw, layout, with_ids = RING_CASES[name]
    rng = np.random.default_rng(len(name))
    p = helpers.random_problem(rng, **kw)
    if with_ids:  # two packed documents per row
      ids = np.where(np.arange(p.q.shape[1]) < 100, 0, 1)[None].repeat(p.q.shape[0], 0)
      p.q_ids, p.kv_ids = ids, ids.copy()
    b, t = p.q.shape[:2]
    s = p.k.shape[1]
    idx_q = sharding.zigzag_indices(t, ways) if layout == "zigzag" else np.arange(t)
    idx_k = sharding.zigzag_indices(s, ways) if layout == "zigzag" else np.arange(s)
    inv_q, inv_k = np.argsort(idx_q), np.argsort(idx_k)
    api = helpers.api_kwargs(p, None)
    if "query_segment_ids" in api:
      api["query_segment_ids"] = api["query_segment_ids"][:, idx_q]
      api["key_value_segment_ids"] = api["key_value_segment_ids"][:, idx_k]

    def run(q, k, v, do, dl):
      f = lambda q, k, v: sharding.ring_attention(q, k, v, mesh=mesh, axis_name="seq",
                                                  layout=layout, return_lse=True, **api)
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
      return [jax.device_put(jnp.asarray(a, dtype if i < 4 else jnp.float32),
                             NamedSharding(mesh, sp)) for i, (a, sp) in enumerate(zip(xs, specs))]

    compiled = jax.jit(run).lower(*inputs("zero")).compile()
    hlo = compiled.as_text()
    calls = sorted(set(re.findall(r'custom_call_target="(jax_padsafe_\w+)"', hlo)))
    # Lengths-only rings in top-left alignment take the grouped plan: no conditional at all (each
    # one would copy its predicate to the host and wait).
    grouped = not with_ids and not kw.get("bottom_right", False)
    conditionals = len(re.findall(r"\bconditional\(", hlo))

    def results(poison):
      o, lse, dq, dk, dv = (np.asarray(r) for r in compiled(*inputs(poison)))
      return dict(out=o[:, inv_q], lse=lse[:, :, inv_q], dq=dq[:, inv_q], dk=dk[:, inv_k],
                  dv=dv[:, inv_k])

    names = ["out", "lse", "dq", "dk", "dv"]
    row = dict(case=name, ring_gpus=ways, calls=calls, collectives=collectives(hlo),
               grouped=grouped, conditionals=conditionals)
    try:
      base = results("zero")
      ref = oracle.reference(p, d_out, d_lse)
      helpers.assert_close_to_oracle(base, ref, helpers.naive_lowp(p, dtype, d_out, d_lse), dtype,
                                     names)
      helpers.assert_contract_zeros(p, base, ref)
      for poison in ("nan", "inf", "1e30", "huge"):
        got = results(poison)
        for nm in names:
          helpers.assert_bitwise_equal(got[nm], base[nm], f"{nm} with {poison} in the padding")
      passed = "jax_padsafe_fwd" in calls and "jax_padsafe_bwd" in calls
      row["error"] = None if passed else "kernels not called"
      if passed and grouped and conditionals:
        passed, row["error"] = False, f"{conditionals} conditionals in a grouped ring"
    except AssertionError as e:
      passed, row["error"] = False, str(e)[:400]
    row["passed"] = passed
    ok &= passed
    rows.append(row)
    print(("ok  " if passed else "FAIL"), row, flush=True)
  return rows, ok


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json")
  ap.add_argument("--ring-only", action="store_true")
  ap.add_argument("--ring-gpus", type=int, default=2, help="ring size (sequence shards)")
  ap.add_argument("--ring-cases", default=",".join(RING_CASES), help="comma-separated RING_CASES names")
  ap.add_argument("--mesh-gpus", type=int, default=None,
                  help="GPUs of the batch/head meshes: 2 or 4 (default: min(4, GPUs)) or 8")
  ap.add_argument("--skip-ring", action="store_true")
  ap.add_argument("--random-rings", type=int, default=0,
                  help="also check this many random lengths-only rings (odd chunk sizes)")
  ap.add_argument("--seed", type=int, default=0, help="seed of --random-rings")
  args = ap.parse_args()
  devs = jax.devices()
  need = args.ring_gpus if args.ring_only else max(2, args.ring_gpus)  # a ring of 1 runs on 1 GPU
  if len(devs) < need:
    print(f"needs >= {need} GPUs")
    sys.exit(2)
  cases = [c for c in args.ring_cases.split(",") if c]
  cases += add_random_ring_cases(args.random_rings, args.seed, args.ring_gpus)
  ring_rows, ok = ([], True) if args.skip_ring else check_ring(devs, args.ring_gpus, cases)
  if args.ring_only:
    if args.json:
      with open(args.json, "w") as fh:
        json.dump(dict(device=devs[0].device_kind, n_devices=len(devs), ring=ring_rows), fh, indent=1)
    print("ALL OK" if ok else "FAILURES")
    sys.exit(0 if ok else 1)
  rng = np.random.default_rng(0)
  results = []
  g = args.mesh_gpus or min(4, len(devs))
  if g not in (2, 4, 8) or g > len(devs):
    sys.exit(f"--mesh-gpus {g}: needs 2, 4 or 8 and at most {len(devs)}")
  b, t, h = max(4, g), 384, 128
  # mesh name -> (mesh shape over ("d", "m"), sharding of [B, T, heads, H])
  meshes = {"batch": ((g, 1), P("d", None, None, None)),
            "heads": ((1, g), P(None, None, "m", None))}
  if g >= 4:
    meshes["batch_heads"] = ((2, g // 2), P("d", None, "m", None))
  # GQA with as many kv heads as head shards (so kv heads split too), and MQA (heads gathered).
  head_configs = ((16, max(4, g)), (8, 1))
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  for layout in ("lengths", "segments", "varlen"):
    for n, kh in head_configs:
      (q, k, v, do, dl), valid, kw, lens = problem(rng, layout, b, t, n, kh, h)
      step = step_fn(layout, kw, lens, b, t)
      single = jax.jit(step)(bf(q), bf(k), bf(v), bf(do), jnp.asarray(dl))
      for mname, (shape, qspec) in meshes.items():
        if layout == "varlen" and shape[0] > 1:
          continue  # the packed layout has no batch axis to shard
        # Auto axes (jax.make_mesh defaults to Explicit from jax 0.10): the jit decides layouts.
        mesh = jax.make_mesh(shape, ("d", "m"), devices=devs[:shape[0] * shape[1]],
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        kvspec = qspec if kh % shape[1] == 0 else P(qspec[0], None, None, None)
        dlspec = P(qspec[0], qspec[2], None)
        specs = (qspec, kvspec, kvspec, qspec, dlspec)

        def placed(poison):
          pq, pdo = (np.where(valid[:, :, None, None], x, poison) for x in (q, do))
          pk, pv = (np.where(valid[:, :, None, None], x, poison) for x in (k, v))
          pdl = np.where(valid[:, None, :], dl, poison)
          xs = (bf(pq), bf(pk), bf(pv), bf(pdo), jnp.asarray(pdl, jnp.float32))
          return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, specs)]

        compiled = jax.jit(step).lower(*placed(0.0)).compile()
        hlo = compiled.as_text()
        coll = collectives(hlo)
        calls = sorted(set(re.findall(r'custom_call_target="(jax_padsafe_\w+)"', hlo)))
        base = compiled(*placed(0.0))
        same = all(np.array_equal(np.asarray(a), np.asarray(s)) for a, s in zip(base, single))
        poison_ok = True
        for poison in (np.nan, 1e30):
          got = compiled(*placed(poison))
          poison_ok &= all(np.array_equal(np.asarray(a), np.asarray(s)) for a, s in zip(got, base))
        gathered_ok = kh == 1 and shape[1] > 1  # MQA backward: heads gathered (documented)
        passed = bool(same and poison_ok and calls == ["jax_padsafe_bwd", "jax_padsafe_fwd"]
                      and (coll == [] or gathered_ok))
        ok &= passed
        row = dict(layout=layout, heads=f"{n}/{kh}", mesh=mname, collectives=coll, calls=calls,
                   equal_to_single_gpu=bool(same), poison_invariant=bool(poison_ok), passed=passed)
        results.append(row)
        print(("ok  " if passed else "FAIL"), row, flush=True)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(device=devs[0].device_kind, n_devices=len(devs), results=results,
                     ring=ring_rows), fh, indent=1)
  print("ALL OK" if ok else "FAILURES")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
