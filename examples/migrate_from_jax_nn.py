"""Migrating from jax.nn.dot_product_attention: the one-line change, and what changes in results.

    -  out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
    +  out = jax_padsafe.dot_product_attention(q, k, v, is_causal=True,
                query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

Same argument names, shapes and meaning. This script runs both on the same batch and prints:

1. valid rows: the same values (within float rounding);
2. padded query rows: jax.nn returns unspecified values there, jax_padsafe exact zeros;
3. NaN written into the padding: jax.nn returns NaN in valid rows and gradients, jax_padsafe is
   bitwise unchanged;
4. a valid query row that sees no key (key length 0): jax_padsafe returns 0 (lse -inf);
5. the extras: a differentiable lse, bottom-right causal alignment, softcap, segment ids.

Run: python examples/migrate_from_jax_nn.py
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_padsafe


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="accepted for symmetry; already fast")
  parser.parse_args(argv)

  b, t, n, h = 3, 12, 4, 32
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.float32) for kk in keys)
  q_len = jnp.array([12, 7, 4], jnp.int32)
  kv_len = jnp.array([12, 7, 4], jnp.int32)
  ok = True

  @jax.jit
  def jax_nn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_len,
                                        key_value_seq_lengths=kv_len, implementation="xla")

  @jax.jit
  def padsafe(q, k, v):  # the one-line change
    return jax_padsafe.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_len,
                                             key_value_seq_lengths=kv_len)

  valid = (jnp.arange(t)[None, :] < q_len[:, None])[..., None, None]  # [b, t, 1, 1]

  # 1. Valid rows agree.
  ref, ours = jax_nn(q, k, v), padsafe(q, k, v)
  diff = float(jnp.max(jnp.where(valid, jnp.abs(ref - ours), 0)))
  tol = 1e-5 if jax.default_backend() == "cpu" else 5e-3  # GPUs: float32 matmuls run as TF32
  print(f"1. valid rows: max |jax.nn - jax_padsafe| = {diff:.2e} (float rounding; tolerance {tol:g})")
  ok &= diff < tol

  # 2. Padded query rows.
  pad_ref = float(jnp.max(jnp.where(valid, 0, jnp.abs(ref))))
  pad_ours = float(jnp.max(jnp.where(valid, 0, jnp.abs(ours))))
  print(f"2. padded query rows: max |out| jax.nn = {pad_ref:.3g} (not documented, may differ by "
        f"implementation), jax_padsafe = {pad_ours} (guaranteed exact zeros)")
  ok &= pad_ours == 0.0

  # 3. NaN in the padding, forward and backward.
  def poison(x):
    return jnp.where(valid, x, jnp.nan)

  @functools.partial(jax.jit, static_argnums=0)
  def grads(fn, q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * do), argnums=(0, 1, 2))(q, k, v)

  for name, fn in (("jax.nn", jax_nn), ("jax_padsafe", padsafe)):
    out = fn(poison(q), poison(k), poison(v))
    g = grads(fn, poison(q), poison(k), poison(v))
    nan_out = int(jnp.sum(jnp.isnan(jnp.where(valid, out, 0))))
    nan_grad = sum(int(jnp.sum(jnp.isnan(jnp.where(valid, x, 0)))) for x in g)
    same = bool(jnp.all(out == fn(q, k, v)))
    print(f"3. NaN in the padding, {name:11s}: NaN in valid output rows {nan_out:5d}, "
          f"in valid gradient rows {nan_grad:5d}, output bitwise unchanged: {same}")
    if name == "jax_padsafe":
      ok &= nan_out == 0 and nan_grad == 0 and same

  # 4. A valid query row with no visible key.
  empty = jax.jit(jax.nn.dot_product_attention)(q, k, v, query_seq_lengths=jnp.array([12, 7, 4]),
                                                key_value_seq_lengths=jnp.array([12, 7, 0]))
  print(f"4. sequence 2 has 4 queries and 0 keys: jax.nn out max |.| = "
        f"{float(jnp.abs(empty[2, :4]).max()):.3g} (not documented)")
  out, lse = jax.jit(functools.partial(jax_padsafe.dot_product_attention, return_lse=True))(
      q, k, v, query_seq_lengths=jnp.array([12, 7, 4]), key_value_seq_lengths=jnp.array([12, 7, 0]))
  print(f"   jax_padsafe out max |.| = {float(jnp.abs(out[2]).max())}, "
        f"lse = {np.asarray(lse[2, 0, :4]).tolist()} (guaranteed)")
  ok &= float(jnp.abs(out[2]).max()) == 0.0

  # 5. Extras jax.nn does not have.
  decode = functools.partial(jax_padsafe.dot_product_attention, is_causal=True,
                             causal_alignment="bottom_right", softcap=30.0, return_lse=True)
  out, lse = jax.jit(decode)(q[:, -1:], k, v, query_seq_lengths=jnp.array([1, 1, 1]),
                             key_value_seq_lengths=kv_len)
  dlse = jax.jit(jax.grad(lambda q: jax_padsafe.dot_product_attention(
      q, k, v, return_lse=True, key_value_seq_lengths=kv_len)[1].sum()))(q)
  print(f"5. decode-style call (one query per sequence, bottom-right causal, softcap): out "
        f"{out.shape}, lse {lse.shape}; d(lse)/dq finite: {bool(jnp.isfinite(dlse).all())}")
  print("migration checks passed" if ok else "migration checks FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
