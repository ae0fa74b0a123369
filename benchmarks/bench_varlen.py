"""Packed batches of documents of unequal lengths: what the kernels' tile grid costs.

    PYTHONPATH=. python benchmarks/bench_varlen.py [--out F] [--dims 128] [--quick]

The kernels size their grid from ``max_seqlen_q`` (``max_seqlen_k`` for the backward's key tiles): every
sequence gets ``ceil(max_seqlen / block)`` tiles per head, and the tiles past a short sequence's end
have nothing to do. A packed batch of a few long and many short documents, or a call that leaves
``max_seqlen`` at its default (the packed length, the only bound a jitted step with traced offsets
knows), launches far more tiles than it has. This benchmark times such batches through the public
``varlen_attention`` (kernels), forward and forward+backward, with

* ``max_seqlen`` = the longest document (the tightest bound a caller can give), and
* ``max_seqlen`` left at its default (``total_q``),

and, for scale, ``jax.nn.dot_product_attention(implementation="cudnn")`` on the same documents padded to
the longest one (``query_seq_lengths``), which is what the batch costs without packing.

Further kinds (``--kinds``): ``short`` (documents of 64-512 tokens) and ``part_full`` (log-normal documents
filling three quarters of the buffer, the rest a tail of padding rows).

bf16, 16k tokens, heads = 2048 / head dim. FLOPs count only visible pairs (causal: l (l + 1) / 2 per
document and head), 2.5x for forward+backward's extra work. Timing as in ``bench_forward.py``.
Columns: TFLOP/s; ``tiles`` is the launched query tiles of the forward (ceil(max_seqlen/128) per
document and head, the grid before the compact schedule) against the tiles with rows.
"""

import argparse
import json
import os

import numpy as np

import jax
import jax.numpy as jnp

import jax_padsafe
from bench_forward import bench

TOKENS = 16384


def doc_lengths(kind: str, rng) -> list[int]:
  if kind == "balanced":            # control: every document the same length
    return [2048] * (TOKENS // 2048)
  if kind == "one_long":            # one long document and many short ones
    return [8192] + [128] * ((TOKENS - 8192) // 128)
  if kind in ("long_tail", "part_full"):  # log-normal lengths (median ~400), as in packed pre-training data;
    fill = TOKENS if kind == "long_tail" else TOKENS * 3 // 4  # part_full: a quarter of the buffer is tail
    lens, total = [], 0
    while total < fill:
      ln = int(np.clip(rng.lognormal(np.log(400), 1.2), 16, 8192))
      ln = min(ln, fill - total)
      lens.append(ln)
      total += ln
    return lens
  if kind == "short":               # many short documents (64-512 tokens): little work per output row
    lens, total = [], 0
    while total < TOKENS:
      ln = min(int(rng.integers(64, 513)), TOKENS - total)
      lens.append(ln)
      total += ln
    return lens
  raise ValueError(kind)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_varlen.json"))
  ap.add_argument("--dims", default="128")
  ap.add_argument("--kinds", default="balanced,one_long,long_tail",
                  help="comma-separated among balanced, one_long, long_tail, short, part_full")
  ap.add_argument("--no-cudnn", action="store_true")
  ap.add_argument("--quick", action="store_true", help="causal only, forward only")
  ap.add_argument("--passes", default="fwd,fwd+bwd", help="which of fwd, fwd+bwd to time")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  dt = jnp.bfloat16
  rows = []
  print(f"{'hd':>4} {'kind':>10} {'docs':>5} {'max':>6} {'causal':>6} {'pass':>8} | {'tiles':>15} | "
        f"{'tight':>8} {'default':>8} {'cudnn pad':>9}   TFLOP/s")
  for dim in [int(d) for d in args.dims.split(",")]:
    n = 2048 // dim
    for kind in args.kinds.split(","):
      lens = doc_lengths(kind, rng)
      b, lmax = len(lens), max(lens)
      cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
      q, k, v = (jnp.asarray(rng.standard_normal((TOKENS, n, dim)), dt) for _ in range(3))
      # The same documents padded to the longest, for cuDNN.
      idx = np.full((b, lmax), 0, np.int32)
      for i, ln in enumerate(lens):
        idx[i, :ln] = int(cu[i]) + np.arange(ln)
      lens_j = jnp.asarray(lens, jnp.int32)
      tiles_launched = b * -(-lmax // 128)
      tiles_used = sum(-(-ln // 128) for ln in lens)
      for causal in ([True] if args.quick else [False, True]):
        pairs = sum(ln * (ln + 1) / 2 if causal else ln * ln for ln in lens)
        flops_f = 4 * n * dim * pairs

        def tight(q, k, v, causal=causal):
          return jax_padsafe.varlen_attention(q, k, v, cu, cu, max_seqlen_q=lmax, max_seqlen_k=lmax,
                                              is_causal=causal, implementation="cute")

        def default(q, k, v, causal=causal):
          return jax_padsafe.varlen_attention(q, k, v, cu, cu, is_causal=causal, implementation="cute")

        def cudnn(q, k, v, causal=causal):
          pad = lambda x: x[jnp.asarray(idx)]
          o = jax.nn.dot_product_attention(pad(q), pad(k), pad(v), is_causal=causal,
                                           query_seq_lengths=lens_j, key_value_seq_lengths=lens_j,
                                           implementation="cudnn")
          return o  # padded rows of o are not unpacked: cuDNN is timed on the padded batch alone

        fns = {"tight": tight, "default": default}
        if not args.no_cudnn:
          fns["cudnn pad"] = cudnn
        passes = [("fwd", 1.0)] if args.quick else [(p, m) for p, m in (("fwd", 1.0), ("fwd+bwd", 2.5))
                                                     if p in args.passes.split(",")]
        for label, mult in passes:
          res = {}
          for name, f in fns.items():
            g = jax.jit(f) if label == "fwd" else jax.jit(jax.grad(
                lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)))
            try:
              res[name] = flops_f * mult / bench(g, q, k, v, iters=5) / 1e12
            except Exception as e:  # noqa: BLE001 - record and go on
              print(f"  {name} {label}: {type(e).__name__}: {str(e)[:200]}")
              res[name] = None
          fmt = lambda x: f"{x:8.1f}" if x else "       -"
          print(f"{dim:4d} {kind:>10} {b:5d} {lmax:6d} {str(causal):>6} {label:>8} | "
                f"{tiles_launched * n:7d}/{tiles_used * n:7d} | {fmt(res.get('tight'))} "
                f"{fmt(res.get('default'))} {fmt(res.get('cudnn pad')):>9}", flush=True)
          rows.append(dict(head_dim=dim, kind=kind, docs=b, max_len=lmax, causal=causal, pass_=label,
                           tiles_launched=tiles_launched * n, tiles_used=tiles_used * n, tflops=res))
  out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows)
  with open(args.out, "w") as fh:
    json.dump(out, fh, indent=1)
  print("saved", args.out)


if __name__ == "__main__":
  main()
