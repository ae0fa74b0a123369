"""jax_padsafe: fused flash attention for JAX in which padding can never poison a result.

Public API:

* :func:`dot_product_attention`: a drop-in for ``jax.nn.dot_product_attention`` (padded layout
  ``[B, T, N, H]``) plus causal alignment, softcap, segment ids and a differentiable lse.
* :func:`varlen_attention`: the packed (variable-length) layout ``[total, N, H]`` with
  ``cu_seqlens`` and optional per-sequence used lengths.

The pad-safety contract (docs/contract.md): every output and gradient is bitwise independent of
what padded memory holds, padded rows come out as exact zeros, and no NaN/Inf is ever produced
(except ``lse = -inf`` for valid query rows that see no key).
"""

from jax_padsafe._api import dot_product_attention, varlen_attention

__version__ = "0.1.0"

__all__ = ["dot_product_attention", "varlen_attention", "__version__"]
