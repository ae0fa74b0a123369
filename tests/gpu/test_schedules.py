"""The kernels' tile schedules on a GPU, forward and backward, at every head dim (bf16): the whole contract
(tests/helpers.py check_packed) through ``varlen_attention`` with ``implementation="cute"``.

* compact: ``max_seqlen`` left at the packed length, so the Hopper kernels number only tiles inside sequences
  (COMPACT_LAYOUT: the first compact tiles are holes; many_layout: 1100 sequences, three rounds of the compact
  search).  The SM80-class kernels keep the dense grid on the same calls.
* overlong: slots longer than the bound, offsets traced (a jitted step with a sequence past ``max_seqlen``): the
  rows past the bound, the lead and the tail are written by the row-zeroing kernel (dense grid) or covered by the
  compact grid (loose bound).
* long: sequences of ~4k tokens (GQA 7 over one kv head), both dtypes.

About 250 s on an H100.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers
from tests.gpu import cases
from tests.gpu.cases import DTYPES, HEAD_DIMS

pytestmark = cases.needs_kernels()

hd = pytest.mark.parametrize("h", HEAD_DIMS, ids=lambda h: f"hd{h}")


@pytest.mark.parametrize("feature", ["plain", "causal_br", "causal_tl", "window_tl", "window_causal_br",
                                     "softcap_causal"])
@hd
def test_compact(h, feature):
  d = cases.packed_case(h, cases.COMPACT_LAYOUT, h, feature, loose_bounds=True)
  helpers.check_packed(d, jnp.bfloat16, "cute", np.random.default_rng(h), poisons=("nan", "huge"))


@hd
def test_compact_many_sequences(h):
  d = cases.packed_case(h, cases.many_layout(), h, "causal_br", loose_bounds=True)
  helpers.check_packed(d, jnp.bfloat16, "cute", np.random.default_rng(h), poisons=("nan", "huge"))


@pytest.mark.parametrize("feature,bound", [("plain", "tight"), ("causal_br", "tight"), ("window_causal_br", "tight"),
                                           ("causal_tl", "loose")])
@hd
def test_overlong_slots(h, feature, bound):
  extra = dict(bound=cases.OVERLONG_BOUND) if bound == "tight" else dict(loose_bounds=True)
  d = cases.packed_case(h, cases.OVERLONG_LAYOUT, h, feature, **extra)
  helpers.check_packed(d, jnp.bfloat16, "cute", np.random.default_rng(h), poisons=("nan",), dirty=True)


LONG_BWD_LAYOUT = dict(caps_q=[4096, 1, 2000], used_q=[4095, 1, 2000], caps_k=[4095, 3005, 1999],
                       used_k=[4095, 3000, 1999], tail_q=3, tail_k=3, n=7, k=1)
# Every feature at hd128 bf16; one at each other head dim and in fp16, bottom-right causal and a window in turn.
LONG = ([("bf16", 128, f) for f in ("plain", "causal_br", "causal_tl", "window_tl")]
        + [(dt, h, f) for (dt, h), f in zip((("bf16", 64), ("fp16", 128), ("bf16", 192), ("bf16", 256), ("fp16", 256)),
                                            ("causal_br", "window_tl", "causal_br", "window_tl", "causal_br"))])


@pytest.mark.parametrize("dtype,h,feature", LONG, ids=[f"{dt}-hd{h}-{f}" for dt, h, f in LONG])
def test_long_sequences(dtype, h, feature):
  d = cases.packed_case(h, LONG_BWD_LAYOUT, h, feature)
  helpers.check_packed(d, DTYPES[dtype], "cute", np.random.default_rng(h), poisons=("nan",))
