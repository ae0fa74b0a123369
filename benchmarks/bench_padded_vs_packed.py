"""What padding costs: the same valid tokens as a padded batch and as a packed batch, on the kernels.

The aim: a padded batch costs no more than 3% over the same valid tokens packed.
For each case a padded batch [B, S] with lengths drawn uniformly in [0.4 S, S] (~30% padding) runs
through `dot_product_attention(query_seq_lengths=, key_value_seq_lengths=)`, and the same valid rows,
packed back to back without gaps, run through `varlen_attention(cu_seqlens)`. Both use the public
API with implementation="cute" (the default dispatch on a GPU), forward and forward+backward.
Reported: milliseconds of each and padded / packed - 1 (the overhead of padding).

    PYTHONPATH=. python benchmarks/bench_padded_vs_packed.py [--out F] [--seqs 2048,8192] [--dims 128]

Timing: `bench_forward.bench` (jit, 2 warm-up calls, median of 5 rounds of back-to-back calls).
"""

import argparse
import json
import os

import numpy as np

import jax
import jax.numpy as jnp

import jax_padsafe
from bench_forward import bench  # the benchmarks' one timing rule (seconds)


def with_grad(f):
    """f(q, k, v) -> out  ==>  one forward+backward step returning (dq, dk, dv)."""
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)))


def case(rng, dim, seq, causal, tokens, dtype):
    heads = 2048 // dim
    batch = max(1, tokens // seq)
    lens = rng.integers(int(0.4 * seq), seq + 1, size=batch).astype(np.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), dtype) for _ in range(3))
    lens_j = jnp.asarray(lens)

    def padded(q, k, v):
        return jax_padsafe.dot_product_attention(q, k, v, is_causal=causal, query_seq_lengths=lens_j,
                                                 key_value_seq_lengths=lens_j, implementation="cute")

    # The same valid rows, back to back.
    pack = lambda x: jnp.concatenate([x[b, :lens[b]] for b in range(batch)], axis=0)
    pq, pk, pv = pack(q), pack(k), pack(v)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)

    def packed(q, k, v):
        return jax_padsafe.varlen_attention(q, k, v, cu, cu, max_seqlen_q=seq, max_seqlen_k=seq,
                                            is_causal=causal, implementation="cute")

    row = dict(head_dim=dim, seq=seq, batch=batch, heads=heads, causal=causal,
               padding_frac=round(1 - lens.sum() / (batch * seq), 3))
    row["padded_fwd_ms"] = bench(jax.jit(padded), q, k, v) * 1e3
    row["packed_fwd_ms"] = bench(jax.jit(packed), pq, pk, pv) * 1e3
    row["padded_fwdbwd_ms"] = bench(with_grad(padded), q, k, v) * 1e3
    row["packed_fwdbwd_ms"] = bench(with_grad(packed), pq, pk, pv) * 1e3
    row["fwd_overhead"] = row["padded_fwd_ms"] / row["packed_fwd_ms"] - 1
    row["fwdbwd_overhead"] = row["padded_fwdbwd_ms"] / row["packed_fwdbwd_ms"] - 1
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_padded_vs_packed.json"))
    ap.add_argument("--dims", default="128")
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--tokens", type=int, default=32768, help="padded tokens per batch (B = tokens / S)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        raise SystemExit("needs a GPU with the kernel library (implementation='cute')")
    rows = []
    for dim in (int(x) for x in a.dims.split(",")):
        for seq in (int(x) for x in a.seqs.split(",")):
            for causal in (False, True):
                rows.append(case(rng, dim, seq, causal, a.tokens, jnp.bfloat16))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\npadded (~30% padding) vs the same valid tokens packed, {dev.device_kind}, bf16 (ms)")
    print("  hd      S causal  pad | fwd padded  packed  overhead | fwd+bwd padded  packed  overhead")
    for r in rows:
        print(f"{r['head_dim']:>4} {r['seq']:>6} {str(r['causal']):>6} {r['padding_frac']:>4} | "
              f"{r['padded_fwd_ms']:>10.3f} {r['packed_fwd_ms']:>7.3f} {100 * r['fwd_overhead']:>+8.1f}% | "
              f"{r['padded_fwdbwd_ms']:>14.3f} {r['packed_fwdbwd_ms']:>7.3f} {100 * r['fwdbwd_overhead']:>+8.1f}%")
    with open(a.out, "w") as fh:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, rows=rows), fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
