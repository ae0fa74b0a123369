"""GPU checks of the CuTe kernels (run on a CUDA machine; see scripts/gpu_check.sh)."""

import os

# Every output buffer the kernel library does not memset starts as NaN (ffi/jps_zero_rows.h): a row that no
# kernel writes then fails the checks' exact-zero and reference comparisons instead of passing on whatever the
# allocator left there.  Read once per process, before the first kernel call.
os.environ.setdefault("JAX_PADSAFE_POISON_OUTPUTS", "1")
