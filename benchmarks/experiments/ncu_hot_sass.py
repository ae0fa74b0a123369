"""The SASS instructions with the most warp-stall samples in an Nsight Compute source export, with their top
three stall reasons:

    ncu -i report.ncu-rep --page source --csv --print-source sass > kernel_sass.csv   (ncu_dkdv_stalls.sh)
    python benchmarks/experiments/ncu_hot_sass.py kernel_sass.csv [40]
"""
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
def g(r, k):
    try: return float(r[ix[k]].replace(",", ""))
    except: return 0.0
tot = sum(g(r, "Warp Stall Sampling (All Samples)") for r in data)
print("total samples", tot)
reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
# print top 40 instructions with top reasons
top = sorted(data, key=lambda r: -g(r, "Warp Stall Sampling (All Samples)"))[:int(sys.argv[2]) if len(sys.argv) > 2 else 40]
for r in top:
    s = g(r, "Warp Stall Sampling (All Samples)")
    rs = sorted(((g(r, h), h) for h in reasons), reverse=True)[:3]
    print(f"{r[ix['Address']]:>6} {100*s/tot:5.1f}% {r[ix['Source']][:60]:60s} " + " ".join(f"{h[6:]}={int(v)}" for v, h in rs if v))
