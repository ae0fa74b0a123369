#!/usr/bin/env bash
# Session 10 device call: the backward's pinned dP waits (JPS_SM90_BWD_PIN=1 build, exp/bpin) against the same
# tree without (exp/bbase), hd128 bf16: bitwise A/B of dq/dk/dv, then forward+backward speed (cute + cuDNN in
# each process), ROUNDS rounds with the order rotated.
export PYTHONPATH=. PYTHONUNBUFFERED=1
L() { echo "$PWD/exp/$1/lib/libjax_padsafe_kernels.so"; }
AB=benchmarks/experiments/bwd_bitwise_ab.py
JAX_PADSAFE_CUTE_LIB=$(L ${BASE:-bbase}) HEAD_DIMS=${DIMS:-128} DTYPES=bf16 timeout 90 python3 $AB save /tmp/ref.npz 2>&1 | tail -1
JAX_PADSAFE_CUTE_LIB=$(L ${PIN:-bpin}) HEAD_DIMS=${DIMS:-128} DTYPES=bf16 timeout 90 python3 $AB compare /tmp/ref.npz 2>&1 | tail -4 | tee $OUT/bitwise.log
libs=(${BASE:-bbase} ${PIN:-bpin})
for round in $(seq 1 ${ROUNDS:-3}); do for i in 0 1; do V=${libs[$(( (i + round) % 2 ))]}
  JAX_PADSAFE_CUTE_LIB=$(L $V) timeout 120 python3 benchmarks/bench_backward.py --impls cute,cudnn --dims ${DIMS:-128} \
    --seqs 2048,8192 --out "$OUT/bb_${V}_r$round.json" > "/tmp/bb_${V}_r$round.log" 2>&1
  echo "== $V round $round rc=$?"; grep -E "(True|False) \|" "/tmp/bb_${V}_r$round.log" | tail -20
done; done
