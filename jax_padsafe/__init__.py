"""jax_padsafe: fused flash attention for JAX in which padding can never poison a result.

Public API:

* :func:`dot_product_attention`: a drop-in for ``jax.nn.dot_product_attention`` (padded layout
  ``[B, T, N, H]``) plus causal alignment, softcap, segment ids and a differentiable lse.
* :func:`varlen_attention`: the packed (variable-length) layout ``[total, N, H]`` with
  ``cu_seqlens`` and optional per-sequence used lengths.
* :mod:`jax_padsafe.sharding`: ring (context-parallel) attention and the zigzag layout.
* Layers: :mod:`jax_padsafe.flax_linen`, :mod:`jax_padsafe.flax_nnx`, :mod:`jax_padsafe.equinox`.
* What runs where (:mod:`jax_padsafe.introspection`): :func:`kernels_available`, :func:`kernels_status`
  (the kernel library: loaded, or why not) and :func:`attention_backends` (whether a function's
  attention runs on the kernels, read off its lowered program).

The pad-safety contract (docs/contract.md): every output and gradient is bitwise independent of
what padded memory holds, padded rows come out as exact zeros, and no NaN/Inf is ever produced
(except ``lse = -inf`` for valid query rows that see no key).
"""

from jax_padsafe.attention import dot_product_attention, varlen_attention
from jax_padsafe.introspection import AttentionBackends
from jax_padsafe.introspection import attention_backends
from jax_padsafe.introspection import KernelLibraryWarning
from jax_padsafe.introspection import kernels_available
from jax_padsafe.introspection import kernels_status
from jax_padsafe.introspection import KernelStatus

__version__ = "0.1.0"

__all__ = ["dot_product_attention", "varlen_attention", "kernels_available", "kernels_status",
           "KernelStatus", "KernelLibraryWarning", "attention_backends", "AttentionBackends",
           "__version__"]
