#!/bin/bash
# Session 8, device call on the library that ships (exp/s8_v3: full sm_90a build of the final tree): bitwise A/B
# against session 7's library (exp/s8_final) at every head dim, forward+backward speed with cuDNN in the same
# process, check_backward at CHECK_DIMS, then (NCU=1) the dK/dV kernel's stall profile.
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
L() { echo "$PWD/exp/$1/libjax_padsafe_kernels.so"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${AB:-1}" = 1 ]; then
  AB=benchmarks/experiments/bwd_bitwise_ab.py
  JAX_PADSAFE_CUTE_LIB=$(L s8_final) HEAD_DIMS=64,96,128,192,256 timeout 90 python3 $AB save /tmp/ref.npz 2>&1 | tail -1
  JAX_PADSAFE_CUTE_LIB=$(L s8_v3) HEAD_DIMS=64,96,128,192,256 timeout 90 python3 $AB compare /tmp/ref.npz 2>&1 | tail -6
fi
if [ "${BENCH:-1}" = 1 ]; then
  JAX_PADSAFE_CUTE_LIB=$(L s8_v3) timeout 240 python3 benchmarks/bench_backward.py --impls cute,cudnn \
    --dims 64,96,128,192,256 --seqs 2048,8192 --out "$OUT/bench_backward_v3.json" > "$OUT/bench_backward_v3.log" 2>&1
  echo "== bench rc=$?"; grep -E "^ +[0-9]+ +[0-9]+ +(True|False)" "$OUT/bench_backward_v3.log"
fi
JAX_PADSAFE_CUTE_LIB=$(L s8_v3) timeout ${CHECK_S:-300} python3 tests/gpu/check_backward.py --head-dims ${CHECK_DIMS:-64,96} \
  --dtypes bf16,fp16 --json "$OUT/check_backward_v3.json" > "$OUT/check_backward_v3.log" 2>&1
echo "check rc=$?"; grep -E "FAIL|passed|failed" "$OUT/check_backward_v3.log" | tail -8
if [ "${NCU:-0}" = 1 ]; then
  JAX_PADSAFE_CUTE_LIB=$(L s8_v3) bash benchmarks/experiments/ncu_dkdv_stalls.sh > /dev/null 2>&1
  rm -f "$OUT"/*_raw.csv; gzip -f "$OUT"/*_sass.csv
  python3 benchmarks/experiments/ncu_hot_sass.py <(zcat "$OUT/BwdDKDVSm90_sass.csv.gz") 25 > "$OUT/ncu_dkdv_v3_hot.txt" 2>&1
  head -30 "$OUT/ncu_dkdv_v3_hot.txt"
fi
