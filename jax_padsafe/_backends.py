"""Backend selection: which forward function runs inside the shared ``custom_vjp``.

* ``"xla"``: the pure-JAX forward (every platform, every feature).
* ``"cute"``: the CuTe DSL kernels through XLA FFI on CUDA devices (``lax.platform_dependent``
  lowers the same call to the pure-JAX forward on other platforms, so a jitted program stays
  portable). A feature combination the kernels do not support raises ``NotImplementedError``.
* ``None``: the kernels when they are built and support the call, else the pure-JAX forward.

The backward runs on the CuTe backward kernels where they are built and support the call (CUDA),
and is the pure-JAX blockwise backward otherwise.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import custom_batching
from jax import lax

from jax_padsafe import _masking
from jax_padsafe import _split_kv
from jax_padsafe import _xla
from jax_padsafe._spec import AttentionSpec


def _kernel_ops():
  """The kernel module, or ``None`` when this install has no kernel library."""
  try:
    from jax_padsafe._cute import ops  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return ops


def kernel_unsupported_reason(spec: AttentionSpec, query, key, *, bias, mask, segments_reason=None):
  """``None`` if the GPU forward kernel can run this call, else why not (a sentence)."""
  ops = _kernel_ops()
  if ops is None:
    return "the kernel runtime (jax_padsafe._cute) is not part of this install"
  if not ops.library_available():
    return ("the kernel library was not built into this install "
            "(see BUILD.md: build from source with the kernels enabled)")
  if mask is not None:
    return "a boolean `mask` is only supported by the pure-JAX path (use lengths or segment ids)"
  if segments_reason is not None:
    return segments_reason
  n, h = query.shape[-2], query.shape[-1]
  return ops.unsupported_reason(
      dtype=query.dtype, head_dim=h, head_dim_v=h, num_heads=n, num_kv_heads=key.shape[-2],
      causal=spec.causal, window=spec.has_window, softcap=spec.softcap,
      has_bias=bias is not None)


def choose_backend(implementation, spec: AttentionSpec, query, key, *, bias, mask,
                   segments_reason=None):
  """The ``_xla.Backend`` for this call (see the module docstring for the rules)."""
  if implementation == "xla":
    return _xla.XLA
  reason = kernel_unsupported_reason(spec, query, key, bias=bias, mask=mask,
                                     segments_reason=segments_reason)
  if reason is None:
    return CUTE
  if implementation == "cute":
    raise NotImplementedError(f'implementation="cute" cannot run this call: {reason}. '
                              'Use implementation=None to fall back to the pure-JAX path.')
  return _xla.XLA


@functools.lru_cache(maxsize=None)
def _partitioned_kernel(kind: str):
  """A kernel entry point wrapped so that batch/head-sharded calls run shard-local (no all-gather).

  ``kind``: ``fwd_packed``/``bwd_packed`` (the varlen layout, heads shardable) or
  ``fwd_runs``/``bwd_runs`` (the padded layout as runs per batch row, see ``_packing``; batch and
  heads shardable), or ``fwd_split_runs`` / ``fwd_split_packed``: those forwards for few query rows,
  rewritten by ``_split_kv`` (GQA heads packed into rows, keys split), sharded the same way.
  """
  from jax_padsafe import _partitioning as P  # pylint: disable=g-import-not-at-top
  from jax_padsafe._cute import bwd_ops, ops  # pylint: disable=g-import-not-at-top
  return {
      "fwd_packed": lambda: P.partition_packed_forward(ops.flash_forward),
      "fwd_runs": lambda: P.partition_runs_forward(P.packed_to_runs(ops.flash_forward)),
      "fwd_split_runs": lambda: P.partition_runs_forward(_split_kv.split_kv_to_runs(ops.flash_forward)),
      "fwd_split_packed": lambda: P.partition_packed_forward(_split_kv.split_kv_packed(ops.flash_forward)),
      "bwd_packed": lambda: P.partition_packed_backward(bwd_ops.flash_backward),
      "bwd_runs": lambda: P.partition_runs_backward(
          P.packed_backward_to_runs(bwd_ops.flash_backward)),
  }[kind]()


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
    args = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched in zip(args, in_batched)]
    if kind.endswith("packed"):
      out = lax.map(lambda xs: call(*xs), tuple(args))
    else:
      fold = lambda x: x.reshape((-1,) + x.shape[2:])
      out = call(*(fold(a) for a in args))
      out = tuple(x.reshape((axis_size, -1) + x.shape[1:]) for x in out)
    return out, (True,) * len(out)

  return call


def _kernel_static_args(spec: AttentionSpec):
  return dict(
      max_seqlen_q=int(spec.max_seqlen_q), max_seqlen_k=int(spec.max_seqlen_k),
      scale=float(spec.scale), causal=spec.causal, bottom_right=spec.bottom_right,
      window_left=-1 if spec.window_left is None else spec.window_left,
      window_right=-1 if spec.window_right is None else spec.window_right,
      softcap=0.0 if spec.softcap is None else float(spec.softcap),
      rows_covered=spec.dense_rows and not spec.packed)


def _run_kernel_or_fallback(kernel_args, on_cuda, elsewhere, *operands):
  """``on_cuda`` on CUDA devices and ``elsewhere`` on other platforms; when the segment-id runs
  were traced (``kernel_args["runs_exact"]``), a run-time ``lax.cond`` sends layouts the kernels
  cannot express exactly to ``elsewhere`` (the pure-JAX path) on CUDA as well."""
  exact = kernel_args.get("runs_exact") if kernel_args else None
  cuda = on_cuda
  if exact is not None:
    cuda = lambda *xs: lax.cond(exact, on_cuda, elsewhere, *xs)
  return lax.platform_dependent(*operands, cuda=cuda, default=elsewhere)


def _runs_args(kernel_args):
  return tuple(kernel_args[name] for name in ("q_start", "q_used", "k_start", "k_used"))


def _packed_args(kernel_args):
  return tuple(kernel_args[name] for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q",
                                              "seqused_k"))


def cute_forward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, kernel_args):
  """Forward on the GPU kernel for CUDA, the pure-JAX forward elsewhere (same results contract)."""
  static = tuple(sorted(_kernel_static_args(spec).items()))

  def on_cuda(q, k, v):
    if spec.packed:  # canonical batch of one holding the packed rows
      # Few query rows per sequence (decoding) are rewritten first: GQA heads packed into rows, keys split.
      kind = "fwd_split_packed" if _split_kv.eligible(spec, spec.max_seqlen_q, kernel_args) else "fwd_packed"
      o, lse = _kernel_call(kind, static)(q[0], k[0], v[0], *_packed_args(kernel_args))
      return o[None], lse[None]
    kind = "fwd_split_runs" if _split_kv.eligible(spec, q.shape[1], kernel_args) else "fwd_runs"
    return _kernel_call(kind, static)(q, k, v, *_runs_args(kernel_args))

  def elsewhere(q, k, v):
    q, k, v = _masking.zero_padded_inputs(q, k, v, q_seg, k_seg)
    return _xla.forward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos)

  return _run_kernel_or_fallback(kernel_args, on_cuda, elsewhere, q, k, v)


def _backward_kernel_ops(spec: AttentionSpec, q, k):
  """The backward kernel module if it is built and supports this call, else ``None``."""
  try:
    from jax_padsafe._cute import bwd_ops  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  if not bwd_ops.backward_available():
    return None
  reason = bwd_ops.unsupported_reason(
      dtype=q.dtype, head_dim=q.shape[-1], num_heads=q.shape[-2], num_kv_heads=k.shape[-2],
      causal=spec.causal, window=spec.has_window, softcap=spec.softcap)
  return bwd_ops if reason is None else None


def cute_backward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, kernel_args, o, lse, do,
                  dlse):
  """Backward on the GPU kernels (CUDA) where built and supported, else the pure-JAX backward."""
  if _backward_kernel_ops(spec, q, k) is None or bias is not None or mask is not None:
    return _pure_jax_backward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, o, lse, do,
                              dlse)
  static = tuple(sorted(dict(_kernel_static_args(spec), deterministic=spec.deterministic).items()))

  def on_cuda(q, k, v, o, lse, do, dlse):
    dlse = dlse.astype(jnp.float32)
    if spec.packed:
      grads = _kernel_call("bwd_packed", static)(
          q[0], k[0], v[0], o[0], lse[0], do[0], dlse[0], *_packed_args(kernel_args))
      return tuple(g[None] for g in grads)
    return _kernel_call("bwd_runs", static)(q, k, v, o, lse, do, dlse, *_runs_args(kernel_args))

  def elsewhere(q, k, v, o, lse, do, dlse):
    return _pure_jax_backward(spec, q, k, v, None, None, q_seg, k_seg, q_pos, k_pos, o, lse, do,
                              dlse)[:3]

  do = do.astype(q.dtype)
  dq, dk, dv = _run_kernel_or_fallback(kernel_args, on_cuda, elsewhere, q, k, v, o, lse, do, dlse)
  return dq, dk, dv, None


def _pure_jax_backward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, o, lse, do, dlse):
  """The pure-JAX backward inside the kernel backend, which gets q/k/v unsanitised (see
  ``Backend.reads_padding_safely``): padded input rows are zeroed first, and the padded rows of
  the gradients are zeroed after (what the select in front of the pure-JAX path does by its VJP)."""
  q, k, v = _masking.zero_padded_inputs(q, k, v, q_seg, k_seg)
  dq, dk, dv, dbias = _xla.backward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, o, lse,
                                    do, dlse)
  dq, dk, dv = _masking.zero_padded_inputs(dq, dk, dv, q_seg, k_seg)
  return dq, dk, dv, dbias


CUTE = _xla.Backend("cute", cute_forward, cute_backward, reads_padding_safely=True)
