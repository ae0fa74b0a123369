"""The same GPU tests on the other ways the kernels run, each in a fresh pytest process (the settings below are
read once per process: the library reads JAX_PADSAFE_SM90 at its first kernel call, XLA its flags at start-up).

* The SM80-class kernel family on Hopper (JAX_PADSAFE_SM90=0; elsewhere it is the default family and the other
  modules test it): test_forward.py, test_backward.py's packed bf16 matrix (every head dim and feature set),
  test_fuzz.py's short draws, and test_masks.py (masks and biases).
* XLA command buffers (CUDA graphs) with the kernels' custom calls inside: the sm_90a forward and backward at two
  head dims.

About 350 s on an H100 (three fresh processes for the SM80-class family, one for command buffers).
"""

import pytest

from tests.gpu import cases

pytestmark = cases.needs_kernels()

GPU_TESTS = "tests/gpu/"


@pytest.mark.parametrize("args", [
    ["test_forward.py"],
    ["test_backward.py", "-k", "packed_gqa7 and bf16"],
    ["test_fuzz.py", "-k", "not long"],
    ["test_masks.py"],
], ids=["forward", "backward_bf16", "fuzz_short", "masks"])
def test_sm80_class_family_on_hopper(args):
  if not cases.is_hopper():
    pytest.skip("the SM80-class family is the default here: the other modules test it")
  cases.run_pytest(["-m", "gpu", GPU_TESTS + args[0], *args[1:]], {"JAX_PADSAFE_SM90": "0"}, timeout=540)


def test_command_buffers():
  flags = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
  cases.run_pytest(["-m", "gpu", GPU_TESTS + "test_backward.py", "-k", "packed_gqa7 and bf16 and (hd64 or hd128) "
                    "and (plain or causal_br or softcap_causal)"], {"XLA_FLAGS": flags}, timeout=300)
