"""One CuTe backward call (hd HD, S x B = 16k tokens, non-causal unless CAUSAL=1) for Nsight Compute:

    ncu --kernel-name regex:"BwdDKDV|BwdDQ" --launch-count 2 --section SpeedOfLight ... \
        env PYTHONPATH=. python benchmarks/experiments/ncu_bwd_once.py
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_padsafe._cute import bwd_ops, ops

H = int(os.environ.get("HD", 128))
S = int(os.environ.get("S", 8192))
causal = os.environ.get("CAUSAL", "0") == "1"
N, B = 2048 // H, 16384 // S
rng = np.random.default_rng(0)
q, k, v, do = (jnp.asarray(rng.standard_normal((B * S, N, H)), jnp.bfloat16) for _ in range(4))
cu = jnp.arange(B + 1, dtype=jnp.int32) * S
used = jnp.full((B,), S, jnp.int32)
kw = dict(max_seqlen_q=S, max_seqlen_k=S, scale=H ** -0.5, causal=causal, bottom_right=False, window_left=-1,
          window_right=-1, softcap=0.0, rows_covered=True)
o, lse = ops.flash_forward(q, k, v, cu, cu, used, used, **kw)
g = bwd_ops.flash_backward(q, k, v, o, lse, do, jnp.zeros_like(lse), cu, cu, used, used, **kw)
jax.block_until_ready(g)
print("done", [x.shape for x in g])
