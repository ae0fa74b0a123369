"""The kernel library: ``libjax_padsafe_kernels.so``, loaded once for the forward and the backward.

The library (built from ``jax_padsafe/kernels`` and ``ffi/``; see BUILD.md) lives in ``lib/`` beside
this file; the environment variable ``JAX_PADSAFE_CUTE_LIB`` may name another file. It exports, per
direction (``fwd``, ``bwd``), the XLA FFI handlers ``jps_<kind>_initialize`` / ``jps_<kind>_execute``
and ``jps_num_<kind>_variants`` / ``jps_<kind>_variant(i, &arch, &dtype, &head_dim, &softcap)``: what
it was built for; and ``jps_ffi_api_version(&major, &minor)``: the XLA FFI API its handlers speak.

Loading checks, in order: the file exists; the dynamic loader accepts it (a glibc too old for it, a
corrupted file); the running jaxlib serves its FFI API version (registering handlers of a newer
version would take jax's whole CUDA backend down); it holds both directions' symbols and forward
kernels. Then it registers the FFI targets ``jax_padsafe_fwd`` and ``jax_padsafe_bwd`` for CUDA, and,
where the library has them, ``jax_padsafe_fwd_aux`` and ``jax_padsafe_bwd_aux``: the kernel variants
that take masks and biases as tensors (``jps_<kind>_aux_execute``; ``jps_<kind>_variant_aux(i)`` says
which table entries they are).
The first failure is kept as the reason (:func:`unusable_reason`); nothing is registered,
:func:`library_available` is False, support is judged by the default build matrix (a call still
lowers, but no GPU executable can be compiled), and :func:`warn_unusable` says so once where jax has
a CUDA backend.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

LIBRARY_NAME = "libjax_padsafe_kernels.so"
FORWARD_TARGET = "jax_padsafe_fwd"
BACKWARD_TARGET = "jax_padsafe_bwd"
FORWARD_AUX_TARGET = "jax_padsafe_fwd_aux"
BACKWARD_AUX_TARGET = "jax_padsafe_bwd_aux"
BACKWARD_DBIAS_TARGET = "jax_padsafe_bwd_dbias"

# What the default build (jax_padsafe/kernels/build) provides, forward and backward; used when no
# library is loaded.
DEFAULT_HEAD_DIMS = (64, 80, 96, 128, 192, 256)
DTYPE_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1}
ARCH_NAMES = {80: "sm_80", 90: "sm_90a", 100: "sm_100a", 120: "sm_120"}
_KINDS = {"forward": ("fwd", FORWARD_TARGET), "backward": ("bwd", BACKWARD_TARGET)}
_SYMBOLS = tuple(f"jps_{name}" for kind, _ in _KINDS.values()
                 for name in (f"{kind}_initialize", f"{kind}_execute", f"num_{kind}_variants", f"{kind}_variant"))
# The cost of the fallback, from benchmarks/README.md (H100, 2026-11-25, jax 0.11.2): the pure-JAX path
# reaches 1/3 to 1/27 of the kernels' forward TFLOP/s (median 1/9), 1/3 to 1/8 forward+backward.
FALLBACK_COST = "every attention call runs on the pure-JAX path, about 10x slower on a GPU (3-27x on an H100)"

_lock = threading.Lock()
_warned: set[str] = set()


class KernelLibraryWarning(UserWarning):
  """The GPU kernel library is missing or cannot be used, on a machine where jax has a CUDA backend."""


class Loaded(NamedTuple):
  """The library as loaded: its handle and the variants ``(arch, dtype code, head_dim, softcap)`` of
  each direction (``None``: not usable), the file, why it is not used (``None`` when it is), the
  XLA FFI API version ``(major, minor)`` it was built against, and the aux variants (masks and
  biases as tensors; softcap always 0) of each direction whose aux target is registered."""
  lib: object
  forward: tuple | None
  backward: tuple | None
  path: Path | None = None
  reason: str | None = None
  ffi_api: tuple[int, int] | None = None
  forward_aux: tuple = ()
  backward_aux: tuple = ()
  backward_dbias: tuple = ()  # the variants with the bias gradient kernel (target registered)


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


@functools.lru_cache(maxsize=None)
def runtime_ffi_api_version() -> tuple[int, int] | None:
  """The XLA FFI API version of the running jaxlib, from the ``c_api.h`` it ships (its CUDA plugin is
  pinned to the same release); None if that header cannot be read."""
  try:
    text = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    return tuple(int(re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text).group(1))
                 for part in ("MAJOR", "MINOR"))
  except (OSError, AttributeError):
    return None


def library_ffi_api_version(lib) -> tuple[int, int] | None:
  """The XLA FFI API version the library's handlers were built against; None if it does not say."""
  if not hasattr(lib, "jps_ffi_api_version"):
    return None
  major, minor = ctypes.c_int(), ctypes.c_int()
  lib.jps_ffi_api_version(ctypes.byref(major), ctypes.byref(minor))
  return major.value, minor.value


def _variants_of(lib, kind: str, aux: bool = False, dbias: bool = False) -> tuple:
  """The distinct variants in one direction's table: those without (``aux`` False) or with the aux
  arguments (none where the library has no aux target); ``dbias``: the backward variants with the
  bias gradient kernel (none where the library has no such target)."""
  count, describe = getattr(lib, f"jps_num_{kind}_variants"), getattr(lib, f"jps_{kind}_variant")
  is_aux = getattr(lib, f"jps_{kind}_variant_aux", None)
  if aux and (is_aux is None or not hasattr(lib, f"jps_{kind}_aux_execute")):
    return ()
  has_dbias = getattr(lib, f"jps_{kind}_variant_dbias", None)
  if dbias and (has_dbias is None or not hasattr(lib, f"jps_{kind}_dbias_execute")):
    return ()
  count.restype = ctypes.c_int
  variants = []
  for i in range(count()):
    if is_aux is not None and (is_aux(i) != 0) != aux:  # 0 plain, 1 / 2 the mask / bias kind
      continue
    if dbias and has_dbias(i) != 1:
      continue
    vals = [ctypes.c_int() for _ in range(4)]
    if describe(i, *[ctypes.byref(x) for x in vals]) == 0:
      v = tuple(x.value for x in vals)
      if v not in variants:
        variants.append(v)
  return tuple(variants)


def _register(lib, kind: str, target: str, execute: str = "execute"):
  """Registers one FFI target: its kind's initialize handler (which loads the kind's modules, aux
  variants included) and the ``jps_<kind>_<execute>`` handler."""
  with _lock:
    jax.ffi.register_ffi_target(
        target,
        {"initialize": jax.ffi.pycapsule(getattr(lib, f"jps_{kind}_initialize")),
         "execute": jax.ffi.pycapsule(getattr(lib, f"jps_{kind}_{execute}"))},
        platform="CUDA",
    )


def _version(v: tuple[int, int]) -> str:
  return f"{v[0]}.{v[1]}"


@functools.lru_cache(maxsize=None)
def _load() -> Loaded:
  """The library, checked and its targets registered once; on any failure a ``Loaded`` without
  variants whose ``reason`` says what failed."""
  path = library_path()

  def unusable(reason, ffi_api=None):
    return Loaded(None, None, None, path, reason, ffi_api)

  if not path.is_file():
    if os.environ.get("JAX_PADSAFE_CUTE_LIB"):
      return unusable(f"JAX_PADSAFE_CUTE_LIB names {path}, which does not exist")
    return unusable(f"the kernel library was not built into this install (no file {path}; BUILD.md builds it)")
  try:
    lib = ctypes.CDLL(str(path))
  except OSError as e:  # e.g. "version `GLIBC_2.36' not found", "invalid ELF header", a missing dependency
    return unusable(f"the kernel library {path} cannot be loaded: {e}")
  ffi_api = library_ffi_api_version(lib)
  if ffi_api is None:
    return unusable(f"{path} does not export jps_ffi_api_version: not a jax_padsafe kernel library, or one "
                    f"from another version of jax_padsafe")
  runtime = runtime_ffi_api_version()
  if runtime is not None and (ffi_api[0] != runtime[0] or ffi_api[1] > runtime[1]):
    return unusable(f"the kernel library {path} was built against XLA FFI API {_version(ffi_api)}, which the "
                    f"running jaxlib {jax.lib.__version__} (FFI API {_version(runtime)}) cannot serve: upgrade "
                    f"jax and jaxlib, or rebuild the library against this jaxlib's FFI headers", ffi_api)
  missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
  if missing:
    return unusable(f"the kernel library {path} lacks {', '.join(missing)}: built from other sources than "
                    f"this jax_padsafe", ffi_api)
  forward, backward = (_variants_of(lib, _KINDS[d][0]) for d in ("forward", "backward"))
  if not forward:
    return unusable(f"the kernel library {path} holds no forward kernels (empty variant table)", ffi_api)
  forward_aux, backward_aux = (_variants_of(lib, _KINDS[d][0], aux=True) for d in ("forward", "backward"))
  backward_dbias = _variants_of(lib, "bwd", aux=True, dbias=True)
  try:
    for kind, target in _KINDS.values():
      _register(lib, kind, target)
    for (kind, _), target, variants in zip(_KINDS.values(), (FORWARD_AUX_TARGET, BACKWARD_AUX_TARGET),
                                           (forward_aux, backward_aux)):
      if variants:
        _register(lib, kind, target, "aux_execute")
    if backward_dbias:
      _register(lib, "bwd", BACKWARD_DBIAS_TARGET, "dbias_execute")
  except Exception as e:  # noqa: BLE001 - any registration error leaves the pure-JAX path
    return unusable(f"registering the kernel library's FFI targets failed: {type(e).__name__}: {e}", ffi_api)
  return Loaded(lib, forward, backward or None, path, None, ffi_api, forward_aux, backward_aux, backward_dbias)


def loaded() -> Loaded:
  """The loaded library (or why there is none).  Never raises."""
  try:
    return _load()
  except Exception as e:  # noqa: BLE001 - by contract this never raises
    return Loaded(None, None, None, None, f"loading the kernel library failed: {type(e).__name__}: {e}")


def _variants(direction: str):
  """The loaded variants of ``direction``, or None (no library, or not that direction). Never raises."""
  return getattr(loaded(), direction)


def library_available() -> bool:
  """True if the library was found and loaded and its forward target registered.  Never raises."""
  return _variants("forward") is not None


def backward_available() -> bool:
  """True if the library holds the backward kernels and their target is registered.  Never raises."""
  return _variants("backward") is not None


def unusable_reason() -> str:
  """Why the kernels are not used, for a call that needs them and finds no usable library."""
  # The loader's reason (None only where a caller overrides library_available for a loaded library).
  return loaded().reason or "the kernel library was not built into this install"


def cuda_backend_present() -> bool:
  """Whether jax has a CUDA backend (this initialises jax's backends, as the call at hand does)."""
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


def warn_unusable() -> None:
  """Warns, once per reason, that a call the kernels would run goes to the pure-JAX path because the
  library is missing or unusable. Only where jax has a CUDA backend: elsewhere no kernels are expected."""
  reason = loaded().reason
  if reason is None or reason in _warned or not cuda_backend_present():
    return
  _warned.add(reason)
  warnings.warn(f"jax_padsafe: {reason}. Until this is fixed, {FALLBACK_COST}; see docs/troubleshooting.md "
                f"and jax_padsafe.kernels_status().", KernelLibraryWarning, stacklevel=2)


def dbias_available(dtype, head_dim: int) -> bool:
  """Whether the loaded library computes the bias gradient on the kernels for this dtype and head dim (any
  arch: the handler names a missing one).  Never raises."""
  code = DTYPE_CODES.get(jnp.dtype(dtype))
  return any(d == code and h == head_dim for (_, d, h, _) in loaded().backward_dbias)


def built_variants(direction: str = "forward"):
  """``(arch, dtype, head_dim, softcap)`` tuples of the loaded library's kernels; empty without it."""
  available = library_available() if direction == "forward" else backward_available()
  variants = _variants(direction) if available else None
  if not variants:
    return ()
  inv = {v: k for k, v in DTYPE_CODES.items()}
  return tuple((ARCH_NAMES.get(a, str(a)), str(inv[d]), h, bool(c)) for a, d, h, c in variants)


def _built_head_dims(dt, cap: bool, aux: bool, direction: str):
  """The head dims the loaded library has kernels of ``direction`` for (this dtype, softcap or not, aux
  or not), sorted; ``DEFAULT_HEAD_DIMS`` without a library; a sentence when the library has no aux
  kernels at all."""
  available = library_available() if direction == "forward" else backward_available()
  variants = _variants(direction) if available else None
  if variants is None:
    return DEFAULT_HEAD_DIMS
  if aux:
    variants = getattr(loaded(), f"{direction}_aux")
    if not variants:
      what = "forward" if direction == "forward" else "backward"
      return (f"the kernel library has no {what} kernels for masks and biases "
              "(built with JPS_AUX=0, or from older sources)")
  code = DTYPE_CODES[dt]
  return tuple(sorted({h for (_, d, h, c) in variants if d == code and bool(c) == cap}))


def kernel_head_dim(*, dtype, head_dim: int, head_dim_v: int | None = None, softcap=None, aux: bool = False,
                    direction: str = "forward") -> int | None:
  """The compiled head dim the kernels run a call with these head dims at: the narrowest built one (the
  default build's without a library) at least as wide as Q/K's and V's, or None.

  Narrower operands are zero-padded to it: a zero column adds an exact 0 to every score and gives an
  output column of zeros (sliced off), so the results are those of the narrower problem. Never raises."""
  dt = jnp.dtype(dtype)
  if dt not in DTYPE_CODES:
    return None
  dims = _built_head_dims(dt, bool(softcap and softcap > 0), aux, direction)
  if isinstance(dims, str):
    return None
  need = max(head_dim, head_dim if head_dim_v is None else head_dim_v)
  return next((d for d in dims if d >= need), None)


def unsupported_reason(*, dtype, head_dim, num_heads, num_kv_heads, causal, window, softcap,
                       head_dim_v=None, aux: bool = False, direction: str = "forward", exact: bool = False):
  """None if the kernels of ``direction`` support this static combination, else a sentence why not.
  ``aux``: the call passes a mask or a bias (the aux variants, built without softcap only).
  ``exact``: the operands must have a built head dim themselves (the raw kernel entry points); otherwise
  any head dims up to the widest built one are supported, zero-padded to a built one (`kernel_head_dim`)."""
  del causal, window  # every variant has them
  # "the CuTe forward kernel supports ..." / "the CuTe backward kernels support ..."
  what, verb = ("forward kernel", "supports") if direction == "forward" else ("backward kernels", "support")
  dt = jnp.dtype(dtype)
  if dt not in DTYPE_CODES:
    return f"the CuTe {what} {verb} bfloat16 and float16 inputs, not {dt}"
  hv = head_dim if head_dim_v is None else head_dim_v
  if exact and hv != head_dim:
    return f"the CuTe {what} needs the same head dim for V as for Q/K (got {head_dim} and {hv})"
  if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
    return f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
  if num_heads > 65535:
    return f"the CuTe {what} {verb} at most 65535 query heads"
  if softcap is not None and softcap < 0:
    return "softcap must be >= 0"
  cap = bool(softcap and softcap > 0)
  if aux and cap:
    return f"the CuTe {what} {verb} a mask or bias without softcap only"
  dims = _built_head_dims(dt, cap, aux, direction)
  if isinstance(dims, str):
    return dims
  if (head_dim in dims) if exact else any(d >= max(head_dim, hv) for d in dims):
    return None
  built = library_available() if direction == "forward" else backward_available()
  kernels = "kernels" if direction == "forward" else "backward kernels"
  dims_text = (f"head dim {head_dim}" if hv == head_dim else f"head dims {head_dim} (Q/K) and {hv} (V)")
  if not built:
    return (f"the CuTe {what} {verb} head dims up to {max(dims)}"
            f"{f' (exactly {dims})' if exact else ''}, not {dims_text}")
  return (f"the built CuTe {kernels} have no {dt} variant for {dims_text}"
          f"{' with softcap' if cap else ''}{' with a mask or bias' if aux else ''} (built: {list(dims)})")


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
