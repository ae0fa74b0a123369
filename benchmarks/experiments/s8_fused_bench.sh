#!/bin/bash
# Session 8: the opt-in fused-dQ (sm90f) backward vs the default on the final library, then the dK/dV stall profile.
export PYTHONPATH=.
L=$PWD/exp/s8_v3/libjax_padsafe_kernels.so
for F in 1 0; do
  JAX_PADSAFE_FUSED_DQ=$F JAX_PADSAFE_CUTE_LIB=$L timeout 120 python3 benchmarks/bench_backward.py --impls cute$([ $F = 0 ] && echo ,cudnn) --dims 128 \
    --seqs 2048,8192 --out "$OUT/bench_backward_v3_fused$F.json" > "$OUT/bench_backward_v3_fused$F.log" 2>&1
  echo "== fused=$F rc=$?"; grep -E "^ +[0-9]+ +[0-9]+ +(True|False)" "$OUT/bench_backward_v3_fused$F.log"
done
NCU=0 OUT=$OUT JAX_PADSAFE_CUTE_LIB=$L bash benchmarks/experiments/ncu_dkdv_stalls.sh > /dev/null 2>&1
rm -f "$OUT"/*_raw.csv; gzip -f "$OUT"/*_sass.csv
