"""Where the time of a decode-shaped call goes, with and without the split-KV rewrite (GPU only).

Traces `--calls` calls of one bench_decode case with the JAX profiler and prints per call: device span, busy
and idle time, the time per category and the top device ops (ring_overhead_probe.summarise).  Run it once
with JAX_PADSAFE_SPLIT_KV=0 and once without (a process each: jax_padsafe caches its traced calls, so the
switch cannot change within a process).

    PYTHONPATH=. JAX_PADSAFE_SPLIT_KV=0 python benchmarks/experiments/decode_overhead_probe.py --case 4,1,131072,8,window4095
"""

import argparse
import glob
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ring_overhead_probe import summarise, write_timeline  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--case", default="4,1,131072,8,window4095", help="B,T,S,K[,mask] as in bench_decode")
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  a = ap.parse_args()
  import jax
  import bench_decode

  parts = a.case.split(",")
  B, T, S, K = (int(x) for x in parts[:4])
  mode = parts[4] if len(parts) > 4 else None
  q, k, v, lq, lk, _ = bench_decode.make_inputs(B, T, S, K)
  report = {}
  for split in (os.environ.get("JAX_PADSAFE_SPLIT_KV", "1"),):
    fn = bench_decode.make_fn("cute", mode)
    for _ in range(3):
      jax.block_until_ready(fn(q, k, v, lq, lk))
    logdir = os.path.join(a.out, f"decode_trace_split{split}")
    with jax.profiler.trace(logdir):
      for _ in range(a.calls):
        r = fn(q, k, v, lq, lk)
      jax.block_until_ready(r)
    trace = glob.glob(os.path.join(logdir, "plugins/profile/*/*.trace.json.gz"))[0]
    s = summarise(trace, a.calls)
    write_timeline(trace, os.path.join(a.out, f"decode_timeline_split{split}.txt"))
    shutil.rmtree(logdir)
    report[split] = s
    print(f"\n== split {split}: {a.case}: span {s['span_us']:.1f} us, busy {s['busy_us']:.1f}, idle "
          f"{s['idle_us']:.1f}, {s['kernels']:.1f} device ops per call")
    for cat, us in s["by_category_us"].items():
      print(f"   {cat:<20} {us:8.1f} us")
    for name, count, us in s["top"][:12]:
      print(f"   {us:8.1f} us {count:5.1f}x  {name}")
  with open(os.path.join(a.out, f"decode_overhead_probe_split{split}.json"), "w") as f:
    json.dump(dict(case=a.case, device=jax.devices()[0].device_kind, report=report), f, indent=1)


if __name__ == "__main__":
  main()
