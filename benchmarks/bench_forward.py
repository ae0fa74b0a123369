"""Forward TFLOP/s of the CuTe kernel (jax_padsafe._backends.cute.forward.flash_forward) vs jax.nn.dot_product_attention
(implementation="cudnn" and "xla") in one run.  bf16; head dims 64/128/256 (heads = 2048/dim);
seqlens 512..16k at 16k tokens per batch; causal and not; plus a padded batch (lengths uniform in
[0.4 S, S], seed 0: 39.7% padding).

    PYTHONPATH=. python benchmarks/bench_forward.py [--out results.json] [--quick]

FLOPs counted: 4 * N * H * (visible q-k pairs): S^2 (non-causal) or S^2/2 (causal) per sequence and head;
for the padded batch only the valid pairs (sum of q_len * k_len), so padding earns nothing.
Timing: jit, 2 warm-up calls, then the median of 5 rounds of `iters` back-to-back calls (wall clock
around block_until_ready).
"""

import argparse
import json
import os
import time

import numpy as np

import jax
import jax.numpy as jnp

from jax_padsafe._backends.cute import forward as ops


def bench(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            r = fn(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def cute_fn(B, S, causal, scale):
    def f(q, k, v, lq, lk):
        N, H = q.shape[2], q.shape[3]
        cu = jnp.arange(B + 1, dtype=jnp.int32) * S
        o, _ = ops.flash_forward(q.reshape(B * S, N, H), k.reshape(B * S, k.shape[2], H), v.reshape(B * S, v.shape[2], H),
                                 cu, cu, lq, lk, max_seqlen_q=S, max_seqlen_k=S, scale=scale, causal=causal,
                                 bottom_right=False, window_left=-1, window_right=-1, softcap=0.0,
                                 rows_covered=True)  # the dense [B, S] layout, as the API's lengths path
        return o.reshape(B, S, N, H)
    return jax.jit(f)


def jnn_fn(impl, causal, padded):
    if padded:
        return jax.jit(lambda q, k, v, lq, lk: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl, query_seq_lengths=lq, key_value_seq_lengths=lk))
    return jax.jit(lambda q, k, v, lq, lk: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_forward.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--impls", default="cute,cudnn,xla")
    ap.add_argument("--dims", default="")
    ap.add_argument("--seqs", default="")
    ap.add_argument("--no-padded", action="store_true")
    a = ap.parse_args()
    dev = jax.devices()[0].device_kind
    rows = []
    dims = (128,) if a.quick else (64, 128, 256)
    seqs = (2048, 8192) if a.quick else (512, 2048, 8192, 16384)
    if a.dims:
        dims = tuple(int(x) for x in a.dims.split(","))
    if a.seqs:
        seqs = tuple(int(x) for x in a.seqs.split(","))
    impls = tuple(a.impls.split(","))
    cases = [(D, S, c, False) for D in dims for S in seqs for c in (False, True)]
    if not a.no_padded:
        cases += [(D, 2048, c, True) for D in dims for c in (False, True)]
    for D, S, causal, padded in cases:
        N = 2048 // D
        B = max(1, 16384 // S)
        if padded:
            B = 8
        ks = [jax.random.fold_in(jax.random.PRNGKey(0), i) for i in range(3)]
        q, k, v = (jax.random.normal(kk, (B, S, N, D), jnp.bfloat16) for kk in ks)
        if padded:  # ~30% padding: lengths uniform in [0.4 S, S]
            lens = np.random.default_rng(0).integers(int(0.4 * S), S + 1, B).astype(np.int32)
        else:
            lens = np.full(B, S, np.int32)
        lq = lk = jnp.asarray(lens)
        pairs = sum(int(l) * (int(l) + 1) // 2 if causal else int(l) * int(l) for l in lens)
        flops = 4 * N * D * pairs
        row = dict(head_dim=D, heads=N, seqlen=S, batch=B, causal=causal, padded=padded,
                   padding_frac=round(1 - lens.sum() / (B * S), 3))
        for impl in impls:
            if impl == "xla" and S > 8192:
                row[impl] = None
                continue
            try:
                fn = cute_fn(B, S, causal, D ** -0.5) if impl == "cute" else jnn_fn(impl, causal, padded)
                t = bench(fn, q, k, v, lq, lk)
                row[impl] = round(flops / t / 1e12, 1)
            except Exception as e:  # noqa: BLE001 - record and continue
                row[impl] = None
                row[impl + "_error"] = repr(e)[:300]
        rows.append(row)
        print(row, flush=True)
    print(f"\nforward TFLOP/s on {dev} (bf16; padded rows: effective FLOPs of valid pairs only)")
    print(f"{'hd':>4} {'heads':>5} {'S':>6} {'B':>3} {'causal':>6} {'pad':>5} | {'cute':>7} {'cudnn':>7} {'xla':>7} | cute/cudnn")
    for r in rows:
        ratio = (r["cute"] / r["cudnn"]) if r.get("cute") and r.get("cudnn") else float("nan")
        f = lambda x: f"{x:7.1f}" if x else "    n/a"
        print(f"{r['head_dim']:>4} {r['heads']:>5} {r['seqlen']:>6} {r['batch']:>3} {str(r['causal']):>6} "
              f"{r['padding_frac']:>5} | {f(r.get('cute'))} {f(r.get('cudnn'))} {f(r.get('xla'))} | {ratio:.2f}")
    with open(a.out, "w") as fh:
        json.dump(dict(device=dev, jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
