"""Bitwise A/B of two forward kernel libraries (GPU): run once per library, the first run saves, the second compares.

    JAX_PADSAFE_CUTE_LIB=A.so PYTHONPATH=. python benchmarks/experiments/fwd_bitwise_ab.py save ref.npz
    JAX_PADSAFE_CUTE_LIB=B.so PYTHONPATH=. python benchmarks/experiments/fwd_bitwise_ab.py compare ref.npz

For a forward change that must not change any bit (session 10: the wait for P V pinned after the softmax, O
rescaled before the P V issue): O and lse of packed GQA batches with used lengths below their slots, head dims
HEAD_DIMS (default 64,96,128,192,256), bf16; plain, causal (top-left and bottom-right), sliding window; short
sequences (one K tile per query tile) and a batch with enough query tiles that each CTA takes several.
BOUND=packed passes the packed length as max_seqlen (all a jitted step with traced offsets knows), so every case
takes the compact schedule, and adds a case of ~300 documents of 1-512 tokens (session 20: the compact schedule's
queue publishing decoded tiles).  Prints how many outputs are bitwise identical.
"""

import os
import sys

import numpy as np

import jax.numpy as jnp

from jax_padsafe._cute import ops

CASES = {
    # name: (slot lengths, used lengths, heads, kv heads, causal, bottom_right, window_left, window_right)
    "plain": ([700, 1300], [650, 1211], 8, 2, False, False, -1, -1),
    "causal": ([700, 1300], [650, 1211], 8, 2, True, False, -1, -1),
    "causal_br": ([700, 1300], [333, 1211], 8, 2, True, True, -1, -1),
    "window": ([900, 1100], [900, 1003], 8, 4, True, False, 200, 0),
    "short": ([130, 64, 300], [100, 1, 37], 8, 8, False, False, -1, -1),
    "multitile": ([2048] * 8, [2048, 2000, 1937, 2048, 1500, 2048, 1999, 2048], 16, 16, False, False, -1, -1),
    "multitile_causal": ([2048] * 8, [2048, 2000, 1937, 2048, 1500, 2048, 1999, 2048], 16, 16, True, False, -1, -1),
}


def cases():
    if os.environ.get("BOUND") != "packed":
        return CASES
    rng = np.random.default_rng(20)
    slots = [int(x) for x in rng.integers(1, 513, 300)]
    used = [max(x - int(d), 0) for x, d in zip(slots, rng.integers(0, 40, 300))]
    return dict(CASES, many=(slots, used, 8, 2, False, False, -1, -1), many_causal=(slots, used, 8, 2, True, True, -1, -1))


def outputs():
    out = {}
    packed = os.environ.get("BOUND") == "packed"
    for H in (int(h) for h in os.environ.get("HEAD_DIMS", "64,96,128,192,256").split(",")):
        for name, (slots, used, N, K, causal, br, wl, wr) in cases().items():
            if name.startswith("multitile"):
                N = max(2, 2048 // H)
                K = N
            rng = np.random.default_rng(H * 1000 + len(name))
            T = sum(slots)
            q = jnp.asarray(rng.standard_normal((T, N, H)), jnp.bfloat16)
            k, v = (jnp.asarray(rng.standard_normal((T, K, H)), jnp.bfloat16) for _ in range(2))
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(slots)]), jnp.int32)
            u = jnp.asarray(used, jnp.int32)
            bound = T if packed else max(slots)
            o, lse = ops.flash_forward(q, k, v, cu, cu, u, u, max_seqlen_q=bound, max_seqlen_k=bound,
                                       scale=H ** -0.5, causal=causal, bottom_right=br, window_left=wl,
                                       window_right=wr, softcap=0.0)
            out[f"hd{H}_{name}_o"] = np.asarray(o.astype(jnp.float32))
            out[f"hd{H}_{name}_lse"] = np.asarray(lse)
    return out


def main(mode, path):
    res = outputs()
    if mode == "save":
        np.savez(path, **res)
        print(f"saved {len(res)} outputs")
        return 0
    ref = np.load(path)
    bad = [k for k in res if not np.array_equal(res[k], ref[k], equal_nan=True)]
    print(f"bitwise A/B: {len(res) - len(bad)}/{len(res)} outputs identical; differ: {bad}")
    for k in bad:
        print(f"  {k}: max |diff| {np.nanmax(np.abs(res[k] - ref[k])):.3g}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
