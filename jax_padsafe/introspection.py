"""What an install carries and where a program's attention runs.

* :func:`kernels_available`: which kernels (forward, backward) this install can run.
* :func:`kernels_status`: the GPU kernel library of this install: loaded or not and why, the XLA FFI
  API versions of the library and of the running jaxlib, the variants and architectures built.
* :func:`attention_backends`: whether a function's attention runs on the kernels, forward and
  backward, read off the program jax lowers for it (not from what the library could do).

A library that is present but unusable, or absent, on a machine where jax has a CUDA backend also
raises one :class:`KernelLibraryWarning` when a call the kernels would run falls back to pure JAX.
"""

from __future__ import annotations

import dataclasses
import re

import jax

from jax_padsafe._backends.cute import library
from jax_padsafe._backends.cute.library import KernelLibraryWarning


def kernels_available() -> dict:
  """Which GPU kernels this install carries: ``{"forward": bool, "backward": bool}``.

  True means the CuTe DSL kernel library was built into this install and loads; the kernels then
  run for supported calls on CUDA devices (sm_80 class and sm_90). It never raises.
  :func:`kernels_status` says why not, and what the library was built for.
  """
  return {"forward": library.library_available(), "backward": library.backward_available()}


@dataclasses.dataclass(frozen=True)
class KernelStatus:
  """The kernel library of this install (see :func:`kernels_status`)."""
  path: str | None                           # the file loaded, or looked for
  loaded: bool                               # loaded, checked and its FFI targets registered
  reason: str | None                         # why it is not used; None when loaded
  library_ffi_api: tuple[int, int] | None    # XLA FFI API (major, minor) the library was built against
  jaxlib_ffi_api: tuple[int, int] | None     # XLA FFI API of the running jaxlib
  forward_variants: int                      # (arch, dtype, head dim, softcap) combinations built
  backward_variants: int
  archs: tuple[str, ...]                     # architectures built, e.g. ("sm_80", "sm_90a")


def kernels_status() -> KernelStatus:
  """The kernel library's status; see :class:`KernelStatus`. Never raises, never warns, and does not
  initialise jax's backends."""
  lib = library.loaded()
  variants = (lib.forward or ()) + (lib.backward or ())
  archs = tuple(library.ARCH_NAMES.get(a, f"sm_{a}") for a in sorted({v[0] for v in variants}))
  return KernelStatus(
      path=None if lib.path is None else str(lib.path), loaded=lib.forward is not None, reason=lib.reason,
      library_ffi_api=lib.ffi_api, jaxlib_ffi_api=library.runtime_ffi_api_version(),
      forward_variants=len(lib.forward or ()), backward_variants=len(lib.backward or ()), archs=archs)


@dataclasses.dataclass(frozen=True)
class AttentionBackends:
  """Where the attention of one lowered program runs (see :func:`attention_backends`)."""
  platform: str    # the platform the program was lowered for
  forward: bool    # it calls the forward kernels (custom call jax_padsafe_fwd)
  backward: bool   # it calls the backward kernels (jax_padsafe_bwd); False also without a gradient

  def __str__(self):
    where = lambda on: "GPU kernels" if on else "pure JAX"
    return f"forward on {where(self.forward)}, backward on {where(self.backward)} ({self.platform})"


def attention_backends(fn, *args, platform: str | None = None, **kwargs) -> AttentionBackends:
  """Lowers ``jax.jit(fn)(*args, **kwargs)`` (without compiling or running it) and reports whether the
  program calls the forward and the backward kernels.

  ``args`` may be arrays or ``jax.ShapeDtypeStruct``\\ s. ``platform`` (e.g. ``"cuda"``) lowers for
  that platform instead of jax's default backend; lowering for CUDA works on a machine without a GPU.
  A jitted ``fn`` (also one with shardings) is lowered as it is.
  """
  traced = (fn if hasattr(fn, "trace") else jax.jit(fn)).trace(*args, **kwargs)
  if platform is None:
    text, platform = traced.lower().as_text(), jax.default_backend()
  else:
    text = traced.lower(lowering_platforms=(platform,)).as_text()
  targets = set(re.findall(r"stablehlo\.custom_call @(\w+)", text))
  return AttentionBackends(platform=platform, forward=library.FORWARD_TARGET in targets,
                           backward=library.BACKWARD_TARGET in targets)


__all__ = ["KernelLibraryWarning", "KernelStatus", "kernels_status", "AttentionBackends",
           "attention_backends"]
