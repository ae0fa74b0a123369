#!/bin/bash
# GPU run: A/B of sm90 backward tile variants (libraries under exp/sm90bwd/<name>/, carried), then the full
# check_backward on the fastest.  Usage (device tool): bash benchmarks/experiments/sm90bwd_gpu_variants.sh
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VARIANTS=${VARIANTS:-lib B C D}
first=1
for V in $VARIANTS; do
  impls=cute; [ $first = 1 ] && impls=cute,cudnn; first=0
  JAX_PADSAFE_CUTE_LIB=$PWD/exp/sm90bwd/$V/libjax_padsafe_kernels.so timeout 100 python3 benchmarks/bench_backward.py \
    --impls $impls --seqs 2048,4096,8192 --out "$OUT/bench_backward_$V.json" > "$OUT/bench_backward_$V.log" 2>&1
  echo "== $V rc=$?"; tail -6 "$OUT/bench_backward_$V.log"
done
BEST=$(python3 - "$OUT" $VARIANTS <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
best, score = None, -1.0
for n in names:
    try:
        rows = json.load(open(f"{out}/bench_backward_{n}.json"))["rows"]
        s = sum(r["cute_fwdbwd"] for r in rows) / len(rows)
    except Exception:
        continue
    print(f"{n}: mean fwd+bwd {s:.1f}", file=sys.stderr)
    if s > score:
        best, score = n, s
print(best)
PY
)
echo "best: $BEST"
JAX_PADSAFE_CUTE_LIB=$PWD/exp/sm90bwd/$BEST/libjax_padsafe_kernels.so timeout 220 python3 tests/gpu/check_backward.py \
  --json "$OUT/check_backward_$BEST.json" > "$OUT/check_backward_$BEST.log" 2>&1
echo "full check ($BEST) rc=$?"; grep -E "FAIL|passed" "$OUT/check_backward_$BEST.log" | tail -12
