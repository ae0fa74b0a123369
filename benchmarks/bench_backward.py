"""Forward+backward TFLOP/s of the CuTe kernels (flash_forward + flash_backward of the cute backend) vs
jax.nn.dot_product_attention (implementation="cudnn" and "xla") in one run.  bf16, 16k tokens per batch.

    PYTHONPATH=. python benchmarks/bench_backward.py [--out results.json] [--dims 128] [--seqs 2048,4096,8192]
        [--softcap 50]  (cute only: jax.nn has no softcap)  [--xla-deterministic]

cuDNN's flash-attention backward is not deterministic by default (it accumulates dQ with atomics); ours always is
(a fixed reduction order, so that results are bitwise reproducible and poison-invariant).  `--xla-deterministic`
runs the whole benchmark with XLA_FLAGS --xla_gpu_exclude_nondeterministic_ops=true, which makes XLA ask cuDNN for
its deterministic backward: the like-for-like comparison.  The flag is read when the GPU backend starts, so it
needs a process of its own (the JSON records it).

Each timed call computes o = attention(q, k, v) and (dq, dk, dv) = vjp(do) under one jit.  FLOPs counted
the usual way: forward 4 * N * H * (visible pairs), forward+backward 3.5x that (backward = 2.5x
forward).  Timing: 2 warm-up calls, median of 5 rounds of `iters` back-to-back calls.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp

from jax_padsafe._backends.cute import backward as bwd_ops
from jax_padsafe._backends.cute import forward as ops
from bench_forward import bench  # the benchmarks' one timing rule


def cute_fwd_bwd(B, S, causal, scale, deterministic=False, softcap=0.0):
    def f(q, k, v, do):
        _, _, N, H = q.shape
        KH = k.shape[2]
        cu = jnp.arange(B + 1, dtype=jnp.int32) * S
        used = jnp.full((B,), S, jnp.int32)
        # rows_covered: the dense [B, S] layout, as dot_product_attention's lengths path passes it.
        kw = dict(max_seqlen_q=S, max_seqlen_k=S, scale=scale, causal=causal, bottom_right=False, window_left=-1,
                  window_right=-1, softcap=softcap, rows_covered=True)
        qp, kp, vp = q.reshape(B * S, N, H), k.reshape(B * S, KH, H), v.reshape(B * S, KH, H)
        o, lse = ops.flash_forward(qp, kp, vp, cu, cu, used, used, **kw)
        dq, dk, dv = bwd_ops.flash_backward(qp, kp, vp, o, lse, do.reshape(B * S, N, H), jnp.zeros_like(lse),
                                            cu, cu, used, used, deterministic=deterministic, **kw)
        return o, dq, dk, dv
    return jax.jit(f)


def cute_fwd_only(B, S, causal, scale, softcap=0.0):
    def f(q, k, v, do):
        _, _, N, H = q.shape
        cu = jnp.arange(B + 1, dtype=jnp.int32) * S
        used = jnp.full((B,), S, jnp.int32)
        o, _ = ops.flash_forward(q.reshape(B * S, N, H), k.reshape(B * S, N, H), v.reshape(B * S, N, H), cu, cu,
                                 used, used, max_seqlen_q=S, max_seqlen_k=S, scale=scale, causal=causal,
                                 bottom_right=False, window_left=-1, window_right=-1, softcap=softcap,
                                 rows_covered=True)
        return o
    return jax.jit(f)


def jnn_fwd_bwd(impl, causal):
    def f(q, k, v, do):
        o, vjp = jax.vjp(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal, implementation=impl),
                         q, k, v)
        return (o, *vjp(do))
    return jax.jit(f)


def jnn_fwd_only(impl, causal):
    return jax.jit(lambda q, k, v, do: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_backward.json"))
    ap.add_argument("--impls", default="cute,cudnn,xla")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="logit softcap of the cute kernels; jax.nn has none, so only cute runs with one")
    ap.add_argument("--xla-deterministic", action="store_true",
                    help="XLA_FLAGS --xla_gpu_exclude_nondeterministic_ops=true (cuDNN's deterministic backward)")
    a = ap.parse_args()
    if a.xla_deterministic:  # before the backend starts (the first jax.devices()), which is when XLA reads it
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_exclude_nondeterministic_ops=true")
    if a.softcap:
        a.impls = "cute"
    dev = jax.devices()[0].device_kind
    rows = []
    for D in (int(x) for x in a.dims.split(",")):
        for S in (int(x) for x in a.seqs.split(",")):
            for causal in (False, True):
                N = 2048 // D
                B = max(1, 16384 // S)
                ks = [jax.random.fold_in(jax.random.PRNGKey(0), i) for i in range(4)]
                q, k, v, do = (jax.random.normal(kk, (B, S, N, D), jnp.bfloat16) for kk in ks)
                pairs = B * (S * (S + 1) // 2 if causal else S * S)
                fl = 4 * N * D * pairs
                row = dict(head_dim=D, heads=N, seqlen=S, batch=B, causal=causal, softcap=a.softcap,
                           xla_deterministic=a.xla_deterministic)
                for impl in a.impls.split(","):
                    if impl == "xla" and S > 8192:
                        continue
                    try:
                        if impl == "cute":
                            tf = bench(cute_fwd_only(B, S, causal, D ** -0.5, a.softcap), q, k, v, do)
                            tb = bench(cute_fwd_bwd(B, S, causal, D ** -0.5, softcap=a.softcap), q, k, v, do)
                        else:
                            tf = bench(jnn_fwd_only(impl, causal), q, k, v, do)
                            tb = bench(jnn_fwd_bwd(impl, causal), q, k, v, do)
                        row[impl + "_fwd"] = round(fl / tf / 1e12, 1)
                        row[impl + "_fwdbwd"] = round(3.5 * fl / tb / 1e12, 1)
                        row[impl + "_ms"] = round(tb * 1e3, 3)
                    except Exception as e:  # noqa: BLE001 - record and continue
                        row[impl + "_error"] = repr(e)[:300]
                rows.append(row)
                print(row, flush=True)
    cap = (f", softcap {a.softcap:g}" if a.softcap else "") + (
        ", XLA deterministic ops: cuDNN's deterministic backward" if a.xla_deterministic else "")
    print(f"\nforward / forward+backward TFLOP/s on {dev} (bf16{cap}; fwd+bwd counted as 3.5x forward FLOPs)")
    print(f"{'hd':>4} {'S':>6} {'causal':>6} | {'cute':>13} {'cudnn':>13} {'xla':>13} | fwd+bwd cute/cudnn")
    for r in rows:
        f = lambda i: (f"{r[i + '_fwd']:5.0f}/{r[i + '_fwdbwd']:5.0f}  " if r.get(i + "_fwdbwd") else "          n/a")
        ratio = r["cute_fwdbwd"] / r["cudnn_fwdbwd"] if r.get("cute_fwdbwd") and r.get("cudnn_fwdbwd") else float("nan")
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} | {f('cute')} {f('cudnn')} {f('xla')} | {ratio:.2f}")
    with open(a.out, "w") as fh:
        json.dump(dict(device=dev, jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows), fh,
                  indent=1)


if __name__ == "__main__":
    main()
