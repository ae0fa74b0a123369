"""Train a small decoder-only transformer on packed + padded batches whose padding holds NaN.

Every batch row packs several variable-length sequences back to back (segment ids 0, 1, 2, ...) and
ends in padding (segment id -1). The task: continue an arithmetic progression mod the vocabulary
(``a, a+d, a+2d, ...``), which a couple of attention layers learn in a few hundred steps.

To mimic padded memory that holds garbage, the padded rows of the activations entering **every
block** are overwritten with NaN (``--poison``). The attention layer,
``jax_padsafe.flax_nnx.MultiHeadAttention``, takes the segment ids and never lets those rows reach a
valid row, in the forward pass or in any gradient. Attention is the only layer that mixes rows in
the forward pass; but layers with weights also mix rows in the backward pass (``dW = x^T dy`` sums
over rows, and ``0 * NaN = NaN``), so the MLP selects its input rows (one ``jnp.where``, the same
thing the attention layer does inside), the norm has no weights, and the loss is a select over
valid tokens. Pad-safety of a whole model needs both.

For comparison, the same model with Flax's own ``nnx.MultiHeadAttention`` (the boolean mask built
from the same segment ids, the same parameters) is evaluated once: its loss is NaN.

Run:  python examples/train_decoder.py                 (300 steps; GPU: bf16, the kernels)
      python examples/train_decoder.py --quick         (CI: a few steps on the CPU)
      python examples/train_decoder.py --plot loss.png (save the loss curve; needs matplotlib)
      python examples/train_decoder.py --layout padded (one sequence per row, lengths)
Needs flax and optax: pip install "jax_padsafe[flax,examples]".
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_padsafe
from jax_padsafe import flax_nnx


# ----------------------------------------------------------------------------------------- data --

def make_batch(rng, batch, length, vocab, min_len=6, max_len=20, pad_frac=(0.1, 0.3), packed=True):
  """Rows of arithmetic progressions; the tail of each row is padding (segment -1).

  ``packed``: several sequences per row (segment ids 0, 1, ...); else one sequence per row.
  """
  tokens = np.zeros((batch, length), np.int32)
  seg = np.full((batch, length), -1, np.int32)
  for b in range(batch):
    budget = length - int(length * rng.uniform(*pad_frac))
    pos, sid = 0, 0
    while pos + min_len <= budget and (packed or sid == 0):
      n = int(min(rng.integers(min_len, max_len + 1), budget - pos)) if packed else budget
      a, d = rng.integers(0, vocab), rng.integers(1, 8)
      tokens[b, pos:pos + n] = (a + d * np.arange(n)) % vocab
      seg[b, pos:pos + n] = sid
      pos, sid = pos + n, sid + 1
  # Targets: the next token of the same sequence; -1 where there is none (end of a sequence, padding).
  targets = np.full_like(tokens, -1)
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
  targets[:, :-1] = np.where(same, tokens[:, 1:], -1)
  return jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(targets)


# ---------------------------------------------------------------------------------------- model --

def rms_norm(x, eps=1e-6):
  """Parameter-free RMS norm (no weights, so nothing sums over rows in its backward)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def select_valid(x, valid):
  return jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))


class Block(nnx.Module):

  def __init__(self, dim, heads, kv_heads, dtype, rngs, padsafe=True):
    self.padsafe = padsafe
    if padsafe:
      self.attn = flax_nnx.MultiHeadAttention(heads, dim, num_kv_heads=kv_heads, is_causal=True,
                                              dtype=dtype, rngs=rngs)
    else:  # Flax's own layer, for the comparison; same parameters
      self.attn = nnx.MultiHeadAttention(heads, dim, num_kv_heads=kv_heads, dtype=dtype,
                                         decode=False, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, h, seg, poison, packed):
    valid = seg >= 0
    if poison is not None:  # padded memory holds garbage
      h = jnp.where(valid[..., None], h, jnp.asarray(poison, h.dtype))
    x = rms_norm(h)
    if self.padsafe and packed:
      h = h + self.attn(x, query_segment_ids=seg)      # packed rows: segment ids
    elif self.padsafe:
      h = h + self.attn(x, query_seq_lengths=valid.sum(-1))   # one sequence per row: lengths
    else:
      mask = (seg[:, None, :, None] == seg[:, None, None, :]) & valid[:, None, None, :]
      mask &= jnp.tril(jnp.ones((seg.shape[1],) * 2, bool))
      h = h + self.attn(x, mask=mask)
    x = rms_norm(select_valid(h, valid))
    return h + self.down(jax.nn.gelu(self.up(x)))


class Decoder(nnx.Module):

  def __init__(self, vocab, dim, depth, heads, kv_heads, max_len, dtype, rngs, padsafe=True):
    self.embed = nnx.Embed(vocab, dim, dtype=dtype, rngs=rngs)
    self.pos = nnx.Embed(max_len, dim, dtype=dtype, rngs=rngs)
    blocks = [Block(dim, heads, kv_heads, dtype, rngs, padsafe) for _ in range(depth)]
    self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks  # flax >= 0.12 wants nnx.List
    self.head = nnx.Linear(dim, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, seg, poison=None, packed=True):
    positions = jnp.where(seg >= 0, flax_nnx.positions_from_segments(seg), 0)
    h = self.embed(tokens) + self.pos(positions)
    for block in self.blocks:
      h = block(h, seg, poison, packed)
    return self.head(rms_norm(select_valid(h, seg >= 0))).astype(jnp.float32)


def loss_fn(model, tokens, seg, targets, poison, packed=True):
  logits = model(tokens, seg, poison, packed)
  has_target = targets >= 0
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
  ce = jnp.where(has_target, ce, 0.0)  # a select: NaN logits in padded rows cannot leak
  return ce.sum() / jnp.maximum(has_target.sum(), 1)


# ----------------------------------------------------------------------------------------- main --

def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model (CI)")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--vocab", type=int, default=32)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--dtype", default=None,
                      help="activation dtype (default: bfloat16 on GPU, float32 elsewhere)")
  parser.add_argument("--poison", type=float, default=float("nan"),
                      help="value written into the padding of every block's input (default NaN)")
  parser.add_argument("--log-every", type=int, default=None)
  parser.add_argument("--plot", default=None, help="save the loss curve to this PNG")
  parser.add_argument("--layout", choices=("packed", "padded"), default="packed",
                      help="packed: several sequences per row (segment ids); padded: one sequence "
                      "per row (lengths: the GPU kernels' fast path)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  packed = args.layout == "packed"
  if args.quick:
    args.steps = min(args.steps, 25)
    args.batch, args.length, args.dim, args.heads, args.kv_heads = 8, 64, 64, 4, 2
  log_every = args.log_every or max(1, args.steps // 10)
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), dtype {dtype.name}, "
        f"jax {jax.__version__}")

  rngs_seed = args.seed
  model = Decoder(args.vocab, args.dim, args.depth, args.heads, args.kv_heads, args.length, dtype,
                  nnx.Rngs(rngs_seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"model: {args.depth} blocks, dim {args.dim}, {args.heads} heads / {args.kv_heads} kv heads, "
        f"{n_params / 1e3:.0f}k parameters")
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(optax.warmup_cosine_decay_schedule(
                       0.0, args.lr, max(1, args.steps // 10), max(2, args.steps)), weight_decay=0.01))
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, tokens, seg, targets):
    def loss_of(params):
      return loss_fn(nnx.merge(graphdef, params, rest), tokens, seg, targets, args.poison, packed)
    loss, grads = jax.value_and_grad(loss_of)(params)
    grad_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grad_finite

  rng = np.random.default_rng(args.seed)
  tokens, seg, targets = make_batch(rng, args.batch, args.length, args.vocab, packed=packed)
  pad = float(np.mean(np.asarray(seg) < 0))
  nseq = int(sum(len(set(r[r >= 0].tolist())) for r in np.asarray(seg)))
  # Read off the program jax lowers for this step: the kernels' custom calls are in it, or not.
  print(f"attention: {jax_padsafe.attention_backends(train_step, params, opt_state, tokens, seg, targets)}")
  print(f"batch: {args.batch} rows x {args.length} tokens, {nseq} sequences ({args.layout}), "
        f"{100 * pad:.0f}% padding, padding of every block input = {args.poison}")

  # The comparison: Flax's attention layer with a mask, same parameters, same NaN padding.
  baseline = Decoder(args.vocab, args.dim, args.depth, args.heads, args.kv_heads, args.length,
                     dtype, nnx.Rngs(rngs_seed), padsafe=False)
  nnx.update(baseline, params)
  base_loss = float(jax.jit(lambda t, s, y: loss_fn(baseline, t, s, y, args.poison))(tokens, seg,
                                                                                      targets))
  print(f"step 0 loss with flax nnx.MultiHeadAttention + mask: {base_loss:.4f}  "
        f"(NaN padding leaks into valid rows)")

  losses, t0, last = [], time.perf_counter(), time.perf_counter()
  all_finite = True
  for step in range(1, args.steps + 1):
    tokens, seg, targets = make_batch(rng, args.batch, args.length, args.vocab, packed=packed)
    params, opt_state, loss, grad_finite = train_step(params, opt_state, tokens, seg, targets)
    loss = float(loss)
    all_finite &= bool(grad_finite) and math.isfinite(loss)
    losses.append(loss)
    if step % log_every == 0 or step == 1 or step == args.steps:
      now = time.perf_counter()
      print(f"step {step:5d}/{args.steps}  loss {loss:.4f}  grads finite: {bool(grad_finite)}  "
            f"({(now - last) * 1e3 / (1 if step == 1 else log_every):.1f} ms/step)", flush=True)
      last = now
  k = max(1, len(losses) // 5)
  first, final = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
  print(f"summary: loss {first:.4f} -> {final:.4f} (mean of first/last {k} steps), "
        f"all losses and gradients finite: {all_finite}, {time.perf_counter() - t0:.1f} s")

  if args.plot:
    try:
      import matplotlib  # pylint: disable=g-import-not-at-top
      matplotlib.use("Agg")
      import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
      print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
    else:
      fig, ax = plt.subplots(figsize=(6, 3.5))
      ax.plot(np.arange(1, len(losses) + 1), losses)
      ax.set_xlabel("step")
      ax.set_ylabel("loss (valid tokens)")
      ax.set_title(f"{args.layout} layout, padding filled with {args.poison}")
      ax.grid(alpha=0.3)
      fig.tight_layout()
      fig.savefig(args.plot, dpi=120)
      print(f"loss plot saved to {args.plot}")
  return 0 if (all_finite and final < first) else 1


if __name__ == "__main__":
  sys.exit(main())
