"""JAX entry point of the CuTe DSL forward kernel (XLA FFI target `jax_padsafe_fwd`, CUDA only).

Packed layout: q [total_q, N, H], k/v [total_k, K, H], cu_seqlens_* int32 [B+1], seqused_* int32 [B].
Returns (o [total_q, N, H], lse [N, total_q] float32) under the pad-safety contract (docs/contract.md):
padded rows of o and lse are exactly 0, valid rows with no visible key have o = 0 and lse = -inf, and
nothing depends on what padded memory holds.

Without the kernel library (`library.library_available()` False) `flash_forward` still lowers (the
custom call is emitted), but an executable for a GPU cannot be compiled.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from jax_padsafe._backends.cute import library

TARGET_NAME = library.FORWARD_TARGET


def _check(cond, exc, msg):
    if not cond:
        raise exc(f"flash_forward: {msg}")


def flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *, max_seqlen_q: int,
                  max_seqlen_k: int, scale: float, causal: bool, bottom_right: bool, window_left: int,
                  window_right: int, softcap: float, rows_covered: bool = False):
    """Pad-safe flash-attention forward on the packed layout; see the module docstring.

    `max_seqlen_q` must be >= every segment length cu_seqlens_q[b+1] - cu_seqlens_q[b]: the grid covers
    ceil(max_seqlen_q / block_m) query tiles per sequence, and query rows beyond it are left at 0.
    `max_seqlen_k` is validated but not needed by the kernel (its K loop bounds come from the lengths).

    `rows_covered=True` promises that cu_seqlens_q starts at 0 and ends at total_q (with no segment
    longer than max_seqlen_q, as above): then the kernel's tiles cover every row of o, and kernels that
    zero their tiles' rows past the used length (the sm90 family) skip the memset of o.  With False
    (the default) the rows no tile reaches are zeroed first: by a memset of o, or under the sm90 family by
    a kernel that writes only those rows (ffi/jps_zero_rows.h)."""
    _check(q.ndim == 3 and k.ndim == 3 and v.ndim == 3, ValueError,
           f"q, k, v must be [total, heads, head_dim], got ranks {q.ndim}, {k.ndim}, {v.ndim}")
    total_q, n, h = q.shape
    total_k, kh, hk = k.shape
    _check(v.shape == k.shape, ValueError, f"v shape {v.shape} must equal k shape {k.shape}")
    _check(hk == h, ValueError, f"k head_dim {hk} must equal q head_dim {h}")
    _check(q.dtype == k.dtype == v.dtype, TypeError, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _check(kh > 0 and n % kh == 0, ValueError, f"num_heads {n} must be a multiple of num_kv_heads {kh}")
    _check(cu_seqlens_q.ndim == 1 and cu_seqlens_k.ndim == 1 and seqused_q.ndim == 1 and seqused_k.ndim == 1,
           ValueError, "cu_seqlens_* and seqused_* must be 1-D")
    b = seqused_q.shape[0]
    _check(cu_seqlens_q.shape[0] == b + 1 and cu_seqlens_k.shape[0] == b + 1 and seqused_k.shape[0] == b,
           ValueError, f"cu_seqlens_q/k need {b + 1} entries and seqused_k {b} (from seqused_q)")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        _check(x.dtype == jnp.int32, TypeError, f"{name} must be int32, got {x.dtype}")
    _check(int(max_seqlen_q) >= 0 and int(max_seqlen_k) >= 0, ValueError, "max_seqlen_q/k must be >= 0")
    _check(np.isfinite(scale), ValueError, f"scale must be finite, got {scale}")
    _check(np.isfinite(softcap) and softcap >= 0, ValueError, f"softcap must be finite and >= 0, got {softcap}")
    reason = library.unsupported_reason(dtype=q.dtype, head_dim=h, head_dim_v=v.shape[-1], num_heads=n,
                                        num_kv_heads=kh, causal=causal, window=(window_left, window_right),
                                        softcap=softcap, has_bias=False)
    if reason is not None:
        raise NotImplementedError(reason)
    library.library_available()  # registers the target when the library is present
    # The kernel needs scale > 0 (it takes the row max over raw scores).  Exact rewrites otherwise:
    # softmax(c q.k) with c < 0 is softmax(|c| (-q).k); with c == 0 every logit is 0, as with q = 0.
    if scale < 0:
        q, scale = -q, -scale
    elif scale == 0:
        q, scale = jnp.zeros_like(q), 1.0

    call = jax.ffi.ffi_call(
        TARGET_NAME,
        # The third result is the kernel's scratch: the tile counter of the sm90 compact schedule.
        (jax.ShapeDtypeStruct((total_q, n, h), q.dtype), jax.ShapeDtypeStruct((n, total_q), jnp.float32),
         jax.ShapeDtypeStruct((1,), jnp.int32)),
        vmap_method="sequential",
    )
    o, lse, _ = call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        scale=np.float32(scale),
        softcap=np.float32(softcap),
        window_left=np.int32(-1 if window_left is None or window_left < 0 else window_left),
        window_right=np.int32(-1 if window_right is None or window_right < 0 else window_right),
        causal=np.int32(bool(causal)),
        bottom_right=np.int32(bool(bottom_right)),
        max_seqlen_q=np.int32(max_seqlen_q),
        rows_covered=np.int32(bool(rows_covered)),
    )
    return o, lse
