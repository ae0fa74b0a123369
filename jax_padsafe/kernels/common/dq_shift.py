"""dQ against a reference key: what keeps the dQ kernels exact when the keys share a large component.

dQ_i = sum_j dS_ij k_j with dS_ij = P_ij (dP_ij - Delta*_i), and Delta*_i = rowsum(P dP)_i - dlse_i is only
known to the preprocess as rowsum(dO * O) - dlse, from O rounded to the input dtype (and from the forward's
P rounded before P V).  Its error delta_i reaches dQ as delta_i * sum_j P_ij k_j: when the keys share a large
component c, that is delta_i * c, however small the true dQ is (sum_j dS*_ij k_j cancels c exactly).

For any vector k_ref, dQ_i = sum_j dS*_ij (k_j - k_ref) + e_i k_ref with e_i = sum_j dS*_ij, so the kernel
computes

    dQ_i = sum_j dS_ij k_j + f_i k_ref,    f_i = e_i - sum_j dS_ij = W_i (Delta_i - Delta*_i),

from its own dS (made with the preprocess's Delta): Delta's error then multiplies sum_j P_ij (k_j - k_ref)
instead of sum_j P_ij k_j.  That is a gain only where k_ref is close to the keys' weighted mean: a single key
as k_ref made dQ 5x worse on random keys when the values share a large component (Delta's error is large
there).  So k_ref is the shared component itself, per column d of the first key tile the kernel loads (its
valid rows; always at least one): the column's mean where it exceeds twice the column's standard deviation
(the keys sit in a narrow band around it, so their weighted mean does too), else 0 (dQ's error unchanged from
the unshifted kernel's in that column).  The row sums f takes are float32 sums of the kernel's own unrounded P
and dS, one add per element under the GEMMs:

    R_i = sum_j P_ij (dP_ij - Delta_i)      (dS before the softcap factor)
    B_i = sum_j P_ij                        (1 - P_sink with sinks: their weight is not in any key's P)
    W_i = sum_j P_ij (1 - tanh^2_ij)        (B_i without softcap)

and then rowsum(P dP)_i = R_i + Delta_i B_i exactly (no assumption that the P sum to 1), Delta*_i = that - dlse_i
(true with and without sinks: a sink has no value), and f_i = W_i (Delta_i + dlse_i - rowsum(P dP)_i).

The dQ kernel leaves rowsum(P dP) in the Delta workspace (it is launched last: the dK/dV kernel has read Delta
before): the bias gradient and the sinks' gradient take their Delta from it.  A call whose keys are only part
of each row's softmax (a ring attention step: ``partial_keys``) has neither e_i nor rowsum(P dP) of the whole
row: it skips both.
"""

import cutlass
import cutlass.cute as cute

from .softmax import quad_allreduce


def make_sums(n_rows: int, has_softcap: bool):
    """Zeroed per-row accumulators (R, B, W) of this thread's rows; W is B's tensor without softcap."""
    r = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
    b = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
    r.fill(0.0)
    b.fill(0.0)
    w = b
    if cutlass.const_expr(has_softcap):
        w = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        w.fill(0.0)
    return r, b, w


@cute.jit
def load_dlse(mdLSE: cute.Tensor, head: cutlass.Int32, q_start: cutlass.Int32, q_len: cutlass.Int32,
              row0: cutlass.Int32, coords: cute.Tensor, partial_keys: cutlass.Int32, dlse: cute.Tensor):
    """dlse[r] for this thread's rows (queries are rows), 0 for padded rows and partial-key calls: loaded with
    the other row statistics, before the key tiles, so that `finish` does not wait for it."""
    for x in cutlass.range_constexpr(cute.size(dlse)):
        i = row0 + coords[x, 0][0]
        v = cutlass.Float32(0.0)
        if i < q_len and partial_keys == 0:
            v = mdLSE[head, q_start + i]
        dlse[x] = v


@cute.jit
def finish(
    sums,
    delta: cute.Tensor,
    dlse: cute.Tensor,
    mDelta: cute.Tensor,
    head: cutlass.Int32,
    q_start: cutlass.Int32,
    q_len: cutlass.Int32,
    row0: cutlass.Int32,
    coords: cute.Tensor,
    partial_keys: cutlass.Int32,
    f: cute.Tensor,
):
    """f[r] for this thread's rows (0 for padded rows, rows that see no key, and partial-key calls), and
    rowsum(P dP) into mDelta for its valid rows (one lane of each quad writes; not for partial-key calls).
    `sums`: make_sums' accumulators after every key tile, reduced here over the quad that shares each row."""
    r_sum, b_sum, w_sum = sums
    lane = cute.arch.lane_idx()
    for x in cutlass.range_constexpr(cute.size(f)):
        rr = quad_allreduce(r_sum[x], lambda a, b: a + b)
        bb = quad_allreduce(b_sum[x], lambda a, b: a + b)
        ww = bb
        if cutlass.const_expr(w_sum is not b_sum):
            ww = quad_allreduce(w_sum[x], lambda a, b: a + b)
        i = row0 + coords[x, 0][0]
        fx = cutlass.Float32(0.0)
        if i < q_len and partial_keys == 0:
            p_dp = rr + delta[x] * bb
            # bb > 0: the row sees a key (a row without one has dS = 0 and f = 0, whatever dlse holds).
            if bb > cutlass.Float32(0.0):
                fx = ww * (delta[x] + dlse[x] - p_dp)
            if lane % 4 == 0:
                mDelta[head, q_start + i] = p_dp
        f[x] = fx


@cute.jit
def zero_row_sums(mDelta: cute.Tensor, head: cutlass.Int32, q_start: cutlass.Int32, q_len: cutlass.Int32,
                  row0: cutlass.Int32, block_m: cutlass.Constexpr, tidx: cutlass.Int32, num_threads: cutlass.Constexpr,
                  partial_keys: cutlass.Int32):
    """rowsum(P dP) = 0 into mDelta for the valid rows of a query tile that visits no key tile (its rows see no
    key), so that the workspace holds rowsum(P dP) for every valid row (not for partial-key calls)."""
    if partial_keys == 0:
        for x in cutlass.range(tidx, block_m, num_threads, unroll=1):
            if row0 + x < q_len:
                mDelta[head, q_start + row0 + x] = cutlass.Float32(0.0)


def _lanes_per_column(num_threads: int, head_dim: int) -> int:
    """The largest power of two g <= 32 with g * head_dim <= num_threads (1 when head_dim > num_threads)."""
    group = 1
    while group * 2 * head_dim <= num_threads and group * 2 <= 32:
        group *= 2
    return group


def _log2(n: int) -> int:
    return n.bit_length() - 1


@cute.jit
def reference_key(sK: cute.Tensor, n_valid: cutlass.Int32, sRef: cute.Tensor, tidx: cutlass.Int32,
                  num_threads: cutlass.Constexpr, head_dim: cutlass.Constexpr):
    """sRef[d] = k_ref's column d (see the module docstring) from the first n_valid >= 1 rows of the key tile
    `sK` (block_n x head_dim in shared memory), by every one of the caller's num_threads threads (every thread
    calls it); the caller orders these stores before `shift` reads them (a barrier).

    It runs once per query tile before the first GEMMs: each column's rows are split over `group` adjacent
    lanes (a power of two, num_threads // head_dim at most), whose partial sums meet by shuffles."""
    group = _lanes_per_column(num_threads, head_dim)
    for d0 in cutlass.range_constexpr(0, head_dim, num_threads // group):
        d = d0 + tidx // group
        g = tidx % group
        total = cutlass.Float32(0.0)
        squares = cutlass.Float32(0.0)
        rows = n_valid
        if d >= head_dim:
            rows = 0
        for r in cutlass.range(g, rows, group, unroll=4):
            x = sK[r, d].to(cutlass.Float32)
            total = total + x
            squares = squares + x * x
        for k in cutlass.range_constexpr(_log2(group)):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << k, mask=-1, mask_and_clamp=31)
            squares = squares + cute.arch.shuffle_sync_bfly(squares, offset=1 << k, mask=-1, mask_and_clamp=31)
        n = cutlass.Float32(n_valid)
        mean = total / n
        var = squares / n - mean * mean
        ref = cutlass.Float32(0.0)
        if mean * mean > cutlass.Float32(4.0) * var:
            ref = mean
        if g == 0 and d < head_dim:
            sRef[d] = ref


@cute.jit
def shift(dq_mn: cute.Tensor, coords_dq: cute.Tensor, f: cute.Tensor, sRef: cute.Tensor):
    """dQ[r, :] += f[r] * k_ref over this thread's rows x columns (`dq_mn`: the dQ accumulator's rows x columns
    view, whose rows are f's; `coords_dq` its (row, column) coordinates; `sRef`: reference_key's k_ref)."""
    for c in cutlass.range_constexpr(cute.size(dq_mn, mode=[1])):
        k = sRef[coords_dq[0, c][1]]
        for x in cutlass.range_constexpr(cute.size(dq_mn, mode=[0])):
            dq_mn[x, c] = dq_mn[x, c] + f[x] * k
