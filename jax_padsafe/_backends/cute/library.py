"""The kernel library: ``libjax_padsafe_kernels.so``, loaded once for the forward and the backward.

The library (built from ``jax_padsafe/kernels`` and ``ffi/``; see BUILD.md) lives in ``lib/`` beside
this file; the environment variable ``JAX_PADSAFE_CUTE_LIB`` may name another file. It exports, per
direction (``fwd``, ``bwd``), the XLA FFI handlers ``jps_<kind>_initialize`` / ``jps_<kind>_execute``
and ``jps_num_<kind>_variants`` / ``jps_<kind>_variant(i, &arch, &dtype, &head_dim, &softcap)``: what
it was built for. Loading registers the FFI targets ``jax_padsafe_fwd`` and ``jax_padsafe_bwd`` for
CUDA. Without the library nothing is registered, :func:`library_available` is False, and support is
judged by the default build matrix (a call still lowers, but no GPU executable can be compiled).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

LIBRARY_NAME = "libjax_padsafe_kernels.so"
FORWARD_TARGET = "jax_padsafe_fwd"
BACKWARD_TARGET = "jax_padsafe_bwd"

# What the default build (jax_padsafe/kernels/build) provides, forward and backward; used when no
# library is loaded.
DEFAULT_HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPE_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1}
_ARCH_NAMES = {80: "sm_80", 90: "sm_90a", 100: "sm_100a", 120: "sm_120"}
_KINDS = {"forward": ("fwd", FORWARD_TARGET), "backward": ("bwd", BACKWARD_TARGET)}

_lock = threading.Lock()


class Loaded(NamedTuple):
  """The loaded library and the variants ``(arch, dtype code, head_dim, softcap)`` of each direction
  (``None``: the direction's symbols are missing and its target is not registered)."""
  lib: object
  forward: tuple | None
  backward: tuple | None


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


def _register(lib, kind: str, target: str):
  """Registers one direction's FFI target; returns its variants, or None if a symbol is missing."""
  names = (f"jps_{kind}_initialize", f"jps_{kind}_execute", f"jps_num_{kind}_variants",
           f"jps_{kind}_variant")
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
        target,
        {"initialize": jax.ffi.pycapsule(initialize), "execute": jax.ffi.pycapsule(execute)},
        platform="CUDA",
    )
  return tuple(variants)


@functools.lru_cache(maxsize=None)
def _load():
  """The library, loaded and its targets registered once; None if there is no loadable library."""
  path = library_path()
  if not path.is_file():
    return None
  try:
    lib = ctypes.CDLL(str(path))
  except OSError:
    return None
  return Loaded(lib, *(_register(lib, *_KINDS[d]) for d in ("forward", "backward")))


def _variants(direction: str):
  """The loaded variants of ``direction``, or None (no library, or not that direction). Never raises."""
  try:
    loaded = _load()
  except Exception:  # noqa: BLE001 - by contract this never raises
    return None
  return None if loaded is None else getattr(loaded, direction)


def library_available() -> bool:
  """True if the library was found and loaded and its forward target registered.  Never raises."""
  return _variants("forward") is not None


def backward_available() -> bool:
  """True if the library holds the backward kernels and their target is registered.  Never raises."""
  return _variants("backward") is not None


def built_variants(direction: str = "forward"):
  """``(arch, dtype, head_dim, softcap)`` tuples of the loaded library's kernels; empty without it."""
  available = library_available() if direction == "forward" else backward_available()
  variants = _variants(direction) if available else None
  if not variants:
    return ()
  inv = {v: k for k, v in DTYPE_CODES.items()}
  return tuple((_ARCH_NAMES.get(a, str(a)), str(inv[d]), h, bool(c)) for a, d, h, c in variants)


def unsupported_reason(*, dtype, head_dim, num_heads, num_kv_heads, causal, window, softcap,
                       head_dim_v=None, has_bias=False, direction: str = "forward"):
  """None if the kernels of ``direction`` support this static combination, else a sentence why not."""
  del causal, window  # every variant has them
  # "the CuTe forward kernel supports ..." / "the CuTe backward kernels support ..."
  what, verb = ("forward kernel", "supports") if direction == "forward" else ("backward kernels", "support")
  dt = jnp.dtype(dtype)
  if dt not in DTYPE_CODES:
    return f"the CuTe {what} {verb} bfloat16 and float16 inputs, not {dt}"
  if head_dim_v is not None and head_dim_v != head_dim:
    return f"the CuTe {what} needs the same head dim for V as for Q/K (got {head_dim} and {head_dim_v})"
  if has_bias:
    return f"the CuTe {what} does not support an additive bias"
  if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
    return f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
  if num_heads > 65535:
    return f"the CuTe {what} {verb} at most 65535 query heads"
  if softcap is not None and softcap < 0:
    return "softcap must be >= 0"
  available = library_available() if direction == "forward" else backward_available()
  variants = _variants(direction) if available else None
  cap = bool(softcap and softcap > 0)
  if variants is not None:
    code = DTYPE_CODES[dt]
    have = {(h, c) for (_, d, h, c) in variants if d == code}
    if (head_dim, cap) not in have:
      dims = sorted({h for h, c in have if c == cap})
      kernels = "kernels" if direction == "forward" else "backward kernels"
      return (f"the built CuTe {kernels} have no {dt} variant for head dim {head_dim}"
              f"{' with softcap' if cap else ''} (built: {dims})")
  elif head_dim not in DEFAULT_HEAD_DIMS:
    return f"the CuTe {what} {verb} head dims {DEFAULT_HEAD_DIMS}, not {head_dim}"
  return None


def check_operands(caller: str, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *,
                   max_seqlen_q, max_seqlen_k, scale, softcap):
  """The operand checks that ``flash_forward`` and ``flash_backward`` share (errors name ``caller``).

  Returns ``(total_q, num_heads, head_dim, total_k, num_kv_heads)``.
  """
  def check(cond, exc, msg):
    if not cond:
      raise exc(f"{caller}: {msg}")

  check(q.ndim == 3 and k.ndim == 3 and v.ndim == 3, ValueError,
        f"q, k, v must be [total, heads, head_dim], got ranks {q.ndim}, {k.ndim}, {v.ndim}")
  total_q, n, h = q.shape
  total_k, kh, hk = k.shape
  check(v.shape == k.shape, ValueError, f"v shape {v.shape} must equal k shape {k.shape}")
  check(hk == h, ValueError, f"k head_dim {hk} must equal q head_dim {h}")
  check(kh > 0 and n % kh == 0, ValueError, f"num_heads {n} must be a multiple of num_kv_heads {kh}")
  seqlens = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q),
             ("seqused_k", seqused_k))
  check(all(x.ndim == 1 for _, x in seqlens), ValueError, "cu_seqlens_* and seqused_* must be 1-D")
  b = seqused_q.shape[0]
  check(cu_seqlens_q.shape[0] == b + 1 and cu_seqlens_k.shape[0] == b + 1 and seqused_k.shape[0] == b,
        ValueError, f"cu_seqlens_q/k need {b + 1} entries and seqused_k {b} (from seqused_q)")
  for name, x in seqlens:
    check(x.dtype == jnp.int32, TypeError, f"{name} must be int32, got {x.dtype}")
  check(int(max_seqlen_q) >= 0 and int(max_seqlen_k) >= 0, ValueError, "max_seqlen_q/k must be >= 0")
  check(np.isfinite(scale), ValueError, f"scale must be finite, got {scale}")
  check(np.isfinite(softcap) and softcap >= 0, ValueError,
        f"softcap must be finite and >= 0, got {softcap}")
  return total_q, n, h, total_k, kh


def window_attribute(side) -> np.int32:
  """A window side as the handlers take it: int32, -1 for unbounded."""
  return np.int32(-1 if side is None or side < 0 else side)
