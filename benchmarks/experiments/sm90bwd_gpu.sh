#!/bin/bash
# GPU run of the Hopper backward (bwd_sm90) with the library built into exp/sm90bwd/lib (carried).
# Usage (device tool): bash benchmarks/experiments/sm90bwd_gpu.sh   -> logs/JSON under $OUT
cd "$(dirname "$0")/../.."
export PYTHONPATH=. JAX_PADSAFE_CUTE_LIB=$PWD/exp/sm90bwd/lib/libjax_padsafe_kernels.so
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 tests/gpu/check_backward.py --quick --json "$OUT/check_backward_quick.json" > "$OUT/check_backward_quick.log" 2>&1
rc=$?; echo "quick rc=$rc" | tee -a "$OUT/check_backward_quick.log"; tail -3 "$OUT/check_backward_quick.log"
if [ $rc -eq 0 ] && [ "${FULL:-1}" = 1 ]; then
  timeout 220 python3 tests/gpu/check_backward.py --json "$OUT/check_backward.json" > "$OUT/check_backward.log" 2>&1
  echo "full rc=$?" | tee -a "$OUT/check_backward.log"; grep -E "FAIL|passed" "$OUT/check_backward.log" | tail -12
else
  grep -E "FAIL|Error|error" "$OUT/check_backward_quick.log" | head -20
fi
timeout 150 python3 benchmarks/bench_backward.py --impls cute,cudnn --seqs ${SEQS:-2048,4096,8192} --out "$OUT/bench_backward.json" > "$OUT/bench_backward.log" 2>&1
echo "bench rc=$?"; tail -8 "$OUT/bench_backward.log"
JAX_PADSAFE_SM90_BWD=0 timeout 80 python3 benchmarks/bench_backward.py --impls cute --seqs 2048,8192 --out "$OUT/bench_backward_sm80family.json" > "$OUT/bench_backward_sm80family.log" 2>&1
echo "bench sm80-family rc=$?"; tail -5 "$OUT/bench_backward_sm80family.log"
