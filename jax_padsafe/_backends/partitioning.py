"""Shard-local partitioning for opaque attention forwards (FFI kernels) over batch and heads.

A bare ``jax.ffi.ffi_call`` gives XLA no partitioning rule, so batch/head-sharded operands are
all-gathered in front of it. :func:`partition_packed_forward` and :func:`partition_padded_forward`
wrap such a forward in ``jax.experimental.custom_partitioning`` with a Shardy ``sharding_rule``
(and the GSPMD callbacks, for programs that turn Shardy off) so that it runs on each device's
shard with no collective:

* heads: query heads ``N`` and key/value heads ``K`` are split the same number of ways, so a
  shard holds whole GQA groups (local ratio ``N/K`` unchanged). With ``K == 1`` (MQA) the single
  key/value head is replicated and only the query heads are split. Any other head sharding (``K``
  not a multiple of the number of head shards) cannot be honoured shard-locally: by default the
  heads are re-sharded to replicated (XLA inserts an all-gather in front of the op; documented in
  ``docs/sharding.md``), or, with ``head_sharding="strict"``, a ``ValueError`` is raised.
* batch (padded layout only): every per-sequence operand is split along the batch.
* sequence/token axes and the head dim are never split (``cu_seqlens`` index the whole packed
  buffer): a sharding there is re-sharded to replicated. Sequence parallelism is
  :func:`jax_padsafe.sharding.ring_attention`'s job.

The wrapped function must be a pure function of its array arguments given the static keyword
arguments (which must be hashable): it is traced once per shard shape.

Signatures (``jax_padsafe._backends.cute.forward.flash_forward`` is the packed one)::

  packed: fn(q [total_q, N, H], k [total_k, K, H], v [total_k, K, H],
             cu_seqlens_q [B+1], cu_seqlens_k [B+1], seqused_q [B], seqused_k [B], **static)
          -> (o [total_q, N, H], lse [N, total_q])
  padded: fn(q [B, T, N, H], k [B, S, K, H], v [B, S, K, H], q_len [B], kv_len [B], **static)
          -> (o [B, T, N, H], lse [B, N, T])

:func:`packed_to_padded` turns a packed forward into a padded one (``cu_seqlens`` rebuilt from the
*local* batch), which is what the padded layout needs to be batch-shardable.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_padsafe._core import problem as canonical

__all__ = ["partition_packed_forward", "partition_padded_forward", "partition_runs_forward",
           "partition_packed_backward", "partition_runs_backward", "packed_to_padded",
           "packed_to_runs", "packed_backward_to_runs", "partition_runs_forward_aux",
           "partition_runs_backward_aux", "packed_to_runs_aux", "packed_backward_to_runs_aux",
           "partition_runs_dbias", "packed_dbias_to_runs"]

# Per-dimension roles: "b" batch (shardable), "n" query heads, "k" key/value heads, None: never split.
_PACKED_ARGS = ((None, "n", None), (None, "k", None), (None, "k", None), (None,), (None,),
                (None,), (None,))
_PACKED_OUTS = ((None, "n", None), ("n", None))
_PACKED_RULE = "t (k g) h, s k h, s k h, c, c, b, b -> t (k g) h, (k g) t"
_PACKED_REPLICATED = ("t", "s", "h", "c", "b")

_PADDED_ARGS = (("b", None, "n", None), ("b", None, "k", None), ("b", None, "k", None), ("b",),
                ("b",))
_PADDED_OUTS = (("b", None, "n", None), ("b", "n", None))
_PADDED_RULE = "b t (k g) h, b s k h, b s k h, b, b -> b t (k g) h, b (k g) t"
_PADDED_REPLICATED = ("t", "s", "h")

_RUNS_ARGS = _PADDED_ARGS[:3] + (("b", None),) * 4
_RUNS_RULE = "b t (k g) h, b s k h, b s k h, b r, b r, b r, b r -> b t (k g) h, b (k g) t"

_Q, _KV, _LSE = (None, "n", None), (None, "k", None), ("n", None)
_PACKED_BWD_ARGS = (_Q, _KV, _KV, _Q, _LSE, _Q, _LSE, (None,), (None,), (None,), (None,))
_PACKED_BWD_OUTS = (_Q, _KV, _KV)
_PACKED_BWD_RULE = ("t (k g) h, s k h, s k h, t (k g) h, (k g) t, t (k g) h, (k g) t, c, c, b, b "
                    "-> t (k g) h, s k h, s k h")
_BQ, _BKV, _BLSE = ("b", None, "n", None), ("b", None, "k", None), ("b", "n", None)
_RUNS_BWD_ARGS = (_BQ, _BKV, _BKV, _BQ, _BLSE, _BQ, _BLSE) + (("b", None),) * 4
_RUNS_BWD_OUTS = (_BQ, _BKV, _BKV)
_RUNS_BWD_RULE = ("b t (k g) h, b s k h, b s k h, b t (k g) h, b (k g) t, b t (k g) h, b (k g) t, "
                  "b r, b r, b r, b r -> b t (k g) h, b s k h, b s k h")

# The aux kernels (masks and biases as tensors) take, after the runs, operands [Bx, Hx, ., .] whose batch
# and head dimensions either match the call's (then they split with it) or are 1 (then every shard reads the
# one copy): their roles and rule terms come from their shapes, call by call (`_aux_terms`).  The forward
# also returns the exact row statistics, which the backward takes after the aux operands.
_RUNS_AUX_OUTS = _PADDED_OUTS + (("b", "n", None),) * 2
_RUNS_AUX_OUT_RULE = ", b (k g) t, b (k g) t"
_RUNS_BWD_STATS = (("b", "n", None),) * 2
_RUNS_BWD_STATS_RULE = ", b (k g) t, b (k g) t"

# The bias gradient (q, k, v, do, Delta, the runs, the aux operands, the statistics -> dbias): dbias has the
# bias's shape, so its roles and rule term are the bias's; a dimension the bias broadcasts is summed over.
_RUNS_DBIAS_ARGS = (_BQ, _BKV, _BKV, _BQ, _BLSE) + (("b", None),) * 4
_RUNS_DBIAS_RULE = "b t (k g) h, b s k h, b s k h, b t (k g) h, b (k g) t, b r, b r, b r, b r -> "

_HEAD_MODES = ("reshard", "strict")


def _with_sinks(arg_roles, rule, sinks: bool):
  """A forward's roles and rule with the attention sinks ``[N]`` as its last operand (split with the query
  heads) when ``sinks``."""
  if not sinks:
    return arg_roles, rule
  lhs, rhs = rule.split(" -> ")
  return arg_roles + (("n",),), f"{lhs}, (k g) -> {rhs}"


def partition_packed_forward(fn, *, head_sharding: str = "reshard", sinks: bool = False):
  """Wrap a packed-layout forward so that head-sharded calls run shard-local (see module doc); ``sinks``: it
  takes the attention sinks ``[N]`` as its last array argument."""
  args, rule = _with_sinks(_PACKED_ARGS, _PACKED_RULE, sinks)
  return _wrap(fn, args, _PACKED_OUTS, rule, _PACKED_REPLICATED, head_sharding,
               heads_of=lambda q, k: (q.shape[1], k.shape[1]))


def partition_padded_forward(fn, *, head_sharding: str = "reshard"):
  """Wrap a padded-layout forward so that batch- and head-sharded calls run shard-local."""
  return _wrap(fn, _PADDED_ARGS, _PADDED_OUTS, _PADDED_RULE, _PADDED_REPLICATED, head_sharding,
               heads_of=lambda q, k: (q.shape[2], k.shape[2]))


def packed_to_padded(packed_fn):
  """A padded forward ``(q [B,T,N,H], k, v, q_len, kv_len, **static)`` from a packed one.

  Sequence ``b`` owns packed rows ``b*T .. b*T+T-1``; ``cu_seqlens`` are built from the shapes it
  sees, so under :func:`partition_padded_forward` they describe the local batch shard.
  """
  runs_fn = packed_to_runs(packed_fn)

  @functools.wraps(packed_fn)
  def padded(q, k, v, q_len, kv_len, **static):
    return runs_fn(q, k, v, *canonical.runs_from_lengths(q_len, kv_len), **static)

  return padded


def packed_to_runs(packed_fn):
  """A padded forward over runs ``(q [B,T,N,H], k, v, q_start, q_used, k_start, k_used [B,R])``.

  See :mod:`jax_padsafe._core.problem`: run ``r`` of batch row ``b`` becomes packed sequence ``b*R+r``,
  with offsets built from the shapes it sees (the local batch shard under partitioning).
  """

  @functools.wraps(packed_fn)
  def padded(q, k, v, q_start, q_used, k_start, k_used, *rest, **static):
    b, t, n, h = q.shape
    s, nk = k.shape[1], k.shape[2]
    view = canonical.packed_view(canonical.Runs(q_start, q_used, k_start, k_used), t, s)
    o, lse = packed_fn(
        q.reshape(b * t, n, h), k.reshape(b * s, nk, k.shape[-1]), v.reshape(b * s, nk, v.shape[-1]),
        *view, *rest, **static)
    return o.reshape(b, t, n, o.shape[-1]), _rows_to_batch(lse, b, t)

  return padded


def packed_backward_to_runs(packed_bwd, with_delta: bool = False):
  """The backward counterpart of :func:`packed_to_runs`.

  ``packed_bwd(q, k, v, o, lse [N, total_q], do, dlse [N, total_q], cu_q, cu_k, used_q, used_k,
  **static) -> (dq, dk, dv)`` becomes ``fn(q, k, v, o, lse [B,N,T], do, dlse [B,N,T], q_start,
  q_used, k_start, k_used, **static) -> (dq, dk, dv)`` on the padded layout. ``with_delta``: the packed
  backward also returns its Delta workspace ``[N, B*T]``, returned as ``[B, N, T]`` after dq, dk, dv.
  """

  @functools.wraps(packed_bwd)
  def padded(q, k, v, o, lse, do, dlse, q_start, q_used, k_start, k_used, **static):
    b, t, n, h = q.shape
    s = k.shape[1]
    view = canonical.packed_view(canonical.Runs(q_start, q_used, k_start, k_used), t, s)
    flat = lambda x, rows: x.reshape((b * rows,) + x.shape[2:])
    dq, dk, dv, *delta = packed_bwd(
        flat(q, t), flat(k, s), flat(v, s), flat(o, t), _batch_to_rows(lse), flat(do, t),
        _batch_to_rows(dlse), *view, **static)
    grads = (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape))
    return grads + ((_rows_to_batch(delta[0], b, t),) if with_delta else ())

  return padded


def packed_to_runs_aux(packed_fn):
  """:func:`packed_to_runs` for the aux kernels: ``fn(q, k, v, q_start, q_used, k_start, k_used, mask, bias,
  tile_map, row_range, col_range, slopes, **static) -> (o, lse, row_max, log_sum)`` (statistics ``[B, N, T]``); the
  packed function takes the aux operands after the sequence bounds and returns the statistics ``[N, B*T]``."""

  @functools.wraps(packed_fn)
  def padded(q, k, v, q_start, q_used, k_start, k_used, *aux, **static):
    b, t, n, h = q.shape
    s, nk = k.shape[1], k.shape[2]
    view = canonical.packed_view(canonical.Runs(q_start, q_used, k_start, k_used), t, s)
    o, *rows = packed_fn(q.reshape(b * t, n, h), k.reshape(b * s, nk, k.shape[-1]),
                         v.reshape(b * s, nk, v.shape[-1]), *view, *aux, **static)
    return (o.reshape(b, t, n, o.shape[-1]), *(_rows_to_batch(x, b, t) for x in rows))

  return padded


def packed_backward_to_runs_aux(packed_bwd, with_delta: bool = False):
  """:func:`packed_backward_to_runs` for the aux kernels: the aux operands and the forward's statistics
  (``[B, N, T]``) follow the runs. ``with_delta``: the packed backward also returns its Delta workspace
  ``[N, B*T]``, returned as ``[B, N, T]`` after dq, dk, dv (the bias gradient's input)."""

  @functools.wraps(packed_bwd)
  def padded(q, k, v, o, lse, do, dlse, q_start, q_used, k_start, k_used, mask, bias, tile_map, row_range,
             col_range, slopes, row_max, log_sum, **static):
    b, t, n, h = q.shape
    s = k.shape[1]
    view = canonical.packed_view(canonical.Runs(q_start, q_used, k_start, k_used), t, s)
    flat = lambda x, rows: x.reshape((b * rows,) + x.shape[2:])
    dq, dk, dv, *delta = packed_bwd(
        flat(q, t), flat(k, s), flat(v, s), flat(o, t), _batch_to_rows(lse), flat(do, t),
        _batch_to_rows(dlse), *view, mask, bias, tile_map, row_range, col_range, slopes, _batch_to_rows(row_max),
        _batch_to_rows(log_sum), **static)
    grads = (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape))
    return grads + ((_rows_to_batch(delta[0], b, t),) if with_delta else ())

  return padded


def packed_dbias_to_runs(packed_fn):
  """The bias gradient on the padded layout: ``fn(q, k, v, do, delta, q_start, q_used, k_start, k_used,
  mask, bias, tile_map, row_range, col_range, slopes, row_max, log_sum, **static) -> dbias`` (Delta and the
  statistics ``[B, N, T]``); the packed function takes them ``[N, B*T]``."""

  @functools.wraps(packed_fn)
  def padded(q, k, v, do, delta, q_start, q_used, k_start, k_used, mask, bias, tile_map, row_range, col_range,
             slopes, row_max, log_sum, **static):
    b, t, n, h = q.shape
    s = k.shape[1]
    view = canonical.packed_view(canonical.Runs(q_start, q_used, k_start, k_used), t, s)
    flat = lambda x, rows: x.reshape((b * rows,) + x.shape[2:])
    return packed_fn(flat(q, t), flat(k, s), flat(v, s), flat(do, t), _batch_to_rows(delta), *view, mask, bias,
                     tile_map, row_range, col_range, slopes, _batch_to_rows(row_max), _batch_to_rows(log_sum),
                     **static)

  return padded


def _rows_to_batch(x, b, t):  # [N, B*T] -> [B, N, T]
  return x.reshape(x.shape[0], b, t).transpose(1, 0, 2)


def _batch_to_rows(x):  # [B, N, T] -> [N, B*T]
  return jnp.transpose(x, (1, 0, 2)).reshape(x.shape[1], -1)


def partition_runs_forward(fn, *, head_sharding: str = "reshard", sinks: bool = False):
  """Wrap a runs forward (see :func:`packed_to_runs`) so batch/head-sharded calls run shard-local (``sinks``: as
  in :func:`partition_packed_forward`)."""
  args, rule = _with_sinks(_RUNS_ARGS, _RUNS_RULE, sinks)
  return _wrap(fn, args, _PADDED_OUTS, rule, _PADDED_REPLICATED + ("r",), head_sharding,
               heads_of=lambda q, k: (q.shape[2], k.shape[2]))


def partition_packed_backward(fn, *, head_sharding: str = "reshard"):
  """Wrap a packed backward (``backward.flash_backward``'s signature) so head-sharded calls run
  shard-local. dK/dV sum over a group's query heads, so MQA (one key/value head) is never split
  by heads here: the heads are re-sharded to replicated instead."""
  return _wrap(fn, _PACKED_BWD_ARGS, _PACKED_BWD_OUTS, _PACKED_BWD_RULE, _PACKED_REPLICATED,
               head_sharding, heads_of=lambda q, k: (q.shape[1], k.shape[1]), sums_over_heads=True)


def partition_packed_backward_delta(fn, *, head_sharding: str = "reshard"):
  """:func:`partition_packed_backward` for a packed backward that also returns its Delta workspace
  ``[N, total_q]`` (split like lse)."""
  return _wrap(fn, _PACKED_BWD_ARGS, _PACKED_BWD_OUTS + (_LSE,), _PACKED_BWD_RULE + ", (k g) t",
               _PACKED_REPLICATED, head_sharding, heads_of=lambda q, k: (q.shape[1], k.shape[1]),
               sums_over_heads=True)


def partition_runs_backward(fn, *, head_sharding: str = "reshard"):
  """Wrap a runs backward (see :func:`packed_backward_to_runs`) for batch/head sharding."""
  return _wrap(fn, _RUNS_BWD_ARGS, _RUNS_BWD_OUTS, _RUNS_BWD_RULE, _PADDED_REPLICATED + ("r",),
               head_sharding, heads_of=lambda q, k: (q.shape[2], k.shape[2]), sums_over_heads=True)


def partition_runs_backward_delta(fn, *, head_sharding: str = "reshard"):
  """:func:`partition_runs_backward` for ``packed_backward_to_runs(..., with_delta=True)`` (Delta
  ``[B, N, T]`` as a fourth result, split like lse)."""
  return _wrap(fn, _RUNS_BWD_ARGS, _RUNS_BWD_OUTS + (_BLSE,), _RUNS_BWD_RULE + ", b (k g) t",
               _PADDED_REPLICATED + ("r",), head_sharding, heads_of=lambda q, k: (q.shape[2], k.shape[2]),
               sums_over_heads=True)


def partition_runs_forward_aux(fn, *, head_sharding: str = "reshard", sinks: bool = False):
  """Wrap a runs forward of the aux kernels (:func:`packed_to_runs_aux`) for batch/head sharding: the
  aux operands split with the call where their batch / head dimension is the call's, else replicate
  (``sinks``: the attention sinks ``[N]`` follow them, split with the query heads)."""
  return _wrap(fn, _RUNS_ARGS, _RUNS_AUX_OUTS, _RUNS_RULE + _RUNS_AUX_OUT_RULE,
               _PADDED_REPLICATED + ("r",), head_sharding,
               heads_of=lambda q, k: (q.shape[2], k.shape[2]), aux_at=len(_RUNS_ARGS),
               aux_tail=((("n",),), ", (k g)") if sinks else None)


def partition_runs_backward_aux(fn, *, head_sharding: str = "reshard"):
  """Wrap a runs backward of the aux kernels (:func:`packed_backward_to_runs_aux`) for batch/head
  sharding (see :func:`partition_runs_backward`)."""
  return _wrap(fn, _RUNS_BWD_ARGS, _RUNS_BWD_OUTS, _RUNS_BWD_RULE, _PADDED_REPLICATED + ("r",),
               head_sharding, heads_of=lambda q, k: (q.shape[2], k.shape[2]), sums_over_heads=True,
               aux_at=len(_RUNS_BWD_ARGS), aux_tail=(_RUNS_BWD_STATS, _RUNS_BWD_STATS_RULE))


def partition_runs_backward_delta_aux(fn, *, head_sharding: str = "reshard"):
  """:func:`partition_runs_backward_aux` for ``packed_backward_to_runs_aux(..., with_delta=True)`` (Delta
  ``[B, N, T]`` as a fourth result, split like the statistics)."""
  return _wrap(fn, _RUNS_BWD_ARGS, _RUNS_BWD_OUTS + (("b", "n", None),), _RUNS_BWD_RULE + ", b (k g) t",
               _PADDED_REPLICATED + ("r",), head_sharding, heads_of=lambda q, k: (q.shape[2], k.shape[2]),
               sums_over_heads=True, aux_at=len(_RUNS_BWD_ARGS), aux_tail=(_RUNS_BWD_STATS, _RUNS_BWD_STATS_RULE))


def partition_runs_dbias(fn, *, head_sharding: str = "reshard"):
  """Wrap a runs bias gradient (:func:`packed_dbias_to_runs`) for batch/head sharding: dbias splits with
  the call where the bias's batch / head dimension is the call's; a dimension the bias broadcasts (size
  1) is summed over, so a call sharded along it is re-sharded to replicated there (every shard then
  computes the whole sum; XLA gathers the operands)."""
  return _wrap(fn, _RUNS_DBIAS_ARGS, None, _RUNS_DBIAS_RULE, _PADDED_REPLICATED + ("r",), head_sharding,
               heads_of=lambda q, k: (q.shape[2], k.shape[2]), sums_over_heads=True,
               aux_at=len(_RUNS_DBIAS_ARGS), aux_tail=(_RUNS_BWD_STATS, _RUNS_BWD_STATS_RULE), out_aux=1)


# --------------------------------------------------------------------------------------------------

def _aux_terms(shapes, b, n):
  """Roles and rule terms of aux operands ``[Bx, Hx, ., .]`` (Bx in {1, B}, Hx in {1, N}): the batch and
  head dimensions take the call's factors where they match it, every other dimension a factor of its own
  that is never split (returned as the third element)."""
  roles, terms, own = [], [], []
  for i, shape in enumerate(shapes):
    names = [f"x{i}{c}" for c in "abcd"]
    dims = list(names)
    r = [None] * 4
    if shape[0] == b:
      dims[0], r[0] = "b", "b"
    if shape[1] == n:
      dims[1], r[1] = "(k g)", "n"
    own += [nm for nm, d in zip(names, dims) if nm == d]
    roles.append(tuple(r))
    terms.append(" ".join(dims))
  return tuple(roles), "".join(", " + t for t in terms), tuple(own)


def _wrap(fn, arg_roles, out_roles, rule, replicated, head_sharding, heads_of,
          sums_over_heads=False, aux_at=None, aux_tail=None, out_aux=None):
  """``out_aux``: the one result has the roles and rule term of aux operand ``out_aux`` (``out_roles``
  and the rule's right-hand side are then unused); the call dimensions that operand does not carry are
  reduced over, so they are never split."""
  if head_sharding not in _HEAD_MODES:
    raise ValueError(f"head_sharding must be one of {_HEAD_MODES}, got {head_sharding!r}")

  @functools.wraps(fn)
  def wrapped(*args, **static):
    args = tuple(jnp.asarray(a) for a in args)
    roles_all, rule_all, replicated_all = arg_roles, rule, replicated
    outs, reduce = out_roles, ()
    if aux_at is not None:
      # The aux operands (6: mask, bias, block map, row and column ranges, ALiBi slopes), then, for the backward, the
      # forward's statistics: roles and rule terms from their shapes.
      n_aux = 6
      aux_roles, aux_rule, own = _aux_terms([a.shape for a in args[aux_at:aux_at + n_aux]],
                                            args[0].shape[0], heads_of(args[0], args[1])[0])
      tail_roles, tail_rule = aux_tail or ((), "")
      roles_all = arg_roles + aux_roles + tail_roles
      lhs, rhs = rule.split(" -> ")
      reduce = ()
      outs = out_roles
      if out_aux is not None:
        outs = (aux_roles[out_aux],)
        rhs = aux_rule.split(", ")[1 + out_aux]
        reduce = tuple(r for r in ("b", "n") if r not in aux_roles[out_aux])
      rule_all = f"{lhs}{aux_rule}{tail_rule} -> {rhs}"
      replicated_all = replicated + own + (("b",) if "b" in reduce else ()) + (("k", "g") if "n" in reduce else ())
    if len(args) != len(roles_all):
      raise TypeError(f"{fn.__name__} takes {len(roles_all)} array arguments, got {len(args)}")
    for a, roles in zip(args, roles_all):
      if a.ndim != len(roles):
        raise ValueError(f"{fn.__name__}: expected an operand of rank {len(roles)}, got {a.shape}")
    n, nk = heads_of(args[0], args[1])
    if nk <= 0 or n % nk:
      raise ValueError(f"{fn.__name__}: query heads ({n}) must be a multiple of key/value heads ({nk})")
    op = _build(fn, tuple(sorted(static.items())), roles_all, outs, rule_all, replicated_all,
                head_sharding, n // nk, nk == 1, sums_over_heads, reduce)
    return op(*args)

  return wrapped


@functools.lru_cache(maxsize=None)
def _build(fn, static_items, arg_roles, out_roles, rule, replicated, head_sharding, group, mqa,
           sums_over_heads, reduce=()):
  from jax.experimental.custom_partitioning import custom_partitioning  # pylint: disable=g-import-not-at-top
  static = dict(static_items)

  def call(*args):
    return fn(*args, **static)

  op = custom_partitioning(call)

  def decide(mesh, arg_shapes):
    """Mesh axes for the batch and the heads that this call can honour shard-locally."""
    q_shape, k_shape = arg_shapes[0], arg_shapes[1]
    q_spec = _spec_of(q_shape.sharding, len(q_shape.shape))
    q_roles = arg_roles[0]
    batch_axes = head_axes = None
    if "b" in q_roles:
      d = q_roles.index("b")
      batch_axes = _divisible(mesh, q_spec[d], q_shape.shape[d])
    d = q_roles.index("n")
    head_axes = _divisible(mesh, q_spec[d], q_shape.shape[d])
    nk = k_shape.shape[arg_roles[1].index("k")]
    kv_axes = head_axes
    if head_axes is not None:
      ways = _size(mesh, head_axes)
      if nk % ways == 0:
        kv_axes = head_axes          # whole groups per shard
      elif nk == 1 and not sums_over_heads:
        kv_axes = None               # MQA forward: every shard needs the one key/value head
      elif nk == 1:
        head_axes = kv_axes = None   # MQA backward: dK/dV sum over all query heads; not split
      else:
        if head_sharding == "strict":
          raise ValueError(
              f"attention: heads sharded {ways} ways over mesh axes {head_axes!r} cannot be honoured "
              f"shard-locally with {nk} key/value heads (groups of {group} query heads): a shard "
              "must hold whole groups, so the number of key/value heads must be a multiple of the "
              "number of head shards (or be 1). Shard the heads fewer ways.")
        head_axes = kv_axes = None   # documented re-shard: heads replicated
    if "b" in reduce:
      batch_axes = None  # the result sums over the batch: every shard takes the whole batch
    if "n" in reduce:
      head_axes = kv_axes = None
    return batch_axes, head_axes, kv_axes

  def shardings(mesh, roles_list, batch_axes, head_axes, kv_axes):
    table = {"b": batch_axes, "n": head_axes, "k": kv_axes, None: None}
    return tuple(NamedSharding(mesh, P(*(table[r] for r in roles))) for roles in roles_list)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    batch_axes, head_axes, kv_axes = decide(mesh, arg_shapes)
    arg_sh = shardings(mesh, arg_roles, batch_axes, head_axes, kv_axes)
    out_sh = shardings(mesh, out_roles, batch_axes, head_axes, kv_axes)
    return mesh, call, out_sh[0] if len(out_roles) == 1 else out_sh, arg_sh

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    batch_axes, head_axes, kv_axes = decide(mesh, arg_shapes)
    out_sh = shardings(mesh, out_roles, batch_axes, head_axes, kv_axes)
    return out_sh[0] if len(out_roles) == 1 else out_sh  # a single result takes a single sharding

  rule, factor_sizes = _specialise_rule(rule, group, mqa)
  if mqa and sums_over_heads:
    replicated = replicated + ("g",)  # the query heads are a reduction factor of dK/dV
  # Shardy wants the special factors once each, in the order of their first appearance in the rule (dbias
  # with one key/value head names "g" twice: a reduced head dimension and MQA's summed query heads).
  order = _factor_order(rule)
  replicated = tuple(sorted({f for f in replicated if f in order}, key=order.index))
  try:
    op.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=replicated, **factor_sizes)
  except TypeError:  # a jax without need_replication_factors: the callback re-shards anyway
    op.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     **factor_sizes)
  return op


def _specialise_rule(rule, group, mqa):
  """The query-head dimension is the compound factor ``(k g)`` for GQA; Shardy rejects size-1
  members of a compound, so MHA (``g == 1``) uses ``k`` and MQA (one key/value head) uses ``g``
  alone (the key/value head dimension keeps its own size-1 factor ``k``)."""
  if group == 1:
    return rule.replace("(k g)", "k"), {}
  if mqa:
    return rule.replace("(k g)", "g"), {}
  return rule, {"g": group}


def _factor_order(rule):
  order = []
  for tok in rule.replace("(", " ").replace(")", " ").replace(",", " ").replace("->", " ").split():
    if tok not in order:
      order.append(tok)
  return order


def _spec_of(sharding, rank):
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (rank - len(spec))


def _names(entry):
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _size(mesh, axes):
  return math.prod(mesh.shape[a] for a in _names(axes))


def _divisible(mesh, entry, dim):
  """``entry`` (mesh axes of one dimension) if it splits ``dim`` evenly, else ``None``."""
  names = _names(entry)
  if not names:
    return None
  if dim % _size(mesh, names):
    return None
  return names[0] if len(names) == 1 else names
