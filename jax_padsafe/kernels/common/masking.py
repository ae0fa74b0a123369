"""The visibility mask, applied to a score tile with selects (never by multiplying)."""

import cutlass
import cutlass.cute as cute


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an mma.sync C fragment ((2,2), MMA_M, MMA_N) as (rows, cols) of this thread."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.jit
def apply_visibility_mask(
    s_mn: cute.Tensor,
    c_mn: cute.Tensor,
    row0: cutlass.Int32,
    col0: cutlass.Int32,
    k_len: cutlass.Int32,
    off: cutlass.Int32,
    left: cutlass.Int32,
    right: cutlass.Int32,
):
    """Set s[i, j] = -inf wherever key j is not visible to query i.

    `c_mn` holds tile-local (row, col) coordinates matching `s_mn`; the key index is col0 + col,
    the query index row0 + row (both within their sequence).  Visible iff
    max(0, i + off - left) <= j < min(k_len, i + off + right + 1).
    """
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        i = row0 + c_mn[r, 0][0]
        lo = cutlass.max(i + off - left, 0)
        hi = cutlass.min(i + off + right + 1, k_len)
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            j = col0 + c_mn[0, c][1]
            if j < lo or j >= hi:
                s_mn[r, c] = -cutlass.Float32.inf


def acc_mn_view_sm90(acc: cute.Tensor) -> cute.Tensor:
    """View a Hopper wgmma C fragment ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols) of this thread.

    Per 64 x N wgmma atom a thread holds rows r and r + 8 (mode 0[1]) and, in each 8-column block
    (mode 0[2]), two adjacent columns (mode 0[0])."""
    lay = cute.make_layout(acc.layout.shape)
    s0, d0 = lay.shape[0], lay.stride[0]
    mn = cute.make_layout(
        ((s0[1], lay.shape[1]), (s0[0], s0[2], lay.shape[2])),
        stride=((d0[1], lay.stride[1]), (d0[0], d0[2], lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))
