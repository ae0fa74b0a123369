"""The contract on the packed (variable-length) layout: tails past cu_seqlens[-1], gaps between
used rows and the next sequence (seqused), empty sequences; and packed == padded equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers


CASES = {
    # caps_q, used_q, caps_k, used_k
    "gaps": ([9, 14, 1, 7], [9, 10, 0, 3], [12, 5, 3, 8], [7, 5, 2, 8]),
    "empty_seqs": ([0, 6, 0, 5], [0, 6, 0, 5], [4, 0, 0, 5], [4, 0, 0, 5]),
    "irregular": ([1, 127, 129], [1, 127, 129], [129, 1, 127], [129, 1, 127]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["full", "causal_tl", "causal_br", "window_softcap"])
def test_packed_contract(impl, case, mode):
  rng = np.random.default_rng(hash((case, mode)) % 2**32)
  kw = dict(full={}, causal_tl=dict(causal=True), causal_br=dict(causal=True, bottom_right=True),
            window_softcap=dict(window=(4, 2), softcap=3.0))[mode]
  d = helpers.build_packed(rng, *CASES[case], **kw)
  helpers.contract_packed(d, helpers.dtype_for(impl, jnp.float32), impl, rng)


DEGENERATE = {
    # caps_q, used_q, caps_k, used_k: nothing to compute anywhere
    "no_queries": ([0, 0, 0, 0], [0, 0, 0, 0], [5, 130, 0, 9], [5, 100, 0, 9]),
    "slots_unused": ([6, 130, 3], [0, 0, 0], [5, 130, 9], [5, 130, 9]),
    "no_keys": ([7, 129, 0, 2], [7, 129, 0, 2], [0, 0, 0, 0], [0, 0, 0, 0]),
    "nothing": ([0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]),
}


@pytest.mark.parametrize("bounds", ["tight", "loose"])
@pytest.mark.parametrize("case", list(DEGENERATE))
def test_degenerate_packed_batches(impl, case, bounds):
  """Packed batches with no work: no query row, every slot unused, no key row, or nothing at all; with the
  bounds at the longest slot, or left at their default (the packed length, so the kernels take their compact
  schedules and every tile they claim is a hole).  All outputs are still written (exact zeros, lse -inf for
  valid rows without keys) and no padding value reaches them."""
  rng = np.random.default_rng(hash((case, bounds)) % 2**32)
  for causal in (False, True):
    d = helpers.build_packed(rng, *DEGENERATE[case], causal=causal, bottom_right=causal)
    d["loose_bounds"] = bounds == "loose"
    helpers.contract_packed(d, helpers.dtype_for(impl, jnp.float32), impl, rng)


def test_packed_equals_padded(impl):
  """The same sequences through varlen_attention and dot_product_attention agree."""
  rng = np.random.default_rng(5)
  d = helpers.build_packed(rng, [8, 13, 5], [8, 13, 5], [10, 4, 9], [10, 4, 9], tail_q=0, tail_k=0, causal=True,
            bottom_right=True)
  p = d["problem"]
  dt = helpers.dtype_for(impl, jnp.float32)
  packed = jax_padsafe.varlen_attention(
      jnp.asarray(d["q"], dt), jnp.asarray(d["k"], dt),
      jnp.asarray(d["v"], dt), jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"]),
      is_causal=True, causal_alignment="bottom_right", implementation=impl)
  padded = jax_padsafe.dot_product_attention(
      jnp.asarray(p.q, dt), jnp.asarray(p.k, dt), jnp.asarray(p.v, dt),
      query_seq_lengths=jnp.asarray(p.q_len), key_value_seq_lengths=jnp.asarray(p.kv_len),
      is_causal=True, causal_alignment="bottom_right", implementation=impl)
  tol = 2e-6 if dt == jnp.float32 else 1e-2
  np.testing.assert_allclose(
      np.asarray(packed, np.float32),
      helpers.packed_from_padded(np.asarray(padded, np.float32), d["cu_q"], d["used_q"], len(d["q"])),
      atol=tol, rtol=tol)


def test_traced_offsets_past_max_seqlen_are_padding(impl):
  """Under jit a max_seqlen smaller than a sequence cannot raise (the offsets are traced): the rows
  past the bound are padding in every implementation, bitwise the same as declaring them padding with
  seqused, whatever they hold."""
  rng = np.random.default_rng(11)
  caps_q, caps_k, bound_q, bound_k = [9, 14, 5], [12, 5, 10], 8, 6
  d = helpers.build_packed(rng, caps_q, np.minimum(caps_q, bound_q), caps_k, np.minimum(caps_k, bound_k), causal=True)
  dtype = helpers.dtype_for(impl, jnp.float32)
  total_q = len(d["valid_q"])
  n, h = d["q"].shape[1:]
  d_out = rng.standard_normal((total_q, n, h))
  d_lse = rng.standard_normal((n, total_q))
  try:
    declared = helpers.run_packed(d, dtype, helpers.make_packed_runner(d, impl), "zero", rng, d_out, d_lse)
  except NotImplementedError as e:
    if impl == "cute":
      pytest.skip(str(e))
    raise
  q, k, v, do = (jnp.asarray(helpers.poison_rows(x[None], valid[None], "nan", rng)[0], dtype)
                 for x, valid in ((d["q"], d["valid_q"]), (d["k"], d["valid_k"]), (d["v"], d["valid_k"]),
                                  (d_out, d["valid_q"])))
  dl = jnp.asarray(np.where(d["valid_q"][None], d_lse, np.nan), jnp.float32)

  @jax.jit
  def f(q, k, v, do, dl, cu_q, cu_k):
    (o, lse), vjp = jax.vjp(lambda q, k, v: jax_padsafe.varlen_attention(
        q, k, v, cu_q, cu_k, max_seqlen_q=bound_q, max_seqlen_k=bound_k, is_causal=True, return_lse=True,
        implementation=impl), q, k, v)
    return (o, lse) + vjp((do, dl))

  traced = dict(zip(("out", "lse", "dq", "dk", "dv"),
                    f(q, k, v, do, dl, jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"]))))
  assert not np.all(declared["out"] == 0)
  for name in declared:
    helpers.assert_bitwise_equal(np.asarray(traced[name]), declared[name], f"traced bound: {name}")
  # Concrete offsets: the same bound is an error.
  with pytest.raises(ValueError, match="max_seqlen_q"):
    jax_padsafe.varlen_attention(q, k, v, jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"]),
                                 max_seqlen_q=bound_q, max_seqlen_k=bound_k, implementation=impl)
