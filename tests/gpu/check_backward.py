"""GPU check of the CuTe backward kernels against a float64 reference (run on a CUDA machine).

    PYTHONPATH=. python tests/gpu/check_backward.py [--quick] [--json out.json] [--head-dims 192,256]
        [--dtypes bf16] [--no-long]

--head-dims restricts the head dims (default: every head dim the library has a backward kernel for;
--quick: 64 and 128 of those); --dtypes the dtypes; --no-long skips the long-sequence cases.

For every dtype x head dim x feature set (plain, causal top-left / bottom-right, window, window + causal
bottom-right, softcap, negative and zero scale) on a packed batch with irregular lengths (0, 1, 127, 129,
300, valid queries with no keys), gaps (seqused < segment), rows past cu_seqlens[-1] and GQA 28 q heads
over 4 kv heads, plus long sequences (4095 / 2000 / 1, GQA 7):
  * forward by ops.flash_forward, backward by bwd_ops.flash_backward with a random dO and dlse;
  * |ours - ref64| <= 2 |naive_lowp - ref64| + 1e-3 max|ref64| (max over valid rows) for dq, dk, dv;
    naive_lowp = float32 math on the same inputs, P and dS rounded to the input dtype before the GEMMs;
  * padded rows of dq/dk/dv, dq of valid rows with no visible key, and dk/dv of keys no valid query sees
    are exactly 0; no NaN/Inf anywhere;
  * every padded row of q/k/v/o/dO/lse/dlse poisoned with NaN, +Inf, -Inf, 1e30 and random huge values:
    bitwise identical gradients; two calls (deterministic=True and False) bitwise identical;
  * dirty allocator: NaN-filled buffers of the outputs' sizes allocated and freed before the call.
Exit status 0 iff everything passed.
"""

import argparse
import json
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

from jax_padsafe._cute import bwd_ops, ops
from tests.gpu.check_forward import (COMPACT_LAYOUT, DENSE_FEATURES, DENSE_LENS, DT, OVERLONG_BOUND, OVERLONG_LAYOUT,
                                     POISONS, dense_batch, many_layout, packed_batch, pad_rows, poison)
from tests.gpu.reference import attention_rows, visible_mask


def ref_backward(q, k, v, do, dlse, cu_q, cu_k, uq, uk, *, scale, causal, bottom_right, left, right, softcap,
                 o_in=None, lowp=None, xp=jnp):
    """(dq, dk, dv, seen_keys) of L = sum(o * do) + sum(lse * dlse) on the valid slices, one sequence at a time
    through `reference.attention_rows`.  lowp=None: float64 throughout (o recomputed in float64).  lowp=dtype: the
    naive low-precision attention, with Delta from o_in (the kernel's low-precision forward output)."""
    K = k.shape[1]
    g = q.shape[1] // K
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    seen = np.zeros(k.shape[0], bool)
    heads = lambda x: np.asarray(x).transpose(1, 0, 2)  # noqa: E731  [rows, N, H] -> [N, rows, H]
    for b in range(len(uq)):
        lq, lk = int(uq[b]), int(uk[b])
        if lq == 0 or lk == 0:
            continue
        sq, sk = slice(cu_q[b], cu_q[b] + lq), slice(cu_k[b], cu_k[b] + lk)
        m = visible_mask(None, None, lq, lk, causal, bottom_right, left, right)
        seen[sk] |= m.any(0)
        _, _, dqs, dks, dvs = attention_rows(
            heads(q[sq]), np.repeat(heads(k[sk]), g, axis=0), np.repeat(heads(v[sk]), g, axis=0), heads(do[sq]),
            np.asarray(dlse[:, sq]), m, scale=scale, softcap=softcap, kv_heads=K, lowp=lowp,
            o_in=None if o_in is None else heads(o_in[sq]), xp=xp)
        dq[sq], dk[sk], dv[sk] = dqs.transpose(1, 0, 2), dks.transpose(1, 0, 2), dvs.transpose(1, 0, 2)
    return dq, dk, dv, seen


def run_case(name, dtype, q, k, v, cu_q, cu_k, uq, uk, *, causal, bottom_right, left, right, softcap, rng, poisons,
             scale=None, dirty=False, rows_covered=False, loose_bound=False, ref_xp=jnp, bound=None):
    """ref_xp: where the float64 reference runs, jax.numpy on the GPU (default) or numpy on the host (for many
    short sequences, which jax.numpy would compile one shape at a time).  bound: both max_seqlens, as in
    check_forward.run_case."""
    jdt, ldt = DT[dtype]
    H = q.shape[2]
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    q, k, v = (x.astype(ldt).astype(np.float64) for x in (q, k, v))
    padq, padk = pad_rows(cu_q, uq, q.shape[0]), pad_rows(cu_k, uk, k.shape[0])
    mxq = int(np.max(np.diff(cu_q))) if len(uq) else 0
    mxk = int(np.max(np.diff(cu_k))) if len(uk) else 0
    if loose_bound:  # as check_forward.run_case: the compact tile schedule
        mxq, mxk = q.shape[0], k.shape[0]
    if bound is not None:
        mxq = mxk = bound
    wl = -1 if left is None else left
    wr = -1 if right is None else right
    meta = [jnp.asarray(x) for x in (cu_q, cu_k, uq, uk)]
    fwd = jax.jit(lambda qq, kk, vv: ops.flash_forward(
        qq, kk, vv, *meta, max_seqlen_q=mxq, max_seqlen_k=mxk, scale=scale, causal=causal,
        bottom_right=bottom_right, window_left=wl, window_right=wr, softcap=softcap or 0.0, rows_covered=rows_covered))

    def bwd_fn(det):
        return jax.jit(lambda qq, kk, vv, oo, ll, dd, dl: bwd_ops.flash_backward(
            qq, kk, vv, oo, ll, dd, dl, *meta, max_seqlen_q=mxq, max_seqlen_k=mxk, scale=scale, causal=causal,
            bottom_right=bottom_right, window_left=wl, window_right=wr, softcap=softcap or 0.0, deterministic=det,
            rows_covered=rows_covered))

    bwd, bwd_det = bwd_fn(False), bwd_fn(True)
    o, lse = fwd(jnp.asarray(q, jdt), jnp.asarray(k, jdt), jnp.asarray(v, jdt))
    o_np = np.asarray(o.astype(jnp.float32)).astype(np.float64)
    lse_np = np.asarray(lse).astype(np.float64)
    do = rng.standard_normal(q.shape).astype(ldt).astype(np.float64)
    dlse = rng.standard_normal(lse_np.shape) * 0.3
    do[padq] = 0
    dlse[:, padq] = 0

    def call(f, qq, kk, vv, oo, ll, dd, dl):
        r = f(jnp.asarray(qq, jdt), jnp.asarray(kk, jdt), jnp.asarray(vv, jdt), jnp.asarray(oo, jdt),
              jnp.asarray(ll, jnp.float32), jnp.asarray(dd, jdt), jnp.asarray(dl, jnp.float32))
        return tuple(np.asarray(x.astype(jnp.float32)) for x in r)

    args = (q, k, v, o_np, lse_np, do, dlse)
    g0 = call(bwd, *args)
    kw = dict(scale=scale, causal=causal, bottom_right=bottom_right, left=left, right=right, softcap=softcap)
    ref = ref_backward(q, k, v, do, dlse, cu_q, cu_k, uq, uk, xp=ref_xp, **kw)
    nai = ref_backward(q, k, v, do, dlse, cu_q, cu_k, uq, uk, o_in=o_np, lowp=jdt if ref_xp is jnp else ldt,
                       xp=ref_xp, **kw)
    seen = ref[3]
    fails = []
    errs = {}
    for gi, (nm, pad) in enumerate((("dq", padq), ("dk", padk), ("dv", padk))):
        ours, r, nv = g0[gi], ref[gi], nai[gi]
        if not np.all(np.isfinite(ours)):
            fails.append(f"non-finite {nm}")
        if np.any(ours[pad] != 0):
            fails.append(f"padded {nm} rows not exactly 0")
        valid = ~pad
        e = np.abs(ours - r)[valid].max(initial=0.0)
        en = np.abs(nv - r)[valid].max(initial=0.0)
        tol = 2 * en + 1e-3 * np.abs(r).max(initial=0.0) + 1e-6
        errs[nm] = (float(e), float(en))
        if not e <= tol:
            fails.append(f"{nm} error {e:.3g} > 2*{en:.3g} + eps")
    if np.any(g0[1][~seen] != 0) or np.any(g0[2][~seen] != 0):
        fails.append("dk/dv not exactly 0 for keys no valid query sees")
    empty = np.isneginf(lse_np).T  # [total_q, N] valid rows with no visible key
    if np.any(g0[0][empty] != 0):
        fails.append("dq not exactly 0 in a valid row with no visible key")
    same = lambda a, b: all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))
    if not same(call(bwd_det, *args), g0) or not same(call(bwd, *args), g0):
        fails.append("not bitwise reproducible across calls (deterministic / default)")
    for kind in poisons:
        pq = poison(q, padq, kind, rng)
        pk, pv = poison(k, padk, kind, rng), poison(v, padk, kind, rng)
        po, pdo = poison(o_np, padq, kind, rng), poison(do, padq, kind, rng)
        pl, pdl = poison(lse_np.T, padq, kind, rng).T, poison(dlse.T, padq, kind, rng).T
        if not same(call(bwd_det, pq, pk, pv, po, pl, pdo, pdl), g0):
            fails.append(f"not bitwise identical under poison {kind}")
    if dirty:
        junk = [jnp.full((x.size * 2,), jnp.nan, jnp.float32) for x in g0]
        jax.block_until_ready(junk)
        del junk
        if not same(call(bwd, *args), g0):
            fails.append("dirty allocator changed the result")
    return dict(name=name, dtype=dtype, head_dim=H, errs=errs, fails=fails)


FEATURES = {
    "plain": dict(causal=False, bottom_right=False, left=None, right=None, softcap=0.0),
    "causal_tl": dict(causal=True, bottom_right=False, left=None, right=None, softcap=0.0),
    "causal_br": dict(causal=True, bottom_right=True, left=None, right=None, softcap=0.0),
    "window_tl": dict(causal=False, bottom_right=False, left=37, right=9, softcap=0.0),
    "window_causal_br": dict(causal=True, bottom_right=True, left=100, right=None, softcap=0.0),
    "softcap_causal": dict(causal=True, bottom_right=False, left=None, right=None, softcap=30.0),
    "softcap_small": dict(causal=False, bottom_right=False, left=None, right=None, softcap=2.0),
    "neg_scale_causal": dict(causal=True, bottom_right=False, left=None, right=None, softcap=0.0, scale=-0.07),
    "zero_scale_window": dict(causal=False, bottom_right=True, left=5, right=5, softcap=0.0, scale=0.0),
}


def emulate_tiles(q, k, v, o, lse, do, dlse, cu_q, cu_k, uq, uk, *, scale, causal, bottom_right, left, right,
                  softcap, BM=64, BN=64):
    """float64 NumPy replay of the kernels' tile schedule (jax_padsafe/kernels/bwd_sm80.py + bounds.py +
    bwd_common.py): which tiles each CTA visits (m_block_range / n_block_range), when masking is skipped
    (tile_needs_mask), zero-filled rows, the lse sentinel and the selects.  Checks the index logic on the
    CPU; it says nothing about the DSL code generation."""
    total_q, N, H = q.shape
    K = k.shape[1]
    g = N // K
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(k.shape)
    for b in range(len(uq)):
        q_start, k_start = int(cu_q[b]), int(cu_k[b])
        q_len = min(max(int(uq[b]), 0), max(int(cu_q[b + 1] - cu_q[b]), 0))
        k_len = min(max(int(uk[b]), 0), max(int(cu_k[b + 1] - cu_k[b]), 0))
        off = k_len - q_len if bottom_right else 0
        big = q_len + k_len
        lw = left if left is not None and left >= 0 else big
        rw = 0 if causal else (right if right is not None and right >= 0 else big)
        if causal and right is not None and right >= 0:
            rw = 0

        def rows(x, start, r0, n, limit):  # zero-filled tile load
            t = np.zeros((n,) + x.shape[1:])
            m = max(0, min(n, limit - r0))
            t[:m] = x[start + r0:start + r0 + m]
            return t

        def stats(h, r0):
            l2 = np.full(BM, np.inf)
            d = np.zeros(BM)
            for x in range(BM):
                i = r0 + x
                if i < q_len and lse[h, q_start + i] != -np.inf:
                    l2[x] = lse[h, q_start + i]
                    d[x] = (do[q_start + i, h] * o[q_start + i, h]).sum() - dlse[h, q_start + i]
            return l2, d

        def needs_mask(nb, mb):
            m0, m_last, n0 = mb * BM, min(mb * BM + BM, q_len) - 1, nb * BN
            n_last = n0 + BN - 1
            return n_last >= k_len or n_last > m0 + off + rw or n0 < m_last + off - lw

        def tile(h, hk, mb, nb):
            m0, n0 = mb * BM, nb * BN
            qt, dot = rows(q[:, h], q_start, m0, BM, q_len), rows(do[:, h], q_start, m0, BM, q_len)
            kt, vt = rows(k[:, hk], k_start, n0, BN, k_len), rows(v[:, hk], k_start, n0, BN, k_len)
            l2, d = stats(h, m0)
            s = qt @ kt.T * scale
            t = None
            if softcap:
                th = np.tanh(s / softcap)
                t, s = 1 - th * th, softcap * th
            with np.errstate(invalid="ignore", over="ignore"):
                p = np.exp(s - l2[:, None])
            p[np.isinf(l2)] = 0
            if needs_mask(nb, mb):
                i = m0 + np.arange(BM)[:, None] + off
                j = n0 + np.arange(BN)[None, :]
                vis = (j >= np.maximum(i - lw, 0)) & (j < np.minimum(i + rw + 1, k_len))
                p = np.where(vis, p, 0.0)
            dp = dot @ vt.T
            ds = np.where(p == 0, 0.0, p * (dp - d[:, None]) * (1 if t is None else t))
            return qt, dot, kt, p, ds

        for hk in range(K):  # dK/dV kernel: one CTA per key tile
            for nb in range((k_len + BN - 1) // BN):
                n0 = nb * BN
                n_last = min(n0 + BN, k_len) - 1
                m_lo, m_hi = max(n0 - off - rw, 0), min(n_last - off + lw + 1, q_len)
                m_min = m_lo // BM
                m_max = (m_hi + BM - 1) // BM if m_hi > m_lo else m_min
                adk, adv = np.zeros((BN, H)), np.zeros((BN, H))
                for h in range(hk * g, hk * g + g):
                    for mb in range(m_min, m_max):
                        qt, dot, kt, p, ds = tile(h, hk, mb, nb)
                        adv += p.T @ dot
                        adk += ds.T @ qt
                nv = max(0, min(BN, k_len - n0))
                dk[k_start + n0:k_start + n0 + nv, hk] = scale * adk[:nv]
                dv[k_start + n0:k_start + n0 + nv, hk] = adv[:nv]
        for h in range(N):  # dQ kernel: one CTA per query tile
            for mb in range((q_len + BM - 1) // BM):
                m0 = mb * BM
                m_last = min(m0 + BM, q_len) - 1
                n_lo, n_hi = max(m0 + off - lw, 0), min(m_last + off + rw + 1, k_len)
                n_min = n_lo // BN
                n_max = (n_hi + BN - 1) // BN if n_hi > n_lo else n_min
                adq = np.zeros((BM, H))
                for nb in range(n_max - 1, n_min - 1, -1):
                    _, _, kt, _, ds = tile(h, h // g, mb, nb)
                    adq += ds @ kt
                nv = max(0, min(BM, q_len - m0))
                dq[q_start + m0:q_start + m0 + nv, h] = scale * adq[:nv]
    return dq, dk, dv


def check_emulation(cases=40, seed=1):
    """The tile schedule (emulate_tiles) against ref_backward on random packed batches and masks."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    fails = []
    for c in range(cases):
        B = int(rng.integers(1, 4))
        q_lens = rng.integers(0, 200, B)
        k_lens = rng.integers(0, 200, B)
        if c % 5 == 0:
            k_lens[0] = 0
        batch = packed_batch(rng, list(q_lens), list(k_lens), list(rng.integers(0, 5, B)),
                             list(rng.integers(0, 5, B)), int(rng.integers(0, 4)), N=4, K=2, H=16)
        q, k, v, cu_q, cu_k, uq, uk = batch
        feat = dict(causal=bool(rng.integers(0, 2)), bottom_right=bool(rng.integers(0, 2)),
                    left=[None, 0, 7, 70][rng.integers(0, 4)], right=[None, 0, 5, 100][rng.integers(0, 4)],
                    softcap=[0.0, 3.0][rng.integers(0, 2)], scale=0.3)
        from tests.gpu.reference import reference
        o, lse = reference(q, k, v, cu_q, cu_k, uq, uk, **feat)
        do = rng.standard_normal(q.shape)
        dlse = rng.standard_normal(lse.shape) * 0.3
        padq = pad_rows(cu_q, uq, q.shape[0])
        do[padq] = 0
        dlse[:, padq] = 0
        ref = ref_backward(q, k, v, do, dlse, cu_q, cu_k, uq, uk, xp=np, **feat)
        emu = emulate_tiles(q, k, v, o, lse, do, dlse, cu_q, cu_k, uq, uk, **feat)
        for nm, a, r in zip(("dq", "dk", "dv"), emu, ref[:3]):
            e = float(np.abs(a - r).max(initial=0.0))
            worst = max(worst, e)
            if not e < 1e-9:
                fails.append(f"case {c} {feat} lens q={list(q_lens)} k={list(k_lens)}: {nm} error {e:.3g}")
    print(f"tile-schedule emulation: {cases - len(set(f.split(':')[0] for f in fails))}/{cases} cases match the "
          f"float64 reference (worst error {worst:.2g})", *fails[:5], sep="\n")
    return 1 if fails else 0


def check_lowering():
    """No GPU needed: flash_backward lowers for CUDA to one jax_padsafe_bwd custom call with 11 operands
    and 5 results (dq, dk, dv, the Delta workspace, the fused-dQ workspace: empty unless opted in), also under vmap (sequential) and for negative / zero scale; unsupported static
    combinations raise NotImplementedError."""
    fails = []
    total_q, total_k, N, K, H = 40, 30, 4, 2, 128
    q = jnp.zeros((total_q, N, H), jnp.bfloat16)
    k = jnp.zeros((total_k, K, H), jnp.bfloat16)
    lse = jnp.zeros((N, total_q), jnp.float32)
    cu_q, cu_k = jnp.array([0, 20, 40], jnp.int32), jnp.array([0, 10, 30], jnp.int32)
    used = jnp.array([20, 10], jnp.int32)
    for scale in (0.1, -0.1, 0.0):
        f = lambda q, k, v, o, l, do, dl: bwd_ops.flash_backward(
            q, k, v, o, l, do, dl, cu_q, cu_k, used, used, max_seqlen_q=20, max_seqlen_k=20, scale=scale,
            causal=True, bottom_right=True, window_left=8, window_right=-1, softcap=5.0, deterministic=True)
        for fn, args in ((f, (q, k, k, q, lse, q, lse)),
                         (jax.vmap(f), tuple(jnp.stack([x, x]) for x in (q, k, k, q, lse, q, lse)))):
            txt = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            calls = [ln for ln in txt.splitlines() if "custom_call @jax_padsafe_bwd" in ln]
            ok = len(calls) == 1 and "deterministic = 1" in calls[0]
            if ok:
                ins, outs = calls[0].rsplit(" : (", 1)[1].split(") -> (")
                ok = ins.count("tensor<") == 11 and outs.count("tensor<") == 5
            if not ok:
                fails.append(f"scale {scale}: unexpected lowering {[c[:200] for c in calls]}")
    try:
        bwd_ops.flash_backward(q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32),
                               q.astype(jnp.float32), lse, q.astype(jnp.float32), lse, cu_q, cu_k, used, used,
                               max_seqlen_q=20, max_seqlen_k=20, scale=0.1, causal=False, bottom_right=False,
                               window_left=-1, window_right=-1, softcap=0.0)
        fails.append("float32 inputs did not raise NotImplementedError")
    except NotImplementedError:
        pass
    print("lowering:", "ok" if not fails else fails)
    return 1 if fails else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated case groups to run (gqa7, dense, compact, many "
                    "(compact's 1100-sequence case alone), overlong, long; default: all)")
    ap.add_argument("--json")
    ap.add_argument("--lowering", action="store_true", help="only the CPU-side lowering check (no GPU needed)")
    ap.add_argument("--head-dims", help="comma-separated head dims (default: every built one)")
    ap.add_argument("--dtypes", help="comma-separated dtypes among bf16, fp16")
    ap.add_argument("--no-long", action="store_true", help="skip the long-sequence cases")
    a = ap.parse_args()
    group = lambda g: not a.only or g in a.only.split(",")  # noqa: E731
    if a.lowering:
        return check_lowering() | check_emulation()
    jax.config.update("jax_enable_x64", True)
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, "fwd library:", ops.library_available(),
          "bwd:", bwd_ops.backward_available(), bwd_ops.built_variants()[:3], flush=True)
    if not bwd_ops.backward_available():
        print("FAIL: the kernel library has no backward kernels (run scripts/gpu_check.sh build)")
        return 1
    rng = np.random.default_rng(0)
    results = []
    dims = sorted({h for (_, _, h, _) in bwd_ops.built_variants()}) or [64, 128]
    if a.head_dims:
        want = [int(x) for x in a.head_dims.split(",") if x.strip()]
        missing = [d for d in want if d not in dims]
        if missing:
            print(f"FAIL: the library has no backward kernel for head dims {missing} (built: {dims})")
            return 1
        dims = want
    elif a.quick:
        dims = [d for d in dims if d in (64, 128)]
    dtypes = ("bf16",) if a.quick else ("bf16", "fp16")
    if a.dtypes:
        dtypes = tuple(x for x in a.dtypes.split(",") if x.strip())
    feats = ("plain", "causal_br", "softcap_causal") if a.quick else tuple(FEATURES)
    poisons = ("nan", "huge") if a.quick else tuple(POISONS)
    t0 = time.time()
    for dtype in dtypes:
        for H in dims:
            batch = packed_batch(rng, q_lens=[0, 1, 127, 129, 300, 64], k_lens=[5, 1, 127, 129, 333, 0],
                                 q_gaps=[3, 0, 1, 7, 0, 2], k_gaps=[0, 2, 1, 0, 9, 4], tail=11, lead=5, N=28, K=4, H=H)
            for i, fname in enumerate(feats if group("gqa7") else ()):
                r = run_case(f"gqa7_{fname}", dtype, *batch, rng=rng, poisons=poisons, dirty=(i == 0),
                             **FEATURES[fname])
                results.append(r)
                print(("FAIL " if r["fails"] else "ok   ") + f"{dtype} hd{H} {r['name']}: {r['errs']} {r['fails']}",
                      flush=True)
            # The dense padded layout with rows_covered=True (the lengths path of the API): no gradient memsets.
            dense = dense_batch(rng, N=28, K=4, H=H, **DENSE_LENS)
            for fname in (DENSE_FEATURES if not a.quick else ("causal_br",)) if group("dense") else ():
                r = run_case(f"dense_{fname}", dtype, *dense, rng=rng, poisons=poisons, dirty=True, rows_covered=True,
                             **FEATURES[fname])
                results.append(r)
                print(("FAIL " if r["fails"] else "ok   ") + f"{dtype} hd{H} {r['name']}: {r['errs']} {r['fails']}",
                      flush=True)
    # The compact tile schedule (see check_forward.py's compact cases): the Hopper dQ and dK/dV kernels take it
    # (the layout's keys: 21 compact key tiles against 117 dense ones), the SM80-class kernels stay dense.
    for dtype, H in [(d, h) for d in dtypes[:1] for h in dims if group("compact") or group("many")]:
        batch = packed_batch(rng, N=28, K=4, H=H, **COMPACT_LAYOUT)
        for fname in ("plain", "causal_br") if a.quick else ("plain", "causal_br", "causal_tl", "window_tl",
                                                             "softcap_causal"):
            if fname not in FEATURES or not group("compact"):
                continue
            r = run_case(f"compact_{fname}", dtype, *batch, rng=rng, poisons=("nan", "huge"), loose_bound=True,
                         **FEATURES[fname])
            results.append(r)
            print(("FAIL " if r["fails"] else "ok   ") + f"{dtype} hd{H} {r['name']}: {r['errs']} {r['fails']}",
                  flush=True)
        # 1100 short sequences: the compact search's three rounds (check_forward.many_layout).
        r = run_case("compact_many_causal_br", dtype, *packed_batch(rng, N=4, K=2, H=H, **many_layout()), rng=rng,
                     poisons=("nan", "huge"), loose_bound=True, ref_xp=np, **FEATURES["causal_br"])
        results.append(r)
        print(("FAIL " if r["fails"] else "ok   ") + f"{dtype} hd{H} {r['name']}: {r['errs']} {r['fails']}", flush=True)
    # Slots longer than the kernels' bound (check_forward.OVERLONG_LAYOUT): dense grids, then the compact ones.
    for dtype, H in [(d, h) for d in dtypes[:1] for h in dims if group("overlong")]:
        batch = packed_batch(rng, N=8, K=2, H=H, **OVERLONG_LAYOUT)
        for fname, extra in (("causal_br", dict(bound=OVERLONG_BOUND)), ("plain", dict(bound=OVERLONG_BOUND)),
                             ("causal_tl", dict(loose_bound=True))):
            r = run_case(f"overlong_{'loose_' if 'loose_bound' in extra else ''}{fname}", dtype, *batch, rng=rng,
                         poisons=("nan",), dirty=True, **extra, **FEATURES[fname])
            results.append(r)
            print(("FAIL " if r["fails"] else "ok   ") + f"{dtype} hd{H} {r['name']}: {r['errs']} {r['fails']}",
                  flush=True)
    longs = (("bf16", 128),) if a.quick else (("bf16", 64), ("bf16", 128), ("fp16", 128), ("bf16", 192),
                                               ("bf16", 256), ("fp16", 256))
    for dtype, H in longs:
        if H not in dims or dtype not in dtypes or a.no_long or not group("long"):
            continue
        batch = packed_batch(rng, q_lens=[4095, 1, 2000], k_lens=[4095, 3000, 1999], q_gaps=[1, 0, 0],
                             k_gaps=[0, 5, 0], tail=3, N=7, K=1, H=H)
        for fname in ("plain", "causal_br", "causal_tl", "window_tl"):
            r = run_case(f"long_gqa7_{fname}", dtype, *batch, rng=rng, poisons=("nan",), **FEATURES[fname])
            results.append(r)
            print(("FAIL " if r["fails"] else "ok   ") + f"{dtype} hd{H} {r['name']}: {r['errs']} {r['fails']}",
                  flush=True)
    nfail = sum(bool(r["fails"]) for r in results)
    print(f"\n{len(results) - nfail}/{len(results)} backward cases passed in {time.time() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
