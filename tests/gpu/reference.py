"""Float64 NumPy reference of the pad-safety contract on the packed layout (valid slices only),
and the 'naive low-precision' attention used for the tolerance rule."""

import numpy as np


def visible_mask(qi, kj, q_len, k_len, causal, bottom_right, left, right):
    """[q_len, k_len] bool: key j visible to query i."""
    off = (k_len - q_len) if bottom_right else 0
    i = np.arange(q_len)[:, None] + off
    j = np.arange(k_len)[None, :]
    m = np.ones((q_len, k_len), bool)
    if causal:
        m &= j <= i
    if left is not None and left >= 0:
        m &= j >= i - left
    if right is not None and right >= 0:
        m &= j <= i + right
    return m


def _attend(q, k, v, mask, scale, softcap, lowp=None, xp=np):
    """q [Lq, N, H], k/v [Lk, N, H] (kv heads already repeated); returns o [Lq,N,H], lse [N,Lq].
    `xp` is numpy or jax.numpy (the latter, with x64 enabled, to run the float64 math on a GPU)."""
    ft = xp.float32 if lowp is not None else xp.float64
    rnd = (lambda x: x.astype(lowp).astype(ft)) if lowp is not None else (lambda x: x)
    q, k, v, mask = (xp.asarray(x) for x in (q, k, v, mask))
    s = rnd(xp.matmul(q.astype(ft).transpose(1, 0, 2), k.astype(ft).transpose(1, 2, 0)))  # [N, Lq, Lk]
    s = s * scale
    if softcap:
        s = softcap * xp.tanh(s / softcap)
    s = xp.where(mask[None], s, -xp.inf)
    mx = s.max(axis=-1, keepdims=True)
    empty = ~xp.isfinite(mx)
    mx_safe = xp.where(empty, 0.0, mx)
    p = xp.where(mask[None], xp.exp(s - mx_safe), 0.0)
    l = p.sum(-1, keepdims=True)
    p = p / xp.where(empty, 1.0, l)
    o = xp.matmul(rnd(p), v.astype(ft).transpose(1, 0, 2)).transpose(1, 0, 2)  # [Lq, N, H]
    o = xp.where(empty.transpose(1, 0, 2), 0.0, o)
    lse = xp.where(empty[..., 0], -xp.inf, (mx_safe + xp.log(xp.where(empty, 1.0, l)))[..., 0])
    return np.asarray(rnd(o), np.float64), np.asarray(lse, np.float64)


def reference(q, k, v, cu_q, cu_k, used_q, used_k, *, scale, causal, bottom_right, left, right, softcap, lowp=None,
              xp=np):
    """Packed-layout outputs (o [total_q,N,H] float64, lse [N,total_q]) with padded rows 0.
    `lowp` (e.g. ml_dtypes.bfloat16) gives the naive input-dtype attention instead of float64."""
    total_q, N, H = q.shape
    K = k.shape[1]
    o = np.zeros((total_q, N, H))
    lse = np.zeros((N, total_q))
    for b in range(len(used_q)):
        lq, lk = int(used_q[b]), int(used_k[b])
        if lq == 0:
            continue
        if lk == 0:  # valid queries, no keys: o = 0, lse = -inf
            lse[:, cu_q[b]:cu_q[b] + lq] = -np.inf
            continue
        qs = q[cu_q[b]:cu_q[b] + lq]
        ks = np.repeat(k[cu_k[b]:cu_k[b] + lk], N // K, axis=1)
        vs = np.repeat(v[cu_k[b]:cu_k[b] + lk], N // K, axis=1)
        m = visible_mask(None, None, lq, lk, causal, bottom_right, left, right)
        ob, lb = _attend(qs, ks, vs, m, scale, softcap, lowp, xp)
        o[cu_q[b]:cu_q[b] + lq] = ob
        lse[:, cu_q[b]:cu_q[b] + lq] = lb
    return o, lse
