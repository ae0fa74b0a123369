"""JAX entry points of the CuTe DSL forward kernel (XLA FFI target `jax_padsafe_fwd`, CUDA only).

Canonical packed layout: q [total_q, N, H], k/v [total_k, K, H], cu_seqlens_* int32 [B+1],
seqused_* int32 [B].  Returns (o [total_q, N, H], lse [N, total_q] float32) under the pad-safety
contract (../shared/PADSAFE_CONTRACT.md): padded rows of o and lse are exactly 0, valid rows with no
visible key have o = 0 and lse = -inf, and nothing depends on what padded memory holds.

The library is `jax_padsafe/_cute/lib/libjax_padsafe_kernels.so` (override with the environment
variable JAX_PADSAFE_CUTE_LIB).  Without it `library_available()` is False; `flash_forward` still
lowers (the custom call is emitted), but an executable for a GPU cannot be compiled.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp

TARGET_NAME = "jax_padsafe_fwd"
LIBRARY_NAME = "libjax_padsafe_kernels.so"

# What the default build (jax_padsafe/kernels/variants.py) provides; used when no library is loaded.
_DEFAULT_HEAD_DIMS = (64, 96, 128, 192, 256)
_DTYPE_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1}
_ARCH_NAMES = {80: "sm_80", 90: "sm_90a", 100: "sm_100a", 120: "sm_120"}

_lock = threading.Lock()


def library_path() -> Path:
    """JAX_PADSAFE_CUTE_LIB, else lib/ beside this file, else lib/ in any other folder of this package
    (an editable install keeps the sources here and the built library in site-packages)."""
    env = os.environ.get("JAX_PADSAFE_CUTE_LIB")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent / "lib" / LIBRARY_NAME
    pkg = sys.modules.get(__package__) if __package__ else None
    for folder in [here.parent.parent] + [Path(p) for p in getattr(pkg, "__path__", [])]:
        cand = folder / "lib" / LIBRARY_NAME
        if cand.is_file():
            return cand
    return here


def load_kernel_target(kind: str, target_name: str):
    """Load the kernel library and register one of its FFI targets (``kind`` "fwd" or "bwd").

    The library exports, per kind, ``jps_<kind>_initialize`` / ``jps_<kind>_execute`` (the XLA FFI
    handlers) and ``jps_num_<kind>_variants`` / ``jps_<kind>_variant(i, &arch, &dtype, &head_dim,
    &softcap)`` (what it was built for).  Returns (lib, variants) with one (arch, dtype code,
    head_dim, softcap) entry per combination, whichever kernel family serves it, or None when the
    library or one of those symbols is missing."""
    path = library_path()
    if not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    names = (f"jps_{kind}_initialize", f"jps_{kind}_execute", f"jps_num_{kind}_variants", f"jps_{kind}_variant")
    if not all(hasattr(lib, name) for name in names):
        return None
    initialize, execute, count, describe = (getattr(lib, name) for name in names)
    count.restype = ctypes.c_int
    variants = []
    for i in range(count()):
        vals = [ctypes.c_int() for _ in range(4)]
        if describe(i, *[ctypes.byref(x) for x in vals]) == 0:
            v = tuple(x.value for x in vals)
            if v not in variants:
                variants.append(v)
    with _lock:
        jax.ffi.register_ffi_target(
            target_name,
            {"initialize": jax.ffi.pycapsule(initialize), "execute": jax.ffi.pycapsule(execute)},
            platform="CUDA",
        )
    return lib, tuple(variants)


@functools.lru_cache(maxsize=None)
def _load():
    """The forward target, loaded and registered once; None if unavailable."""
    return load_kernel_target("fwd", TARGET_NAME)


def library_available() -> bool:
    """True if the built kernel library was found, loaded and registered.  Never raises."""
    try:
        return _load() is not None
    except Exception:  # noqa: BLE001 - by contract this never raises
        return False


def built_variants():
    """(arch, dtype, head_dim, softcap) tuples of the loaded library; empty without it."""
    loaded = library_available() and _load()
    if not loaded:
        return ()
    inv = {v: k for k, v in _DTYPE_CODES.items()}
    return tuple((_ARCH_NAMES.get(a, str(a)), str(inv[d]), h, bool(c)) for a, d, h, c in loaded[1])


def unsupported_reason(*, dtype, head_dim, head_dim_v, num_heads, num_kv_heads, causal, window, softcap, has_bias):
    """None if the forward kernel supports this static combination, else a sentence saying why not."""
    dt = jnp.dtype(dtype)
    if dt not in _DTYPE_CODES:
        return f"the CuTe forward kernel supports bfloat16 and float16 inputs, not {dt}"
    if head_dim_v != head_dim:
        return f"the CuTe forward kernel needs the same head dim for V as for Q/K (got {head_dim} and {head_dim_v})"
    if has_bias:
        return "the CuTe forward kernel does not support an additive bias"
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        return f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
    if num_heads > 65535:
        return "the CuTe forward kernel supports at most 65535 query heads"
    if softcap is not None and softcap < 0:
        return "softcap must be >= 0"
    loaded = library_available() and _load()
    if loaded:
        code = _DTYPE_CODES[dt]
        cap = bool(softcap and softcap > 0)
        have = {(h, c) for (_, d, h, c) in loaded[1] if d == code}
        if (head_dim, cap) not in have:
            dims = sorted({h for h, c in have if c == cap})
            return (f"the built CuTe kernels have no {dt} variant for head dim {head_dim}"
                    f"{' with softcap' if cap else ''} (built: {dims})")
    elif head_dim not in _DEFAULT_HEAD_DIMS:
        return f"the CuTe forward kernel supports head dims {_DEFAULT_HEAD_DIMS}, not {head_dim}"
    return None


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
    reason = unsupported_reason(dtype=q.dtype, head_dim=h, head_dim_v=v.shape[-1], num_heads=n, num_kv_heads=kh,
                                causal=causal, window=(window_left, window_right), softcap=softcap, has_bias=False)
    if reason is not None:
        raise NotImplementedError(reason)
    library_available()  # registers the target when the library is present
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
