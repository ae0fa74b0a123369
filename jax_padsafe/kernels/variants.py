"""The forward variant matrix and the naming shared by the build script and `ffi/`.

A variant is fixed at build time by (arch, dtype, head_dim, softcap on/off); everything else
(lengths, head counts, scale, window, causal alignment, max_seqlen_q) is a run-time argument.
Causal attention is a window with right = 0, so it needs no variant of its own.
"""

from dataclasses import dataclass

ARCHS = ("sm_80", "sm_90a")
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 96, 128, 192, 256)
SOFTCAP = (False, True)

# (block_m, block_n, num_threads) per head dim: 4 warps.  Measured on an H100 (benchmarks/RESULTS.md):
# hd64 128x64 beats 128x128 (which spills) by ~19%; 8-warp variants were slower for hd128/256.
TILES = {64: (128, 64, 128), 96: (128, 64, 128), 128: (128, 64, 128), 192: (64, 64, 128), 256: (64, 64, 128)}

# Codes shared with ffi/ (see ffi/jps_fwd.cc): dtype codes and arch codes.
DTYPE_CODE = {"bf16": 0, "fp16": 1}
ARCH_CODE = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90a": 90, "sm_100a": 100, "sm_120": 120}


@dataclass(frozen=True)
class FwdVariant:
    arch: str
    dtype: str
    head_dim: int
    softcap: bool

    @property
    def prefix(self) -> str:
        return f"jps_fwd_{self.arch}_{self.dtype}_hd{self.head_dim}_{'cap' if self.softcap else 'nocap'}"

    @property
    def tile(self):
        return TILES[self.head_dim]


def matrix(archs=ARCHS, dtypes=DTYPES, head_dims=HEAD_DIMS, softcap=SOFTCAP):
    return [FwdVariant(a, d, h, c) for a in archs for d in dtypes for h in head_dims for c in softcap]
