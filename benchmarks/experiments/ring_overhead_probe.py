"""Where the time of a ring-attention call goes: kernels, the small ops around them, and idle gaps.

    PYTHONPATH=. python benchmarks/experiments/ring_overhead_probe.py [--devices 1] [--seq 16384]
        [--causal true] [--layout zigzag] [--mode fwd] [--out DIR]

Times ``sharding.ring_attention`` on a ring of ``--devices`` GPUs (1 works: the chunk pairs of
the zigzag layout still run as separate launches) against ``dot_product_attention`` on one GPU for
the same problem, then records a JAX profiler trace of a few ring calls and summarises device 0's
stream activity per call: total kernel time by kind (the attention kernels, collectives, the rest),
the busy time (union of kernel intervals) and the idle time between the first and last kernel.
A ring that is slower than its kernel time explains is paying for gaps (host syncs of
``lax.cond``/``lax.switch`` predicates, launch latency) or for the small ops around the kernels.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import time


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--devices", type=int, default=0, help="ring size (default: all devices)")
  ap.add_argument("--causal", default="true")
  ap.add_argument("--layout", default="zigzag")
  ap.add_argument("--mode", default="fwd", choices=("fwd", "fwd_bwd"))
  ap.add_argument("--calls", type=int, default=3, help="ring calls inside the trace")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--tag", default="")
  ap.add_argument("--documents", type=int, default=0,
                  help="pack this many documents per row (segment ids; 0: one sequence)")
  ap.add_argument("--per-pair", action="store_true",
                  help="force the ring's per-pair path (the grouped plan off), for comparison")
  return ap.parse_args(argv)


def categorise(name):
  low = name.lower()
  if "jax_padsafe" in low or "flash" in low or "kernel_cutlass" in low or "cutlass" in low:
    return "attention kernels"
  if "nccl" in low or "collective" in low or "permute" in low:
    return "collectives"
  if "memset" in low or "memcpy" in low:
    return "memset/memcpy"
  return "other XLA ops"


def summarise(trace_file, calls):
  with gzip.open(trace_file, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  pname = {}
  tname = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      pname[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      tname[(e["pid"], e["tid"])] = e["args"]["name"]
  gpu0 = [p for p, n in pname.items() if n.endswith("GPU:0")]
  kern = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu0 and "dur" in e
          and "stream" in tname.get((e["pid"], e["tid"]), "").lower()]
  if not kern:  # fall back: every complete event of a GPU process
    kern = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu0 and "dur" in e]
  kern.sort(key=lambda e: e["ts"])
  by_cat = collections.defaultdict(float)
  by_name = collections.defaultdict(lambda: [0, 0.0])
  # Long (CuTe DSL) kernel names differ at their end (e.g. the `_0` / `_1` of one export's two kernels).
  short = lambda n: n if len(n) <= 90 else n[:70] + "..." + n[-17:]  # noqa: E731
  for e in kern:
    by_cat[categorise(e["name"])] += e["dur"]
    by_name[short(e["name"])][0] += 1
    by_name[short(e["name"])][1] += e["dur"]
  # busy = union of intervals
  busy, cur_s, cur_e = 0.0, None, None
  for e in kern:
    s, t = e["ts"], e["ts"] + e["dur"]
    if cur_e is None or s > cur_e:
      if cur_e is not None:
        busy += cur_e - cur_s
      cur_s, cur_e = s, t
    else:
      cur_e = max(cur_e, t)
  if cur_e is not None:
    busy += cur_e - cur_s
  span = (kern[-1]["ts"] + kern[-1]["dur"] - kern[0]["ts"]) if kern else 0.0
  out = {"processes": sorted(set(pname.values()))[:12], "kernels": len(kern) / calls, "span_us": span / calls, "busy_us": busy / calls,
         "idle_us": (span - busy) / calls,
         "by_category_us": {k: v / calls for k, v in sorted(by_cat.items())},
         "top": sorted(((n, c / calls, d / calls) for n, (c, d) in by_name.items()),
                       key=lambda x: -x[2])[:25]}
  return out


def write_timeline(trace_file, path):
  """Every device event in time order: GPU, stream, start (us from the first), duration, name."""
  with gzip.open(trace_file, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  pname = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  dev = [e for e in events if e.get("ph") == "X" and "dur" in e
         and "GPU" in pname.get(e.get("pid"), "")]
  dev.sort(key=lambda e: e["ts"])
  t0 = dev[0]["ts"] if dev else 0
  with open(path, "w") as f:
    for e in dev:
      f.write(f"{pname[e['pid']][-5:]} {e['tid']:>6} {e['ts'] - t0:12.1f} {e['dur']:10.1f}  "
              f"{e['name'][:100]}\n")


def main(argv=None):
  a = parse_args(argv)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jax_padsafe  # pylint: disable=g-import-not-at-top
  from jax_padsafe import sharding as jps  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  num = a.devices or len(devices)
  mesh = jax.sharding.Mesh(np.array(devices[:num]), ("seq",))
  b, t, n, h = 1, a.seq, a.heads, a.head_dim
  causal = a.causal == "true"
  ks = [jax.random.fold_in(jax.random.PRNGKey(1), i) for i in range(4)]
  q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in ks)

  def grad_of(attn):
    def fb(q, k, v, do):
      o, vjp = jax.vjp(attn, q, k, v)
      return vjp(do)
    return fb

  if a.per_pair:
    jps._grouped_eligible = lambda *args: False  # pylint: disable=protected-access
  kw = {}
  if a.documents > 1:  # equal documents in natural order, laid out like the sequence
    ids = (np.arange(t) * a.documents // t).astype(np.int32)[None]
    order = jps.zigzag_indices(t, num) if a.layout == "zigzag" else np.arange(t)
    kw = dict(query_segment_ids=jnp.asarray(ids[:, order]), key_value_segment_ids=jnp.asarray(ids[:, order]))
    one_kw = dict(query_segment_ids=jnp.asarray(ids), key_value_segment_ids=jnp.asarray(ids))
  else:
    one_kw = {}

  def ring(q, k, v):
    return jps.ring_attention(q, k, v, mesh=mesh, axis_name="seq", layout=a.layout,
                              is_causal=causal, **kw)

  def one(q, k, v):
    return jax_padsafe.dot_product_attention(q, k, v, is_causal=causal, **one_kw)

  wrap = (lambda f: (lambda q, k, v, do: f(q, k, v))) if a.mode == "fwd" else grad_of
  ring_fn, one_fn = jax.jit(wrap(ring)), jax.jit(wrap(one))
  sx = NamedSharding(mesh, P(None, "seq", None, None))
  rargs = [jax.device_put(x, sx) for x in (q, k, v, do)]

  def timed(fn, args):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(3):
      t0 = time.perf_counter()
      for _ in range(a.iters):
        r = fn(*args)
      jax.block_until_ready(r)
      ts.append((time.perf_counter() - t0) / a.iters)
    return float(np.median(ts)) * 1e3

  one_ms = timed(one_fn, (q, k, v, do))
  ring_ms = timed(ring_fn, rargs)
  row = dict(device=devices[0].device_kind, devices=num, seq=t, heads=n, head_dim=h, causal=causal,
             layout=a.layout, mode=a.mode, documents=a.documents, per_pair=a.per_pair, one_ms=round(one_ms, 3), ring_ms=round(ring_ms, 3),
             ideal_ring_ms=round(one_ms / num, 3))
  print(json.dumps(row), flush=True)

  logdir = os.path.join(a.out, f"ring_trace{a.tag}")
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(a.calls):
      r = ring_fn(*rargs)
    jax.block_until_ready(r)
  files = glob.glob(os.path.join(logdir, "plugins/profile/*/*.trace.json.gz"))
  shutil.copy(files[0], os.path.join(a.out, f"ring_trace{a.tag}.json.gz"))  # flat: easy to fetch
  write_timeline(files[0], os.path.join(a.out, f"timeline{a.tag}.txt"))
  s = summarise(files[0], a.calls)
  row["trace"] = s
  print(f"per call on GPU 0: {s['kernels']:.0f} kernels, span {s['span_us']:.0f} us, busy "
        f"{s['busy_us']:.0f} us, idle {s['idle_us']:.0f} us")
  for cat, us in s["by_category_us"].items():
    print(f"  {cat:20s} {us:9.0f} us")
  print("  top kernels (count per call, us per call):")
  for name, c, d in s["top"]:
    print(f"    {c:5.1f} {d:9.1f}  {name}")
  with open(os.path.join(a.out, f"ring_overhead{a.tag}.json"), "w") as f:
    json.dump(row, f, indent=1)


if __name__ == "__main__":
  main()
