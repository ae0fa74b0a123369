"""A jit-compiled, sharded training step of a tiny attention model with padded batches.

Mesh ``data x tensor x sequence`` = 2 x 1 x 2 on 4 fake CPU devices (set below, before JAX starts):

* data: the batch is split over ``data`` (gradients of replicated weights are summed by XLA);
* tensor: attention heads (and the matching weight columns) are split over ``tensor``; a shard
  holds whole GQA groups;
* sequence: the sequence is split over ``seq`` and attention runs as ring attention
  (:func:`jax_padsafe.sharding.ring_attention`) in the load-balanced zigzag layout.

The batch is padded to a common length and every padded position holds NaN. The model's own
layers select the padding away at the input (``jnp.where``: a matmul would turn ``NaN * 0`` into
NaN in the weight gradient, so every pad-safe model does this for its own layers); attention
masks through the per-sequence lengths and guarantees exact zeros for padded rows. At the end the
step is re-run with different garbage (+Inf, huge values) in the padding: loss and gradients are
bitwise identical.

Run: python examples/sharded_training.py [--steps 20]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_padsafe  # noqa: E402
from jax_padsafe import sharding as jps  # noqa: E402

DATA, TENSOR, SEQ = "data", "tensor", "seq"
B, T, D = 4, 64, 32          # batch, padded length, model width
N, K, H = 4, 2, 8            # query heads, key/value heads (GQA), head dim


def make_mesh(shape, names):
  kinds = getattr(jax.sharding, "AxisType", None)
  if kinds is None:  # older jax: Auto is the only kind
    return jax.make_mesh(shape, names)
  return jax.make_mesh(shape, names, axis_types=(kinds.Auto,) * len(names))


def init_params(key):
  ks = jax.random.split(key, 5)
  s = 1.0 / np.sqrt(D)
  return dict(
      wq=jax.random.normal(ks[0], (D, N, H)) * s,
      wk=jax.random.normal(ks[1], (D, K, H)) * s,
      wv=jax.random.normal(ks[2], (D, K, H)) * s,
      wo=jax.random.normal(ks[3], (N, H, D)) * (1.0 / np.sqrt(N * H)),
      readout=jax.random.normal(ks[4], (D,)) * s,
  )


PARAM_SPECS = dict(wq=P(None, TENSOR, None), wk=P(None, TENSOR, None), wv=P(None, TENSOR, None),
                   wo=P(TENSOR, None, None), readout=P())


def make_batch(rng, mesh_seq, poison=np.nan):
  """Features ``[B, T, D]`` and targets ``[B, T]`` in the zigzag layout, NaN/garbage in the padding.

  The target at position i is a causal running mean of feature 0 (something attention can learn).
  """
  lengths = rng.integers(T // 4, T + 1, size=B).astype(np.int32)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  csum = np.cumsum(x[..., 0], axis=1)
  y = (csum / np.arange(1, T + 1)).astype(np.float32)
  valid = np.arange(T)[None, :] < lengths[:, None]
  x = np.where(valid[..., None], x, np.float32(poison))
  y = np.where(valid, y, np.float32(poison))
  # The data pipeline puts sequences into the zigzag layout (lengths stay natural).
  idx = jps.zigzag_indices(T, mesh_seq)
  return dict(x=x[:, idx], y=y[:, idx], valid=valid[:, idx], lengths=lengths)


BATCH_SPECS = dict(x=P(DATA, SEQ, None), y=P(DATA, SEQ), valid=P(DATA, SEQ), lengths=P(DATA))


def build_step(mesh, lr=0.1):

  def loss_fn(params, batch):
    valid = batch["valid"]
    x = jnp.where(valid[..., None], batch["x"], 0.0)  # our own layers: select the padding away
    q = jnp.einsum("btd,dnh->btnh", x, params["wq"])
    k = jnp.einsum("btd,dkh->btkh", x, params["wk"])
    v = jnp.einsum("btd,dkh->btkh", x, params["wv"])
    att = jps.ring_attention(q, k, v, mesh=mesh, axis_name=SEQ, batch_axis=DATA, head_axis=TENSOR,
                             layout="zigzag", is_causal=True, query_seq_lengths=batch["lengths"],
                             key_value_seq_lengths=batch["lengths"], block_k=32)
    hdn = x + jnp.einsum("btnh,nhd->btd", att, params["wo"])
    pred = jnp.einsum("btd,d->bt", hdn, params["readout"])
    err = jnp.where(valid, pred - jnp.where(valid, batch["y"], 0.0), 0.0)
    return jnp.sum(err * err) / jnp.maximum(jnp.sum(valid), 1)

  def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return params, loss, grads

  p_sh = {k: NamedSharding(mesh, s) for k, s in PARAM_SPECS.items()}
  b_sh = {k: NamedSharding(mesh, s) for k, s in BATCH_SPECS.items()}
  return jax.jit(step, in_shardings=(p_sh, b_sh), out_shardings=(p_sh, None, p_sh),
                 donate_argnums=()), p_sh, b_sh


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  mesh = make_mesh((2, 1, 2), (DATA, TENSOR, SEQ))
  print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}, mesh {dict(mesh.shape)}")
  step, p_sh, b_sh = build_step(mesh)
  params = jax.device_put(init_params(jax.random.PRNGKey(args.seed)), p_sh)
  rng = np.random.default_rng(args.seed)
  # Read off the program jax lowers for the step: the kernels' custom calls are in it, or not.
  where = jax_padsafe.attention_backends(step, params, make_batch(np.random.default_rng(0), mesh.shape[SEQ]))
  print(f"attention: {where}")

  t0 = time.perf_counter()
  for i in range(args.steps):
    batch = jax.device_put(make_batch(rng, mesh.shape[SEQ]), b_sh)
    params, loss, _ = step(params, batch)
    loss = float(loss)
    if i == 0:
      print(f"compiled and ran the first step in {time.perf_counter() - t0:.1f} s")
    print(f"step {i:3d}  loss {loss:.5f}")
    if not np.isfinite(loss):
      raise SystemExit("non-finite loss: padding leaked into the result")

  # Same step, same valid data, different garbage in the padding: bitwise identical results.
  outs = []
  for poison in (np.nan, np.inf, 3e38):
    batch = jax.device_put(make_batch(np.random.default_rng(123), mesh.shape[SEQ], poison), b_sh)
    _, loss, grads = step(params, batch)
    outs.append([np.asarray(loss)] + [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)])
  same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
             for other in outs[1:] for a, b in zip(outs[0], other))
  print(f"loss and gradients bitwise identical with NaN / +Inf / 3e38 in the padding: {same}")
  hlo = step.lower(params, batch).compile().as_text()
  kinds = sorted({c for c in ("all-gather", "all-reduce", "collective-permute", "all-to-all",
                              "reduce-scatter") if f" {c}(" in hlo or f" {c}-start(" in hlo})
  print(f"collectives in the compiled step: {kinds} (all-reduce: data-parallel weight gradients)")
  if not same:
    raise SystemExit("results depend on the padding")


if __name__ == "__main__":
  main()
