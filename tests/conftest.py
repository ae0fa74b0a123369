"""Test configuration: every contract test runs once per implementation ("xla", and "cute" on a GPU)."""

import os

import pytest

# The suite runs on the CPU everywhere; fake several host devices for the sharding tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# On a GPU, outputs the kernel library does not memset start as NaN (ffi/common.h), so that a row no
# kernel writes fails the exact-zero checks rather than passing on what the allocator left.
os.environ.setdefault("JAX_PADSAFE_POISON_OUTPUTS", "1")
# On a GPU, JAX takes memory as it needs it rather than 75% up front: the GPU tests start further pytest
# processes (tests/gpu/test_families.py) and the large-tensor tests need most of the memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from tests import helpers  # noqa: E402  (after the environment above: it imports jax_padsafe)


def implementations():
  """The implementations: "xla" everywhere; "cute" marked ``gpu`` (``pytest -m gpu`` selects it) and skipped without a CUDA GPU
  and a built kernel library."""
  ready, why = helpers.kernels_ready()
  return ["xla", pytest.param("cute", marks=[pytest.mark.gpu, pytest.mark.skipif(not ready, reason=why)])]


def pytest_generate_tests(metafunc):
  if "impl" in metafunc.fixturenames:
    metafunc.parametrize("impl", implementations())


@pytest.fixture
def kernels_built(monkeypatch):
  """Pretend the kernel library is built (for CPU lowering tests of the kernel path): dispatch then
  judges support by the default build matrix, whatever this machine has built."""
  library = pytest.importorskip("jax_padsafe._backends.cute.library")
  monkeypatch.setenv("JAX_PADSAFE_CUTE_LIB", "/nonexistent/libjax_padsafe_kernels.so")
  library._load.cache_clear()
  monkeypatch.setattr(library, "library_available", lambda: True)
  monkeypatch.setattr(library, "backward_available", lambda: True)
  monkeypatch.setattr(library, "dbias_available", lambda dtype, head_dim: True)
  yield
  library._load.cache_clear()
