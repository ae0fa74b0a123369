"""The problem and the fix: NaN in the padding of a batch, through jax.nn and through jax_padsafe.

A batch of three sequences is padded to a common length. Padded memory is not guaranteed to hold
zeros (it may hold the leftovers of an earlier kernel, or NaN from an upstream op on padded rows),
so we write NaN there and compare what each implementation returns in the *valid* rows, and what the
gradients look like.

Run: python examples/padding_nan_demo.py
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_padsafe


def make_batch(seed, b=3, t=16, n=4, h=32, poison=np.nan):
  rng = np.random.default_rng(seed)
  q_len = np.array([16, 9, 1], np.int32)
  kv_len = np.array([16, 5, 11], np.int32)
  q = rng.standard_normal((b, t, n, h)).astype(np.float32)
  k = rng.standard_normal((b, t, n, h)).astype(np.float32)
  v = rng.standard_normal((b, t, n, h)).astype(np.float32)
  for i in range(b):  # poison everything past each sequence's length
    q[i, q_len[i]:] = poison
    k[i, kv_len[i]:] = poison
    v[i, kv_len[i]:] = poison
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_len), jnp.asarray(kv_len)


def valid_rows(x, q_len):
  return [np.asarray(x[i, : int(q_len[i])]) for i in range(x.shape[0])]


def report(name, out, grads, q_len, kv_len):
  print(f"\n== {name}")
  for i, rows in enumerate(valid_rows(out, q_len)):
    print(f"  sequence {i}: {rows.shape[0]:2d} valid query rows, NaN in them: {int(np.isnan(rows).sum()):5d}")
  dq, dk, dv = grads
  for gname, g, lens in (("dq", dq, q_len), ("dk", dk, kv_len), ("dv", dv, kv_len)):
    bad = sum(int(np.isnan(r).sum()) for r in valid_rows(g, lens))
    print(f"  {gname}: NaN in valid rows: {bad}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--poison", default="nan", help="value written into the padding (nan, inf, 1e30)")
  args = parser.parse_args(argv)
  poison = float(args.poison)
  q, k, v, q_len, kv_len = make_batch(0, poison=poison)
  print(f"batch: q {q.shape}, query lengths {q_len.tolist()}, key lengths {kv_len.tolist()}, "
        f"padding filled with {poison}")

  def loss(fn, q, k, v):
    out = fn(q, k, v)
    # Only valid rows enter the loss, as a careful user would write it.
    valid = jnp.arange(q.shape[1])[None, :, None, None] < q_len[:, None, None, None]
    return jnp.sum(jnp.where(valid, out, 0.0) ** 2)

  jax_nn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
      implementation="xla")
  padsafe = lambda q, k, v: jax_padsafe.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

  results = {}
  for name, fn in (("jax.nn.dot_product_attention", jax_nn), ("jax_padsafe.dot_product_attention", padsafe)):
    out = jax.jit(fn)(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: loss(fn, q, k, v), (0, 1, 2)))(q, k, v)
    report(name, out, grads, q_len, kv_len)
    results[name] = (out, grads)

  out, _ = results["jax_padsafe.dot_product_attention"]
  padded_rows = np.concatenate([np.asarray(out[i, int(q_len[i]):]).ravel() for i in range(3)])
  print(f"\njax_padsafe padded output rows are exactly zero: {bool(np.all(padded_rows == 0))}")
  clean = jax_padsafe.dot_product_attention(
      *make_batch(0, poison=0.0)[:3], is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  same = np.array_equal(np.asarray(clean).view(np.uint32), np.asarray(out).view(np.uint32))
  print(f"jax_padsafe output with {poison} in the padding is bitwise identical to zero padding: {same}")
  return results


if __name__ == "__main__":
  main()
