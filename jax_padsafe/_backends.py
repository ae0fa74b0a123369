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

from jax_padsafe import _xla
from jax_padsafe._spec import AttentionSpec


def _kernel_ops():
  """The kernel module, or ``None`` when this install has no kernel library."""
  try:
    from jax_padsafe._cute import ops  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return ops


def kernel_unsupported_reason(spec: AttentionSpec, query, key, *, bias, mask, has_segment_ids):
  """``None`` if the GPU forward kernel can run this call, else why not (a sentence)."""
  ops = _kernel_ops()
  if ops is None:
    return "the kernel runtime (jax_padsafe._cute) is not part of this install"
  if not ops.library_available():
    return ("the kernel library was not built into this install "
            "(see BUILD.md: build from source with the kernels enabled)")
  if mask is not None:
    return "a boolean `mask` is only supported by the pure-JAX path (use lengths or segment ids)"
  if has_segment_ids:
    return "segment ids are not yet mapped onto the kernels"
  n, h = query.shape[-2], query.shape[-1]
  return ops.unsupported_reason(
      dtype=query.dtype, head_dim=h, head_dim_v=h, num_heads=n, num_kv_heads=key.shape[-2],
      causal=spec.causal, window=spec.has_window, softcap=spec.softcap,
      has_bias=bias is not None)


def choose_backend(implementation, spec: AttentionSpec, query, key, *, bias, mask, has_segment_ids):
  """The ``_xla.Backend`` for this call (see the module docstring for the rules)."""
  if implementation == "xla":
    return _xla.XLA
  reason = kernel_unsupported_reason(spec, query, key, bias=bias, mask=mask,
                                     has_segment_ids=has_segment_ids)
  if reason is None:
    return CUTE
  if implementation == "cute":
    raise NotImplementedError(f'implementation="cute" cannot run this call: {reason}. '
                              'Use implementation=None to fall back to the pure-JAX path.')
  return _xla.XLA


@functools.lru_cache(maxsize=None)
def _partitioned_kernel(packed: bool):
  """The kernel forward wrapped so that batch/head-sharded calls run shard-local (no all-gather)."""
  from jax_padsafe import _partitioning  # pylint: disable=g-import-not-at-top
  from jax_padsafe._cute import ops  # pylint: disable=g-import-not-at-top
  if packed:
    return _partitioning.partition_packed_forward(ops.flash_forward)
  return _partitioning.partition_padded_forward(_partitioning.packed_to_padded(ops.flash_forward))


@functools.lru_cache(maxsize=None)
def _kernel_call(packed: bool, static_items: tuple):
  """The partitioned kernel forward for one static configuration, with a vmap rule.

  ``custom_partitioning`` has no batching rule, so ``jax.vmap`` is given one here: for the padded
  layout the mapped axis is just more sequences and is folded into the batch (one kernel launch);
  for the packed layout each mapped problem is its own launch (``lax.map``).
  """
  inner = _partitioned_kernel(packed)
  static = dict(static_items)

  @custom_batching.custom_vmap
  def call(*args):
    return inner(*args, **static)

  @call.def_vmap
  def call_vmap(axis_size, in_batched, *args):
    args = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched in zip(args, in_batched)]
    if packed:
      out = lax.map(lambda xs: call(*xs), tuple(args))
    else:
      fold = lambda x: x.reshape((-1,) + x.shape[2:])
      o, lse = call(*(fold(a) for a in args))
      out = (o.reshape((axis_size, -1) + o.shape[1:]), lse.reshape((axis_size, -1) + lse.shape[1:]))
    return out, (True, True)

  return call


def _kernel_static_args(spec: AttentionSpec):
  return dict(
      max_seqlen_q=int(spec.max_seqlen_q), max_seqlen_k=int(spec.max_seqlen_k),
      scale=float(spec.scale), causal=spec.causal, bottom_right=spec.bottom_right,
      window_left=-1 if spec.window_left is None else spec.window_left,
      window_right=-1 if spec.window_right is None else spec.window_right,
      softcap=0.0 if spec.softcap is None else float(spec.softcap))


def cute_forward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, kernel_args):
  """Forward on the GPU kernel for CUDA, the pure-JAX forward elsewhere (same results contract)."""

  def on_cuda(q, k, v):
    static = tuple(sorted(_kernel_static_args(spec).items()))
    if spec.packed:  # canonical batch of one holding the packed rows
      o, lse = _kernel_call(True, static)(
          q[0], k[0], v[0], kernel_args["cu_seqlens_q"], kernel_args["cu_seqlens_k"],
          kernel_args["seqused_q"], kernel_args["seqused_k"])
      return o[None], lse[None]
    return _kernel_call(False, static)(q, k, v, kernel_args["seqused_q"], kernel_args["seqused_k"])

  def elsewhere(q, k, v):
    return _xla.forward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos)

  return lax.platform_dependent(q, k, v, cuda=on_cuda, default=elsewhere)


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
  bwd_ops = _backward_kernel_ops(spec, q, k)
  if bwd_ops is None or bias is not None or mask is not None:
    return _xla.xla_backward(spec, q, k, v, bias, mask, q_seg, k_seg, q_pos, k_pos, kernel_args, o,
                             lse, do, dlse)
  b, t, n, h = q.shape
  s, nk = k.shape[1], k.shape[2]

  def on_cuda(q, k, v, o, lse, do, dlse):
    # Both layouts reach the kernels packed: the padded one as B sequences of T (resp. S) rows.
    def rows_last(x):  # [B, N, T] -> [N, B*T]
      return jnp.transpose(x, (1, 0, 2)).reshape(n, b * t)
    dq, dk, dv = bwd_ops.flash_backward(
        q.reshape(b * t, n, h), k.reshape(b * s, nk, h), v.reshape(b * s, nk, v.shape[-1]),
        o.reshape(b * t, n, o.shape[-1]), rows_last(lse), do.reshape(b * t, n, do.shape[-1]),
        rows_last(dlse.astype(jnp.float32)),
        kernel_args["cu_seqlens_q"], kernel_args["cu_seqlens_k"],
        kernel_args["seqused_q"], kernel_args["seqused_k"],
        deterministic=spec.deterministic, **_kernel_static_args(spec))
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

  def elsewhere(q, k, v, o, lse, do, dlse):
    return _xla.backward(spec, q, k, v, None, None, q_seg, k_seg, q_pos, k_pos, o, lse, do,
                         dlse)[:3]

  do = do.astype(q.dtype)
  dq, dk, dv = lax.platform_dependent(q, k, v, o, lse, do, dlse, cuda=on_cuda, default=elsewhere)
  return dq, dk, dv, None


CUTE = _xla.Backend("cute", cute_forward, cute_backward)
