"""Sharded pad-safe attention: ring (context-parallel) attention and layout helpers.

Batch and head sharding need nothing from this module: :func:`jax_padsafe.dot_product_attention`
and :func:`jax_padsafe.varlen_attention` already run shard-local under ``jax.jit`` when their inputs
are sharded over batch and/or (whole groups of) heads (see ``docs/sharding.md``). This module adds:

* :func:`ring_attention`: attention over a sequence sharded on a mesh axis. ``shard_map`` +
  ``lax.ppermute`` of key/value chunks around the ring, an lse-based merge of the per-chunk results,
  and a ``jax.custom_vjp`` whose backward recomputes chunk by chunk and passes the dK/dV
  accumulators around the ring with the chunks. Only collective-permutes appear in the HLO (no
  all-gather, no all-reduce).
* :func:`zigzag_permute` / :func:`zigzag_unpermute`: the load-balanced layout for causal attention
  (device ``d`` of ``P`` holds chunk ``d`` and chunk ``2P-1-d`` of ``2P`` equal chunks).

The whole pad-safety contract holds on the ring: lengths, segment ids, causal in both alignments,
window, softcap, sinks, padded rows exactly 0 (lse 0), valid rows that see no key give out 0 / lse
-inf (the sink with sinks), and results are bitwise independent of what the padding holds. The merge
never evaluates ``-inf - -inf`` and masks with selects.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jax_padsafe import _backends
from jax_padsafe._backends import partitioning
from jax_padsafe._backends import xla
from jax_padsafe._backends.cute import backend as cute
from jax_padsafe._backends.cute import backward as cute_backward
from jax_padsafe._backends.cute import forward as cute_forward
from jax_padsafe._core import checks
from jax_padsafe._core import problem as canonical
from jax_padsafe._core import visibility

__all__ = ["ring_attention", "zigzag_permute", "zigzag_unpermute", "zigzag_indices"]

_F32 = jnp.float32
_LAYOUTS = ("contiguous", "zigzag")
_BIG = 2 ** 30  # bound on positions/window sizes in the block-skipping predicate (no int32 overflow)


# --------------------------------------------------------------------------------------------------
# jax version shims (0.10 / 0.11)
# --------------------------------------------------------------------------------------------------

def shard_map(f, *, mesh, in_specs, out_specs):
  """``shard_map`` without replication/VMA checking, on every supported jax version."""
  if hasattr(jax, "shard_map"):
    try:
      return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:  # a version whose jax.shard_map still spells it check_rep
      return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
  from jax.experimental.shard_map import shard_map as _sm  # pylint: disable=g-import-not-at-top
  return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# --------------------------------------------------------------------------------------------------
# Zigzag (load-balanced) layout
# --------------------------------------------------------------------------------------------------

def _zigzag_order(num_shards: int) -> np.ndarray:
  """Chunk order of the zigzag layout: ``[0, 2P-1, 1, 2P-2, ...]``."""
  p = int(num_shards)
  return np.array([c for d in range(p) for c in (d, 2 * p - 1 - d)], np.int32)


def _check_zigzag(length, num_shards, what):
  if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
  if length % (2 * num_shards):
    raise ValueError(f"{what} ({length}) must be a multiple of 2 * num_shards = {2 * num_shards} "
                     "for the zigzag layout; pad the sequence (padding is free: mark it with "
                     "lengths or negative segment ids)")


def zigzag_indices(length: int, num_shards: int) -> np.ndarray:
  """``idx[j]`` = natural position of the element at layout slot ``j`` (NumPy int32 ``[length]``).

  ``x_layout = x_natural[idx]``. The sequence is cut into ``2 * num_shards`` equal chunks and device
  ``d`` (slots ``d*L/P .. (d+1)*L/P - 1``) holds chunk ``d`` followed by chunk ``2P-1-d``.
  """
  _check_zigzag(length, num_shards, "length")
  c = length // (2 * num_shards)
  return (_zigzag_order(num_shards)[:, None] * c + np.arange(c)[None, :]).reshape(-1).astype(np.int32)


def zigzag_permute(x, num_shards: int, axis: int = 1):
  """Natural order -> zigzag layout along ``axis`` (default 1, the sequence axis of ``[B, T, ...]``).

  Apply it to query, key, value, segment ids (and anything else indexed by sequence position)
  before sharding the sequence axis over ``num_shards`` devices; undo it on the outputs with
  :func:`zigzag_unpermute`. Lengths are *not* permuted: they always count natural positions.
  """
  x = jnp.asarray(x)
  axis = axis % x.ndim
  _check_zigzag(x.shape[axis], num_shards, f"axis {axis} of length")
  return _reorder_chunks(x, _zigzag_order(num_shards), axis)


def zigzag_unpermute(x, num_shards: int, axis: int = 1):
  """Zigzag layout -> natural order along ``axis`` (inverse of :func:`zigzag_permute`).

  For an lse ``[B, N, T]`` pass ``axis=2`` (or ``-1``).
  """
  x = jnp.asarray(x)
  axis = axis % x.ndim
  _check_zigzag(x.shape[axis], num_shards, f"axis {axis} of length")
  return _reorder_chunks(x, np.argsort(_zigzag_order(num_shards)), axis)


def _reorder_chunks(x, order, axis):
  """Chunk ``i`` of the result is chunk ``order[i]`` of ``x`` (static slices and a concatenate,
  which every sharding mode accepts; on a sharded axis XLA moves the chunks between devices)."""
  c = x.shape[axis] // len(order)
  return jnp.concatenate([lax.slice_in_dim(x, int(i) * c, (int(i) + 1) * c, axis=axis)
                          for i in order], axis=axis)


# --------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------

def ring_attention(
    query,
    key,
    value,
    *,
    mesh,
    axis_name,
    batch_axis=None,
    head_axis=None,
    layout: str = "contiguous",
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    scale: float | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    local_window_size=None,
    softcap: float | None = None,
    return_lse: bool = False,
    block_k: int = 512,
    skip_masked_blocks: bool = True,
    implementation: str | None = None,
    max_segments: int | None = None,
    sinks=None,
):
  r"""Pad-safe attention with the sequence sharded over mesh axis ``axis_name`` (ring attention).

  Same semantics as :func:`jax_padsafe.dot_product_attention` (contract included), computed with
  ``shard_map``: every device keeps its query chunk and the key/value chunks travel around the
  ring (``lax.ppermute``); per-chunk results are merged through their log-sum-exp. The backward is a
  ``jax.custom_vjp`` over the ring: it recomputes chunk by chunk and the dK/dV accumulators travel
  with their chunks, arriving home after one full turn. No all-gather or all-reduce is emitted.
  Call it under ``jax.jit`` (it works eagerly too).

  Args:
    query: ``[B, T, N, H]``; key: ``[B, S, K, H]``; value: ``[B, S, K, Hv]`` (``N % K == 0``).
      Sequence axes in the order given by ``layout``, sharded (or to be sharded) over
      ``axis_name``.
    mesh: a ``jax.sharding.Mesh``.
    axis_name: the mesh axis the sequence is split over (``P`` devices: ``T`` and ``S`` must be
      multiples of ``P``, of ``2P`` for ``layout="zigzag"``).
    batch_axis, head_axis: optional mesh axes (name or tuple of names) the batch / head axes are
      split over (data and tensor parallelism inside the ring). ``head_axis`` needs ``K`` to be a
      multiple of its size, so that every shard holds whole GQA groups.
    layout: ``"contiguous"`` (device ``d`` holds rows ``d*T/P .. (d+1)*T/P-1``) or ``"zigzag"``
      (inputs permuted with :func:`zigzag_permute`; balances causal work: every device skips the
      same number of fully masked blocks). Outputs come back in the same layout.
    query_seq_lengths, key_value_seq_lengths: ``[B]`` valid lengths in *natural* positions (not
      permuted, whatever the layout).
    query_segment_ids, key_value_segment_ids: ``[B, T]`` / ``[B, S]`` in the *layout's* order.
    skip_masked_blocks: on the per-pair path, skip (``lax.cond``) the compute of query/key chunk
      pairs that provably have no visible pair (causal, window, lengths, segment ranges); forward
      and backward. Grouped kernel calls (below) never compute such pairs, whatever this says.
    implementation: how the query/key chunk pairs are computed. ``None``: the GPU kernels where
      they apply (CUDA, bf16/fp16, no window), else the pure-JAX blocks. With lengths only (no
      segment ids; causal also needs ``T == S`` and top-left alignment) each ring step is one or
      two *grouped* kernel calls whose runs select the visible pairs, with no run-time control
      flow. Otherwise each chunk pair is routed at run time (``lax.switch``, from segments and
      positions only, so never from what padded memory holds): fully visible pairs and causal
      diagonal pairs whose query and key runs start at the same position on the kernels, the
      rest on the pure-JAX blocks. ``"xla"``: always the pure-JAX blocks. ``"cute"``: like
      ``None`` but raises ``NotImplementedError`` when the kernels cannot serve the call at all.
    max_segments: as in :func:`jax_padsafe.dot_product_attention` (runs per batch row per chunk
      that the kernels are sized for).
    sinks: as in :func:`jax_padsafe.dot_product_attention` (float ``[N]``, differentiable). The
      sinks join each row's result after the ring, as one more partial result merged through its
      lse (value 0), so the chunk pairs compute what they compute without them. Their gradient is
      one sum over every row: with sinks the backward has one all-reduce of ``N`` floats.
    Other arguments as in :func:`jax_padsafe.dot_product_attention`.

  Returns:
    ``out [B, T, N, Hv]`` (and ``lse [B, N, T]`` float32 with ``return_lse=True``) in the layout's
    order, sharded like the inputs.
  """
  checks.check_alignment(causal_alignment)
  if layout not in _LAYOUTS:
    raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  checks.check_float_inputs(query, key, value, rank=4, layout="[B, T, N, H]")
  b, t, n, h = query.shape
  s, nk = key.shape[1], key.shape[2]
  if key.shape[0] != b:
    raise ValueError(f"query batch ({b}) and key/value batch ({key.shape[0]}) differ")

  num = _axis_size(mesh, axis_name, "axis_name")
  nsub = 2 if layout == "zigzag" else 1
  for what, length in (("query sequence length T", t), ("key/value sequence length S", s)):
    if length % (num * nsub):
      raise ValueError(
          f"{what} ({length}) must be a multiple of {num * nsub} (= {num} devices on axis "
          f"{axis_name!r}{' x 2 for the zigzag layout' if nsub == 2 else ''}); pad the sequence "
          "(padding is free: mark it with lengths or negative segment ids)")
  if batch_axis is not None and b % _axis_size(mesh, batch_axis, "batch_axis"):
    raise ValueError(f"batch ({b}) must be a multiple of the size of batch_axis {batch_axis!r}")
  if head_axis is not None:
    hs = _axis_size(mesh, head_axis, "head_axis")
    if nk % hs or n % hs:
      raise ValueError(
          f"head_axis {head_axis!r} splits heads {hs} ways, but a shard must hold whole GQA groups: "
          f"the number of key/value heads ({nk}) and of query heads ({n}) must be multiples of "
          f"{hs}. Shard fewer ways over heads, or replicate heads (head_axis=None).")
  _check_distinct(axis_name, batch_axis, head_axis)

  checks.check_segment_pair(query_segment_ids, key_value_segment_ids)
  sinks = checks.sinks(sinks, n)
  # No sinks flag: the chunk pairs never see the sinks (they are merged in after the ring).
  spec = checks.make_spec(h, scale, is_causal, local_window_size, softcap, block_k)
  # Natural position held by every layout slot; segments and positions follow the layout.
  rows_q = rows_k = None
  if layout == "zigzag":
    rows_q = jnp.asarray(zigzag_indices(t, num))[None, :]
    rows_k = jnp.asarray(zigzag_indices(s, num))[None, :]
  # The chunk pairs get their kernel view (runs) on each device, so none is built here.
  problem = canonical.from_padded(spec, b, t, s, causal_alignment, query_seq_lengths,
                                  key_value_seq_lengths, query_segment_ids, key_value_segment_ids,
                                  kernel_view=False, positions=(rows_q, rows_k))
  checks.check_implementation(implementation)
  kernel_fwd, kernel_bwd = _ring_kernels(implementation, spec, query, key, value)
  max_runs = 1
  if query_segment_ids is not None:
    if max_segments is not None:
      max_runs = int(max_segments)
    elif checks.is_concrete(query_segment_ids):
      ids = np.asarray(query_segment_ids)
      ids = np.where(ids >= 0, ids, -1)
      prev = np.concatenate([np.full(ids.shape[:1] + (1,), -1), ids[:, :-1]], axis=1)
      max_runs = int(np.max(((ids >= 0) & (ids != prev)).sum(axis=1), initial=1))
    else:
      max_runs = canonical.DEFAULT_TRACED_MAX_RUNS
    max_runs = max(1, min(max_runs, t // (num * nsub)))
  grouped = _grouped_eligible(spec, t, s, query_segment_ids is not None,
                              causal_alignment == "bottom_right")
  cfg = _RingConfig(spec=spec, mesh=mesh, axis_name=axis_name, batch_axis=batch_axis,
                    head_axis=head_axis, nsub=nsub, skip=bool(skip_masked_blocks),
                    kernel_fwd=kernel_fwd, kernel_bwd=kernel_bwd, max_runs=max_runs,
                    grouped=grouped)

  # Sanitise before any arithmetic (selects): padded rows become exact zeros, and the gradient of
  # the select routes exact zeros to them.
  q, k, v = visibility.zero_padded_inputs(query, key, value, problem.q_seg, problem.k_seg)
  # Head dims without a compiled kernel run zero-padded to the next one (exact: see cute.widen).
  width = _ring_width(cfg, q, v)
  if width is not None and (width != h or width != value.shape[-1]):
    if cfg.kernel_bwd and cute.kernel_width(spec, q, v, aux=False, direction="backward") != width:
      cfg = dataclasses.replace(cfg, kernel_bwd=False)
    q, k, v = (cute.widen(x, width) for x in (q, k, v))
  sp = cfg.specs()
  q, k, v = (_constrain(x, mesh, sp["x"]) for x in (q, k, v))
  q_seg, k_seg, q_pos, k_pos = (_constrain(x, mesh, sp["row"]) for x in problem.rows())
  if sinks is not None:
    sinks = _constrain(sinks, mesh, sp["head"])
  out, lse = _ring(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks)
  out = out[..., :value.shape[-1]]
  return (out, lse) if return_lse else out


def _ring_width(cfg, q, v) -> int | None:
  """The compiled head dim the ring's kernel chunk pairs run at; None where no kernel runs them."""
  direction = "forward" if cfg.kernel_fwd else "backward" if cfg.kernel_bwd else None
  if direction is None:
    return None
  return cute.kernel_width(cfg.spec, q, v, aux=False, direction=direction)


def _has_explicit_axes(mesh):
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  return explicit is not None and any(t == explicit for t in getattr(mesh, "axis_types", ()))


def _constrain(x, mesh, spec):
  """Put ``x`` on ``NamedSharding(mesh, spec)``: ``reshard`` on meshes with Explicit axes (the
  ``jax.make_mesh`` default from jax 0.10), a sharding constraint on Auto meshes."""
  sharding = jax.sharding.NamedSharding(mesh, spec)
  if _has_explicit_axes(mesh):
    reshard = getattr(jax.sharding, "reshard", None) or getattr(jax, "reshard")
    return reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def _axis_size(mesh, axis, what):
  names = axis if isinstance(axis, tuple) else (axis,)
  size = 1
  for name in names:
    if name not in mesh.shape:
      raise ValueError(f"{what}: {name!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})")
    size *= mesh.shape[name]
  return size


def _check_distinct(*axes):
  seen = []
  for a in axes:
    for name in (a if isinstance(a, tuple) else (a,)):
      if name is None:
        continue
      if name in seen:
        raise ValueError(f"mesh axis {name!r} is used twice among axis_name/batch_axis/head_axis")
      seen.append(name)


# --------------------------------------------------------------------------------------------------
# The ring (custom_vjp outside, shard_map inside both halves)
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _RingConfig:
  """Static (hashable) description of one ring: the custom_vjp's non-differentiable argument."""
  spec: object
  mesh: object
  axis_name: object
  batch_axis: object
  head_axis: object
  nsub: int
  skip: bool
  kernel_fwd: bool = False  # chunk pairs may run on the GPU forward kernel
  kernel_bwd: bool = False  # ... and on the backward kernels
  max_runs: int = 1         # run slots per batch row of a chunk (see _core.problem)
  grouped: bool = False     # lengths-only problem: one kernel call per group of chunk pairs (below)

  @property
  def size(self):
    return _axis_size(self.mesh, self.axis_name, "axis_name")

  def specs(self):
    seq, bat, hd = self.axis_name, self.batch_axis, self.head_axis
    return dict(x=PartitionSpec(bat, seq, hd, None), row=PartitionSpec(bat, seq),
                lse=PartitionSpec(bat, hd, seq), head=PartitionSpec(hd))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks):
  return _ring_forward(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks)[:2]


# The shard_map'd halves are jitted once per ring configuration: called eagerly, a shard_map runs
# op by op on every device (minutes on CPU for a small causal zigzag ring); under an outer jit the
# inner jit is inlined, so traced programs are unchanged.
@functools.lru_cache(maxsize=64)
def _ring_forward_fn(cfg, with_sinks):
  sp = cfg.specs()
  return jax.jit(shard_map(functools.partial(_forward_local, cfg), mesh=cfg.mesh,
                           in_specs=(sp["x"], sp["x"], sp["x"], sp["row"], sp["row"], sp["row"], sp["row"],
                                     sp["head"] if with_sinks else None),
                           out_specs=(sp["x"], sp["lse"]) + ((sp["x"],) if with_sinks else ())))


@functools.lru_cache(maxsize=64)
def _ring_backward_fn(cfg):
  sp = cfg.specs()
  return jax.jit(shard_map(functools.partial(_backward_local, cfg), mesh=cfg.mesh,
                           in_specs=(sp["x"], sp["x"], sp["x"], sp["row"], sp["row"], sp["row"], sp["row"],
                                     sp["x"], sp["lse"], sp["x"], sp["lse"]),
                           out_specs=(sp["x"], sp["x"], sp["x"])))


def _ring_forward(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks):
  """``(o, lse, o32)``: ``o32``, the float32 output, only with sinks (else None), for their gradient."""
  out = _ring_forward_fn(cfg, sinks is not None)(q, k, v, q_seg, k_seg, q_pos, k_pos, sinks)
  return out if sinks is not None else out + (None,)


def _ring_fwd(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks):
  o, lse, o32 = _ring_forward(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks)
  return (o, lse), (q, k, v, q_seg, k_seg, q_pos, k_pos, sinks, o, lse, o32)


def _ring_bwd(cfg, res, cotangents):
  q, k, v, q_seg, k_seg, q_pos, k_pos, sinks, o, lse, o32 = res
  do, dlse = cotangents
  # The chunk pairs' gradients need no change for sinks: the final lse includes them, so each pair's
  # P is its share of the full softmax.
  dq, dk, dv = _ring_backward_fn(cfg)(q, k, v, q_seg, k_seg, q_pos, k_pos, o, lse, do, dlse)
  dsinks = None if sinks is None else _sink_gradient(sinks, q_seg, o32, lse, do, dlse)
  return dq, dk, dv, None, None, None, None, dsinks


def _sink_gradient(sinks, q_seg, o, lse, do, dlse):
  """``dsinks [N]``: the sink of row i has probability ``exp(sink - lse_i)`` and value 0, so its gradient
  is ``-P_sink * (rowsum(dO * O) - dlse)``, summed over the valid rows (padded rows selected away,
  whatever their cotangents hold) of every shard.  ``o``: the float32 output (the one rounded to the
  input dtype would put that rounding into every row's term)."""
  rows = visibility.row_is_valid(q_seg)[:, None, :] & (lse != -jnp.inf)            # [B, N, T]
  delta = jnp.einsum("btnh,btnh->bnt", do.astype(_F32), o.astype(_F32), precision=lax.Precision.HIGHEST)
  delta = delta - dlse.astype(_F32)
  p_sink = jnp.exp(sinks[None, :, None] - jnp.where(rows, lse, _F32(0)))
  return jnp.sum(jnp.where(rows, -p_sink * delta, _F32(0)), axis=(0, 2)).astype(sinks.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------------------------------------------
# Per-device bodies
# --------------------------------------------------------------------------------------------------

def _split(x, nsub, axis):
  return jnp.split(x, nsub, axis=axis) if nsub > 1 else [x]


def _shift(tree, cfg):
  """Send every leaf to the next device of the ring (device d receives from d-1)."""
  num = cfg.size
  perm = [(i, (i + 1) % num) for i in range(num)]
  return jax.tree_util.tree_map(lambda x: lax.ppermute(x, cfg.axis_name, perm), tree)


def _pack_chunk(k, v, k_seg, k_pos):
  """What travels around the ring: K and V in the input dtype (half the bytes of fp32 for bf16),
  side by side on the head dim (V's may differ from K's), and the key segments/positions, as two
  arrays (two collective-permutes per hop)."""
  return jnp.concatenate([k, v], axis=-1), jnp.stack([k_seg, k_pos])


def _unpack_chunk(kv, head_dim):
  kvf, kvi = kv
  return kvf[..., :head_dim], kvf[..., head_dim:], kvi[0], kvi[1]


def _merge(o_acc, lse_acc, o_blk, lse_blk):
  """Combine two partial results through their lse (``-inf`` = saw nothing). Selects only."""
  ninf = _F32(-jnp.inf)
  mx = jnp.maximum(lse_acc, lse_blk)
  empty = mx == ninf
  mx_safe = jnp.where(empty, _F32(0), mx)          # finite: never -inf - -inf below
  w_acc = jnp.where(lse_acc == ninf, _F32(0), jnp.exp(lse_acc - mx_safe))
  w_blk = jnp.where(lse_blk == ninf, _F32(0), jnp.exp(lse_blk - mx_safe))
  tot = jnp.where(empty, _F32(1), w_acc + w_blk)  # >= 1 where not empty
  lse = jnp.where(empty, ninf, mx_safe + jnp.log(tot))

  def rows(x):  # [B, N, T] -> [B, T, N, 1]
    return jnp.transpose(x, (0, 2, 1))[..., None]

  # A side that saw nothing is dropped by select (its weight is 0, but 0 * x is only safe for
  # finite x, and the contract forbids relying on that).
  part_acc = jnp.where(rows(lse_acc == ninf), _F32(0), rows(w_acc) * o_acc)
  part_blk = jnp.where(rows(lse_blk == ninf), _F32(0), rows(w_blk) * o_blk)
  o = jnp.where(rows(empty), _F32(0), (part_acc + part_blk) / rows(tot))
  return o, lse


def _merge_sinks(o_acc, lse_acc, sinks):
  """The ring's result with the sinks merged in: one more partial result, value 0 and lse the sink."""
  if sinks is None:
    return o_acc, lse_acc
  sink = jnp.broadcast_to(sinks.astype(_F32)[None, :, None], lse_acc.shape)
  return _merge(o_acc, lse_acc, jnp.zeros_like(o_acc), sink)


def _forward_local(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks):
  if cfg.grouped and cfg.kernel_fwd:
    return _grouped_forward_local(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks)
  spec, nsub = cfg.spec, cfg.nsub
  dtype = q.dtype
  qs = list(zip(_split(q, nsub, 1), _split(q_seg, nsub, 1), _split(q_pos, nsub, 1)))
  o_acc = [jnp.zeros(qa.shape[:3] + (v.shape[-1],), _F32) for qa, _, _ in qs]
  lse_acc = [jnp.full((qa.shape[0], qa.shape[2], qa.shape[1]), -jnp.inf, _F32) for qa, _, _ in qs]

  kv = _pack_chunk(k, v, k_seg, k_pos)
  num = cfg.size
  for step in range(num):
    # Issue the transfer of the next chunk before computing on this one (overlap).
    kv_next = _shift(kv, cfg) if step < num - 1 else None
    kc, vc, ksc, kpc = _unpack_chunk(kv, k.shape[-1])
    chunks = list(zip(_split(kc, nsub, 1), _split(vc, nsub, 1), _split(ksc, nsub, 1),
                      _split(kpc, nsub, 1)))
    for a, (qa, qsa, qpa) in enumerate(qs):
      for kb, vb, ksb, kpb in chunks:

        def compute(o_a, lse_a, qa=qa, qsa=qsa, qpa=qpa, kb=kb, vb=vb, ksb=ksb, kpb=kpb):
          o_b, lse_b = _block_forward(cfg, qa, kb, vb, qsa, ksb, qpa, kpb)
          # Padded query rows report lse 0: for the merge they saw nothing.
          lse_b = jnp.where(visibility.row_is_valid(qsa)[:, None, :], lse_b, _F32(-jnp.inf))
          return _merge(o_a, lse_a, o_b.astype(_F32), lse_b)

        if cfg.skip:
          o_acc[a], lse_acc[a] = lax.cond(
              visibility.may_see(spec, qsa, qpa, ksb, kpb, big=_BIG), compute,
              lambda o_a, lse_a: (o_a, lse_a), o_acc[a], lse_acc[a])
        else:
          o_acc[a], lse_acc[a] = compute(o_acc[a], lse_acc[a])
    kv = kv_next

  o = jnp.concatenate(o_acc, axis=1) if nsub > 1 else o_acc[0]
  lse = jnp.concatenate(lse_acc, axis=2) if nsub > 1 else lse_acc[0]
  o, lse = _merge_sinks(o, lse, sinks)
  o = visibility.zero_invalid_rows(o, q_seg)  # padded rows: out exactly 0 (with sinks too)
  lse = jnp.where(visibility.row_is_valid(q_seg)[:, None, :], lse, _F32(0))  # padded rows: lse exactly 0
  return (o.astype(dtype), lse) + ((o,) if sinks is not None else ())


def _backward_local(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, o, lse, do, dlse):
  if cfg.grouped and cfg.kernel_bwd:
    return _grouped_backward_local(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, o, lse, do, dlse)
  spec, nsub = cfg.spec, cfg.nsub
  qs = list(zip(_split(q, nsub, 1), _split(q_seg, nsub, 1), _split(q_pos, nsub, 1),
                _split(o, nsub, 1), _split(lse, nsub, 2), _split(do, nsub, 1),
                _split(dlse, nsub, 2)))
  dq = [jnp.zeros(qa.shape, _F32) for qa, *_ in qs]  # fp32 accumulators (dq, dk, dv)

  kv = _pack_chunk(k, v, k_seg, k_pos)
  dkv = None  # fp32 dK|dV (side by side on the head dim) of the chunk held, from the previous device
  num = cfg.size
  for step in range(num):
    kv_next = _shift(kv, cfg) if step < num - 1 else None
    kc, vc, ksc, kpc = _unpack_chunk(kv, k.shape[-1])
    chunks = list(zip(_split(kc, nsub, 1), _split(vc, nsub, 1), _split(ksc, nsub, 1),
                      _split(kpc, nsub, 1)))
    dk_parts, dv_parts = [], []
    for kb, vb, ksb, kpb in chunks:
      dk_b = jnp.zeros(kb.shape, _F32)
      dv_b = jnp.zeros(vb.shape, _F32)
      for a, (qa, qsa, qpa, oa, la, doa, dla) in enumerate(qs):

        def compute(dq_a, dk_b, dv_b, qa=qa, qsa=qsa, qpa=qpa, oa=oa, la=la, doa=doa, dla=dla,
                    kb=kb, vb=vb, ksb=ksb, kpb=kpb):
          g_q, g_k, g_v = _block_backward(cfg, qa, kb, vb, qsa, ksb, qpa, kpb, oa, la, doa, dla)
          return dq_a + g_q.astype(_F32), dk_b + g_k.astype(_F32), dv_b + g_v.astype(_F32)

        if cfg.skip:
          dq[a], dk_b, dv_b = lax.cond(visibility.may_see(spec, qsa, qpa, ksb, kpb, big=_BIG),
                                       compute, lambda *c: c, dq[a], dk_b, dv_b)
        else:
          dq[a], dk_b, dv_b = compute(dq[a], dk_b, dv_b)
      dk_parts.append(dk_b)
      dv_parts.append(dv_b)
    dk_here = jnp.concatenate(dk_parts, axis=1) if nsub > 1 else dk_parts[0]
    dv_here = jnp.concatenate(dv_parts, axis=1) if nsub > 1 else dv_parts[0]
    here = jnp.concatenate([dk_here, dv_here], axis=-1)
    dkv = here if dkv is None else dkv + here
    # The accumulator travels with its chunk; after the last step it arrives home.
    if num > 1:
      dkv = _shift(dkv, cfg)
    kv = kv_next

  dq = jnp.concatenate(dq, axis=1) if nsub > 1 else dq[0]
  h = k.shape[-1]
  return dq.astype(q.dtype), dkv[..., :h].astype(k.dtype), dkv[..., h:].astype(v.dtype)


# --------------------------------------------------------------------------------------------------
# One query/key chunk pair: the GPU kernels where they express it exactly, else pure JAX
# --------------------------------------------------------------------------------------------------

def _ring_kernels(implementation, spec, query, key, value):
  """(forward, backward) chunk pairs may use the kernels; raises for "cute" when they cannot."""
  if implementation == "xla":
    return False, False
  reason = _backends.kernel_unsupported_reason(spec, query, key, bias=None, mask=None, value=value)
  if reason is None and spec.has_window:
    reason = ("a local window on the ring: the chunk pairs' position offsets are not expressible "
              "by the kernels")
  if reason is not None:
    if implementation == "cute":
      raise NotImplementedError(f'ring_attention(implementation="cute") cannot run this call: '
                                f"{reason}. Use implementation=None to fall back to pure JAX.")
    if not spec.has_window:  # warns (CUDA hosts) if only a missing or unusable library is the reason
      _backends.note_fallback(spec, query, key, bias=None, mask=None, value=value)
    return False, False
  return True, cute.backward_supported(spec, query, key)


_PURE_JAX, _KERNEL_FULL, _KERNEL_CAUSAL = 0, 1, 2


def _block_route(cfg, q_seg, k_seg, q_pos, k_pos):
  """``(branch, runs)`` for one chunk pair, from segments and positions only.

  The kernels see the pair as runs (``_core.problem.Runs``). Without a causal mask they serve it whenever
  the runs describe it exactly. With one they serve a pair whose valid keys all precede its valid
  queries as a fully visible pair (non-causal kernel), and a diagonal pair whose query and key runs
  start at the same position with the causal kernel; anything else runs on the pure-JAX block.
  """
  runs, exact = canonical.runs_from_segments(q_seg, k_seg, q_pos, k_pos, max_runs=cfg.max_runs,
                                             positional=False, bottom_right=False)
  if not cfg.spec.causal:
    return jnp.where(exact, _KERNEL_FULL, _PURE_JAX), runs
  _, exact_causal = canonical.runs_from_segments(q_seg, k_seg, q_pos, k_pos,
                                                 max_runs=cfg.max_runs, positional=True,
                                                 bottom_right=False)
  big = jnp.int32(_BIG)
  kmax = jnp.max(jnp.where(visibility.row_is_valid(k_seg), k_pos, -big))
  qmin = jnp.min(jnp.where(visibility.row_is_valid(q_seg), q_pos, big))
  branch = jnp.where(exact & (kmax <= qmin), _KERNEL_FULL,
                     jnp.where(exact_causal, _KERNEL_CAUSAL, _PURE_JAX))
  return branch, runs


def _kernel_static(cfg, causal, tq, tk):
  # Runs from segment ids leave gaps between them: the rows no tile covers must be zeroed by the library
  # (a memset, or on Hopper the row-zeroing kernel), not promised covered.
  spec = dataclasses.replace(cfg.spec, causal=causal, bottom_right=False)
  return cute.kernel_static_args(spec, max_seqlen_q=tq, max_seqlen_k=tk, rows_covered=False)


def _block_forward(cfg, qa, kb, vb, qsa, ksb, qpa, kpb):
  """``(o float32, lse)`` of one chunk pair (lse 0 in padded query rows, -inf where none seen)."""
  spec = cfg.spec

  def pure_jax(qa, kb, vb):
    o, lse = xla.forward(spec, qa.astype(_F32), kb.astype(_F32), vb.astype(_F32), None, None,
                          qsa, ksb, qpa, kpb)
    return o.astype(_F32), lse

  if not cfg.kernel_fwd:
    return pure_jax(qa, kb, vb)
  fwd = partitioning.packed_to_runs(cute_forward.flash_forward)

  def on_cuda(qa, kb, vb):
    branch, runs = _block_route(cfg, qsa, ksb, qpa, kpb)

    def kernel(causal):
      def run(qa, kb, vb):
        o, lse = fwd(qa, kb, vb, *runs, **_kernel_static(cfg, causal, qa.shape[1], kb.shape[1]))
        return o.astype(_F32), lse
      return run

    return lax.switch(branch, [pure_jax, kernel(False), kernel(True)], qa, kb, vb)

  return lax.platform_dependent(qa, kb, vb, cuda=on_cuda, default=pure_jax)


def _block_backward(cfg, qa, kb, vb, qsa, ksb, qpa, kpb, oa, la, doa, dla):
  """``(dq, dk, dv)`` of one chunk pair given the ring's final ``o``/``lse`` of the query chunk."""
  spec = cfg.spec

  def pure_jax(qa, kb, vb, oa, la, doa, dla):
    g = xla.backward(spec, qa.astype(_F32), kb.astype(_F32), vb.astype(_F32), None, None, qsa,
                      ksb, qpa, kpb, oa, la, doa, dla)
    return tuple(x.astype(_F32) for x in g[:3])

  operands = (qa, kb, vb, oa, la, doa, dla)
  if not cfg.kernel_bwd:
    return pure_jax(*operands)
  bwd = partitioning.packed_backward_to_runs(cute_backward.flash_backward)

  def on_cuda(qa, kb, vb, oa, la, doa, dla):
    branch, runs = _block_route(cfg, qsa, ksb, qpa, kpb)

    def kernel(causal):
      def run(qa, kb, vb, oa, la, doa, dla):
        # With the ring's final lse (and Delta from the final o), each pair's P and dS are the
        # pair's share of the full softmax's, so the partial gradients just add up.
        g = bwd(qa, kb, vb, oa.astype(qa.dtype), la, doa.astype(qa.dtype), dla.astype(_F32),
                *runs, deterministic=spec.deterministic, partial_keys=True,
                **_kernel_static(cfg, causal, qa.shape[1], kb.shape[1]))
        return tuple(x.astype(_F32) for x in g)
      return run

    return lax.switch(branch, [pure_jax, kernel(False), kernel(True)], *operands)

  return lax.platform_dependent(*operands, cuda=on_cuda, default=pure_jax)


# --------------------------------------------------------------------------------------------------
# Grouped kernel calls: the ring without run-time control flow (lengths-only problems)
# --------------------------------------------------------------------------------------------------
#
# The general path above decides per chunk pair, at run time, whether to skip it (``lax.cond``) and
# which kernel serves it (``lax.switch``). On a GPU every such decision copies its predicate to the
# host and waits: on two H200s (32k tokens, causal zigzag) the syncs left the GPUs idle for 1.3 ms
# of a 6.4 ms forward, and the per-pair routing (a sort per pair), the copies that split every
# chunk in two and the merges cost another 1.3 ms.
#
# Without segment ids the valid rows of every local chunk are a prefix of it (lengths count natural
# positions, and positions increase along a contiguous chunk and along a zigzag chunk's two halves),
# and which chunk pairs are visible follows from the device index and the step alone. So each step
# becomes one or two kernel calls on the whole local chunks, whose *runs* (row ranges, see
# ``_core.problem``) select the pairs: a pair that sees nothing gets an empty run (its CTAs exit at once),
# and the device index enters only through the runs' start and length, which live on the device.
# The causal flag of every call is static: diagonal pairs (step 0) run on the causal kernel, every
# other visible pair is wholly visible (its keys precede its queries) and runs on the non-causal one.


def _grouped_eligible(spec, t, s, has_segment_ids, bottom_right):
  """Whether the grouped plan expresses this ring exactly (else the per-pair path)."""
  if has_segment_ids or spec.has_window:
    return False
  if spec.causal:  # diagonal pairs must start at the same position: top-left alignment, T == S
    return not bottom_right and t == s
  return True


def _grouped_plan(cfg, step, device, tq, tk):
  """The kernel calls of one ring step on ``device`` (traced): ``[(causal, spans)]``.

  ``causal`` is static; ``spans`` lists runs ``(q_lo, q_hi, k_lo, k_hi)`` of local rows (Python or
  traced int32 scalars) in start order; run ``r`` of the queries attends to run ``r`` of the keys.
  At step ``s`` the device holds the key chunk of device ``e = (d - s) mod P``, which precedes its
  own chunk iff ``s <= d``.
  """
  if not cfg.spec.causal:
    return [(False, [(0, tq, 0, tk)])]
  earlier = jnp.int32(step) <= device  # the keys held come from an earlier device
  if cfg.nsub == 1:  # contiguous: the diagonal, then whole chunks that are visible or not
    if step == 0:
      return [(True, [(0, tq, 0, tk)])]
    return [(False, [(0, jnp.where(earlier, tq, 0), 0, tk)])]
  # zigzag: local rows are chunk d (first half) and chunk 2P-1-d (second half).
  hq, hk = tq // 2, tk // 2
  if step == 0:  # both diagonals in one causal call; the second half sees the first half whole
    return [(True, [(0, hq, 0, hk), (hq, tq, hk, tk)]), (False, [(hq, tq, 0, hk)])]
  # Keys from an earlier device: both query halves see their first half (the second is later than
  # both). From a later one: the second query half sees both key halves, the first half nothing.
  return [(False, [(jnp.where(earlier, 0, hq), tq, 0, jnp.where(earlier, hk, tk))])]


def _grouped_runs(spans, q_valid, k_valid, tq):
  """``(runs, covered, q_run_id, run_id)`` of one call.

  ``q_valid``/``k_valid``: int32 ``[B]`` valid-prefix lengths of the local query chunk and the key
  chunk held. ``covered [B, tq]``: query rows inside a run that has keys (the rows whose lse the
  call defines). ``q_run_id [B, tq]``: the run index of every query row, -1 outside every run;
  ``run_id(start, used, rows)`` computes the same for the keys. Run indices as segment ids make the
  pure-JAX path compute exactly what the kernels compute.
  """
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  q_start = jnp.stack([i32(lo) for lo, _, _, _ in spans])
  k_start = jnp.stack([i32(lo) for _, _, lo, _ in spans])
  q_used = jnp.clip(q_valid[:, None] - q_start[None], 0,
                    jnp.stack([i32(hi) - i32(lo) for lo, hi, _, _ in spans])[None])
  k_used = jnp.clip(k_valid[:, None] - k_start[None], 0,
                    jnp.stack([i32(hi) - i32(lo) for _, _, lo, hi in spans])[None])
  b = q_valid.shape[0]
  runs = canonical.Runs(jnp.broadcast_to(q_start[None], (b, len(spans))), q_used.astype(jnp.int32),
                       jnp.broadcast_to(k_start[None], (b, len(spans))), k_used.astype(jnp.int32))

  def run_id(start, used, rows):
    r = jnp.arange(rows, dtype=jnp.int32)[None, :, None]
    inside = (r >= start[:, None, :]) & (r < (start + used)[:, None, :])  # [B, rows, R]
    ids = jnp.arange(len(spans), dtype=jnp.int32)
    return jnp.max(jnp.where(inside, ids, -1), axis=2)

  q_run_id = run_id(runs.q_start, runs.q_used, tq)
  has_keys = jnp.take_along_axis(runs.k_used, jnp.maximum(q_run_id, 0), axis=1) > 0
  covered = (q_run_id >= 0) & has_keys
  return runs, covered, q_run_id, run_id


def _grouped_forward_call(cfg, causal, spans, q, kc, vc, q_valid, k_valid, q_pos, k_pos):
  """``(o float32, lse)`` of one grouped call; lse is ``-inf`` in rows the call does not cover."""
  tq, tk = q.shape[1], kc.shape[1]
  runs, covered, q_run_id, run_id = _grouped_runs(spans, q_valid, k_valid, tq)
  spec = dataclasses.replace(cfg.spec, causal=causal)

  def pure_jax(q, kc, vc):
    k_run_id = run_id(runs.k_start, runs.k_used, tk)
    o, lse = xla.forward(spec, q.astype(_F32), kc.astype(_F32), vc.astype(_F32), None, None,
                          q_run_id, k_run_id, q_pos, k_pos)
    return o.astype(_F32), lse

  def on_cuda(q, kc, vc):
    fwd = partitioning.packed_to_runs(cute_forward.flash_forward)
    o, lse = fwd(q, kc, vc, *runs, **_kernel_static(cfg, causal, tq, tk))
    return o.astype(_F32), lse

  o, lse = lax.platform_dependent(q, kc, vc, cuda=on_cuda, default=pure_jax)
  return o, jnp.where(covered[:, None, :], lse, _F32(-jnp.inf))


def _grouped_backward_call(cfg, causal, spans, q, kc, vc, o, lse, do, dlse, q_valid, k_valid,
                           q_pos, k_pos):
  """``(dq, dk, dv)`` float32 of one grouped call (exact zeros outside its runs)."""
  tq, tk = q.shape[1], kc.shape[1]
  runs, _, q_run_id, run_id = _grouped_runs(spans, q_valid, k_valid, tq)
  spec = dataclasses.replace(cfg.spec, causal=causal)
  operands = (q, kc, vc, o, lse, do, dlse)

  def pure_jax(q, kc, vc, o, lse, do, dlse):
    k_run_id = run_id(runs.k_start, runs.k_used, tk)
    g = xla.backward(spec, q.astype(_F32), kc.astype(_F32), vc.astype(_F32), None, None, q_run_id,
                      k_run_id, q_pos, k_pos, o, lse, do, dlse)
    return tuple(x.astype(_F32) for x in g[:3])

  def on_cuda(q, kc, vc, o, lse, do, dlse):
    bwd = partitioning.packed_backward_to_runs(cute_backward.flash_backward)
    g = bwd(q, kc, vc, o.astype(q.dtype), lse, do.astype(q.dtype), dlse.astype(_F32), *runs,
            deterministic=cfg.spec.deterministic, partial_keys=True, **_kernel_static(cfg, causal, tq, tk))
    return tuple(x.astype(_F32) for x in g)

  return lax.platform_dependent(*operands, cuda=on_cuda, default=pure_jax)


def _valid_prefix(seg):
  return visibility.row_is_valid(seg).sum(axis=1).astype(jnp.int32)


def _grouped_forward_local(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, sinks):
  device = lax.axis_index(cfg.axis_name)
  q_valid = _valid_prefix(q_seg)
  held = (k, v, k_seg, k_pos)  # separate leaves: no stacking copy before the transfer
  o_acc = lse_acc = None
  num = cfg.size
  for step in range(num):
    held_next = _shift(held, cfg) if step < num - 1 else None  # issued before this step's compute
    kc, vc, ksc, kpc = held
    k_valid = _valid_prefix(ksc)
    for causal, spans in _grouped_plan(cfg, step, device, q.shape[1], kc.shape[1]):
      o_b, lse_b = _grouped_forward_call(cfg, causal, spans, q, kc, vc, q_valid, k_valid, q_pos, kpc)
      if o_acc is None:  # merging into (0, -inf) would return (o_b, lse_b) exactly
        o_acc, lse_acc = o_b, lse_b
      else:
        o_acc, lse_acc = _merge(o_acc, lse_acc, o_b, lse_b)
    held = held_next
  o_acc, lse_acc = _merge_sinks(o_acc, lse_acc, sinks)
  lse = jnp.where(visibility.row_is_valid(q_seg)[:, None, :], lse_acc, _F32(0))  # padded rows: lse exactly 0
  o = visibility.zero_invalid_rows(o_acc, q_seg)
  return (o.astype(q.dtype), lse) + ((o,) if sinks is not None else ())


def _grouped_backward_local(cfg, q, k, v, q_seg, k_seg, q_pos, k_pos, o, lse, do, dlse):
  device = lax.axis_index(cfg.axis_name)
  q_valid = _valid_prefix(q_seg)
  held = (k, v, k_seg, k_pos)
  dq = dkv = None
  num = cfg.size
  for step in range(num):
    held_next = _shift(held, cfg) if step < num - 1 else None
    kc, vc, ksc, kpc = held
    k_valid = _valid_prefix(ksc)
    dk_here = dv_here = None
    for causal, spans in _grouped_plan(cfg, step, device, q.shape[1], kc.shape[1]):
      g_q, g_k, g_v = _grouped_backward_call(cfg, causal, spans, q, kc, vc, o, lse, do, dlse,
                                             q_valid, k_valid, q_pos, kpc)
      dq = g_q if dq is None else dq + g_q
      dk_here = g_k if dk_here is None else dk_here + g_k
      dv_here = g_v if dv_here is None else dv_here + g_v
    dkv = (dk_here, dv_here) if dkv is None else (dkv[0] + dk_here, dkv[1] + dv_here)
    if num > 1:  # the accumulators travel with their chunk and arrive home after a full turn
      dkv = _shift(dkv, cfg)
    held = held_next
  return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)
