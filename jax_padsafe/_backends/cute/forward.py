"""JAX entry point of the CuTe DSL forward kernel (XLA FFI target `jax_padsafe_fwd`, CUDA only).

Packed layout: q [total_q, N, H], k/v [total_k, K, H], cu_seqlens_* int32 [B+1], seqused_* int32 [B].
Returns (o [total_q, N, H], lse [N, total_q] float32) under the pad-safety contract (docs/contract.md):
padded rows of o and lse are exactly 0, valid rows with no visible key have o = 0 and lse = -inf, and
nothing depends on what padded memory holds.

Without the kernel library (`library.library_available()` False) `flash_forward` still lowers (the
custom call is emitted), but an executable for a GPU cannot be compiled.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from jax_padsafe._backends.cute import library

TARGET_NAME = library.FORWARD_TARGET


def flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks=None, *, max_seqlen_q: int,
                  max_seqlen_k: int, scale: float, causal: bool, bottom_right: bool, window_left: int,
                  window_right: int, softcap: float, rows_covered: bool = False, aux=None):
  """Pad-safe flash-attention forward on the packed layout; see the module docstring.

  ``sinks`` (float32 ``[N]``, or None): one attention-sink logit per query head, joined in the kernels'
  epilogue: ``O_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))`` and lse includes the sink; a valid
  row that sees no key gets O = 0 and lse = sink.

  ``aux`` (:class:`jax_padsafe._backends.cute.aux.AuxOperands`): a mask and/or bias, for the padded
  layout's ``cu_seqlens`` (sequence b at rows ``b*T``); the aux target then also returns the exact row
  statistics ``(row_max, log_sum)`` ``[N, total_q]`` float32 that its backward reads: ``lse = row_max +
  log_sum`` in valid rows with a visible key, ``(0, +inf)`` in valid rows without one, zeros in padded rows.

  `max_seqlen_q` must be >= every segment length cu_seqlens_q[b+1] - cu_seqlens_q[b]: the grid covers
  ceil(max_seqlen_q / block_m) query tiles per sequence, and query rows beyond it are left at 0.
  `max_seqlen_k` is validated but not needed by the kernel (its K loop bounds come from the lengths).

  `rows_covered=True` promises that cu_seqlens_q starts at 0 and ends at total_q (with no segment
  longer than max_seqlen_q, as above): then the kernel's tiles cover every row of o, and kernels that
  zero their tiles' rows past the used length (the sm90 family) skip the memset of o.  With False
  (the default) the rows no tile reaches are zeroed first: by a memset of o, or under the sm90 family by
  a kernel that writes only those rows (ffi/jps_zero_rows.h)."""
  total_q, n, h, _, kh = library.check_operands(
      "flash_forward", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale, softcap=softcap)
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"flash_forward: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
  if sinks is None:
    sinks = jnp.zeros((0,), jnp.float32)  # the kernels read no sink
  elif sinks.shape != (n,):
    raise ValueError(f"flash_forward: sinks must have shape [N] = ({n},), got {sinks.shape}")
  reason = library.unsupported_reason(dtype=q.dtype, head_dim=h, head_dim_v=v.shape[-1], num_heads=n,
                                      num_kv_heads=kh, causal=causal, window=(window_left, window_right),
                                      softcap=softcap, aux=aux is not None, exact=True)
  if reason is not None:
    raise NotImplementedError(reason)
  library.library_available()  # registers the target when the library is present
  # The kernel needs scale > 0 (it takes the row max over raw scores).  Exact rewrites otherwise:
  # softmax(c q.k) with c < 0 is softmax(|c| (-q).k); with c == 0 every logit is 0, as with q = 0.
  if scale < 0:
    q, scale = -q, -scale
  elif scale == 0:
    q, scale = jnp.zeros_like(q), 1.0

  rows = jax.ShapeDtypeStruct((n, total_q), jnp.float32)
  # The third result is the kernel's scratch: the tile counter of the sm90 compact schedule.
  results = (jax.ShapeDtypeStruct((total_q, n, h), q.dtype), rows, jax.ShapeDtypeStruct((1,), jnp.int32))
  operands = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks.astype(jnp.float32))
  attrs = {}
  if aux is not None:
    results += (rows, rows)
    operands += aux.arrays
    attrs = {name: np.int32(flag) for name, flag in aux.flags.items()}
  call = jax.ffi.ffi_call(library.FORWARD_AUX_TARGET if aux is not None else TARGET_NAME, results,
                          vmap_method="sequential")
  o, lse, _, *stats = call(
      *operands,
      scale=np.float32(scale),
      softcap=np.float32(softcap),
      window_left=library.window_attribute(window_left),
      window_right=library.window_attribute(window_right),
      causal=np.int32(bool(causal)),
      bottom_right=np.int32(bool(bottom_right)),
      max_seqlen_q=np.int32(max_seqlen_q),
      rows_covered=np.int32(bool(rows_covered)),
      **attrs,
  )
  return (o, lse, *stats)
