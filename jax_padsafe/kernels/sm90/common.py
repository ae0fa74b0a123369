"""Hopper (sm_90a) building blocks shared by the TMA + wgmma kernels.

* `smem_layout`: a wgmma/TMA-compatible swizzled (rows, head_dim[, stages]) shared-memory layout.
* `rows_dim_heads`: the (rows, head_dim, heads) view of a packed [total, heads, head_dim] tensor, so one
  TMA box is (rows, head_dim) of one head.
* `make_mma`: a wgmma TiledMma over `num_wg` consumer warpgroups stacked along M; `make_mma_split_n`:
  side by side along N.
* `c_to_a_layout`: a wgmma accumulator fragment re-viewed as the register A operand of the next GEMM.
* `gemm`: issue one warpgroup GEMM (first k-block may overwrite) and commit it.
* `zero_rows_from`: pad-safety under TMA (which zero-fills only outside the whole tensor): overwrite the
  rows of a shared tile at or past a valid length with zeros, then make the generic-proxy stores visible
  to the async proxy (wgmma) and barrier the warpgroup.
* `wgmma_wait_after`: a wgmma wait that ptxas cannot hoist above the instructions computing given values
  (keeps a GEMM running under the element-wise work that the source places before the wait).
* `store_rows_via_smem` / `zero_rows_global`: the epilogue; rows past the valid length up to the
  sequence's slot end are written as zeros, so that no output memset is needed where the tiles cover
  every row.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from ..common import aux_scores, tiles


def smem_layout(dtype, rows: int, head_dim: int, stages: int = 0, atom_cols: int = 0):
    """Row-major (head_dim contiguous) swizzled layout of (rows, head_dim) or (rows, head_dim, stages); any
    element type (fp32: the head-dim split's P^T exchange tile).  The swizzle atom is the
    widest (up to 128 B) that divides `atom_cols` (default head_dim): a GEMM operand that starts at column
    c of the tile needs c to be a multiple of the atom's width."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or head_dim), dtype)
    if stages:
        return cute.tile_to_shape(atom, (rows, head_dim, stages), order=(0, 1, 2))
    return cute.tile_to_shape(atom, (rows, head_dim), order=(0, 1))


def rows_dim_heads(t: cute.Tensor) -> cute.Tensor:
    """[total, heads, head_dim] -> (total, head_dim, heads) view (same memory)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))


def transposed(s: cute.Tensor) -> cute.Tensor:
    """(rows, cols[, stages]) shared tensor -> (cols, rows[, stages]): the MN-major operand view."""
    modes = [1, 0, 2] if cute.rank(s.layout) == 3 else [1, 0]
    return cute.make_tensor(s.iterator, cute.select(s.layout, mode=modes))


def make_mma(dtype, num_wg: int, tile_m_per_wg: int, tile_n: int, b_major_mn: bool, a_from_regs: bool):
    """wgmma TiledMma: num_wg warpgroups x tile_m_per_wg rows, tile_n columns, fp32 accumulate.
    A is K-major (shared memory, or registers with a_from_regs); B is K-major or MN-major."""
    b_mode = warpgroup.OperandMajorMode.MN if b_major_mn else warpgroup.OperandMajorMode.K
    args = [dtype, dtype, warpgroup.OperandMajorMode.K, b_mode, cutlass.Float32, (num_wg, 1, 1),
            (tile_m_per_wg, tile_n)]
    if a_from_regs:
        args.append(warpgroup.OperandSource.RMEM)
    return sm90_utils.make_trivial_tiled_mma(*args)


def make_mma_split_n(dtype, tile_m: int, tile_n_per_wg: int, num_wg: int, a_major_mn: bool, b_major_mn: bool,
                     a_from_regs: bool = False):
    """wgmma TiledMma with `num_wg` warpgroups side by side along N (each tile_m x tile_n_per_wg), for a GEMM
    whose M is one warpgroup's 64 rows: the head-dim-split dK / dV GEMMs (A = P^T / dS^T from registers,
    `a_from_regs`; every warpgroup holds the whole A), where each consumer warpgroup takes half of the head dim."""
    a_mode = warpgroup.OperandMajorMode.MN if a_major_mn else warpgroup.OperandMajorMode.K
    b_mode = warpgroup.OperandMajorMode.MN if b_major_mn else warpgroup.OperandMajorMode.K
    args = [dtype, dtype, a_mode, b_mode, cutlass.Float32, (1, num_wg, 1), (tile_m, tile_n_per_wg)]
    if a_from_regs:
        args.append(warpgroup.OperandSource.RMEM)
    return sm90_utils.make_trivial_tiled_mma(*args)


def c_to_a_layout(lay):
    """wgmma C fragment ((2, 2, N/8), M, N) -> register A fragment ((2, 2, 2), M, (N, N/16)) of the next
    GEMM: an A k-block of 16 columns is two consecutive 8-column blocks of C (same registers)."""
    s0, d0 = lay.shape[0], lay.stride[0]
    return cute.make_layout(
        ((s0[0], s0[1], 2), lay.shape[1], (lay.shape[2], s0[2] // 2)),
        stride=((d0[0], d0[1], d0[2]), lay.stride[1], (lay.stride[2], 2 * d0[2])),
    )


@cute.jit
def gemm(mma_first: cute.TiledMma, mma_acc: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
         overwrite: cutlass.Constexpr):
    """Issue acc (+)= A B^T over every k-block of the operand fragments and commit the group; with
    `overwrite` the first k-block uses `mma_first` (accumulate off).  The caller waits."""
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        mma = mma_first if (overwrite and k == 0) else mma_acc
        cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k], acc)
    warpgroup.commit_group()


def map_group(query_mode: int) -> int:
    """Columns of a wgmma accumulator fragment (masking.acc_mn_view_sm90) per block of the mask's summary, for
    aux_scores' `map_group`: column c of a thread lies at 8 * (c // 2) + 2 * (lane % 4) + c % 2 of the tile, so
    2 * MAP_COLS / 8 columns span one block of keys (queries as rows, query_mode 0) and 2 * MAP_ROWS / 8 one block
    of queries (query_mode 1); a thread's rows r and r + 8 of its warp's 16 lie in one block either way."""
    return 2 * (aux_scores.MAP_ROWS if query_mode == 1 else aux_scores.MAP_COLS) // 8


@cute.jit
def wgmma_wait_after(values: cute.Tensor, opaque_zero: cutlass.Int32, pending: cutlass.Constexpr):
    """`wgmma.wait_group pending`, issued only after the registers `values` are computed (any element type
    whose tensor is a whole number of 32-bit words: fp32 scores, bf16 / fp16 probabilities).

    Why: `wgmma.wait_group` has no register operands, so ptxas's list scheduler treats it as ready at the
    top of its basic block and, since the accumulator reads after it are on the critical path, issues it
    first.  In the Hopper forward that put the wait for P V *before* the softmax that the source overlaps
    with it (SASS: `WARPGROUP.DEPBAR.LE gsb0, 0x0` right after the mask branch merges), so the warpgroup's
    own tensor-core work and its exp2 never ran together.  Here the wait sits in a branch whose condition
    depends on `values`, which pins it after them.

    The condition is `(bits(values) & opaque_zero) == 0`, where `opaque_zero` is 0 at run time but unknown
    to both compilers: always true, for every thread alike (the `.aligned` wait requires the whole
    warpgroup to take the same path).  The caller still issues its unconditional wait afterwards, so the
    results never depend on the branch.

    Precondition (the caller's): `opaque_zero` is 0 in every thread.  A non-zero value could split the
    warpgroup between the two waits, which `.aligned` forbids.  The callers derive it from a kernel value
    with a known bound: `tiles_per_cta >> 30` (tiles_per_cta <= max_tiles_per_cta, asserted < 2^30) in the
    forward, `total query rows >> 30` in the backward (2^30 rows of Q alone would not fit a GPU's memory)."""
    bits = cute.recast_tensor(values, cutlass.Int32)
    acc = bits[0]
    for i in cutlass.range_constexpr(1, cute.size(bits)):
        acc = acc | bits[i]
    if (acc & opaque_zero) == 0:
        warpgroup.wait_group(pending)


@cute.jit
def zero_rows_from(dtype: cutlass.Constexpr, rows: cutlass.Constexpr, head_dim: cutlass.Constexpr, s_tile: cute.Tensor,
                   n_valid: cutlass.Int32, tidx_wg: cutlass.Int32, barrier_id: cutlass.Int32):
    """Zero the rows r >= n_valid of the (rows, head_dim) shared tile `s_tile` with 16-byte stores by the
    128 threads of one warpgroup (tidx_wg in [0, 128)), then fence.proxy.async (wgmma reads through the
    async proxy) and barrier that warpgroup.  Several warpgroups may zero the same rows (same values)."""
    zero_copy = tiles.gmem_tiled_copy(dtype, head_dim, 128, async_copy=False)
    thr = zero_copy.get_slice(tidx_wg)
    tZs = thr.partition_D(s_tile)
    tZc = thr.partition_D(cute.make_identity_tensor((rows, head_dim)))
    for m in cutlass.range_constexpr(cute.size(tZs.shape[1])):
        if tZc[0, m, 0][0] >= n_valid:
            tZs[None, m, None].fill(0)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)


@cute.jit
def zero_rows_global(dtype: cutlass.Constexpr, rows: cutlass.Constexpr, cols: cutlass.Constexpr, copy_out: cute.TiledCopy,
                     gX: cute.Tensor, row0: cutlass.Int32, row_end: cutlass.Int32, tidx: cutlass.Int32):
    """Write zeros to the rows r of the (rows, cols) global tile gX with row0 + r < row_end (16-byte stores by
    the threads of copy_out, tidx below its thread count): the output of a tile with nothing to compute."""
    thr = copy_out.get_slice(tidx)
    tXgX = thr.partition_D(gX)
    tXcX = thr.partition_D(cute.make_identity_tensor((rows, cols)))
    tXrZ = cute.make_fragment_like(tXgX, dtype)
    tXrZ.fill(0)
    for m in cutlass.range_constexpr(cute.size(tXrZ.shape[1])):
        if row0 + tXcX[0, m, 0][0] < row_end:
            cute.copy(copy_out, tXrZ[None, m, None], tXgX[None, m, None])


@cute.jit
def store_rows_via_smem(acc: cute.Tensor, mul: cutlass.Float32, dtype: cutlass.Constexpr, tiled_mma: cute.TiledMma,
                        copy_out: cute.TiledCopy, sX: cute.Tensor, gX: cute.Tensor, rows: cutlass.Constexpr,
                        cols: cutlass.Constexpr, row0: cutlass.Int32, row_limit: cutlass.Int32, tidx: cutlass.Int32,
                        barrier_id: cutlass.Int32, num_threads: cutlass.Constexpr, row_end: cutlass.Int32):
    """mul * acc (a wgmma C fragment of the (rows, cols) tile) -> shared sX -> global gX (16-byte stores):
    tile rows with row0 + r < row_limit (the valid rows) get the values, rows with row_limit <= row0 + r <
    row_end (padding up to the sequence's slot end) get exact zeros (the accumulator of a padded row is
    never read), and nothing past row_end is touched, so a partial tile never writes a neighbouring
    sequence.  The caller barriers before (every GEMM reading sX is complete)."""
    rX = cute.make_fragment_like(acc, dtype)
    rX.store((acc.load() * mul).to(dtype))
    copy_r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype), tiled_mma)
    thr_r2s = copy_r2s.get_slice(tidx)
    cute.copy(copy_r2s, thr_r2s.retile(rX), thr_r2s.partition_D(sX))
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    thr_out = copy_out.get_slice(tidx)
    tXsX = thr_out.partition_S(sX)
    tXgX = thr_out.partition_D(gX)
    tXcX = thr_out.partition_D(cute.make_identity_tensor((rows, cols)))
    tXrX = cute.make_fragment_like(tXgX, dtype)
    cute.copy(copy_out, tXsX, tXrX)
    for m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
        row = row0 + tXcX[0, m, 0][0]
        if row >= row_limit:
            tXrX[None, m, None].fill(0)
        if row < cutlass.max(row_limit, row_end):
            cute.copy(copy_out, tXrX[None, m, None], tXgX[None, m, None])
