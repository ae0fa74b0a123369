"""GPU check of big problems: tensors with more than 2**31 elements, and one very long sequence (run on a CUDA
machine with >= 60 GB of memory).

    PYTHONPATH=. python tests/gpu/check_large.py [--json out.json] [--layouts varlen,dense,long] [--tokens 2250000]
        [--long 131072]

Why: the kernels take int32 sizes and int64 row strides.  A row offset computed in 32 bits would wrap once
q/k/v hold more than 2**31 elements (e.g. 2.1M packed tokens x 8 heads x 128), and the kernels would read
and write another sequence's rows, silently; and a 128k-token sequence walks 1000 tiles deep.  This check
runs forward and backward through the public API (implementation="cute") on

  * varlen: ~2.25M packed tokens, 8 heads (q and kv), head dim 128, bf16, causal; irregular lengths and gaps
    (seqused < segment) whose rows hold NaN;
  * dense: [B, 4096, 8, 128] with B chosen so that q holds more than 2**31 elements, random lengths, +Inf
    in the padded rows;
  * long: one causal sequence of 131072 tokens (GQA 8 / 2) in a slot 1000 rows longer holding NaN or 1e30;

For varlen and dense, the sequences at the start, the one straddling element 2**31 and the last one are compared
bitwise with the same sequence run alone (O, lse, dq, dk, dv), and the straddling one, whole, with float64.  For
long, the first and last 64 rows (and the last 64 keys' dk, dv, which only those rows see) are compared with
float64, and the results with NaN and with 1e30 in the padding bitwise.  The tolerance is check_backward's:
|ours - ref64| <= 2 |naive - ref64| + 1e-3 max|ref64|, the naive attention computing in float32 with P and dS
rounded to bf16 before their GEMMs, Delta from O in bf16, and O and the gradients returned in bf16.

Run it with JAX_PADSAFE_SM90=0 JAX_PADSAFE_SM90_BWD=0 too, for the SM80-class kernels, and with
JAX_PADSAFE_FUSED_DQ=1 for the opt-in fused-dQ backward (its fp32 workspace needs ~9 GB more).  Exit status 0
iff everything passed.  A dry run of the check itself on a CPU: `--impl xla --limit 200000 --tokens 2000 --seq 128
--long 700` (the pure-JAX path; comparisons with the sequences alone are close, not bitwise).
"""

import argparse
import json
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

import jax_padsafe
from tests.gpu.reference import attention_rows

N, H = 8, 128
DT = jnp.bfloat16
LIMIT = 2 ** 31  # --limit lowers it (with --impl xla) for a dry run of the check itself on a CPU
IMPL = "cute"


def _loss_and_grads(fn, q, k, v, g):
    def loss(q, k, v, g):  # g an argument, not a captured constant (gigabytes of it would be baked in)
        o, lse = fn(q, k, v)
        dot = jnp.sum(o.astype(jnp.float32) * g.astype(jnp.float32))
        return dot + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, g)
    return o, lse, grads


def _same(a, b):
    """Bitwise for the kernels.  The pure-JAX path (a dry run with --impl xla) is only close: XLA's fusions
    and blockings depend on the batch shape."""
    a, b = np.asarray(a), np.asarray(b)
    if IMPL != "cute":
        return a.shape == b.shape and np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=2e-2, atol=1e-2)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _accuracy(name, ours, q, k, v, g, causal, report):
    """ours = (o, lse, dq, dk, dv) of one whole sequence against float64, by the contract's tolerance rule."""
    every = np.arange(q.shape[0])
    ref = _reference(q, k, v, g, every, every, H ** -0.5, causal, lowp=False)
    lowp = _reference(q, k, v, g, every, every, H ** -0.5, causal, lowp=True)
    return _judge(name, [np.asarray(x, np.float64) for x in ours], ref, lowp, ("o", "lse", "dq", "dk", "dv"), report)


def _judge(name, ours, ref, lowp, names, report):
    """|ours - ref64| <= 2 |naive_lowp - ref64| + 1e-3 max|ref64| (max over the compared entries)."""
    ok = True
    for what, a, r, n in zip(names, ours, ref, lowp):
        err = np.abs(a - r).max()
        bound = 2 * np.abs(n - r).max() + 1e-3 * np.abs(r).max()
        good = bool(np.isfinite(err) and err <= bound)
        report.append(dict(case=f"{name}: {what} vs float64", ok=good, err=float(err), bound=float(bound)))
        ok &= good
    return ok


def check_varlen(total_tokens, max_len, report):
    rng = np.random.default_rng(0)
    lens, used = [], []
    while sum(lens) < total_tokens:
        seg = int(rng.integers(1, max_len + 1))
        lens.append(seg)
        used.append(seg if rng.random() < 0.5 else int(rng.integers(0, seg + 1)))
    lens, used = np.array(lens), np.array(used, np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    assert T * N * H > LIMIT, "the check needs more than 2**31 elements per tensor"
    key = jax.random.PRNGKey(1)
    kq, kk, kv, kg = jax.random.split(key, 4)
    rowvalid = np.zeros(T, bool)
    for b in range(len(lens)):
        rowvalid[cu[b]: cu[b] + used[b]] = True
    pad = jnp.asarray(~rowvalid)[:, None, None]
    mk = lambda k_: jnp.where(pad, jnp.nan, jax.random.normal(k_, (T, N, H), DT))
    q, k, v = mk(kq), mk(kk), mk(kv)
    g = jax.random.normal(kg, (T, N, H), DT)  # bf16: the fused-dQ run needs the memory
    print(f"varlen: {len(lens)} sequences, {T} tokens, {T * N * H / 2 ** 30:.2f} Gi elements per tensor", flush=True)

    def fn(q, k, v, cu=cu, used=used):
        return jax_padsafe.varlen_attention(q, k, v, jnp.asarray(cu), jnp.asarray(cu), seqused_q=jnp.asarray(used),
                                            seqused_k=jnp.asarray(used), is_causal=True, return_lse=True,
                                            implementation=IMPL, max_seqlen_q=max_len, max_seqlen_k=max_len)

    t0 = time.time()
    o, lse, (dq, dk, dv) = _loss_and_grads(fn, q, k, v, g)
    jax.block_until_ready(dv)
    print(f"  full batch fwd+bwd {time.time() - t0:.1f} s", flush=True)
    straddle = int(np.searchsorted(cu, LIMIT // (N * H), side="right") - 1)
    picks = {"first": 0, "straddling 2**31": straddle, "last": len(lens) - 1}
    ok = True
    for label, b in picks.items():
        while used[b] == 0 and b > 0:
            b -= 1
        s = slice(int(cu[b]), int(cu[b + 1]))
        cu1 = np.array([0, lens[b]], np.int32)
        o1, lse1, (dq1, dk1, dv1) = _loss_and_grads(
            lambda a, b_, c: fn(a, b_, c, cu=cu1, used=used[b:b + 1]), q[s], k[s], v[s], g[s])
        outs = dict(o=(o[s], o1), lse=(lse[:, s], lse1), dq=(dq[s], dq1), dk=(dk[s], dk1), dv=(dv[s], dv1))
        for name, (a, b_) in outs.items():
            same = _same(a, b_)
            report.append(dict(case=f"varlen {label} (seq {b}, rows {s.start}..{s.stop}) {name} bitwise", ok=same))
            ok &= same
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in (o[s], dq[s], dk[s], dv[s]))
        report.append(dict(case=f"varlen {label} finite", ok=finite))
        ok &= finite
        if label == "straddling 2**31":
            u = int(used[b])
            r = slice(int(cu[b]), int(cu[b]) + u)
            ok &= _accuracy(f"varlen seq {b}", (o[r], lse[:, r], dq[r], dk[r], dv[r]),
                            q[r], k[r], v[r], np.asarray(g[r]), True, report)
    del q, k, v, g, o, lse, dq, dk, dv
    return ok


def check_dense(S, report):
    B = LIMIT // (S * N * H) + 8
    rng = np.random.default_rng(2)
    lens = rng.integers(1, S + 1, size=B).astype(np.int32)
    lens[B - 1] = S
    key = jax.random.PRNGKey(3)
    kq, kk, kv, kg = jax.random.split(key, 4)
    pad = jnp.arange(S)[None, :, None, None] >= jnp.asarray(lens)[:, None, None, None]
    mk = lambda k_: jnp.where(pad, jnp.inf, jax.random.normal(k_, (B, S, N, H), DT))
    q, k, v = mk(kq), mk(kk), mk(kv)
    g = jax.random.normal(kg, (B, S, N, H), DT)
    print(f"dense: B={B}, S={S}, {B * S * N * H / 2 ** 30:.2f} Gi elements per tensor", flush=True)

    def fn(q, k, v, lens=lens):
        return jax_padsafe.dot_product_attention(q, k, v, query_seq_lengths=jnp.asarray(lens),
                                                 key_value_seq_lengths=jnp.asarray(lens), return_lse=True,
                                                 implementation=IMPL)

    t0 = time.time()
    o, lse, (dq, dk, dv) = _loss_and_grads(fn, q, k, v, g)
    jax.block_until_ready(dv)
    print(f"  full batch fwd+bwd {time.time() - t0:.1f} s", flush=True)
    picks = {"first": 0, "straddling 2**31": LIMIT // (S * N * H), "last": B - 1}
    ok = True
    for label, b in picks.items():
        s = slice(b, b + 1)
        o1, lse1, (dq1, dk1, dv1) = _loss_and_grads(lambda a, b_, c: fn(a, b_, c, lens=lens[s]), q[s], k[s], v[s],
                                                     g[s])
        outs = dict(o=(o[s], o1), lse=(lse[s], lse1), dq=(dq[s], dq1), dk=(dk[s], dk1), dv=(dv[s], dv1))
        for name, (a, b_) in outs.items():
            same = _same(a, b_)
            report.append(dict(case=f"dense {label} (batch {b}, len {lens[b]}) {name} bitwise", ok=same))
            ok &= same
        L = int(lens[b])
        zeros = all(bool(jnp.all(x[b, L:] == 0)) for x in (o, dq, dk, dv))
        report.append(dict(case=f"dense {label} padded rows exactly 0", ok=zeros))
        ok &= zeros
        if label == "straddling 2**31":
            ok &= _accuracy(f"dense batch {b}", (o[b, :L], lse[b, :, :L], dq[b, :L], dk[b, :L], dv[b, :L]),
                            q[b, :L], k[b, :L], v[b, :L], np.asarray(g[b, :L]), False, report)
    return ok


def _reference(q, k, v, g, rows, keys, scale, causal, lowp):
    """o, lse, dq of the query rows `rows` and dk, dv of the keys `keys` of one sequence (causal: top-left),
    for the loss sum(o * g) + sum(lse), computed from those rows alone: valid when every row that sees a
    key of `keys` is in `rows` (all rows; or the last keys of a causal sequence, seen only by its last rows).
    q [L, N, H], k / v [L, K, H] (GQA: query head h uses kv head h // (N // K)); float64, or (lowp) the naive
    attention of the tolerance rule, as check_backward's (`reference.attention_rows`).  Row-major results:
    o / dq [R, N, H], lse [N, R], dk / dv [len(keys), K, H]."""
    n, kh = q.shape[1], k.shape[1]
    rows = np.asarray(rows)
    heads = lambda x: jnp.asarray(x).transpose(1, 0, 2)  # noqa: E731  [rows, N, H] -> [N, rows, H]
    rep = lambda x: jnp.repeat(heads(x), n // kh, axis=0)  # noqa: E731
    mask = np.ones((len(rows), k.shape[0]), bool)
    if causal:
        mask = np.arange(k.shape[0])[None, :] <= rows[:, None]
    o, lse, dq, dk, dv = attention_rows(heads(q[rows]), rep(k), rep(v), heads(g[rows]), jnp.ones((n, len(rows))), mask,
                                        scale=scale, kv_heads=kh, keys=keys, lowp=DT if lowp else None, xp=jnp)
    t = lambda x: x.transpose(1, 0, 2)  # noqa: E731
    return [t(o), lse, t(dq), t(dk), t(dv)]


def check_long(L, report):
    """One causal sequence of L tokens (GQA 8 / 2, hd128), its slot 1000 rows longer and NaN there: the
    first and last 64 query rows (O, lse, dq) and the last 64 keys (dk, dv) against float64 (the
    contract's tolerance rule), exact zeros in the slot's padding, and bitwise the same with 1e30 there."""
    n, kh, slot = 8, 2, L + 1000
    key = jax.random.PRNGKey(4)
    kq, kk, kv, kg = jax.random.split(key, 4)
    pad = (jnp.arange(slot) >= L)[:, None, None]
    mk = lambda k_, heads, poison: jnp.where(pad, poison, jax.random.normal(k_, (slot, heads, H), DT))  # noqa: E731
    g = jax.random.normal(kg, (slot, n, H), DT)
    cu = np.array([0, slot], np.int32)
    used = np.array([L], np.int32)
    print(f"long: one causal sequence of {L} tokens (slot {slot}), {n}/{kh} heads", flush=True)

    def fn(q, k, v):
        return jax_padsafe.varlen_attention(q, k, v, jnp.asarray(cu), jnp.asarray(cu), seqused_q=jnp.asarray(used),
                                            seqused_k=jnp.asarray(used), is_causal=True, return_lse=True,
                                            implementation=IMPL, max_seqlen_q=slot, max_seqlen_k=slot)

    outs = {}
    for poison in (jnp.nan, 1e30):
        q, k, v = mk(kq, n, poison), mk(kk, kh, poison), mk(kv, kh, poison)
        t0 = time.time()
        o, lse, grads = _loss_and_grads(fn, q, k, v, g)
        jax.block_until_ready(grads)
        print(f"  fwd+bwd {time.time() - t0:.1f} s (padding {poison})", flush=True)
        outs[poison] = (o, lse) + tuple(grads)
    names = ("o", "lse", "dq", "dk", "dv")
    ok = True
    for name, a, b in zip(names, outs[jnp.nan], outs[1e30]):
        same = _same(a, b)
        report.append(dict(case=f"long {L}: {name} bitwise the same with NaN and 1e30 padding", ok=same))
        ok &= same
    o, lse, dq, dk, dv = outs[jnp.nan]
    zeros = all(bool(jnp.all(x[L:] == 0)) for x in (o, dq, dk, dv)) and bool(jnp.all(lse[:, L:] == 0))
    report.append(dict(case=f"long {L}: padded rows exactly 0", ok=zeros))
    ok &= zeros
    q, k, v = mk(kq, n, 0.0)[:L], mk(kk, kh, 0.0)[:L], mk(kv, kh, 0.0)[:L]
    gl = g[:L]
    edge = 64
    for label, rows, keys in (("first rows", np.arange(edge), None), ("last rows and keys", np.arange(L - edge, L),
                                                                      np.arange(L - edge, L))):
        kk_ = keys if keys is not None else np.arange(1)
        ref = _reference(q, k, v, gl, rows, kk_, H ** -0.5, True, lowp=False)
        lowp = _reference(q, k, v, gl, rows, kk_, H ** -0.5, True, lowp=True)
        ours = [o[rows], lse[:, rows], dq[rows], dk[kk_], dv[kk_]]
        ours = [np.asarray(x, np.float64) for x in ours]
        take = [i for i, nm in enumerate(names) if keys is not None or nm not in ("dk", "dv")]
        # (the first keys are seen by every row: not computable from a few rows)
        ok &= _judge(f"long {L}, {label}", [ours[i] for i in take], [ref[i] for i in take],
                     [lowp[i] for i in take], [names[i] for i in take], report)
    return ok


def main():
    global LIMIT, IMPL
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--layouts", default="varlen,dense,long")
    ap.add_argument("--long", type=int, default=131072, help="tokens of the one long sequence")
    ap.add_argument("--tokens", type=int, default=2_250_000, help="packed tokens of the varlen case")
    ap.add_argument("--seq", type=int, default=4096, help="longest sequence (varlen) / padded length (dense)")
    ap.add_argument("--limit", type=int, default=LIMIT, help="element count to exceed (lower: dry run)")
    ap.add_argument("--impl", default="cute")
    a = ap.parse_args()
    LIMIT, IMPL = a.limit, a.impl
    if jax.default_backend() != "gpu" and IMPL == "cute":
        print("no GPU: nothing to check")
        return 0
    jax.config.update("jax_enable_x64", True)  # the float64 reference; every array of the check is typed
    report = []
    ok = True
    t0 = time.time()
    if "varlen" in a.layouts:
        ok &= check_varlen(a.tokens, a.seq, report)
    if "dense" in a.layouts:
        ok &= check_dense(a.seq, report)
    if "long" in a.layouts:
        ok &= check_long(a.long, report)
    for r in report:
        print(("PASS " if r["ok"] else "FAIL ") + r["case"] + (f"  err {r['err']:.3g} <= {r['bound']:.3g}"
                                                              if "err" in r else ""))
    print(f"{sum(r['ok'] for r in report)}/{len(report)} passed in {time.time() - t0:.0f} s on "
          f"{jax.devices()[0].device_kind}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, ok=bool(ok), results=report), fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
