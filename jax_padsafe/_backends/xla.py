"""Pure-JAX pad-safe flash attention (runs on CPU, GPU and TPU).

This is the fallback for every feature combination the GPU kernels do not cover, and the oracle the
kernels are tested against. It works on the per-row view of the canonical problem
(``jax_padsafe._core.problem``):

* Forward: an online softmax over blocks of ``block_k`` keys (``lax.scan``), so memory grows with
  ``T x block_k`` rather than ``T x S``.
* Backward: recomputes the probabilities block by block from the row statistics the forward keeps
  (:class:`RowStats`: the max ``m``, ``log l`` and the float32 output); Delta and the statistics are
  explicitly zero in padded rows.
* Matrix products take the inputs' dtype: bfloat16 / float16 operands (P and dS rounded to it, as the
  kernels and ``jax.nn`` do) with float32 accumulation at default precision; float32 operands at
  full float32 precision.

Pad-safety rules followed everywhere below:

* inputs are sanitised with selects before any arithmetic (done by the caller, ``attention._run``,
  and again here for the cotangents);
* masked logits are *selected* away (``jnp.where``), never multiplied by zero;
* the running max is replaced by 0 while a row has seen no visible key, so ``exp(-inf - -inf)`` is
  never evaluated;
* rows with no visible key produce ``o = 0`` and ``lse = -inf`` (valid rows) or ``lse = 0`` (padded rows).

ALiBi adds ``-slope * |q_pos - k_pos|`` to the logits after the softcap, next to the bias, computed
per key block from the canonical positions (which include the alignment offset): no T x S array.

Sinks (one logit per query head, ``exp(sink)`` added to every valid row's denominator) are a key with
a zero value that every valid row sees: the online softmax starts from it (``m = sink``, ``l = 1``), so
a valid row that sees no key comes out with ``o = 0`` and ``lse = sink``, and huge or ``-inf`` sinks
go through the same max-shifted sums as the logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_padsafe._core import visibility
from jax_padsafe._core.backend import Backend
from jax_padsafe._core.spec import AttentionSpec

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST


def _einsum(spec, a, b, dtype, like=None):
  """``a`` x ``b`` with both operands in ``dtype`` (the inputs' dtype) and float32 accumulation:
  default precision for bfloat16 / float16 (the kernels' and jax.nn's products), full precision
  for float32 (XLA would otherwise be free to use bfloat16 passes, e.g. TF32 on GPUs).

  ``like``: an array whose sharding the result takes when the mesh has Explicit axes and the
  contraction runs over a sharded axis (MQA's dK/dV sum over head-sharded query heads), where JAX
  will not guess the output sharding."""
  kw = {}
  if like is not None and _explicit_sharding(like) is not None:
    kw["out_sharding"] = _explicit_sharding(like)
  precision = _HIGHEST if jnp.dtype(dtype) == _F32 else None
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision,
                    preferred_element_type=_F32, **kw)


class RowStats(NamedTuple):
  """What the forward keeps for the backward, per query row (``[B, K, G, T]``, grouped heads).

  ``m``: the row's max logit, the sink included (``-inf`` for rows that saw no key and have no sink,
  0 in padded rows); ``log_l``: the log of its sum of ``exp(s - m)``, the sink's term included;
  ``o``: the output ``[B, K, G, T, Hv]`` in float32.  ``lse = m + log_l`` rounds to ``m`` once
  ``|m|`` dwarfs ``log_l`` (a huge finite bias on every key: -1e30, finfo.min), so ``exp(s - lse)``
  would give 1 where the softmax is ``1 / l``; ``exp((s - m) - log_l)`` is exact to rounding for any
  finite ``m``.  Delta = rowsum(dO * O) is formed from the float32 output, not the one rounded to
  the input dtype (dQ's remaining mismatch, from P rounded for its product with V, is corrected in
  :func:`backward`); ``o`` None (the kernels' statistics, :func:`row_stats_from_kernels`): Delta =
  rowsum(P * dP) from the recomputed P and dP."""
  m: jax.Array
  log_l: jax.Array
  o: jax.Array | None


def _explicit_sharding(x):
  """The sharding in ``x``'s type on a mesh with Explicit axes, else None."""
  typeof = getattr(jax, "typeof", None)
  sharding = getattr(typeof(x), "sharding", None) if typeof is not None else None
  mesh = getattr(sharding, "mesh", None)
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  if mesh is None or explicit is None or explicit not in tuple(getattr(mesh, "axis_types", ())):
    return None
  return sharding


# --------------------------------------------------------------------------------------------------
# Key/value blocking
# --------------------------------------------------------------------------------------------------

def _num_blocks(spec: AttentionSpec, s: int) -> tuple[int, int]:
  block = max(1, min(spec.block_k, s))
  return block, -(-s // block)


def _split_s(x, block: int, nblk: int, fill):
  """``[..., S, *rest]`` along ``axis`` -> blocks stacked in front. ``x``'s S axis is axis 1."""
  s = x.shape[1]
  pad = nblk * block - s
  if pad:
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    x = jnp.pad(x, widths, constant_values=fill)
  x = x.reshape(x.shape[0], nblk, block, *x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _split_last(x, block: int, nblk: int, fill):
  """Blocks of the last (key) axis of a broadcastable ``[Bx, Nx, Tx, Sx]`` operand, in front."""
  s = x.shape[-1]
  pad = nblk * block - s
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=fill)
  x = x.reshape(*x.shape[:-1], nblk, block)
  return jnp.moveaxis(x, -2, 0)


def _heads_to_groups(x, num_kv_heads: int):
  """``[Bx, Nx, Tx, Sx]`` (``Nx`` in ``{1, N}``) -> ``[Bx, K|1, G|1, Tx, Sx]`` to match the logits."""
  bx, nx, tx, sx = x.shape
  if nx == 1:
    return x.reshape(bx, 1, 1, tx, sx)
  return x.reshape(bx, num_kv_heads, nx // num_kv_heads, tx, sx)


def _key_blocks(spec, k, v, bias, mask, k_seg, k_pos, alibi=None):
  """Everything that varies along the key axis, split into scan inputs (or kept whole if broadcast);
  the ALiBi slopes (``[1|B, N, 1|T]``, constant along the keys) are kept whole."""
  s = k.shape[1]
  block, nblk = _num_blocks(spec, s)
  xs = {
      "k": _split_s(k, block, nblk, 0),
      "v": _split_s(v, block, nblk, 0),
      # Padding keys added by the blocking are invalid rows: segment -1.
      "k_seg": _split_s(k_seg, block, nblk, -1),
      "k_pos": _split_s(k_pos, block, nblk, 0),
  }
  whole = {}
  num_kv_heads = k.shape[2]
  for name, arr, fill in (("bias", bias, 0), ("mask", mask, False)):
    if arr is None:
      continue
    arr = _heads_to_groups(arr, num_kv_heads)
    if arr.shape[-1] == 1:
      whole[name] = arr
    else:
      xs[name] = _split_last(arr, block, nblk, fill)
  if alibi is not None:  # [Bx, N, Tx] -> [Bx, K, G, Tx, 1], to broadcast against the logits
    whole["alibi"] = alibi.reshape(alibi.shape[0], num_kv_heads, -1, alibi.shape[-1])[..., None]
  return xs, whole, block, nblk


def _block_logits(spec: AttentionSpec, qg, q_seg, q_pos, blk):
  """Logits of one key block and their visibility.

  Returns ``(s, vis, tanh_s)``: ``s [B, K, G, T, bk]`` float32 (meaningful only where ``vis``),
  ``vis`` broadcastable to ``s``, and ``tanh(s_raw / softcap)`` for the softcap derivative.
  """
  dtype = blk["k"].dtype
  if dtype == _F32:
    # float32: the scale goes on q, before the GEMM, not on its product: XLA would fuse
    # `product * scale` into the later `s - max` as one FMA, which subtracts the rounded max from
    # the unrounded product; for |s| past ~1e9 that rounding gap alone overflows exp (inf / NaN).
    s = _einsum("btkgh,bskh->bkgts", qg * _F32(spec.scale), blk["k"], dtype)
  else:
    # bfloat16 / float16: q stays in its dtype (scaling it there would round it once more) and the
    # float32 product is scaled, as the kernels and jax.nn do.
    s = _einsum("btkgh,bskh->bkgts", qg, blk["k"], dtype) * _F32(spec.scale)
  tanh_s = None
  if spec.softcap is not None:
    cap = _F32(spec.softcap)
    tanh_s = jnp.tanh(s / cap)
    s = cap * tanh_s
  vis = visibility.visible(spec, q_seg, blk["k_seg"], q_pos, blk["k_pos"])[:, None, None]
  if "mask" in blk:
    vis = vis & blk["mask"]
  if "bias" in blk:
    bias = blk["bias"].astype(_F32)
    # A bias of -inf hides a key exactly like a mask does; elsewhere only visible entries are read.
    vis = vis & (bias != -jnp.inf)
    s = s + jnp.where(vis, bias, _F32(0))
  if "alibi" in blk:
    # |i + off - j| from the positions (int32: exact), then in float32 like the bias.
    dist = jnp.abs(q_pos[:, None, None, :, None] - blk["k_pos"][:, None, None, None, :]).astype(_F32)
    s = s + jnp.where(vis, -blk["alibi"] * dist, _F32(0))
  return s, vis, tanh_s


def _group_queries(x, num_kv_heads):
  b, t, n, h = x.shape
  return x.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

def forward(spec: AttentionSpec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, *, sinks=None,
            alibi=None):
  """Returns ``(o [B, T, N, Hv] q.dtype, lse [B, N, T] float32)``. Inputs must be sanitised.
  ``sinks``: float32 ``[N]`` sink logits, or ``None``; ``alibi``: float32 ALiBi slopes ``[1|B, N, 1|T]``
  (per query row), or ``None``."""
  o, lse, _ = forward_with_stats(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, sinks=sinks,
                                 alibi=alibi)
  return o, lse


def _grouped_sinks(sinks, num_kv_heads):
  """Sink logits ``[N]`` as ``[1, K, G, 1]``, to broadcast against the row statistics ``[B, K, G, T]``."""
  return sinks.astype(_F32).reshape(1, num_kv_heads, -1, 1)


def forward_with_stats(spec: AttentionSpec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, *,
                       sinks=None, alibi=None):
  """``(o, lse, RowStats)``: :func:`forward` and the row statistics its backward reads."""
  b, t, n, _ = q.shape
  num_kv_heads, hv = k.shape[2], v.shape[-1]
  qg = _group_queries(q, num_kv_heads)
  xs, whole, _, _ = _key_blocks(spec, k, v, bias, mask, k_seg, k_pos, alibi)
  q_valid = visibility.row_is_valid(q_seg)[:, None, None, :]

  def step(carry, blk):
    m, l, acc = carry
    s, vis, _ = _block_logits(spec, qg, q_seg, q_pos, {**blk, **whole})
    m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1))
    # While a row has seen no visible key its max is -inf; use 0 instead so that neither
    # exp(s - m) nor the rescale factor ever evaluates -inf - -inf.
    m_safe = jnp.where(m_new == -jnp.inf, _F32(0), m_new)
    p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), _F32(0))
    alpha = jnp.exp(m - m_safe)
    l = l * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + _einsum("bkgts,bskh->bkgth", p, blk["v"], v.dtype)
    return (m_new, l, acc), None

  # The carries are derived from qg so that they carry its sharding: on meshes with Explicit axes
  # (jax.set_mesh) a scan carry must keep one sharding type from its initial value to its update.
  zeros = jnp.zeros_like(jnp.moveaxis(qg[..., 0], 1, -1), dtype=_F32)  # [B, K, G, T]
  m0, l0 = jnp.full_like(zeros, -jnp.inf), zeros
  if sinks is not None:
    # The sink is the first key of every valid row (padded rows stay as without sinks): m = sink,
    # l = exp(sink - m) = 1, or nothing at all for a sink of -inf ("no sink" for that head).
    sink = _grouped_sinks(sinks, num_kv_heads)
    m0 = jnp.where(q_valid, zeros + sink, m0)
    l0 = jnp.where(q_valid & (sink != -jnp.inf), zeros + 1, l0)
  init = (m0, l0, zeros[..., None] + jnp.zeros((hv,), _F32))  # acc: [B, K, G, T, Hv]
  (m, l, acc), _ = lax.scan(step, init, xs)

  # A row has a softmax iff its running max left -inf (it saw a key, or it has a sink).  (Not
  # `l > 0`: NaN in a valid row's data must come out as NaN, as plain attention gives it, not turn the
  # row into an empty one with output 0.)  A row with a sink and no key: acc = 0, l = 1, so o = 0 and
  # lse = sink exactly.
  has_key = m != -jnp.inf
  l_safe = jnp.where(has_key, l, _F32(1))
  o = jnp.where(has_key[..., None], acc / l_safe[..., None], _F32(0))
  # lse: finite for rows with a softmax, -inf for valid rows without, exactly 0 for padding.
  log_l = jnp.where(has_key, jnp.log(l_safe), _F32(0))
  lse = jnp.where(has_key, m + log_l, jnp.where(q_valid, -jnp.inf, _F32(0)))
  m = jnp.where(q_valid, m, _F32(0))
  stats = RowStats(m, log_l, o)
  o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, n, hv).astype(q.dtype)
  return o, lse.reshape(b, n, t), stats


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

def backward(spec: AttentionSpec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, o, lse, do, dlse,
             stats: RowStats | None = None, *, sinks=None, alibi=None):
  """Gradients ``(dq, dk, dv, dbias, dsinks)`` by blockwise recomputation.

  With ``stats`` (from :func:`forward_with_stats`) P is ``exp((s - m) - log_l)`` and Delta comes
  from the float32 output; without (the ring, which merges its chunks' lse) from ``lse`` and ``o``.
  ``dsinks`` (float32 ``[N]``, ``None`` without ``sinks``): the sink of row i has probability
  ``P_sink = exp(sink - lse_i)`` and a zero value, so its gradient is ``-P_sink * Delta_i`` summed
  over the valid rows (padded rows selected away), in a fixed order.
  """
  b, t, n, _ = q.shape
  s_len, num_kv_heads = k.shape[1], k.shape[2]
  g = n // num_kv_heads
  dtype = q.dtype

  q_valid = visibility.row_is_valid(q_seg)
  do = visibility.zero_invalid_rows(do, q_seg)
  grouped = lambda x: x.reshape(b, num_kv_heads, g, t)  # noqa: E731  [B, N, T] -> [B, K, G, T]
  if stats is None:
    m, log_l = grouped(lse), jnp.zeros((b, num_kv_heads, g, t), _F32)
    o32 = jnp.moveaxis(_group_queries(o.astype(_F32), num_kv_heads), 1, 3)   # [B, K, G, T, Hv]
  else:
    m, log_l, o32 = stats
  # Delta = rowsum(dO * O) - dlse, explicitly zero in padded rows and in rows that saw no key
  # (they contribute nothing; their max is -inf and must not be subtracted from anything).
  has_key = (m != -jnp.inf) & grouped(jnp.broadcast_to(q_valid[:, None, :], (b, n, t)))
  dog = _group_queries(do, num_kv_heads)                                      # [B, T, K, G, Hv]
  m_safe = jnp.where(has_key, m, _F32(0))  # a NaN max (NaN in valid data) propagates
  log_l = jnp.where(has_key, log_l, _F32(0))
  qg = _group_queries(q, num_kv_heads)
  xs, whole, block, nblk = _key_blocks(spec, k, v, bias, mask, k_seg, k_pos, alibi)
  bias_shape = None if bias is None else bias.shape
  if o32 is None:
    # Statistics without a float32 output (the kernels' output is in the input dtype, whose rounding
    # would be all of dbias's error): Delta = rowsum(P * dP) from the P and dP recomputed here, one
    # more pass over the keys.
    def delta_step(acc, blk):
      s, vis, _ = _block_logits(spec, qg, q_seg, q_pos, {**blk, **whole})
      p = jnp.where(vis, jnp.exp(jnp.minimum(s - m_safe[..., None], _F32(0)) - log_l[..., None]), _F32(0))
      dp = _einsum("btkgh,bskh->bkgts", dog, blk["v"], dtype)
      return acc + jnp.sum(jnp.where(vis, p * dp, _F32(0)), axis=-1), None

    delta, _ = lax.scan(delta_step, jnp.zeros_like(m_safe), xs)
  else:
    delta = jnp.sum(jnp.moveaxis(dog.astype(_F32), 1, 3) * o32, axis=-1)      # [B, K, G, T]
  dlse = grouped(dlse.astype(_F32))
  dlse = jnp.where(has_key, dlse, _F32(0))
  delta = jnp.where(has_key, delta - dlse, _F32(0))

  # The sink's probability (0 where the head has none, and in rows without a softmax).
  p_sink = None
  if sinks is not None:
    sink = _grouped_sinks(sinks, num_kv_heads)
    p_sink = jnp.where(has_key, jnp.exp((sink - m_safe) - log_l), _F32(0))

  # With the whole row in this call (``stats``), dQ is also made to use Delta = rowsum(P * dP) of
  # the P and dP recomputed here: the output's P was rounded to the input dtype for its product with
  # V, so rowsum(dO * O) differs from it by that rounding, and sum_j dS_j, which must cancel a
  # component that all keys share (dQ = scale * sum_j dS_j k_j), is off by as much.  The scan sums
  # sum_j dS_j and pk = sum_j P_j k_j.  Over every key, the sink's dS = -P_sink * Delta included,
  # the dS of a row sum to dlse exactly, so eps = sum_j dS_j - P_sink * Delta - dlse is the mismatch,
  # and dQ -= scale * eps * pk replaces Delta by Delta + eps (which is rowsum(P * dP) - dlse: the
  # keys' P sum to 1 - P_sink, the sink's value is 0).  dK and dbias need no such care: a key's dS does
  # not sum to zero over the queries.  (The ring passes no ``stats``: its calls see only part of each
  # row.)
  whole_row = stats is not None

  def step(carry, blk):
    dq, eps, pk = carry
    s, vis, tanh_s = _block_logits(spec, qg, q_seg, q_pos, {**blk, **whole})
    # s <= m within a row, so s - m is finite (or -inf past float32's range: exp gives 0).  The logits
    # recomputed here may round differently from the forward's (XLA is free to emit a product another way
    # in another program), which at logits ~1e10 would put s above m by far more than exp's range:
    # min(s - m, 0) keeps P <= exp(-log l) whatever that rounding, and changes nothing where s <= m (NaN
    # still propagates).
    p = jnp.where(vis, jnp.exp(jnp.minimum(s - m_safe[..., None], _F32(0)) - log_l[..., None]), _F32(0))
    dv_blk = _einsum("bkgts,btkgh->bskh", p, dog, dtype, like=blk["v"])
    dp = _einsum("btkgh,bskh->bkgts", dog, blk["v"], dtype)
    ds = jnp.where(vis, p * (dp - delta[..., None]), _F32(0))  # d loss / d (capped logit + bias)
    dbias_blk = None
    if bias_shape is not None:
      dbias_blk = _reduce_to_bias(ds.reshape(b, n, t, ds.shape[-1]), bias_shape)
    if whole_row:
      eps = eps + jnp.sum(ds, axis=-1)
    if tanh_s is not None:
      cap_grad = 1 - tanh_s * tanh_s
      ds = ds * cap_grad
      p = p * cap_grad
    if whole_row:
      pk = pk + _einsum("bkgts,bskh->btkgh", p, blk["k"], dtype)
    ds = ds * _F32(spec.scale)
    dq = dq + _einsum("bkgts,bskh->btkgh", ds, blk["k"], dtype)
    dk_blk = _einsum("bkgts,btkgh->bskh", ds, qg, dtype, like=blk["k"])
    return (dq, eps, pk), (dk_blk, dv_blk, dbias_blk)

  dq0 = jnp.zeros_like(qg, dtype=_F32)  # keeps qg's sharding (scan carries on Explicit meshes)
  (dq, eps, pk), (dk, dv, dbias) = lax.scan(step, (dq0, jnp.zeros_like(delta), dq0), xs)
  if whole_row:
    eps = eps - dlse if p_sink is None else eps - p_sink * delta - dlse
    dq = dq - _F32(spec.scale) * jnp.moveaxis(eps, 3, 1)[..., None] * pk
  dsinks = None
  if sinks is not None:
    # The corrected Delta (above) also for the sink: rowsum(P * dP) is free of the output's rounding.
    row_delta = delta + eps if whole_row else delta
    dsinks = jnp.sum(jnp.where(has_key, -p_sink * row_delta, _F32(0)), axis=(0, 3))
    dsinks = dsinks.reshape(n).astype(sinks.dtype)

  def unblock(x):  # [nblk, B, bk, K, H] -> [B, S, K, H]
    x = jnp.moveaxis(x, 0, 1).reshape(b, nblk * block, *x.shape[3:])
    return x[:, :s_len]

  dq = dq.reshape(q.shape).astype(q.dtype)
  dk = unblock(dk).astype(k.dtype)
  dv = unblock(dv).astype(v.dtype)
  if bias_shape is not None:
    if bias_shape[-1] == 1:
      dbias = jnp.sum(dbias, axis=0)
    else:
      dbias = jnp.moveaxis(dbias, 0, -2).reshape(*bias_shape[:-1], nblk * block)[..., :s_len]
    dbias = dbias.astype(bias.dtype)
  return dq, dk, dv, dbias, dsinks


def row_stats_from_kernels(o, row_max, log_sum, num_kv_heads) -> RowStats:
  """:class:`RowStats` from the kernels' exact row statistics (``row_max``, ``log_sum`` ``[B, N, T]``:
  ``(0, +inf)`` in valid rows without a visible key, zeros in padded rows).  Without a float32 output
  (``o32`` None) :func:`backward` forms Delta from the probabilities it recomputes."""
  b, t, n, _ = o.shape
  grouped = lambda x: x.astype(_F32).reshape(b, num_kv_heads, n // num_kv_heads, t)  # noqa: E731
  empty = grouped(log_sum) == jnp.inf
  m = jnp.where(empty, -jnp.inf, grouped(row_max))
  log_l = jnp.where(empty, _F32(0), grouped(log_sum))
  return RowStats(m, log_l, None)


def _reduce_to_bias(ds, bias_shape):
  """Sum ``ds [B, N, T, bk]`` over the axes the bias broadcasts along (a bias per key/value head, ``Hx = K``:
  over each group's query heads)."""
  b, n, t, bk = ds.shape
  hx = bias_shape[1]
  if 1 < hx < n:
    ds = jnp.sum(ds.reshape(b, hx, n // hx, t, bk), axis=2)
  axes = tuple(i for i in range(3) if bias_shape[i] == 1)
  if bias_shape[3] == 1:
    axes = axes + (3,)
  return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


# --------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------

def xla_forward(spec, q, k, v, bias, mask, sinks, alibi, problem):
  return forward(spec, q, k, v, bias, mask, *problem.rows(), sinks=sinks, alibi=alibi)


def xla_forward_with_stats(spec, q, k, v, bias, mask, sinks, alibi, problem):
  return forward_with_stats(spec, q, k, v, bias, mask, *problem.rows(), sinks=sinks, alibi=alibi)


def xla_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, stats=None):
  return backward(spec, q, k, v, bias, mask, *problem.rows(), o, lse, do, dlse, stats, sinks=sinks,
                  alibi=alibi)


XLA = Backend("xla", xla_forward, xla_backward, forward_with_stats=xla_forward_with_stats)
