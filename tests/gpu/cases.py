"""What the GPU tests run on: the kernels' feature sets, head dims and dtypes, and batch layouts chosen to
reach every branch of the kernels' tile schedules (irregular lengths, gaps, leads and tails, the compact
schedule's holes, several tiles per CTA, slots longer than the bound)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}

# Feature sets, as oracle.Problem / PackedProblem fields.
FEATURES = {
    "plain": dict(),
    "causal_tl": dict(causal=True),
    "causal_br": dict(causal=True, bottom_right=True),
    "window_tl": dict(window=(37, 9)),
    "window_causal_br": dict(causal=True, bottom_right=True, window=(100, None)),
    "softcap_causal": dict(causal=True, softcap=30.0),
    "softcap_small": dict(softcap=2.0),
    "neg_scale_causal": dict(causal=True, scale=-0.07),
    "zero_scale_window": dict(bottom_right=True, window=(5, 5), scale=0.0),
}

# GQA 7 (28 query heads over 4 kv heads) on sequences of 0, 1, 127, 129, 300 and 64 queries (tiles cut at every
# boundary), valid queries without keys, gaps (seqused < slot), a lead before the first slot and a tail.
GQA7_LAYOUT = dict(caps_q=[3, 1, 128, 136, 300, 66], used_q=[0, 1, 127, 129, 300, 64],
                   caps_k=[5, 3, 128, 129, 342, 4], used_k=[5, 1, 127, 129, 333, 0],
                   lead_q=5, lead_k=5, tail_q=11, tail_k=11, n=28, k=4)

# The padded layout with lengths: dot_product_attention's kernel call covers every row with the kernels' tiles, so
# the handler skips the output memsets and the kernels write the padded rows' zeros themselves.
DENSE_LAYOUT = dict(b=6, t=320, s=345, n=28, k=4, q_len=[0, 1, 127, 129, 300, 64], kv_len=[5, 1, 127, 129, 333, 0])

# The compact tile schedule (max_seqlen left at the packed length): one long sequence among short and empty ones,
# the first starting past row 300 (the first compact tiles are holes), gaps and a tail; enough heads for several
# tiles per CTA.
COMPACT_LAYOUT = dict(caps_q=[3, 1300, 2, 134, 129, 2, 64, 132, 200], used_q=[0, 1300, 1, 127, 129, 0, 64, 3, 200],
                      caps_k=[4, 702, 2, 127, 9, 134, 64, 4, 257], used_k=[4, 700, 1, 127, 0, 130, 64, 3, 257],
                      lead_q=300, lead_k=300, tail_q=11, tail_k=11, n=28, k=4)


def many_layout(n=1100, seed=17):
  """n short sequences (0-40 rows, one of 300 queries and one of 300 keys) with gaps, a lead and a tail: the compact
  schedule's search tests 32 candidates per round, so 1100 sequences take three rounds (1100 -> 35 -> 2 -> 1)."""
  rng = np.random.default_rng(seed)
  used_q, used_k = rng.integers(0, 41, n), rng.integers(0, 41, n)
  used_q[n // 2], used_k[n // 3] = 300, 300
  return dict(caps_q=used_q + rng.integers(0, 4, n), used_q=used_q, caps_k=used_k + rng.integers(0, 4, n),
              used_k=used_k, lead_q=37, lead_k=37, tail_q=5, tail_k=5, n=4, k=2)


# Slots longer than the bound the kernels are given (OVERLONG_BOUND >= every used length), as a jitted step with
# traced offsets gets them: with the dense grid the rows past the bound, the lead and the tail are the row-zeroing
# kernel's; with a loose bound the compact grid covers every slot row instead.
OVERLONG_LAYOUT = dict(caps_q=[400, 237, 150, 129, 5], used_q=[100, 37, 0, 128, 5],
                       caps_k=[90, 388, 143, 63, 200], used_k=[90, 128, 3, 60, 0],
                       lead_q=20, lead_k=20, tail_q=7, tail_k=7, n=8, k=2)
OVERLONG_BOUND = 128

# Long irregular sequences, GQA 7 over one kv head.
LONG_LAYOUT = dict(caps_q=[4096, 1000], used_q=[4095, 1000], caps_k=[4093, 4100], used_k=[4093, 4097],
                   tail_q=5, tail_k=5, n=7, k=1)

# Enough tiles that the Hopper forward runs several query tiles per CTA (tiles per CTA = clamp(tiles // 264, 1, 4):
# 10 m-blocks x 28 heads x 6 sequences = 1680 -> 4): tiles of different sequences and heads in one CTA, tiles wholly
# past a sequence's length between them, and (head dims < 128) the L2 prefetch of each CTA's next tile.
MULTITILE_LAYOUT = dict(caps_q=[1200, 5, 513, 132, 1001, 7], used_q=[1200, 0, 513, 129, 1000, 7],
                        caps_k=[392, 300, 500, 701, 0, 15], used_k=[390, 300, 500, 700, 0, 9],
                        tail_q=9, tail_k=9, n=28, k=4)


def packed_case(seed, layout, h, feature, **extra):
  """A packed problem (helpers.build_packed) of ``layout`` at head dim ``h`` with a feature set of FEATURES."""
  d = helpers.build_packed(np.random.default_rng(seed), h=h, **layout, **FEATURES[feature])
  d.update(extra)
  return d


def is_hopper():
  return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def sm90_family_active():
  """Whether this process runs the sm_90a kernels: on Hopper unless JAX_PADSAFE_SM90=0 (read by the library once
  per process, at its first call), which keeps the SM80-class family there."""
  return is_hopper() and os.environ.get("JAX_PADSAFE_SM90", "1") != "0"


def run_pytest(args, env, timeout):
  """Runs ``python -m pytest args`` in a fresh process (environment ``env`` added to this one's) from the
  repository root; fails with the tail of its output unless every selected test passed."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  full_env = dict(os.environ, **env)
  full_env["PYTHONPATH"] = root + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *args],
                        cwd=root, env=full_env, capture_output=True, text=True, timeout=timeout)
  tail = (proc.stdout + proc.stderr)[-6000:]
  assert proc.returncode == 0, f"pytest {' '.join(args)} with {env} exited {proc.returncode}:\n{tail}"
  assert " passed" in proc.stdout, f"no test ran:\n{tail}"
  return tail


def needs_kernels():
  """The mark of every GPU test: ``gpu``, and a skip (with the reason) without a CUDA GPU or a built library."""
  ready, why = helpers.kernels_ready()
  return [pytest.mark.gpu, pytest.mark.skipif(not ready, reason=why)]
