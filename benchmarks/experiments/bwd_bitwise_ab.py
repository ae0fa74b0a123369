"""Bitwise A/B of two backward kernel libraries (GPU): run once per library, the first run saves, the second compares.

    JAX_PADSAFE_CUTE_LIB=A.so PYTHONPATH=. python benchmarks/experiments/bwd_bitwise_ab.py save ref.npz
    JAX_PADSAFE_CUTE_LIB=B.so PYTHONPATH=. python benchmarks/experiments/bwd_bitwise_ab.py compare ref.npz

For a kernel change that must not change any bit (a new work split with the same wgmma shapes and the same
element-wise math; session 7: the hd192/256 P^T/dS^T exchange against the duplicated S^T/dP^T; session 8: the
dQ kernel's register operands and step overlap): dq, dk, dv of a packed GQA batch (2 sequences, used lengths
below their slots), head dims HEAD_DIMS (default 192,256), causal and not, DTYPES (default bf16,fp16).  Prints how many gradients are bitwise identical.
"""

import os
import sys

import numpy as np

import jax.numpy as jnp

from jax_padsafe._cute import bwd_ops, ops


def gradients():
    out = {}
    for H in (int(h) for h in os.environ.get("HEAD_DIMS", "192,256").split(",")):
        for causal in (False, True):
            for dt in (getattr(jnp, {"bf16": "bfloat16", "fp16": "float16"}[d])
                       for d in os.environ.get("DTYPES", "bf16,fp16").split(",")):
                rng = np.random.default_rng(H + causal)
                T, N, K = 1500, 8, 2
                q, do = (jnp.asarray(rng.standard_normal((T, N, H)), dt) for _ in range(2))
                k, v = (jnp.asarray(rng.standard_normal((T, K, H)), dt) for _ in range(2))
                cu = jnp.array([0, 700, 1500], jnp.int32)
                used = jnp.array([650, 777], jnp.int32)
                kw = dict(max_seqlen_q=800, max_seqlen_k=800, scale=H ** -0.5, causal=causal, bottom_right=False,
                          window_left=-1, window_right=-1, softcap=0.0)
                o, lse = ops.flash_forward(q, k, v, cu, cu, used, used, **kw)
                g = bwd_ops.flash_backward(q, k, v, o, lse, do, jnp.zeros_like(lse), cu, cu, used, used, **kw)
                for name, x in zip(("dq", "dk", "dv"), g):
                    out[f"hd{H}_causal{int(causal)}_{dt.__name__}_{name}"] = np.asarray(x.astype(jnp.float32))
    return out


def main(mode, path):
    res = gradients()
    if mode == "save":
        np.savez(path, **res)
        return 0
    ref = np.load(path)
    bad = [k for k in res if not np.array_equal(res[k], ref[k])]
    print(f"bitwise A/B: {len(res) - len(bad)}/{len(res)} gradients identical; differ: {bad}")
    for k in bad:
        print(f"  {k}: max |diff| {np.abs(res[k] - ref[k]).max():.3g} (max |ref| {np.abs(ref[k]).max():.3g})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
