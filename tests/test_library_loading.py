"""The kernel library's loader on the CPU: every way a library can be missing or unusable gives its
reason in ``kernels_status()``, and one ``KernelLibraryWarning`` where jax has a CUDA backend (here
pretended), none on a plain CPU host; ``attention_backends`` reads the lowered program."""

import warnings

import pytest

import jax
import jax.numpy as jnp

import jax_padsafe
from jax_padsafe._backends.cute import library

_ctypes = pytest.importorskip("_ctypes")
# A shared object that loads but is no kernel library: the ctypes extension module itself.
FOREIGN_SO = getattr(_ctypes, "__file__", None)


@pytest.fixture(autouse=True)
def _fresh_loader():
  """Each test loads the library afresh and may warn again; afterwards the real library is reloaded."""
  library._load.cache_clear()
  library._warned.clear()
  yield
  library._load.cache_clear()
  library._warned.clear()


def _point_at(monkeypatch, path):
  monkeypatch.setenv("JAX_PADSAFE_CUTE_LIB", str(path))


def _cuda_host(monkeypatch):
  monkeypatch.setattr(library, "cuda_backend_present", lambda: True)


def _cpu_host(monkeypatch):
  """Pretend jax has no CUDA backend (the tests also run on GPU machines)."""
  monkeypatch.setattr(library, "cuda_backend_present", lambda: False)


def _kernel_warnings(calls=2, dtype=jnp.bfloat16, **kw):
  """The KernelLibraryWarnings raised by ``calls`` eager calls the kernels could run (bf16, head dim 64)."""
  q = jnp.zeros((1, 16, 4, 64), dtype)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(calls):
      jax_padsafe.dot_product_attention(q, q, q, is_causal=True, **kw)
  return [w for w in caught if issubclass(w.category, jax_padsafe.KernelLibraryWarning)]


def _unusable(**expect):
  status = jax_padsafe.kernels_status()
  assert not status.loaded and jax_padsafe.kernels_available() == {"forward": False, "backward": False}
  assert status.forward_variants == status.backward_variants == 0 and status.archs == ()
  for field, value in expect.items():
    assert getattr(status, field) == value, status
  return status


def test_corrupted_file(monkeypatch, tmp_path):
  bad = tmp_path / "libjax_padsafe_kernels.so"
  bad.write_bytes(b"\x7fELF" + bytes(range(256)) * 4)
  _point_at(monkeypatch, bad)
  status = _unusable(path=str(bad), library_ffi_api=None)
  assert "cannot be loaded" in status.reason and str(bad) in status.reason
  _cpu_host(monkeypatch)
  assert _kernel_warnings() == []  # plain CPU host: no kernels expected, no warning
  _cuda_host(monkeypatch)
  (w,) = _kernel_warnings(calls=3)
  message = str(w.message)
  assert status.reason in message and "pure-JAX path, about 10x slower on a GPU" in message


def test_missing_file(monkeypatch, tmp_path):
  _point_at(monkeypatch, tmp_path / "absent.so")
  status = _unusable()
  assert "JAX_PADSAFE_CUTE_LIB names" in status.reason and "does not exist" in status.reason
  _cuda_host(monkeypatch)
  assert len(_kernel_warnings()) == 1


def test_never_built(monkeypatch, tmp_path):
  """A source checkout whose kernels were never built: its own wording, quiet on the CPU."""
  monkeypatch.delenv("JAX_PADSAFE_CUTE_LIB", raising=False)
  monkeypatch.setattr(library, "library_path", lambda: tmp_path / library.LIBRARY_NAME)
  status = _unusable()
  assert status.reason.startswith("the kernel library was not built into this install")
  _cpu_host(monkeypatch)
  assert _kernel_warnings() == []
  _cuda_host(monkeypatch)
  (w,) = _kernel_warnings()
  assert "not built into this install" in str(w.message)
  with pytest.raises(NotImplementedError, match="not built into this install"):
    _kernel_warnings(implementation="cute")


@pytest.mark.skipif(FOREIGN_SO is None, reason="_ctypes is built into this Python")
def test_not_a_kernel_library(monkeypatch):
  _point_at(monkeypatch, FOREIGN_SO)
  assert "does not export jps_ffi_api_version" in _unusable().reason
  # With a version (stubbed), the missing handlers and variant tables are named.
  monkeypatch.setattr(library, "library_ffi_api_version", lambda lib: (0, 3))
  monkeypatch.setattr(library, "runtime_ffi_api_version", lambda: (0, 3))
  library._load.cache_clear()
  reason = _unusable(library_ffi_api=(0, 3)).reason
  assert "lacks jps_fwd_initialize" in reason and "jps_num_bwd_variants" in reason


@pytest.mark.skipif(FOREIGN_SO is None, reason="_ctypes is built into this Python")
@pytest.mark.parametrize("lib_api, runtime_api", [((0, 5), (0, 3)), ((1, 0), (0, 5)), ((0, 3), (1, 0))])
def test_ffi_api_the_runtime_cannot_serve(monkeypatch, lib_api, runtime_api):
  """A newer minor or another major version is refused before registration (which would take the CUDA
  backend down), with both versions in the reason."""
  _point_at(monkeypatch, FOREIGN_SO)
  monkeypatch.setattr(library, "library_ffi_api_version", lambda lib: lib_api)
  monkeypatch.setattr(library, "runtime_ffi_api_version", lambda: runtime_api)
  registered = []
  monkeypatch.setattr(library, "_register", lambda *a: registered.append(a))
  status = _unusable(library_ffi_api=lib_api, jaxlib_ffi_api=runtime_api)
  assert f"XLA FFI API {lib_api[0]}.{lib_api[1]}" in status.reason
  assert f"FFI API {runtime_api[0]}.{runtime_api[1]})" in status.reason and "cannot serve" in status.reason
  assert registered == []
  _cuda_host(monkeypatch)
  (w,) = _kernel_warnings()
  assert "cannot serve" in str(w.message)


def test_runtime_ffi_api_version_matches_jaxlib():
  """Read from the running jaxlib's own header: jaxlib 0.10.2 serves XLA FFI API 0.3, 0.11.2 0.4, 0.12.0 and
  0.12.0.1 0.5."""
  known = {"0.10.2": (0, 3), "0.11.2": (0, 4), "0.12.0": (0, 5), "0.12.0.1": (0, 5)}
  version = library.runtime_ffi_api_version()
  assert version is not None and version[0] == 0
  if jax.lib.__version__ in known:
    assert version == known[jax.lib.__version__]


def test_calls_the_kernels_would_not_run_stay_quiet(monkeypatch, tmp_path):
  """float32 inputs and implementation="xla" never reach the kernels: no warning even on a CUDA host."""
  _point_at(monkeypatch, tmp_path / "absent.so")
  _cuda_host(monkeypatch)
  assert _kernel_warnings(dtype=jnp.float32) == []
  assert _kernel_warnings(implementation="xla") == []
  assert len(_kernel_warnings()) == 1


def test_built_library_reports_its_build(monkeypatch):
  """The real library, where this install has one: loaded, versions and the variant tables."""
  status = jax_padsafe.kernels_status()
  if not status.loaded:
    pytest.skip(f"no usable kernel library here: {status.reason}")
  assert status.reason is None and status.library_ffi_api <= status.jaxlib_ffi_api
  assert status.forward_variants > 0 and status.backward_variants > 0 and status.archs
  assert jax_padsafe.kernels_available() == {"forward": True, "backward": True}
  # Registration failing (e.g. a runtime that rejects the handlers) is a reason too.
  def reject(*args, **kwargs):
    raise RuntimeError("handler rejected")
  monkeypatch.setattr(jax.ffi, "register_ffi_target", reject)
  library._load.cache_clear()
  reason = _unusable(library_ffi_api=status.library_ffi_api).reason
  assert "registering the kernel library's FFI targets failed: RuntimeError: handler rejected" in reason


def test_attention_backends_reads_the_lowered_program(kernels_built):
  """On a CPU host the program runs on pure JAX; lowered for CUDA it calls the kernels, forward and backward."""
  q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)

  def loss(q, k, v):
    return jnp.sum(jax_padsafe.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))

  here = jax_padsafe.attention_backends(jax.grad(loss, (0, 1, 2)), q, q, q)
  on_gpu = jax.default_backend() == "gpu"  # a GPU host runs the kernels, any other host pure JAX
  assert (here.platform, here.forward, here.backward) == (jax.default_backend(), on_gpu, on_gpu)
  cuda = jax_padsafe.attention_backends(jax.grad(loss, (0, 1, 2)), q, q, q, platform="cuda")
  assert cuda.forward and cuda.backward
  assert str(cuda) == "forward on GPU kernels, backward on GPU kernels (cuda)"
  fwd_only = jax_padsafe.attention_backends(jax.jit(loss), q, q, q, platform="cuda")
  assert fwd_only.forward and not fwd_only.backward
  xla = jax_padsafe.attention_backends(
      lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, implementation="xla"), q, q, q, platform="cuda")
  assert not xla.forward and not xla.backward
