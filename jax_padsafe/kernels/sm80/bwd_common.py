"""Pieces shared by the SM80-class backward kernels (mma.sync + ldmatrix + cp.async).

* `make_mma` / `transposed`: the warp-level TiledMma and the transposed view of a shared tile.
* `BwdBase`: the configuration every SM80-class backward kernel holds (and the choice of the aux variant's
  class, see `BwdBase.__new__`; the aux kinds "mask" and "bias" as in fwd.aux_kind).
* `aux_view`: the AuxView (common/aux_scores.py) of one (sequence, query head) from an aux kernel's inputs.
* `gemm_ss` / `gemm_rs`: mma.sync GEMMs with ldmatrix-fed operands (shared/shared, register/shared).
* `store_rows`: accumulator -> shared -> global for rows below a valid length only.
* `smem_tiles_struct`: the shared-memory struct of a kernel configuration (only the buffers it uses).
"""

import cutlass
import cutlass.cute as cute

from ..common import aux_scores
from .fwd import aux_kind


def make_mma(dtype, num_threads):
    return cute.make_tiled_mma(
        cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
        (num_threads // 32, 1, 1),
        permutation_mnk=(num_threads // 32 * 16, 16, 16),
    )


def transposed(s, rows, cols):
    """(cols, rows) view of a row-major (rows, cols) shared tile."""
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


class BwdBase:
    """Configuration of an SM80-class backward kernel (two shared-memory stages of the streamed operands: every
    default tile fits sm_80's 163 KB per block with two).

    `aux` = "bias" (True: the same; masks and biases as tensors, natural-unit scores, P from the forward's exact
    row statistics) or "mask" (a mask alone: the plain kernel's raw scores and P from lse, the mask applied to
    the raw scores) builds the subclass named by the kernel class's `aux_class`: the DSL compiles __call__'s
    fixed signature, and the aux variants' __call__ (one for both kinds) takes the extra tensors and the
    aux_flags scalar.  `self.aux` is False, "mask" or "bias"; the kernels branch on it with const_expr only."""

    aux_class = None  # set by each kernel module to its aux subclass

    def __new__(cls, *args, aux=False, **kwargs):
        if aux_kind(aux):
            assert cls.aux_class is not None
            return super().__new__(cls.aux_class)
        return super().__new__(cls)

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_threads: int, has_softcap: bool, *,
                 aux=False):
        assert head_dim % 16 == 0
        aux = aux_kind(aux)
        assert not (aux and has_softcap)  # aux variants are built without softcap
        assert bool(aux) == (type(self).aux_class is type(self))  # the __call__ matches the kernel body
        self.aux = aux
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.block_n = block_n
        self.num_threads = num_threads
        self.has_softcap = has_softcap


@cute.jit
def aux_view(aux_in, batch: cutlass.Int32, head: cutlass.Int32, num_heads: cutlass.Int32) -> aux_scores.AuxView:
    """The AuxView of query head `head` of sequence `batch`.  `aux_in` = (mMask, mBias, mBias32, mTileMap,
    mRanges, mRowMax, mLogSum, aux_flags, mSlopes), mRanges being the row ranges (dQ) or the column ranges (dK/dV): each
    kernel reads only its own kind, so the one tensor fills both slots of the view."""
    return aux_scores.view(aux_in[0], aux_in[1], aux_in[2], aux_in[3], aux_in[4], aux_in[4], aux_in[8], aux_in[7],
                           batch, head, num_heads)


@cute.jit
def gemm_ss(tiled_mma, acc, copy_a, tCsA, tCrA_v, tCrA, copy_b, tCsB, tCrB_v, tCrB):
    """acc += A B^T with both operands read from shared memory by ldmatrix (one k-slice ahead)."""
    cute.copy(copy_a, tCsA[None, None, 0], tCrA_v[None, None, 0])
    cute.copy(copy_b, tCsB[None, None, 0], tCrB_v[None, None, 0])
    nk = cute.size(tCsA.shape[2])
    for k in cutlass.range_constexpr(nk):
        if k + 1 < nk:
            cute.copy(copy_a, tCsA[None, None, k + 1], tCrA_v[None, None, k + 1])
            cute.copy(copy_b, tCsB[None, None, k + 1], tCrB_v[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma, acc, tCrA, copy_b, tCsB, tCrB_v, tCrB):
    """acc += A B^T with A in registers (an mma C fragment re-laid out as A) and B from shared memory."""
    cute.copy(copy_b, tCsB[None, None, 0], tCrB_v[None, None, 0])
    nk = cute.size(tCrA.shape[2])
    for k in cutlass.range_constexpr(nk):
        if k + 1 < nk:
            cute.copy(copy_b, tCsB[None, None, k + 1], tCrB_v[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


def c_to_a_layout(layout):
    """mma C fragment (4, MMA_M, MMA_N) -> A fragment ((4, 2), MMA_M, MMA_N / 2) (same registers)."""
    d = cute.logical_divide(layout, (None, None, 2))
    return cute.make_layout(
        ((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
        stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]),
    )


@cute.jit
def store_rows(
    acc: cute.Tensor,
    mul: cutlass.Float32,
    dtype: cutlass.Constexpr,
    tiled_mma: cute.TiledMma,
    copy_out: cute.TiledCopy,
    sX: cute.Tensor,
    gX: cute.Tensor,
    rows: cutlass.Constexpr,
    cols: cutlass.Constexpr,
    row0: cutlass.Int32,
    row_limit: cutlass.Int32,
    tidx: cutlass.Int32,
):
    """Write mul * acc (an mma C fragment of a (rows, cols) tile) to gX for tile rows with
    row0 + r < row_limit only, through the shared tile sX.  The caller barriers before (sX free)."""
    rX = cute.make_fragment_like(acc, dtype)
    rX.store((acc.load() * mul).to(dtype))
    copy_r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype), tiled_mma)
    thr_r2s = copy_r2s.get_slice(tidx)
    cute.copy(copy_r2s, thr_r2s.retile(rX), thr_r2s.partition_D(sX))
    cute.arch.barrier()
    thr_out = copy_out.get_slice(tidx)
    tXsX = thr_out.partition_S(sX)
    tXgX = thr_out.partition_D(gX)
    tXcX = thr_out.partition_D(cute.make_identity_tensor((rows, cols)))
    tXrX = cute.make_fragment_like(tXgX, dtype)
    cute.copy(copy_out, tXsX, tXrX)
    for m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
        if row0 + tXcX[0, m, 0][0] < row_limit:
            cute.copy(copy_out, tXrX[None, m, None], tXgX[None, m, None])


def smem_tiles_struct(dtype, tiles_of: dict):
    """A `cute.struct` with one 1024-byte-aligned `dtype` buffer per entry of `tiles_of` (name -> smem layout),
    in that order.  Built here, outside the @cute.jit functions, so a kernel can leave out the buffers a
    compile-time configuration does not use (an `if` inside a class body in a jit function would be
    rewritten by the DSL's preprocessor)."""
    fields = {name: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]
              for name, layout in tiles_of.items()}
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
