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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json")
  args = ap.parse_args()
  devs = jax.devices()
  if len(devs) < 2:
    print("needs >= 2 GPUs")
    sys.exit(2)
  rng = np.random.default_rng(0)
  results, ok = [], True
  b, t, h = 4, 384, 128
  # mesh name -> (mesh shape over ("d", "m"), sharding of [B, T, heads, H])
  meshes = {"batch": ((2, 1), P("d", None, None, None)),
            "heads": ((1, 2), P(None, None, "m", None))}
  if len(devs) >= 4:
    meshes["batch_heads"] = ((2, 2), P("d", None, "m", None))
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  for layout in ("lengths", "segments", "varlen"):
    for n, kh in ((16, 4), (8, 1)):
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
      json.dump(dict(device=devs[0].device_kind, n_devices=len(devs), results=results), fh, indent=1)
  print("ALL OK" if ok else "FAILURES")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
