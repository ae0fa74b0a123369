"""How large may logits get?  Each implementation against float64, with a growing `scale`.

    PYTHONPATH=. python benchmarks/experiments/logit_range_probe.py [--impls cute,cudnn,xla]
    JAX_PADSAFE_SM90=0 ... (the SM80-class forward on Hopper)

Flash kernels form exp2(s * c - max) as one FMA: the product s * c is exact inside it, the max was rounded, so
the difference carries the max's rounding gap, up to half an ulp of |s * c|.  That is harmless while |s| is
small and overflows exp2 once half an ulp passes 128, near |s * c| = 2**31.  This prints, for bf16 inputs
(|q . k| up to ~60 at head dim 128), the largest logit, NaN count and the worst error of O against float64.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_padsafe


def reference(q, k, v, scale):
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="cute,cudnn,xla")
    a = ap.parse_args()
    B, T, N, H = 2, 256, 4, 128
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(3))
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (qb, kb, vb))
    top = np.abs(np.einsum("bthd,bshd->bhts", q64, k64)).max()
    print(f"{jax.devices()[0].device_kind}; max |q.k| = {top:.1f}")
    print(f"{'scale':>8} {'max |logit|':>12} " + " ".join(f"{i + ' nan':>10} {i + ' err':>10}" for i in a.impls.split(",")))
    for scale in (1e1, 1e2, 3e2, 1e3, 1e5, 1e6, 1e7, 3e7, 1e8, 1e9, 1e10, 1e20, 1e30):
        ref = reference(q64, k64, v64, scale)
        cells = []
        for impl in a.impls.split(","):
            if impl == "cudnn":
                o = jax.nn.dot_product_attention(qb, kb, vb, scale=scale, implementation="cudnn")
            else:
                o = jax_padsafe.dot_product_attention(qb, kb, vb, scale=scale, implementation=impl)
            o = np.asarray(o, np.float64)
            bad = ~np.isfinite(o)
            err = np.abs(np.where(bad, 0, o) - ref).max()
            cells.append(f"{int(bad.sum()):>10} {err:>10.2e}")
        print(f"{scale:>8.0e} {top * scale:>12.2e} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
