"""Model features on the kernels: head dims without a kernel of their own, a value head dim of its own (MLA), and
attention sinks, each against the call it should cost about as much as, in one process with
jax.nn.dot_product_attention (cuDNN) where cuDNN runs the same call.  bf16, 16 query heads (4 key/value heads),
16k tokens per batch, T = S, through ``jax_padsafe.dot_product_attention(implementation="cute")``.

    PYTHONPATH=. python benchmarks/bench_features.py [--out results.json] [--seqs 2048,8192]
        [--cases head_dims,mla,sinks] [--dims 64,72,80,96,104,128]

Cases:
* ``head_dims``: every head dim of ``--dims``, causal and not.  TFLOP/s are counted at the call's own head dim,
  so a head dim that runs zero-padded on a wider kernel shows what the padding costs.
* ``mla``: Q/K head dim 192 with V head dim 128, against (192, 192) on our kernels; TFLOP/s counted per FLOP of
  each call (QK^T at 192, PV at the value head dim).
* ``sinks``: per-head sink logits (differentiated in forward+backward) against the same call without them.
* ``alibi``: ALiBi slopes (``2**(-8 h / N)``, computed in the kernels) against the same call without them.

Times: forward, and forward+backward (``jax.vjp`` under one jit, all inputs differentiated).  FLOPs: forward
``2 N (H + Hv)`` per visible pair, forward+backward 3.5x that.  Timing: ``bench_forward.bench``.
"""

import argparse
import inspect
import json
import os

import jax
import jax.numpy as jnp

import jax_padsafe
from bench_forward import bench  # the benchmarks' one timing rule

TOKENS, HEADS, KV_HEADS = 16384, 16, 4


def _inputs(B, S, h, hv, seed=0):
    ks = [jax.random.fold_in(jax.random.PRNGKey(seed), i) for i in range(5)]
    q = jax.random.normal(ks[0], (B, S, HEADS, h), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, S, KV_HEADS, h), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, KV_HEADS, hv), jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, S, HEADS, hv), jnp.bfloat16)
    sinks = jax.random.normal(ks[4], (HEADS,), jnp.float32)
    return q, k, v, do, sinks


def _alibi_slopes():
    return 2.0 ** (-8.0 * jnp.arange(1, HEADS + 1, dtype=jnp.float32) / HEADS)


def _fn(impl, causal, grad, with_sinks=False, with_alibi=False):
    def attend(q, k, v, sinks):
        if impl == "cudnn":
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        kw = dict(sinks=sinks) if with_sinks else {}
        if with_alibi:
            kw["alibi_slopes"] = _alibi_slopes()
        return jax_padsafe.dot_product_attention(q, k, v, is_causal=causal, implementation="cute", **kw)

    if not grad:
        return jax.jit(lambda q, k, v, do, sinks: attend(q, k, v, sinks))

    def f(q, k, v, do, sinks):
        o, pull = jax.vjp(attend, q, k, v, sinks)
        return o, pull(do)
    return jax.jit(f)


def _flops(B, S, h, hv, causal, grad):
    pairs = B * S * S / (2 if causal else 1)
    return 2 * HEADS * (h + hv) * pairs * (3.5 if grad else 1.0)


def _time(impl, B, S, h, hv, causal, grad, with_sinks=False, with_alibi=False):
    try:
        args = _inputs(B, S, h, hv)
        t = bench(_fn(impl, causal, grad, with_sinks, with_alibi), *args)
    except Exception as e:  # noqa: BLE001 - a call cuDNN does not take is reported, not fatal
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {"ms": t * 1e3, "tflops": _flops(B, S, h, hv, causal, grad) / t / 1e12}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_features.json"))
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--cases", default="head_dims,mla,sinks,alibi")
    ap.add_argument("--dims", default="64,72,80,96,104,128")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    cases = args.cases.split(",")
    params = inspect.signature(jax_padsafe.dot_product_attention).parameters
    has_sinks, has_alibi = "sinks" in params, "alibi_slopes" in params
    rows = []

    def record(case, **row):
        rows.append(dict(case=case, **row))
        print(json.dumps(rows[-1]), flush=True)

    for S in seqs:
        B = TOKENS // S
        for causal in (False, True):
            for grad in (False, True):
                what = dict(S=S, causal=causal, pass_="fwd+bwd" if grad else "fwd")
                if "head_dims" in cases:
                    for h in (int(d) for d in args.dims.split(",")):
                        record("head_dims", h=h, hv=h, **what, ours=_time("cute", B, S, h, h, causal, grad),
                               cudnn=_time("cudnn", B, S, h, h, causal, grad))
                if "mla" in cases:
                    record("mla", h=192, hv=128, **what, ours=_time("cute", B, S, 192, 128, causal, grad),
                           cudnn=_time("cudnn", B, S, 192, 128, causal, grad),
                           ours_192_192=_time("cute", B, S, 192, 192, causal, grad))
                if "sinks" in cases and has_sinks:
                    for h in (64, 128):
                        record("sinks", h=h, hv=h, **what, ours=_time("cute", B, S, h, h, causal, grad, True),
                               without=_time("cute", B, S, h, h, causal, grad),
                               cudnn=_time("cudnn", B, S, h, h, causal, grad))
                if "alibi" in cases and has_alibi:
                    for h in (64, 128):
                        record("alibi", h=h, hv=h, **what,
                               ours=_time("cute", B, S, h, h, causal, grad, with_alibi=True),
                               without=_time("cute", B, S, h, h, causal, grad),
                               cudnn=_time("cudnn", B, S, h, h, causal, grad))
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, tokens=TOKENS, heads=HEADS,
                kv_heads=KV_HEADS, dtype="bfloat16")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
