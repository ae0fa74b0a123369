"""The variant matrix of every kernel the build compiles, forward and backward, and the tuning table.

A variant is fixed at build time by (kind, family, arch, dtype, head dim, softcap on/off, aux); everything else
(lengths, head counts, scale, window, causal alignment, max_seqlen_q) is a run-time argument. Causal
attention is a window with right = 0, so it needs no variant of its own.  `aux` variants take masks and
biases as tensors (`kernels/common/aux_scores.py`), in two kinds: "mask" (a mask alone: the plain kernels'
raw scores and softmax, plus the mask) and "bias" (a bias, with or without a mask: natural-unit scores and the
exact softmax); they are built without softcap only.

Kernel families:
- "sm80": mma.sync + cp.async (forward `fwd_sm80.FlashFwdSm80`, backward `bwd_sm80`); built for every arch.
- "sm90": TMA + wgmma, warp-specialised (forward `fwd_sm90.FlashFwdSm90`, backward `bwd_sm90`; the backward's
  Delta preprocess is the sm80 one); sm_90a only. On compute capability 9.0 the FFI handlers prefer it and fall
  back to the sm80 family's sm_90a build where a combination lacks it.
Besides the attention variants, sm_90a builds the two row-zeroing kernels (`row_zeroing.ZeroUncoveredRows`,
one and two outputs) that replace memsets of whole outputs under the sm90 family.

Every performance choice of a kernel lives in TUNING below (one row per family and head dim), so a compiled
object is described completely by its variant and its row (`Variant.options`, part of the build cache key).
"""

from dataclasses import dataclass

ARCHS = ("sm_80", "sm_90a")
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
SOFTCAP = (False, True)
AUX = (False, True)  # without / with the aux variants (both kinds)
AUX_KINDS = ("mask", "bias")
AUX_CODE = {"": 0, "mask": 1, "bias": 2}  # shared with ffi/ (JpsFwdVariant.aux, JpsBwdVariant.aux)
KINDS = ("fwd", "bwd")

# Codes shared with ffi/ (the registry tables): dtype, family and arch codes.
DTYPE_CODE = {"bf16": 0, "fp16": 1}
FAMILY_CODE = {"sm80": 0, "sm90": 1}
ARCH_CODE = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90a": 90, "sm_100a": 100, "sm_120": 120}
# Archs a family is built for (None: every arch).
FAMILY_ARCHS = {"sm80": None, "sm90": ("sm_90a",)}


@dataclass(frozen=True)
class Sm80Tuning:
    """Tiles (block_m, block_n, threads) of the sm80 family's kernels at one head dim."""
    fwd: tuple
    dkdv: tuple
    dq: tuple
    # The backward's dK/dV kernel runs as two launches (a dV pass, then a dK pass): dK and dV together would
    # need 2 x 16 x HD fp32 accumulators per warp, 2 x HD / 2 registers per thread (256 at hd256).
    split_dkdv: bool = False
    # The bias gradient kernel (sm80/bwd_dbias.py, built into the "bias" variants of both families).
    dbias: tuple = (128, 64, 256)


@dataclass(frozen=True)
class Sm90Tuning:
    """Tiles (block_m, block_n, stages) and per-head-dim switches of the sm90 family's kernels at one head dim."""
    fwd: tuple
    dkdv: tuple
    dq: tuple
    # Forward: the producer prefetches the next tile's Q and first K / V block into L2 (several tiles per CTA).
    fwd_prefetch_next_tile: bool = False
    # Forward: the wait for P V kept after the softmax that overlaps it, and O rescaled between issuing S and
    # issuing P V (FlashAttention-3's order); the results are bitwise the same either way.
    fwd_pin_pv_wait: bool = False
    fwd_rescale_o_early: bool = False
    # Backward (both kernels): the wait for dP issued only after P in the input dtype is formed.
    bwd_pin_waits: bool = False
    # Backward: the kernel runs every layout, dense ones too, through its tile queue (else one CTA per dense
    # tile); the FFI handler then zeroes that kernel's tile counter on every call (the registry's queue_all).
    dkdv_queue_dense: bool = False
    dq_queue_dense: bool = False
    # Backward, plain dK/dV kernel: the next step's S^T and dP^T issued right after the current step's dK GEMM
    # (bwd_dkdv_ahead.py).  H200, 2026-11-29: backward +4-7% at hd64, +1-4% at hd80; hd96 within noise; hd128 -3%
    # at S=8192 with S^T alone issued ahead (with both, ptxas serialised every wgmma for lack of registers).
    dkdv_steps_ahead: bool = False


# Measurements: H100 SXM, CUDA 13.0, nvidia-cutlass-dsl 4.8.1, 2026-11 (benchmarks/README.md for the current
# end-to-end numbers).
# sm80 forward: 4 warps; hd64 128x64 beats 128x128 (which spills) by ~19%; 8-warp tiles were slower at hd128/256.
# sm80 backward: each warp owns 16 rows of the accumulators (dK and dV: 16 x HD each; dQ: 16 x HD); 8-warp tiles
# (dK/dV 64x128x256) were 6-10% slower end to end, dQ 128x64x256 equal within noise. hd192/256 (dK/dV in two
# passes): 32 query rows per dK/dV step and 32 keys per dQ step keep the S / dP fragments small next to the
# accumulator; ptxas (sm_90a, bf16) reports 0 spills for the dV and dK passes and dQ (hd256 dQ with softcap:
# 16 B), where 64 x 64 tiles spilled 184 B (dK pass, softcap) and 392-448 B (dQ). Shared memory: 128 KB per
# block in every kernel (dV pass 96 KB), so the kernels' two stages fit sm_80 (163 KB) and sm_90a.
# sm90 forward: block_m = 2 consumer warpgroups x 64 rows; shared memory Q block_m x hd + 2 stages x (K + V)
# block_n x hd, at most 227 KB (hd256: 225 KB). The L2 prefetch: hd64 +5-10% at >= 2k tokens, hd96 neutral, hd128
# 5-9% slower at 512 tokens. The pinned P V wait with the early O rescale: hd128 +3-5% at 2k-16k tokens, causal
# and not; hd64 -5% to +3%; hd96, 192 and 256 2-7% slower.
# sm90 backward: block_m x block_n of the resident tile = 2 consumer warpgroups x 64 rows (dK/dV: keys, dQ:
# queries); a dK/dV block_n of 64 (hd192/256) selects the head-dim split (each warpgroup keeps half of the head
# dim of dK and dV). hd256's dQ kernel streams 32-key K/V tiles (Q + dO resident: 128 KB). Shared memory:
# hd256 dK/dV 216 KB, hd256 and hd192 dQ 192 KB, hd192 dK/dV 168 KB (3 stages measured equal); hd64 64x128x3 and
# 128x128x2 measured equal within 2%. Pinned dP waits: forward+backward hd128 +2-3% at 2k and 8k tokens, hd64 /
# hd96 2-3% slower, hd192 / hd256 within +-1.5%. Dense layouts through the tile queue, per-kernel times on
# 8 x 2048 tokens against one CTA per dense tile: dK/dV hd128 -7 to -8%, hd192 -7 to -8%, hd256 -11 to -12%, but
# hd64 +2 to +5% and hd96 +1%; dQ hd64 -5 to -8%, hd128 -1 to -3%, hd192 -1 to -4%, hd256 -3 to -4%, but hd96
# +1 to +4%.
# sm90 head dim 80 (H200, 2026-11-28, B=4 S=4096, 16 / 4 heads): its row first copied head dim 96's; the forward's
# pinned P V wait with the early O rescale and the dense layouts' dQ through the queue took its forward from 0.807 to
# 0.749 ms (causal 0.459 -> 0.433) and forward+backward from 3.78 to 3.60 ms (causal 2.25 -> 2.16) while head dim
# 96 measured within 4% in both runs.
TUNING = {
    "sm80": {
        64: Sm80Tuning(fwd=(128, 64, 128), dkdv=(64, 64, 128), dq=(64, 64, 128), dbias=(64, 64, 128)),
        80: Sm80Tuning(fwd=(128, 64, 128), dkdv=(64, 64, 128), dq=(64, 64, 128), dbias=(64, 64, 128)),
        96: Sm80Tuning(fwd=(128, 64, 128), dkdv=(64, 64, 128), dq=(64, 64, 128)),
        128: Sm80Tuning(fwd=(128, 64, 128), dkdv=(64, 64, 128), dq=(64, 64, 128)),
        192: Sm80Tuning(fwd=(64, 64, 128), dkdv=(32, 64, 128), dq=(64, 32, 128), split_dkdv=True,
                        dbias=(64, 32, 128)),
        256: Sm80Tuning(fwd=(64, 64, 128), dkdv=(32, 64, 128), dq=(64, 32, 128), split_dkdv=True,
                        dbias=(64, 32, 128)),
    },
    "sm90": {
        64: Sm90Tuning(fwd=(128, 128, 2), dkdv=(64, 128, 2), dq=(128, 64, 2), fwd_prefetch_next_tile=True,
                       dq_queue_dense=True, dkdv_steps_ahead=True),
        80: Sm90Tuning(fwd=(128, 128, 2), dkdv=(64, 128, 2), dq=(128, 64, 2), fwd_prefetch_next_tile=True,
                       fwd_pin_pv_wait=True, fwd_rescale_o_early=True, dq_queue_dense=True, dkdv_steps_ahead=True),
        96: Sm90Tuning(fwd=(128, 128, 2), dkdv=(64, 128, 2), dq=(128, 64, 2), fwd_prefetch_next_tile=True),
        128: Sm90Tuning(fwd=(128, 128, 2), dkdv=(64, 128, 2), dq=(128, 64, 2), fwd_pin_pv_wait=True,
                        fwd_rescale_o_early=True, bwd_pin_waits=True, dkdv_queue_dense=True, dq_queue_dense=True),
        192: Sm90Tuning(fwd=(128, 112, 2), dkdv=(64, 64, 2), dq=(128, 64, 2), dkdv_queue_dense=True,
                        dq_queue_dense=True),
        256: Sm90Tuning(fwd=(128, 80, 2), dkdv=(64, 64, 2), dq=(128, 32, 2), dkdv_queue_dense=True,
                        dq_queue_dense=True),
    },
}

# Shared memory per SM by build target (bytes usable by CTAs); archs not named here: 227 KB.
SMEM_PER_SM = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_120": 99 * 1024,
               "sm_120a": 99 * 1024}


# The Hopper bias gradient kernel (sm90/bwd_dbias.py): 128 x 64 tiles (two consumer warpgroups of 64 rows), as many
# stages of its four operand tiles as fit, at most 4; built for the sm90 family up to this head dim (above, the
# SM80-class kernel: one 128-row stage of Q, dO, K and V would take 144 KB at 192).
SM90_DBIAS_TILE = (128, 64)
SM90_DBIAS_MAX_HEAD_DIM = 128


def sm90_dbias(family: str, head_dim: int) -> bool:
    """Whether `family`'s "bias" variants at `head_dim` take the Hopper bias gradient kernel."""
    return family == "sm90" and head_dim <= SM90_DBIAS_MAX_HEAD_DIM


def dbias_tile(arch: str, head_dim: int, family: str = "sm80") -> tuple:
    """(block_m, block_n, threads, stages) of the bias gradient kernel of `family`'s "bias" variants: the
    Hopper kernel for the sm90 family up to SM90_DBIAS_MAX_HEAD_DIM, else the SM80-class one (two stages of its
    four operand tiles (Q, dO, K, V) where they fit one block of `arch`, else one)."""
    if sm90_dbias(family, head_dim):
        block_m, block_n = SM90_DBIAS_TILE
        stage_bytes = 2 * (block_m + block_n) * head_dim * 2
        stages = min(4, (SMEM_PER_SM.get(arch, 227 * 1024) - 1024) // stage_bytes)
        return block_m, block_n, 384, stages
    block_m, block_n, threads = TUNING["sm80"][head_dim].dbias
    stage_bytes = 2 * (block_m + block_n) * head_dim * 2
    stages = 2 if 2 * stage_bytes + 1024 <= SMEM_PER_SM.get(arch, 227 * 1024) else 1
    return block_m, block_n, threads, stages


def sm80_fwd_stages(arch: str, head_dim: int) -> int:
    """K/V shared-memory stages of the sm80 forward: 2 (tile n-1 loads while tile n is computed) where two CTAs
    with Q plus two K and two V tiles still fit one SM of `arch`, else 1 (a second stage that costs the second
    CTA per SM loses more latency hiding than it gains)."""
    block_m, block_n, _ = TUNING["sm80"][head_dim].fwd
    two_stage_bytes = (block_m + 4 * block_n) * head_dim * 2 + 1024
    return 2 if 2 * two_stage_bytes <= SMEM_PER_SM.get(arch, 227 * 1024) else 1



@dataclass(frozen=True)
class Variant:
    """One attention variant: `kind` "fwd" (one export, `prefix`) or "bwd" (the exports in `kernels`)."""
    kind: str
    arch: str
    dtype: str
    head_dim: int
    softcap: bool
    family: str = "sm80"
    aux: str = ""  # "", "mask" or "bias"

    @property
    def prefix(self) -> str:
        fam = "" if self.family == "sm80" else f"{self.family}k_"
        aux = f"_{self.aux}" if self.aux else ""
        return (f"jps_{self.kind}_{fam}{self.arch}_{self.dtype}_hd{self.head_dim}_{'cap' if self.softcap else 'nocap'}"
                f"{aux}")

    @property
    def tuning(self):
        return TUNING[self.family][self.head_dim]

    @property
    def tile(self):
        """Forward: (block_m, block_n, threads | stages); backward: (dK/dV tile, dQ tile)."""
        t = self.tuning
        return t.fwd if self.kind == "fwd" else (t.dkdv, t.dq)

    @property
    def split(self) -> bool:
        """Backward: True when the dK/dV kernel is exported as a dV pass (`_dv`) and a dK pass (`_dk`)."""
        return self.kind == "bwd" and self.family == "sm80" and self.tuning.split_dkdv

    @property
    def kernels(self) -> tuple:
        """The exported kernels, in launch order: the backward's `<prefix>_<kernel>`, the forward's `<prefix>`."""
        if self.kind == "fwd":
            return ("",)
        dbias = ("dbias",) if self.aux == "bias" else ()
        return (("pre", "dv", "dk", "dq") if self.split else ("pre", "dkdv", "dq")) + dbias

    @property
    def exports(self) -> tuple:
        """Symbol prefixes of the exported objects (`<export>.o` + `<export>.h`)."""
        return tuple(f"{self.prefix}_{k}" if k else self.prefix for k in self.kernels)

    @property
    def options(self) -> dict:
        """Every compile-time choice of this variant's kernels: its kind's part of the tuning row, resolved for
        its arch."""
        fwd = self.kind == "fwd"
        opts = {k: v for k, v in vars(self.tuning).items() if (k == "fwd" or k.startswith("fwd_")) == fwd}
        if self.family == "sm80" and fwd:
            opts["fwd_stages"] = sm80_fwd_stages(self.arch, self.head_dim)
        opts.pop("dbias", None)
        if "dbias" in self.kernels:
            opts["dbias"] = dbias_tile(self.arch, self.head_dim, self.family)
        if self.aux:
            opts["aux"] = self.aux
        return opts

    @property
    def queue_all(self) -> int:
        """Backward sm90: which kernels queue every layout (bit 0: dK/dV, bit 1: dQ); 0 otherwise."""
        if self.kind != "bwd" or self.family != "sm90":
            return 0
        return int(self.tuning.dkdv_queue_dense) | 2 * int(self.tuning.dq_queue_dense)

    def describe(self) -> str:
        cap = "cap" if self.softcap else "nocap"
        aux = f" {self.aux}" if self.aux else ""
        return f"{self.arch} {self.dtype} hd{self.head_dim} {cap} {self.kind} {self.family}{aux}"


@dataclass(frozen=True)
class ZeroRowsKernel:
    """row_zeroing.ZeroUncoveredRows for one arch and 1 or 2 outputs; built where the sm90 family is (the only
    kernels that write every row of their tiles, so the only ones that can go without an output memset)."""
    arch: str
    num_outputs: int
    kind: str = "zero_rows"

    @property
    def prefix(self) -> str:
        return f"jps_zero_rows{self.num_outputs}_{self.arch}"

    @property
    def exports(self) -> tuple:
        return (self.prefix,)

    @property
    def options(self) -> dict:
        return {}

    def describe(self) -> str:
        return f"{self.arch} zero rows x{self.num_outputs}"


def family_builds(family: str, arch: str, head_dim: int) -> bool:
    archs = FAMILY_ARCHS[family]
    return (archs is None or arch in archs) and head_dim in TUNING[family]


def matrix(archs=ARCHS, dtypes=DTYPES, head_dims=HEAD_DIMS, softcap=SOFTCAP, kinds=KINDS, aux=AUX):
    """Every variant of the build, in registry order: per kind, the sm80 family, then the sm90 family (aux
    variants, softcap off only, after the others of their head dim)."""
    combos = [(c, "") for c in softcap if False in aux]
    if True in aux and False in softcap:
        combos += [(False, kind) for kind in AUX_KINDS]
    return [Variant(kind, a, d, h, c, fam, x) for kind in kinds for fam in FAMILY_CODE for a in archs for d in dtypes
            for h in head_dims if family_builds(fam, a, h) for c, x in combos]


def zero_rows_kernels(archs=ARCHS):
    return [ZeroRowsKernel(a, n) for a in archs if a in FAMILY_ARCHS["sm90"] for n in (1, 2)]
