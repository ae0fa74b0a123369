"""Pure-JAX pad-safe flash attention (runs on CPU, GPU and TPU).

This is the fallback for every feature combination the GPU kernels do not cover, and the oracle the
kernels are tested against. It works on the per-row view of the canonical problem
(``jax_padsafe._core.problem``):

* Forward: an online softmax over blocks of ``block_k`` keys (``lax.scan``), so memory grows with
  ``T x block_k`` rather than ``T x S``.
* Backward: recomputes the probabilities block by block from ``(q, k, v, o, lse)``; Delta and the
  saved lse are explicitly zero in padded rows.

Pad-safety rules followed everywhere below:

* inputs are sanitised with selects before any arithmetic (done by the caller, ``attention._run``,
  and again here for the cotangents);
* masked logits are *selected* away (``jnp.where``), never multiplied by zero;
* the running max is replaced by 0 while a row has seen no visible key, so ``exp(-inf - -inf)`` is
  never evaluated;
* rows with no visible key produce ``o = 0`` and ``lse = -inf`` (valid rows) or ``lse = 0`` (padded rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_padsafe._core import visibility
from jax_padsafe._core.backend import Backend
from jax_padsafe._core.spec import AttentionSpec

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST


def _einsum(spec, a, b, like=None):
  """float32 einsum at full precision. ``like``: an array whose sharding the result takes when
  the mesh has Explicit axes and the contraction runs over a sharded axis (MQA's dK/dV sum over
  head-sharded query heads), where JAX will not guess the output sharding."""
  kw = {}
  if like is not None and _explicit_sharding(like) is not None:
    kw["out_sharding"] = _explicit_sharding(like)
  return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=_F32, **kw)


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


def _key_blocks(spec, k, v, bias, mask, k_seg, k_pos):
  """Everything that varies along the key axis, split into scan inputs (or kept whole if broadcast)."""
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
  return xs, whole, block, nblk


def _block_logits(spec: AttentionSpec, qg, q_seg, q_pos, blk):
  """Logits of one key block and their visibility.

  Returns ``(s, vis, tanh_s)``: ``s [B, K, G, T, bk]`` float32 (meaningful only where ``vis``),
  ``vis`` broadcastable to ``s``, and ``tanh(s_raw / softcap)`` for the softcap derivative.
  """
  # The scale goes on q, before the GEMM (as jax.nn does), not on its product: XLA would fuse
  # `product * scale` into the later `s - max` as one FMA, which subtracts the rounded max from the
  # unrounded product; for |s| past ~1e9 that rounding gap alone overflows exp and gives inf / NaN.
  s = _einsum("btkgh,bskh->bkgts", qg * _F32(spec.scale), blk["k"].astype(_F32))
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
  return s, vis, tanh_s


def _group_queries(x, num_kv_heads):
  b, t, n, h = x.shape
  return x.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

def forward(spec: AttentionSpec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos):
  """Returns ``(o [B, T, N, Hv] q.dtype, lse [B, N, T] float32)``. Inputs must be sanitised."""
  b, t, n, _ = q.shape
  num_kv_heads, hv = k.shape[2], v.shape[-1]
  qg = _group_queries(q.astype(_F32), num_kv_heads)
  xs, whole, _, _ = _key_blocks(spec, k, v, bias, mask, k_seg, k_pos)

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
    acc = acc * alpha[..., None] + _einsum("bkgts,bskh->bkgth", p, blk["v"].astype(_F32))
    return (m_new, l, acc), None

  # The carries are derived from qg so that they carry its sharding: on meshes with Explicit axes
  # (jax.set_mesh) a scan carry must keep one sharding type from its initial value to its update.
  zeros = jnp.zeros_like(jnp.moveaxis(qg[..., 0], 1, -1))           # [B, K, G, T]
  init = (
      jnp.full_like(zeros, -jnp.inf),
      zeros,
      zeros[..., None] + jnp.zeros((hv,), _F32),                     # [B, K, G, T, Hv]
  )
  (m, l, acc), _ = lax.scan(step, init, xs)

  # A row saw a key iff its running max left -inf.  (Not `l > 0`: NaN in a valid row's data must come
  # out as NaN, as plain attention gives it, not turn the row into an empty one with output 0.)
  has_key = m != -jnp.inf
  l_safe = jnp.where(has_key, l, _F32(1))
  o = jnp.where(has_key[..., None], acc / l_safe[..., None], _F32(0))
  q_valid = visibility.row_is_valid(q_seg)[:, None, None, :]
  # lse: finite for rows that saw a key, -inf for valid rows that saw none, exactly 0 for padding.
  lse = jnp.where(has_key, m + jnp.log(l_safe), jnp.where(q_valid, -jnp.inf, _F32(0)))
  o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, n, hv).astype(q.dtype)
  return o, lse.reshape(b, n, t)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

def backward(spec: AttentionSpec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, o, lse, do, dlse):
  """Gradients ``(dq, dk, dv, dbias)`` by blockwise recomputation from the saved ``o`` and ``lse``."""
  b, t, n, _ = q.shape
  s_len, num_kv_heads = k.shape[1], k.shape[2]
  g = n // num_kv_heads

  q_valid = visibility.row_is_valid(q_seg)
  do = visibility.zero_invalid_rows(do, q_seg).astype(_F32)
  # Delta = rowsum(dO * O) - dlse, explicitly zero in padded rows and in rows that saw no key
  # (they contribute nothing; their lse is -inf and must not be subtracted from anything).
  has_key = (lse != -jnp.inf) & q_valid[:, None, :]  # a NaN lse (NaN in valid data) propagates
  delta = jnp.transpose(jnp.sum(do * o.astype(_F32), axis=-1), (0, 2, 1))
  delta = jnp.where(has_key, delta - jnp.where(has_key, dlse.astype(_F32), _F32(0)), _F32(0))
  lse_safe = jnp.where(has_key, lse, _F32(0))
  delta = delta.reshape(b, num_kv_heads, g, t)
  lse_safe = lse_safe.reshape(b, num_kv_heads, g, t)

  qg = _group_queries(q.astype(_F32), num_kv_heads)
  dog = _group_queries(do, num_kv_heads)
  xs, whole, block, nblk = _key_blocks(spec, k, v, bias, mask, k_seg, k_pos)
  bias_shape = None if bias is None else bias.shape

  def step(dq, blk):
    s, vis, tanh_s = _block_logits(spec, qg, q_seg, q_pos, {**blk, **whole})
    p = jnp.where(vis, jnp.exp(s - lse_safe[..., None]), _F32(0))
    dv_blk = _einsum("bkgts,btkgh->bskh", p, dog, like=blk["v"])
    dp = _einsum("btkgh,bskh->bkgts", dog, blk["v"].astype(_F32))
    ds = jnp.where(vis, p * (dp - delta[..., None]), _F32(0))  # d loss / d (capped logit + bias)
    dbias_blk = None
    if bias_shape is not None:
      dbias_blk = _reduce_to_bias(ds.reshape(b, n, t, ds.shape[-1]), bias_shape)
    if tanh_s is not None:
      ds = ds * (1 - tanh_s * tanh_s)
    ds = ds * _F32(spec.scale)
    dq = dq + _einsum("bkgts,bskh->btkgh", ds, blk["k"].astype(_F32))
    dk_blk = _einsum("bkgts,btkgh->bskh", ds, qg, like=blk["k"])
    return dq, (dk_blk, dv_blk, dbias_blk)

  dq0 = jnp.zeros_like(qg)  # keeps qg's sharding (scan carries on Explicit meshes)
  dq, (dk, dv, dbias) = lax.scan(step, dq0, xs)

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
  return dq, dk, dv, dbias


def _reduce_to_bias(ds, bias_shape):
  """Sum ``ds [B, N, T, bk]`` over the axes the bias broadcasts along."""
  axes = tuple(i for i in range(3) if bias_shape[i] == 1)
  if bias_shape[3] == 1:
    axes = axes + (3,)
  return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


# --------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------

def xla_forward(spec, q, k, v, bias, mask, problem):
  return forward(spec, q, k, v, bias, mask, *problem.rows())


def xla_backward(spec, q, k, v, bias, mask, problem, o, lse, do, dlse):
  return backward(spec, q, k, v, bias, mask, *problem.rows(), o, lse, do, dlse)


XLA = Backend("xla", xla_forward, xla_backward)
