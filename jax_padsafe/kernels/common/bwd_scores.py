"""The backward's probability and score-gradient math, shared by the SM80-class and the Hopper kernels.

* `load_row_stats`: per-query lse (in the exp2 domain) and Delta for this thread's fragment, loaded
  only for valid rows; padded rows and rows with lse = -inf get the sentinel lse2 = +inf and Delta 0,
  and are turned into P = 0 by a select (never exp(-inf - -inf)).
* `probs_and_dscale`: recompute P from the score fragment and mask it with selects.
* `dscores`: dS = P * (dP - Delta) [* (1 - tanh^2)], 0 by select wherever P = 0.
* `load_row_stats_exact` / `probs_exact`: the same for the aux kernels (masks and biases as tensors),
  from the forward's separate row max m and ln l, with s - m formed first (see softmax.py).
* `probs_interior`, `probs_exact_interior`, `dscores_interior`: the same values without the selects, for a
  tile that lies inside the valid rectangle with every pair visible (bounds.tile_interior).
* The dQ kernels' row sums of P and dS (for dQ against a reference key and rowsum(P * dP)) are dq_shift's.
"""

import math

import cutlass
import cutlass.cute as cute


LOG2_E = math.log2(math.e)


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
def probs_interior(s_mn: cute.Tensor, lse2: cute.Tensor, score_mul: cutlass.Float32, query_mode: cutlass.Constexpr):
    """`probs_and_dscale` without softcap for a tile that lies inside the valid rectangle with every pair
    visible: the same P, bitwise, without its selects.  Every row there is valid and sees the tile's keys, so
    its lse2 is finite, and every score is finite (its Q and K rows are valid)."""
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            x = r if cutlass.const_expr(query_mode == 0) else c
            s_mn[r, c] = cute.math.exp2(s_mn[r, c] * score_mul - lse2[x], fastmath=True)


def _tree_sum(values: list):
    """The sum of a trace-time list of Float32 values, pairwise."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


@cute.jit
def dscores(
    p_mn: cute.Tensor,
    dp_mn: cute.Tensor,
    t_mn: cute.Tensor,
    delta: cute.Tensor,
    query_mode: cutlass.Constexpr,
    has_softcap: cutlass.Constexpr,
    sums=None,
):
    """In place dp <- P * (dP - Delta) [* (1 - tanh^2)].  Where P = 0 (masked, padded, empty rows)
    the result is a select to 0, so nothing from dP reaches it.  `sums` (the dQ kernels, queries as rows):
    dq_shift.make_sums' row sums, added to here."""
    for r in cutlass.range_constexpr(cute.size(p_mn, mode=[0])):
        terms = ([], [], [])  # this row's u, P and P (1 - tanh^2), summed as a tree (short dependency chains)
        for c in cutlass.range_constexpr(cute.size(p_mn, mode=[1])):
            x = r if cutlass.const_expr(query_mode == 0) else c
            p = p_mn[r, c]
            ds = p * (dp_mn[r, c] - delta[x])
            u = ds
            if cutlass.const_expr(has_softcap):
                ds = ds * t_mn[r, c]
            if p == cutlass.Float32(0.0):
                ds = cutlass.Float32(0.0)
                u = cutlass.Float32(0.0)
            dp_mn[r, c] = ds
            if cutlass.const_expr(sums is not None):
                terms[0].append(u)
                terms[1].append(p)
                if cutlass.const_expr(has_softcap):
                    terms[2].append(p * t_mn[r, c])
        if cutlass.const_expr(sums is not None):
            for k in cutlass.range_constexpr(3 if has_softcap else 2):
                sums[k][r] = sums[k][r] + _tree_sum(terms[k])


# ---------------------------------------------------------------- the aux kernels (natural-unit scores)

@cute.jit
def load_row_stats_exact(
    mRowMax: cute.Tensor,
    mLogSum: cute.Tensor,
    mDelta: cute.Tensor,
    head: cutlass.Int32,
    q_start: cutlass.Int32,
    q_len: cutlass.Int32,
    row0: cutlass.Int32,
    coords: cute.Tensor,
    row_max: cute.Tensor,
    log_sum2: cute.Tensor,
    delta: cute.Tensor,
    query_mode: cutlass.Constexpr,
):
    """`load_row_stats` for the aux kernels: the forward's exact statistics m (row_max) and ln l, the latter
    as log_sum2 = ln l * log2(e).  Rows at or past q_len are never read: row_max 0, log_sum2 = +inf, delta 0;
    an empty row (the forward wrote m = 0, ln l = +inf) also gets log_sum2 = +inf and delta 0.  The loads
    (`load_row_stats_exact_raw`) and the empty-row rule (`finish_row_stats_exact`) in one."""
    load_row_stats_exact_raw(mRowMax, mLogSum, mDelta, head, q_start, q_len, row0, coords, row_max, log_sum2,
                             delta, query_mode)
    finish_row_stats_exact(row_max, log_sum2, delta, row_max, log_sum2, delta)


@cute.jit
def load_row_stats_exact_raw(
    mRowMax: cute.Tensor,
    mLogSum: cute.Tensor,
    mDelta: cute.Tensor,
    head: cutlass.Int32,
    q_start: cutlass.Int32,
    q_len: cutlass.Int32,
    row0: cutlass.Int32,
    coords: cute.Tensor,
    raw_max: cute.Tensor,
    raw_log_sum: cute.Tensor,
    raw_delta: cute.Tensor,
    query_mode: cutlass.Constexpr,
):
    """The loads of `load_row_stats_exact`, as stored (m, ln l, Delta; 0, +inf, 0 for rows at or past q_len),
    all three issued together.  A kernel that loads a step ahead applies `finish_row_stats_exact` where it uses
    them: a select right after the loads makes the warp wait there for them (in-order issue), which in the
    Hopper dbias kernel, with m and Delta loaded only after testing ln l, took 11% of the stall samples."""
    for x in cutlass.range_constexpr(cute.size(raw_log_sum)):
        i = cutlass.Int32(0)
        if cutlass.const_expr(query_mode == 0):
            i = row0 + coords[x, 0][0]
        else:
            i = row0 + coords[0, x][1]
        m = cutlass.Float32(0.0)
        ls = cutlass.Float32.inf
        d = cutlass.Float32(0.0)
        if i < q_len:
            ls = mLogSum[head, q_start + i]
            m = mRowMax[head, q_start + i]
            d = mDelta[head, q_start + i]
        raw_max[x] = m
        raw_log_sum[x] = ls
        raw_delta[x] = d


@cute.jit
def finish_row_stats_exact(raw_max: cute.Tensor, raw_log_sum: cute.Tensor, raw_delta: cute.Tensor,
                           row_max: cute.Tensor, log_sum2: cute.Tensor, delta: cute.Tensor):
    """`load_row_stats_exact`'s values from `load_row_stats_exact_raw`'s (may be the same tensors): an empty
    row (ln l = +inf, as the forward writes it and as rows past q_len load) gets m = 0, log_sum2 = +inf, Delta
    = 0 by select, whatever its m and Delta hold."""
    for x in cutlass.range_constexpr(cute.size(log_sum2)):
        ls = raw_log_sum[x]
        m = cutlass.Float32(0.0)
        l2 = cutlass.Float32.inf
        d = cutlass.Float32(0.0)
        if ls != cutlass.Float32.inf:
            m = raw_max[x]
            l2 = ls * LOG2_E
            d = raw_delta[x]
        row_max[x] = m
        log_sum2[x] = l2
        delta[x] = d


@cute.jit
def probs_exact_interior(s_mn: cute.Tensor, row_max: cute.Tensor, log_sum2: cute.Tensor,
                         query_mode: cutlass.Constexpr):
    """`probs_exact` for a tile that lies inside the valid rectangle with every pair visible (no mask cell,
    window or causal edge hides one): the same P, bitwise, without its per-score tests.  A row the forward
    found empty (log_sum2 = +inf, m = 0) had every score -inf, and these are the same scores bitwise, so
    exp2(-inf) gives its P = 0 without probs_exact's select.  Two passes (s - m, then the exp2), so that the
    row max and ln l need not be held together."""
    rows = cute.size(s_mn, mode=[0])
    cols = cute.size(s_mn, mode=[1])
    for r in cutlass.range_constexpr(rows):
        for c in cutlass.range_constexpr(cols):
            x = r if cutlass.const_expr(query_mode == 0) else c
            s_mn[r, c] = s_mn[r, c] - row_max[x]
    for r in cutlass.range_constexpr(rows):
        for c in cutlass.range_constexpr(cols):
            x = r if cutlass.const_expr(query_mode == 0) else c
            s_mn[r, c] = cute.math.exp2(s_mn[r, c] * LOG2_E - log_sum2[x], fastmath=True)


@cute.jit
def dscores_interior(p_mn: cute.Tensor, dp_mn: cute.Tensor, delta: cute.Tensor, query_mode: cutlass.Constexpr,
                     sums=None):
    """`dscores` (no softcap) for a tile of `probs_exact_interior`: dp <- P * (dP - Delta) without the P = 0
    select.  There every Q, dO, K and V row is valid, so dP is finite and P = 0 gives dS = 0 by arithmetic
    (the sign of a zero aside).  `sums`: as in `dscores`."""
    for r in cutlass.range_constexpr(cute.size(p_mn, mode=[0])):
        terms = ([], [])  # this row's dS and P, summed as a tree
        for c in cutlass.range_constexpr(cute.size(p_mn, mode=[1])):
            x = r if cutlass.const_expr(query_mode == 0) else c
            p = p_mn[r, c]
            ds = p * (dp_mn[r, c] - delta[x])
            dp_mn[r, c] = ds
            if cutlass.const_expr(sums is not None):
                terms[0].append(ds)
                terms[1].append(p)
        if cutlass.const_expr(sums is not None):
            for k in cutlass.range_constexpr(2):
                sums[k][r] = sums[k][r] + _tree_sum(terms[k])


@cute.jit
def probs_exact(
    s_mn: cute.Tensor,
    c_mn: cute.Tensor,
    row_max: cute.Tensor,
    log_sum2: cute.Tensor,
    q0: cutlass.Int32,
    k0: cutlass.Int32,
    k_len: cutlass.Int32,
    off: cutlass.Int32,
    left: cutlass.Int32,
    right: cutlass.Int32,
    need_mask: cutlass.Boolean,
    query_mode: cutlass.Constexpr,
):
    """In place: natural-unit scores s (aux_scores.scores: q.k * scale + bias, -inf where the mask hides) ->
    P = exp2((s - m) * log2(e) - ln l * log2(e)).  The difference s - m comes first, so a bias as large as
    finfo(float32).min gives the same P as a small one.  P = 0 by select for pairs the visibility rule hides
    and for rows with the sentinel log_sum2 = +inf."""
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            x = r if cutlass.const_expr(query_mode == 0) else c
            l2 = log_sum2[x]
            p = cute.math.exp2((s_mn[r, c] - row_max[x]) * LOG2_E - l2, fastmath=True)
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
