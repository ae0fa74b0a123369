#!/usr/bin/env bash
# One device call: the sm90 backward's `queue_dense` A/B (session 21).  Libraries (bwd_dense_queue_build.sh):
#   MAIN  the shipping policy (jax_padsafe/_cute/lib), OFF  JPS_SM90_BWD_DENSE_QUEUE=0 at DIMS_ON,
#   QALL  =all at DIMS_TRY (head dims the shipping policy leaves off, so MAIN is their base).
# 1. Bitwise gradients, the padded / two-sequence / short-document layouts: MAIN against OFF at DIMS_ON, QALL
#    against MAIN at DIMS_TRY (the schedule moves tiles between CTAs, never changes one tile's math).
# 2. Per-kernel times (varlen_probe, 8 x 2048 balanced documents, tight bound, causal and not) at DIMS_TRY.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
MAIN=jax_padsafe/_cute/lib/libjax_padsafe_kernels.so OFF=exp/off/lib/libjax_padsafe_kernels.so
QALL=exp/qall/lib/libjax_padsafe_kernels.so AB=benchmarks/experiments/bwd_bitwise_ab.py
DIMS_ON=${DIMS_ON:-64,128} DIMS_TRY=${DIMS_TRY:-96,192,256}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for layout in padded two short; do
  for pair in "$OFF $MAIN $DIMS_ON" "$MAIN $QALL $DIMS_TRY"; do set -- $pair
    LAYOUT=$layout JAX_PADSAFE_CUTE_LIB=$1 HEAD_DIMS=$3 DTYPES=bf16 timeout 150 python3 $AB save /tmp/ref.npz 2>&1 | tail -1
    echo "== $layout $3: $(basename $(dirname $(dirname $2))) vs $(basename $(dirname $(dirname $1)))"
    LAYOUT=$layout JAX_PADSAFE_CUTE_LIB=$2 HEAD_DIMS=$3 DTYPES=bf16 timeout 150 python3 $AB compare /tmp/ref.npz 2>&1 \
      | tail -3 | tee -a "$OUT/bitwise.log"
  done
done
for H in ${DIMS_TRY//,/ }; do for lib in MAIN QALL; do
  echo "== hd$H $lib"
  JAX_PADSAFE_CUTE_LIB=${!lib} timeout 150 python3 benchmarks/experiments/varlen_probe.py --kinds balanced \
    --bounds tight --causal 0,1 --calls 10 --head-dim $H 2>&1 | grep -v "^ *$" | grep -A8 "fwd+bwd" | tee "$OUT/probe_hd${H}_$lib.log"
done; done
# 3. The contract checks on MAIN (padded with rows_covered, GQA packed, long), and the dense ones on QALL.
if [ -n "${CHECKS:-1}" ]; then
  timeout 200 python3 tests/gpu/check_backward.py --quick --only gqa7,dense,long 2>&1 | tail -12 | tee "$OUT/check_main.log"
  JAX_PADSAFE_CUTE_LIB=$QALL timeout 120 python3 tests/gpu/check_backward.py --quick --head-dims ${DIMS_TRY} \
    --only dense 2>&1 | grep -v "^ok" | tail -8 | tee "$OUT/check_qall.log"
fi
