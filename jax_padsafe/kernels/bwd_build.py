"""Ahead-of-time build of the backward kernels (no GPU needed); companion of `build.py`.

    python -m jax_padsafe.kernels.bwd_build --out build/kernels [--archs sm_80,sm_90a] [--dtypes bf16]
        [--head-dims 64,128] [--softcap 0,1] [--jobs 2]

Same environment overrides as build.py (JPS_ARCHS, JPS_DTYPES, JPS_HEAD_DIMS, JPS_SOFTCAP, JPS_JOBS);
head dims default to `BWD_HEAD_DIMS` (the backward's supported set).  JPS_SM90_BWD=1 (--sm90-bwd 1) also
builds the Hopper TMA + wgmma backward family (bwd_sm90: dK/dV and dQ kernels; the preprocess stays
bwd_sm80's) for sm_90a and the head dims in `SM90_BWD_TILES` (all of them); the handler prefers it on compute
capability 9.0 (JAX_PADSAFE_SM90_BWD=0 at run time opts out).  On by default since it passed
tests/gpu/check_backward.py on an H100 (every head dim, bf16/fp16; benchmarks/NOTES_sm90_bwd.md); JPS_SM90_BWD=0
builds without it.  JPS_SM90_BWD_TILES="128=64x128x3,128x64x2" overrides its tiles (dK/dV, dQ:
block_m x block_n x stages) for experiments, JPS_SM90_BWD_DQ="regs=1,overlap=1" the dQ kernel's options
(`SM90_BWD_DQ_OPTS`), JPS_SM90_BWD_QUEUE=0 their compact schedules with one CTA per tile (`sm90_tile_queue`).
JPS_SM90F_BWD=1 (--sm90f-bwd 1, the default) also builds the fused-dQ family `sm90f` for sm_90a at the head
dims in `SM90F_BWD_TILES` (5 GEMMs: dQ = dS K accumulated in fp32 by the dK/dV kernel in a fixed order, then
converted; its `_dkdv` export takes the accumulator and semaphores, its `_dq` export is the conversion); the
handler uses it only when the caller passes its workspace (JAX_PADSAFE_FUSED_DQ=1 at run time, opt-in).
Per variant three kernels are exported (`<prefix>_pre`, `<prefix>_dkdv`, `<prefix>_dq`), or four for the
SM80-class family at head dims above `SPLIT_DKDV_ABOVE` (`<prefix>_pre`, `<prefix>_dv`, `<prefix>_dk`,
`<prefix>_dq`: the dK/dV kernel compiled as a dV-only and a dK-only pass, launched one after the other);
then `jps_bwd_registry.h` (launch adapters + the table `kJpsBwdVariants`) and `bwd_objects.txt` are
written, which ffi/CMakeLists.txt links in (ffi/jps_bwd.cc) when present.
"""

import argparse
import concurrent.futures as cf
import os
import sys
import time
from dataclasses import dataclass

from . import variants as V

BWD_HEAD_DIMS = (64, 96, 128, 192, 256)
# (block_m, block_n, num_threads) of the dK/dV kernel and of the dQ kernel.  Each warp owns 16 rows of
# the accumulators (dK and dV: 16 x HD each; dQ: 16 x HD), which live in registers.
# H100, 2026-11-22 (benchmarks/RESULTS.md, double-buffered kernels): 8-warp tiles dkdv=64x128x256 were
# 6-10% slower end to end, dq=128x64x256 equal within noise, so 4 warps stay the default.
BWD_TILES = {
    64: ((64, 64, 128), (64, 64, 128)),
    96: ((64, 64, 128), (64, 64, 128)),
    128: ((64, 64, 128), (64, 64, 128)),
    # hd192/256 (dK/dV in two passes): 32 query rows per dK/dV step and 32 keys per dQ step keep the S / dP
    # fragments small next to the 16 x HD accumulator.  ptxas (13.0, sm_90a, bf16): 0 spills for the dV and
    # dK passes and dQ (hd256 dQ with softcap: 16 B), where 64 x 64 tiles spilled 184 B (dK pass, softcap)
    # and 392-448 B (dQ).  Shared memory 128 KB per block in every kernel (dV pass 96 KB), 2 stages on both
    # sm_80 (163 KB allowed) and sm_90a.
    192: ((32, 64, 128), (64, 32, 128)),
    256: ((32, 64, 128), (64, 32, 128)),
}
# Above this head dim the SM80-class dK/dV kernel runs as two passes (dV only, then dK only): dK and dV
# together would need 2 x 16 x HD fp32 accumulators per warp, 2 x HD / 2 registers per thread (256 at hd256).
SPLIT_DKDV_ABOVE = 128
# Shared-memory stages of the streamed operands, (dK/dV kernel: Q/dO, dQ kernel: K/V), per (arch, head dim)
# where not 2.  Shared memory per block (bf16/fp16, 2 stages): dK/dV 2 x 2 x block_m x HD x 2 B (Q, dO) +
# 2 x block_n x HD x 2 B (K, V); dQ 2 x block_m x HD x 2 B + 2 x 2 x block_n x HD x 2 B.  With the tiles
# above every variant fits sm_80's 163 KB per block (hd256: 128 KB), so none needs one stage today; one
# stage (load, then compute) compiles but no default variant uses it and it has not run on a GPU.
BWD_STAGES = {}


# sm90 family: ((block_m, block_n, stages) of the dK/dV kernel, (block_m, block_n, stages) of the dQ kernel);
# 2 consumer warpgroups x 64 rows of the resident tile (dK/dV: keys, dQ: queries).  A dK/dV block_n of 64
# (hd192/256) selects the head-dim split (BwdDKDVSm90.split_head_dim): dK and dV of 64 keys x HD per
# warpgroup would need HD fp32 registers per thread, so each warpgroup keeps half of the head dim; warpgroup 0
# computes S^T / P^T and warpgroup 1 dP^T / dS^T, swapped through shared memory.  hd256's dQ kernel streams
# 32-key K/V tiles (Q + dO resident: 128 KB).  Shared memory per block: hd256 dK/dV 216 KB, hd256 dQ and
# hd192 dQ 192 KB, hd192 dK/dV 168 KB (3 stages measured equal).
# H100, 2026-11-23 (check_backward hd64 30/30, hd96 26/26, hd192 + hd256 64/64): fwd+bwd 1.4-2.3x the SM80-class
# backward; hd64 64x128x3 / 128x128x2 measured equal within 2% (benchmarks/NOTES_sm90_bwd.md, session 7).
SM90_BWD_TILES = {
    64: ((64, 128, 2), (128, 64, 2)),
    96: ((64, 128, 2), (128, 64, 2)),
    128: ((64, 128, 2), (128, 64, 2)),
    192: ((64, 64, 2), (128, 64, 2)),
    256: ((64, 64, 2), (128, 32, 2)),
}
# sm90 dQ kernel options per (head dim, softcap) (bwd_sm90.BwdDQSm90): "regs" = Q and dO in registers
# (operands_in_regs), "overlap" = S / dP of the next key tile issued before dQ of the current one
# (overlap_steps, needs >= 3 dQ stages).  Off everywhere: on the H100 (session 8, hd128 bf16, bitwise
# identical gradients) neither changed forward+backward by more than the run-to-run noise (+-2%); Nsight
# Compute shows the dQ kernel at ~69% tensor-pipe use already (~620 TFLOP/s executed), the dK/dV kernel is
# the slower one (benchmarks/NOTES_sm90_bwd.md).  JPS_SM90_BWD_DQ="regs=1,overlap=1" (with 3 dQ stages in
# JPS_SM90_BWD_TILES) turns them on for experiments.
SM90_BWD_DQ_OPTS = {}


def sm90_dq_opts(head_dim: int, softcap: bool) -> dict:
    env = os.environ.get("JPS_SM90_BWD_DQ", "")
    if env:
        cfg = dict(item.split("=") for item in env.split(",") if item.strip())
        return dict(operands_in_regs=bool(int(cfg.get("regs", 0))), overlap_steps=bool(int(cfg.get("overlap", 0))))
    return dict(SM90_BWD_DQ_OPTS.get((head_dim, softcap), {}))


def sm90_pin_waits(head_dim: int) -> bool:
    """`pin_waits` of the sm90 family's two kernels: the wait for dP (dP^T) issued only after P (P^T in the
    input dtype) is formed (sm90_common.wgmma_wait_after), which ptxas otherwise hoists.  On the H100 (session
    10, gradients bitwise identical, benchmarks/NOTES_sm90_bwd.md): forward+backward hd128 +2-3% at 2k and 8k,
    causal and not; hd64 / hd96 2-3% slower, hd192 / hd256 within +-1.5%.  Hence head dim 128 only.
    JPS_SM90_BWD_PIN=0/1 overrides it for experiments.  (The opt-in fused-dQ family keeps it off: not timed.)"""
    env = os.environ.get("JPS_SM90_BWD_PIN", "")
    return bool(int(env)) if env else head_dim == 128


def sm90_tile_queue() -> bool:
    """`dynamic_compact` of the sm90 family's two kernels: their compact schedules (packed batches whose dense
    grid would be mostly empty tiles) run persistent CTAs that claim tiles from a counter (tile_queue), as the
    forward's do, instead of one CTA per tile (benchmarks/NOTES_sm90_bwd.md, session 20).  JPS_SM90_BWD_QUEUE=0
    builds the one-tile CTAs for A/B runs, JPS_SM90_BWD_QUEUE=nostage the queue without the staging tiles that
    let a tile's resident operands go before its epilogue (`stage_out`); the dense schedules are the same
    either way."""
    return os.environ.get("JPS_SM90_BWD_QUEUE", "1") != "0"


# Head dims whose sm90 dK/dV and dQ kernels run every layout, dense ones too, through the tile queue
# (`queue_dense`; benchmarks/NOTES_sm90_bwd.md, session 21).  Per-kernel times on 8 x 2048 tokens (H100, causal
# and not, queued against one CTA per dense tile): dK/dV hd128 -7 to -8%, hd192 -7 to -8%, hd256 -11 to -12%, but
# hd64 +2 to +5% and hd96 +1%; dQ hd64 -5 to -8%, hd128 -1 to -3%, hd192 -1 to -4%, hd256 -3 to -4%, but hd96
# +1 to +4%.  Where the queue lost, the kernel keeps one CTA per dense tile.
SM90_DENSE_QUEUE = {"dkdv": (128, 192, 256), "dq": (64, 128, 192, 256)}


def sm90_dense_queue(head_dim: int) -> tuple:
    """(dK/dV, dQ) `queue_dense` of the sm90 family at `head_dim`.  JPS_SM90_BWD_DENSE_QUEUE=0 turns it off,
    =all on for both kernels at every head dim (A/B builds); it needs the queue itself (sm90_tile_queue)."""
    env = os.environ.get("JPS_SM90_BWD_DENSE_QUEUE", "")
    if env == "0" or not sm90_tile_queue():
        return (False, False)
    if env == "all":
        return (True, True)
    return (head_dim in SM90_DENSE_QUEUE["dkdv"], head_dim in SM90_DENSE_QUEUE["dq"])


# sm90f family (fused dQ, 5 GEMMs): the dK/dV kernel's (block_m, block_n, stages); it also computes dS K per
# step and adds it into a zero-filled fp32 dQ accumulator in key-tile order (bwd_sm90.BwdDKDVQSm90), and a
# conversion kernel writes dQ (bwd_sm90.DqConvertSm90).  Needs the caller's fp32 workspace (jps_bwd.cc);
# the handler prefers it over the sm90 family when the workspace is there.  JPS_SM90F_BWD=0 builds without.
SM90F_BWD_TILES = {128: (64, 128, 2)}


def _apply_sm90_tile_overrides():
    """JPS_SM90_BWD_TILES="128=64x128x3,128x64x2" (head_dim=dKdV BMxBNxSTAGES,dQ BMxBNxSTAGES; ';' between
    head dims) for tile experiments of the sm90 family."""
    for item in os.environ.get("JPS_SM90_BWD_TILES", "").split(";"):
        if item.strip():
            hd, cfg = item.split("=")
            dkdv, dq = (tuple(int(x) for x in part.split("x")) for part in cfg.split(","))
            SM90_BWD_TILES[int(hd)] = (dkdv, dq)


def _apply_tile_overrides():
    """JPS_BWD_TILES="dkdv=64x128x256,dq=128x64x256" (all head dims) for tile experiments."""
    _apply_sm90_tile_overrides()
    cfg = dict(item.split("=") for item in os.environ.get("JPS_BWD_TILES", "").split(",") if item.strip())
    if cfg:
        for h in BWD_TILES:
            dkdv, dq = BWD_TILES[h]
            dkdv = tuple(int(x) for x in cfg["dkdv"].split("x")) if "dkdv" in cfg else dkdv
            dq = tuple(int(x) for x in cfg["dq"].split("x")) if "dq" in cfg else dq
            BWD_TILES[h] = (dkdv, dq)


@dataclass(frozen=True)
class BwdVariant:
    arch: str
    dtype: str
    head_dim: int
    softcap: bool
    family: str = "sm80"

    @property
    def prefix(self) -> str:
        fam = "" if self.family == "sm80" else f"{self.family}k_"
        return f"jps_bwd_{fam}{self.arch}_{self.dtype}_hd{self.head_dim}_{'cap' if self.softcap else 'nocap'}"

    @property
    def tile(self):
        if self.family == "sm90f":
            return SM90F_BWD_TILES[self.head_dim], None
        return SM90_BWD_TILES[self.head_dim] if self.family == "sm90" else BWD_TILES[self.head_dim]

    @property
    def stages(self):
        """(dK/dV stages, dQ stages) of the SM80-class family."""
        return BWD_STAGES.get((self.arch, self.head_dim), (2, 2))

    @property
    def split(self) -> bool:
        """True: the dK/dV kernel is exported as a dV pass (`_dv`) and a dK pass (`_dk`)."""
        return self.family == "sm80" and self.head_dim > SPLIT_DKDV_ABOVE

    @property
    def kinds(self):
        """The exported kernels, in launch order."""
        return ("pre", "dv", "dk", "dq") if self.split else ("pre", "dkdv", "dq")


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
    from .bwd_sm80 import BwdDKDV, BwdDQ, BwdPreprocess

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[variant.dtype]
    H = variant.head_dim
    (bm, bn, nt), dq_tile = variant.tile
    sym = cute.sym_int
    opts = f"--gpu-arch {variant.arch}"

    def x3():
        return make_fake_compact_tensor(dt, (sym(), sym(), H), stride_order=(2, 1, 0), assumed_align=16)

    def f2():
        return make_fake_compact_tensor(cutlass.Float32, (sym(), sym()), stride_order=(1, 0), assumed_align=4)

    def i1():
        return make_fake_compact_tensor(cutlass.Int32, (sym(),), assumed_align=4)

    t0 = time.time()
    p = variant.prefix
    pre = cute.compile(BwdPreprocess(dt, H), x3(), x3(), f2(), f2(), f2(), i1(), i1(), 0, make_fake_stream(),
                       options=opts)
    pre.export_to_c(out, p + "_pre", function_prefix=p + "_pre")
    if variant.family == "sm90f":
        from .bwd_sm90 import BwdDKDVQSm90, DqConvertSm90

        f3 = lambda: make_fake_compact_tensor(cutlass.Float32, (sym(), sym(), H), stride_order=(2, 1, 0),  # noqa: E731
                                              assumed_align=16)
        ordered = os.environ.get("JPS_SM90F_UNORDERED", "0") != "1"
        dkdv = cute.compile(BwdDKDVQSm90(dt, H, bm, bn, nt, variant.softcap, ordered), x3(), x3(), x3(), x3(), f2(),
                            f2(), x3(), x3(), f3(), i1(), i1(), i1(), i1(), i1(), 1.0, 1.0, 1.0, 0, 0, 0, 1,
                            make_fake_stream(), options=opts)
        dkdv.export_to_c(out, p + "_dkdv", function_prefix=p + "_dkdv")
        conv = cute.compile(DqConvertSm90(dt, H), f3(), x3(), 1.0, make_fake_stream(), options=opts)
        conv.export_to_c(out, p + "_dq", function_prefix=p + "_dq")
        return variant, time.time() - t0, 0
    (bm_q, bn_q, nt_q) = dq_tile
    if variant.family == "sm90":
        from .bwd_sm90 import BwdDKDVSm90, BwdDQSm90

        # Same call arguments and exported ABI as the SM80-class kernels; the constructors take
        # (dtype, head_dim, block_m, block_n, stages, softcap): the tile's third entry is a stage count here.
        pin = sm90_pin_waits(H)
        queue = dict(dynamic_compact=sm90_tile_queue(), stage_out=os.environ.get("JPS_SM90_BWD_QUEUE") != "nostage")
        dense_dkdv, dense_dq = sm90_dense_queue(H)
        passes = {"dkdv": BwdDKDVSm90(dt, H, bm, bn, nt, variant.softcap, pin_waits=pin, queue_dense=dense_dkdv,
                                      **queue)}
        dq_kernel = BwdDQSm90(dt, H, bm_q, bn_q, nt_q, variant.softcap, pin_waits=pin, queue_dense=dense_dq,
                              **queue, **sm90_dq_opts(H, variant.softcap))
    else:
        st_kv, st_q = variant.stages
        # One kernel class; the split variants compile it twice with a compile-time output selector.
        passes = {kind: BwdDKDV(dt, H, bm, bn, nt, variant.softcap, stages=st_kv, outputs=kind)
                  for kind in variant.kinds if kind in ("dkdv", "dv", "dk")}
        dq_kernel = BwdDQ(dt, H, bm_q, bn_q, nt_q, variant.softcap, stages=st_q)
    # sm90: one more int32 tensor after seqused_k, the kernel's tile counter (_KERNELS_SM90).
    counter = (i1(),) if variant.family == "sm90" else ()
    for kind, kern in passes.items():
        dkdv = cute.compile(kern, x3(), x3(), x3(), x3(), f2(), f2(), x3(), x3(), i1(), i1(), i1(), i1(), *counter,
                            1.0, 1.0, 1.0, 0, 0, 0, 1, make_fake_stream(), options=opts)
        dkdv.export_to_c(out, f"{p}_{kind}", function_prefix=f"{p}_{kind}")
    dq = cute.compile(dq_kernel, x3(), x3(), x3(), x3(), f2(), f2(), x3(), i1(), i1(), i1(), i1(), *counter,
                      1.0, 1.0, 1.0, 0, 0, 0, 1, make_fake_stream(), options=opts)
    dq.export_to_c(out, p + "_dq", function_prefix=p + "_dq")
    # Which kernels were compiled to queue every layout, read off the kernel objects themselves: the registry's
    # queue_all (the handler's cue to zero their tile counters on every call) then cannot disagree with them.
    queue_all = sum(bit for bit, k in ((1, passes.get("dkdv")), (2, dq_kernel)) if getattr(k, "queue_dense", False))
    return variant, time.time() - t0, queue_all


# Tensor structs of each export: (parameter name, C expression of the struct initialiser).
_Q = "{a->%s, {a->total_q, a->num_heads}, {(int64_t)a->num_heads * a->head_dim}}"
_K = "{a->%s, {a->total_k, a->num_kv_heads}, {(int64_t)a->num_kv_heads * a->head_dim}}"
_R = "{a->%s, {a->num_heads, a->total_q}, {(int64_t)a->total_q}}"
_CU = "{a->%s, {a->batch + 1}}"
_US = "{a->%s, {a->batch}}"
_KERNELS = {
    "pre": [("mO", _Q % "o"), ("mdO", _Q % "dout"), ("mLSE", _R % "lse"), ("mdLSE", _R % "dlse"),
            ("mDelta", _R % "delta"), ("mCuQ", _CU % "cu_q"), ("mUsedQ", _US % "used_q")],
    "dkdv": [("mQ", _Q % "q"), ("mK", _K % "k"), ("mV", _K % "v"), ("mdO", _Q % "dout"), ("mLSE", _R % "lse"),
             ("mDelta", _R % "delta"), ("mdK", _K % "dk"), ("mdV", _K % "dv"), ("mCuQ", _CU % "cu_q"),
             ("mCuK", _CU % "cu_k"), ("mUsedQ", _US % "used_q"), ("mUsedK", _US % "used_k")],
    "dq": [("mQ", _Q % "q"), ("mK", _K % "k"), ("mV", _K % "v"), ("mdO", _Q % "dout"), ("mLSE", _R % "lse"),
           ("mDelta", _R % "delta"), ("mdQ", _Q % "dq"), ("mCuQ", _CU % "cu_q"), ("mCuK", _CU % "cu_k"),
           ("mUsedQ", _US % "used_q"), ("mUsedK", _US % "used_k")],
}
_SCALARS = {
    "pre": "a->max_seqlen_q",
    "dkdv": "a->score_mul, a->cap_mul, a->dscale, a->window_left, a->window_right, a->bottom_right, a->max_seqlen_k",
    "dq": "a->score_mul, a->cap_mul, a->dscale, a->window_left, a->window_right, a->bottom_right, a->max_seqlen_q",
}
# The dV and dK passes of a split variant have the dK/dV kernel's signature.
_KERNELS["dv"] = _KERNELS["dk"] = _KERNELS["dkdv"]
_SCALARS["dv"] = _SCALARS["dk"] = _SCALARS["dkdv"]
# sm90f: the dK/dV kernel also takes the fp32 dQ accumulator and the semaphores; "dq" is the conversion.
_ACC = "{a->dq_accum, {a->total_q, a->num_heads}, {(int64_t)a->num_heads * a->head_dim}}"
_SEM = "{a->dq_sem, {a->dq_sem_count}}"
_KERNELS_FUSED = dict(_KERNELS, dkdv=_KERNELS["dkdv"][:8] + [("mdQacc", _ACC), ("mSem", _SEM)] + _KERNELS["dkdv"][8:],
                      dq=[("mAcc", _ACC), ("mdQ", _Q % "dq")])
_SCALARS_FUSED = dict(_SCALARS, dq="a->dscale")
# sm90: both kernels also take their compact schedule's tile counter (bwd_sm90 via tile_queue), after mUsedK.
_KERNELS_SM90 = dict(_KERNELS, dkdv=_KERNELS["dkdv"] + [("mTileCounter", "{a->tile_counters, {1}}")],
                     dq=_KERNELS["dq"] + [("mTileCounter", "{a->tile_counters + 1, {1}}")])


def _adapter(v: BwdVariant) -> str:
    lines = []
    kernels, scalars = {"sm90f": (_KERNELS_FUSED, _SCALARS_FUSED), "sm90": (_KERNELS_SM90, _SCALARS)}.get(
        v.family, (_KERNELS, _SCALARS))
    for kind in v.kinds:
        tensors = kernels[kind]
        p = f"{v.prefix}_{kind}"
        lines.append(f'#include "{p}.h"')
        lines.append(f"static int32_t {p}_launch(void *module, const JpsBwdArgs *a, cudaStream_t s) {{")
        for name, init in tensors:
            lines.append(f"  {p}_Tensor_{name}_t {name} = {init};")
        refs = ", ".join("&" + n for n, _ in tensors)
        lines.append(f"  return cute_dsl_{p}_wrapper(({p}_Kernel_Module_t *)module, {refs}, {scalars[kind]}, s);")
        lines.append("}")
        lines.append(f"static {p}_Kernel_Module_t {p}_module;")
    p = v.prefix
    loads = " ".join(f"{p}_{kind}_Kernel_Module_Load(&{p}_{kind}_module);" for kind in v.kinds)
    lines.append(f"static void {p}_load(void) {{ {loads} }}")
    return "\n".join(lines)


def write_registry(out: str, built, queue_all=None):
    """Write jps_bwd_registry.h and bwd_objects.txt for the compiled variants `built`.  `queue_all` maps a
    variant's prefix to the queue bits its compiled kernels report (`_compile_one`); a variant it does not name
    takes the build policy's (`sm90_dense_queue`, as the kernels would be compiled under this environment)."""
    queue_all = queue_all or {}
    body = ["// Generated by jax_padsafe/kernels/bwd_build.py: do not edit.", "#pragma once",
            '#include "jps_bwd_args.h"']
    body += [_adapter(v) for v in built]
    body.append("static const JpsBwdVariant kJpsBwdVariants[] = {")
    for v in built:
        p = v.prefix
        # dkdv = the first dK/dV launch (both outputs, or the dV pass); dk = the dK pass or null.
        first, second = ("dv", f"&{p}_dk_module, &{p}_dk_launch") if v.split else ("dkdv", "0, 0")
        # The sm90 kernels' tiles, and which of them queue every layout (1: dK/dV, 2: dQ), decide whether the
        # handler zeroes their tile counters (jps_bwd.cc).
        queued = queue_all.get(p, sum(bit for bit, on in zip((1, 2), sm90_dense_queue(v.head_dim)) if on))
        blocks = f"{v.tile[0][1]}, {v.tile[1][0]}, {queued}" if v.family == "sm90" else "0, 0, 0"
        body.append(
            f"  {{{V.ARCH_CODE[v.arch]}, {V.DTYPE_CODE[v.dtype]}, {v.head_dim}, {int(v.softcap)}, &{p}_load, "
            f"&{p}_pre_module, &{p}_pre_launch, &{p}_{first}_module, &{p}_{first}_launch, &{p}_dq_module, "
            f"&{p}_dq_launch, \"{p}\", {V.FAMILY_CODE[v.family]}, {second}, {blocks}}},"
        )
    if not built:
        body.append("  {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \"none\", 0, 0, 0, 0, 0, 0},")
    body.append("};")
    body.append(f"static const int kJpsNumBwdVariants = {len(built)};")
    with open(os.path.join(out, "jps_bwd_registry.h"), "w") as f:
        f.write("\n".join(body) + "\n")
    with open(os.path.join(out, "bwd_objects.txt"), "w") as f:
        f.write("\n".join(f"{v.prefix}_{k}.o" for v in built for k in v.kinds) + "\n")


def _csv(s, conv=str):
    return tuple(conv(x) for x in s.split(",") if x.strip())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=os.environ.get("JPS_ARCHS", ",".join(V.ARCHS)))
    ap.add_argument("--dtypes", default=os.environ.get("JPS_DTYPES", ",".join(V.DTYPES)))
    ap.add_argument("--head-dims", default=os.environ.get("JPS_HEAD_DIMS", ",".join(map(str, BWD_HEAD_DIMS))))
    ap.add_argument("--softcap", default=os.environ.get("JPS_SOFTCAP", "0,1"))
    ap.add_argument("--sm90-bwd", type=int, default=int(os.environ.get("JPS_SM90_BWD", "1")),
                    help="1: also build the sm90 (TMA + wgmma) backward family for sm_90a")
    ap.add_argument("--sm90f-bwd", type=int, default=int(os.environ.get("JPS_SM90F_BWD", "1")),
                    help="1: also build the fused-dQ sm90 backward family (5 GEMMs, fp32 dQ accumulator)")
    ap.add_argument("--out", default="build/kernels")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("JPS_JOBS", os.cpu_count() or 1)))
    a = ap.parse_args(argv)
    _apply_tile_overrides()
    print(f"backward tiles (block_m, block_n, threads) dkdv / dq: {BWD_TILES}; stages where not 2 (dkdv, dq): "
          f"{BWD_STAGES}; dK/dV in two passes above hd{SPLIT_DKDV_ABOVE}", flush=True)
    if a.sm90_bwd:
        print(f"sm90 backward tiles (block_m, block_n, stages) dkdv / dq: {SM90_BWD_TILES}; dQ options: "
              f"{os.environ.get('JPS_SM90_BWD_DQ') or SM90_BWD_DQ_OPTS}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    todo = [BwdVariant(ar, d, h, c) for ar in _csv(a.archs) for d in _csv(a.dtypes)
            for h in _csv(a.head_dims, int) if h in BWD_TILES for c in _csv(a.softcap, lambda x: bool(int(x)))]
    if a.sm90_bwd and "sm_90a" in _csv(a.archs):
        todo += [BwdVariant("sm_90a", d, h, c, "sm90") for d in _csv(a.dtypes) for h in _csv(a.head_dims, int)
                 if h in SM90_BWD_TILES for c in _csv(a.softcap, lambda x: bool(int(x)))]
    if a.sm90f_bwd and "sm_90a" in _csv(a.archs):
        todo += [BwdVariant("sm_90a", d, h, c, "sm90f") for d in _csv(a.dtypes) for h in _csv(a.head_dims, int)
                 if h in SM90F_BWD_TILES for c in _csv(a.softcap, lambda x: bool(int(x)))]
    out = os.path.abspath(a.out)
    built, queue_all = [], {}
    t0 = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=ctx) as ex:
        for v, dt, queued in ex.map(_compile_one, [(v, out) for v in todo]):
            print(f"  built {v.prefix} ({dt:.1f} s)", flush=True)
            built.append(v)
            queue_all[v.prefix] = queued
    write_registry(out, built, queue_all)
    print(f"{len(built)} backward variants in {time.time() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
