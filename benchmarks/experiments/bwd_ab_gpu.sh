#!/usr/bin/env bash
# One device call: a backward library A/B.  Bitwise dq / dk / dv of NEW against BASE (bwd_bitwise_ab.py, the
# two-sequence packed layout and LAYOUT=short), then forward+backward speed (bench_backward.py, cute + cuDNN
# in each process), ROUNDS rounds with the library order rotated.  BASE / NEW: paths of the two libraries.
#   BASE=jax_padsafe/_cute/lib/libjax_padsafe_kernels.so NEW=exp/x/lib/libjax_padsafe_kernels.so \
#     DIMS=128 SEQS=2048,8192 bash benchmarks/experiments/bwd_ab_gpu.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
AB=benchmarks/experiments/bwd_bitwise_ab.py
for layout in two short; do
  LAYOUT=$layout JAX_PADSAFE_CUTE_LIB=$BASE HEAD_DIMS=${DIMS:-128} DTYPES=bf16 timeout 120 python3 $AB save /tmp/ref_$layout.npz 2>&1 | tail -1
  LAYOUT=$layout JAX_PADSAFE_CUTE_LIB=$NEW HEAD_DIMS=${DIMS:-128} DTYPES=bf16 timeout 120 python3 $AB compare /tmp/ref_$layout.npz 2>&1 \
    | tail -2 | tee "$OUT/bitwise_$layout.log"
done
libs=("$BASE" "$NEW"); names=(base new)
for round in $(seq 1 "${ROUNDS:-2}"); do for i in 0 1; do j=$(( (i + round) % 2 ))
  JAX_PADSAFE_CUTE_LIB=${libs[$j]} timeout 200 python3 benchmarks/bench_backward.py --impls cute,cudnn --dims "${DIMS:-128}" \
    --seqs "${SEQS:-2048,8192}" --out "$OUT/bb_${names[$j]}_r$round.json" > "/tmp/bb_${names[$j]}_r$round.log" 2>&1
  echo "== ${names[$j]} round $round rc=$?"; grep -E "(True|False) *\|" "/tmp/bb_${names[$j]}_r$round.log" | tail -20
done; done
