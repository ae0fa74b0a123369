"""Random contract cases on the GPU kernels from fresh seeds: every feature the kernels support drawn at random
(tests/test_fuzz.py draw_problem / draw_packed), each case first checked to lower to the forward and backward
kernels (never the pure-JAX path), then the whole contract (helpers.check_problem / check_packed).

* short: 32 padded-layout and 16 packed draws with sequences below 200 / 160 rows;
* long: 6 padded and 4 packed draws with sequences below 1100 rows, which the short ones never reach: a partial
  last tile after full ones, a causal or window band starting mid-sequence, several key tiles per CTA, window
  sides longer than a tile.

A draw whose variant this library was built without (a partial build) skips.  The seeds start at JPS_FUZZ_SEED
(default: drawn at random per run); a failure names its seed, and
``JPS_FUZZ_SEED=<seed> pytest -m gpu tests/gpu/test_fuzz.py`` replays the run.

About 160 s on an H100.
"""

import os
import re
import secrets

import pytest

from tests import helpers
from tests import test_fuzz
from tests.gpu import cases

pytestmark = cases.needs_kernels()

BASE_SEED = int(os.environ.get("JPS_FUZZ_SEED") or secrets.randbelow(10 ** 6) * 100)


def _replay(seed, kind, run):
  try:
    run()
  except Exception as e:  # noqa: BLE001  (re-raised with the seed that reproduces it)
    raise AssertionError(f"{kind} seed {seed} failed (replay: JPS_FUZZ_SEED={BASE_SEED}): "
                         f"{type(e).__name__}: {e}") from e


def _reaches(check, *args):
  """check(*args); a skip where this library was built without the draw's variant (a partial build: fewer dtypes,
  head dims or no softcap).  The default build has every draw's variant: tests/test_fuzz.py
  (test_gpu_draws_reach_the_kernels) checks that on the CPU against the full variant matrix."""
  try:
    return check(*args)
  except NotImplementedError as e:
    if re.search(r"the built CuTe (backward )?kernels have no", str(e)):
      pytest.skip(f"not in this build: {e}")
    raise


def _dense(seed, max_len=None):
  p, dtype, bias_dtype = test_fuzz.draw_problem(seed, "cute", max_len=max_len)
  _reaches(test_fuzz.dense_reaches_kernels, p, dtype, bias_dtype)

  def run():
    assert test_fuzz.dense_reaches_kernels(p, dtype, bias_dtype), f"does not lower to the kernels: {p.shape}"
    helpers.check_problem(p, dtype, "cute", seed=seed, bias_dtype=bias_dtype)

  _replay(seed, "dense", run)


def _packed(seed, max_len=None):
  d, dtype, rng = test_fuzz.draw_packed(seed, "cute", max_len=max_len)
  _reaches(test_fuzz.packed_reaches_kernels, d, dtype)

  def run():
    assert test_fuzz.packed_reaches_kernels(d, dtype), "does not lower to the kernels"
    helpers.check_packed(d, dtype, "cute", rng)

  _replay(seed, "packed", run)


@pytest.mark.parametrize("i", range(32))
def test_random_dense(i):
  _dense(BASE_SEED + i)


@pytest.mark.parametrize("i", range(16))
def test_random_packed(i):
  _packed(BASE_SEED + 50 + i)


@pytest.mark.parametrize("i", range(6))
def test_random_dense_long(i):
  _dense(BASE_SEED + 70 + i, max_len=1100)


@pytest.mark.parametrize("i", range(4))
def test_random_packed_long(i):
  _packed(BASE_SEED + 80 + i, max_len=1100)
