#!/bin/bash
# CPU build of one sm90 backward tile variant into its own library, for sm90bwd_gpu_variants.sh.
# Usage: bash benchmarks/experiments/sm90bwd_build_variant.sh NAME "128=DKDV_BMxBNxSTAGES,DQ_BMxBNxSTAGES"
#   -> exp/sm90bwd/NAME/libjax_padsafe_kernels.so (needs build/sm90bwd/kernels from a full restricted build first)
# Variants prepared 2026-11-22 (not yet measured): B "128=64x128x3,128x128x2", C "128=64x128x3,128x64x3",
# D "128=64x128x2,128x128x2"; v1 (the default) is "128=64x128x2,128x64x2" in exp/sm90bwd/lib.
set -e
cd "$(dirname "$0")/../.."
N=$1; T=$2
rm -rf build/sm90bwd/k_$N; cp -r build/sm90bwd/kernels build/sm90bwd/k_$N
export JPS_ARCHS=sm_90a JPS_DTYPES=bf16,fp16 JPS_HEAD_DIMS=128 JPS_SOFTCAP=0,1 JPS_JOBS=2
JPS_SM90_BWD_TILES="$T" python3 -m jax_padsafe.kernels.bwd_build --out build/sm90bwd/k_$N 2>&1 | tail -1
cmake -S ffi -B build/sm90bwd/ffi_$N -DJPS_KERNEL_DIR=$PWD/build/sm90bwd/k_$N -DJPS_OUTPUT_DIR=$PWD/exp/sm90bwd/$N -DCMAKE_BUILD_TYPE=Release > /dev/null 2>&1
cmake --build build/sm90bwd/ffi_$N -j2 2>&1 | tail -1
ls -la exp/sm90bwd/$N
