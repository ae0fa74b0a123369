"""Zeroing of the output rows that no tile of the Hopper kernels writes, instead of a memset of the whole output.

The sm90 kernels (sm90/fwd, bwd_dkdv, bwd_dq) write every row of their tiles up to the sequence's slot end, rows
past the used length and tiles nothing sees as zeros.  Their grids (dense: ceil(max_seqlen / block) tiles per sequence;
compact: every tile that starts inside a slot) therefore write every row r of sequence b with

    cu[b] <= r < cu[b + 1]  and  r - cu[b] < max_seqlen.

The rows left are the lead before cu[0], the tail from cu[B] on, and the rows of a slot at or past max_seqlen
(a sequence longer than the bound under traced offsets; the runs of segment ids, whose last run of a batch row
reaches into the next row).  `ZeroUncoveredRows` writes zeros to exactly those rows (`row_outside_tiles`) and
touches nothing else, so on a packed batch with no lead or tail it only reads the offsets: a few microseconds
where the memset of a 16k-token, 16-head hd128 output writes 64 MB (~22 us on an H100).  The handlers launch it before
the attention kernel, in stream order, so the result is the memset's: the kernel's rows, zeros everywhere else.

The outputs are seen as rows of 16-byte words (a row is every head of one token: N x head_dim x 2 bytes, a
multiple of 16), so one compiled kernel serves bf16 and fp16 and every head count and head dim.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute


@cute.jit
def row_outside_tiles(cu: cute.Tensor, batch: cutlass.Int32, row: cutlass.Int32, bound: cutlass.Int32):
    """True iff no sm90 tile writes `row`: row < cu[0], row >= cu[batch], or row - cu[b] >= bound for the b with
    cu[b] <= row < cu[b + 1].

    The search keeps cu[lo] <= row < cu[hi] and halves [lo, hi); that invariant needs no ordering of cu, so the
    b it ends on satisfies the bracket even for offsets that are not non-decreasing (which the callers already
    forbid).  At most ceil(log2(batch)) dependent loads, 16 for 65535 sequences."""
    outside = cutlass.Boolean(True)
    if row >= cu[0] and row < cu[batch]:
        lo = cutlass.Int32(0)
        hi = batch
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if cu[mid] <= row:
                lo = mid
            else:
                hi = mid
        outside = row - cu[lo] >= bound
    return outside


class ZeroUncoveredRows:
    """Zeros the rows `row_outside_tiles` finds in one or two outputs that share their rows (dK and dV).

    Call: (mA, mB, mCu, bound, stream).  mA and mB are Int32 views [total_rows, words, 4] of the outputs (one
    16-byte word = 4 Int32); with num_outputs = 1, mB is ignored (pass mA again).  mCu is cu_seqlens [batch + 1]
    and `bound` the max_seqlen the attention kernel was launched with.

    A CTA owns 32 consecutive rows.  Every warp tests them, one row per lane, and so holds the same ballot of
    marked rows (the 8 searches share their loads through L1); then all 256 threads write each marked row
    together, one 16-byte store per thread per 4 KB of row.  A tail of padding rows is thereby spread over as
    many CTAs as it has 32-row groups, each with a full CTA of stores in flight.  Giving each warp 32 rows of its
    own to write instead keeps only 32 CTAs busy on a 4096-row tail: on a 16k-token buffer a quarter empty (H100,
    forward+backward, bench_varlen part_full) that saves 24-36 us of the ~66 us the memsets cost, this 41-54 us."""

    num_threads = 256
    rows_per_cta = 32

    def __init__(self, num_outputs: int):
        assert num_outputs in (1, 2)
        self.num_outputs = num_outputs

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mCu: cute.Tensor, bound: cutlass.Int32,
                 stream: cuda.CUstream):
        grid = (cute.ceil_div(cute.size(mA.shape[0]), self.rows_per_cta), 1, 1)
        self.kernel(mA, mB, mCu, bound).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mCu: cute.Tensor, bound: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        total = cute.size(mA.shape[0])
        words = cute.size(mA.shape[1])
        batch = cute.size(mCu.shape[0]) - 1
        first = cta * self.rows_per_cta
        row = first + lane
        outside = cutlass.Boolean(False)
        if row < total:
            outside = row_outside_tiles(mCu, batch, row, bound)
        marked = cute.arch.vote_ballot_sync(outside)
        zero = cute.make_rmem_tensor(4, cutlass.Int32)
        zero.fill(0)
        if marked != 0:
            for i in cutlass.range(self.rows_per_cta, unroll=1):
                if (marked >> i) & 1 != 0:
                    r = first + i
                    for w in cutlass.range(tidx, words, self.num_threads, unroll=1):
                        cute.autovec_copy(zero, mA[r, w, None])
                        if cutlass.const_expr(self.num_outputs == 2):
                            cute.autovec_copy(zero, mB[r, w, None])
