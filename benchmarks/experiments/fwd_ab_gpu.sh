#!/usr/bin/env bash
# usage: fwd_ab_gpu.sh "lib1 lib2 ..." [dims] [seqs]: bench_forward of each library (cute + cudnn, one process each),
# in turn, ROUNDS times (default 2); libraries at ${LIBDIR:-exp}/<lib>/lib
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 
T0=$(date +%s)
libs=($1); n=${#libs[@]}
# The order rotates by one library per round, so that no library always runs first (or last) on the GPU.
for round in $(seq 1 ${ROUNDS:-2}); do for i in $(seq 0 $((n - 1))); do lib=${libs[$(( (i + round - 1) % n ))]}
  JAX_PADSAFE_CUTE_LIB=$PWD/${LIBDIR:-exp}/$lib/lib/libjax_padsafe_kernels.so timeout 120 python3 benchmarks/bench_forward.py \
    --impls cute,cudnn --dims ${2:-64,128} --seqs ${3:-512,2048,8192,16384} --no-padded --out $OUT/b_${lib}_r$round.json >> $OUT/ab.log 2>&1
  echo "== $lib round $round done at $(( $(date +%s) - T0 )) s"
done; done
python3 - "$1" <<'PY'
import json, sys, os, glob
libs = sys.argv[1].split()
out = os.environ["OUT"]
rows = {}
for lib in libs:
    for r in range(1, int(os.environ.get("ROUNDS", "2")) + 1):
        p = f"{out}/b_{lib}_r{r}.json"
        if not os.path.exists(p): continue
        for row in json.load(open(p))["rows"]:
            key = (row["head_dim"], row["seqlen"], row["causal"])
            rows.setdefault(key, {}).setdefault(lib, []).append((row["cute"], row["cudnn"]))
print("hd S causal | " + " | ".join(f"{l} cute (ratio) per round" for l in libs))
for key in sorted(rows):
    cells = []
    for lib in libs:
        v = rows[key].get(lib, [])
        cells.append(", ".join(f"{c:.0f} ({c/d:.2f})" for c, d in v if c and d))
    print(f"{key[0]} {key[1]} {key[2]!s:5} | " + " | ".join(cells))
json.dump({f"{k[0]}_{k[1]}_{k[2]}": v for k, v in rows.items()}, open(f"{out}/ab_summary.json", "w"), indent=1)
for p in glob.glob(f"{out}/b_*.json"): os.remove(p)
PY
