"""Backend dispatch: which ``Backend`` runs inside the shared ``custom_vjp``.

* ``"xla"``: the pure-JAX forward and backward (every platform, every feature), :mod:`.xla`.
* ``"cute"``: the CuTe DSL kernels through XLA FFI on CUDA devices, :mod:`.cute`
  (``lax.platform_dependent`` lowers the same call to the pure-JAX path on other platforms, so a
  jitted program stays portable). A feature combination the kernels do not support raises
  ``NotImplementedError``.
* ``None``: the kernels when they are built and support the call, else the pure-JAX path (with one
  ``KernelLibraryWarning`` on a CUDA host when only a missing or unusable library keeps a call off them).

Within the kernel backend, the backward runs on the backward kernels where they are built and
support the call, and is the pure-JAX blockwise backward otherwise.
"""

from __future__ import annotations

from jax_padsafe._backends import xla
from jax_padsafe._backends.cute import aux as cute_aux
from jax_padsafe._backends.cute import backend as cute
from jax_padsafe._backends.cute import library
from jax_padsafe._core.backend import Backend
from jax_padsafe._core.spec import AttentionSpec

BACKENDS = {"xla": xla.XLA, "cute": cute.CUTE}


def kernel_unsupported_reason(spec: AttentionSpec, query, key, *, bias, mask, problem=None, value=None):
  """``None`` if the GPU forward kernel can run this call, else why not (a sentence). ``value``:
  its head dim is checked (``None``: the same as the key's)."""
  if not library.library_available():
    return library.unusable_reason()
  return _call_unsupported_reason(spec, query, key, bias=bias, mask=mask, problem=problem, value=value)


def _call_unsupported_reason(spec: AttentionSpec, query, key, *, bias, mask, problem=None, value=None):
  """Why the kernels cannot run this call, whatever the library (the default build matrix without one).
  Sinks run on every kernel path (they join the kernels' results); ALiBi slopes, like a mask or a bias,
  on the aux kernels."""
  if problem is not None and problem.unsupported is not None:
    return problem.unsupported
  aux = bias is not None or mask is not None or spec.alibi
  if aux:
    reason = ("a mask, bias or ALiBi reaches the kernels through the attention functions only" if problem is None
              else cute_aux.unsupported_reason(problem, query, bias, mask))
    if reason is not None:
      return reason
  n, h = query.shape[-2], query.shape[-1]
  return library.unsupported_reason(
      dtype=query.dtype, head_dim=h, head_dim_v=h if value is None else value.shape[-1], num_heads=n,
      num_kv_heads=key.shape[-2],
      causal=spec.causal, window=spec.has_window, softcap=spec.softcap, aux=aux)


def note_fallback(spec: AttentionSpec, query, key, *, bias, mask, problem=None, value=None):
  """For a call going to the pure-JAX path under ``implementation=None``: if only the missing or
  unusable library keeps it off the kernels, warn once (``library.warn_unusable``, CUDA hosts only)."""
  if (not library.library_available()
      and _call_unsupported_reason(spec, query, key, bias=bias, mask=mask, problem=problem,
                                   value=value) is None):
    library.warn_unusable()


def choose_backend(implementation, spec: AttentionSpec, problem, query, key, *, bias,
                   mask, value=None) -> Backend:
  """The ``Backend`` for this call (see the module docstring for the rules)."""
  if implementation == "xla":
    return BACKENDS["xla"]
  reason = kernel_unsupported_reason(spec, query, key, bias=bias, mask=mask, problem=problem, value=value)
  if reason is None:
    return BACKENDS["cute"]
  if implementation == "cute":
    raise NotImplementedError(f'implementation="cute" cannot run this call: {reason}. '
                              'Use implementation=None to fall back to the pure-JAX path.')
  note_fallback(spec, query, key, bias=bias, mask=mask, problem=problem, value=value)
  return BACKENDS["xla"]
