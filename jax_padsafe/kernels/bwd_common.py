"""Building blocks of the backward kernels that the forward does not need.

* `m_block_range`: the query tiles a key tile must visit (the transpose of `bounds.n_block_range`).
* `load_row_stats`: per-query lse (in the exp2 domain) and Delta for this thread's fragment, loaded
  only for valid rows; padded rows and rows with lse = -inf get the sentinel lse2 = +inf and Delta 0,
  and are turned into P = 0 by a select (never exp(-inf - -inf)).
* `probs_and_dscale`: recompute P from the score fragment and mask it with selects.
* `gemm_ss` / `gemm_rs`: mma.sync GEMMs with ldmatrix-fed operands (shared/shared, register/shared).
* `store_rows`: accumulator -> shared -> global for rows below a valid length only.
* `smem_tiles_struct`: the shared-memory struct of a kernel configuration (only the buffers it uses).
"""

import math

import cutlass
import cutlass.cute as cute

LOG2_E = math.log2(math.e)


@cute.jit
def m_block_range(
    n_block: cutlass.Int32,
    block_m: cutlass.Constexpr,
    block_n: cutlass.Constexpr,
    q_len: cutlass.Int32,
    k_len: cutlass.Int32,
    off: cutlass.Int32,
    left: cutlass.Int32,
    right: cutlass.Int32,
):
    """[m_min, m_max) of query tiles holding at least one valid query that sees a valid key of this
    key tile.  Query i sees key j iff i + off - left <= j <= i + off + right (and both valid)."""
    n0 = n_block * block_n
    n_last = cutlass.min(n0 + block_n, k_len) - 1
    m_lo = cutlass.max(n0 - off - right, 0)
    m_hi = cutlass.min(n_last - off + left + 1, q_len)
    m_min = m_lo // block_m
    m_max = m_min
    if m_hi > m_lo:
        m_max = (m_hi + block_m - 1) // block_m
    return m_min, m_max


@cute.jit
def load_row_stats(
    mLSE: cute.Tensor,
    mDelta: cute.Tensor,
    head: cutlass.Int32,
    q_start: cutlass.Int32,
    q_len: cutlass.Int32,
    row0: cutlass.Int32,
    coords: cute.Tensor,
    lse2: cute.Tensor,
    delta: cute.Tensor,
    query_mode: cutlass.Constexpr,
):
    """lse2[x] = lse * log2(e) and delta[x] for the x-th query coordinate of this thread's fragment
    (`coords` is the (rows, cols) coordinate view; `query_mode` 0: queries are rows, 1: columns).
    Rows at or past q_len are never read: lse2 = +inf, delta = 0.  lse = -inf (no visible key):
    lse2 = +inf, delta = 0."""
    for x in cutlass.range_constexpr(cute.size(lse2)):
        i = cutlass.Int32(0)
        if cutlass.const_expr(query_mode == 0):
            i = row0 + coords[x, 0][0]
        else:
            i = row0 + coords[0, x][1]
        l2 = cutlass.Float32.inf
        d = cutlass.Float32(0.0)
        if i < q_len:
            lv = mLSE[head, q_start + i]
            if lv != -cutlass.Float32.inf:
                l2 = lv * LOG2_E
                d = mDelta[head, q_start + i]
        lse2[x] = l2
        delta[x] = d


@cute.jit
def probs_and_dscale(
    s_mn: cute.Tensor,
    t_mn: cute.Tensor,
    c_mn: cute.Tensor,
    lse2: cute.Tensor,
    q0: cutlass.Int32,
    k0: cutlass.Int32,
    k_len: cutlass.Int32,
    off: cutlass.Int32,
    left: cutlass.Int32,
    right: cutlass.Int32,
    score_mul: cutlass.Float32,
    cap_mul: cutlass.Float32,
    need_mask: cutlass.Boolean,
    query_mode: cutlass.Constexpr,
    has_softcap: cutlass.Constexpr,
):
    """In place: raw scores q.k -> P = exp2(s2 - lse2) with s2 = q.k * scale * log2(e), or
    tanh(q.k * scale / c) * c * log2(e) when soft-capped (then t_mn receives 1 - tanh^2, the softcap
    derivative).  P = 0 by select for invisible pairs and for rows with the sentinel lse2 = +inf."""
    nr = cute.size(s_mn, mode=[0])
    nc = cute.size(s_mn, mode=[1])
    for r in cutlass.range_constexpr(nr):
        for c in cutlass.range_constexpr(nc):
            x = r if cutlass.const_expr(query_mode == 0) else c
            l2 = lse2[x]
            s = s_mn[r, c]
            s2 = s * score_mul
            if cutlass.const_expr(has_softcap):
                th = cute.math.tanh(s2, fastmath=False)
                t_mn[r, c] = 1.0 - th * th
                s2 = th * cap_mul
            p = cute.math.exp2(s2 - l2, fastmath=True)
            if l2 == cutlass.Float32.inf:
                p = cutlass.Float32(0.0)
            if need_mask:
                i = q0 + c_mn[r, c][0]
                j = k0 + c_mn[r, c][1]
                if cutlass.const_expr(query_mode == 1):
                    i = q0 + c_mn[r, c][1]
                    j = k0 + c_mn[r, c][0]
                lo = cutlass.max(i + off - left, 0)
                hi = cutlass.min(i + off + right + 1, k_len)
                if j < lo or j >= hi:
                    p = cutlass.Float32(0.0)
            s_mn[r, c] = p


@cute.jit
def dscores(
    p_mn: cute.Tensor,
    dp_mn: cute.Tensor,
    t_mn: cute.Tensor,
    delta: cute.Tensor,
    query_mode: cutlass.Constexpr,
    has_softcap: cutlass.Constexpr,
):
    """In place dp <- P * (dP - Delta) [* (1 - tanh^2)].  Where P = 0 (masked, padded, empty rows)
    the result is a select to 0, so nothing from dP reaches it."""
    for r in cutlass.range_constexpr(cute.size(p_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(p_mn, mode=[1])):
            x = r if cutlass.const_expr(query_mode == 0) else c
            p = p_mn[r, c]
            ds = p * (dp_mn[r, c] - delta[x])
            if cutlass.const_expr(has_softcap):
                ds = ds * t_mn[r, c]
            if p == cutlass.Float32(0.0):
                ds = cutlass.Float32(0.0)
            dp_mn[r, c] = ds


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
