"""Online softmax in the exp2 domain; never evaluates exp(-inf - -inf).

Scores s arrive either already in the exp2 domain (multiplied by scale*log2(e), or soft-capped),
with mul = 1, or raw (q.k) with mul = scale*log2(e) > 0 folded into one FFMA per element.
Masked entries are -inf.  Per row the state is (m, l): running max of the raw scores and this
thread's partial sum of exp2(s*mul - m*mul).

The aux kernels (masks and biases given as tensors, `aux_scores`) pass natural-unit scores with
mul = log2(e) and `exact=True`: the difference s - m is taken before the multiplication.  A bias as large
as finfo(float32).min is finite in natural units but not times log2(e), and with |m| ~ 1e30 the product
s*mul - m*mul loses every bit of s - m; the difference of two floats of one row is exact.  `finalize_exact`
then keeps m and ln(l) apart (`lse = m + ln l` rounds to m when |m| >> ln l), so that the backward can
recompute P = exp(s - m - ln l) exactly.
"""

import math

import cutlass
import cutlass.cute as cute

LN2 = math.log(2.0)
LOG2_E = math.log2(math.e)


def quad_allreduce(val, op):
    """Reduce over the 4 threads of an mma.sync quad (they share a row)."""
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=2, mask=-1, mask_and_clamp=31))
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=1, mask=-1, mask_and_clamp=31))
    return val


@cute.jit
def online_softmax_step(
    s_mn: cute.Tensor, o_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, mul: cutlass.Float32,
    exact: cutlass.Constexpr = False,
):
    """Turn scores s into probabilities in place and rescale the O accumulator rows (mul > 0; `exact` as in
    online_softmax_step_alpha).

    The O rows are rescaled only when some row of the warp changed its max (otherwise every alpha is
    exactly 1.0, and skipping a multiplication by 1.0 changes no bit): after the first tiles this
    saves one FMUL per O accumulator element per tile."""
    alpha = cute.make_rmem_tensor(row_max.layout, cutlass.Float32)
    online_softmax_step_alpha(s_mn, row_max, row_sum, alpha, mul, exact)
    changed = cutlass.Boolean(False)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        if alpha[r] != 1.0:
            changed = cutlass.Boolean(True)
    if cute.arch.vote_any_sync(changed):
        rescale_rows(o_mn, alpha)


@cute.jit
def read_sink(mSinks: cute.Tensor, head: cutlass.Int32):
    """The sink logit of `head` (natural units), or -inf where the call has none (`mSinks` then has no
    elements)."""
    sink = -cutlass.Float32.inf
    if cute.size(mSinks.shape[0]) > 0:
        sink = mSinks[head]
    return sink


@cute.jit
def _row_total(m2: cutlass.Float32, l: cutlass.Float32, sink: cutlass.Float32):
    """(M, a, l'): the row's log2-domain max M = max(m2, sink * log2 e), the factor a = exp2(m2 - M) that
    rescales what the keys contributed, and the denominator with the sink, l' = l * a + exp2(sink * log2 e - M)
    (a non-empty row: l > 0, m2 finite, or NaN throughout).  Differences are taken before the exponentials,
    so neither a sink far above the scores nor one far below overflows."""
    s2 = sink * LOG2_E
    big = cute.arch.fmax(m2, s2)
    a = cute.math.exp2(m2 - big, fastmath=True)
    return big, a, l * a + cute.math.exp2(s2 - big, fastmath=True)


@cute.jit
def finalize(o_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, lse: cute.Tensor, mul: cutlass.Float32,
             sink: cutlass.Float32):
    """O /= l and lse = (m*mul + log2 l) * ln 2 per row.  A row that saw no visible key (l = 0: every
    probability was selected to 0) gets O = 0 exactly and lse = -inf (selects, no 0 * x).

    Empty is l == 0, not m == -inf: the max (fmax) skips NaN, so a valid row whose every score is NaN
    (NaN in its query) keeps m = -inf and would pass for empty, output 0, where plain attention gives
    NaN.  Its l is NaN, so it is not empty and O and lse come out NaN.  For finite scores the two tests
    agree (the row's maximum contributes exp2(0) = 1 to l), so no finite result changes.

    `sink` (natural units; -inf: none, and the code above runs unchanged) joins the denominator:
    O = acc * a / l', lse = (M + log2 l') * ln 2 (`_row_total`), and a row without a visible key gets O = 0
    and lse = sink."""
    has_sink = sink != -cutlass.Float32.inf
    for r in cutlass.range_constexpr(cute.size(row_max)):
        l = quad_allreduce(row_sum[r], lambda a, b: a + b)
        m = row_max[r]
        empty = l == cutlass.Float32(0.0)
        inv = cutlass.Float32(0.0)
        lse_r = sink
        if not empty:
            if has_sink:
                big, a, total = _row_total(m * mul, l, sink)
                inv = cute.arch.rcp_approx(total) * a
                lse_r = (big + cute.math.log2(total, fastmath=False)) * LN2
            else:
                inv = cute.arch.rcp_approx(l)
                lse_r = (m * mul + cute.math.log2(l, fastmath=False)) * LN2
        o_mn[r, None] = o_mn[r, None].load() * inv
        for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
            if empty:
                o_mn[r, c] = cutlass.Float32(0.0)
        lse[r] = lse_r


@cute.jit
def finalize_with_stats(o_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, lse: cute.Tensor,
                        mul: cutlass.Float32, max_out: cute.Tensor, log_sum: cute.Tensor, sink: cutlass.Float32):
    """`finalize` (raw scores, exp2 domain: the mask-only aux variants) that also gives the row statistics
    in natural units, as `finalize_exact` does: max_out = M * ln 2, log_sum = ln l' (M = m * mul and l' = l
    without a sink); a row that saw no visible key gets (0, +inf)."""
    finalize(o_mn, row_max, row_sum, lse, mul, sink)
    has_sink = sink != -cutlass.Float32.inf
    for r in cutlass.range_constexpr(cute.size(row_max)):
        l = quad_allreduce(row_sum[r], lambda a, b: a + b)
        m_r = cutlass.Float32(0.0)
        ln_l = cutlass.Float32.inf
        if l != cutlass.Float32(0.0):
            if has_sink:
                big, _, total = _row_total(row_max[r] * mul, l, sink)
                m_r = big * LN2
                ln_l = cute.math.log2(total, fastmath=False) * LN2
            else:
                m_r = row_max[r] * mul * LN2
                ln_l = cute.math.log2(l, fastmath=False) * LN2
        max_out[r] = m_r
        log_sum[r] = ln_l


@cute.jit
def finalize_exact(o_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, lse: cute.Tensor,
                   max_out: cute.Tensor, log_sum: cute.Tensor, sink: cutlass.Float32):
    """`finalize` for natural-unit scores (mul = log2 e, `exact` steps): O /= l, lse = m + ln l, and the
    backward's exact statistics max_out = m, log_sum = ln l.  A row that saw no visible key gets O = 0,
    lse = -inf, max_out = 0 and log_sum = +inf (P = exp(s - 0 - inf) = 0 for every s).

    With a `sink` (natural units): M = max(m, sink), l' = l exp(m - M) + exp(sink - M), O = acc exp(m - M) / l',
    lse = M + ln l', max_out = M, log_sum = ln l'; a row without a visible key gets lse = sink and (0, +inf)."""
    has_sink = sink != -cutlass.Float32.inf
    for r in cutlass.range_constexpr(cute.size(row_max)):
        l = quad_allreduce(row_sum[r], lambda a, b: a + b)
        m = row_max[r]
        empty = l == cutlass.Float32(0.0)
        inv = cutlass.Float32(0.0)
        lse_r = sink
        m_r = cutlass.Float32(0.0)
        ln_l = cutlass.Float32.inf
        if not empty:
            if has_sink:
                big = cute.arch.fmax(m, sink)
                a = cute.math.exp2((m - big) * LOG2_E, fastmath=True)
                total = l * a + cute.math.exp2((sink - big) * LOG2_E, fastmath=True)
                inv = cute.arch.rcp_approx(total) * a
                ln_l = cute.math.log2(total, fastmath=False) * LN2
                lse_r = big + ln_l
                m_r = big
            else:
                inv = cute.arch.rcp_approx(l)
                ln_l = cute.math.log2(l, fastmath=False) * LN2
                lse_r = m + ln_l
                m_r = m
        o_mn[r, None] = o_mn[r, None].load() * inv
        for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
            if empty:
                o_mn[r, c] = cutlass.Float32(0.0)
        lse[r] = lse_r
        max_out[r] = m_r
        log_sum[r] = ln_l


@cute.jit
def online_softmax_step_alpha(
    s_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, alpha: cute.Tensor, mul: cutlass.Float32,
    exact: cutlass.Constexpr = False, row_offset: cute.Tensor = None,
):
    """One online-softmax step without touching O: s becomes probabilities in place, (m, l) are
    updated, and the per-row rescale factors go to `alpha`.  Used directly by a caller whose O
    accumulator is still being written by an in-flight GEMM (apply with rescale_rows later).

    `row_offset` (raw scores only): this thread's scores of row r are s + row_offset[r] (the mask kind's
    folded ALiBi term, aux_scores.AlibiFold; it may differ between the threads of a row).  The offset joins
    the thread's max before the quad's reduction and the exp2's subtrahend, never the scores: the step
    then costs two more operations per row, not one per score.  An offset of 0 changes no bit."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = s_mn[r, None].load()
        m_thr = row.reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
        if cutlass.const_expr(row_offset is not None):
            m_thr = m_thr + row_offset[r]
        m_tile = quad_allreduce(m_thr, lambda a, b: cute.arch.fmax(a, b))
        m_old = row_max[r]
        m_new = cute.arch.fmax(m_old, m_tile)
        # A row with nothing visible so far keeps m = -inf; subtract 0 instead so that
        # exp2(-inf - m_safe) = 0 and never exp2(-inf + inf).
        m_safe = m_new
        if m_new == -cutlass.Float32.inf:
            m_safe = cutlass.Float32(0.0)
        if cutlass.const_expr(exact):
            p = cute.math.exp2((row - m_safe) * mul, fastmath=True)
            a = cute.math.exp2((m_old - m_safe) * mul, fastmath=True)
        elif cutlass.const_expr(row_offset is not None):
            m_scaled = m_safe * mul
            p = cute.math.exp2(row * mul - (m_safe - row_offset[r]) * mul, fastmath=True)
            a = cute.math.exp2(m_old * mul - m_scaled, fastmath=True)
        else:
            m_scaled = m_safe * mul
            p = cute.math.exp2(row * mul - m_scaled, fastmath=True)
            a = cute.math.exp2(m_old * mul - m_scaled, fastmath=True)
        row_sum[r] = row_sum[r] * a + p.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
        row_max[r] = m_new
        alpha[r] = a
        s_mn[r, None] = p


@cute.jit
def rescale_rows(o_mn: cute.Tensor, alpha: cute.Tensor):
    """o[r, :] *= alpha[r]."""
    for r in cutlass.range_constexpr(cute.size(alpha)):
        o_mn[r, None] = o_mn[r, None].load() * alpha[r]
