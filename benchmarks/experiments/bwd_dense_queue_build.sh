#!/usr/bin/env bash
# CPU build of an A/B library for the sm90 backward's `queue_dense` policy (bwd_build.sm90_dense_queue):
#   bash benchmarks/experiments/bwd_dense_queue_build.sh NAME QUEUE HEAD_DIMS
# QUEUE is JPS_SM90_BWD_DENSE_QUEUE (0: off, all: both kernels at every head dim, "": the shipping policy).
# Copies the full build's kernels (the forward and every other variant) and recompiles the bf16 sm_90a backward
# at HEAD_DIMS over them -> exp/NAME/lib/libjax_padsafe_kernels.so (its backward registry lists only those).
set -e
cd "$(dirname "$0")/../.."
name=$1; queue=$2; dims=$3
src=$(ls -d build/skbuild/*/kernels 2>/dev/null | head -1); src=${KERNELS:-${src:-build/kernels}}
rm -rf "build/exp_$name"; mkdir -p "build/exp_$name"; cp -r "$src" "build/exp_$name/kernels"
JPS_SM90_BWD_DENSE_QUEUE=$queue JPS_ARCHS=sm_90a JPS_DTYPES=bf16 JPS_HEAD_DIMS=$dims JPS_SOFTCAP=0 JPS_SM90F_BWD=0 \
  python3 -m jax_padsafe.kernels.bwd_build --out "build/exp_$name/kernels" 2>&1 | tail -1
cmake -S ffi -B "build/exp_$name/ffi" -DJPS_KERNEL_DIR="$PWD/build/exp_$name/kernels" \
  -DJPS_OUTPUT_DIR="$PWD/exp/$name/lib" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "build/exp_$name/ffi" -j2 2>&1 | tail -1
ls -la "exp/$name/lib"
