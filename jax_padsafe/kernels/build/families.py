"""What each kernel family compiles: the kernel objects of a variant, the fake (symbolic) arguments they are
traced with, and the parameter list of every exported kernel, from which `registry.py` writes the C++ launch
adapters. A kernel's `__call__` signature, its fake arguments here and its `Signature` here change together.

`compile_variant` runs in a build worker process (`__main__.py`); it needs nvidia-cutlass-dsl and no GPU.
"""

import os
import time
from dataclasses import dataclass

from .variants import Variant, ZeroRowsKernel, dbias_tile, sm80_fwd_stages, sm90_dbias


@dataclass(frozen=True)
class Tensor:
    """A tensor parameter of an exported kernel. Its C struct is `<export>_Tensor_<name>_t`
    (`{data, int32 dynamic_shapes[shapes], int64 dynamic_strides[strides]}`)."""
    name: str  # the parameter's name in the kernel's __call__
    init: str  # C initialiser of the struct, from the handler's argument struct `a`
    var: str = ""  # the adapter's local variable (default: `name`)
    shapes: int = 0  # dynamic shapes and strides of the struct (checked with static_asserts where given)
    strides: int = 0

    @property
    def local(self) -> str:
        return self.var or self.name


@dataclass(frozen=True)
class Signature:
    tensors: tuple  # Tensor parameters, in call order
    scalars: str  # C expressions of the scalar parameters that follow them (the stream comes last)


# C initialisers from JpsFwdArgs / JpsBwdArgs: [total_q, N, H] and [total_k, K, H] tensors (H static), [N, total_q]
# float32 rows, cu_seqlens [B + 1] and seqused [B]; the forward's attention sinks, float32 [N] or [0] (none).
_Q = "{a->%s, {a->total_q, a->num_heads}, {(int64_t)a->num_heads * a->head_dim}}"
_K = "{a->%s, {a->total_k, a->num_kv_heads}, {(int64_t)a->num_kv_heads * a->head_dim}}"
_R = "{a->%s, {a->num_heads, a->total_q}, {(int64_t)a->total_q}}"
_CU = "{a->%s, {a->batch + 1}}"
_US = "{a->%s, {a->batch}}"

_FWD = (
    Tensor("mQ", _Q % "q", "q", 2, 1), Tensor("mK", _K % "k", "k", 2, 1), Tensor("mV", _K % "v", "v", 2, 1),
    Tensor("mO", _Q % "o", "o", 2, 1), Tensor("mLSE", _R % "lse", "lse", 2, 1),
    Tensor("mSinks", "{a->sinks, {a->num_sinks}}", "snk", 1), Tensor("mCuQ", _CU % "cu_q", "cuq", 1), Tensor("mCuK", _CU % "cu_k", "cuk", 1),
    Tensor("mUsedQ", _US % "used_q", "uq", 1), Tensor("mUsedK", _US % "used_k", "uk", 1),
)
_FWD_SCALARS = "a->score_mul, a->cap_mul, a->window_left, a->window_right, a->bottom_right, a->max_seqlen_q"

_BWD = {
    "pre": Signature((Tensor("mO", _Q % "o"), Tensor("mdO", _Q % "dout"), Tensor("mLSE", _R % "lse"),
                      Tensor("mdLSE", _R % "dlse"), Tensor("mDelta", _R % "delta"), Tensor("mCuQ", _CU % "cu_q"),
                      Tensor("mUsedQ", _US % "used_q")), "a->max_seqlen_q"),
    "dkdv": Signature((Tensor("mQ", _Q % "q"), Tensor("mK", _K % "k"), Tensor("mV", _K % "v"),
                       Tensor("mdO", _Q % "dout"), Tensor("mLSE", _R % "lse"), Tensor("mDelta", _R % "delta"),
                       Tensor("mdK", _K % "dk"), Tensor("mdV", _K % "dv"), Tensor("mCuQ", _CU % "cu_q"),
                       Tensor("mCuK", _CU % "cu_k"), Tensor("mUsedQ", _US % "used_q"),
                       Tensor("mUsedK", _US % "used_k")),
                      "a->score_mul, a->cap_mul, a->dscale, a->window_left, a->window_right, a->bottom_right, "
                      "a->max_seqlen_k"),
    "dq": Signature((Tensor("mQ", _Q % "q"), Tensor("mK", _K % "k"), Tensor("mV", _K % "v"),
                     Tensor("mdO", _Q % "dout"), Tensor("mLSE", _R % "lse"), Tensor("mDelta", _R % "delta"),
                     Tensor("mdLSE", _R % "dlse"), Tensor("mdQ", _Q % "dq"), Tensor("mCuQ", _CU % "cu_q"), Tensor("mCuK", _CU % "cu_k"),
                     Tensor("mUsedQ", _US % "used_q"), Tensor("mUsedK", _US % "used_k")),
                    "a->score_mul, a->cap_mul, a->dscale, a->window_left, a->window_right, a->bottom_right, "
                    "a->max_seqlen_q, a->partial_keys"),
}
# The dV and dK passes of a split sm80 variant have the dK/dV kernel's signature.
_BWD["dv"] = _BWD["dk"] = _BWD["dkdv"]
# The sm90 family's kernels also take the tile counter of their compact schedule's queue, after seqused_k:
# the forward JpsFwdArgs.tile_counter, the backward's dK/dV kernel JpsBwdArgs.tile_counters[0], its dQ kernel [1].
_FWD_SM90 = _FWD + (Tensor("mTileCounter", "{a->tile_counter, {1}}", "tc", 1),)
_BWD_SM90 = dict(_BWD, dkdv=Signature(_BWD["dkdv"].tensors + (Tensor("mTileCounter", "{a->tile_counters, {1}}"),),
                                      _BWD["dkdv"].scalars),
                 dq=Signature(_BWD["dq"].tensors + (Tensor("mTileCounter", "{a->tile_counters + 1, {1}}"),),
                              _BWD["dq"].scalars))
# The aux variants (masks and biases as tensors, kernels/common/aux_scores.py) append, after every other tensor:
# the mask (Uint8), the bias in the input dtype and in float32 (each [Bx, Hx, Tx, S]), the mask's block map
# [Bx, Hx, Mx, Nx] and its row ranges [Bx, Hx, Mx, 2] (forward, dQ) or column ranges [Bx, Hx, Nx, 2] (dK/dV), and
# the forward's exact row statistics (row max, ln of the row sum; [N, total_q] float32), the ALiBi slopes
# [Bx, N, 1, 1] float32; and the scalar aux_flags after every other scalar.
_A4 = "{a->%s, {a->%s[0], a->%s[1], a->%s[2], a->%s[3]}, {%s}}"


def _aux4(name: str, ptr: str, dims: str) -> Tensor:
    strides = f"(int64_t)a->{dims}[1] * a->{dims}[2] * a->{dims}[3], (int64_t)a->{dims}[2] * a->{dims}[3], " \
              f"(int64_t)a->{dims}[3]"
    return Tensor(name, _A4 % (ptr, dims, dims, dims, dims, strides), ptr, 4, 3)


def _aux_tensors(ranges: str) -> tuple:
    rng = "row_range" if ranges == "rows" else "col_range"
    return (_aux4("mMask", "mask", "mask_dims"), _aux4("mBias", "bias", "bias_dims"),
            _aux4("mBias32", "bias32", "bias32_dims"), _aux4("mTileMap", "tile_map", "map_dims"),
            _aux4("mRowRange" if ranges == "rows" else "mColRange", rng, f"{rng}_dims"),
            Tensor("mRowMax", _R % "row_max", "rmax", 2, 1), Tensor("mLogSum", _R % "log_sum", "lsum", 2, 1),
            _aux4("mSlopes", "slopes", "slopes_dims"))


def _with_aux(sig: Signature, ranges: str) -> Signature:
    return Signature(sig.tensors + _aux_tensors(ranges), sig.scalars + ", a->aux_flags")


# The bias gradient kernel of the "bias" variants (sm80/bwd_dbias.py): the inputs it recomputes dS from, the aux
# operands, and dbias in the input dtype and in float32 ([Bx, Hx, T, S], the bias's shape; the one of the
# bias's dtype is live).
_DBIAS = Signature((Tensor("mQ", _Q % "q"), Tensor("mK", _K % "k"), Tensor("mV", _K % "v"),
                    Tensor("mdO", _Q % "dout"), Tensor("mDelta", _R % "delta"), Tensor("mCuQ", _CU % "cu_q"),
                    Tensor("mCuK", _CU % "cu_k"), Tensor("mUsedQ", _US % "used_q"),
                    Tensor("mUsedK", _US % "used_k"))
                   + _aux_tensors("rows")
                   + (_aux4("mdBias", "dbias", "dbias_dims"), _aux4("mdBias32", "dbias32", "dbias32_dims")),
                   "a->score_mul, a->window_left, a->window_right, a->bottom_right, a->max_seqlen_q, "
                   "a->max_seqlen_k, a->aux_flags")


# Row zeroing: two outputs seen as int32 [rows, 16-byte words, 4] (the same one twice for one output), cu_seqlens_q.
_ZERO_ROWS = Signature((Tensor("mA", "{a, {rows, words}, {(int64_t)words * 4}}", "ta"),
                        Tensor("mB", "{b, {rows, words}, {(int64_t)words * 4}}", "tb"),
                        Tensor("mCu", "{cu, {batch + 1}}", "tc")), "bound")


def signature(v, kernel: str = "") -> Signature:
    """The parameter list of `v`'s exported kernel `kernel` (one of `v.kernels`)."""
    if isinstance(v, ZeroRowsKernel):
        return _ZERO_ROWS
    if v.kind == "fwd":
        sig = Signature(_FWD_SM90 if v.family == "sm90" else _FWD, _FWD_SCALARS)
        return _with_aux(sig, "rows") if v.aux else sig
    if kernel == "dbias":
        return _DBIAS
    sig = (_BWD_SM90 if v.family == "sm90" else _BWD)[kernel]
    if v.aux and kernel != "pre":
        return _with_aux(sig, "rows" if kernel == "dq" else "cols")
    return sig


# ----------------------------------------------------------------------------------------------------------------
# Compilation (build worker process).

def compile_variant(v, out: str) -> dict:
    """Compile and export every kernel of `v` into `out` (`<export>.o` + `<export>.h`). Returns the facts the
    registry takes from the compiled kernels (backward: `queue_all`)."""
    os.environ["CUTE_DSL_ARCH"] = v.arch  # read by the DSL when it traces
    import ctypes

    from cutlass.runtime import find_runtime_libraries

    # The DSL runtime library, loaded globally first: needed to compile on a host without a GPU.
    ctypes.CDLL(find_runtime_libraries(enable_tvm_ffi=False)[0], ctypes.RTLD_GLOBAL)
    if isinstance(v, ZeroRowsKernel):
        return _compile_zero_rows(v, out)
    return {("fwd", "sm80"): _compile_fwd_sm80, ("fwd", "sm90"): _compile_fwd_sm90,
            ("bwd", "sm80"): _compile_bwd, ("bwd", "sm90"): _compile_bwd}[(v.kind, v.family)](v, out)


def _dtype(v: Variant):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[v.dtype]


def _aux_kw(v: Variant) -> dict:
    """The kernel constructors' `aux` keyword (the kind), passed only for aux variants (the others compile as
    before)."""
    return {"aux": v.aux} if v.aux else {}


def _fake_aux(dt) -> tuple:
    """Fake tensors of the aux parameters (see `_aux_tensors`): element loads only, so byte alignment."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    def t4(elem, align):
        return make_fake_compact_tensor(elem, tuple(cute.sym_int() for _ in range(4)), stride_order=(3, 2, 1, 0),
                                        assumed_align=align)

    def rows():
        return make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride_order=(1, 0),
                                        assumed_align=4)

    return (t4(cutlass.Uint8, 1), t4(dt, dt.width // 8), t4(cutlass.Float32, 4), t4(cutlass.Uint8, 1),
            t4(cutlass.Int32, 4), rows(), rows(), t4(cutlass.Float32, 4))


def _export(compiled, out: str, name: str):
    compiled.export_to_c(out, name, function_prefix=name)


def _compile_zero_rows(z: ZeroRowsKernel, out: str) -> dict:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    from ..common.row_zeroing import ZeroUncoveredRows

    def words():  # an output as Int32 [rows, 16-byte words, 4]
        return make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), 4), stride_order=(2, 1, 0),
                                        assumed_align=16)

    a = words()
    b = words() if z.num_outputs == 2 else a
    cu = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    _export(cute.compile(ZeroUncoveredRows(z.num_outputs), a, b, cu, 0, make_fake_stream(),
                         options=f"--gpu-arch {z.arch}"), out, z.prefix)
    return {}


def _compile_fwd_sm80(v: Variant, out: str) -> dict:
    from ..sm80.fwd import FlashFwdSm80

    bm, bn, nt = v.tuning.fwd
    kern = FlashFwdSm80(_dtype(v), v.head_dim, bm, bn, nt, v.softcap, stages=sm80_fwd_stages(v.arch, v.head_dim),
                        **_aux_kw(v))
    return _compile_fwd(v, out, kern, counter=False)


def _compile_fwd_sm90(v: Variant, out: str) -> dict:
    from ..sm90.fwd import FlashFwdSm90

    t = v.tuning
    bm, bn, stages = t.fwd
    kern = FlashFwdSm90(_dtype(v), v.head_dim, bm, bn, stages, v.softcap, prefetch_next_tile=t.fwd_prefetch_next_tile,
                        pin_pv_wait=t.fwd_pin_pv_wait, rescale_o_early=t.fwd_rescale_o_early, **_aux_kw(v))
    return _compile_fwd(v, out, kern, counter=True)


def _compile_fwd(v: Variant, out: str, kern, counter: bool) -> dict:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    dt, H, sym = _dtype(v), v.head_dim, cute.sym_int

    def qkv():
        return make_fake_compact_tensor(dt, (sym(), sym(), H), stride_order=(2, 1, 0), assumed_align=16)

    q, k, v_, o = qkv(), qkv(), qkv(), qkv()
    lse = make_fake_compact_tensor(cutlass.Float32, (sym(), sym()), stride_order=(1, 0), assumed_align=4)
    sinks = make_fake_compact_tensor(cutlass.Float32, (sym(),), assumed_align=4)
    # cu_seqlens_q/k, seqused_q/k (+ the sm90 family's tile counter).
    vec = [make_fake_compact_tensor(cutlass.Int32, (sym(),), assumed_align=4) for _ in range(5 if counter else 4)]
    aux, flags = (_fake_aux(dt), (0,)) if v.aux else ((), ())
    compiled = cute.compile(kern, q, k, v_, o, lse, sinks, *vec, *aux, 1.0, 1.0, 0, 0, 0, 1, *flags, make_fake_stream(),
                            options=f"--gpu-arch {v.arch}")
    _export(compiled, out, v.prefix)
    return {}


def _compile_bwd(v: Variant, out: str) -> dict:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    from ..sm80.bwd_dkdv import BwdDKDV
    from ..sm80.bwd_dq import BwdDQ
    from ..sm80.bwd_preprocess import BwdPreprocess

    dt, H, sym = _dtype(v), v.head_dim, cute.sym_int
    t = v.tuning
    (bm, bn, nt), (bm_q, bn_q, nt_q) = t.dkdv, t.dq
    opts = f"--gpu-arch {v.arch}"

    def x3():
        return make_fake_compact_tensor(dt, (sym(), sym(), H), stride_order=(2, 1, 0), assumed_align=16)

    def f2():
        return make_fake_compact_tensor(cutlass.Float32, (sym(), sym()), stride_order=(1, 0), assumed_align=4)

    def i1():
        return make_fake_compact_tensor(cutlass.Int32, (sym(),), assumed_align=4)

    p = v.prefix
    pre = cute.compile(BwdPreprocess(dt, H), x3(), x3(), f2(), f2(), f2(), i1(), i1(), 0, make_fake_stream(),
                       options=opts)
    _export(pre, out, p + "_pre")
    if v.family == "sm90":
        from ..sm90.bwd_dkdv import BwdDKDVSm90
        from ..sm90.bwd_dq import BwdDQSm90

        # The constructors take (dtype, head_dim, block_m, block_n, stages, softcap): the tile's third entry is
        # a stage count here.
        passes = {"dkdv": BwdDKDVSm90(dt, H, bm, bn, nt, v.softcap, pin_waits=t.bwd_pin_waits,
                                      queue_dense=t.dkdv_queue_dense, steps_ahead=t.dkdv_steps_ahead,
                                      **_aux_kw(v))}
        dq_kernel = BwdDQSm90(dt, H, bm_q, bn_q, nt_q, v.softcap, pin_waits=t.bwd_pin_waits,
                              queue_dense=t.dq_queue_dense, **_aux_kw(v))
    else:
        # One kernel class; the split variants compile it twice with a compile-time output selector.
        passes = {kind: BwdDKDV(dt, H, bm, bn, nt, v.softcap, outputs=kind, **_aux_kw(v))
                  for kind in v.kernels if kind in ("dkdv", "dv", "dk")}
        dq_kernel = BwdDQ(dt, H, bm_q, bn_q, nt_q, v.softcap, **_aux_kw(v))
    counter = (i1(),) if v.family == "sm90" else ()  # sm90: the tile counter, after seqused_k
    aux = (lambda: _fake_aux(dt)) if v.aux else (lambda: ())
    flags = (0,) if v.aux else ()
    for kind, kern in passes.items():
        dkdv = cute.compile(kern, x3(), x3(), x3(), x3(), f2(), f2(), x3(), x3(), i1(), i1(), i1(), i1(), *counter,
                            *aux(), 1.0, 1.0, 1.0, 0, 0, 0, 1, *flags, make_fake_stream(), options=opts)
        _export(dkdv, out, f"{p}_{kind}")
    dq = cute.compile(dq_kernel, x3(), x3(), x3(), x3(), f2(), f2(), f2(), x3(), i1(), i1(), i1(), i1(), *counter,
                      *aux(), 1.0, 1.0, 1.0, 0, 0, 0, 1, 0, *flags, make_fake_stream(), options=opts)
    _export(dq, out, p + "_dq")
    if "dbias" in v.kernels:
        _compile_dbias(v, out, x3, f2, i1)
    # Which kernels were compiled to queue every layout, read off the kernel objects themselves: the registry's
    # queue_all (the handler's cue to zero their tile counters on every call) then cannot disagree with them.
    queue_all = sum(bit for bit, k in ((1, passes.get("dkdv")), (2, dq_kernel)) if getattr(k, "queue_dense", False))
    return {"queue_all": queue_all}


def _compile_dbias(v: Variant, out: str, x3, f2, i1):
    """The bias gradient kernel of a "bias" variant, one ABI in both families: the Hopper kernel (TMA producer,
    wgmma consumers) for the sm90 family where variants.dbias_tile picks it, else the SM80-class kernel (two
    GEMMs per visible tile fed by cp.async)."""
    import cutlass.cute as cute
    from cutlass.runtime import make_fake_stream

    dt = _dtype(v)
    bm, bn, nt, stages = dbias_tile(v.arch, v.head_dim, v.family)
    if sm90_dbias(v.family, v.head_dim):
        from ..sm90.bwd_dbias import BwdDBiasSm90

        kern = BwdDBiasSm90(dt, v.head_dim, bm, bn, stages)
    else:
        from ..sm80.bwd_dbias import BwdDBias

        kern = BwdDBias(dt, v.head_dim, bm, bn, nt, stages)
    aux = _fake_aux(dt)
    outs = _fake_aux(dt)[1:3]  # dbias in the input dtype and in float32: the bias's fake tensors
    compiled = cute.compile(kern, x3(), x3(), x3(), x3(), f2(), i1(), i1(), i1(), i1(), *aux, *outs,
                            1.0, 0, 0, 0, 1, 1, 0, make_fake_stream(), options=f"--gpu-arch {v.arch}")
    _export(compiled, out, v.prefix + "_dbias")


def timed_compile(args):
    """Worker entry point: (variant, out) -> (variant, facts, seconds)."""
    v, out = args
    t0 = time.time()
    facts = compile_variant(v, out)
    return v, facts, time.time() - t0
