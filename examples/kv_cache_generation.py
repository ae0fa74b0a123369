"""KV-cache generation with a length per sequence, using jax_padsafe.flax_nnx.MultiHeadAttention.

A small decoder (rotary embeddings built into the attention layer: ``rope=apply_rope``) is first
trained for a few hundred steps to continue arithmetic progressions mod the vocabulary, on padded
batches (one sequence per row, ``query_seq_lengths``). Then a batch of prompts of **different
lengths** is generated from:

1. ``init_cache``: one cache row per sequence, filled with NaN to show that nothing reads past a
   sequence's own length;
2. prefill: the prompts go in as one padded block with ``query_seq_lengths=prompt_lengths``; every
   sequence's keys land at its own offset, and the cache lengths advance per sequence;
3. decode: one new token per sequence per step, attending with bottom-right causal alignment to that
   sequence's cache only.

The logits of every generated position are checked against recomputing the whole sequence without
a cache; the generated tokens are checked against the true continuation of each progression.

Run:  python examples/kv_cache_generation.py            (train 300 steps, generate 12 tokens)
      python examples/kv_cache_generation.py --quick    (CI: a few training steps)
Needs flax and optax: pip install "jax_padsafe[flax,examples]".
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_padsafe
from jax_padsafe import flax_nnx


def rms_norm(x, eps=1e-6):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class Block(nnx.Module):

  def __init__(self, dim, heads, kv_heads, dtype, rngs):
    self.attn = flax_nnx.MultiHeadAttention(heads, dim, num_kv_heads=kv_heads, is_causal=True,
                                            rope=flax_nnx.apply_rope, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, h, lengths, decode):
    h = h + self.attn(rms_norm(h), query_seq_lengths=lengths, decode=decode)
    return h + self.down(jax.nn.gelu(self.up(rms_norm(h))))


class Decoder(nnx.Module):

  def __init__(self, vocab, dim, depth, heads, kv_heads, dtype, rngs):
    self.embed = nnx.Embed(vocab, dim, dtype=dtype, rngs=rngs)
    blocks = [Block(dim, heads, kv_heads, dtype, rngs) for _ in range(depth)]
    self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
    self.head = nnx.Linear(dim, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, lengths, decode=False):
    """``tokens [B, T]``; rows at or past ``lengths[b]`` are padding (their logits are garbage)."""
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    h = jnp.where(valid[..., None], self.embed(jnp.clip(tokens, 0, None)), 0)
    for block in self.blocks:
      h = block(h, lengths, decode)
    return self.head(rms_norm(h)).astype(jnp.float32)

  def init_cache(self, batch, max_length, dtype, fill_value=float("nan")):
    for block in self.blocks:
      block.attn.init_cache((batch, max_length, block.attn.in_features), dtype,
                            fill_value=fill_value)


def progressions(rng, batch, length, vocab, lengths):
  a = rng.integers(0, vocab, (batch, 1))
  d = rng.integers(1, 8, (batch, 1))
  tokens = (a + d * np.arange(length)[None, :]) % vocab
  rows = np.arange(length)[None, :]
  garbage = rng.integers(0, vocab, (batch, length))  # padding holds garbage tokens
  return np.where(rows < lengths[:, None], tokens, garbage).astype(np.int32), a, d


def train(model, args, rng):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, args.train_steps // 10),
                                                      max(2, args.train_steps)))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, tokens, lengths):
    def loss_of(params):
      logits = nnx.merge(graphdef, params, rest)(tokens, lengths)
      has_target = jnp.arange(tokens.shape[1] - 1)[None, :] < (lengths[:, None] - 1)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
      return jnp.where(has_target, ce, 0.0).sum() / has_target.sum()
    loss, grads = jax.value_and_grad(loss_of)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for i in range(1, args.train_steps + 1):
    lengths = rng.integers(4, args.max_length + 1, (args.batch,)).astype(np.int32)
    tokens, _, _ = progressions(rng, args.batch, args.max_length, args.vocab, lengths)
    if i == 1:  # read off the program jax lowers for the step: the kernels' custom calls are in it, or not
      print(f"training attention: {jax_padsafe.attention_backends(step, params, opt_state, tokens, lengths)}")
    params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens), jnp.asarray(lengths))
    if i == 1 or i % max(1, args.train_steps // 5) == 0:
      print(f"train step {i:4d}/{args.train_steps}  loss {float(loss):.4f}", flush=True)
  nnx.update(model, params)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--train-steps", type=int, default=300)
  parser.add_argument("--new-tokens", type=int, default=12)
  parser.add_argument("--quick", action="store_true", help="few training steps (CI)")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--max-length", type=int, default=48)
  parser.add_argument("--dim", type=int, default=256)  # head_dim 64
  parser.add_argument("--vocab", type=int, default=32)
  parser.add_argument("--dtype", default=None,
                      help="activation dtype (default: bfloat16 on GPU, float32 elsewhere)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.quick:
    args.train_steps, args.new_tokens, args.batch, args.dim = min(args.train_steps, 5), 4, 8, 64
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), dtype {dtype.name}")
  rng = np.random.default_rng(args.seed)
  model = Decoder(args.vocab, args.dim, 2, 4, 2, dtype, nnx.Rngs(args.seed))
  if args.train_steps:
    train(model, args, rng)

  # ---- generation: prompts of different lengths, one cache row per sequence -------------------
  b = 4
  prompt_len = np.array([3, 7, 2, 5], np.int32)
  tmax = int(prompt_len.max())
  prompts, a, d = progressions(rng, b, tmax, args.vocab, prompt_len)
  capacity = tmax + args.new_tokens
  model.init_cache(b, capacity, dtype)  # NaN-filled: only each sequence's own rows are read
  print(f"prompt lengths {prompt_len.tolist()}, cache capacity {capacity} (filled with NaN)")

  @nnx.jit
  def prefill(model, tokens, lengths):
    logits = model(tokens, lengths, decode=True)
    return logits[jnp.arange(tokens.shape[0]), lengths - 1]  # each sequence's last prompt token

  @nnx.jit
  def decode_step(model, token):
    return model(token[:, None], jnp.ones(token.shape, jnp.int32), decode=True)[:, 0]

  graphdef, state = nnx.split(model)
  def decode_forward(state, token):  # decode_step on the model's state, as attention_backends lowers it
    return nnx.merge(graphdef, state)(token[:, None], jnp.ones_like(token), decode=True)
  where = jax_padsafe.attention_backends(decode_forward, state, jnp.zeros((b,), jnp.int32))
  print(f"decoding attention: forward on {'GPU kernels' if where.forward else 'pure JAX'} ({where.platform})")
  logits = prefill(model, jnp.asarray(prompts), jnp.asarray(prompt_len))
  generated, step_logits = [], []
  for _ in range(args.new_tokens):
    step_logits.append(logits)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    generated.append(token)
    logits = decode_step(model, token)
  generated = np.stack([np.asarray(t) for t in generated], 1)  # [b, new_tokens]
  cache_len = np.asarray(model.blocks[0].attn.cache_lengths[...])
  print(f"cache lengths after generation: {cache_len.tolist()} (= prompt + {args.new_tokens} generated)")

  # ---- check: cache logits == recomputing each full sequence without a cache -----------------
  full = np.zeros((b, capacity), np.int32)
  for i in range(b):
    n = prompt_len[i]
    full[i, :n] = prompts[i, :n]
    full[i, n:n + args.new_tokens] = generated[i]
  lengths = prompt_len + args.new_tokens
  ref = jax.jit(lambda t, n: model(t, n))(jnp.asarray(full), jnp.asarray(lengths))
  worst, correct = 0.0, 0
  for i in range(b):
    n = prompt_len[i]
    for j in range(args.new_tokens):
      worst = max(worst, float(jnp.max(jnp.abs(step_logits[j][i] - ref[i, n - 1 + j]))))
    truth = (a[i, 0] + d[i, 0] * np.arange(n, n + args.new_tokens)) % args.vocab
    correct += int((generated[i] == truth).sum())
    print(f"  sequence {i}: prompt {prompts[i, :n].tolist()} -> generated {generated[i].tolist()}")
  tol = 5e-2 if dtype == jnp.bfloat16 else 1e-3
  print(f"max |logits(cache) - logits(recompute)| = {worst:.2e} (tolerance {tol:g}); "
        f"tokens matching the progression: {correct}/{b * args.new_tokens}")
  ok = worst <= tol and np.isfinite(worst)
  print("cache consistent with recompute:", ok)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
