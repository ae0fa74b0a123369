"""Where the time of a packed (varlen) call goes: device ops per call, by the JAX profiler (GPU only).

    PYTHONPATH=. python benchmarks/experiments/varlen_probe.py [--kinds balanced,one_long] [--calls 10]

For each `bench_varlen.py` document layout, traces `--calls` calls of `varlen_attention` with max_seqlen
tight (the longest document) and left at its default (the packed length), forward and forward+backward,
and prints per call the device span, busy time and the device ops with their time: which kernels ran
(the dense or the compact tile schedule are different kernels of one export: their names differ) and
what else the call costs around them.
"""

import argparse
import glob
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ring_overhead_probe import summarise  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--kinds", default="balanced,one_long")
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", default="1", help="comma list of 1 (causal, the default) / 0 (not)")
  ap.add_argument("--bounds", default="tight,default", help="which max_seqlen bounds to trace")
  a = ap.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_padsafe
  from bench_varlen import TOKENS, doc_lengths

  rng = np.random.default_rng(0)
  n, dim = 2048 // a.head_dim, a.head_dim
  for kind in a.kinds.split(","):
    lens = doc_lengths(kind, rng)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((TOKENS, n, dim)), jnp.bfloat16) for _ in range(3))
    for bound, causal in ((b, int(c)) for b in a.bounds.split(",") for c in a.causal.split(",")):
      mx = dict(max_seqlen_q=max(lens), max_seqlen_k=max(lens)) if bound == "tight" else {}
      f = lambda q, k, v, mx=mx, c=causal: jax_padsafe.varlen_attention(q, k, v, cu, cu, is_causal=bool(c),  # noqa: E731
                                                                          implementation="cute", **mx)
      for label, fn in (("fwd", jax.jit(f)),
                        ("fwd+bwd", jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)),
                                                     (0, 1, 2))))):
        for _ in range(3):
          jax.block_until_ready(fn(q, k, v))
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
          for _ in range(a.calls):
            r = fn(q, k, v)
          jax.block_until_ready(r)
        trace = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)[0]
        s = summarise(trace, a.calls)
        shutil.rmtree(d, ignore_errors=True)
        print(f"\n{kind} ({len(lens)} docs, max {max(lens)}), max_seqlen {bound}, causal {causal}, {label}: span {s['span_us']:.0f} us, "
              f"busy {s['busy_us']:.0f} us, {s['kernels']:.0f} device ops per call")
        for name, count, dur in s["top"][:8]:
          print(f"  {dur:9.1f} us  x{count:4.1f}  {name}")


if __name__ == "__main__":
  main()
