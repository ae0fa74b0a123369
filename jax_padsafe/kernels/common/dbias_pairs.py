"""The bias gradient kernels' walk over the (sequence, query head) pairs one dbias tile sums (both families).

A bias is [Bx, Hx, Tx, S] with Bx in {1, B} and Hx in {1, N}, so one dbias cell is the sum of dS over every
(sequence, query head) that maps to it.  A dbias CTA owns one (block_m x block_n) tile of one (bx, hx) slice
and walks those pairs in a fixed order (b ascending, then h ascending), which makes the sum bitwise
deterministic without atomics.  Which pairs contribute, and where each pair's rows and keys start, is decided
here, so the SM80-class kernel (cp.async, one role) and the Hopper one (a TMA producer warp and consumer
warpgroups that each walk the pairs) agree on it by construction.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute

from . import aux_scores, bounds


class Pairs(NamedTuple):
    """What a CTA needs to walk its (b, h) pairs: pair p is sequence b_first + p // group, query head
    h_first + p % group; n_pairs of them (0 when the slice's sequence is not one of this call's)."""
    cu_q: cute.Tensor
    cu_k: cute.Tensor
    used_q: cute.Tensor
    used_k: cute.Tensor
    mask: cute.Tensor
    bias: cute.Tensor
    bias32: cute.Tensor
    tile_map: cute.Tensor
    row_range: cute.Tensor
    slopes: cute.Tensor
    flags: cutlass.Int32
    window_left: cutlass.Int32
    window_right: cutlass.Int32
    bottom_right: cutlass.Int32
    m_block: cutlass.Int32
    n_block: cutlass.Int32
    b_first: cutlass.Int32
    h_first: cutlass.Int32
    group: cutlass.Int32
    num_heads: cutlass.Int32
    n_pairs: cutlass.Int32
    bx: cutlass.Int32
    hx: cutlass.Int32


@cute.jit
def make(mCuQ: cute.Tensor, mCuK: cute.Tensor, mUsedQ: cute.Tensor, mUsedK: cute.Tensor, mMask: cute.Tensor,
         mBias: cute.Tensor, mBias32: cute.Tensor, mTileMap: cute.Tensor, mRowRange: cute.Tensor,
         mSlopes: cute.Tensor, mdBias: cute.Tensor, mdBias32: cute.Tensor, aux_flags: cutlass.Int32,
         window_left: cutlass.Int32, window_right: cutlass.Int32, bottom_right: cutlass.Int32,
         num_heads: cutlass.Int32, m_block: cutlass.Int32, n_block: cutlass.Int32,
         slice_idx: cutlass.Int32) -> Pairs:
    """The pairs of slice `slice_idx` (bx * Hx + hx of the live dbias tensor) for tile (m_block, n_block)."""
    # The live dbias tensor's broadcast sizes (the placeholder is (1, 1, 1, 1), so the max is the live one's).
    Bx = cutlass.max(cute.size(mdBias.shape[0]), cute.size(mdBias32.shape[0]))
    Hx = cutlass.max(cute.size(mdBias.shape[1]), cute.size(mdBias32.shape[1]))
    bx = slice_idx // Hx
    hx = slice_idx % Hx
    group = num_heads // Hx  # query heads per bias head
    # Every sequence (Bx = 1) or sequence bx, the query heads of bias head hx.
    num_seqs = cute.size(mUsedQ.shape[0])
    b_first = bx
    n_pairs = group
    if Bx == 1:
        b_first = cutlass.Int32(0)
        n_pairs = num_seqs * group
    if b_first >= num_seqs:
        n_pairs = cutlass.Int32(0)  # not a sequence of this call: nothing is read, the tile gets zeros
    return Pairs(mCuQ, mCuK, mUsedQ, mUsedK, mMask, mBias, mBias32, mTileMap, mRowRange, mSlopes, aux_flags,
                 window_left, window_right, bottom_right, m_block, n_block, b_first, hx * group, group, num_heads,
                 n_pairs, bx, hx)


@cute.jit
def pair_bounds(p: cutlass.Int32, args: Pairs):
    """(b, h, q_start, q_len, k_start, k_len, off, left, right) of pair p."""
    # A bias per query head (group 1, the common [1, N, T, S]) walks the sequences without a division.
    b = args.b_first + p
    h = args.h_first
    if args.group != 1:
        b = args.b_first + p // args.group
        h = args.h_first + p % args.group
    q_start, q_len = bounds.used_length(args.cu_q, args.used_q, b)
    k_start, k_len = bounds.used_length(args.cu_k, args.used_k, b)
    off, left, right = bounds.window_bounds(q_len, k_len, args.window_left, args.window_right, args.bottom_right)
    return b, h, q_start, q_len, k_start, k_len, off, left, right


@cute.jit
def pair_view(b: cutlass.Int32, h: cutlass.Int32, args: Pairs) -> aux_scores.AuxView:
    # The col-range slot of the view is unused here (no query-tile narrowing).
    return aux_scores.view(args.mask, args.bias, args.bias32, args.tile_map, args.row_range, args.row_range,
                           args.slopes, args.flags, b, h, args.num_heads)


@cute.jit
def next_active(p: cutlass.Int32, args: Pairs, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr):
    """The first pair >= p that contributes to the tile (n_pairs when none): the tile's rows start below q_len
    and its key tile lies in the query tile's key-tile range, narrowed by the mask's block summary."""
    m_block, n_block = args.m_block, args.n_block
    q = p
    searching = q < args.n_pairs
    while searching:
        b, h, _, q_len, _, k_len, off, left, right = pair_bounds(q, args)
        found = cutlass.Boolean(False)
        if m_block * block_m < q_len:
            n_min, n_max = bounds.n_block_range(m_block, block_m, block_n, q_len, k_len, off, left, right)
            n_min, n_max = aux_scores.key_tiles(pair_view(b, h, args), m_block, block_m, block_n, n_min, n_max)
            if n_block >= n_min and n_block < n_max:
                found = cutlass.Boolean(True)
        if found:
            searching = cutlass.Boolean(False)
        else:
            q = q + 1
            searching = q < args.n_pairs
    return q


@cute.jit
def store_tile(acc: cute.Tensor, mn_view, c_mn: cute.Tensor, mdBias: cute.Tensor, mdBias32: cute.Tensor,
               flags: cutlass.Int32, bx: cutlass.Int32, hx: cutlass.Int32, m0: cutlass.Int32, m1: cutlass.Int32):
    """A tile's dbias from its float32 accumulator `acc` into the live tensor: in the input dtype (FLAG_BIAS,
    rounded once) or in float32 (FLAG_BIAS32).  `mn_view` gives the (rows, cols) view of the accumulator's
    layout (the family's MMA); `c_mn` the cells' tile coordinates in it; (m0, m1) the tile's first query and key."""
    if (flags & aux_scores.FLAG_BIAS) != 0:
        r = cute.make_fragment_like(acc, mdBias.element_type)
        r.store(acc.load().to(mdBias.element_type))
        store(mn_view(r), c_mn, mdBias, bx, hx, m0, m1)
    elif (flags & aux_scores.FLAG_BIAS32) != 0:
        store(mn_view(acc), c_mn, mdBias32, bx, hx, m0, m1)


@cute.jit
def store(r_mn: cute.Tensor, c_mn: cute.Tensor, mdB: cute.Tensor, bx: cutlass.Int32, hx: cutlass.Int32,
          m0: cutlass.Int32, n0: cutlass.Int32):
    """mdB[bx, hx, i, j] = r_mn[r, c] (this thread's cells as (rows, cols), already in mdB's type; c_mn their
    tile coordinates) for every cell of the tile inside [0, Tx) x [0, S) of mdB.  Every cell of the tile inside
    the tensor is written (zeros where no pair contributes), so the output needs no memset.  Two adjacent keys
    per store where the fragment's columns come as pairs starting at an even key and S is even (the pair is
    then aligned, and inside the tensor when its first key is); one element per store otherwise (S may be odd
    and the tensor only element-aligned)."""
    rows = cute.size(mdB.shape[2])
    cols = cute.size(mdB.shape[3])
    if bx < cute.size(mdB.shape[0]) and hx < cute.size(mdB.shape[1]):
        gB = mdB[bx, hx, None, None]
        paired = cutlass.Boolean(False)
        if cutlass.const_expr(cute.size(r_mn, mode=[1]) % 2 == 0):
            paired = cols % 2 == 0
            for c in cutlass.range_constexpr(cute.size(r_mn, mode=[1]) // 2):
                j = n0 + c_mn[0, 2 * c][1]
                paired = paired and j % 2 == 0 and n0 + c_mn[0, 2 * c + 1][1] == j + 1
        if paired:
            width = mdB.element_type.width // 8
            two = cute.make_rmem_tensor((2,), mdB.element_type)
            for r in cutlass.range_constexpr(cute.size(r_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(r_mn, mode=[1]) // 2):
                    i = m0 + c_mn[r, 2 * c][0]
                    j = n0 + c_mn[r, 2 * c][1]
                    if i < rows and j < cols:
                        addr = (gB.iterator + cute.crd2idx((i, j), gB.layout)).toint()
                        dst = cute.make_tensor(cute.make_ptr(mdB.element_type, addr, cute.AddressSpace.gmem,
                                                             assumed_align=2 * width), cute.make_layout(2))
                        two[0] = r_mn[r, 2 * c]
                        two[1] = r_mn[r, 2 * c + 1]
                        dst.store(two.load())
        else:
            for r in cutlass.range_constexpr(cute.size(r_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(r_mn, mode=[1])):
                    i = m0 + c_mn[r, c][0]
                    j = n0 + c_mn[r, c][1]
                    if i < rows and j < cols:
                        gB[i, j] = r_mn[r, c]
