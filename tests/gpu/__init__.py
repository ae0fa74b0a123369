"""The GPU test suite: every test here is marked ``gpu`` and skips itself without a CUDA GPU and a built kernel
library.  ``pytest -m gpu tests`` on a CUDA machine runs it together with the ``implementation="cute"`` cases of
the CPU suite (scripts/gpu_check.sh test)."""
