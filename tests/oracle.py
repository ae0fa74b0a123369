"""Float64 NumPy oracle for the pad-safety contract.

It reads only valid data: every input is first copied into a fresh zero array through the validity
masks, so poisoned padding cannot reach it. Forward and gradients (for the loss
``sum(out * d_out) + sum(lse * d_lse)``) are computed from the textbook formulas on full
``[B, N, T, S]`` logits, independently of the blockwise code under test.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Problem:
  """A padded-layout problem in NumPy; packed tests convert to it."""
  q: np.ndarray            # [B, T, N, H]
  k: np.ndarray            # [B, S, K, H]
  v: np.ndarray            # [B, S, K, H]
  q_len: np.ndarray        # [B]
  kv_len: np.ndarray       # [B]
  q_ids: np.ndarray | None = None   # [B, T]
  kv_ids: np.ndarray | None = None  # [B, S]
  bias: np.ndarray | None = None    # broadcastable [B, N, T, S]
  mask: np.ndarray | None = None    # broadcastable [B, N, T, S] bool
  causal: bool = False
  window: tuple | None = None       # (left, right), None side = unbounded
  softcap: float | None = None
  scale: float | None = None
  bottom_right: bool = False

  @property
  def shape(self):
    b, t, n, h = self.q.shape
    return b, t, n, h, self.k.shape[1], self.k.shape[2]

  def q_valid(self):
    b, t = self.q.shape[:2]
    valid = np.arange(t)[None, :] < self.q_len[:, None]
    if self.q_ids is not None:
      valid &= self.q_ids >= 0
    return valid

  def k_valid(self):
    b, s = self.k.shape[:2]
    valid = np.arange(s)[None, :] < self.kv_len[:, None]
    if self.kv_ids is not None:
      valid &= self.kv_ids >= 0
    return valid

  def visible(self):
    """[B, N, T, S] boolean visibility (the contract's rule, written independently)."""
    b, t, n, h, s, kh = self.shape
    qv, kv = self.q_valid(), self.k_valid()
    vis = qv[:, :, None] & kv[:, None, :]
    if self.q_ids is not None:
      vis &= self.q_ids[:, :, None] == self.kv_ids[:, None, :]
    off = (self.kv_len - self.q_len) if self.bottom_right else np.zeros_like(self.q_len)
    i = np.arange(t)[None, :, None] + off[:, None, None]
    j = np.arange(s)[None, None, :]
    if self.causal:
      vis &= j <= i
    if self.window is not None:
      left, right = self.window
      if left is not None:
        vis &= j >= i - left
      if right is not None:
        vis &= j <= i + right
    vis = np.broadcast_to(vis[:, None], (b, n, t, s))
    if self.mask is not None:
      vis = vis & np.broadcast_to(self.mask, (b, n, t, s))
    if self.bias is not None:
      vis = vis & (np.broadcast_to(self.bias, (b, n, t, s)) != -np.inf)
    return vis


def _clean(x, valid):
  out = np.zeros(x.shape, np.float64)
  out[valid] = np.asarray(x, np.float64)[valid]
  return out


def _expand_kv(x, n):
  return np.repeat(x, n // x.shape[2], axis=2)


def reference(p: Problem, d_out=None, d_lse=None):
  """Returns ``dict(out, lse[, dq, dk, dv, dbias])`` in float64 (padded rows exactly 0)."""
  b, t, n, h, s, kh = p.shape
  scale = p.scale if p.scale is not None else 1.0 / np.sqrt(h)
  qv, kv = p.q_valid(), p.k_valid()
  q = _clean(p.q, qv)
  k = _expand_kv(_clean(p.k, kv), n)
  v = _expand_kv(_clean(p.v, kv), n)
  vis = p.visible()

  raw = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if p.softcap is not None:
    th = np.tanh(raw / p.softcap)
    logits = p.softcap * th
  else:
    logits = raw
  if p.bias is not None:
    bias = np.broadcast_to(np.asarray(p.bias, np.float64), (b, n, t, s))
    logits = logits + np.where(vis, bias, 0.0)
  masked = np.where(vis, logits, -np.inf)
  has = vis.any(-1)
  mx = np.where(has, masked.max(-1, initial=-np.inf), 0.0)
  e = np.where(vis, np.exp(np.where(vis, masked, 0.0) - mx[..., None]), 0.0)
  l = e.sum(-1)
  l_safe = np.where(has, l, 1.0)
  prob = e / l_safe[..., None]
  out = np.einsum("bnts,bsnh->btnh", prob, v)
  lse = np.where(has, mx + np.log(l_safe), np.where(qv[:, None, :], -np.inf, 0.0))
  result = dict(out=out, lse=lse, visible=vis)
  if d_out is None:
    return result

  do = _clean(d_out, qv)
  dl = np.where(qv[:, None, :] & has, np.asarray(d_lse, np.float64), 0.0) if d_lse is not None \
      else np.zeros((b, n, t))
  dv = np.einsum("bnts,btnh->bsnh", prob, do)
  dp = np.einsum("btnh,bsnh->bnts", do, v)
  delta = np.einsum("btnh,btnh->bnt", do, out) - dl
  ds = np.where(vis, prob * (dp - delta[..., None]), 0.0)
  dbias = None
  if p.bias is not None:
    dbias = ds
    for axis in range(4):
      if p.bias.shape[axis] == 1:
        dbias = dbias.sum(axis=axis, keepdims=True)
  if p.softcap is not None:
    ds = ds * (1 - th * th)
  ds = ds * scale
  dq = np.einsum("bnts,bsnh->btnh", ds, k)
  dk = np.einsum("bnts,btnh->bsnh", ds, q)
  g = n // kh
  dk = dk.reshape(b, s, kh, g, h).sum(3)
  dv = dv.reshape(b, s, kh, g, h).sum(3)
  result.update(dq=dq, dk=dk, dv=dv, dbias=dbias)
  return result
