"""Ring (context-parallel) attention throughput: per device on P devices vs the same problem on one.

For one long sequence (default 32k tokens, bf16, 16 heads, head dim 128) it times

* ``one``: :func:`jax_padsafe.dot_product_attention` on a single device (the pure-JAX path,
  ``implementation="xla"``, i.e. the same per-block code the ring runs; ``--one-impl none`` lets
  the library pick the GPU kernel for the forward where it applies),
* ``ring``: :func:`jax_padsafe.sharding.ring_attention` with the sequence split over P devices,
  ``contiguous`` and (causal only) the load-balanced ``zigzag`` layout; its chunk pairs run on the
  GPU kernels where they express them (``--ring-impl none``, the default) or on the pure-JAX
  blocks (``--ring-impl xla``). Compare kernel rings with ``--one-impl none``.

forward and forward+backward, causal and not. It reports TFLOP/s of the whole ring, TFLOP/s per
device and the scaling efficiency ``(ring TFLOP/s / P) / one-device TFLOP/s``.

FLOPs counted: ``4 * B * N * H * pairs`` forward, ``pairs = T*S`` (non-causal) or ``T*(T+1)/2``
(causal); forward+backward counts 3.5x the forward (backward = 2.5x forward). Timing: jit, 2 warm-up calls, median of ``--rounds`` rounds of
``--iters`` calls around ``block_until_ready``.

Read the efficiency with two facts in mind: FLOPs count only the useful (visible) pairs, and the
single-device pure-JAX loop computes every key block (masked ones included) while the ring skips
chunk pairs that are wholly masked, so a causal ring can exceed an efficiency of 1. Transfers
overlap with compute only where XLA's latency-hiding scheduler moves the async
collective-permutes (default on GPUs; ``XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true``
forces it).

GPU (e.g. 2 H200s; the pure-JAX path at 32k tokens takes minutes, so a run can be split; results are
written after every row)::

    PYTHONPATH=. python benchmarks/bench_ring.py --causal true  --out $OUT/bench_ring_causal.json
    PYTHONPATH=. python benchmarks/bench_ring.py --causal false --out $OUT/bench_ring_full.json
    # shorter: --seq 16384, or --modes fwd; GQA: --kv-heads 4

CPU smoke test (4 fake devices, tiny sizes, seconds)::

    python benchmarks/bench_ring.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768, help="sequence length T = S")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: = heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--devices", type=int, default=0, help="ring size P (default: all devices)")
    ap.add_argument("--block-k", type=int, default=1024, help="keys per step of the pure-JAX loop")
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--one-impl", default="xla", choices=("xla", "none"),
                    help="implementation of the single-device baseline")
    ap.add_argument("--ring-impl", default="none", choices=("xla", "none"),
                    help="implementation of the ring's chunk pairs (none: the GPU kernels where they "
                         "express a pair, else pure JAX)")
    ap.add_argument("--skip-one", action="store_true", help="no single-device baseline (too big)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_ring.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on 4 fake CPU devices (sets XLA_FLAGS when JAX is not started)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.seq, a.batch, a.heads, a.kv_heads, a.head_dim = 256, 1, 4, 2, 16
        a.dtype, a.block_k, a.iters, a.rounds = "float32", 32, 1, 1
        a.devices = a.devices or 4
    a.kv_heads = a.kv_heads or a.heads
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.smoke and "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

    import numpy as np  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

    import jax_padsafe  # pylint: disable=g-import-not-at-top
    from jax_padsafe import sharding as jps  # pylint: disable=g-import-not-at-top

    devices = jax.devices()
    num = a.devices or len(devices)
    if num > len(devices):
        raise SystemExit(f"--devices {num} but only {len(devices)} devices")
    kinds = getattr(jax.sharding, "AxisType", None)
    mesh_devices = np.array(devices[:num])
    mesh = (jax.sharding.Mesh(mesh_devices, ("seq",), axis_types=(kinds.Auto,)) if kinds
            else jax.sharding.Mesh(mesh_devices, ("seq",)))
    dtype = jnp.dtype(a.dtype)
    b, t, n, kh, h = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    if t % (2 * num):
        raise SystemExit(f"--seq must be a multiple of 2 * devices = {2 * num}")

    keys = [jax.random.fold_in(jax.random.PRNGKey(0), i) for i in range(4)]
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    k = jax.random.normal(keys[1], (b, t, kh, h), dtype)
    v = jax.random.normal(keys[2], (b, t, kh, h), dtype)
    do = jax.random.normal(keys[3], (b, t, n, h), dtype)

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for _ in range(a.iters):
                r = fn(*args)
            jax.block_until_ready(r)
            ts.append((time.perf_counter() - t0) / a.iters)
        return float(np.median(ts))

    def with_grad(attn):
        def fb(q, k, v, do):
            o, vjp = jax.vjp(attn, q, k, v)
            return vjp(do)
        return fb

    def fwd_only(attn):
        return lambda q, k, v, do: attn(q, k, v)

    seq_x = NamedSharding(mesh, P(None, "seq", None, None))
    one_dev = jax.sharding.SingleDeviceSharding(devices[0])
    rows = []
    print(f"ring attention on {num} x {devices[0].device_kind} ({devices[0].platform}); jax "
          f"{jax.__version__}; B={b} T=S={t} N={n} K={kh} H={h} {dtype.name}", flush=True)
    for causal in [c.strip() == "true" for c in a.causal.split(",")]:
        pairs = t * (t + 1) // 2 if causal else t * t
        fwd_flops = 4 * b * n * h * pairs
        for mode in a.modes.split(","):
            flops = fwd_flops * (3.5 if mode == "fwd_bwd" else 1.0)
            wrap = with_grad if mode == "fwd_bwd" else fwd_only
            row = dict(device=devices[0].device_kind, devices=num, batch=b, seq=t, heads=n, kv_heads=kh,
                       head_dim=h, dtype=dtype.name, causal=causal, mode=mode, one_impl=a.one_impl,
                       ring_impl=a.ring_impl)
            if not a.skip_one:
                impl = None if a.one_impl == "none" else "xla"
                one = jax.jit(wrap(lambda q, k, v: jax_padsafe.dot_product_attention(
                    q, k, v, is_causal=causal, implementation=impl, block_k=a.block_k)))
                try:
                    args = [jax.device_put(x, one_dev) for x in (q, k, v, do)]
                    sec = timed(one, *args)
                    row["one_ms"] = round(sec * 1e3, 3)
                    row["one_tflops"] = round(flops / sec / 1e12, 3)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: record and go on
                    row["one_error"] = repr(e)[:300]
            for layout in (("contiguous", "zigzag") if causal else ("contiguous",)):
                ring = jax.jit(wrap(lambda q, k, v, layout=layout: jps.ring_attention(
                    q, k, v, mesh=mesh, axis_name="seq", layout=layout, is_causal=causal,
                    block_k=a.block_k, implementation=None if a.ring_impl == "none" else "xla")))
                try:
                    # Layout permutation is data preparation: done once, outside the timed region.
                    prep = (lambda x: jps.zigzag_permute(x, num)) if layout == "zigzag" else (lambda x: x)
                    args = [jax.device_put(prep(x), seq_x) for x in (q, k, v, do)]
                    sec = timed(ring, *args)
                    row[f"ring_{layout}_ms"] = round(sec * 1e3, 3)
                    row[f"ring_{layout}_tflops"] = round(flops / sec / 1e12, 3)
                    row[f"ring_{layout}_tflops_per_device"] = round(flops / sec / 1e12 / num, 3)
                    if "one_tflops" in row:
                        row[f"ring_{layout}_efficiency"] = round(flops / sec / 1e12 / num / row["one_tflops"], 3)
                except Exception as e:  # noqa: BLE001
                    row[f"ring_{layout}_error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            _dump(rows, a.out)  # after every row: a run cut short by a time limit keeps what it measured

    print(f"\n{'causal':>6} {'mode':>8} | {'1 dev TF/s':>10} | {'layout':>10} {'ring TF/s':>9} "
          f"{'per dev':>8} {'eff.':>6}")
    for r in rows:
        for layout in ("contiguous", "zigzag"):
            if f"ring_{layout}_tflops" in r or f"ring_{layout}_error" in r:
                print(f"{str(r['causal']):>6} {r['mode']:>8} | {r.get('one_tflops', float('nan')):>10.3f} | "
                      f"{layout:>10} {r.get(f'ring_{layout}_tflops', float('nan')):>9.3f} "
                      f"{r.get(f'ring_{layout}_tflops_per_device', float('nan')):>8.3f} "
                      f"{r.get(f'ring_{layout}_efficiency', float('nan')):>6.2f}")
    if a.out:
        _dump(rows, a.out)
        print(f"wrote {a.out}")
    errors = [k for r in rows for k in r if k.endswith("_error")]
    return 1 if (a.smoke and errors) else 0


def _dump(rows, path):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
