#!/bin/bash
# Session 8, device call: the dK/dV kernel's row-statistics changes (+ dQ options) in exp/s8_v2 (full sm_90a
# library) against exp/s8_final (session 7's library): bitwise A/B of the gradients at every head dim, per-kernel
# backward times (exp/s8_v2skip: the same kernels with bwd_kernel_timing.patch), forward+backward speed, and
# check_backward at head dim 128.
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
L() { echo "$PWD/exp/$1/libjax_padsafe_kernels.so"; }
AB=benchmarks/experiments/bwd_bitwise_ab.py
JAX_PADSAFE_CUTE_LIB=$(L s8_final) HEAD_DIMS=64,96,128,192,256 timeout 90 python3 $AB save /tmp/ref.npz 2>&1 | tail -1
JAX_PADSAFE_CUTE_LIB=$(L s8_v2) HEAD_DIMS=64,96,128,192,256 timeout 90 python3 $AB compare /tmp/ref.npz 2>&1 | tail -6
JAX_PADSAFE_CUTE_LIB=$(L s8_v2skip) DIMS=64,128,256 timeout 150 python3 benchmarks/experiments/bwd_kernel_times.py 2>&1 \
  | grep -v -i warn | tee "$OUT/kernel_times_v2.txt"
for V in s8_final s8_v2; do
  impls=cute; [ $V = s8_final ] && impls=cute,cudnn
  JAX_PADSAFE_CUTE_LIB=$(L $V) timeout 120 python3 benchmarks/bench_backward.py --impls $impls --dims 64,128,256 \
    --seqs 2048,8192 --out "$OUT/bench_backward_$V.json" > "$OUT/bench_backward_$V.log" 2>&1
  echo "== bench $V rc=$?"; grep -E "^ +[0-9]+ +[0-9]+ +(True|False)" "$OUT/bench_backward_$V.log"
done
JAX_PADSAFE_CUTE_LIB=$(L s8_v2) timeout ${CHECK_S:-170} python3 tests/gpu/check_backward.py --head-dims 128 \
  --dtypes bf16,fp16 --json "$OUT/check_backward_v2_128.json" > "$OUT/check_backward_v2_128.log" 2>&1
echo "check rc=$?"; grep -E "FAIL|passed|failed" "$OUT/check_backward_v2_128.log" | tail -8
