"""The contract on the packed (variable-length) layout: tails past cu_seqlens[-1], gaps between
used rows and the next sequence (seqused), empty sequences; and packed == padded equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_padsafe
from tests import helpers, oracle


def build(rng, caps_q, used_q, caps_k, used_k, *, tail_q=3, tail_k=5, n=4, k=2, h=64, **kw):
  """A packed problem plus the padded oracle problem holding the same valid data."""
  caps_q, used_q, caps_k, used_k = map(np.asarray, (caps_q, used_q, caps_k, used_k))
  cu_q = np.concatenate([[0], np.cumsum(caps_q)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(caps_k)]).astype(np.int32)
  total_q, total_k = cu_q[-1] + tail_q, cu_k[-1] + tail_k
  q = rng.standard_normal((total_q, n, h))
  kk = rng.standard_normal((total_k, k, h))
  v = rng.standard_normal((total_k, k, h))
  b, t, s = len(caps_q), max(1, caps_q.max()), max(1, caps_k.max())
  pq, pk, pv = np.zeros((b, t, n, h)), np.zeros((b, s, k, h)), np.zeros((b, s, k, h))
  for i in range(b):
    pq[i, :used_q[i]] = q[cu_q[i]:cu_q[i] + used_q[i]]
    pk[i, :used_k[i]] = kk[cu_k[i]:cu_k[i] + used_k[i]]
    pv[i, :used_k[i]] = v[cu_k[i]:cu_k[i] + used_k[i]]
  prob = oracle.Problem(q=pq, k=pk, v=pv, q_len=used_q.astype(np.int32),
                        kv_len=used_k.astype(np.int32), **kw)
  valid_q = np.zeros(total_q, bool)
  valid_k = np.zeros(total_k, bool)
  for i in range(b):
    valid_q[cu_q[i]:cu_q[i] + used_q[i]] = True
    valid_k[cu_k[i]:cu_k[i] + used_k[i]] = True
  return dict(q=q, k=kk, v=v, cu_q=cu_q, cu_k=cu_k, used_q=used_q, used_k=used_k,
              valid_q=valid_q, valid_k=valid_k, problem=prob)


def packed_from_padded(x, cu, used, total):
  """[B, L, ...] padded -> [total, ...] packed (zeros outside the used rows)."""
  out = np.zeros((total,) + x.shape[2:], x.dtype)
  for i in range(len(used)):
    out[cu[i]:cu[i] + used[i]] = x[i, :used[i]]
  return out


def packed_kwargs(d, impl, **kw):
  """`varlen_attention` keyword arguments for a problem from :func:`build` (cu_seqlens apart).  The
  sequence-length bounds are the longest slots, or left at their default (the packed length) where the
  problem says ``loose_bounds``."""
  p = d["problem"]
  bounds = {} if d.get("loose_bounds") else dict(max_seqlen_q=int(p.q.shape[1]), max_seqlen_k=int(p.k.shape[1]))
  return dict(seqused_q=jnp.asarray(d["used_q"], jnp.int32), seqused_k=jnp.asarray(d["used_k"], jnp.int32),
              is_causal=p.causal, softcap=p.softcap,
              causal_alignment="bottom_right" if p.bottom_right else "top_left",
              local_window_size=None if p.window is None else tuple(-1 if w is None else w for w in p.window),
              implementation=impl, **bounds, **kw)


def run_packed(d, dtype, impl, poison, rng, d_out, d_lse, **kw):
  args = packed_kwargs(d, impl, return_lse=True, **kw)
  qv, kv = d["valid_q"][None], d["valid_k"][None]
  q = jnp.asarray(helpers.poison_rows(d["q"][None], qv, poison, rng)[0], dtype)
  k = jnp.asarray(helpers.poison_rows(d["k"][None], kv, poison, rng)[0], dtype)
  v = jnp.asarray(helpers.poison_rows(d["v"][None], kv, poison, rng)[0], dtype)
  do = jnp.asarray(helpers.poison_rows(d_out[None], qv, poison, rng)[0], dtype)
  dl = jnp.asarray(np.where(d["valid_q"][None], d_lse, helpers.poison_like(d_lse.shape, poison, rng)),
                   jnp.float32)
  cu_q, cu_k = jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"])

  @jax.jit
  def f(q, k, v, do, dl):
    (o, lse), vjp = jax.vjp(
        lambda q, k, v: jax_padsafe.varlen_attention(q, k, v, cu_q, cu_k, **args), q, k, v)
    return (o, lse) + vjp((do, dl))

  return {n: np.asarray(x) for n, x in zip(("out", "lse", "dq", "dk", "dv"), f(q, k, v, do, dl))}


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
  d = build(rng, *CASES[case], **kw)
  try:
    check_packed(d, helpers.dtype_for(impl, jnp.float32), impl, rng)
  except NotImplementedError as e:
    if impl == "cute":
      pytest.skip(str(e))
    raise


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
    d = build(rng, *DEGENERATE[case], causal=causal, bottom_right=causal)
    d["loose_bounds"] = bounds == "loose"
    try:
      check_packed(d, helpers.dtype_for(impl, jnp.float32), impl, rng)
    except NotImplementedError as e:
      if impl == "cute":
        pytest.skip(str(e))
      raise


def check_packed(d, dtype, impl, rng):
  """The whole contract on one packed problem from :func:`build`: oracle (on the padded equivalent),
  exact zeros in tails and gaps, bitwise invariance under every poison value."""
  p = d["problem"]
  total_q, total_k = len(d["valid_q"]), len(d["valid_k"])
  n, h = d["q"].shape[1:]
  d_out = rng.standard_normal((total_q, n, h))
  d_lse = rng.standard_normal((n, total_q))
  base = run_packed(d, dtype, impl, "zero", rng, d_out, d_lse)
  # Oracle on the padded equivalent.
  do_pad = np.zeros(p.q.shape)
  dl_pad = np.zeros((p.q.shape[0], n, p.q.shape[1]))
  for i in range(len(d["used_q"])):
    rows = slice(d["cu_q"][i], d["cu_q"][i] + d["used_q"][i])
    do_pad[i, :d["used_q"][i]] = d_out[rows]
    dl_pad[i, :, :d["used_q"][i]] = d_lse[:, rows]
  ref = oracle.reference(p, do_pad, dl_pad)
  ref_packed = dict(
      out=packed_from_padded(ref["out"], d["cu_q"], d["used_q"], total_q),
      dq=packed_from_padded(ref["dq"], d["cu_q"], d["used_q"], total_q),
      dk=packed_from_padded(ref["dk"], d["cu_k"], d["used_k"], total_k),
      dv=packed_from_padded(ref["dv"], d["cu_k"], d["used_k"], total_k),
      lse=packed_from_padded(ref["lse"].transpose(0, 2, 1), d["cu_q"], d["used_q"], total_q).T)
  naive = {}
  if dtype != jnp.float32:  # the accuracy rule's yardstick: plain attention in the input dtype
    nv = helpers.naive_lowp(p, dtype, do_pad, dl_pad)
    naive = dict(out=packed_from_padded(nv["out"], d["cu_q"], d["used_q"], total_q),
                 dq=packed_from_padded(nv["dq"], d["cu_q"], d["used_q"], total_q),
                 dk=packed_from_padded(nv["dk"], d["cu_k"], d["used_k"], total_k),
                 dv=packed_from_padded(nv["dv"], d["cu_k"], d["used_k"], total_k),
                 lse=packed_from_padded(nv["lse"].transpose(0, 2, 1), d["cu_q"], d["used_q"],
                                        total_q).T)
  helpers.assert_close_to_oracle(base, ref_packed, naive, dtype, ["out", "lse", "dq", "dk", "dv"])
  # Padding rows (gaps and tail) are exact zeros; so is their lse.
  assert np.all(base["out"][~d["valid_q"]] == 0) and np.all(base["lse"][:, ~d["valid_q"]] == 0)
  assert np.all(base["dq"][~d["valid_q"]] == 0)
  assert np.all(base["dk"][~d["valid_k"]] == 0) and np.all(base["dv"][~d["valid_k"]] == 0)
  for name in ("out", "dq", "dk", "dv"):
    assert np.all(np.isfinite(base[name])), name
  for poison in helpers.POISONS:
    poisoned = run_packed(d, dtype, impl, poison, rng, d_out, d_lse)
    for name in base:
      helpers.assert_bitwise_equal(poisoned[name], base[name], f"packed {name} with {poison}")


def test_packed_equals_padded(impl):
  """The same sequences through varlen_attention and dot_product_attention agree."""
  rng = np.random.default_rng(5)
  d = build(rng, [8, 13, 5], [8, 13, 5], [10, 4, 9], [10, 4, 9], tail_q=0, tail_k=0, causal=True,
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
      packed_from_padded(np.asarray(padded, np.float32), d["cu_q"], d["used_q"], len(d["q"])),
      atol=tol, rtol=tol)


def test_traced_offsets_past_max_seqlen_are_padding(impl):
  """Under jit a max_seqlen smaller than a sequence cannot raise (the offsets are traced): the rows
  past the bound are padding in every implementation, bitwise the same as declaring them padding with
  seqused, whatever they hold."""
  rng = np.random.default_rng(11)
  caps_q, caps_k, bound_q, bound_k = [9, 14, 5], [12, 5, 10], 8, 6
  d = build(rng, caps_q, np.minimum(caps_q, bound_q), caps_k, np.minimum(caps_k, bound_k), causal=True)
  dtype = helpers.dtype_for(impl, jnp.float32)
  total_q = len(d["valid_q"])
  n, h = d["q"].shape[1:]
  d_out = rng.standard_normal((total_q, n, h))
  d_lse = rng.standard_normal((n, total_q))
  try:
    declared = run_packed(d, dtype, impl, "zero", rng, d_out, d_lse)
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
