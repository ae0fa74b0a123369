"""Ahead-of-time build of every CuTe DSL kernel, forward and backward (no GPU needed).

    python -m jax_padsafe.kernels.build --out DIR [--archs sm_80,sm_90a] [--dtypes bf16,fp16]
        [--head-dims 64,96,128,192,256] [--softcap 0,1] [--jobs N]

Each option defaults to its environment variable (JPS_ARCHS, JPS_DTYPES, JPS_HEAD_DIMS, JPS_SOFTCAP, JPS_AUX, JPS_JOBS),
else to the full matrix (variants.py) and the CPU count. Every variant is compiled in a worker process of a pool
(the DSL reads the target arch from CUTE_DSL_ARCH when it traces) and exported as `<export>.o` + `<export>.h`;
a variant whose cache key is unchanged (cache.py) is reused. Then the registry headers and object lists that
ffi/CMakeLists.txt links are written (registry.py).
"""

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
import traceback

from . import cache, registry
from . import variants as V
from .families import timed_compile


def _csv(s, conv=str):
    return tuple(conv(x.strip()) for x in s.split(",") if x.strip())


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m jax_padsafe.kernels.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    ap.add_argument("--out", required=True, help="output folder (reused objects are kept there)")
    ap.add_argument("--archs", default=env("JPS_ARCHS") or ",".join(V.ARCHS))
    ap.add_argument("--dtypes", default=env("JPS_DTYPES") or ",".join(V.DTYPES))
    ap.add_argument("--head-dims", default=env("JPS_HEAD_DIMS") or ",".join(map(str, V.HEAD_DIMS)))
    ap.add_argument("--softcap", default=env("JPS_SOFTCAP") or "0,1", help="0: without, 1: with softcap")
    ap.add_argument("--aux", default=env("JPS_AUX") or "0,1",
                    help="0: the variants without, 1: with mask and bias tensors (softcap off only)")
    ap.add_argument("--jobs", type=int, default=int(env("JPS_JOBS") or os.cpu_count() or 1))
    a = ap.parse_args(argv)
    archs, dtypes, head_dims = _csv(a.archs), _csv(a.dtypes), _csv(a.head_dims, int)
    softcap = _csv(a.softcap, lambda x: bool(int(x)))
    aux = _csv(a.aux, lambda x: bool(int(x)))
    for arch in archs:
        if arch not in V.ARCH_CODE:
            ap.error(f"unknown arch {arch} (known: {', '.join(V.ARCH_CODE)})")
    for d in dtypes:
        if d not in V.DTYPE_CODE:
            ap.error(f"unknown dtype {d} (known: {', '.join(V.DTYPE_CODE)})")
    for h in head_dims:
        if h not in V.TUNING["sm80"]:
            ap.error(f"head dim {h} has no tuning row (known: {', '.join(map(str, V.TUNING['sm80']))})")
    return a, V.matrix(archs, dtypes, head_dims, softcap, aux=aux) + V.zero_rows_kernels(archs)


def main(argv=None):
    a, units = _parse(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    common = cache.common_key()
    keys = {u: cache.unit_key(u, common) for u in units}
    facts, todo = {}, []
    n = len(units)
    done = 0
    for u in units:
        hit = cache.lookup(out, u, keys[u])
        if hit is None:
            todo.append(u)
        else:
            facts[u] = hit
            done += 1
            print(f"[{done}/{n}] {u.describe()} ... cached", flush=True)
    failed = []
    if todo:
        for u in todo:
            cache.invalidate(out, u)
        # spawn: a fresh interpreter per worker (no state forked from this process).
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=max(1, min(a.jobs, len(todo))), mp_context=ctx) as ex:
            futures = {ex.submit(timed_compile, (u, out)): u for u in todo}
            for fut in cf.as_completed(futures):
                done += 1
                try:
                    u, f, seconds = fut.result()
                except Exception as e:  # noqa: BLE001 - reported below; the other variants still finish and are kept
                    failed.append(futures[fut])
                    print(f"[{done}/{n}] {futures[fut].describe()} ... FAILED", flush=True)
                    traceback.print_exception(e)
                    continue
                cache.store(out, u, keys[u], f)
                facts[u] = f
                print(f"[{done}/{n}] {u.describe()} ... {seconds:.0f} s", flush=True)
    if failed:
        print(f"{len(failed)} of {n} failed: {', '.join(u.prefix for u in failed)}", file=sys.stderr, flush=True)
        return 1
    registry.write(out, units, {u.prefix: f["queue_all"] for u, f in facts.items() if "queue_all" in f})
    print(f"built {len(todo)}, cached {n - len(todo)} in {time.time() - t0:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
