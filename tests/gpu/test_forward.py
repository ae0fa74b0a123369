"""The forward kernels on a GPU, forward-only calls: the schedules only the forward has (several query tiles per
CTA), long sequences, vmap, and the test hook every exact-zero check of the GPU tests relies on.  The whole
contract (oracle, exact zeros, bitwise poison invariance, dirty memory) through ``varlen_attention`` with
``implementation="cute"``.  The forward-and-backward matrix of every dtype, head dim and feature set is
``test_backward.py``.

About 70 s on an H100.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers
from tests.gpu import cases
from tests.gpu.cases import DTYPES

pytestmark = cases.needs_kernels()


@pytest.mark.parametrize("feature", ["plain", "causal_br", "window_causal_br", "softcap_causal"])
@pytest.mark.parametrize("h", [64, 96, 128], ids=lambda h: f"hd{h}")
def test_multitile(h, feature):
  """Several query tiles per CTA (the Hopper forward's persistent schedule), bf16."""
  d = cases.packed_case(h, cases.MULTITILE_LAYOUT, h, feature)
  helpers.check_packed(d, jnp.bfloat16, "cute", np.random.default_rng(h), grads=False, poisons=("nan", "huge"),
                       dirty=True)


@pytest.mark.parametrize("feature", ["plain", "causal_br", "causal_tl"])
@pytest.mark.parametrize("dtype,h", [("bf16", 64), ("bf16", 128), ("fp16", 256)], ids=["bf16-hd64", "bf16-hd128",
                                                                                        "fp16-hd256"])
def test_long_sequences(dtype, h, feature):
  """~4k-token sequences (GQA 7 over one kv head): hundreds of key tiles per query tile."""
  d = cases.packed_case(h, cases.LONG_LAYOUT, h, feature)
  helpers.check_packed(d, DTYPES[dtype], "cute", np.random.default_rng(h), grads=False, poisons=("nan",))


def test_vmap_is_sequential_calls():
  """vmap over a stacked query equals the per-slice calls bitwise (the kernel call is batched sequentially)."""
  d = helpers.build_packed(np.random.default_rng(0), [6, 130], [5, 130], [7, 131], [7, 129], tail_q=3, tail_k=3,
                           n=8, k=2, h=128, causal=True, bottom_right=True, scale=0.1)
  q = jnp.asarray(np.stack([d["q"], -0.5 * d["q"]]), jnp.bfloat16)
  k, v = jnp.asarray(d["k"], jnp.bfloat16), jnp.asarray(d["v"], jnp.bfloat16)
  kw = helpers.packed_kwargs(d, "cute", return_lse=True)
  f = lambda q: jax_padsafe.varlen_attention(q, k, v, jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"]), **kw)  # noqa: E731
  stacked = jax.jit(jax.vmap(f))(q)
  for i in range(2):
    alone = jax.jit(f)(q[i])
    for name, a, b in zip(("out", "lse"), stacked, alone):
      helpers.assert_bitwise_equal(np.asarray(a[i]), np.asarray(b), f"vmap slice {i}: {name}")


def test_poison_hook_is_active():
  """The premise of every exact-zero check here: with JAX_PADSAFE_POISON_OUTPUTS=1 (tests/conftest.py) outputs
  the library does not memset start as NaN, so a row no kernel writes fails instead of passing on whatever the
  allocator left.  A call that falsely promises ``rows_covered`` on a layout with a tail makes the sm_90a
  forward's handler skip both the memset and the row zeroing: the tail of o must come back NaN.  The SM80-class
  family memsets its outputs, so there (JAX_PADSAFE_SM90=0, or another GPU) the tail must be 0."""
  from jax_padsafe._backends.cute.forward import flash_forward  # the only way to make that false promise
  d = helpers.build_packed(np.random.default_rng(1), [51, 130], [50, 130], [70, 131], [70, 129], tail_q=9,
                           tail_k=9, n=8, k=2, h=128)
  meta = [jnp.asarray(d[x]) for x in ("cu_q", "cu_k", "used_q", "used_k")]
  o, _ = jax.jit(lambda q, k, v: flash_forward(
      q, k, v, *meta, max_seqlen_q=130, max_seqlen_k=131, scale=0.1, causal=False, bottom_right=False,
      window_left=-1, window_right=-1, softcap=0.0, rows_covered=True))(
          *(jnp.asarray(d[x], jnp.bfloat16) for x in ("q", "k", "v")))
  tail = np.asarray(o.astype(jnp.float32))[int(d["cu_q"][-1]):]
  hooked = os.environ.get("JAX_PADSAFE_POISON_OUTPUTS") == "1"
  if cases.sm90_family_active():
    assert hooked, "tests/conftest.py sets JAX_PADSAFE_POISON_OUTPUTS=1"
    assert np.all(np.isnan(tail)), "poison hook inactive: rows no kernel writes are not NaN"
  else:
    assert np.all(tail == 0), "the SM80-class forward memsets o: its tail rows must be 0"
