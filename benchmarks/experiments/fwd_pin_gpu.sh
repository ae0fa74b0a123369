#!/usr/bin/env bash
# Session 10 device call: bitwise A/B of forward libraries against the first, then the speed A/B.
#   LIBS="fbase fpin fpinre" DIMS=64,128 SEQS=2048,8192,16384 benchmarks/experiments/fwd_pin_gpu.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1
set -u
libs=($LIBS)
T0=$(date +%s)
lib() { echo "$PWD/${LIBDIR:-exp}/$1/lib/libjax_padsafe_kernels.so"; }
if [ "${BITWISE:-1}" = 1 ]; then
  JAX_PADSAFE_CUTE_LIB=$(lib ${libs[0]}) timeout ${BITWISE_TIMEOUT:-200} python3 benchmarks/experiments/fwd_bitwise_ab.py save /tmp/ref.npz 2>&1 | tail -2 | tee -a $OUT/bitwise.log
  for l in "${libs[@]:1}"; do
    echo "== $l vs ${libs[0]}" | tee -a $OUT/bitwise.log
    JAX_PADSAFE_CUTE_LIB=$(lib $l) timeout ${BITWISE_TIMEOUT:-200} python3 benchmarks/experiments/fwd_bitwise_ab.py compare /tmp/ref.npz 2>&1 | tail -8 | tee -a $OUT/bitwise.log
  done
  echo "bitwise done at $(( $(date +%s) - T0 )) s"
fi
bash benchmarks/experiments/fwd_ab_gpu.sh "$LIBS" "${DIMS:-64,128}" "${SEQS:-2048,8192,16384}"
echo "all done at $(( $(date +%s) - T0 )) s"
