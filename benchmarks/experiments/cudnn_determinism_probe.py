"""Is the cuDNN backward that jax.nn.dot_product_attention runs deterministic?  (and ours, for contrast)

    PYTHONPATH=. python benchmarks/experiments/cudnn_determinism_probe.py [--repeats 8]
    XLA_FLAGS=--xla_gpu_exclude_nondeterministic_ops=true PYTHONPATH=. python benchmarks/...  (the deterministic one)

Runs the same forward+backward (bf16, hd128, 16 heads, 8 x 2048 tokens, non-causal) `--repeats` times on the same
inputs and counts the distinct bit patterns of dq / dk / dv.  One pattern each means reproducible in this run; more
than one proves the backward is not deterministic.  Context for benchmarks/bench_backward.py --xla-deterministic:
our backward adds dQ partials in a fixed order, so the fair comparison is with cuDNN's deterministic backward.
"""

import argparse
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_padsafe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--impls", default="cudnn,cute")
    a = ap.parse_args()
    B, S, N, H = 8, 2048, 16, 128
    ks = [jax.random.fold_in(jax.random.PRNGKey(1), i) for i in range(4)]
    q, k, v, do = (jax.random.normal(kk, (B, S, N, H), jnp.bfloat16) for kk in ks)
    print(f"{jax.devices()[0].device_kind}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for impl in a.impls.split(","):
        if impl == "cute":
            attn = lambda x, y, z: jax_padsafe.dot_product_attention(x, y, z, implementation="cute")  # noqa: E731
        else:
            attn = lambda x, y, z: jax.nn.dot_product_attention(x, y, z, implementation=impl)  # noqa: E731

        @jax.jit
        def grads(q, k, v, do):
            _, vjp = jax.vjp(attn, q, k, v)
            return vjp(do)

        seen = [set(), set(), set()]
        for _ in range(a.repeats):
            for s, g in zip(seen, grads(q, k, v, do)):
                s.add(hashlib.md5(np.asarray(g).view(np.uint16).tobytes()).hexdigest())
        print(f"{impl:6s}: distinct bit patterns over {a.repeats} runs: dq {len(seen[0])}, dk {len(seen[1])}, "
              f"dv {len(seen[2])}", flush=True)


if __name__ == "__main__":
    main()
