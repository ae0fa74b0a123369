"""Boolean masks and additive biases on the kernels (the aux variants), forward and backward with dbias.

Every case runs the whole contract (``helpers.check_problem``): O, lse, dQ, dK, dV (and dbias) against the float64
oracle with the accuracy rule, exact zeros, and bitwise invariance under poison in every padded region, the mask's
and bias's cells outside the valid rectangle included (random flips of the mask, NaN / Inf / 1e30 / huge values
in the bias).  Shapes reach every edge of the loads (odd key counts 1, 7, 127, 129, 1000, every broadcast
pattern) and of the mask's block summary (hidden tiles at both ends of a tile row, hidden tiles inside it, fully
visible tiles, rows with no visible key).  ``tests/gpu/test_families.py`` runs this module on the SM80-class
family too.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers
from tests.gpu import cases
from tests.helpers import random_problem

pytestmark = cases.needs_kernels()


def _mask(kind, rng, b, n, t, s, q_len, kv_len):
  """Masks the way models build them (shapes broadcast over what they do not depend on)."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  if kind == "causal_padding":  # Flax: make_causal_mask & make_attention_mask(padding), [B, 1, T, S]
    keys = np.arange(s)[None, :] < np.asarray(kv_len)[:, None]
    return (j <= i)[None, None] & keys[:, None, None, :]
  if kind == "key_padding":  # [B, 1, 1, S]
    return (np.arange(s)[None, :] < np.asarray(kv_len)[:, None] - 3)[:, None, None, :]
  if kind == "random_per_head":  # [B, N, T, S], about 30% hidden
    return rng.random((b, n, t, s)) < 0.7
  if kind == "documents":  # block-diagonal documents with a causal mask inside, [1, 1, T, S]: hidden tiles
    doc_q, doc_k = i // 97, j // 97  # inside each tile row, visible tiles on both sides of them
    return ((doc_q == doc_k) & (j <= i))[None, None]
  if kind == "sparse_rows":  # some query rows see nothing, others a few keys far apart, [1, N, T, S]
    m = rng.random((1, n, t, s)) < 0.02
    m[:, :, ::5] = False
    return m
  raise ValueError(kind)


def _bias(kind, rng, b, n, t, s):
  if kind == "none":
    return None
  shape = {"f32_heads": (1, n, t, s), "full": (b, n, t, s), "shared": (1, 1, t, s), "per_key": (b, 1, 1, s)}[kind]
  bias = 2.0 * rng.standard_normal(shape)
  bias[rng.random(shape) < 0.05] = -np.inf  # -inf hides a key exactly like the mask
  return bias


@pytest.mark.parametrize("mask_kind", ["causal_padding", "key_padding", "random_per_head", "documents",
                                       "sparse_rows"])
@pytest.mark.parametrize("h", [64, 128], ids=lambda h: f"hd{h}")
def test_masks(h, mask_kind):
  rng = np.random.default_rng(h)
  b, t, s = 2, 300, 333
  q_len, kv_len = [300, 129], [333, 127]
  p = random_problem(rng, b=b, t=t, s=s, n=4, k=2, h=h, q_len=q_len, kv_len=kv_len)
  p.mask = _mask(mask_kind, rng, b, 4, t, s, q_len, kv_len)
  helpers.check_problem(p, jnp.bfloat16, "cute", seed=h, poisons=("nan", "huge", "-inf"))


@pytest.mark.parametrize("bias_kind", ["f32_heads", "full", "shared", "per_key"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["bias", "bias_and_mask"])
@pytest.mark.parametrize("dtype,h", [("bf16", 64), ("bf16", 80), ("bf16", 128), ("fp16", 256)],
                         ids=["bf16-hd64", "bf16-hd80", "bf16-hd128", "fp16-hd256"])
def test_biases(dtype, h, with_mask, bias_kind):
  """Biases of float32 and of the input dtype, with dbias (summed over the broadcast dimensions: on the bias
  gradient kernel, and for the per-key bias on the pure-JAX path)."""
  rng = np.random.default_rng(h + 7)
  b, t, s = 2, 129, 200
  q_len, kv_len = [129, 70], [200, 1]
  p = random_problem(rng, b=b, t=t, s=s, n=4, k=2, h=h, q_len=q_len, kv_len=kv_len, causal=with_mask)
  p.bias = _bias(bias_kind, rng, b, 4, t, s)
  if with_mask:
    p.mask = _mask("random_per_head", rng, b, 4, t, s, q_len, kv_len)
  bias_dtype = jnp.float32 if bias_kind == "f32_heads" else cases.DTYPES[dtype]
  p.bias = np.asarray(jnp.asarray(p.bias, bias_dtype).astype(jnp.float32))  # representable in bias_dtype
  helpers.check_problem(p, cases.DTYPES[dtype], "cute", seed=h, poisons=("nan", "1e30"), bias_dtype=bias_dtype)


@pytest.mark.parametrize("dtype,h", [("bf16", 64), ("bf16", 96), ("bf16", 128), ("fp16", 64), ("fp16", 128)],
                         ids=["bf16-hd64", "bf16-hd96", "bf16-hd128", "fp16-hd64", "fp16-hd128"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["bias", "bias_and_mask"])
def test_bias_over_many_key_tiles(dtype, h, with_mask):
  """A bias in the input dtype over many key tiles, where the Hopper forward (head dims up to 96) and dQ kernels
  stage each tile's bias in shared memory a key tile ahead: warpgroups whose rows end inside the tile or at its
  edge, key tiles partly past the length (read from global memory) before and after inner ones (staged), a
  sequence of exactly one query tile, and poison in the padding of the bias.  S = 906 (rows not 16-byte
  aligned) reads every tile from global memory.  Both dtypes: the Hopper dK/dV kernel reads a staged bf16
  bias with ldmatrix and a float16 one cell by cell, and tiles inside the valid rectangle take the backward's
  interior path."""
  rng = np.random.default_rng(h + 31)
  b, t, s = 3, 520, 906 if with_mask else 904
  q_len, kv_len = [520, 333, 128], [904, 517, 256]
  p = random_problem(rng, b=b, t=t, s=s, n=4, k=2, h=h, q_len=q_len, kv_len=kv_len, causal=with_mask)
  p.bias = _bias("full", rng, b, 4, t, s)
  if with_mask:
    p.mask = _mask("random_per_head", rng, b, 4, t, s, q_len, kv_len)
  dt = cases.DTYPES[dtype]
  p.bias = np.asarray(jnp.asarray(p.bias, dt).astype(jnp.float32))
  helpers.check_problem(p, dt, "cute", seed=h, poisons=("nan", "1e30"), bias_dtype=dt)


@pytest.mark.parametrize("h", [64, 128], ids=lambda h: f"hd{h}")
@pytest.mark.parametrize("with_mask", [False, True], ids=["bias", "bias_and_mask"])
def test_dbias_over_several_tiles_per_cta(h, with_mask):
  """dbias of a bias shared by the batch ([1, N, T, S]) with enough tiles (8 x 16 x 8 = 1024 of 128 x 64) that
  the Hopper dbias CTAs take three each, the last two CTAs two: the pipeline runs on across tiles, each tile
  reads its own bias and stores its own dbias.  Sequence 0 fills its buffer, so most of its tiles take the interior path (no selects),
  sequence 1's lengths end inside tiles (the general path); in sequence 0 a row whose every bias is -inf (a row
  the forward finds empty, inside an interior tile) and rows at -1e30 (a huge finite bias)."""
  rng = np.random.default_rng(h + 51)
  b, n, t, s = 2, 8, 1024, 1024
  q_len, kv_len = [1024, 700], [1024, 555]
  p = random_problem(rng, b=b, t=t, s=s, n=n, k=2, h=h, q_len=q_len, kv_len=kv_len, causal=with_mask)
  bias = 2.0 * rng.standard_normal((1, n, t, s))
  bias[0, :, 5, :] = -np.inf
  bias[0, :, 300:302, :] = -1e30
  p.bias = np.asarray(jnp.asarray(bias, jnp.bfloat16).astype(jnp.float32))
  if with_mask:
    p.mask = _mask("random_per_head", rng, b, n, t, s, q_len, kv_len)
  helpers.check_problem(p, jnp.bfloat16, "cute", seed=h, poisons=("nan", "1e30"), bias_dtype=jnp.bfloat16)


@pytest.mark.parametrize("s", [1, 7, 127, 129, 1000])
def test_odd_key_counts(s):
  """Any S: element loads of the mask and bias never straddle a row or the end of the tensor."""
  rng = np.random.default_rng(s)
  t = 77
  p = random_problem(rng, b=3, t=t, s=s, n=2, k=1, h=64, q_len=[77, 0, 40], kv_len=[s, s // 2, max(s - 1, 0)],
                     causal=True, bottom_right=True)
  p.mask = rng.random((3, 1, t, s)) < 0.8
  p.bias = np.asarray(jnp.asarray(rng.standard_normal((1, 2, t, s)), jnp.bfloat16).astype(jnp.float32))
  helpers.check_problem(p, jnp.bfloat16, "cute", seed=s, poisons=("nan", "huge"), bias_dtype=jnp.bfloat16)


@pytest.mark.parametrize("h", [64, 128], ids=lambda h: f"hd{h}")
def test_padding_cells_of_a_batch_shared_mask_move_no_tile_range(h):
  """A mask shared by the batch ([1, N, T, S]) whose cells past the lengths are flipped at random (the poisoned
  runs): its block summary counts only cells inside a valid rectangle, so no flipped cell widens a row of
  tiles' key range.  When it counted them, the widened range changed the first key tile the dQ kernels visit,
  whose valid rows give dQ's reference key (kernels/common/dq_shift.py), and dQ's rounding with it (found with
  hd80 on the SM80-class family by tests/gpu/test_fuzz.py)."""
  rng = np.random.default_rng(h + 1)
  t = s = 200
  p = random_problem(rng, b=2, t=t, s=s, n=2, k=1, h=h, q_len=[194, 0], kv_len=[194, 200], causal=True)
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  # Valid rows see keys below 150 only: the last key tiles hold nothing visible but padding cells.
  p.mask = np.broadcast_to((j <= i) & (j < 150), (1, 2, t, s)).copy()
  helpers.check_problem(p, jnp.bfloat16, "cute", seed=h, poisons=("nan", "inf", "huge"))


@pytest.mark.parametrize("value", [-1e30, float(np.finfo(np.float32).min)], ids=["1e30", "f32_min"])
def test_huge_finite_bias(value):
  """A finite bias however large is added, not a mask: rows whose every key carries it are a softmax over those
  keys in the forward and the backward (the kernels keep the row max and log-sum apart)."""
  rng = np.random.default_rng(3)
  b, t, s = 2, 130, 140
  p = random_problem(rng, b=b, t=t, s=s, n=4, k=2, h=128, q_len=[130, 60], kv_len=[140, 90], causal=True,
                     bottom_right=True)
  shape = (b, 4, t, s)
  kind = rng.integers(0, 3, size=shape[:3])[..., None]
  bias = np.where(kind == 0, value, np.where((kind == 1) & (rng.random(shape) < 0.5), value,
                                             0.5 * rng.standard_normal(shape)))
  p.bias = bias
  helpers.check_problem(p, jnp.bfloat16, "cute", seed=3, poisons=("nan",))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dbias_with_values_sharing_a_large_component(dtype):
  """dbias = P (dP - Delta) is a small difference of large terms when the values share a large component
  (v = 4 + N(0, 1)): Delta must be rowsum(P dP) of the P and dP the backward recomputes, not rowsum(dO O) of
  the output rounded to the input dtype (that rounding would be all of the difference)."""
  rng = np.random.default_rng(17)
  b, t, s = 3, 200, 260
  p = random_problem(rng, b=b, t=t, s=s, n=4, k=2, h=64, q_len=[200, 131, 7], kv_len=[260, 190, 260])
  p.v = 4.0 + p.v
  p.bias = np.asarray(jnp.asarray(rng.standard_normal((1, 4, t, s)), jnp.float32))
  helpers.check_problem(p, cases.DTYPES[dtype], "cute", seed=17, poisons=("nan",))


def test_lowers_to_aux_kernels_forward_and_backward():
  """The calls above run on the kernels both ways (no silent pure-JAX backward), and dbias work appears only
  when the bias is differentiated."""
  q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 80, 2, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 64, 80), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 1, 64, 80), jnp.bool_)

  def loss(q, k, v, bias, mask):
    return jax_padsafe.dot_product_attention(q, k, v, bias, mask=mask, implementation="cute").astype(
        jnp.float32).sum()

  def targets(f):
    return re.findall(r"custom_call_target=\"(\w+)\"", jax.jit(f).lower(q, k, k, bias, mask).as_text("hlo"))

  fwd = targets(loss)
  assert fwd.count("jax_padsafe_fwd_aux") == 1
  grads = targets(jax.grad(loss, (0, 1, 2)))
  assert "jax_padsafe_fwd_aux" in grads and "jax_padsafe_bwd_aux" in grads
  assert "jax_padsafe_bwd_dbias" not in grads
  assert targets(jax.grad(loss, (0, 1, 2, 3))).count("jax_padsafe_bwd_dbias") == 1


def test_mask_costs_what_lengths_cost_in_tiles():
  """A causal + key-padding mask gives the same results as is_causal with lengths (to the oracle's rule, not
  bitwise: the aux kernels form scores in natural units), here on a size where most tiles are skipped."""
  rng = np.random.default_rng(11)
  b, t, s = 2, 1024, 1024
  q_len, kv_len = [1024, 1000], [1024, 700]
  p = random_problem(rng, b=b, t=t, s=s, n=2, k=1, h=128, q_len=q_len, kv_len=kv_len)
  p.mask = _mask("causal_padding", rng, b, 2, t, s, q_len, kv_len)
  helpers.check_problem(p, jnp.bfloat16, "cute", seed=11, poisons=("nan",))
