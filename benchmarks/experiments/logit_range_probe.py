"""How large may logits get?  Each implementation against float64, with a growing `scale`.

    PYTHONPATH=. python benchmarks/experiments/logit_range_probe.py [--impls cute,cudnn,xla]
    JAX_PADSAFE_SM90=0 ... (the SM80-class forward on Hopper)

Flash kernels form exp2(s * c - max) as one FMA: the product s * c is exact inside it, the max was rounded, so
the difference carries the max's rounding gap, up to half an ulp of |s * c|.  That is harmless while |s| is
small and overflows exp2 once half an ulp passes 128, near |s * c| = 2**31.  This prints, for bf16 inputs
(|q . k| up to ~60 at head dim 128), the largest logit, NaN count and the worst error of O against float64.
`--grads`: the same for dq, dk, dv of sum(O * G) (non-finite count; worst error relative to max |float64| up to
scale 1e3, past which the exact gradients of these near one-hot rows vanish and only the count means something).
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


def reference_grads(q, k, v, g, scale):
    """float64 dq, dk, dv of sum(attention(q, k, v) * g), by jax autodiff of the plain softmax attention."""
    def loss(q, k, v):
        s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
        p = jax.nn.softmax(s, axis=-1)
        return jnp.sum(jnp.einsum("bhts,bshd->bthd", p, v) * g)
    return [np.asarray(x) for x in jax.grad(loss, (0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="cute,cudnn,xla")
    ap.add_argument("--grads", action="store_true")
    a = ap.parse_args()
    if a.grads:
        jax.config.update("jax_enable_x64", True)
    B, T, N, H = 2, 256, 4, 128
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(4))
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
                attn = lambda x, y, z: jax.nn.dot_product_attention(x, y, z, scale=scale, implementation="cudnn")  # noqa: E731
            else:
                attn = lambda x, y, z: jax_padsafe.dot_product_attention(x, y, z, scale=scale, implementation=impl)  # noqa: E731
            if a.grads:
                gb = jnp.asarray(np.asarray(g, np.float32), jnp.bfloat16)
                ours = jax.grad(lambda x, y, z: jnp.sum(attn(x, y, z).astype(jnp.float32) * gb.astype(jnp.float32)),
                                (0, 1, 2))(qb, kb, vb)
                refs = reference_grads(q64, k64, v64, np.asarray(gb, np.float64), scale)
                bad = sum(int((~np.isfinite(np.asarray(x, np.float64))).sum()) for x in ours)
                # Past ~1e3 the exact gradients of these near one-hot rows are ~0 and every implementation's are
                # rounding noise times the scale: only the non-finite count means something there.
                err = max(np.abs(np.nan_to_num(np.asarray(x, np.float64), nan=0.0, posinf=0.0, neginf=0.0) - r).max()
                          / np.abs(r).max() for x, r in zip(ours, refs)) if scale <= 1e3 else float("nan")
            else:
                o = np.asarray(attn(qb, kb, vb), np.float64)
                bad = int((~np.isfinite(o)).sum())
                err = np.abs(np.where(np.isfinite(o), o, 0) - ref).max()
            cells.append(f"{bad:>10} {err:>10.2e}")
        print(f"{scale:>8.0e} {top * scale:>12.2e} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
