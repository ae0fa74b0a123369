#!/bin/bash
# Nsight Compute on the device machine: stall reasons and per-SASS-instruction stall samples of the sm90 dK/dV
# kernel (one launch, hd128, 8k, non-causal).  KERNEL=BwdDQSm90 for the dQ kernel.
#   JAX_PADSAFE_CUTE_LIB=... OUT=gpu_out bash benchmarks/experiments/ncu_dkdv_stalls.sh
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
NCU_BIN=${NCU_BIN:-/usr/local/cuda/bin/ncu}
K=${KERNEL:-BwdDKDVSm90}
timeout 200 $NCU_BIN --kernel-name regex:"$K" --launch-count 1 --section WarpStateStats --section SourceCounters \
  --section SpeedOfLight --import-source no -f -o "$OUT/$K" python3 benchmarks/experiments/ncu_bwd_once.py > "$OUT/ncu_$K.log" 2>&1
echo "ncu rc=$?"
$NCU_BIN -i "$OUT/$K.ncu-rep" --page details --print-details all > "$OUT/${K}_details.txt" 2>&1
$NCU_BIN -i "$OUT/$K.ncu-rep" --page raw --csv > "$OUT/${K}_raw.csv" 2>&1
$NCU_BIN -i "$OUT/$K.ncu-rep" --page source --csv --print-source sass > "$OUT/${K}_sass.csv" 2>&1
rm -f "$OUT/$K.ncu-rep"
ls -la "$OUT"
