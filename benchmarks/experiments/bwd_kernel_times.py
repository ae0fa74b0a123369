"""Per-kernel time of the CuTe backward (GPU, timing experiment): the backward op alone, timed with kernels left
out by a library built with `bwd_kernel_timing.patch` (env JPS_TIMING_SKIP: 1 preprocess, 2 dK/dV, 4 dQ;
the results are wrong, only the times count), and the cuDNN backward (vjp of jax.nn.dot_product_attention minus
its forward) in the same process.

    git apply benchmarks/experiments/bwd_kernel_timing.patch && <build the library> && git checkout ffi/jps_bwd.cc
    JAX_PADSAFE_CUTE_LIB=exp/skip/libjax_padsafe_kernels.so PYTHONPATH=. python benchmarks/experiments/bwd_kernel_times.py

Backward FLOPs are counted as 2.5x the forward's (4 N H x visible pairs, the 5 GEMMs of a backward); the
per-kernel TFLOP/s are *executed* ones: the dK/dV kernel runs 4 GEMMs (S^T, dP^T, dV, dK: 2x the forward's
FLOPs), the dQ kernel 3 (S, dP, dQ: 1.5x).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_forward import bench  # noqa: E402

from jax_padsafe._cute import bwd_ops, ops  # noqa: E402


def main():
    dims = [int(x) for x in os.environ.get("DIMS", "128").split(",")]
    seqs = [int(x) for x in os.environ.get("SEQS", "2048,8192").split(",")]
    print(jax.devices()[0].device_kind)
    print(f"{'hd':>4} {'S':>6} {'causal':>6} | {'all ms':>7} {'pre':>6} {'dkdv':>6} {'dq':>6} | {'dkdv TF':>7} "
          f"{'dq TF':>6} {'bwd TF':>6} | {'cudnn bwd ms':>12} {'TF':>5}")
    for H in dims:
        N = 2048 // H
        for S in seqs:
            B = 16384 // S
            for causal in (False, True):
                rng = np.random.default_rng(0)
                q, k, v, do = (jnp.asarray(rng.standard_normal((B * S, N, H)), jnp.bfloat16) for _ in range(4))
                cu = jnp.arange(B + 1, dtype=jnp.int32) * S
                used = jnp.full((B,), S, jnp.int32)
                kw = dict(max_seqlen_q=S, max_seqlen_k=S, scale=H ** -0.5, causal=causal, bottom_right=False,
                          window_left=-1, window_right=-1, softcap=0.0, rows_covered=True)
                o, lse = ops.flash_forward(q, k, v, cu, cu, used, used, **kw)
                f = jax.jit(lambda q, k, v, o, lse, do: bwd_ops.flash_backward(
                    q, k, v, o, lse, do, jnp.zeros_like(lse), cu, cu, used, used, **kw))
                t = {}
                for skip in (0, 1, 2, 4, 7):
                    os.environ["JPS_TIMING_SKIP"] = str(skip)
                    t[skip] = bench(f, q, k, v, o, lse, do) * 1e3
                os.environ["JPS_TIMING_SKIP"] = "0"
                pairs = S * (S + 1) / 2 if causal else S * S
                fwd_flop = 4 * N * H * pairs * B
                t_pre, t_dkdv, t_dq = t[0] - t[1], t[0] - t[2], t[0] - t[4]
                qb, kb, vb, dob = (x.reshape(B, S, N, H) for x in (q, k, v, do))
                fj = jax.jit(lambda a, b, c, d: jax.vjp(lambda x, y, z: jax.nn.dot_product_attention(
                    x, y, z, is_causal=causal, implementation="cudnn"), a, b, c)[1](d))
                ff = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal,
                                                                         implementation="cudnn"))
                t_cu = (bench(fj, qb, kb, vb, dob) - bench(ff, qb, kb, vb)) * 1e3
                print(f"{H:4d} {S:6d} {str(causal):>6} | {t[0]:7.3f} {t_pre:6.3f} {t_dkdv:6.3f} {t_dq:6.3f} | "
                      f"{2.0 * fwd_flop / t_dkdv / 1e9:7.0f} {1.5 * fwd_flop / t_dq / 1e9:6.0f} "
                      f"{2.5 * fwd_flop / t[0] / 1e9:6.0f} | {t_cu:12.3f} {2.5 * fwd_flop / t_cu / 1e9:5.0f}"
                      f"   (launch-only {t[7]:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
