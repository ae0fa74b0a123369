"""Shared test machinery: problem generation, poisoning, running an implementation, contract checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_padsafe
from tests import oracle

# Values written into padded memory. "huge" draws fresh random huge magnitudes on every call.
POISONS = ("nan", "inf", "-inf", "1e30", "huge")

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def poison_like(shape, kind, rng):
  if kind == "zero":
    return np.zeros(shape)
  if kind == "nan":
    return np.full(shape, np.nan)
  if kind == "inf":
    return np.full(shape, np.inf)
  if kind == "-inf":
    return np.full(shape, -np.inf)
  if kind == "1e30":
    return np.full(shape, 1e30)
  if kind == "huge":
    mag = 10.0 ** rng.uniform(4, 38, size=shape)
    return np.where(rng.random(shape) < 0.5, -mag, mag)
  raise ValueError(kind)


def poison_rows(x, valid, kind, rng):
  """``x [B, L, ...]`` with every row where ``valid [B, L]`` is False replaced by poison."""
  x = np.asarray(x, np.float64)
  valid = valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim))
  return np.where(valid, x, poison_like(x.shape, kind, rng))


def bits(x):
  x = np.asarray(x)
  return x.view(_UINT[x.dtype.itemsize])


def assert_bitwise_equal(a, b, what):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape, what
  if not np.array_equal(bits(a), bits(b)):
    diff = np.argwhere(bits(a) != bits(b))
    raise AssertionError(f"{what}: not bitwise identical at {len(diff)} places, first {diff[:3].tolist()}")


def dtype_for(impl, dtype):
  """The GPU kernels take bf16/fp16 only: float32 cases run on them in bfloat16 (same tolerance rule,
  judged against a bfloat16 naive attention)."""
  if impl == "cute" and jnp.dtype(dtype) == jnp.float32:
    return jnp.bfloat16
  return dtype


def random_problem(rng, *, b=2, t=33, s=47, n=4, k=2, h=64, q_len=None, kv_len=None, **kw):
  q_len = np.asarray(q_len if q_len is not None else rng.integers(0, t + 1, size=b), np.int32)
  kv_len = np.asarray(kv_len if kv_len is not None else rng.integers(0, s + 1, size=b), np.int32)
  return oracle.Problem(
      q=rng.standard_normal((b, t, n, h)), k=rng.standard_normal((b, s, k, h)),
      v=rng.standard_normal((b, s, k, h)), q_len=q_len, kv_len=kv_len, **kw)


def api_kwargs(p: oracle.Problem, impl):
  kw = dict(is_causal=p.causal, query_seq_lengths=jnp.asarray(p.q_len),
            key_value_seq_lengths=jnp.asarray(p.kv_len), softcap=p.softcap, scale=p.scale,
            causal_alignment="bottom_right" if p.bottom_right else "top_left",
            implementation=impl)
  if p.window is not None:
    kw["local_window_size"] = tuple(-1 if w is None else w for w in p.window)
  if p.q_ids is not None:
    kw["query_segment_ids"] = jnp.asarray(p.q_ids, jnp.int32)
    kw["key_value_segment_ids"] = jnp.asarray(p.kv_ids, jnp.int32)
  if p.mask is not None:
    kw["mask"] = jnp.asarray(p.mask)
  return kw


def cotangents(p: oracle.Problem, rng):
  b, t, n, h, s, kh = p.shape
  return rng.standard_normal((b, t, n, h)), rng.standard_normal((b, n, t))


def make_runner(p: oracle.Problem, impl, *, grads=True, traced_ids=False):
  """One jitted function (compiled once, reused for every poison) giving outputs and gradients.

  ``traced_ids``: pass the segment ids as arguments of the jitted function (as a training step
  does) instead of closing over them, so that they are traced rather than concrete."""
  kw = api_kwargs(p, impl)
  ids = (kw.pop("query_segment_ids"), kw.pop("key_value_segment_ids")) if traced_ids else ()

  def f(q, k, v, bias, *ids):
    if ids:
      kw.update(query_segment_ids=ids[0], key_value_segment_ids=ids[1])
    return jax_padsafe.dot_product_attention(q, k, v, bias, return_lse=True, **kw)

  def run(q, k, v, bias, do, dl, *ids):
    if not grads:
      out, lse = f(q, k, v, bias, *ids)
      return dict(out=out, lse=lse)
    (out, lse), vjp = jax.vjp(lambda q, k, v, bias: f(q, k, v, bias, *ids), q, k, v, bias)
    dq, dk, dv, dbias = vjp((do, dl))
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if dbias is not None:
      res["dbias"] = dbias
    return res

  jitted = jax.jit(run)
  return lambda *args: jitted(*args, *ids)


def run_padded(p: oracle.Problem, dtype, runner, *, poison="zero", rng=None, d_out=None, d_lse=None):
  """Runs ``runner`` (from :func:`make_runner`) with every padded region poisoned."""
  rng = rng or np.random.default_rng(0)
  qv, kv = p.q_valid(), p.k_valid()
  q = jnp.asarray(poison_rows(p.q, qv, poison, rng), dtype)
  k = jnp.asarray(poison_rows(p.k, kv, poison, rng), dtype)
  v = jnp.asarray(poison_rows(p.v, kv, poison, rng), dtype)
  bias = None
  if p.bias is not None:
    # A bias entry that no visible (query, key) pair reads is padding too; -inf entries stay.
    used = p.visible().any(axis=tuple(i for i in range(4) if p.bias.shape[i] == 1), keepdims=True)
    bias = jnp.asarray(np.where(used | np.isneginf(p.bias), p.bias,
                                poison_like(p.bias.shape, poison, rng)), jnp.float32)
  do = jnp.asarray(poison_rows(d_out, qv, poison, rng), dtype)
  dl = jnp.asarray(np.where(qv[:, None, :], d_lse, poison_like(d_lse.shape, poison, rng)), jnp.float32)
  return {name: np.asarray(x) for name, x in runner(q, k, v, bias, do, dl).items()}


def naive_lowp(p: oracle.Problem, dtype, d_out, d_lse):
  """Plain (non-blockwise) softmax attention in ``dtype`` with float32 accumulation, on clean
  inputs: the yardstick for the contract's accuracy rule."""
  b, t, n, h, s, kh = p.shape
  scale = p.scale if p.scale is not None else 1.0 / np.sqrt(h)
  vis = jnp.asarray(p.visible())
  qv, kv = p.q_valid(), p.k_valid()
  q = jnp.asarray(np.where(qv[..., None, None], p.q, 0), dtype)
  k = jnp.asarray(np.repeat(np.where(kv[..., None, None], p.k, 0), n // kh, axis=2), dtype)
  v = jnp.asarray(np.repeat(np.where(kv[..., None, None], p.v, 0), n // kh, axis=2), dtype)
  bias = None if p.bias is None else jnp.asarray(np.broadcast_to(p.bias, (b, n, t, s)), dtype)

  def f(q, k, v, bias):
    s_ = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32).astype(dtype)
    s_ = s_.astype(jnp.float32) * scale
    if p.softcap is not None:
      s_ = p.softcap * jnp.tanh(s_ / p.softcap)
    if bias is not None:
      s_ = s_ + jnp.where(vis, bias.astype(jnp.float32), 0)
    m = jnp.max(jnp.where(vis, s_, -jnp.inf), -1)
    m = jnp.where(jnp.isfinite(m), m, 0)
    e = jnp.where(vis, jnp.exp(s_ - m[..., None]), 0)
    l = e.sum(-1)
    ls = jnp.where(l > 0, l, 1)
    prob = (e / ls[..., None]).astype(dtype)
    out = jnp.einsum("bnts,bsnh->btnh", prob, v, preferred_element_type=jnp.float32).astype(dtype)
    lse = jnp.where(l > 0, m + jnp.log(ls), 0)
    return out, lse

  (out, lse), vjp = jax.vjp(f, q, k, v, bias)
  do = jnp.asarray(np.where(qv[..., None, None], d_out, 0), dtype)
  dl = jnp.asarray(np.where(qv[:, None, :], d_lse, 0), jnp.float32)
  dq, dk, dv, dbias = vjp((do, dl))
  dk = dk.reshape(b, s, kh, n // kh, h).sum(3)
  dv = dv.reshape(b, s, kh, n // kh, h).sum(3)
  res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
  if dbias is not None:
    axes = tuple(i for i in range(4) if p.bias.shape[i] == 1)
    res["dbias"] = jnp.sum(dbias.astype(jnp.float32), axis=axes, keepdims=True)
  return {name: np.asarray(x, np.float64) for name, x in res.items()}


def assert_close_to_oracle(ours, ref, naive, dtype, names):
  """The contract's accuracy rule: ``max|ours - ref64| <= 2 * max|naive_lowp - ref64| + eps``."""
  for name in names:
    r = ref[name]
    a = np.asarray(ours[name], np.float64)
    finite = np.isfinite(r)
    assert np.array_equal(np.isfinite(a), finite), f"{name}: non-finite entries differ from the oracle"
    assert np.array_equal(a[~finite], r[~finite]), f"{name}: infinite entries differ from the oracle"
    if not finite.any():
      continue
    err = np.max(np.abs(a[finite] - r[finite]))
    naive_err = np.max(np.abs(naive[name][finite] - r[finite])) if name in naive else 0.0
    # eps: rounding the result to the input dtype, plus float32 accumulation noise.
    eps = (2 * float(jnp.finfo(dtype).eps) + 32 * float(jnp.finfo(jnp.float32).eps)) * max(
        1.0, float(np.max(np.abs(r[finite]))))
    assert err <= 2 * naive_err + eps, (
        f"{name}: max error {err:.3g} > 2 * naive {naive_err:.3g} + eps {eps:.3g}")


def assert_contract_zeros(p: oracle.Problem, ours, ref):
  """Padded rows and never-seen keys hold exact zeros; lse is 0 / -inf where the contract says."""
  qv, kv = p.q_valid(), p.k_valid()
  assert np.all(ours["out"][~qv] == 0), "padded output rows must be exactly 0"
  assert np.all(ours["lse"].transpose(0, 2, 1)[~qv] == 0), "padded lse rows must be exactly 0"
  vis = ref["visible"]
  empty = qv[:, None, :] & ~vis.any(-1)            # [B, N, T] valid rows with no visible key
  assert np.all(np.isneginf(ours["lse"][empty])), "valid rows with no visible key need lse = -inf"
  out_rows = ours["out"].transpose(0, 2, 1, 3)       # [B, N, T, H]
  assert np.all(out_rows[empty] == 0), "valid rows with no visible key need output exactly 0"
  finite_lse = np.where(empty, 0.0, ours["lse"])
  assert np.all(np.isfinite(finite_lse)), "lse may be non-finite only for valid empty rows"
  for name in ("out", "dq", "dk", "dv", "dbias"):
    if name in ours:
      assert np.all(np.isfinite(ours[name])), f"{name} holds NaN/Inf"
  if "dq" in ours:
    assert np.all(ours["dq"][~qv] == 0), "padded dQ rows must be exactly 0"
    dq_rows = ours["dq"].transpose(0, 2, 1, 3)
    assert np.all(dq_rows[empty] == 0), "dQ of valid rows with no visible key must be exactly 0"
    b, t, n, h, s, kh = p.shape
    seen = vis.reshape(b, kh, n // kh, t, s).any(axis=(2, 3)).transpose(0, 2, 1)  # [B, S, K]
    for name in ("dk", "dv"):
      assert np.all(ours[name][~kv] == 0), f"padded {name} rows must be exactly 0"
      assert np.all(ours[name][~seen] == 0), f"{name} of keys no valid query sees must be exactly 0"


def check_problem(p: oracle.Problem, dtype, impl, *, poisons=POISONS, seed=0, grads=True,
                  traced_ids=False):
  """The whole contract on one problem: oracle match, exact zeros, bitwise poison invariance."""
  rng = np.random.default_rng(seed)
  dtype = dtype_for(impl, dtype)
  d_out, d_lse = cotangents(p, rng)
  runner = make_runner(p, impl, grads=grads, traced_ids=traced_ids)
  base = run_padded(p, dtype, runner, poison="zero", d_out=d_out, d_lse=d_lse, rng=rng)
  ref = oracle.reference(p, d_out, d_lse)
  names = ["out", "lse"] + (["dq", "dk", "dv"] + (["dbias"] if p.bias is not None else [])
                           if grads else [])
  naive = naive_lowp(p, dtype, d_out, d_lse)
  assert_close_to_oracle(base, ref, naive, dtype, names)
  assert_contract_zeros(p, base, ref)
  for poison in poisons:
    poisoned = run_padded(p, dtype, runner, poison=poison, d_out=d_out, d_lse=d_lse, rng=rng)
    for name in names:
      assert_bitwise_equal(poisoned[name], base[name], f"{name} with {poison} in the padding")
  return base, ref


# --------------------------------------------------------------------------------------------------
# Pure-JAX stand-ins with the kernels' packed signatures (for CPU tests of the layout mapping and of
# the partitioning wrappers around the FFI calls)
# --------------------------------------------------------------------------------------------------

def standin_flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *,
                          max_seqlen_q, max_seqlen_k, scale, causal, bottom_right, window_left,
                          window_right, softcap):
  """Pure-JAX stand-in with the signature of ``jax_padsafe._cute.ops.flash_forward``."""
  del max_seqlen_q, max_seqlen_k
  return jax_padsafe.varlen_attention(
      q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, scale=scale,
      is_causal=causal, causal_alignment="bottom_right" if bottom_right else "top_left",
      local_window_size=(window_left, window_right), softcap=softcap or None, return_lse=True,
      implementation="xla", block_k=16)


def standin_flash_backward(q, k, v, o, lse, do, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                           seqused_k, *, deterministic=False, **static):
  """Pure-JAX stand-in with the signature of ``jax_padsafe._cute.bwd_ops.flash_backward``."""
  del o, lse, deterministic
  fwd = lambda q, k, v: standin_flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                              seqused_k, **static)
  _, vjp = jax.vjp(fwd, q, k, v)
  return vjp((do, dlse))
