"""Masks and biases: jax_padsafe.dot_product_attention against jax.nn.dot_product_attention (cuDNN) with the same
mask or bias, in one process.  bf16, B=4, 16 heads (hd128) or 32 (hd64), T = S.

    PYTHONPATH=. python benchmarks/bench_masks.py [--out results.json] [--dims 64,128] [--seqs 2048,4096,8192]
        [--cases mask,bias]

Cases:
* ``mask``: a causal + key-padding boolean mask ``[B, 1, T, S]`` (the way Flax builds them: make_causal_mask &
  make_attention_mask of the padding; each sequence's length drawn in [S/2, S]).  jax_padsafe also runs the same
  problem as ``is_causal`` + ``key_value_seq_lengths`` (``lengths``): the mask path should cost about that.
* ``bias``: a dense additive bias ``[1, N, T, S]`` bf16; forward+backward differentiates it (dbias).  jax_padsafe
  also runs forward+backward with the bias not differentiated (``nodbias``): the difference is dbias's cost.

Times: forward, and forward+backward (``jax.vjp`` under one jit; the gradients of q, k, v and, for ``bias``, of
the bias).  Ratios are cuDNN time / ours (> 1: ours faster).  Timing: ``bench_forward.bench``.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_padsafe
from bench_forward import bench  # the benchmarks' one timing rule


def _inputs(B, S, N, D, seed=0):
    ks = [jax.random.fold_in(jax.random.PRNGKey(seed), i) for i in range(4)]
    q, k, v, do = (jax.random.normal(kk, (B, S, N, D), jnp.bfloat16) for kk in ks)
    lengths = jnp.asarray(np.random.default_rng(seed).integers(S // 2, S + 1, size=B), jnp.int32)
    causal = jnp.tril(jnp.ones((S, S), bool))
    keys = jnp.arange(S)[None, :] < lengths[:, None]
    mask = causal[None, None] & keys[:, None, None, :]
    bias = (0.5 * jax.random.normal(jax.random.PRNGKey(seed + 1), (1, N, S, S))).astype(jnp.bfloat16)
    return q, k, v, do, lengths, mask, bias


def ours(case, grad, diff_bias=True):
    def attn(q, k, v, extra, lengths):
        if case == "mask":
            return jax_padsafe.dot_product_attention(q, k, v, mask=extra)
        if case == "lengths":
            return jax_padsafe.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
        return jax_padsafe.dot_product_attention(q, k, v, extra)
    return _timed(attn, grad, diff_extra=case == "bias" and diff_bias)


def cudnn(case, grad):
    def attn(q, k, v, extra, lengths):
        if case == "mask":
            return jax.nn.dot_product_attention(q, k, v, mask=extra, implementation="cudnn")
        return jax.nn.dot_product_attention(q, k, v, bias=extra, implementation="cudnn")
    return _timed(attn, grad, diff_extra=case == "bias")


def _timed(attn, grad, diff_extra):
    if not grad:
        return jax.jit(lambda q, k, v, do, extra, lengths: attn(q, k, v, extra, lengths))

    def f(q, k, v, do, extra, lengths):
        if diff_extra:
            o, vjp = jax.vjp(lambda a, b, c, e: attn(a, b, c, e, lengths), q, k, v, extra)
        else:
            o, vjp = jax.vjp(lambda a, b, c: attn(a, b, c, extra, lengths), q, k, v)
        return (o, *vjp(do))
    return jax.jit(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_masks.json"))
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--cases", default="mask,bias")
    a = ap.parse_args()
    dev = jax.devices()[0].device_kind
    rows = []
    for D in (int(x) for x in a.dims.split(",")):
        for S in (int(x) for x in a.seqs.split(",")):
            B, N = 4, 2048 // D
            q, k, v, do, lengths, mask, bias = _inputs(B, S, N, D)
            for case in a.cases.split(","):
                extra = mask if case == "mask" else bias
                row = dict(case=case, head_dim=D, heads=N, seqlen=S, batch=B)
                for name, make in (("ours", lambda g: ours(case, g)), ("cudnn", lambda g: cudnn(case, g)),
                                   ("lengths", lambda g: ours("lengths", g)),
                                   ("nodbias", lambda g: ours(case, g, diff_bias=False))):
                    if (name == "lengths" and case != "mask") or (name == "nodbias" and case != "bias"):
                        continue
                    try:
                        if name != "nodbias":  # its forward is ours
                            row[name + "_fwd_ms"] = round(bench(make(False), q, k, v, do, extra, lengths) * 1e3, 3)
                        row[name + "_fwdbwd_ms"] = round(bench(make(True), q, k, v, do, extra, lengths) * 1e3, 3)
                    except Exception as e:  # noqa: BLE001 - record and continue
                        row[name + "_error"] = repr(e)[:300]
                for part in ("fwd", "fwdbwd"):
                    if row.get(f"ours_{part}_ms") and row.get(f"cudnn_{part}_ms"):
                        row[f"{part}_ratio"] = round(row[f"cudnn_{part}_ms"] / row[f"ours_{part}_ms"], 2)
                    if row.get(f"ours_{part}_ms") and row.get(f"lengths_{part}_ms"):
                        row[f"{part}_vs_lengths"] = round(row[f"ours_{part}_ms"] / row[f"lengths_{part}_ms"], 2)
                rows.append(row)
                print(row, flush=True)
    print(f"\nms on {dev} (bf16, B=4; ratio = cuDNN time / ours; vs lengths = mask time / is_causal+lengths time)")
    print(f"{'case':>5} {'hd':>4} {'S':>6} | {'ours fwd':>9} {'cudnn':>7} {'ratio':>5} | {'ours f+b':>9} {'cudnn':>7} "
          f"{'ratio':>5} | vs lengths fwd, f+b | f+b without dbias")
    for r in rows:
        g = lambda key: r.get(key, float("nan"))  # noqa: E731
        print(f"{r['case']:>5} {r['head_dim']:>4} {r['seqlen']:>6} | {g('ours_fwd_ms'):9.3f} {g('cudnn_fwd_ms'):7.3f} "
              f"{g('fwd_ratio'):5.2f} | {g('ours_fwdbwd_ms'):9.3f} {g('cudnn_fwdbwd_ms'):7.3f} {g('fwdbwd_ratio'):5.2f} | "
              f"{g('fwd_vs_lengths'):.2f}, {g('fwdbwd_vs_lengths'):.2f} | {g('nodbias_fwdbwd_ms'):.3f}")
    with open(a.out, "w") as fh:
        json.dump(dict(device=dev, jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
