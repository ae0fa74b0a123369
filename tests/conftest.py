"""Test configuration: every contract test runs once per available implementation."""

import os

import jax
import pytest

# The suite runs on the CPU everywhere; fake several host devices for the sharding tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# On a GPU, outputs the kernel library does not memset start as NaN (ffi/jps_zero_rows.h), so that a row no
# kernel writes fails the exact-zero checks rather than passing on what the allocator left.
os.environ.setdefault("JAX_PADSAFE_POISON_OUTPUTS", "1")


def _gpu_present():
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def _cute_ready():
  if not _gpu_present():
    return False, "no CUDA GPU present"
  from jax_padsafe import _backends
  ops = _backends._kernel_ops()
  if ops is None or not ops.library_available():
    return False, "kernel library not built"
  return True, ""


def implementations():
  ready, why = _cute_ready()
  return ["xla", pytest.param("cute", marks=pytest.mark.skipif(not ready, reason=why))]


def pytest_generate_tests(metafunc):
  if "impl" in metafunc.fixturenames:
    metafunc.parametrize("impl", implementations())


@pytest.fixture
def kernels_built(monkeypatch):
  """Pretend the kernel library is built (for CPU lowering tests of the kernel path): dispatch then
  judges support by the default build matrix, whatever this machine has built."""
  cute = pytest.importorskip("jax_padsafe._cute.ops")
  bwd = pytest.importorskip("jax_padsafe._cute.bwd_ops")
  monkeypatch.setenv("JAX_PADSAFE_CUTE_LIB", "/nonexistent/libjax_padsafe_kernels.so")
  cute._load.cache_clear()
  monkeypatch.setattr(cute, "library_available", lambda: True)
  bwd._load.cache_clear()
  monkeypatch.setattr(bwd, "backward_available", lambda: True)
  yield
  cute._load.cache_clear()
  bwd._load.cache_clear()
