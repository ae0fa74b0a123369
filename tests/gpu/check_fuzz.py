"""A longer random sweep of the contract: fresh seeds, longer sequences (several tiles, several CTAs per sequence).

    PYTHONPATH=. python tests/gpu/check_fuzz.py [--impl cute] [--dense 1000:1040] [--packed 2000:2020]
        [--max-len 1100] [--json out.json]

`tests/test_fuzz.py` draws every feature at random but keeps sequences short (< 200 rows) and its seeds fixed,
so that the pytest run stays fast.  Bugs that need length do not show there: a partial last tile after full ones,
a causal or window band that starts mid-sequence, several key tiles per CTA, multi-tile CTAs, the fused-dQ
reduction across many key tiles, window sides longer than a tile.  This draws the same problems
(`test_fuzz.draw_problem` / `draw_packed`) with lengths below `--max-len`, from seeds nobody has run, and checks
each with the whole contract (`helpers.check_problem` / `test_varlen.check_packed`): float64 oracle with the
accuracy rule, exact zeros in every padded row, bitwise invariance under NaN, +-Inf, 1e30 and random huge values
in the padding.  A failing case is reported with its seed and keeps the sweep going; exit status 0 iff every case
passed.  With `--impl cute` each case is first lowered for CUDA and must call the forward and backward kernels
(never the pure-JAX fallback), as `test_fuzz.test_gpu_draws_reach_the_kernels` asserts for the short draws.

Run it on the GPU with each kernel family: as is (sm_90a kernels on Hopper), with JAX_PADSAFE_SM90=0
JAX_PADSAFE_SM90_BWD=0 (the SM80-class kernels), and with JAX_PADSAFE_FUSED_DQ=1.  On a CPU `--impl xla`
sweeps the pure-JAX path, which draws its own (smaller) head dims, bias and masks too.
"""

import argparse
import json
import sys
import time
import traceback

import jax

import tests.gpu  # noqa: F401  (JAX_PADSAFE_POISON_OUTPUTS=1: outputs not memset start as NaN)
from tests import helpers
from tests import test_fuzz
from tests import test_varlen


def _seeds(text):
    lo, _, hi = text.partition(":")
    return range(int(lo), int(hi)) if hi else range(int(lo), int(lo) + 1)


def _masks(p):
    """The masking features of a problem, as words."""
    bits = []
    if p.causal:
        bits.append("causal-" + ("br" if p.bottom_right else "tl"))
    if p.window is not None:
        bits.append(f"window{p.window}")
    if p.softcap:
        bits.append(f"softcap{p.softcap:.1f}")
    return bits


def _describe(p, dtype):
    """One line naming what a dense case exercises, so that a failure can be read without rerunning it."""
    b, t = p.q.shape[:2]
    s, kh = p.k.shape[1], p.k.shape[2]
    bits = [f"b{b} t{t} s{s} n{p.q.shape[2]}/{kh} hd{p.q.shape[3]} {jax.numpy.dtype(dtype).name}"] + _masks(p)
    bits += [name for name, x in (("segments", p.q_ids), ("bias", p.bias), ("mask", p.mask)) if x is not None]
    return " ".join(bits)


def _describe_packed(d, dtype):
    """The same for a packed case: its sequences' used lengths."""
    return " ".join([f"seqs {len(d['used_q'])} used_q {list(map(int, d['used_q']))} "
                     f"used_k {list(map(int, d['used_k']))} n{d['q'].shape[1]}/{d['k'].shape[1]} "
                     f"hd{d['q'].shape[2]} {jax.numpy.dtype(dtype).name}"] + _masks(d["problem"])
                    + (["loose-bounds"] if d.get("loose_bounds") else []))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="cute")
    ap.add_argument("--dense", default="1000:1040", help="seed range lo:hi of dense (padded-layout) cases")
    ap.add_argument("--packed", default="2000:2020", help="seed range lo:hi of packed (varlen) cases")
    ap.add_argument("--max-len", type=int, default=1100, help="sequences (and packed capacities) shorter than this")
    ap.add_argument("--json")
    args = ap.parse_args()

    # Interleaved in proportion, so that a sweep cut off by a time limit has run both kinds (dense first, the
    # packed draws after all of them, left every packed seed unrun in a 280 s sweep).
    keyed = []
    for kind, seeds in (("dense", list(_seeds(args.dense))), ("packed", list(_seeds(args.packed)))):
        keyed += [((i + 0.5) / len(seeds), kind, seed) for i, seed in enumerate(seeds)]
    cases = [(kind, seed) for _, kind, seed in sorted(keyed)]
    results, t_all = [], time.time()
    for kind, seed in cases:
        t0, what = time.time(), "(draw failed)"
        try:
            if kind == "dense":
                p, dtype = test_fuzz.draw_problem(seed, args.impl, max_len=args.max_len)
                what = _describe(p, dtype)
                if args.impl == "cute":
                    assert test_fuzz.dense_reaches_kernels(p, dtype), "does not lower to the kernels (a fallback)"
                helpers.check_problem(p, dtype, args.impl, seed=seed)
            else:
                d, dtype, rng = test_fuzz.draw_packed(seed, args.impl, max_len=args.max_len)
                what = _describe_packed(d, dtype)
                if args.impl == "cute":
                    assert test_fuzz.packed_reaches_kernels(d, dtype), "does not lower to the kernels (a fallback)"
                test_varlen.check_packed(d, dtype, args.impl, rng)
            ok, err = True, ""
        except Exception as e:  # noqa: BLE001 (a failing case is reported and the sweep goes on)
            ok, err = False, "".join(traceback.format_exception_only(type(e), e)).strip()
        dt = time.time() - t0
        results.append(dict(kind=kind, seed=seed, case=what, ok=ok, error=err, seconds=round(dt, 1)))
        print(f"{'ok  ' if ok else 'FAIL'} {kind:6} seed {seed:5d} {dt:6.1f}s  {what}", flush=True)
        if not ok:
            print("     " + err.replace("\n", "\n     ")[:2000], flush=True)
        if args.json:  # after every case, so that a run cut off by a time limit still leaves its record
            with open(args.json, "w") as f:
                json.dump(dict(impl=args.impl, max_len=args.max_len, device=str(jax.devices()[0].device_kind),
                               results=results), f, indent=1)
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} passed in {time.time() - t_all:.0f} s "
          f"(impl {args.impl}, lengths < {args.max_len}, devices {jax.devices()})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
