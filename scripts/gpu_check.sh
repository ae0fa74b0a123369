#!/usr/bin/env bash
# Build the kernel library from the source tree, and run the GPU test suite on a CUDA machine.
#
#   scripts/gpu_check.sh build           # compile the kernels (incremental), link jax_padsafe/_backends/cute/lib/
#   scripts/gpu_check.sh test [ARGS]     # python3 -m pytest -m gpu tests [ARGS]; logs and JUnit XML in $OUT or ./gpu_out
#
# ARGS pass through to pytest, e.g. `test tests/gpu/test_backward.py` (one module), `test tests -k hd128`, or
# `test tests -m "gpu and not large"`.  Build settings: JPS_ARCHS, JPS_DTYPES, JPS_HEAD_DIMS, JPS_SOFTCAP, JPS_AUX, JPS_JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}; shift || true
case "$cmd" in
  build)
    python3 -m jax_padsafe.kernels.build --out build/kernels
    cmake -S ffi -B build/ffi -DJPS_KERNEL_DIR="$PWD/build/kernels" -DCMAKE_BUILD_TYPE=Release
    cmake --build build/ffi -j"${JPS_JOBS:-2}"
    ls -l jax_padsafe/_backends/cute/lib/
    ;;
  test)
    out=${OUT:-gpu_out}; mkdir -p "$out"
    export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader | tee "$out/device.txt"
    fi
    args=("$@"); [ ${#args[@]} -gt 0 ] || args=(tests)
    name=$(printf '%s' "${args[*]}" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80)
    python3 -m pytest -m gpu -rfEs --durations=25 --junitxml="$out/pytest_$name.xml" "${args[@]}" 2>&1 \
      | tee "$out/pytest_$name.log"
    ;;
  *) sed -n 2,9p "$0"; exit 2 ;;
esac
