#!/usr/bin/env bash
# One device call: the shipping library after the `queue_dense` policy (session 21): the backward contract checks
# on the layouts the policy moves (padded with rows_covered, packed GQA, long; every head dim it queues), then
# forward+backward speed against OFF (JPS_SM90_BWD_DENSE_QUEUE=0, bf16, built by bwd_dense_queue_build.sh), cute
# and cuDNN in each process, ROUNDS rounds with the library order rotated.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
MAIN=jax_padsafe/_cute/lib/libjax_padsafe_kernels.so OFF=exp/off/lib/libjax_padsafe_kernels.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
timeout 150 python3 tests/gpu/check_backward.py --quick --only gqa7,dense,long 2>&1 | grep -v "^ok" | tail -4 | tee "$OUT/check_quick.log"
timeout 150 python3 tests/gpu/check_backward.py --head-dims 192,256 --dtypes bf16,fp16 --only dense 2>&1 | grep -v "^ok" \
  | tail -4 | tee "$OUT/check_dense_192_256.log"
libs=("$OFF" "$MAIN"); names=(off main)
for round in $(seq 1 "${ROUNDS:-1}"); do for i in 0 1; do j=$(( (i + round) % 2 ))
  JAX_PADSAFE_CUTE_LIB=${libs[$j]} timeout 200 python3 benchmarks/bench_backward.py --impls cute,cudnn \
    --dims "${DIMS:-64,128,192,256}" --seqs "${SEQS:-2048,8192}" --out "$OUT/bb_${names[$j]}_r$round.json" \
    > "/tmp/bb_${names[$j]}_r$round.log" 2>&1
  echo "== ${names[$j]} round $round rc=$?"; grep -E "(True|False) *\|" "/tmp/bb_${names[$j]}_r$round.log" | tail -20
done; done
