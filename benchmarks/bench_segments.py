"""Packed sequences in the padded layout: segment ids on the kernels vs the same documents given to
`varlen_attention` (the floor: the kernels' native layout) and the pure-JAX path, in one run.

    PYTHONPATH=. python benchmarks/bench_segments.py [--out results.json]

bf16, head dim 128, 16 heads, rows of T tokens each holding `docs` documents of random lengths
(contiguous runs, the row's tail padded with id -1). Causal. Times forward and forward+backward
(sum of the output, grads of q, k, v). Segment ids are timed two ways: concrete (closed over, mapped
while tracing) and traced (arguments of the jitted step: both paths compiled, a run-time predicate
picks the kernels). FLOPs count only the visible pairs: 4 * N * H * sum(len * (len + 1) / 2), times
2.5 for forward+backward. Timing as in bench_forward.py.
"""

import argparse
import json
import os

import numpy as np

import jax
import jax.numpy as jnp

import jax_padsafe
from bench_forward import bench


def layout(rng, b, t, docs):
  ids = np.full((b, t), -1, np.int32)
  lens = []
  for r in range(b):
    used = int(t * rng.uniform(0.85, 1.0))
    cuts = np.sort(rng.choice(np.arange(64, used - 64), size=docs - 1, replace=False))
    bounds = [0, *cuts, used]
    for d in range(docs):
      ids[r, bounds[d]:bounds[d + 1]] = d
      lens.append(bounds[d + 1] - bounds[d])
  return ids, lens


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_segments.json"))
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  n, h = 16, 128
  rows = []
  print(f"{'T':>6} {'B':>3} {'docs':>4} | {'pass':>8} | {'seg concrete':>12} {'seg traced':>10} "
        f"{'varlen':>8} {'xla':>8}   TFLOP/s")
  for t, b, docs in [(4096, 4, 4), (8192, 2, 8), (4096, 4, 16)]:
    ids, lens = layout(rng, b, t, docs)
    flops_f = 4 * n * h * sum(l * (l + 1) / 2 for l in lens)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = mk(b, t, n, h), mk(b, t, n, h), mk(b, t, n, h)
    jids = jnp.asarray(ids)
    # The same documents packed: sequence per document, rows in order.
    flat = ids.reshape(-1)
    starts = [i for i in range(flat.size) if flat[i] >= 0 and (i == 0 or flat[i - 1] != flat[i])]
    cu = jnp.asarray(starts + [flat.size], jnp.int32)
    used = jnp.asarray(lens, jnp.int32)

    def seg(q, k, v, qi=jids, ki=jids, impl=None):
      return jax_padsafe.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=qi,
                                               key_value_segment_ids=ki, implementation=impl)

    def var(q, k, v):
      o = jax_padsafe.varlen_attention(q.reshape(b * t, n, h), k.reshape(b * t, n, h),
                                       v.reshape(b * t, n, h), cu, cu, seqused_q=used,
                                       seqused_k=used, max_seqlen_q=t, max_seqlen_k=t,
                                       is_causal=True)
      return o.reshape(b, t, n, h)

    fns = {
        "seg concrete": (lambda q, k, v, i: seg(q, k, v, impl="cute")),
        "seg traced": (lambda q, k, v, i: seg(q, k, v, i, i)),
        "varlen": (lambda q, k, v, i: var(q, k, v)),
        "xla": (lambda q, k, v, i: seg(q, k, v, impl="xla")),
    }
    for label, mult, wrap in [
        ("fwd", 1.0, lambda f: jax.jit(f)),
        ("fwd+bwd", 2.5, lambda f: jax.jit(jax.grad(
            lambda q, k, v, i: jnp.sum(f(q, k, v, i).astype(jnp.float32)), (0, 1, 2))))]:
      res = {}
      for name, f in fns.items():
        if name == "xla" and t > 4096:
          res[name] = None
          continue
        try:
          sec = bench(wrap(f), q, k, v, jids, iters=5)
          res[name] = flops_f * mult / sec / 1e12
        except Exception as e:  # noqa: BLE001 - record and go on
          print(f"  {name} {label}: {type(e).__name__}: {str(e)[:200]}")
          res[name] = None
      fmt = lambda x: f"{x:8.1f}" if x else "       -"
      print(f"{t:6d} {b:3d} {docs:4d} | {label:>8} | {fmt(res['seg concrete']):>12} "
            f"{fmt(res['seg traced']):>10} {fmt(res['varlen'])} {fmt(res['xla'])}")
      rows.append(dict(T=t, B=b, docs=docs, pass_=label, tflops=res))
  out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows)
  with open(args.out, "w") as fh:
    json.dump(out, fh, indent=1)
  print("saved", args.out)


if __name__ == "__main__":
  main()
