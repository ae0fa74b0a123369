"""GPU check: tensors with more than 2**31 elements (run on a CUDA machine with >= 60 GB of memory).

    PYTHONPATH=. python tests/gpu/check_large.py [--json out.json] [--layouts varlen,dense] [--tokens 2250000]

Why: the kernels take int32 sizes and int64 row strides.  A row offset computed in 32 bits would wrap once
q/k/v hold more than 2**31 elements (e.g. 2.1M packed tokens x 8 heads x 128), and the kernels would read
and write another sequence's rows, silently.  This check runs forward and backward through the public API
(implementation="cute") on

  * varlen: ~2.25M packed tokens, 8 heads (q and kv), head dim 128, bf16, causal; irregular lengths and gaps
    (seqused < segment) whose rows hold NaN;
  * dense: [B, 4096, 8, 128] with B chosen so that q holds more than 2**31 elements, random lengths, +Inf
    in the padded rows;

and compares the sequences at the start, the one straddling element 2**31 and the last one, bitwise, with
the same sequence run alone (O, lse, dq, dk, dv), and the straddling one with a float64 reference
(tolerance rule of check_forward / check_backward).  Run it with JAX_PADSAFE_SM90=0 JAX_PADSAFE_SM90_BWD=0
too, for the SM80-class kernels, and with JAX_PADSAFE_FUSED_DQ=1 for the opt-in fused-dQ backward (its fp32
workspace needs ~9 GB more).  Exit status 0 iff everything passed.  A dry run of the check itself on a CPU:
`--impl xla --limit 200000 --tokens 2000 --seq 128` (the pure-JAX path; comparisons close, not bitwise).
"""

import argparse
import json
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

import jax_padsafe
from tests.gpu.reference import visible_mask

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


def _reference(q, k, v, g, causal, lowp):
    """o and dq of one sequence (q/k/v [L, N, H]) for the loss sum(o * g) + sum(lse), by jax on the GPU:
    lowp=False in float64 (x64 on), lowp=True in float32 with P rounded to bf16 before P V (the 'naive low
    precision' attention whose error sets the tolerance)."""
    ft = np.float32 if lowp else np.float64
    qs, ks, vs, gs = (jnp.asarray(np.asarray(x, ft)) for x in (q, k, v, g))
    L = qs.shape[0]
    mask = jnp.asarray(visible_mask(None, None, L, L, causal, False, None, None))

    def f(qs, ks, vs):
        s = jnp.einsum("qnh,knh->nqk", qs, ks) / np.sqrt(H)
        s = jnp.where(mask[None], s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - lse[..., None])
        if lowp:
            p = p.astype(DT).astype(jnp.float32)
        o = jnp.einsum("nqk,knh->qnh", p, vs)
        return jnp.sum(o * gs) + jnp.sum(lse), o

    (_, o), dq = jax.value_and_grad(f, has_aux=True)(qs, ks, vs)
    assert o.dtype == ft
    return np.asarray(o), np.asarray(dq)


def _accuracy(name, ours_o, ours_dq, q, k, v, g, causal, report):
    o64, dq64 = _reference(q, k, v, g, causal, lowp=False)
    olp, dqlp = _reference(q, k, v, g, causal, lowp=True)
    ok = True
    for what, ours, r64, rlp in (("o", ours_o, o64, olp), ("dq", ours_dq, dq64, dqlp)):
        err = np.abs(np.asarray(ours, np.float64) - r64).max()
        bound = 2 * np.abs(rlp - r64).max() + 1e-3 * np.abs(r64).max()
        good = bool(np.isfinite(err) and err <= bound)
        report.append(dict(case=f"{name} {what} vs float64", ok=good, err=float(err), bound=float(bound)))
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
            ok &= _accuracy(f"varlen seq {b}", np.asarray(o[r], np.float32), np.asarray(dq[r], np.float32),
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
            ok &= _accuracy(f"dense batch {b}", np.asarray(o[b, :L], np.float32), np.asarray(dq[b, :L], np.float32),
                            q[b, :L], k[b, :L], v[b, :L], np.asarray(g[b, :L]), False, report)
    return ok


def main():
    global LIMIT, IMPL
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--layouts", default="varlen,dense")
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
