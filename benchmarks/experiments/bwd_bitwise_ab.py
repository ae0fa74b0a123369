"""Bitwise A/B of two backward kernel libraries (GPU): run once per library, the first run saves, the second compares.

    JAX_PADSAFE_CUTE_LIB=A.so PYTHONPATH=. python benchmarks/experiments/bwd_bitwise_ab.py save ref.npz
    JAX_PADSAFE_CUTE_LIB=B.so PYTHONPATH=. python benchmarks/experiments/bwd_bitwise_ab.py compare ref.npz

For a kernel change that must not change any bit (a new work split with the same wgmma shapes and the same
element-wise math; session 7: the hd192/256 P^T/dS^T exchange against the duplicated S^T/dP^T; session 8: the
dQ kernel's register operands and step overlap; session 20: the compact schedules' tile queue against one CTA
per tile): dq, dk, dv of a packed GQA batch (2 sequences, used lengths below their slots), head dims HEAD_DIMS
(default 192,256), causal and not, DTYPES (default bf16,fp16).  LAYOUT=short instead packs ~300 documents of
1-512 tokens (used lengths below their slots, a 2000-token document among them) and leaves max_seqlen at the
packed length, so both backward kernels take their compact schedules with several tiles per persistent CTA.  LAYOUT=padded:
the dense padded layout (4 x 1024 slots, rows_covered), which takes the dense schedule unless `queue_dense`.
Prints how many gradients are bitwise identical.
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
                if os.environ.get("LAYOUT", "two") == "short":
                    slots = rng.integers(1, 513, 300)
                    slots[17] = 2000
                    cu = jnp.asarray(np.concatenate([[0], np.cumsum(slots)]), jnp.int32)
                    used = jnp.asarray(np.maximum(slots - rng.integers(0, 40, slots.size), 0), jnp.int32)
                    T, N, K, bound = int(cu[-1]), 8, 2, int(cu[-1])
                elif os.environ.get("LAYOUT") == "padded":
                    # The dense padded layout (4 x 1024 slots, used lengths below them, rows_covered): the one
                    # the sm90 `queue_dense` policy moves onto the queued schedule.
                    T, N, K, bound = 4096, 8, 2, 1024
                    cu = jnp.arange(5, dtype=jnp.int32) * 1024
                    used = jnp.array([1024, 700, 1001, 333], jnp.int32)
                else:
                    T, N, K, bound = 1500, 8, 2, 800
                    cu = jnp.array([0, 700, 1500], jnp.int32)
                    used = jnp.array([650, 777], jnp.int32)
                q, do = (jnp.asarray(rng.standard_normal((T, N, H)), dt) for _ in range(2))
                k, v = (jnp.asarray(rng.standard_normal((T, K, H)), dt) for _ in range(2))
                kw = dict(max_seqlen_q=bound, max_seqlen_k=bound, scale=H ** -0.5, causal=causal, bottom_right=False,
                          window_left=-1, window_right=-1, softcap=0.0)
                o, lse = ops.flash_forward(q, k, v, cu, cu, used, used, **kw)
                g = bwd_ops.flash_backward(q, k, v, o, lse, do, jnp.zeros_like(lse), cu, cu, used, used, **kw,
                                           rows_covered=os.environ.get("LAYOUT") == "padded")
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
