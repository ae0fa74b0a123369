#!/usr/bin/env bash
# Fused-dQ (sm90f, 5-GEMM) backward on one device call: proof that the opt-in reaches the fused kernels,
# the float64-reference check of hd128 with the fused kernels (JAX_PADSAFE_FUSED_DQ=1) and with the default
# 7-GEMM ones, then (JPS_BENCH=1) forward+backward speed of fused, default and cuDNN.
#   JAX_PADSAFE_CUTE_LIB=$PWD/exp/fused/libjax_padsafe_kernels.so OUT=gpu_out bash benchmarks/experiments/fused_dq_gpu.sh
set -u
export PYTHONPATH=.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 - <<'PY'
import os
import numpy as np, jax, jax.numpy as jnp
from jax_padsafe._cute import bwd_ops, ops
rng = np.random.default_rng(0)
T, N, H = 700, 4, 128
q, k, v, do = (jnp.asarray(rng.standard_normal((T, N, H)), jnp.bfloat16) for _ in range(4))
cu = jnp.array([0, 300, 700], jnp.int32); used = jnp.array([300, 400], jnp.int32)
kw = dict(max_seqlen_q=400, max_seqlen_k=400, scale=H ** -0.5, causal=True, bottom_right=False, window_left=-1,
          window_right=-1, softcap=0.0)
o, lse = ops.flash_forward(q, k, v, cu, cu, used, used, **kw)
out = {}
for flag in ("1", "1", "0"):  # "1" first: the handler reads the variable once per process
    os.environ["JAX_PADSAFE_FUSED_DQ"] = flag
    out.setdefault(flag, []).append(bwd_ops.flash_backward(q, k, v, o, lse, do, jnp.zeros_like(lse), cu, cu, used,
                                                           used, **kw))
(d0,), (f1, f2) = out["0"], out["1"]
for name, a, b, c in zip(("dq", "dk", "dv"), d0, f1, f2):
    a, b, c = (np.asarray(x, np.float32) for x in (a, b, c))
    print(f"{name}: fused vs default max|diff| {np.abs(a - b).max():.3g} (max|x| {np.abs(a).max():.3g}); "
          f"fused run-to-run bitwise equal: {np.array_equal(b, c)}")
PY
DT=${JPS_CHECK_DTYPES:-bf16,fp16}
for flag in 1 0; do
  JAX_PADSAFE_FUSED_DQ=$flag timeout "${JPS_CHECK_S:-250}" python3 -u tests/gpu/check_backward.py --head-dims 128 \
    --dtypes "$DT" --json "$OUT/check_bwd_fused$flag.json" > "$OUT/check_bwd_fused$flag.log" 2>&1
  echo "check_backward JAX_PADSAFE_FUSED_DQ=$flag rc=$?"; grep -v "^ok" "$OUT/check_bwd_fused$flag.log" | tail -4
done
if [ "${JPS_BENCH:-0}" = 1 ]; then
  SEQS=${JPS_BENCH_SEQS:-2048,8192}
  JAX_PADSAFE_FUSED_DQ=1 timeout 150 python3 benchmarks/bench_backward.py --impls cute,cudnn --seqs "$SEQS" \
    --out "$OUT/bench_bwd_fused.json" 2>&1 | tail -6
  timeout 100 python3 benchmarks/bench_backward.py --impls cute --seqs "$SEQS" --out "$OUT/bench_bwd_7gemm.json" 2>&1 | tail -6
fi
