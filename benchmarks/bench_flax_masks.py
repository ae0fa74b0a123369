"""Training-step time of a Flax linen decoder whose attention gets Flax's usual causal + padding mask: the
one-line swap ``nn.MultiHeadDotProductAttention(attention_fn=jax_padsafe.flax_linen.attention_fn)`` against
the same model with jax.nn's cuDNN attention as its ``attention_fn``, in one process.

    PYTHONPATH=. python benchmarks/bench_flax_masks.py [--out results.json] [--seqs 2048,4096] [--layers 4]

Model: token embedding, ``layers`` pre-norm blocks of ``nn.MultiHeadDotProductAttention`` (16 heads of 128,
width 2048, bf16) and a 4x MLP, a tied output projection; batch 4, each sequence's length drawn in [T/2, T]
and its mask ``nn.combine_masks(nn.make_causal_mask(tokens), nn.make_attention_mask(valid, valid))``.  One
step = loss, gradients and an SGD update under one jit.  Timing: ``bench_forward.bench``.
"""

import argparse
import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jax_padsafe.flax_linen
from bench_forward import bench  # the benchmarks' one timing rule

VOCAB, WIDTH, HEADS = 32000, 2048, 16


def cudnn_attention_fn(query, key, value, bias=None, mask=None, **_):
    """jax.nn's cuDNN attention with linen's attention_fn signature (mask as bool, dropout off)."""
    if mask is not None:
        mask = mask.astype(bool)
    return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, implementation="cudnn")


class Block(nn.Module):
    attention_fn: callable

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=jnp.bfloat16, deterministic=True,
                                                attention_fn=self.attention_fn)(h, mask=mask)
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        h = nn.Dense(4 * WIDTH, dtype=jnp.bfloat16)(h)
        return x + nn.Dense(WIDTH, dtype=jnp.bfloat16)(nn.gelu(h))


class Decoder(nn.Module):
    attention_fn: callable
    layers: int

    @nn.compact
    def __call__(self, tokens, valid):
        mask = nn.combine_masks(nn.make_causal_mask(tokens), nn.make_attention_mask(valid, valid))
        embed = nn.Embed(VOCAB, WIDTH, dtype=jnp.bfloat16)
        x = embed(tokens)
        for _ in range(self.layers):
            x = Block(self.attention_fn)(x, mask)
        return embed.attend(nn.LayerNorm(dtype=jnp.bfloat16)(x)).astype(jnp.float32)


def train_step(model):
    def loss_fn(params, tokens, valid):
        logits = model.apply(params, tokens, valid)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        w = (valid[:, 1:] & valid[:, :-1]).astype(jnp.float32)
        return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)

    @jax.jit
    def step(params, tokens, valid):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, valid)
        return jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads), loss
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_flax_masks.json"))
    ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    dev = jax.devices()[0].device_kind
    rows = []
    for T in (int(x) for x in a.seqs.split(",")):
        B = 4
        rng = np.random.default_rng(T)
        tokens = jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32)
        lengths = rng.integers(T // 2, T + 1, B)
        valid = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])
        row = dict(seqlen=T, batch=B, layers=a.layers, width=WIDTH, heads=HEADS)
        for name, fn in (("jax_padsafe", jax_padsafe.flax_linen.attention_fn), ("cudnn", cudnn_attention_fn)):
            model = Decoder(fn, a.layers)
            params = model.init(jax.random.PRNGKey(0), tokens[:, :8], valid[:, :8])
            step = train_step(model)
            row[name + "_step_ms"] = round(bench(functools.partial(step, params), tokens, valid, iters=5) * 1e3, 2)
        row["speedup"] = round(row["cudnn_step_ms"] / row["jax_padsafe_step_ms"], 3)
        rows.append(row)
        print(row, flush=True)
    print(f"\ntraining step ms on {dev} (bf16, {a.layers} layers, width {WIDTH}, {HEADS} heads x 128, batch 4; "
          "speedup = cuDNN time / ours)")
    for r in rows:
        print(f"T={r['seqlen']:>5}: jax_padsafe {r['jax_padsafe_step_ms']:8.2f}  cudnn {r['cudnn_step_ms']:8.2f}  "
              f"speedup {r['speedup']:.2f}")
    with open(a.out, "w") as fh:
        json.dump(dict(device=dev, jax=jax.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
