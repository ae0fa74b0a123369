"""The forward variant matrix and the naming shared by the build script and `ffi/`.

A variant is fixed at build time by (family, arch, dtype, head_dim, softcap on/off); everything else
(lengths, head counts, scale, window, causal alignment, max_seqlen_q) is a run-time argument.
Causal attention is a window with right = 0, so it needs no variant of its own.

Kernel families: "sm80" (fwd_sm80.FlashFwdSm80: mma.sync + cp.async; built for every arch) and
"sm90" (fwd_sm90.FlashFwdSm90: TMA + wgmma, warp-specialised; sm_90a only, head dims in SM90_TILES).
On compute capability 9.0 the FFI handler prefers an "sm90" variant and falls back to the "sm80"
family's sm_90a build for the combinations the sm90 kernel lacks.
"""

from dataclasses import dataclass

ARCHS = ("sm_80", "sm_90a")
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 96, 128, 192, 256)
SOFTCAP = (False, True)

# (block_m, block_n, num_threads) per head dim: 4 warps.  Measured on an H100 (benchmarks/RESULTS.md):
# hd64 128x64 beats 128x128 (which spills) by ~19%; 8-warp variants were slower for hd128/256.
TILES = {64: (128, 64, 128), 96: (128, 64, 128), 128: (128, 64, 128), 192: (64, 64, 128), 256: (64, 64, 128)}

# sm90 family: (block_m, block_n, K/V pipeline stages) per head dim; block_m = 2 consumer warpgroups x 64 rows.
# Shared memory: Q block_m x hd + 2 stages x (K + V) block_n x hd, at most 227 KB (hd256: 225 KB).
SM90_TILES = {64: (128, 128, 2), 96: (128, 128, 2), 128: (128, 128, 2), 192: (128, 112, 2), 256: (128, 80, 2)}

# Codes shared with ffi/ (see ffi/jps_fwd.cc): dtype codes and arch codes.
DTYPE_CODE = {"bf16": 0, "fp16": 1}
FAMILY_CODE = {"sm80": 0, "sm90": 1, "sm90f": 2}
ARCH_CODE = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90a": 90, "sm_100a": 100, "sm_120": 120}


@dataclass(frozen=True)
class FwdVariant:
    arch: str
    dtype: str
    head_dim: int
    softcap: bool
    family: str = "sm80"

    @property
    def prefix(self) -> str:
        fam = "" if self.family == "sm80" else f"{self.family}k_"
        return f"jps_fwd_{fam}{self.arch}_{self.dtype}_hd{self.head_dim}_{'cap' if self.softcap else 'nocap'}"

    @property
    def tile(self):
        """sm80: (block_m, block_n, threads); sm90: (block_m, block_n, stages)."""
        return SM90_TILES[self.head_dim] if self.family == "sm90" else TILES[self.head_dim]


@dataclass(frozen=True)
class ZeroRowsKernel:
    """row_zeroing.ZeroUncoveredRows for one arch and 1 or 2 outputs; built where the sm90 family is (the only
    kernels that write every row of their tiles, so the only ones that can go without an output memset)."""
    arch: str
    num_outputs: int

    @property
    def prefix(self) -> str:
        return f"jps_zero_rows{self.num_outputs}_{self.arch}"


def zero_rows_kernels(archs=ARCHS, sm90=False):
    return [ZeroRowsKernel("sm_90a", n) for n in (1, 2)] if sm90 and "sm_90a" in archs else []


def matrix(archs=ARCHS, dtypes=DTYPES, head_dims=HEAD_DIMS, softcap=SOFTCAP, sm90=False):
    """Every sm80-family variant, plus (sm90=True) the sm90-family variants of the sm_90a build."""
    out = [FwdVariant(a, d, h, c) for a in archs for d in dtypes for h in head_dims for c in softcap]
    if sm90 and "sm_90a" in archs:
        out += [FwdVariant("sm_90a", d, h, c, "sm90") for d in dtypes for h in head_dims if h in SM90_TILES
                for c in softcap]
    return out
