#!/usr/bin/env bash
# Build the CuTe kernel library here (CPU-only machine with nvidia-cutlass-dsl, jax, a CUDA toolkit),
# then run the GPU subset on a CUDA machine from the source tree.
#
#   scripts/gpu_check.sh build            # AOT-compile kernels + link jax_padsafe/_cute/lib/libjax_padsafe_kernels.so
#   scripts/gpu_check.sh test [--quick]   # on the GPU machine (PYTHONPATH=. from the repo root); logs to $OUT or ./gpu_out
#
# With the device tool: run `build` here, then run `scripts/gpu_check.sh test` there, carrying
# jax_padsafe/_cute/lib.  Archs/variants: JPS_ARCHS, JPS_DTYPES, JPS_HEAD_DIMS, JPS_SOFTCAP, JPS_JOBS.
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}; shift || true
case "$cmd" in
  build)
    set -e
    python3 -m jax_padsafe.kernels.build --out build/kernels
    cmake -S ffi -B build/ffi -DJPS_KERNEL_DIR="$PWD/build/kernels" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build build/ffi -j"${JPS_JOBS:-2}"
    lib=jax_padsafe/_cute/lib/libjax_padsafe_kernels.so
    echo "built $lib ($(du -h $lib | cut -f1)); dynamic dependencies:"
    ldd "$lib" | sed 's/^/  /'
    ;;
  test)
    # JPS_STEPS picks parts (default all): checks (kernel checks), fused (the opt-in fused-dQ backward), suite (pytest cute cases; or its
    # halves suite_a, suite_b), bench (benchmarks), sharded (multi-GPU check; needs >= 2 GPUs).  On an
    # H100 (2026-11-24, session 11) suite_a took 162 s and suite_b 549 s: give suite_b a whole 10-minute call.
    # Not in the default: large (tensors of more than 2**31 elements and one 128k-token sequence, both kernel
    # families; needs ~60 GB of GPU memory, ~60 s per family on an H100) and fuzz (check_fuzz.py: random contract
    # cases with sequences up to 1100 rows, fresh seeds from JPS_FUZZ_SEED (default 3000), on the three kernel
    # families in parallel; ~10-30 s per case, JPS_FUZZ_SECONDS per family, default 280).
    # checks takes longer (check_forward 388 s, twice on Hopper; check_backward > 5 min).
    out=${OUT:-gpu_out}; mkdir -p "$out"
    export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    steps=",${JPS_STEPS:-checks,fused,suite,bench,sharded},"
    quick=""; [ "${1:-}" = "--quick" ] && quick="--quick"
    rc=0
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | tee "$out/device.txt"
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
    ngpu=$(nvidia-smi -L | wc -l)
    if [[ $steps == *,checks,* ]]; then
      python3 -m pytest -q tests/test_cute_lowering.py 2>&1 | tail -3 | tee "$out/lowering.log" || rc=1
      python3 tests/gpu/check_forward.py $quick --json "$out/check_forward.json" 2>&1 | tee "$out/check_forward.log" | tail -3 || rc=1
      if [ "$cc" = "9.0" ]; then  # Hopper runs the sm90 forward by default: check the SM80-class one too
        JAX_PADSAFE_SM90=0 python3 tests/gpu/check_forward.py $quick --json "$out/check_forward_sm80class.json" 2>&1 \
          | tee "$out/check_forward_sm80class.log" | tail -3 || rc=1
      fi
      python3 tests/gpu/check_backward.py $quick --json "$out/check_backward.json" 2>&1 | tee "$out/check_backward.log" | tail -3 || rc=1
    fi
    # The opt-in fused-dQ backward (sm90f, hd128) on Hopper; ~100 s per dtype on an H100.
    if [[ $steps == *,fused,* ]] && [ "$cc" = "9.0" ]; then
      JAX_PADSAFE_FUSED_DQ=1 python3 tests/gpu/check_backward.py --head-dims 128 --json "$out/check_backward_fused.json" \
        2>&1 | tee "$out/check_backward_fused.log" | tail -3
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    fi
    if [[ $steps == *,checks,* ]]; then
      # The same kernels inside CUDA graphs (XLA command buffers with custom calls).
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
        python3 tests/gpu/check_forward.py --quick 2>&1 | tail -4 | tee "$out/check_cmdbuf.log" || rc=1
    fi
    # The project's CPU test suite on the GPU, implementation="cute" parametrisations only.  On an H100
    # the whole of it takes ~12 min (2026-11-23), more than one 10-minute device call: "suite_b" (random
    # fuzz cases, varlen) and "suite_a" (every other test file, so a new one is never left out) split it.
    suite_b="tests/test_fuzz.py tests/test_varlen.py"
    suite_a="tests --ignore=tests/gpu --ignore=tests/test_fuzz.py --ignore=tests/test_varlen.py"
    for part in suite suite_a suite_b; do
      if [[ $steps == *,$part,* ]]; then
        case $part in suite) files="tests --ignore=tests/gpu";; suite_a) files=$suite_a;; suite_b) files=$suite_b;; esac
        # shellcheck disable=SC2086
        python3 -m pytest -q $files -k cute -rs 2>&1 | tail -40 | tee "$out/tests_cute_$part.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      fi
    done
    if [[ $steps == *,large,* ]]; then
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 tests/gpu/check_large.py --json "$out/check_large.json" 2>&1 \
        | tee "$out/check_large.log" | tail -3
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      if [ "$cc" = "9.0" ]; then
        XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PADSAFE_SM90=0 JAX_PADSAFE_SM90_BWD=0 python3 tests/gpu/check_large.py \
          --json "$out/check_large_sm80class.json" 2>&1 | tee "$out/check_large_sm80class.log" | tail -3
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      fi
    fi
    if [[ $steps == *,fuzz,* ]]; then
      # One process per kernel family, in parallel: the float64 oracle on the host is most of a case's time.
      seed=${JPS_FUZZ_SEED:-3000}
      pids=(); fams=()
      for fam in sm90 sm80class fused; do
        case $fam in sm90) env=();; sm80class) env=(JAX_PADSAFE_SM90=0 JAX_PADSAFE_SM90_BWD=0);;
                     fused) env=(JAX_PADSAFE_FUSED_DQ=1);; esac
        [ "$cc" = "9.0" ] || [ "$fam" = sm90 ] || continue  # elsewhere the default family is the SM80 one
        env "${env[@]}" XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 \
          timeout "${JPS_FUZZ_SECONDS:-280}" python3 tests/gpu/check_fuzz.py --dense $seed:$((seed + 40)) \
          --packed $((seed + 40)):$((seed + 60)) --json "$out/check_fuzz_$fam.json" > "$out/check_fuzz_$fam.log" 2>&1 &
        pids+=($!); fams+=("$fam")
        seed=$((seed + 60))
      done
      for i in "${!pids[@]}"; do
        wait "${pids[$i]}"; st=$?
        f="$out/check_fuzz_${fams[$i]}.log"
        echo "check_fuzz_${fams[$i]}: $(grep -c '^ok' "$f") passed, $(grep -c '^FAIL' "$f") failed, exit $st" \
          "(124: the time limit ended the sweep, not a failure by itself)"
        grep -A3 '^FAIL' "$f" | head -20
        # 0: all passed; 124: cut off by the limit (its failures, if any, are FAIL lines); anything else (1: a
        # case failed, or a crash before any case) fails the step.
        if grep -q '^FAIL' "$f" || { [ "$st" -ne 0 ] && [ "$st" -ne 124 ]; }; then rc=1; tail -5 "$f"; fi
      done
    fi
    if [[ $steps == *,sharded,* ]] && [ "$ngpu" -ge 2 ]; then
      python3 tests/gpu/check_sharded.py --json "$out/check_sharded.json" 2>&1 | tee "$out/check_sharded.log" | tail -3 || rc=1
    fi
    if [[ $steps == *,bench,* ]]; then
      python3 benchmarks/bench_forward.py $quick --out "$out/bench_forward.json" 2>&1 \
        | tee "$out/bench_forward.log" | tail -40
      python3 benchmarks/bench_backward.py --out "$out/bench_backward.json" 2>&1 \
        | tee "$out/bench_backward.log" | tail -20
      # cuDNN's default backward is not deterministic; ours is.  The like-for-like comparison, in its own process:
      python3 benchmarks/bench_backward.py --impls cute,cudnn --xla-deterministic \
        --out "$out/bench_backward_xla_deterministic.json" 2>&1 | tee "$out/bench_backward_xla_deterministic.log" | tail -9
    fi
    exit $rc
    ;;
  *) sed -n 2,9p "$0"; exit 2 ;;
esac
