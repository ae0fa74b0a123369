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


def attention_rows(qs, ks, vs, dos, dl, mask, *, scale, softcap=None, kv_heads=None, keys=None, lowp=None, o_in=None,
                   xp=np):
    """Attention of some query rows of one sequence and its gradients, for the loss sum(o * do) + sum(lse * dl):
    the float64 reference (lowp=None), or the naive low-precision attention of the tolerance rule (lowp = the
    input dtype: float32 math, P and dS rounded to lowp before their GEMMs, Delta from O in lowp, O and the
    gradients returned in lowp, lse in float32).

    qs / dos [N, R, H], ks / vs [N, L, H] (kv heads already repeated to N), dl [N, R], mask [R, L] bool (key j
    visible to row r).  `o_in` [N, R, H]: the O that Delta uses (a kernel's own low-precision output); default
    this function's O, rounded to lowp.  Rows with no visible key get o = 0, lse = -inf, dq = 0.  dk / dv are
    the contributions of these rows only, summed over each kv head's query heads (`kv_heads`, default N), for
    the keys `keys` (default all): complete when every row that sees those keys is among the rows.
    Returns float64 NumPy arrays (o, lse, dq, dk, dv), head-major: [N, R, H], [N, R], [N, R, H], [K, L', H] x 2.
    `xp` is numpy or jax.numpy (with x64 enabled, to run the float64 math on a GPU)."""
    ft = xp.float64 if lowp is None else xp.float32
    rnd = (lambda x: x) if lowp is None else (lambda x: x.astype(lowp).astype(ft))
    qs, ks, vs, dos, dl = (xp.asarray(x, ft) for x in (qs, ks, vs, dos, dl))
    m = xp.asarray(mask)[None]
    s = xp.matmul(qs, ks.transpose(0, 2, 1)) * scale                              # [N, R, L]
    t = None
    if softcap:
        t = xp.tanh(s / softcap)
        s = softcap * t
    s = xp.where(m, s, -xp.inf)
    mx = s.max(-1, keepdims=True)
    has = xp.isfinite(mx)
    mxs = xp.where(has, mx, 0.0)
    e = xp.where(m, xp.exp(s - mxs), 0.0)
    l = xp.where(has, e.sum(-1, keepdims=True), 1.0)
    p = e / l
    lse = xp.where(has, mxs + xp.log(l), -xp.inf)[..., 0]
    pr = rnd(p)
    o = xp.matmul(pr, vs)
    o_delta = rnd(o) if o_in is None else xp.asarray(o_in, ft)
    delta = xp.where(has[..., 0], (dos * o_delta).sum(-1) - dl, 0.0)               # [N, R]
    dp = xp.matmul(dos, vs.transpose(0, 2, 1))
    ds = xp.where(m & has, p * (dp - delta[..., None]), 0.0)
    if t is not None:
        ds = ds * (1 - t * t)
    ds = rnd(ds)
    dq = xp.matmul(ds, ks) * scale
    if keys is not None:
        kk = xp.asarray(keys)
        ds, pr = ds[:, :, kk], pr[:, :, kk]
    dk = xp.matmul(ds.transpose(0, 2, 1), qs) * scale
    dv = xp.matmul(pr.transpose(0, 2, 1), dos)
    n = qs.shape[0]
    kh = kv_heads or n
    fold = lambda x: x.reshape(kh, n // kh, *x.shape[1:]).sum(1)  # noqa: E731
    return [np.asarray(x, np.float64) for x in (rnd(o), lse, rnd(dq), rnd(fold(dk)), rnd(fold(dv)))]
