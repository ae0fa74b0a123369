"""Decode-shaped attention (a few query rows against a long, padded KV cache): time per call and the
bandwidth of the valid K/V bytes, for jax_padsafe (implementation="cute" on the padded layout, "cute_varlen"
the same cache through the packed layout, and the pure-JAX "xla" path) and jax.nn.dot_product_attention
(cudnn, xla), in one run.

    PYTHONPATH=. python benchmarks/bench_decode.py [--out results.json] [--quick] [--split-tiles 132,264]

bf16, head dim 128, 32 query heads over 8 KV heads (GQA 4; one MHA case).  Each sequence's cache holds a random valid
length in [S/2, S]; every query row sees every valid key (non-causal with lengths, which for the last
query rows of a sequence is what bottom-right causal masking gives).  Bandwidth counts only the valid
K and V bytes (2 x sum(lengths) x KV heads x 128 x 2 B): a kernel that streams the cache at the HBM
rate reaches ~3 TB/s on an H100.
Timing: jit, 2 warm-up calls, then the median of 5 rounds of `iters` back-to-back calls.
jax_padsafe rewrites these calls before the kernels (the cute backend's split_kv module: GQA heads
packed into query rows, keys split into chunks); `--split-tiles MIN,TARGET` tries other thresholds (split
grids of fewer than MIN query tiles into about TARGET).
"""

import argparse
import json
import os

import numpy as np

import jax
import jax.numpy as jnp

import jax_padsafe
from jax_padsafe._backends.cute import split_kv as _split_kv
from bench_forward import bench  # the benchmarks' one timing rule

N, H = 32, 128  # query heads, head dim


def make_inputs(B, T, S, K):
    """q [B, T, N, H], k / v [B, S, K, H] (bf16), query lengths T and cache lengths random in [S/2, S]."""
    ks = [jax.random.fold_in(jax.random.PRNGKey(1), i) for i in range(3)]
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, S, K, H), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, K, H), jnp.bfloat16)
    lens = np.random.default_rng(0).integers(S // 2, S + 1, B).astype(np.int32)
    return q, k, v, jnp.full((B,), T, jnp.int32), jnp.asarray(lens), lens


def padsafe_mask(mode):
    """jax_padsafe keywords of a case's mask: none; "causal" (bottom-right: speculative decoding); or
    "window<W>" (a sliding-window layer's decode step: the new row sees the last W + 1 keys of its cache)."""
    if mode == "causal":
        return dict(is_causal=True, causal_alignment="bottom_right")
    if mode:
        return dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(int(mode[6:]), 0))
    return {}


def make_fn(impl, mode=None):
    kw = padsafe_mask(mode)
    if impl == "cute_varlen":  # the same cache through the packed layout (varlen_attention)

        def varlen(q, k, v, lq, lk):
            b, t, n, h = q.shape
            s, kh = k.shape[1], k.shape[2]
            cu_q = jnp.arange(b + 1, dtype=jnp.int32) * t
            cu_k = jnp.arange(b + 1, dtype=jnp.int32) * s
            o = jax_padsafe.varlen_attention(
                q.reshape(b * t, n, h), k.reshape(b * s, kh, h), v.reshape(b * s, kh, h), cu_q, cu_k,
                seqused_q=lq, seqused_k=lk, max_seqlen_q=t, max_seqlen_k=s, implementation="cute", **kw)
            return o.reshape(b, t, n, h)
        return jax.jit(varlen)
    if impl in ("cute", "padsafe_xla"):
        which = "cute" if impl == "cute" else "xla"
        return jax.jit(lambda q, k, v, lq, lk: jax_padsafe.dot_product_attention(
            q, k, v, query_seq_lengths=lq, key_value_seq_lengths=lk, implementation=which, **kw))
    return jax.jit(lambda q, k, v, lq, lk: jax.nn.dot_product_attention(
        q, k, v, implementation=impl, query_seq_lengths=lq, key_value_seq_lengths=lk))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_decode.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--impls", default="cute,padsafe_xla,cudnn,xla")
    ap.add_argument("--split-tiles", default="", help="MIN,TARGET: the split thresholds (tuning)")
    a = ap.parse_args()
    if a.split_tiles:
        _split_kv._ONE_WAVE, _split_kv._TARGET_TILES = (int(x) for x in a.split_tiles.split(","))
    dev = jax.devices()[0].device_kind
    # (batch, query rows, cache length, kv heads[, mask]): GQA 4 unless kv heads say otherwise (32: MHA).
    # Masked cases have no jax.nn counterpart (its causal masks are top-left only); the window case's
    # valid K/V bytes count only the window's keys.
    cases = [(1, 1, 8192, 8), (8, 1, 8192, 8), (32, 1, 4096, 8), (4, 1, 32768, 8), (1, 1, 131072, 8),
             (8, 4, 8192, 8), (8, 4, 8192, 8, "causal"), (8, 1, 8192, 32), (4, 1, 131072, 8, "window4095")]
    if a.quick:
        cases = cases[:2]
    rows = []
    for B, T, S, K, *mode in cases:
        mode = mode[0] if mode else None
        window = int(mode[6:]) if mode and mode.startswith("window") else None
        q, k, v, lq, lk, lens = make_inputs(B, T, S, K)
        seen = np.minimum(lens, window + 1) if window else lens
        kv_bytes = 2 * int(seen.sum()) * K * H * 2
        row = dict(batch=B, q_rows=T, cache=S, heads=N, kv_heads=K, head_dim=H, mask=mode, kv_gb=kv_bytes / 1e9)
        for impl in a.impls.split(","):
            if ((impl == "xla" and B * N * T * S > 2 ** 31) or (mode and impl in ("cudnn", "xla"))
                    or (impl == "padsafe_xla" and S > 32768)):
                row[impl] = None
                continue
            try:
                row[impl] = bench(make_fn(impl, mode), q, k, v, lq, lk, iters=20)
            except Exception as e:  # an implementation that does not take this shape
                print(f"  {impl} B={B} T={T} S={S}: {type(e).__name__}: {str(e)[:160]}")
                row[impl] = None
        rows.append(row)
    impls = a.impls.split(",")
    print(f"\ndecode attention on {dev}: microseconds per call (valid K/V TB/s); bf16, hd{H}, {N} q heads")
    print(f"{'B':>3} {'T':>3} {'S':>7} {'K':>3} {'mask':>10} | " + " | ".join(f"{i:>17}" for i in impls))
    for r in rows:
        cells = []
        for i in impls:
            t = r.get(i)
            cells.append(f"{t * 1e6:9.1f} ({r['kv_gb'] / 1e3 / t:4.2f})" if t else f"{'-':>17}")
        print(f"{r['batch']:>3} {r['q_rows']:>3} {r['cache']:>7} {r['kv_heads']:>3} {r['mask'] or '-':>10} | "
              + " | ".join(cells))
    with open(a.out, "w") as f:
        json.dump(dict(device=dev, jax=jax.__version__,
                       split_tiles=[_split_kv._ONE_WAVE, _split_kv._TARGET_TILES], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
