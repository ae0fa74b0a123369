"""API behaviour: transformations (jit, grad, vmap, checkpoint), the differentiable lse, bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers, oracle


def _inputs(seed=0, b=2, t=12, s=15, n=4, k=2, h=None, dtype=jnp.float32, impl="xla"):
  """Random inputs; for the kernels in a dtype and head dim they support."""
  rng = np.random.default_rng(seed)
  dtype = helpers.dtype_for(impl, dtype)
  h = h or (64 if impl == "cute" else 16)
  return (jnp.asarray(rng.standard_normal((b, t, n, h)), dtype),
          jnp.asarray(rng.standard_normal((b, s, k, h)), dtype),
          jnp.asarray(rng.standard_normal((b, s, k, h)), dtype))


def test_jit_grad_vmap_checkpoint_agree(impl):
  q, k, v = _inputs(impl=impl)
  q_len = jnp.array([12, 5], jnp.int32)
  kv_len = jnp.array([9, 15], jnp.int32)

  def loss(q, k, v, q_len, kv_len):
    out, lse = jax_padsafe.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
        return_lse=True, implementation=impl)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * 0.1)

  eager = jax.grad(loss, (0, 1, 2))(q, k, v, q_len, kv_len)
  jitted = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, q_len, kv_len)
  ckpt = jax.jit(jax.grad(jax.checkpoint(loss), (0, 1, 2)))(q, k, v, q_len, kv_len)
  # vmap over the batch: per-example calls with a batch of one.
  per_example = jax.vmap(
      lambda q, k, v, ql, kl: jax.grad(loss, (0, 1, 2))(q[None], k[None], v[None], ql[None], kl[None]))
  vmapped = [x[:, 0] for x in per_example(q, k, v, q_len, kv_len)]
  tol = 1e-6 if q.dtype == jnp.float32 else 2e-2
  for a, b, c, d in zip(eager, jitted, ckpt, vmapped):
    chex.assert_trees_all_close(a, b, atol=tol)
    chex.assert_trees_all_close(a, c, atol=tol)
    chex.assert_trees_all_close(a, d, atol=tol)
    assert np.all(np.isfinite(np.asarray(a)))


def test_vmap_over_extra_leading_axis(impl):
  q, k, v = _inputs(impl=impl)
  stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
  f = lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, implementation=impl)
  out = jax.vmap(f)(*stacked)
  tol = 1e-6 if q.dtype == jnp.float32 else 1e-2
  chex.assert_trees_all_close(out[0], f(q, k, v), atol=tol)
  chex.assert_trees_all_close(out[1], f(q * 0.5, k * 0.5, v * 0.5), atol=tol)


def test_lse_gradient_matches_oracle(impl):
  """lse is differentiable: the gradient of sum(lse * w) matches the float64 formulas."""
  rng = np.random.default_rng(3)
  p = helpers.random_problem(rng, b=2, t=10, s=13, q_len=[10, 4], kv_len=[13, 6], causal=True)
  w = rng.standard_normal((2, 4, 10))
  kw = helpers.api_kwargs(p, impl)
  dtype = helpers.dtype_for(impl, jnp.float32)
  g = jax.grad(lambda q, k, v: jnp.sum(jnp.where(
      jnp.isfinite(l := jax_padsafe.dot_product_attention(q, k, v, return_lse=True, **kw)[1]),
      l, 0) * w), (0, 1, 2))(*(jnp.asarray(x, dtype) for x in (p.q, p.k, p.v)))
  ref, naive = oracle.expected(p, dtype, np.zeros(p.q.shape), w)
  ours = dict(zip(("dq", "dk", "dv"), (np.asarray(x, np.float64) for x in g)))
  oracle.assert_close(ours, ref, naive, dtype, ["dq", "dk", "dv"])


def test_unbatched_rank3_inputs(impl):
  q, k, v = _inputs(b=1, impl=impl)
  out3 = jax_padsafe.dot_product_attention(q[0], k[0], v[0], is_causal=True, implementation=impl)
  out4 = jax_padsafe.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  chex.assert_trees_all_equal(out3, out4[0])


def test_traced_lengths_are_clamped():
  q, k, v = _inputs()
  f = jax.jit(lambda ql, kl: jax_padsafe.dot_product_attention(
      q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, implementation="xla"))
  clamped = f(jnp.array([99, -3], jnp.int32), jnp.array([-1, 400], jnp.int32))
  expect = f(jnp.array([12, 0], jnp.int32), jnp.array([0, 15], jnp.int32))
  chex.assert_trees_all_equal(clamped, expect)
  assert np.all(np.asarray(clamped) == 0)  # batch 0 has no keys, batch 1 no queries


def test_scale_and_default_scale():
  q, k, v = _inputs()
  a = jax_padsafe.dot_product_attention(q, k, v)
  b = jax_padsafe.dot_product_attention(q, k, v, scale=1 / 4.0)
  chex.assert_trees_all_close(a, b, atol=1e-7)


def test_softcap_zero_means_none():
  q, k, v = _inputs()
  chex.assert_trees_all_equal(jax_padsafe.dot_product_attention(q, k, v, softcap=0.0),
                              jax_padsafe.dot_product_attention(q, k, v))


def test_cute_unsupported_combination_raises():
  q, k, v = _inputs()
  with pytest.raises(NotImplementedError, match="cute"):
    jax_padsafe.dot_product_attention(q, k, v, mask=jnp.ones((1, 1, 12, 15), bool),
                                      implementation="cute")


BAD_CALLS = [
    (lambda q, k, v: jax_padsafe.dot_product_attention(q[0, 0], k, v), ValueError, "rank"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v[:, :3]), ValueError, "value shape"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q[..., :3, :], k, v), ValueError, "multiple"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q[..., :8], k, v), ValueError, "head dim"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q[:1], k, v), ValueError, "batch"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q.astype(jnp.int32), k, v), TypeError, "dtype"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q.astype(jnp.bfloat16), k, v), TypeError, "share"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, implementation="cudnn"), ValueError,
     "implementation"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, causal_alignment="left"), ValueError,
     "causal_alignment"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([3])),
     ValueError, "query_seq_lengths"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([3, 13])),
     ValueError, r"\[0, 12\]"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([-1, 2])),
     ValueError, "key_value_seq_lengths"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([1.0, 2.0])),
     TypeError, "integer"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, bias=jnp.zeros((2, 3, 12, 15))),
     ValueError, "bias"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, mask=jnp.zeros((2, 4, 12, 15))),
     TypeError, "mask"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, local_window_size=(1, 2, 3)), ValueError,
     "local_window_size"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, softcap=-1.0), ValueError, "softcap"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(
        q, k, v, query_segment_ids=jnp.zeros((2, 12), jnp.int32)), ValueError, "together"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(
        q, k, v, query_segment_ids=jnp.zeros((2, 11), jnp.int32),
        key_value_segment_ids=jnp.zeros((2, 15), jnp.int32)), ValueError, "query_segment_ids"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 5, 12]),
                                                  jnp.array([0, 15])), ValueError, "cu_seqlens_k"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 9, 5]),
                                                  jnp.array([0, 5, 15])), ValueError, "non-decreasing"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 5, 13]),
                                                  jnp.array([0, 5, 15])), ValueError, "cu_seqlens_q"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([[0, 5]]),
                                                  jnp.array([0, 5])), ValueError, "cu_seqlens_q"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 5, 12]),
                                                  jnp.array([0, 5, 15]), seqused_q=jnp.array([6, 1])),
     ValueError, "seqused_q"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 5, 12]),
                                                  jnp.array([0, 5, 15]), max_seqlen_q=4), ValueError,
     "max_seqlen_q"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 5, 12]),
                                                  jnp.array([0, 5, 15]), max_seqlen_k=2 ** 31), ValueError,
     "max_seqlen_k"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q, k, v, jnp.array([0, 5]), jnp.array([0, 5])),
     ValueError, "rank 3"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, return_lse="yes"), TypeError, "return_lse"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, block_k=True), ValueError, "block_k"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, local_window_size=(2.5, 1)), ValueError,
     "local_window_size"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, local_window_size=(True, 2)), ValueError,
     "local_window_size"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(q, k, v, scale=True), TypeError, "scale"),
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 12]), jnp.array([0, 15]),
                                                  deterministic=1), TypeError, "deterministic"),
    # 64-bit values past int32 are an error, not wrapped into range (2**33 would wrap to the valid 0).
    (lambda q, k, v: jax_padsafe.varlen_attention(q[0], k[0], v[0], np.array([0, 5, 2 ** 33], np.int64),
                                                  jnp.array([0, 5, 15])), ValueError, "cu_seqlens_q.*int32"),
    (lambda q, k, v: jax_padsafe.dot_product_attention(
        q, k, v, key_value_seq_lengths=np.array([2 ** 32 + 3, 2], np.int64)), ValueError,
     "key_value_seq_lengths.*int32"),
]


@pytest.mark.parametrize("call,exc,match", BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_bad_input_raises_clear_error(call, exc, match):
  q, k, v = _inputs()
  with pytest.raises(exc, match=match):
    call(q, k, v)


def test_deterministic_gradients_are_bitwise_reproducible(impl):
  q, k, v = _inputs(impl=impl)
  q_len = jnp.array([12, 7], jnp.int32)

  @jax.jit
  def grads(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(jax_padsafe.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=q_len, deterministic=True,
        implementation=impl).astype(jnp.float32) ** 2), (0, 1, 2))(q, k, v)

  first = grads(q, k, v)
  for _ in range(3):
    for a, b in zip(first, grads(q, k, v)):
      helpers.assert_bitwise_equal(np.asarray(a), np.asarray(b), "repeated deterministic gradient")


def test_window_past_int32_is_unbounded(impl):
  """A window side of 2**31 - 1 or more reaches every position: the same result as an unbounded side
  (not an overflow in the int32 kernel arguments)."""
  q, k, v = _inputs(impl=impl)
  kw = dict(implementation=impl, query_seq_lengths=jnp.array([12, 7]), key_value_seq_lengths=jnp.array([9, 15]))
  try:
    huge = jax_padsafe.dot_product_attention(q, k, v, local_window_size=(2 ** 40, 2), **kw)
  except NotImplementedError as e:
    if impl == "cute":
      pytest.skip(str(e))
    raise
  unbounded = jax_padsafe.dot_product_attention(q, k, v, local_window_size=(None, 2), **kw)
  bounded = jax_padsafe.dot_product_attention(q, k, v, local_window_size=(1, 2), **kw)
  helpers.assert_bitwise_equal(np.asarray(huge), np.asarray(unbounded), "window 2**40 vs unbounded")
  assert not np.array_equal(np.asarray(huge), np.asarray(bounded))


def test_lengths_as_sequences_with_traced_entries():
  """Lengths and offsets given as Python lists, some entries traced under jit, work as arrays do."""
  q, k, v = _inputs()
  want = jax_padsafe.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([5, 3]))
  got = jax.jit(lambda n: jax_padsafe.dot_product_attention(q, k, v, query_seq_lengths=[n, 3]))(5)
  helpers.assert_bitwise_equal(np.asarray(got), np.asarray(want), "traced list lengths")
  want = jax_padsafe.varlen_attention(q[0], k[0], v[0], jnp.array([0, 12]), jnp.array([0, 15]))
  got = jax.jit(lambda n: jax_padsafe.varlen_attention(q[0], k[0], v[0], [0, n], [0, 15]))(12)
  helpers.assert_bitwise_equal(np.asarray(got), np.asarray(want), "traced list offsets")
