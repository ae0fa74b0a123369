"""GPU check of the CuTe forward kernel against the float64 reference (run on a CUDA machine).

    PYTHONPATH=. python tests/gpu/check_forward.py [--quick] [--json out.json]

For every dtype x head dim x feature set (plain, causal top-left / bottom-right, sliding window,
window + causal bottom-right, softcap) on a packed batch with irregular lengths (0, 1, 127, 129, ...),
gaps (seqused < segment), rows past cu_seqlens[-1] and GQA 28 q heads over 4 kv heads:
  * every padded row of q/k/v is poisoned with NaN, +Inf, -Inf, 1e30 and random huge values and the
    outputs must be bitwise identical to the zero-padded run;
  * padded o/lse rows must be exactly 0; no NaN/Inf except lse = -inf for valid rows with no visible key;
  * the same after NaN-filled buffers were allocated and freed (dirty allocator), and on the dense padded
    layout with rows_covered=True, where the handler skips the memset of o and the kernel writes the zeros;
  * |ours - ref64| <= 2 |naive_lowp - ref64| + 1e-3 (max over valid entries), for o and lse;
  * a batch large enough that the Hopper kernel runs several query tiles per CTA ("multitile_*");
  * slots longer than max_seqlen, a lead and a tail ("overlong_*"), whose rows past the tiles the row-zeroing
    kernel writes in place of a memset (ffi/jps_zero_rows.h).
Outputs the library does not memset start as NaN (JAX_PADSAFE_POISON_OUTPUTS=1, set by tests/gpu/__init__.py;
"poison_hook" checks that it took effect), so every exact-zero check also checks that some kernel wrote the row.
Exit status 0 iff everything passed.
"""

import argparse
import json
import os
import sys
import time

import ml_dtypes
import numpy as np

import jax
import jax.numpy as jnp

from jax_padsafe._cute import ops
from tests.gpu.reference import reference

DT = {"bf16": (jnp.bfloat16, ml_dtypes.bfloat16), "fp16": (jnp.float16, np.float16)}
POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "1e30": 1e30, "huge": None}


def packed_batch(rng, q_lens, k_lens, q_gaps, k_gaps, tail, N, K, H, lead=0):
    """Sequences back to back after `lead` unused rows, each followed by its gap, then `tail` rows."""
    cu_q = (lead + np.concatenate([[0], np.cumsum(np.add(q_lens, q_gaps))])).astype(np.int32)
    cu_k = (lead + np.concatenate([[0], np.cumsum(np.add(k_lens, k_gaps))])).astype(np.int32)
    tq, tk = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail
    q = rng.standard_normal((tq, N, H))
    k = rng.standard_normal((tk, K, H))
    v = rng.standard_normal((tk, K, H))
    return q, k, v, cu_q, cu_k, np.array(q_lens, np.int32), np.array(k_lens, np.int32)


def dense_batch(rng, q_lens, k_lens, T, S, N, K, H):
    """The padded [B, T] / [B, S] layout flattened: sequence b owns rows [b*T, (b+1)*T) (slots of
    max_seqlen rows, no gaps between slots, no tail), so the kernels' tiles cover every row and the
    call may pass rows_covered=True (no output memset: the kernels write the padded rows' zeros)."""
    return packed_batch(rng, q_lens, k_lens, [T - x for x in q_lens], [S - x for x in k_lens], 0, N, K, H)


DENSE_LENS = dict(q_lens=[0, 1, 127, 129, 300, 64], k_lens=[5, 1, 127, 129, 333, 0], T=320, S=345)
# The compact tile schedule's cases (with loose_bound=True): one long sequence among short and empty ones, the
# first starting past row 300 (so the first compact tiles are holes), gaps and a tail.
COMPACT_LAYOUT = dict(q_lens=[0, 1300, 1, 127, 129, 0, 64, 3, 200], k_lens=[4, 700, 1, 127, 0, 130, 64, 3, 257],
                      q_gaps=[3, 0, 1, 7, 0, 2, 0, 129, 0], k_gaps=[0, 2, 1, 0, 9, 4, 0, 1, 0], tail=11, lead=300)


# Slots longer than the bound the kernels are given (OVERLONG_BOUND >= every used length): what a jitted step with
# traced offsets and a sequence past max_seqlen gets, and the segment-id runs (a batch row's last run reaches into
# the next row).  The tiles cover ceil(bound / block) tiles per slot, so the rows of slots 0, 1 and 2 past the
# bound, the lead and the tail are the row-zeroing kernel's (ffi/jps_zero_rows.h) with the dense grid; with
# loose_bound=True the compact grid covers every slot row instead.
OVERLONG_LAYOUT = dict(q_lens=[100, 37, 0, 128, 5], k_lens=[90, 128, 3, 60, 0], q_gaps=[300, 200, 150, 1, 0],
                       k_gaps=[0, 260, 140, 3, 200], tail=7, lead=20)
OVERLONG_BOUND = 128


def many_layout(n=1100, seed=17):
    """The compact cases' second layout: n short sequences (0-40 rows, one of 300 queries and one of 300 keys)
    with gaps, a lead and a tail.  The compact search tests 32 candidates per round, so 1100 sequences take
    three rounds (1100 -> 35 -> 2 -> 1 candidates), where COMPACT_LAYOUT's nine take one."""
    rng = np.random.default_rng(seed)
    q_lens, k_lens = rng.integers(0, 41, n), rng.integers(0, 41, n)
    q_lens[n // 2], k_lens[n // 3] = 300, 300
    return dict(q_lens=q_lens.tolist(), k_lens=k_lens.tolist(), q_gaps=rng.integers(0, 4, n).tolist(),
                k_gaps=rng.integers(0, 4, n).tolist(), tail=5, lead=37)


def pad_rows(cu, used, total):
    pad = np.ones(total, bool)
    for b in range(len(used)):
        pad[cu[b]:cu[b] + used[b]] = False
    return pad


def poison(x, pad, kind, rng):
    x = np.array(x, copy=True)
    if kind == "huge":
        x[pad] = rng.uniform(-1, 1, x[pad].shape) * 6e4
    else:
        x[pad] = POISONS[kind]
    return x


def run_case(name, dtype, q, k, v, cu_q, cu_k, uq, uk, *, causal, bottom_right, left, right, softcap, rng, poisons,
             scale=None, rows_covered=False, loose_bound=False, ref_xp=None, bound=None):
    """loose_bound: max_seqlen_q/k = the packed lengths (the API's default), not the longest sequence, which
    makes the kernels take the compact tile schedule (kernels/bounds.py) when it halves the grid.  bound: both
    max_seqlens (below the longest slot, at least the longest used length).  ref_xp: numpy forces the float64
    reference onto the host (for many short sequences, which jax.numpy would compile one shape at a time)."""
    jdt, ldt = DT[dtype]
    H = q.shape[2]
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    # inputs exactly representable in the low-precision dtype
    q, k, v = (x.astype(ldt).astype(np.float64) for x in (q, k, v))
    padq, padk = pad_rows(cu_q, uq, q.shape[0]), pad_rows(cu_k, uk, k.shape[0])
    kw = dict(scale=scale, causal=causal, bottom_right=bottom_right, left=left, right=right, softcap=softcap)
    xp = ref_xp or (jnp if jax.config.jax_enable_x64 else np)
    ref_o, ref_l = reference(q, k, v, cu_q, cu_k, uq, uk, xp=xp, **kw)
    nai_o, nai_l = reference(q, k, v, cu_q, cu_k, uq, uk, lowp=jdt if xp is jnp else ldt, xp=xp, **kw)
    mxq = int(np.max(np.diff(cu_q))) if len(uq) else 0
    mxk = int(np.max(np.diff(cu_k))) if len(uk) else 0
    if loose_bound:
        mxq, mxk = q.shape[0], k.shape[0]
    if bound is not None:
        mxq = mxk = bound
    f = jax.jit(lambda *a: ops.flash_forward(
        *a, max_seqlen_q=mxq, max_seqlen_k=mxk, scale=scale, causal=causal, bottom_right=bottom_right,
        window_left=-1 if left is None else left, window_right=-1 if right is None else right, softcap=softcap or 0.0,
        rows_covered=rows_covered))
    meta = [jnp.asarray(x) for x in (cu_q, cu_k, uq, uk)]

    def call(qq, kk, vv):
        o, l = f(jnp.asarray(qq, jdt), jnp.asarray(kk, jdt), jnp.asarray(vv, jdt), *meta)
        return np.asarray(o.astype(jnp.float32)), np.asarray(l)

    o0, l0 = call(q, k, v)
    fails = []
    valid_q = ~padq
    # padded rows exactly 0
    if np.any(o0[padq] != 0) or np.any(l0[:, padq] != 0):
        fails.append("padded o/lse rows not exactly 0")
    # finiteness
    empty = np.isneginf(ref_l)
    if not np.all(np.isfinite(o0)):
        fails.append("non-finite o")
    if np.any(~np.isfinite(l0) & ~empty) or np.any(l0[empty] != -np.inf):
        fails.append("lse non-finite where a key is visible, or not -inf for an empty row")
    eo = np.abs(o0 - ref_o)[valid_q].max(initial=0.0)
    en = np.abs(nai_o - ref_o)[valid_q].max(initial=0.0)
    fin = np.isfinite(ref_l)
    el = np.abs(l0 - ref_l)[fin].max(initial=0.0)
    enl = np.abs(nai_l - ref_l)[fin].max(initial=0.0)
    if not eo <= 2 * en + 1e-3:
        fails.append(f"o error {eo:.3g} > 2*{en:.3g}+1e-3")
    if not el <= 2 * enl + 1e-3:
        fails.append(f"lse error {el:.3g} > 2*{enl:.3g}+1e-3")
    # empty valid rows: o exactly 0
    if np.any(o0[empty.T] != 0):
        fails.append("o not exactly 0 in a valid row with no visible key")
    for kind in poisons:
        op, lp = call(poison(q, padq, kind, rng), poison(k, padk, kind, rng), poison(v, padk, kind, rng))
        if not (np.array_equal(op.view(np.uint32), o0.view(np.uint32)) and np.array_equal(lp.view(np.uint32), l0.view(np.uint32))):
            fails.append(f"not bitwise identical under poison {kind}")
    # dirty allocator: NaN-filled buffers of the outputs' sizes allocated and freed before the call, so o/lse
    # likely land on NaN memory (what the memset, or with rows_covered the kernel's zero rows, must hide)
    junk = [jnp.full((x.size * 2,), jnp.nan, jnp.float32) for x in (o0, l0)]
    jax.block_until_ready(junk)
    del junk
    od, ld = call(q, k, v)
    if not (np.array_equal(od.view(np.uint32), o0.view(np.uint32)) and np.array_equal(ld.view(np.uint32), l0.view(np.uint32))):
        fails.append("dirty allocator changed the result")
    return dict(name=name, dtype=dtype, head_dim=H, o_err=float(eo), o_naive_err=float(en), lse_err=float(el),
                lse_naive_err=float(enl), fails=fails)


def check_vmap(rng):
    """vmap over a stacked q (vmap_method="sequential") equals the per-slice calls bitwise."""
    q, k, v, cu_q, cu_k, uq, uk = packed_batch(rng, [5, 130], [7, 129], [1, 0], [0, 2], 3, N=8, K=2, H=128)
    qs = jnp.asarray(np.stack([q, -q * 0.5]), jnp.bfloat16)
    kj, vj = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    meta = [jnp.asarray(x) for x in (cu_q, cu_k, uq, uk)]
    f = lambda qq: ops.flash_forward(qq, kj, vj, *meta, max_seqlen_q=131, max_seqlen_k=131, scale=0.1, causal=True,
                                     bottom_right=True, window_left=-1, window_right=-1, softcap=0.0)
    ov, lv = jax.jit(jax.vmap(f))(qs)
    fails = []
    for i in range(2):
        o1, l1 = jax.jit(f)(qs[i])
        if not (np.array_equal(np.asarray(ov[i]).view(np.uint16), np.asarray(o1).view(np.uint16))
                and np.array_equal(np.asarray(lv[i]).view(np.uint32), np.asarray(l1).view(np.uint32))):
            fails.append(f"vmap slice {i} differs from the direct call")
    return dict(name="vmap_sequential", dtype="bf16", head_dim=128, o_err=0.0, o_naive_err=0.0, lse_err=0.0,
                lse_naive_err=0.0, fails=fails)


def check_poison_hook(rng):
    """The checks' premise: outputs the library does not memset start as NaN (JAX_PADSAFE_POISON_OUTPUTS=1, set by
    tests/gpu/__init__.py).  A call that falsely promises rows_covered on a layout with a tail makes the Hopper
    kernel's handler skip both the memset and the row zeroing, so the tail rows of o must come back NaN; were
    they 0, a row no kernel writes could pass every other check here.  Only the sm90 forward skips memsets, so
    elsewhere (JAX_PADSAFE_SM90=0, other GPUs) the tail must be 0 instead."""
    q, k, v, cu_q, cu_k, uq, uk = packed_batch(rng, [50, 130], [70, 129], [1, 0], [0, 2], 9, N=8, K=2, H=128)
    meta = [jnp.asarray(x) for x in (cu_q, cu_k, uq, uk)]
    o, _ = jax.jit(lambda qq, kk, vv: ops.flash_forward(
        qq, kk, vv, *meta, max_seqlen_q=130, max_seqlen_k=129, scale=0.1, causal=False, bottom_right=False,
        window_left=-1, window_right=-1, softcap=0.0, rows_covered=True))(
            *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    tail = np.asarray(o.astype(jnp.float32))[int(cu_q[-1]):]
    hopper = getattr(jax.devices()[0], "compute_capability", "") == "9.0"
    sm90 = hopper and os.environ.get("JAX_PADSAFE_SM90", "1") != "0"
    hooked = os.environ.get("JAX_PADSAFE_POISON_OUTPUTS") == "1"
    fails = []
    if sm90 and hooked and not np.all(np.isnan(tail)):
        fails.append("poison hook inactive: unwritten rows of o are not NaN")
    if not sm90 and np.any(tail != 0):
        fails.append("memset o has nonzero tail rows")
    return dict(name="poison_hook", dtype="bf16", head_dim=128, o_err=0.0, o_naive_err=0.0, lse_err=0.0,
                lse_naive_err=0.0, fails=fails)


FEATURES = {
    "plain": dict(causal=False, bottom_right=False, left=None, right=None, softcap=0.0),
    "causal_tl": dict(causal=True, bottom_right=False, left=None, right=None, softcap=0.0),
    "causal_br": dict(causal=True, bottom_right=True, left=None, right=None, softcap=0.0),
    "window_tl": dict(causal=False, bottom_right=False, left=37, right=9, softcap=0.0),
    "window_causal_br": dict(causal=True, bottom_right=True, left=100, right=None, softcap=0.0),
    "softcap_causal": dict(causal=True, bottom_right=False, left=None, right=None, softcap=30.0),
    "neg_scale_causal": dict(causal=True, bottom_right=False, left=None, right=None, softcap=0.0, scale=-0.07),
    "zero_scale_window": dict(causal=False, bottom_right=True, left=5, right=5, softcap=0.0, scale=0.0),
}
DENSE_FEATURES = ("plain", "causal_tl", "window_causal_br", "softcap_causal")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated case groups to run (gqa7, dense, long, multitile, "
                    "compact, many (compact's 1100-sequence case alone), overlong, vmap, hook; default: all)")
    ap.add_argument("--json")
    ap.add_argument("--no-long", action="store_true", help="skip the ~4k-token cases")
    ap.add_argument("--dims", default="", help="comma-separated head dims (default: all, or 64,128 with --quick)")
    ap.add_argument("--dtypes", default="", help="comma-separated dtypes (default: bf16,fp16, or bf16 with --quick)")
    ap.add_argument("--numpy-ref", action="store_true", help="float64 reference in NumPy on the host "
                    "(default: the same float64 code through jax.numpy on the GPU, much faster)")
    a = ap.parse_args()
    group = lambda g: not a.only or g in a.only.split(",")  # noqa: E731
    if not a.numpy_ref:
        jax.config.update("jax_enable_x64", True)
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, "library:", ops.library_available())
    rng = np.random.default_rng(0)
    results = []
    dims = (64, 128) if a.quick else (64, 96, 128, 192, 256)
    dtypes = ("bf16",) if a.quick else ("bf16", "fp16")
    # A restricted kernel library (an experiment's variant) is checked on what it was built for.
    dims = tuple(int(d) for d in a.dims.split(",")) if a.dims else dims
    dtypes = tuple(a.dtypes.split(",")) if a.dtypes else dtypes
    feats = ("plain", "causal_br") if a.quick else tuple(FEATURES)
    poisons = ("nan", "huge") if a.quick else tuple(POISONS)
    t0 = time.time()
    for dtype in dtypes:
        for H in dims:
            batch = packed_batch(rng, q_lens=[0, 1, 127, 129, 300, 64], k_lens=[5, 1, 127, 129, 333, 0],
                                 q_gaps=[3, 0, 1, 7, 0, 2], k_gaps=[0, 2, 1, 0, 9, 4], tail=11, lead=5, N=28, K=4, H=H)
            for fname in feats if group("gqa7") else ():
                results.append(run_case(f"gqa7_{fname}", dtype, *batch, rng=rng, poisons=poisons, **FEATURES[fname]))
            # The dense padded layout with rows_covered=True (the lengths path of the API): no memset of o.
            dense = dense_batch(rng, N=28, K=4, H=H, **DENSE_LENS)
            for fname in (DENSE_FEATURES if not a.quick else ("causal_br",)) if group("dense") else ():
                results.append(run_case(f"dense_{fname}", dtype, *dense, rng=rng, poisons=poisons, rows_covered=True,
                                        **FEATURES[fname]))
    # long irregular sequences (GQA 7: 7 q heads over 1 kv head)
    long_cases = (() if a.no_long or not group("long") else (("bf16", 128),) if a.quick else (("bf16", 64), ("bf16", 128), ("fp16", 256)))
    for dtype, H in [(d, h) for d, h in long_cases if h in dims and d in dtypes]:
        batch = packed_batch(rng, q_lens=[4095, 1000], k_lens=[4093, 4097], q_gaps=[1, 0], k_gaps=[0, 3],
                             tail=5, N=7, K=1, H=H)
        for fname in ("plain", "causal_br", "causal_tl"):
            results.append(run_case(f"long_{fname}", dtype, *batch, rng=rng, poisons=("nan",), **FEATURES[fname]))
    # Enough tiles that the shipped Hopper forward runs several query tiles per CTA (tiles per CTA =
    # clamp(tiles // 264, 1, 4); here 10 m-blocks x 28 heads x 6 sequences = 1680 -> 4), which the small
    # cases above never reach with the default build: tiles of different sequences and heads in one CTA,
    # tiles wholly past a sequence's length between them, and (head dims < 128) the L2 prefetch of each
    # CTA's next tile.
    multi_feats = ("causal_br",) if a.quick else ("plain", "causal_br", "window_causal_br", "softcap_causal")
    for dtype, H in [(d, h) for d in dtypes[:1] for h in dims if h <= 128 and group("multitile")]:
        # (short keys where they do not change the tile count, to keep the float64 reference cheap)
        batch = packed_batch(rng, q_lens=[1200, 0, 513, 129, 1000, 7], k_lens=[390, 300, 500, 700, 0, 9],
                             q_gaps=[0, 5, 0, 3, 1, 0], k_gaps=[2, 0, 0, 1, 0, 6], tail=9, N=28, K=4, H=H)
        for fname in multi_feats:
            results.append(run_case(f"multitile_{fname}", dtype, *batch, rng=rng, poisons=("nan", "huge"),
                                    **FEATURES[fname]))
    # The compact tile schedule: max_seqlen left at the packed lengths, so ceil(max_seqlen / 128) tiles per
    # sequence would be mostly past the short sequences' ends.  One long sequence among short and empty ones,
    # the first sequence starting past row 300 (compact tiles before the first sequence are holes), gaps and
    # a tail; enough heads for several tiles per CTA.
    compact_feats = ("causal_br", "plain") if a.quick else ("plain", "causal_br", "causal_tl", "window_causal_br",
                                                            "softcap_causal")
    for dtype, H in [(d, h) for d in dtypes[:1] for h in dims if group("compact") or group("many")]:
        batch = packed_batch(rng, N=28, K=4, H=H, **COMPACT_LAYOUT)
        for fname in compact_feats if group("compact") else ():
            results.append(run_case(f"compact_{fname}", dtype, *batch, rng=rng, poisons=("nan", "huge"),
                                    loose_bound=True, **FEATURES[fname]))
        batch = packed_batch(rng, N=4, K=2, H=H, **many_layout())
        results.append(run_case("compact_many_causal_br", dtype, *batch, rng=rng, poisons=("nan", "huge"),
                                loose_bound=True, ref_xp=np, **FEATURES["causal_br"]))
    # Slots longer than the kernels' bound, with the dense grid (rows past the bound: the row-zeroing kernel's) and
    # the compact one, every head dim.
    for dtype, H in [(d, h) for d in dtypes[:1] for h in dims if group("overlong")]:
        batch = packed_batch(rng, N=8, K=2, H=H, **OVERLONG_LAYOUT)
        for fname in ("causal_br", "plain") if a.quick else ("plain", "causal_br", "window_causal_br"):
            results.append(run_case(f"overlong_{fname}", dtype, *batch, rng=rng, poisons=("nan",),
                                    bound=OVERLONG_BOUND, **FEATURES[fname]))
        results.append(run_case("overlong_loose_causal_tl", dtype, *batch, rng=rng, poisons=("nan",),
                                loose_bound=True, **FEATURES["causal_tl"]))
    if 128 in dims and "bf16" in dtypes and group("vmap"):  # the vmap check runs hd128 bf16
        results.append(check_vmap(rng))
    if 128 in dims and "bf16" in dtypes and group("hook"):
        results.append(check_poison_hook(rng))
    nfail = 0
    for r in results:
        status = "PASS" if not r["fails"] else "FAIL " + "; ".join(r["fails"])
        nfail += bool(r["fails"])
        print(f"{r['dtype']} hd{r['head_dim']:<3} {r['name']:<22} o_err {r['o_err']:.2e} (naive {r['o_naive_err']:.2e}) "
              f"lse_err {r['lse_err']:.2e} (naive {r['lse_naive_err']:.2e})  {status}")
    print(f"{len(results) - nfail}/{len(results)} cases passed in {time.time() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, results=results), fh, indent=1)
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
