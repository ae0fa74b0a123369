"""Shared-memory layouts and pad-safe tile loads (SM80-class: cp.async, ldmatrix)."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp


def row_block(head_dim: int) -> int:
    """The column block of the SM80-class layouts and copies: 64, 32 or 16 columns (128, 64 or 32 bytes of
    16-bit elements), the widest that divides head_dim."""
    return next(c for c in (64, 32, 16) if head_dim % c == 0)


def smem_layout(dtype, rows: int, head_dim: int):
    """Swizzled row-major (rows, head_dim) layout in atoms of 8 rows x `row_block(head_dim)` columns, swizzled
    over the atom's 16-byte chunks (so that ldmatrix reads 8 rows of one column block from distinct banks where
    the block has 4 or 8 chunks; a 16-column block, 2 chunks, halves the bank conflicts of no swizzle)."""
    k_block = row_block(head_dim)
    bits = {64: 3, 32: 2, 16: 1}[k_block]
    atom = cute.make_composed_layout(
        cute.make_swizzle(bits, 3, 3), 0, cute.make_layout((8, k_block), stride=(k_block, 1))
    )
    return cute.tile_to_shape(atom, (rows, head_dim), (0, 1))


def gmem_tiled_copy(dtype, head_dim: int, num_threads: int, async_copy: bool):
    """16-byte vector copies, a row of head_dim split over consecutive threads (a block of 64, 32 or 16 columns,
    the widest that divides head_dim)."""
    k_block = row_block(head_dim)
    elems = 128 // dtype.width
    op = (
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        if async_copy
        else cute.nvgpu.CopyUniversalOp()
    )
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=128)
    tpr = k_block // elems  # threads per row
    thr_layout = cute.make_layout((num_threads // tpr, tpr), stride=(tpr, 1))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, elems)))


@cute.jit
def load_rows_zero_fill(
    tiled_copy: cute.TiledCopy,
    src: cute.Tensor,
    dst: cute.Tensor,
    coord: cute.Tensor,
    row_base: cutlass.Int32,
    row_limit: cutlass.Int32,
):
    """Copy this thread's share of a (rows, head_dim) tile; rows at or past `row_limit` are never read.

    `src`/`dst`/`coord` are the thread's partitions (CPY_Atom, CPY_M, CPY_K) of the global tile,
    the shared tile and the tile-local identity tensor.  A row r is loaded (cp.async) iff
    `row_base + r < row_limit`; every other row is written with zeros in shared memory, so padded
    memory (NaN, Inf, garbage, or memory past the allocation) can never reach the tensor cores.
    """
    for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
        if row_base + coord[0, m, 0][0] < row_limit:
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)


def smem_tiled_copies(dtype, tiled_mma):
    """ldmatrix copies feeding the mma: Q (A), K (B), V^T (B, transposed)."""
    ldm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
    ldm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
    copy_q = cute.make_tiled_copy_A(cute.make_copy_atom(ldm, dtype), tiled_mma)
    copy_k = cute.make_tiled_copy_B(cute.make_copy_atom(ldm, dtype), tiled_mma)
    copy_v = cute.make_tiled_copy_B(cute.make_copy_atom(ldm_t, dtype), tiled_mma)
    return copy_q, copy_k, copy_v
