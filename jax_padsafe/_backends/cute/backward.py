"""JAX entry point of the CuTe DSL backward kernels (XLA FFI target `jax_padsafe_bwd`, CUDA only).

Packed layout: q/o/do [total_q, N, H] (bf16 | fp16), k/v [total_k, K, H], lse/dlse [N, total_q] float32,
cu_seqlens_* int32 [B+1], seqused_* int32 [B].  Returns (dq, dk, dv) in the input dtype, under the
pad-safety contract: padded rows of dq/dk/dv and keys no valid query sees are exactly 0, valid rows
with lse = -inf give dq = 0 and add nothing to dk/dv, and nothing depends on what padded memory holds.

Kernels (jax_padsafe/kernels/sm80; on Hopper the dK/dV and dQ kernels of jax_padsafe/kernels/sm90):
preprocess (Delta = rowsum(dO*O) - dlse into a zero-filled workspace), dK/dV (one CTA per key tile,
looping over the query heads of its GQA group and the query tiles; for head dims above 128 two launches
of it, a dV pass and a dK pass, so that one 16 x HD fp32 accumulator per warp fits in registers; the
Hopper kernel instead splits the head dim between its two warpgroups), dQ (one CTA per query tile,
looping over key tiles).  No atomics and no global accumulator: every call is deterministic, so
`deterministic=True` costs nothing extra; the price of this design is that S = QK^T and dP = dO V^T are
computed in both kernels (7 GEMMs instead of 5; 8 with the split dK/dV kernel).
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from jax_padsafe._backends.cute import library

TARGET_NAME = library.BACKWARD_TARGET


def flash_backward(q, k, v, o, lse, do, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *,
                   max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, bottom_right: bool,
                   window_left: int, window_right: int, softcap: float, deterministic: bool = False,
                   rows_covered: bool = False, aux=None, stats=None, return_delta: bool = False,
                   partial_keys: bool = False):
  """Gradients (dq, dk, dv) of `forward.flash_forward` on the packed layout; see the module docstring.

  ``aux`` and ``stats``: the forward's mask / bias operands and the exact row statistics
  ``(row_max, log_sum)`` its aux target returned (P is recomputed as ``exp(s - row_max - log_sum)``, exact
  for any finite bias however large); dbias is :func:`flash_dbias`'s (``return_delta=True`` returns the
  Delta workspace as a fourth result: it holds ``rowsum(P * dP)`` of the recomputed P and dP for every valid
  row, from which ``flash_dbias``'s Delta is that minus dlse, and the sinks' gradient takes its Delta).

  The dQ kernel computes dQ against a reference key of each sequence (``kernels/common/dq_shift.py``), which
  needs every key of each row's softmax in the call; ``partial_keys=True`` (a ring attention step, whose
  keys are one block of the row's) turns that off, and the workspace then holds nothing of use.

  `rows_covered=True` promises that cu_seqlens_q/k start at 0, end at total_q/total_k, and have no
  segment longer than max_seqlen_q/k: then the kernels' tiles cover every row, and kernels that zero
  their tiles' rows past the used length (the sm90 family) skip the memsets of dq, dk, dv.  With False
  (the default) the sm90 family zeroes only the rows its tiles miss (ffi/jps_zero_rows.h), the SM80-class
  one memsets dq, dk, dv."""
  total_q, n, h, total_k, kh = library.check_operands(
      "flash_backward", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale, softcap=softcap)
  if not (o.shape == q.shape and do.shape == q.shape):
    raise ValueError(f"flash_backward: o {o.shape} and do {do.shape} must have q's shape {q.shape}")
  if not (lse.shape == (n, total_q) and dlse.shape == (n, total_q)):
    raise ValueError(f"flash_backward: lse {lse.shape} and dlse {dlse.shape} must be {(n, total_q)}")
  if not q.dtype == k.dtype == v.dtype == o.dtype == do.dtype:
    raise TypeError("flash_backward: q, k, v, o, do dtypes differ: "
                    f"{q.dtype}, {k.dtype}, {v.dtype}, {o.dtype}, {do.dtype}")
  reason = library.unsupported_reason(dtype=q.dtype, head_dim=h, num_heads=n, num_kv_heads=kh, causal=causal,
                                      window=(window_left, window_right), softcap=softcap,
                                      aux=aux is not None, direction="backward", exact=True)
  if reason is not None:
    raise NotImplementedError(reason)
  library.backward_available()  # registers the target when the library is present
  # Same exact rewrites as forward.flash_forward (the kernels need scale > 0):
  # scale < 0: logits c q.k = |c| (-q).k, so dq = -dq' and dk, dv are unchanged;
  # scale == 0: every logit is 0 whatever q, k are: dq = dk = 0 exactly, dv from the uniform P.
  sign = 1.0
  if scale < 0:
    q, scale, sign = -q, -scale, -1.0
  zero_scale = scale == 0
  if zero_scale:
    q, scale = jnp.zeros_like(q), 1.0

  operands = (q, k, v, o, lse.astype(jnp.float32), do, dlse.astype(jnp.float32),
              cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
  attrs = {}
  if aux is not None:
    if partial_keys:
      raise ValueError("flash_backward: partial_keys is for the plain target (ring attention), not with aux")
    if stats is None:
      raise ValueError("flash_backward: a mask or bias needs the forward's row statistics (stats=)")
    operands += aux.arrays + tuple(x.astype(jnp.float32) for x in stats)
    attrs = {name: np.int32(flag) for name, flag in aux.flags.items()}
  else:
    attrs = {"partial_keys": np.int32(bool(partial_keys))}
  call = jax.ffi.ffi_call(
      library.BACKWARD_AUX_TARGET if aux is not None else TARGET_NAME,
      (jax.ShapeDtypeStruct((total_q, n, h), q.dtype), jax.ShapeDtypeStruct((total_k, kh, h), q.dtype),
       jax.ShapeDtypeStruct((total_k, kh, h), q.dtype),
       # The Delta workspace, then scratch: the sm90 kernels' compact schedules claim tiles from these
       # counters (zeroed by the handler on every call that may take them).
       jax.ShapeDtypeStruct((n, total_q), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)),
      vmap_method="sequential",
  )
  dq, dk, dv, _delta, _tile_counters = call(
      *operands,
      scale=np.float32(scale),
      softcap=np.float32(softcap),
      window_left=library.window_attribute(window_left),
      window_right=library.window_attribute(window_right),
      causal=np.int32(bool(causal)),
      bottom_right=np.int32(bool(bottom_right)),
      max_seqlen_q=np.int32(max_seqlen_q),
      max_seqlen_k=np.int32(max_seqlen_k),
      deterministic=np.int32(bool(deterministic)),
      rows_covered=np.int32(bool(rows_covered)),
      **attrs,
  )
  if zero_scale:
    dq, dk = jnp.zeros_like(dq), jnp.zeros_like(dk)
  elif sign < 0:
    dq = -dq
  return (dq, dk, dv, _delta) if return_delta else (dq, dk, dv)


def flash_dbias(q, k, v, do, delta, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *, aux, stats,
                max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, bottom_right: bool,
                window_left: int, window_right: int, **unused):
  """The bias gradient (XLA FFI target ``jax_padsafe_bwd_dbias``) on the padded layout: dS recomputed per
  visible tile from q, k, v, do, the backward's ``delta`` and the forward's exact row statistics ``stats``,
  summed over the bias's broadcast batch and head dimensions in a fixed order (deterministic). Returns
  dbias with the bias's shape ``[Bx, Hx, T, S]`` and dtype; cells outside every valid rectangle and pairs
  no query sees are exactly 0. ``aux.bias`` must have a row per query (``Tx == T``)."""
  del unused  # the backward's other static arguments (softcap, rows_covered, deterministic)
  total_q, n, h, total_k, kh = library.check_operands(
      "flash_dbias", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale, softcap=0.0)
  if not aux.has_bias:
    raise ValueError("flash_dbias: the call has no bias")
  if not library.dbias_available(q.dtype, h):
    raise NotImplementedError(f"the kernel library has no bias gradient kernel for {q.dtype} head dim {h}")
  # As flash_backward: scale < 0 is |scale| with -q (dbias unchanged), scale == 0 makes every q.k term 0.
  if scale < 0:
    q, scale = -q, -scale
  if scale == 0:
    q, scale = jnp.zeros_like(q), 1.0
  call = jax.ffi.ffi_call(library.BACKWARD_DBIAS_TARGET, jax.ShapeDtypeStruct(aux.bias.shape, aux.bias.dtype),
                          vmap_method="sequential")
  return call(q, k, v, do.astype(q.dtype), delta.astype(jnp.float32), cu_seqlens_q, cu_seqlens_k, seqused_q,
              seqused_k, *aux.arrays, *(x.astype(jnp.float32) for x in stats),
              scale=np.float32(scale), window_left=library.window_attribute(window_left),
              window_right=library.window_attribute(window_right), causal=np.int32(bool(causal)),
              bottom_right=np.int32(bool(bottom_right)), max_seqlen_q=np.int32(max_seqlen_q),
              max_seqlen_k=np.int32(max_seqlen_k), has_mask=np.int32(aux.has_mask),
              has_alibi=np.int32(aux.has_alibi))
