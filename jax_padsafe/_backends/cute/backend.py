"""The kernels as a ``Backend``: the canonical problem's kernel view to partitioned kernel calls.

``problem.kernel`` is the packed layout's :class:`SeqLens` (``cu_seqlens`` / ``seqused``, heads
shardable) or the padded layout's :class:`Runs` (batch and heads shardable); either goes to one
``custom_partitioning`` kernel call (``partitioning``), which for runs builds the kernels'
``cu_seqlens`` from its shard-local batch. ``lax.platform_dependent`` lowers the same call to the
pure-JAX path on non-CUDA platforms, so a jitted program stays portable; with traced segment ids a
run-time ``lax.cond`` on ``problem.runs_exact`` sends layouts the kernels cannot express to the
pure-JAX path on CUDA as well.

A mask or bias goes to the kernels' aux variants (``aux``), on the padded layout with lengths, batch
and head shardable like the other calls (the mask and bias split with the call where their batch /
head dimension is the call's, else every shard reads the one copy). Their forward also returns the
exact row statistics (max and log-sum apart), which the backward kernels read; ``dbias`` comes from
a kernel call of its own after the backward (summed over the bias's broadcast dimensions), computed only
where it is used (XLA removes it when the bias gets no gradient).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import custom_batching
from jax import lax

from jax_padsafe._backends import partitioning as P
from jax_padsafe._backends import xla
from jax_padsafe._backends.cute import aux as aux_ops
from jax_padsafe._backends.cute import backward as cute_backward_ops
from jax_padsafe._backends.cute import forward as cute_forward_ops
from jax_padsafe._backends.cute import library
from jax_padsafe._backends.cute import sinks as sink_ops
from jax_padsafe._backends.cute import split_kv
from jax_padsafe._core import visibility
from jax_padsafe._core.backend import Backend
from jax_padsafe._core.spec import AttentionSpec


def kernel_static_args(spec: AttentionSpec, *, max_seqlen_q: int, max_seqlen_k: int,
                       rows_covered: bool):
  """The kernels' static keyword arguments for ``spec`` (``flash_forward``'s, and
  ``flash_backward``'s but ``deterministic``)."""
  return dict(
      max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
      scale=float(spec.scale), causal=spec.causal, bottom_right=spec.bottom_right,
      window_left=-1 if spec.window_left is None else spec.window_left,
      window_right=-1 if spec.window_right is None else spec.window_right,
      softcap=0.0 if spec.softcap is None else float(spec.softcap),
      rows_covered=rows_covered)


def _problem_static_args(spec, problem):
  return kernel_static_args(spec, max_seqlen_q=problem.max_seqlen_q,
                            max_seqlen_k=problem.max_seqlen_k,
                            rows_covered=problem.dense_rows and not problem.packed)


@functools.lru_cache(maxsize=None)
def _partitioned_kernel(kind: str):
  """A kernel entry point wrapped so that batch/head-sharded calls run shard-local (no all-gather).

  ``kind``: ``fwd_packed``/``bwd_packed`` (the problem's ``SeqLens``, heads shardable) or
  ``fwd_runs``/``bwd_runs`` (its ``Runs``; batch and heads shardable), ``bwd_delta_packed`` /
  ``bwd_delta_runs`` (those backwards also returning the Delta workspace), or ``fwd_split_runs`` /
  ``fwd_split_packed``: those forwards for few query rows, rewritten by ``split_kv`` (GQA heads
  packed into rows, keys split), sharded the same way. A forward kind ending in ``_sinks`` takes the
  attention sinks ``[N]`` as its last array argument (split with the query heads).
  """
  fwd, bwd = cute_forward_ops.flash_forward, cute_backward_ops.flash_backward
  return {
      "fwd_aux_runs": lambda: P.partition_runs_forward_aux(P.packed_to_runs_aux(_fwd_aux_packed)),
      "fwd_aux_runs_sinks": lambda: P.partition_runs_forward_aux(P.packed_to_runs_aux(_fwd_aux_packed),
                                                                 sinks=True),
      "bwd_aux_runs": lambda: P.partition_runs_backward_aux(P.packed_backward_to_runs_aux(_bwd_aux_packed)),
      "bwd_aux_delta_runs": lambda: P.partition_runs_backward_delta_aux(
          P.packed_backward_to_runs_aux(functools.partial(_bwd_aux_packed, return_delta=True),
                                        with_delta=True)),
      "dbias_runs": lambda: P.partition_runs_dbias(P.packed_dbias_to_runs(_dbias_packed)),
      "fwd_packed": lambda: P.partition_packed_forward(fwd),
      "fwd_runs": lambda: P.partition_runs_forward(P.packed_to_runs(fwd)),
      "fwd_packed_sinks": lambda: P.partition_packed_forward(fwd, sinks=True),
      "fwd_runs_sinks": lambda: P.partition_runs_forward(P.packed_to_runs(fwd), sinks=True),
      "fwd_split_runs": lambda: P.partition_runs_forward(split_kv.split_kv_to_runs(fwd)),
      "fwd_split_packed": lambda: P.partition_packed_forward(split_kv.split_kv_packed(fwd)),
      "fwd_split_runs_sinks": lambda: P.partition_runs_forward(split_kv.split_kv_to_runs(fwd), sinks=True),
      "fwd_split_packed_sinks": lambda: P.partition_packed_forward(split_kv.split_kv_packed(fwd), sinks=True),
      "bwd_packed": lambda: P.partition_packed_backward(bwd),
      "bwd_runs": lambda: P.partition_runs_backward(P.packed_backward_to_runs(bwd)),
      # The same returning the dQ kernel's rowsum(P dP) (the Delta workspace), for the sinks' gradient.
      "bwd_delta_packed": lambda: P.partition_packed_backward_delta(functools.partial(bwd, return_delta=True)),
      "bwd_delta_runs": lambda: P.partition_runs_backward_delta(
          P.packed_backward_to_runs(functools.partial(bwd, return_delta=True), with_delta=True)),
  }[kind]()


def _fwd_aux_packed(q, k, v, cu_q, cu_k, used_q, used_k, mask, bias, tile_map, row_range, col_range, slopes,
                    sinks=None, *, has_mask, has_bias, has_alibi, **static):
  """``flash_forward`` with its aux operands (and the sinks) as positional arrays (for the partitioning
  wrappers)."""
  ops = aux_ops.AuxOperands(mask, bias, tile_map, row_range, col_range, slopes, has_mask, has_bias, has_alibi)
  return cute_forward_ops.flash_forward(q, k, v, cu_q, cu_k, used_q, used_k, sinks, **static, aux=ops)


def _bwd_aux_packed(q, k, v, o, lse, do, dlse, cu_q, cu_k, used_q, used_k, mask, bias, tile_map, row_range,
                    col_range, slopes, row_max, log_sum, *, has_mask, has_bias, has_alibi, **static):
  """``flash_backward`` with its aux operands and statistics as positional arrays."""
  ops = aux_ops.AuxOperands(mask, bias, tile_map, row_range, col_range, slopes, has_mask, has_bias, has_alibi)
  return cute_backward_ops.flash_backward(q, k, v, o, lse, do, dlse, cu_q, cu_k, used_q, used_k, **static,
                                          aux=ops, stats=(row_max, log_sum))


def _dbias_packed(q, k, v, do, delta, cu_q, cu_k, used_q, used_k, mask, bias, tile_map, row_range, col_range,
                  slopes, row_max, log_sum, *, has_mask, has_bias, has_alibi, **static):
  """``flash_dbias`` with its aux operands and statistics as positional arrays."""
  ops = aux_ops.AuxOperands(mask, bias, tile_map, row_range, col_range, slopes, has_mask, has_bias, has_alibi)
  return cute_backward_ops.flash_dbias(q, k, v, do, delta, cu_q, cu_k, used_q, used_k, aux=ops,
                                       stats=(row_max, log_sum), **static)


# Positions of the aux operands ([Bx, ...], Bx in {1, B}) among a kernel call's arguments.
_AUX_POSITIONS = {"fwd_aux_runs": range(7, 13), "fwd_aux_runs_sinks": range(7, 13), "bwd_aux_runs": range(11, 17),
                  "bwd_aux_delta_runs": range(11, 17)}


@functools.lru_cache(maxsize=None)
def _kernel_call(kind: str, static_items: tuple):
  """The partitioned kernel call for one static configuration, with a vmap rule.

  ``custom_partitioning`` has no batching rule, so ``jax.vmap`` is given one here: for the padded
  (runs) layout the mapped axis is just more batch rows and is folded into the batch (one kernel
  launch); for the packed layout each mapped problem is its own launch (``lax.map``).
  """
  inner = _partitioned_kernel(kind)
  static = dict(static_items)

  @custom_batching.custom_vmap
  def call(*args):
    return inner(*args, **static)

  @call.def_vmap
  def call_vmap(axis_size, in_batched, *args):
    # Sinks (the last argument of a "_sinks" kind) mapped with the problems differ between them: one launch each.
    mapped_sinks = kind.endswith("_sinks") and in_batched[-1]
    if kind.endswith("packed") or kind.endswith("packed_sinks") or kind == "dbias_runs" or mapped_sinks:
      # dbias sums over the batch rows its bias broadcasts over: mapped problems cannot be folded into
      # one batch, so each is its own launch.
      args = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
              for a, batched in zip(args, in_batched)]
      out = lax.map(lambda xs: call(*xs), tuple(args))
      return out, (True,) * len(out)
    aux = _AUX_POSITIONS.get(kind, ())
    b = args[0].shape[1] if in_batched[0] else args[0].shape[0]
    folded = []
    for i, (a, batched) in enumerate(zip(args, in_batched)):
      if kind.endswith("_sinks") and i == len(args) - 1:
        folded.append(a)  # the sinks, the same for every mapped problem
        continue
      if i in aux and not batched and a.shape[0] == 1:
        folded.append(a)  # a mask or bias shared by every batch row of every mapped problem stays one
        continue
      if not batched:
        a = jnp.broadcast_to(a, (axis_size,) + a.shape)
      if i in aux:  # [axis, Bx, ...], Bx in {1, B}: the batch dimension first, so that it folds like q
        a = jnp.broadcast_to(a, (axis_size, b) + a.shape[2:])
      folded.append(a.reshape((-1,) + a.shape[2:]))
    out = call(*folded)
    out = tuple(x.reshape((axis_size, -1) + x.shape[1:]) for x in out)
    return out, (True,) * len(out)

  return call


def _run_kernel_or_fallback(problem, on_cuda, elsewhere, *operands):
  """``on_cuda`` on CUDA devices and ``elsewhere`` on other platforms; when the segment-id runs
  were traced (``problem.runs_exact``), a run-time ``lax.cond`` sends layouts the kernels cannot
  express exactly to ``elsewhere`` (the pure-JAX path) on CUDA as well."""
  cuda = on_cuda
  if problem.runs_exact is not None:
    cuda = lambda *xs: lax.cond(problem.runs_exact, on_cuda, elsewhere, *xs)
  return lax.platform_dependent(*operands, cuda=cuda, default=elsewhere)


def cute_forward(spec, q, k, v, bias, mask, sinks, alibi, problem):
  """Forward on the GPU kernel for CUDA, the pure-JAX forward elsewhere (same results contract)."""
  return cute_forward_with_stats(spec, q, k, v, bias, mask, sinks, alibi, problem)[:2]


def kernel_width(spec: AttentionSpec, q, v, *, aux: bool, direction: str = "forward") -> int | None:
  """The compiled head dim this call runs at (``library.kernel_head_dim``), or None."""
  return library.kernel_head_dim(dtype=q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                                 softcap=spec.softcap, aux=aux, direction=direction)


def widen(x, width: int):
  """``x`` with its head dim (last axis) zero-padded to ``width``: zero columns add exact zeros to every
  score and give zero output columns, so a kernel compiled for ``width`` computes the narrower problem."""
  pad = width - x.shape[-1]
  return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _uses_aux(bias, mask, alibi) -> bool:
  """Whether a call runs the aux kernels (a mask, a bias or ALiBi slopes)."""
  return bias is not None or mask is not None or alibi is not None


def cute_forward_with_stats(spec, q, k, v, bias, mask, sinks, alibi, problem):
  """``(o, lse, stats)``: ``stats`` is ``None`` without a mask, bias or ALiBi, else the exact row statistics
  ``(row_max, log_sum)`` ``[B, N, T]`` of the aux kernels and the mask's block summary
  (:func:`_aux_forward`). Head dims without a compiled kernel (and a value head dim of its own) run
  zero-padded to the next compiled one. Sinks join in the forward kernels' epilogue; where no kernel takes them
  (decoding's split keys, the pure-JAX path) they join the results afterwards (:mod:`.sinks`)."""
  h, hv = q.shape[-1], v.shape[-1]
  width = kernel_width(spec, q, v, aux=_uses_aux(bias, mask, alibi))
  if width is not None and (width != h or width != hv):
    q, k, v = (widen(x, width) for x in (q, k, v))
  o, lse, stats = _forward_compiled_width(spec, q, k, v, bias, mask, sinks, alibi, problem)
  return o[..., :hv], lse, stats


def _join_sinks(o, lse, sinks, problem, stats=None):
  """``(o, lse, stats)`` of a forward that ran without the sinks, with them joined (:func:`sinks.forward`;
  ``stats``: the aux forward's ``(row_max, log_sum)``)."""
  if sinks is None:
    return o, lse, stats
  return sink_ops.forward(o, lse, sinks, visibility.row_is_valid(problem.q_seg), stats)


def _forward_compiled_width(spec, q, k, v, bias, mask, sinks, alibi, problem):
  """:func:`cute_forward_with_stats` for head dims the kernels are compiled for."""
  if _uses_aux(bias, mask, alibi):
    return _aux_forward(spec, q, k, v, bias, mask, sinks, alibi, problem)
  static = tuple(sorted(_problem_static_args(spec, problem).items()))
  # Few query rows per sequence (decoding) are rewritten first: GQA heads packed into rows, keys split (the
  # sinks then join the merged result, split_kv).
  split = split_kv.eligible(spec, problem)
  kernel_sinks = () if sinks is None else (sinks,)
  suffix = "_sinks" if kernel_sinks else ""

  def on_cuda(q, k, v):
    if problem.packed:  # canonical batch of one holding the packed rows
      o, lse = _kernel_call(("fwd_split_packed" if split else "fwd_packed") + suffix, static)(
          q[0], k[0], v[0], *problem.kernel, *kernel_sinks)
      return o[None], lse[None]
    return _kernel_call(("fwd_split_runs" if split else "fwd_runs") + suffix, static)(
        q, k, v, *problem.kernel, *kernel_sinks)

  def elsewhere(q, k, v):
    q, k, v = visibility.zero_padded_inputs(q, k, v, problem.q_seg, problem.k_seg)
    return _join_sinks(*xla.forward(spec, q, k, v, bias, mask, *problem.rows()), sinks, problem)[:2]

  o, lse = _run_kernel_or_fallback(problem, on_cuda, elsewhere, q, k, v)
  return o, lse, None


def _kernel_slopes(spec, alibi, bias):
  """The ALiBi slopes per query row ``[1|B, N, 1]`` as the kernels take them, ``[1|B, N]``: in the units of
  the aux kind's scores (``ffi/aux.h``, ``AuxKind``). With a bias tensor the bias kind adds them to
  natural-unit scores; without one the mask kind adds them to the raw scores q.k (the plain kernels' softmax
  applies the scale after), so they are divided by the scale here."""
  if alibi is None:
    return None
  slopes = alibi[:, :, 0]
  return slopes if bias is not None else slopes / jnp.float32(spec.scale)


def _lengths(problem):
  """``(q_len, kv_len)`` ``[B]`` of the lengths layout (one run per sequence from row 0: its used rows), which the
  mask's block summary counts cells by."""
  return problem.kernel.q_used[:, 0], problem.kernel.k_used[:, 0]


def _aux_forward(spec, q, k, v, bias, mask, sinks, alibi, problem):
  """The forward with a mask, bias and / or ALiBi slopes on the aux kernels (padded layout with lengths), the
  sinks joined in their epilogue."""
  b, t, n, _ = q.shape
  ops = aux_ops.operands(bias, mask, alibi_slopes=_kernel_slopes(spec, alibi, bias), lengths=_lengths(problem))
  static = tuple(sorted(dict(_problem_static_args(spec, problem), **ops.flags).items()))
  kernel_sinks = () if sinks is None else (sinks,)

  def on_cuda(q, k, v):
    o, lse, row_max, log_sum = _kernel_call("fwd_aux_runs" + ("_sinks" if kernel_sinks else ""), static)(
        q, k, v, *problem.kernel, *ops.arrays, *kernel_sinks)
    return o, lse, (row_max, log_sum)

  def elsewhere(q, k, v):
    q, k, v = visibility.zero_padded_inputs(q, k, v, problem.q_seg, problem.k_seg)
    o, lse, st = xla.forward_with_stats(spec, q, k, v, bias, mask, *problem.rows(), alibi=alibi)
    # The kernels' conventions: (0, +inf) in valid rows without a visible key.
    m, log_l = st.m.reshape(b, n, t), st.log_l.reshape(b, n, t)
    empty = m == -jnp.inf
    return _join_sinks(o, lse, sinks, problem, (jnp.where(empty, 0.0, m), jnp.where(empty, jnp.inf, log_l)))

  o, lse, stats = _run_kernel_or_fallback(problem, on_cuda, elsewhere, q, k, v)
  # The mask's block summary travels with the statistics, so that the backward does not recompute it.
  return o, lse, stats + (ops.tile_map, ops.row_range, ops.col_range)


def backward_supported(spec: AttentionSpec, q, k) -> bool:
  """Whether the backward kernels are built and support this call's static configuration."""
  if not library.backward_available():
    return False
  return library.unsupported_reason(
      dtype=q.dtype, head_dim=q.shape[-1], num_heads=q.shape[-2], num_kv_heads=k.shape[-2],
      causal=spec.causal, window=spec.has_window, softcap=spec.softcap,
      direction="backward") is None


def cute_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, stats=None):
  """``(dq, dk, dv, dbias, dsinks)`` on the GPU kernels (CUDA) where built and supported, else the pure-JAX
  backward. Head dims without a compiled kernel run zero-padded to the next one, as in the forward. With
  sinks, ``o`` and ``lse`` (and the row statistics) are the forward's, sinks included, from which the
  kernels recompute the probabilities with the sink, and the sinks' gradient is :func:`sinks.gradient`."""
  h, hv = q.shape[-1], v.shape[-1]
  o_given, do_given = o, do
  width = kernel_width(spec, q, v, aux=_uses_aux(bias, mask, alibi), direction="backward")
  if width is not None and (width != h or width != hv):
    q, k, v, o, do = (widen(x, width) for x in (q, k, v, o, do))
  dq, dk, dv, dbias, rowsum_p_dp = _backward_compiled_width(spec, q, k, v, bias, mask, sinks, alibi, problem, o,
                                                            lse, do, dlse, stats)
  dsinks = None
  if sinks is not None:
    dsinks = sink_ops.gradient(sinks, o_given, lse, do_given, dlse, visibility.row_is_valid(problem.q_seg),
                               rowsum_p_dp)
  return dq[..., :h], dk[..., :h], dv[..., :hv], dbias, dsinks


def _backward_compiled_width(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, stats=None):
  """``(dq, dk, dv, dbias, rowsum_p_dp)`` of :func:`cute_backward` for head dims the kernels are compiled for (or
  the pure-JAX backward); ``rowsum_p_dp`` ``[B, N, T]`` (with sinks): where the sinks' gradient takes its Delta
  from (see :func:`sinks.gradient`), None for ``rowsum(dO * o)``."""
  if _uses_aux(bias, mask, alibi):
    return _aux_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, stats)
  if not backward_supported(spec, q, k):
    return _pure_jax_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse) + (None,)
  static = tuple(sorted(dict(_problem_static_args(spec, problem),
                             deterministic=spec.deterministic).items()))

  # With sinks the kernels also return the dQ kernel's rowsum(P dP), the sinks' gradient's Delta.
  kind = "bwd_delta_" if sinks is not None else "bwd_"

  def on_cuda(q, k, v, o, lse, do, dlse):
    dlse = dlse.astype(jnp.float32)
    if problem.packed:
      grads = _kernel_call(kind + "packed", static)(
          q[0], k[0], v[0], o[0], lse[0], do[0], dlse[0], *problem.kernel)
      return tuple(g[None] for g in grads)
    return _kernel_call(kind + "runs", static)(q, k, v, o, lse, do, dlse, *problem.kernel)

  def elsewhere(q, k, v, o, lse, do, dlse):
    grads = _pure_jax_backward(spec, q, k, v, None, None, sinks, None, problem, o, lse, do, dlse)[:3]
    if sinks is None:
      return grads
    # rowsum(P dP) as the pure-JAX path knows it.
    return grads + (jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1),)

  do = do.astype(q.dtype)
  dq, dk, dv, *rowsum = _run_kernel_or_fallback(problem, on_cuda, elsewhere, q, k, v, o, lse, do, dlse)
  return dq, dk, dv, None, (rowsum[0] if rowsum else None)


def _aux_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, stats):
  """The backward of :func:`_aux_forward`: dQ, dK, dV on the aux kernels from its exact row statistics;
  dbias (when there is a bias) from the bias gradient kernel (a call of its own, which XLA drops where
  dbias is unused), or from the pure-JAX backward where that kernel does not apply (a bias broadcast
  over queries, a library without it); with sinks, the kernels' rowsum(P * dP) for their gradient (the fifth
  result, as :func:`_backward_compiled_width`'s)."""
  b, t, n, _ = q.shape
  num_kv = k.shape[2]
  if stats is None or not library.backward_available() or library.unsupported_reason(
      dtype=q.dtype, head_dim=q.shape[-1], num_heads=n, num_kv_heads=num_kv, causal=spec.causal,
      window=spec.has_window, softcap=spec.softcap, aux=True, direction="backward") is not None:
    return _pure_jax_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse) + (None,)
  stats, summary = stats[:2], stats[2:]
  row_stats = xla.row_stats_from_kernels(o, *stats, num_kv)
  ops = aux_ops.operands(bias, mask, summary=summary, alibi_slopes=_kernel_slopes(spec, alibi, bias),
                         lengths=_lengths(problem))
  static = tuple(sorted(dict(_problem_static_args(spec, problem), deterministic=spec.deterministic,
                             **ops.flags).items()))

  kernel_dbias = bias is not None and bias.shape[2] == t and library.dbias_available(q.dtype, q.shape[-1])

  # The dQ kernel leaves rowsum(P dP) in its Delta workspace: returned where dbias or the sinks' gradient
  # takes it.
  want_rowsum = kernel_dbias or sinks is not None

  def on_cuda(q, k, v, o, lse, do, dlse):
    if want_rowsum:
      return _kernel_call("bwd_aux_delta_runs", static)(q, k, v, o, lse, do, dlse.astype(jnp.float32),
                                                        *problem.kernel, *ops.arrays, *stats)
    return _kernel_call("bwd_aux_runs", static)(q, k, v, o, lse, do, dlse.astype(jnp.float32), *problem.kernel,
                                                *ops.arrays, *stats) + (jnp.zeros((b, n, t), jnp.float32),)

  def elsewhere(q, k, v, o, lse, do, dlse):
    grads = _pure_jax_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, row_stats)[:3]
    # rowsum(P dP) as the pure-JAX path knows it (dbias does not read it there).
    rowsum = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    return grads + (rowsum,)

  do = do.astype(q.dtype)
  dq, dk, dv, delta = _run_kernel_or_fallback(problem, on_cuda, elsewhere, q, k, v, o, lse, do, dlse)
  dbias = None
  if bias is not None:
    def pure_dbias(q, k, v, o, lse, do, dlse, delta):
      del delta
      return _pure_jax_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, row_stats)[3]

    def dbias_on_cuda(q, k, v, o, lse, do, dlse, rowsum_p_dp):
      # Delta = rowsum(P dP) - dlse, with and without sinks (a sink has no value).
      delta = rowsum_p_dp - dlse.astype(jnp.float32)
      return _kernel_call("dbias_runs", static)(q, k, v, do, delta, *problem.kernel, *ops.arrays, *stats)

    dbias = _run_kernel_or_fallback(problem, dbias_on_cuda if kernel_dbias else pure_dbias, pure_dbias,
                                    q, k, v, o, lse, do, dlse, delta)
  return dq, dk, dv, dbias, delta if sinks is not None else None


def _pure_jax_backward(spec, q, k, v, bias, mask, sinks, alibi, problem, o, lse, do, dlse, stats=None):
  """The pure-JAX backward inside the kernel backend, which gets q/k/v unsanitised (see
  ``Backend.reads_padding_safely``): padded input rows are zeroed first, and the padded rows of
  the gradients are zeroed after (what the select in front of the pure-JAX path does by its VJP).
  ``stats``: :class:`xla.RowStats` where the forward kept them."""
  q, k, v = visibility.zero_padded_inputs(q, k, v, problem.q_seg, problem.k_seg)
  dq, dk, dv, dbias, _ = xla.backward(spec, q, k, v, bias, mask, *problem.rows(), o, lse, do, dlse, stats,
                                      sinks=sinks, alibi=alibi)
  dq, dk, dv = visibility.zero_padded_inputs(dq, dk, dv, problem.q_seg, problem.k_seg)
  return dq, dk, dv, dbias


CUTE = Backend("cute", cute_forward, cute_backward, reads_padding_safely=True,
               forward_with_stats=cute_forward_with_stats)
