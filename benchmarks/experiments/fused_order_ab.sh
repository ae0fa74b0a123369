#!/usr/bin/env bash
# Launch order of the ordered fused-dQ backward (session 12): forward+backward TFLOP/s of the default 7-GEMM
# backward and of fused-dQ libraries, cute + cuDNN in each process, ROUNDS rounds with the order rotated,
# then check_backward (hd128 bf16) of the fused kernel of the library named by CHECK.
#   LIBDIR=exp/libs OUT=gpu_out bash benchmarks/experiments/fused_order_ab.sh "b_base:0 b_base:1 b_hf:1 b_unord:1"
# Each entry is <library>:<JAX_PADSAFE_FUSED_DQ>; libraries at $LIBDIR/<library>/lib.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cfgs=($1); n=${#cfgs[@]}
T0=$(date +%s)
for round in $(seq 1 ${ROUNDS:-3}); do for i in $(seq 0 $((n - 1))); do c=${cfgs[$(( (i + round - 1) % n ))]}
  lib=${c%%:*}; fused=${c##*:}
  JAX_PADSAFE_FUSED_DQ=$fused JAX_PADSAFE_CUTE_LIB=$PWD/${LIBDIR:-exp/libs}/$lib/lib/libjax_padsafe_kernels.so \
    timeout 150 python3 benchmarks/bench_backward.py --impls cute,cudnn --dims 128 --seqs ${SEQS:-2048,8192} \
    --out $OUT/bb_${lib}_${fused}_r$round.json >> $OUT/ab.log 2>&1
  echo "== $c round $round done at $(( $(date +%s) - T0 )) s"
done; done
python3 - "$1" <<'PY'
import json, sys, os
out = os.environ["OUT"]; rows = {}
for c in sys.argv[1].split():
    lib, fused = c.split(":")
    for r in range(1, int(os.environ.get("ROUNDS", "3")) + 1):
        p = f"{out}/bb_{lib}_{fused}_r{r}.json"
        if not os.path.exists(p): continue
        for row in json.load(open(p))["rows"]:
            rows.setdefault((row["seqlen"], row["causal"]), {}).setdefault(c, []).append(
                (row.get("cute_fwdbwd"), row.get("cudnn_fwdbwd")))
cfgs = sys.argv[1].split()
print("S causal | " + " | ".join(f"{c} fwd+bwd (ratio)" for c in cfgs))
for key in sorted(rows):
    print(f"{key[0]} {key[1]!s:5} | " + " | ".join(", ".join(f"{a:.0f} ({a / b:.2f})" for a, b in rows[key].get(c, []) if a and b) for c in cfgs))
json.dump({f"{k[0]}_{k[1]}": v for k, v in rows.items()}, open(f"{out}/ab_summary.json", "w"), indent=1)
PY
if [ -n "${CHECK:-}" ]; then
  JAX_PADSAFE_FUSED_DQ=1 JAX_PADSAFE_CUTE_LIB=$PWD/${LIBDIR:-exp/libs}/$CHECK/lib/libjax_padsafe_kernels.so timeout 250 \
    python3 tests/gpu/check_backward.py --head-dims 128 --dtypes bf16 --json $OUT/check_bwd_$CHECK.json > $OUT/check_bwd_$CHECK.log 2>&1
  echo "check_backward (fused, $CHECK) rc=$?"; grep -v "^ok" $OUT/check_bwd_$CHECK.log | tail -5
fi
