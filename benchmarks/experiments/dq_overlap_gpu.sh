#!/bin/bash
# Session 8 (device tool, one call): the sm90 dQ kernel with Q / dO in registers and overlapped steps.
# Libraries under exp/ (carried): s8_final = the previous default (the library of session 7), s8_regs /
# s8_ovl / s8_both = hd128 bf16 with one option each / both, s8_cand = hd64/96/128 bf16+fp16 with the
# candidate defaults.  Bitwise A/B of the gradients against s8_final (no arithmetic changes, so every bit must
# match), forward+backward speed of each, then check_backward hd128 on s8_cand.
#   OUT=gpu_out bash benchmarks/experiments/dq_overlap_gpu.sh
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
L() { echo "$PWD/exp/$1/libjax_padsafe_kernels.so"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
AB=benchmarks/experiments/bwd_bitwise_ab.py
JAX_PADSAFE_CUTE_LIB=$(L s8_final) HEAD_DIMS=64,96,128 timeout 60 python3 $AB save "$OUT/ref.npz" 2>&1 | tail -2
JAX_PADSAFE_CUTE_LIB=$(L s8_cand) HEAD_DIMS=64,96,128 timeout 60 python3 $AB compare "$OUT/ref.npz" 2>&1 | tail -8
for V in s8_regs s8_ovl s8_both; do
  echo "== $V"; JAX_PADSAFE_CUTE_LIB=$(L $V) HEAD_DIMS=128 DTYPES=bf16 timeout 40 python3 $AB compare "$OUT/ref.npz" 2>&1 | tail -4
done
for V in ${BENCH:-s8_final s8_regs s8_ovl s8_both s8_cand}; do
  impls=cute; dims=128; [ $V = s8_final ] && impls=cute,cudnn
  [ $V = s8_cand ] && dims=64,96,128
  JAX_PADSAFE_CUTE_LIB=$(L $V) timeout 120 python3 benchmarks/bench_backward.py --impls $impls --dims $dims \
    --seqs 2048,8192 --out "$OUT/bench_backward_$V.json" > "$OUT/bench_backward_$V.log" 2>&1
  echo "== bench $V rc=$?"; grep -E "^\|" "$OUT/bench_backward_$V.log" | tail -14
done
JAX_PADSAFE_CUTE_LIB=$(L s8_cand) timeout ${CHECK_S:-170} python3 tests/gpu/check_backward.py --head-dims ${CHECK_DIMS:-128} \
  --dtypes bf16,fp16 --json "$OUT/check_backward_cand.json" > "$OUT/check_backward_cand.log" 2>&1
echo "check rc=$?"; grep -E "FAIL|passed|failed" "$OUT/check_backward_cand.log" | tail -8
