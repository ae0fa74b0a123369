"""Ahead-of-time build of the CuTe DSL kernels (no GPU needed).

    python -m jax_padsafe.kernels.build --archs sm_80,sm_90a --out build/kernels [--dtypes bf16]
        [--head-dims 64,128] [--softcap 0,1] [--jobs 2]

Environment overrides (for `pip install .` / CMake): JPS_ARCHS, JPS_DTYPES, JPS_HEAD_DIMS, JPS_SOFTCAP,
JPS_JOBS, JPS_SM90 (1: also build the Hopper TMA + wgmma kernel family `fwd_sm90` for sm_90a; --sm90),
and JPS_TILES (tile experiments, e.g. "128=128x64x256,64=128x128x256": head_dim=BMxBNxTHREADS); for the
sm90 family JPS_SM90_TILES ("128=128x176x2": head_dim=BMxBNxSTAGES) and JPS_SM90_OPTS ("pingpong=0").
For every variant this writes `<prefix>.o` + `<prefix>.h` (export_to_c), then `jps_registry.h`:
a table of every built variant with a uniform launch adapter, which `ffi/` compiles in.  With the sm90
family it also builds the row-zeroing kernels (row_zeroing.py: the handlers' replacement for memsets of
whole outputs) into `jps_zero_rows_registry.h` (always written; an empty table without them).
"""

import argparse
import concurrent.futures as cf
import os
import sys
import time

from . import variants as V


def _apply_tile_overrides():
    for env, table in (("JPS_TILES", V.TILES), ("JPS_SM90_TILES", V.SM90_TILES)):
        for item in os.environ.get(env, "").split(","):
            if item.strip():
                hd, cfg = item.split("=")
                table[int(hd)] = tuple(int(x) for x in cfg.split("x"))


def _sm90_options():
    """JPS_SM90_OPTS="pingpong=0,intra_wg_overlap=1": switches of FlashFwdSm90 for experiments."""
    opts = {}
    for item in os.environ.get("JPS_SM90_OPTS", "").split(","):
        if item.strip():
            key, val = item.split("=")
            opts[key.strip()] = int(val) if key.strip() in ("max_tiles_per_cta", "multi_tile_min_tiles") else bool(int(val))
    return opts


def _compile_one(args):
    variant, out = args
    _apply_tile_overrides()
    os.environ["CUTE_DSL_ARCH"] = variant.arch
    import ctypes

    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import find_runtime_libraries, make_fake_stream

    ctypes.CDLL(find_runtime_libraries(enable_tvm_ffi=False)[0], ctypes.RTLD_GLOBAL)
    if isinstance(variant, V.ZeroRowsKernel):
        from .row_zeroing import ZeroUncoveredRows

        def words():  # an output as Int32 [rows, 16-byte words, 4]
            return make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), 4), stride_order=(2, 1, 0),
                                            assumed_align=16)

        t0 = time.time()
        a = words()
        b = words() if variant.num_outputs == 2 else a
        cu = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
        compiled = cute.compile(ZeroUncoveredRows(variant.num_outputs), a, b, cu, 0, make_fake_stream(),
                                options=f"--gpu-arch {variant.arch}")
        compiled.export_to_c(out, variant.prefix, function_prefix=variant.prefix)
        return variant, time.time() - t0

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[variant.dtype]
    H = variant.head_dim
    if variant.family == "sm90":
        from .fwd_sm90 import FlashFwdSm90

        bm, bn, stages = variant.tile
        kern = FlashFwdSm90(dt, H, bm, bn, stages, variant.softcap, **_sm90_options())
    else:
        from .fwd_sm80 import FlashFwdSm80

        bm, bn, nt = variant.tile
        kern = FlashFwdSm80(dt, H, bm, bn, nt, variant.softcap)
    sym = cute.sym_int

    def qkv():
        return make_fake_compact_tensor(dt, (sym(), sym(), H), stride_order=(2, 1, 0), assumed_align=16)

    q, k, v, o = qkv(), qkv(), qkv(), qkv()
    lse = make_fake_compact_tensor(cutlass.Float32, (sym(), sym()), stride_order=(1, 0), assumed_align=4)
    # cu_seqlens_q/k, seqused_q/k; the sm90 family also takes its tile counter (int32 [1]).
    vec = [make_fake_compact_tensor(cutlass.Int32, (sym(),), assumed_align=4)
           for _ in range(5 if variant.family == "sm90" else 4)]
    t0 = time.time()
    compiled = cute.compile(
        kern, q, k, v, o, lse, *vec, 1.0, 1.0, 0, 0, 0, 1, make_fake_stream(),
        options=f"--gpu-arch {variant.arch}",
    )
    compiled.export_to_c(out, variant.prefix, function_prefix=variant.prefix)
    return variant, time.time() - t0


_TENSORS = [  # (parameter name in the kernel's __call__, dynamic shapes, dynamic strides)
    ("mQ", 2, 1), ("mK", 2, 1), ("mV", 2, 1), ("mO", 2, 1), ("mLSE", 2, 1),
    ("mCuQ", 1, 0), ("mCuK", 1, 0), ("mUsedQ", 1, 0), ("mUsedK", 1, 0),
]
_TENSORS_SM90 = _TENSORS + [("mTileCounter", 1, 0)]


def _adapter(v: V.FwdVariant) -> str:
    p = v.prefix
    sm90 = v.family == "sm90"
    lines = [f'#include "{p}.h"']
    for name, ns, nst in (_TENSORS_SM90 if sm90 else _TENSORS):
        t = f"{p}_Tensor_{name}_t"
        lines.append(f"static_assert(sizeof((({t} *)0)->dynamic_shapes) == {ns} * 4, \"ABI of {p}.{name}\");")
        if nst:
            lines.append(f"static_assert(sizeof((({t} *)0)->dynamic_strides) == {nst} * 8, \"ABI of {p}.{name}\");")
    lines += [
        f"static int32_t {p}_launch(void *module, const JpsFwdArgs *a, cudaStream_t s) {{",
        f"  {p}_Tensor_mQ_t q = {{a->q, {{a->total_q, a->num_heads}}, {{(int64_t)a->num_heads * a->head_dim}}}};",
        f"  {p}_Tensor_mK_t k = {{a->k, {{a->total_k, a->num_kv_heads}}, {{(int64_t)a->num_kv_heads * a->head_dim}}}};",
        f"  {p}_Tensor_mV_t v = {{a->v, {{a->total_k, a->num_kv_heads}}, {{(int64_t)a->num_kv_heads * a->head_dim}}}};",
        f"  {p}_Tensor_mO_t o = {{a->o, {{a->total_q, a->num_heads}}, {{(int64_t)a->num_heads * a->head_dim}}}};",
        f"  {p}_Tensor_mLSE_t lse = {{a->lse, {{a->num_heads, a->total_q}}, {{(int64_t)a->total_q}}}};",
        f"  {p}_Tensor_mCuQ_t cuq = {{a->cu_q, {{a->batch + 1}}}};",
        f"  {p}_Tensor_mCuK_t cuk = {{a->cu_k, {{a->batch + 1}}}};",
        f"  {p}_Tensor_mUsedQ_t uq = {{a->used_q, {{a->batch}}}};",
        f"  {p}_Tensor_mUsedK_t uk = {{a->used_k, {{a->batch}}}};",
    ]
    if sm90:
        lines.append(f"  {p}_Tensor_mTileCounter_t tc = {{a->tile_counter, {{1}}}};")
    lines += [
        f"  return cute_dsl_{p}_wrapper(({p}_Kernel_Module_t *)module, &q, &k, &v, &o, &lse, &cuq, &cuk, &uq, &uk,"
        + (" &tc," if sm90 else ""),
        "      a->score_mul, a->cap_mul, a->window_left, a->window_right, a->bottom_right, a->max_seqlen_q, s);",
        "}",
        f"static void {p}_load(void *module) {{ {p}_Kernel_Module_Load(({p}_Kernel_Module_t *)module); }}",
        f"static {p}_Kernel_Module_t {p}_module;",
    ]
    return "\n".join(lines)


def _zero_rows_adapter(z: V.ZeroRowsKernel) -> str:
    p = z.prefix
    return "\n".join([
        f'#include "{p}.h"',
        f"static int32_t {p}_launch(void *module, void *a, void *b, int32_t rows, int32_t words, int32_t *cu,",
        "                                int32_t batch, int32_t bound, cudaStream_t s) {",
        f"  {p}_Tensor_mA_t ta = {{a, {{rows, words}}, {{(int64_t)words * 4}}}};",
        f"  {p}_Tensor_mB_t tb = {{b, {{rows, words}}, {{(int64_t)words * 4}}}};",
        f"  {p}_Tensor_mCu_t tc = {{cu, {{batch + 1}}}};",
        f"  return cute_dsl_{p}_wrapper(({p}_Kernel_Module_t *)module, &ta, &tb, &tc, bound, s);",
        "}",
        f"static void {p}_load(void *module) {{ {p}_Kernel_Module_Load(({p}_Kernel_Module_t *)module); }}",
        f"static {p}_Kernel_Module_t {p}_module;",
    ])


def write_zero_rows_registry(out: str, built):
    body = ["// Generated by jax_padsafe/kernels/build.py: do not edit.", "#pragma once",
            '#include "jps_fwd_args.h"', '#include "jps_zero_rows.h"']
    body += [_zero_rows_adapter(z) for z in built]
    body.append("static const JpsZeroRowsKernel kJpsZeroRowsKernels[] = {")
    for z in built:
        body.append(f"  {{{V.ARCH_CODE[z.arch]}, {z.num_outputs}, &{z.prefix}_module, &{z.prefix}_load, "
                    f"&{z.prefix}_launch}},")
    if not built:
        body.append("  {0, 0, 0, 0, 0},")
    body.append("};")
    body.append(f"static const int kJpsNumZeroRowsKernels = {len(built)};")
    with open(os.path.join(out, "jps_zero_rows_registry.h"), "w") as f:
        f.write("\n".join(body) + "\n")


def write_registry(out: str, built, extra_objects=()):
    """jps_registry.h for the forward variants `built`; objects.txt lists their objects and `extra_objects`'."""
    body = [
        "// Generated by jax_padsafe/kernels/build.py: do not edit.",
        "#pragma once",
        '#include "jps_fwd_args.h"',
    ]
    body += [_adapter(v) for v in built]
    body.append("static const JpsFwdVariant kJpsFwdVariants[] = {")
    for v in built:
        body.append(
            f"  {{{V.ARCH_CODE[v.arch]}, {V.DTYPE_CODE[v.dtype]}, {v.head_dim}, {int(v.softcap)}, "
            f"{v.tile[0]}, &{v.prefix}_module, &{v.prefix}_load, &{v.prefix}_launch, \"{v.prefix}\", "
            f"{V.FAMILY_CODE[v.family]}}},"
        )
    body.append("};")
    body.append(f"static const int kJpsNumFwdVariants = {len(built)};")
    with open(os.path.join(out, "jps_registry.h"), "w") as f:
        f.write("\n".join(body) + "\n")
    with open(os.path.join(out, "objects.txt"), "w") as f:
        f.write("\n".join(v.prefix + ".o" for v in list(built) + list(extra_objects)) + "\n")


def _csv(s, conv=str):
    return tuple(conv(x) for x in s.split(",") if x.strip())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=os.environ.get("JPS_ARCHS", ",".join(V.ARCHS)))
    ap.add_argument("--dtypes", default=os.environ.get("JPS_DTYPES", ",".join(V.DTYPES)))
    ap.add_argument("--head-dims", default=os.environ.get("JPS_HEAD_DIMS", ",".join(map(str, V.HEAD_DIMS))))
    ap.add_argument("--softcap", default=os.environ.get("JPS_SOFTCAP", "0,1"))
    ap.add_argument("--sm90", type=int, default=int(os.environ.get("JPS_SM90", "1")),
                    help="1: also build the sm90 (TMA + wgmma) kernel family for sm_90a")
    ap.add_argument("--out", default="build/kernels")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("JPS_JOBS", os.cpu_count() or 1)))
    a = ap.parse_args(argv)
    _apply_tile_overrides()
    os.makedirs(a.out, exist_ok=True)
    todo = V.matrix(
        _csv(a.archs), _csv(a.dtypes), _csv(a.head_dims, int), _csv(a.softcap, lambda x: bool(int(x))),
        sm90=bool(a.sm90),
    )
    todo += V.zero_rows_kernels(_csv(a.archs), sm90=bool(a.sm90))
    out = os.path.abspath(a.out)
    built = []
    t0 = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=ctx) as ex:
        for v, dt in ex.map(_compile_one, [(v, out) for v in todo]):
            print(f"  built {v.prefix} ({dt:.1f} s)", flush=True)
            built.append(v)
    variants = [v for v in built if isinstance(v, V.FwdVariant)]
    zero_rows = [v for v in built if isinstance(v, V.ZeroRowsKernel)]
    write_registry(out, variants, extra_objects=zero_rows)
    write_zero_rows_registry(out, zero_rows)
    print(f"{len(variants)} variants and {len(zero_rows)} row-zeroing kernels in {time.time() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
