#!/bin/bash
# Session 22: Nsight Compute on the hd96 backward kernels, one CTA per dense tile (exp/hd96off) against the queued
# schedule (exp/hd96all), 8 x 2048 tokens, non-causal.  Libraries: bwd_dense_queue_build.sh hd96off 0 96 /
# hd96all all 96.  Writes per library and kernel the details page and the 25 hottest SASS lines to $OUT.
cd "$(dirname "$0")/../.."
export PYTHONPATH=. HD=96 S=2048
NCU_BIN=${NCU_BIN:-/usr/local/cuda/bin/ncu}
w=/tmp/ncu_w; mkdir -p $w
for lib in hd96off hd96all; do
  for K in BwdDKDVSm90 BwdDQSm90; do
    JAX_PADSAFE_CUTE_LIB=$PWD/exp/$lib/lib/libjax_padsafe_kernels.so timeout 90 $NCU_BIN --kernel-name regex:"$K" \
      --launch-count 1 --section WarpStateStats --section SourceCounters --section SpeedOfLight --section Occupancy \
      --section LaunchStats --import-source no -f -o "$w/${lib}_$K" python3 benchmarks/experiments/ncu_bwd_once.py \
      > "$w/${lib}_$K.log" 2>&1
    echo "$lib $K ncu rc=$?"
    $NCU_BIN -i "$w/${lib}_$K.ncu-rep" --page details --print-details all > "$OUT/${lib}_${K}_details.txt" 2>&1
    $NCU_BIN -i "$w/${lib}_$K.ncu-rep" --page source --csv --print-source sass > "$w/${lib}_$K.csv" 2>&1
    { echo "== $lib $K"; python3 benchmarks/experiments/ncu_hot_sass.py "$w/${lib}_$K.csv" 25; } >> "$OUT/hot_sass.txt" 2>&1
  done
done
