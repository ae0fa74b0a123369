"""The contract test base every implementation runs: problem generation, poisoning, running an
implementation, and the whole contract on one problem (:func:`check_problem` for the padded layout,
:func:`check_packed` for the packed one) against the oracle of ``tests/oracle.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def kernels_ready():
  """``(ready, reason)``: whether the GPU kernels can run here (a CUDA GPU and a built kernel library)."""
  try:
    gpu = any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    gpu = False
  if not gpu:
    return False, "no CUDA GPU present"
  if not jax_padsafe.kernels_available()["forward"]:
    return False, "kernel library not built"
  return True, ""


def dtype_for(impl, dtype):
  """The GPU kernels take bf16/fp16 only: float32 cases run on them in bfloat16 (same tolerance rule,
  judged against a bfloat16 naive attention)."""
  if impl == "cute" and jnp.dtype(dtype) == jnp.float32:
    return jnp.bfloat16
  return dtype


def random_sinks(rng, n, *, special=True):
  """Sink logits around the logits' scale; with ``special`` one head without a sink (-inf)."""
  sinks = rng.normal(0.5, 1.5, size=n)
  if special:
    sinks[rng.integers(n)] = -np.inf
  return sinks


def random_problem(rng, *, b=2, t=33, s=47, n=4, k=2, h=64, hv=None, q_len=None, kv_len=None, **kw):
  """A random padded problem; ``hv``: the value head dim (default ``h``)."""
  q_len = np.asarray(q_len if q_len is not None else rng.integers(0, t + 1, size=b), np.int32)
  kv_len = np.asarray(kv_len if kv_len is not None else rng.integers(0, s + 1, size=b), np.int32)
  return oracle.Problem(
      q=rng.standard_normal((b, t, n, h)), k=rng.standard_normal((b, s, k, h)),
      v=rng.standard_normal((b, s, k, h if hv is None else hv)), q_len=q_len, kv_len=kv_len, **kw)


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
  if p.sinks is not None:
    kw["sinks"] = jnp.asarray(p.sinks, jnp.float32)
  if p.alibi is not None:
    kw["alibi_slopes"] = jnp.asarray(p.alibi, jnp.float32)
  return kw


def cotangents(p: oracle.Problem, rng):
  b, t, n, h, s, kh = p.shape
  return rng.standard_normal((b, t, n, p.v.shape[-1])), rng.standard_normal((b, n, t))


def make_runner(p: oracle.Problem, impl, *, grads=True, traced_ids=False):
  """One jitted function (compiled once, reused for every poison) giving outputs and gradients (the
  sinks' too, ``dsinks``, when the problem has sinks).

  ``traced_ids``: pass the segment ids as arguments of the jitted function (as a training step
  does) instead of closing over them, so that they are traced rather than concrete."""
  kw = api_kwargs(p, impl)
  kw.pop("mask", None)  # an argument of the jitted function: run_padded poisons its padding cells
  sinks = kw.pop("sinks", None)  # an argument too: differentiated
  ids = (kw.pop("query_segment_ids"), kw.pop("key_value_segment_ids")) if traced_ids else ()

  def f(q, k, v, bias, sinks, mask, *ids):
    if ids:
      kw.update(query_segment_ids=ids[0], key_value_segment_ids=ids[1])
    return jax_padsafe.dot_product_attention(q, k, v, bias, mask=mask, return_lse=True, sinks=sinks, **kw)

  def run(q, k, v, bias, mask, do, dl, sinks, *ids):
    if not grads:
      out, lse = f(q, k, v, bias, sinks, mask, *ids)
      return dict(out=out, lse=lse)
    (out, lse), vjp = jax.vjp(lambda q, k, v, bias, sinks: f(q, k, v, bias, sinks, mask, *ids),
                              q, k, v, bias, sinks)
    dq, dk, dv, dbias, dsinks = vjp((do, dl))
    res = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if dbias is not None:
      res["dbias"] = dbias
    if dsinks is not None:
      res["dsinks"] = dsinks
    return res

  jitted = jax.jit(run)
  return lambda *args: jitted(*args, sinks, *ids)


def run_padded(p: oracle.Problem, dtype, runner, *, poison="zero", rng=None, d_out=None, d_lse=None,
               bias_dtype=jnp.float32):
  """Runs ``runner`` (from :func:`make_runner`) with every padded region poisoned; a bias is passed
  in ``bias_dtype``."""
  rng = rng or np.random.default_rng(0)
  qv, kv = p.q_valid(), p.k_valid()
  q = jnp.asarray(poison_rows(p.q, qv, poison, rng), dtype)
  k = jnp.asarray(poison_rows(p.k, kv, poison, rng), dtype)
  v = jnp.asarray(poison_rows(p.v, kv, poison, rng), dtype)
  bias = mask = None
  if p.bias is not None:
    # A bias entry that no visible (query, key) pair reads is padding too; -inf entries stay.
    used = p.visible()
    hx, n = p.bias.shape[1], used.shape[1]
    if 1 < hx < n:  # a bias per key/value head: an entry is read if any query head of its group reads it
      used = used.reshape(used.shape[0], hx, n // hx, *used.shape[2:]).any(axis=2)
    used = used.any(axis=tuple(i for i in range(4) if p.bias.shape[i] == 1), keepdims=True)
    bias = jnp.asarray(np.where(used | np.isneginf(p.bias), p.bias,
                                poison_like(p.bias.shape, poison, rng)), bias_dtype)
  if p.mask is not None:
    # Mask cells outside the valid rectangle (padded queries or keys) are padding: any poison flips them at
    # random (a bool holds no NaN), which must change nothing.
    inside = (qv[:, None, :, None] & kv[:, None, None, :])
    inside = inside.any(axis=tuple(i for i in range(4) if p.mask.shape[i] == 1), keepdims=True)
    flipped = rng.random(p.mask.shape) < 0.5 if poison != "zero" else p.mask
    mask = jnp.asarray(np.where(np.broadcast_to(inside, p.mask.shape), p.mask, flipped))
  do = jnp.asarray(poison_rows(d_out, qv, poison, rng), dtype)
  dl = jnp.asarray(np.where(qv[:, None, :], d_lse, poison_like(d_lse.shape, poison, rng)), jnp.float32)
  return {name: np.asarray(x) for name, x in runner(q, k, v, bias, mask, do, dl).items()}


def empty_row_lse(sinks, shape):
  """The lse of valid rows that see no key, broadcast to ``shape`` (heads on axis -2): -inf, or with
  sinks the row's sink, exactly."""
  if sinks is None:
    return np.full(shape, -np.inf, np.float32)
  return np.broadcast_to(np.asarray(sinks, np.float32)[:, None], shape)


def assert_contract_zeros(p: oracle.Problem, ours, ref):
  """Padded rows and never-seen keys hold exact zeros; lse is 0 / -inf (the sink) where the contract
  says."""
  qv, kv = p.q_valid(), p.k_valid()
  assert np.all(ours["out"][~qv] == 0), "padded output rows must be exactly 0"
  assert np.all(ours["lse"].transpose(0, 2, 1)[~qv] == 0), "padded lse rows must be exactly 0"
  empty = ref["empty"]                               # [B, N, T] valid rows with no visible key
  want = empty_row_lse(p.sinks, ours["lse"].shape)
  assert np.array_equal(ours["lse"][empty], want[empty]), \
      "valid rows with no visible key need lse = -inf (= the sink with sinks)"
  out_rows = ours["out"].transpose(0, 2, 1, 3)       # [B, N, T, Hv]
  assert np.all(out_rows[empty] == 0), "valid rows with no visible key need output exactly 0"
  finite_lse = np.where(empty, 0.0, ours["lse"])
  assert np.all(np.isfinite(finite_lse)), "lse may be non-finite only for valid empty rows"
  for name in ("out", "dq", "dk", "dv", "dbias", "dsinks"):
    if name in ours:
      assert np.all(np.isfinite(ours[name])), f"{name} holds NaN/Inf"
  if "dq" in ours:
    assert np.all(ours["dq"][~qv] == 0), "padded dQ rows must be exactly 0"
    dq_rows = ours["dq"].transpose(0, 2, 1, 3)
    assert np.all(dq_rows[empty] == 0), "dQ of valid rows with no visible key must be exactly 0"
    for name in ("dk", "dv"):
      assert np.all(ours[name][~kv] == 0), f"padded {name} rows must be exactly 0"
      assert np.all(ours[name][~ref["seen"]] == 0), f"{name} of keys no valid query sees must be exactly 0"


def dirty_memory(results):
  """Allocates and frees NaN-filled device buffers twice the size of ``results``, so that the next call's
  outputs likely land on NaN memory: what its memsets or its kernels' zero rows must hide."""
  junk = [jnp.full((2 * np.asarray(x).size,), jnp.nan, jnp.float32) for x in results.values()]
  jax.block_until_ready(junk)
  del junk


def contract(p, dtype, impl, **kw):
  """:func:`check_problem`, skipped (not failed) where ``impl="cute"`` names a feature combination the kernels
  do not take (``NotImplementedError``); any other implementation must run it."""
  try:
    return check_problem(p, dtype, impl, **kw)
  except NotImplementedError as e:
    if impl == "cute":
      pytest.skip(f"not supported by the kernels: {e}")
    raise


def contract_packed(d, dtype, impl, rng, **kw):
  """:func:`check_packed`, skipped where ``impl="cute"`` names what the kernels do not take (as :func:`contract`)."""
  try:
    return check_packed(d, dtype, impl, rng, **kw)
  except NotImplementedError as e:
    if impl == "cute":
      pytest.skip(f"not supported by the kernels: {e}")
    raise


def check_problem(p: oracle.Problem, dtype, impl, *, poisons=POISONS, seed=0, grads=True,
                  traced_ids=False, dirty=False, bias_dtype=jnp.float32):
  """The whole contract on one padded problem: oracle match (the accuracy rule), exact zeros,
  bitwise poison invariance; with ``dirty`` also bitwise the same results on memory left NaN by
  earlier buffers (:func:`dirty_memory`).  A bias is passed in ``bias_dtype`` (its values should be
  representable in it: the oracle reads them as given), and dbias comes back in it.
  Returns ``(results, ref64)``."""
  rng = np.random.default_rng(seed)
  dtype = dtype_for(impl, dtype)
  d_out, d_lse = cotangents(p, rng)
  runner = make_runner(p, impl, grads=grads, traced_ids=traced_ids)
  run = functools.partial(run_padded, p, dtype, runner, d_out=d_out, d_lse=d_lse, rng=rng,
                          bias_dtype=bias_dtype)
  base = run(poison="zero")
  ref, naive = oracle.expected(p, dtype, d_out, d_lse) if grads else oracle.expected(p, dtype)
  names = ["out", "lse"] + (["dq", "dk", "dv"] + (["dbias"] if p.bias is not None else [])
                           + (["dsinks"] if p.sinks is not None else []) if grads else [])
  oracle.assert_close(base, ref, naive, dtype, names, out_dtypes={"dbias": bias_dtype})
  assert_contract_zeros(p, base, ref)
  for poison in poisons:
    poisoned = run(poison=poison)
    for name in names:
      assert_bitwise_equal(poisoned[name], base[name], f"{name} with {poison} in the padding")
  if dirty:
    dirty_memory(base)
    again = run(poison="zero")
    for name in names:
      assert_bitwise_equal(again[name], base[name], f"{name} on dirty memory")
  return base, ref


# --------------------------------------------------------------------------------------------------
# The packed (variable-length) layout
# --------------------------------------------------------------------------------------------------

def build_packed(rng, caps_q, used_q, caps_k, used_k, *, tail_q=3, tail_k=5, lead_q=0, lead_k=0, n=4, k=2,
                 h=64, hv=None, **kw):
  """A random packed problem: sequence b has a slot of ``caps[b]`` rows of which the first ``used[b]`` are
  valid, the slots back to back after ``lead`` unused rows, then ``tail`` rows past ``cu_seqlens[-1]``.
  ``kw``: the masks (``causal``, ``window``, ``softcap``, ``scale``, ``bottom_right``), ``sinks`` and
  ``alibi``; ``hv``: the value head dim (default ``h``).

  Returns a dict: ``q``, ``k``, ``v``, ``cu_q``, ``cu_k``, ``used_q``, ``used_k``, ``valid_q``, ``valid_k``,
  ``packed`` (the :class:`oracle.PackedProblem`) and ``problem`` (the same sequences as a padded
  :class:`oracle.Problem`).  Optional keys read by :func:`check_packed`: ``loose_bounds`` (leave
  ``max_seqlen_q/k`` at their default, the packed length) and ``bound`` (both bounds below the longest
  slot, the offsets traced)."""
  caps_q, used_q, caps_k, used_k = (np.asarray(x, np.int64) for x in (caps_q, used_q, caps_k, used_k))
  cu_q = (lead_q + np.concatenate([[0], np.cumsum(caps_q)])).astype(np.int32)
  cu_k = (lead_k + np.concatenate([[0], np.cumsum(caps_k)])).astype(np.int32)
  total_q, total_k = int(cu_q[-1]) + tail_q, int(cu_k[-1]) + tail_k
  packed = oracle.PackedProblem(
      q=rng.standard_normal((total_q, n, h)), k=rng.standard_normal((total_k, k, h)),
      v=rng.standard_normal((total_k, k, h if hv is None else hv)), cu_q=cu_q, cu_k=cu_k,
      used_q=used_q.astype(np.int32),
      used_k=used_k.astype(np.int32), **kw)
  return dict(q=packed.q, k=packed.k, v=packed.v, cu_q=cu_q, cu_k=cu_k, used_q=packed.used_q,
              used_k=packed.used_k, valid_q=packed.q_valid(), valid_k=packed.k_valid(), packed=packed,
              problem=packed.padded())


def packed_from_padded(x, cu, used, total):
  """[B, L, ...] padded -> [total, ...] packed (zeros outside the used rows)."""
  out = np.zeros((total,) + x.shape[2:], x.dtype)
  for i in range(len(used)):
    out[cu[i]:cu[i] + used[i]] = x[i, :used[i]]
  return out


def packed_kwargs(d, impl, **kw):
  """``varlen_attention`` keyword arguments for a problem from :func:`build_packed` (cu_seqlens apart).
  The sequence-length bounds are the longest slots, ``d["bound"]``, or left at their default (the packed
  length) where ``d["loose_bounds"]``."""
  p = d["packed"]
  if d.get("bound") is not None:
    bounds = dict(max_seqlen_q=int(d["bound"]), max_seqlen_k=int(d["bound"]))
  elif d.get("loose_bounds"):
    bounds = {}
  else:
    bounds = dict(max_seqlen_q=max(1, int(np.max(np.diff(d["cu_q"]), initial=0))),
                  max_seqlen_k=max(1, int(np.max(np.diff(d["cu_k"]), initial=0))))
  if p.alibi is not None:
    kw["alibi_slopes"] = jnp.asarray(p.alibi, jnp.float32)
  return dict(seqused_q=jnp.asarray(d["used_q"], jnp.int32), seqused_k=jnp.asarray(d["used_k"], jnp.int32),
              is_causal=p.causal, softcap=p.softcap, scale=p.scale,
              causal_alignment="bottom_right" if p.bottom_right else "top_left",
              local_window_size=None if p.window is None else tuple(-1 if w is None else w for w in p.window),
              implementation=impl, **bounds, **kw)


def make_packed_runner(d, impl, *, grads=True, **kw):
  """One jitted ``(q, k, v, do, dl) -> dict(out, lse[, dq, dk, dv[, dsinks]])`` through ``varlen_attention``
  (the sinks, when the problem has them, differentiated).  With ``d["bound"]`` the offsets are arguments of
  the jitted function (traced, as in a training step), so that a bound below the longest slot is legal: rows
  past it are padding."""
  args = packed_kwargs(d, impl, return_lse=True, **kw)
  cu = (jnp.asarray(d["cu_q"]), jnp.asarray(d["cu_k"]))
  traced = d.get("bound") is not None
  sinks = d["packed"].sinks
  sinks = () if sinks is None else (jnp.asarray(sinks, jnp.float32),)
  names = ("out", "lse", "dq", "dk", "dv") + (("dsinks",) if sinks else ()) if grads else ("out", "lse")

  @jax.jit
  def f(q, k, v, do, dl, sinks, *offsets):
    cu_q, cu_k = offsets if traced else cu
    def attention(q, k, v, *sinks):
      return jax_padsafe.varlen_attention(q, k, v, cu_q, cu_k, **args, sinks=sinks[0] if sinks else None)
    if not grads:
      return attention(q, k, v, *sinks)
    (o, lse), vjp = jax.vjp(attention, q, k, v, *sinks)
    return (o, lse) + vjp((do, dl))

  return lambda *a: dict(zip(names, f(*a, sinks, *(cu if traced else ()))))


def run_packed(d, dtype, runner, poison, rng, d_out, d_lse):
  """Runs ``runner`` (from :func:`make_packed_runner`) with every padded row of q, k, v, dO, dlse poisoned."""
  qv, kv = d["valid_q"][None], d["valid_k"][None]
  q = jnp.asarray(poison_rows(d["q"][None], qv, poison, rng)[0], dtype)
  k = jnp.asarray(poison_rows(d["k"][None], kv, poison, rng)[0], dtype)
  v = jnp.asarray(poison_rows(d["v"][None], kv, poison, rng)[0], dtype)
  do = jnp.asarray(poison_rows(d_out[None], qv, poison, rng)[0], dtype)
  dl = jnp.asarray(np.where(d["valid_q"][None], d_lse, poison_like(d_lse.shape, poison, rng)), jnp.float32)
  return {n: np.asarray(x) for n, x in runner(q, k, v, do, dl).items()}


def assert_packed_zeros(d, ours, ref):
  """The exact zeros of the packed layout: padded rows (lead, gaps, tail) of every result, valid rows
  without a visible key (out, dq; their lse is -inf, checked with the oracle), keys no query sees."""
  vq, vk = d["valid_q"], d["valid_k"]
  assert np.all(ours["out"][~vq] == 0), "padded output rows must be exactly 0"
  assert np.all(ours["lse"][:, ~vq] == 0), "padded lse rows must be exactly 0"
  empty = ref["empty"].T                              # [total_q, N]
  assert np.all(ours["out"][empty] == 0), "valid rows with no visible key need output exactly 0"
  want = empty_row_lse(d["packed"].sinks, ours["lse"].shape)
  assert np.array_equal(ours["lse"][empty.T], want[empty.T]), \
      "valid rows with no visible key need lse = -inf (= the sink with sinks)"
  assert np.all(np.isfinite(np.where(empty.T, 0.0, ours["lse"]))), "lse may be -inf only for valid empty rows"
  for name in ("out", "dq", "dk", "dv", "dsinks"):
    if name in ours:
      assert np.all(np.isfinite(ours[name])), f"{name} holds NaN/Inf"
  if "dq" in ours:
    assert np.all(ours["dq"][~vq] == 0), "padded dQ rows must be exactly 0"
    assert np.all(ours["dq"][empty] == 0), "dQ of valid rows with no visible key must be exactly 0"
    for name in ("dk", "dv"):
      assert np.all(ours[name][~vk] == 0), f"padded {name} rows must be exactly 0"
      assert np.all(ours[name][~ref["seen"]] == 0), f"{name} of keys no valid query sees must be exactly 0"


def check_packed(d, dtype, impl, rng, *, poisons=POISONS, grads=True, dirty=False):
  """The whole contract on one packed problem from :func:`build_packed`: oracle (the accuracy rule),
  exact zeros in the lead, gaps and tail, bitwise invariance under every poison value (and with
  ``dirty`` on dirty memory, as :func:`check_problem`).  Returns ``(results, ref64)``."""
  total_q = len(d["valid_q"])
  n, hv = d["q"].shape[1], d["v"].shape[-1]
  d_out = rng.standard_normal((total_q, n, hv))
  d_lse = rng.standard_normal((n, total_q))
  runner = make_packed_runner(d, impl, grads=grads)
  base = run_packed(d, dtype, runner, "zero", rng, d_out, d_lse)
  pp = d["packed"]
  if d.get("bound") is not None:  # rows past the bound are padding (no layout here has used rows past it)
    assert np.all(pp.used_q <= d["bound"]) and np.all(pp.used_k <= d["bound"])
  ref, naive = oracle.expected(pp, dtype, d_out, d_lse) if grads else oracle.expected(pp, dtype)
  oracle.assert_close(base, ref, naive, dtype, list(base))
  assert_packed_zeros(d, base, ref)
  for poison in poisons:
    poisoned = run_packed(d, dtype, runner, poison, rng, d_out, d_lse)
    for name in base:
      assert_bitwise_equal(poisoned[name], base[name], f"packed {name} with {poison} in the padding")
  if dirty:
    dirty_memory(base)
    again = run_packed(d, dtype, runner, "zero", rng, d_out, d_lse)
    for name in base:
      assert_bitwise_equal(again[name], base[name], f"packed {name} on dirty memory")
  return base, ref


# --------------------------------------------------------------------------------------------------
# Pure-JAX stand-ins with the kernels' packed signatures (for CPU tests of the layout mapping and of
# the partitioning wrappers around the FFI calls)
# --------------------------------------------------------------------------------------------------

def standin_flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *,
                          max_seqlen_q, max_seqlen_k, scale, causal, bottom_right, window_left,
                          window_right, softcap):
  """Pure-JAX stand-in with the signature of ``jax_padsafe._backends.cute.forward.flash_forward``."""
  del max_seqlen_q, max_seqlen_k
  return jax_padsafe.varlen_attention(
      q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, scale=scale,
      is_causal=causal, causal_alignment="bottom_right" if bottom_right else "top_left",
      local_window_size=(window_left, window_right), softcap=softcap or None, return_lse=True,
      implementation="xla", block_k=16)


def standin_flash_backward(q, k, v, o, lse, do, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                           seqused_k, *, deterministic=False, **static):
  """Pure-JAX stand-in with the signature of ``jax_padsafe._backends.cute.backward.flash_backward``."""
  del o, lse, deterministic
  fwd = lambda q, k, v: standin_flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                              seqused_k, **static)
  _, vjp = jax.vjp(fwd, q, k, v)
  return vjp((do, dlse))
