"""JAX entry point of the CuTe DSL backward kernels (XLA FFI target `jax_padsafe_bwd`, CUDA only).

Packed layout: q/o/do [total_q, N, H] (bf16 | fp16), k/v [total_k, K, H], lse/dlse [N, total_q] float32,
cu_seqlens_* int32 [B+1], seqused_* int32 [B].  Returns (dq, dk, dv) in the input dtype, under the
pad-safety contract: padded rows of dq/dk/dv and keys no valid query sees are exactly 0, valid rows
with lse = -inf give dq = 0 and add nothing to dk/dv, and nothing depends on what padded memory holds.

Kernels (jax_padsafe/kernels/sm80; on Hopper the dK/dV and dQ kernels of jax_padsafe/kernels/sm90):
preprocess (Delta = rowsum(dO*O) - dlse into a zero-filled workspace), dK/dV (one CTA per key tile,
looping over the query heads of its GQA group and the query tiles; for head dims above 128 two launches
of it, a dV pass and a dK pass, so that one 16 x HD fp32 accumulator per warp fits in registers; the
Hopper kernel instead splits the head dim between its two warpgroups), dQ (one CTA per query tile,
looping over key tiles).  No atomics and no global accumulator: every call is deterministic, so
`deterministic=True` costs nothing extra; the price of this design is that S = QK^T and dP = dO V^T are
computed in both kernels (7 GEMMs instead of 5; 8 with the split dK/dV kernel).
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from jax_padsafe._backends.cute import library

TARGET_NAME = library.BACKWARD_TARGET


def _check(cond, exc, msg):
    if not cond:
        raise exc(f"flash_backward: {msg}")


def flash_backward(q, k, v, o, lse, do, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *,
                   max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, bottom_right: bool,
                   window_left: int, window_right: int, softcap: float, deterministic: bool = False,
                   rows_covered: bool = False):
    """Gradients (dq, dk, dv) of `forward.flash_forward` on the packed layout; see the module docstring.

    `rows_covered=True` promises that cu_seqlens_q/k start at 0, end at total_q/total_k, and have no
    segment longer than max_seqlen_q/k: then the kernels' tiles cover every row, and kernels that zero
    their tiles' rows past the used length (the sm90 family) skip the memsets of dq, dk, dv.  With False
    (the default) the sm90 family zeroes only the rows its tiles miss (ffi/jps_zero_rows.h), the SM80-class
    one memsets dq, dk, dv."""
    _check(q.ndim == 3 and k.ndim == 3 and v.ndim == 3, ValueError,
           f"q, k, v must be [total, heads, head_dim], got ranks {q.ndim}, {k.ndim}, {v.ndim}")
    total_q, n, h = q.shape
    total_k, kh, hk = k.shape
    _check(v.shape == k.shape, ValueError, f"v shape {v.shape} must equal k shape {k.shape}")
    _check(hk == h, ValueError, f"k head_dim {hk} must equal q head_dim {h}")
    _check(o.shape == q.shape and do.shape == q.shape, ValueError,
           f"o {o.shape} and do {do.shape} must have q's shape {q.shape}")
    _check(lse.shape == (n, total_q) and dlse.shape == (n, total_q), ValueError,
           f"lse {lse.shape} and dlse {dlse.shape} must be {(n, total_q)}")
    _check(q.dtype == k.dtype == v.dtype == o.dtype == do.dtype, TypeError,
           f"q, k, v, o, do dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}, {o.dtype}, {do.dtype}")
    _check(kh > 0 and n % kh == 0, ValueError, f"num_heads {n} must be a multiple of num_kv_heads {kh}")
    b = seqused_q.shape[0]
    _check(cu_seqlens_q.shape == (b + 1,) and cu_seqlens_k.shape == (b + 1,) and seqused_k.shape == (b,),
           ValueError, f"cu_seqlens_q/k need {b + 1} entries and seqused_k {b} (from seqused_q)")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        _check(x.dtype == jnp.int32, TypeError, f"{name} must be int32, got {x.dtype}")
    _check(int(max_seqlen_q) >= 0 and int(max_seqlen_k) >= 0, ValueError, "max_seqlen_q/k must be >= 0")
    _check(np.isfinite(scale), ValueError, f"scale must be finite, got {scale}")
    _check(np.isfinite(softcap) and softcap >= 0, ValueError, f"softcap must be finite and >= 0, got {softcap}")
    reason = library.unsupported_reason(dtype=q.dtype, head_dim=h, num_heads=n, num_kv_heads=kh, causal=causal,
                                        window=(window_left, window_right), softcap=softcap,
                                        direction="backward")
    if reason is not None:
        raise NotImplementedError(reason)
    library.backward_available()  # registers the target when the library is present
    # Same exact rewrites as forward.flash_forward (the kernels need scale > 0):
    # scale < 0: logits c q.k = |c| (-q).k, so dq = -dq' and dk, dv are unchanged;
    # scale == 0: every logit is 0 whatever q, k are: dq = dk = 0 exactly, dv from the uniform P.
    sign = 1.0
    if scale < 0:
        q, scale, sign = -q, -scale, -1.0
    zero_scale = scale == 0
    if zero_scale:
        q, scale = jnp.zeros_like(q), 1.0

    call = jax.ffi.ffi_call(
        TARGET_NAME,
        (jax.ShapeDtypeStruct((total_q, n, h), q.dtype), jax.ShapeDtypeStruct((total_k, kh, h), q.dtype),
         jax.ShapeDtypeStruct((total_k, kh, h), q.dtype), jax.ShapeDtypeStruct((n, total_q), jnp.float32),
         # Scratch: the sm90 kernels' compact schedules claim tiles from these counters (zeroed by the
         # handler on every call that may take them).
         jax.ShapeDtypeStruct((2,), jnp.int32)),
        vmap_method="sequential",
    )
    dq, dk, dv, _delta, _tile_counters = call(
        q, k, v, o, lse.astype(jnp.float32), do, dlse.astype(jnp.float32),
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        scale=np.float32(scale),
        softcap=np.float32(softcap),
        window_left=np.int32(-1 if window_left is None or window_left < 0 else window_left),
        window_right=np.int32(-1 if window_right is None or window_right < 0 else window_right),
        causal=np.int32(bool(causal)),
        bottom_right=np.int32(bool(bottom_right)),
        max_seqlen_q=np.int32(max_seqlen_q),
        max_seqlen_k=np.int32(max_seqlen_k),
        deterministic=np.int32(bool(deterministic)),
        rows_covered=np.int32(bool(rows_covered)),
    )
    if zero_scale:
        dq, dk = jnp.zeros_like(dq), jnp.zeros_like(dk)
    elif sign < 0:
        dq = -dq
    return dq, dk, dv
