"""SM80-class flash-attention forward (mma.sync tensor cores + cp.async), pad-safe.

One CTA computes one (query tile, head, sequence).  Layout (packed / varlen):
  q [total_q, N, H], k/v [total_k, K, H], o [total_q, N, H], lse [N, total_q] float32,
  cu_seqlens_q/k int32 [B+1], seqused_q/k int32 [B].
The caller zero-fills o and lse (padded rows are never written here); this kernel writes the
valid rows of every sequence.  Loads of rows past a valid length are replaced by zeros in shared
memory, masking is done with selects, empty rows get O = 0 and lse = -inf.

`aux` builds the variant that takes masks and biases as tensors (common/aux_scores.py), in one of two kinds
(`aux_kind`):
  "bias"  scores in natural units (q.k * scale + bias, -inf where the mask hides), the exact-difference softmax,
          and the backward's exact row statistics (row max, ln of the row sum) written next to lse; a bias of
          any magnitude needs the natural units.
  "mask"  a mask alone: the plain kernel's raw scores and exp2-domain softmax (score_mul = scale * log2 e),
          -inf where the mask hides (aux_scores.mask_scores), so a tile the mask shows whole costs what it
          costs without a mask; the same row statistics are written (finalize_with_stats), the backward
          reads lse as the plain one does.
Both kinds share one __call__ (class FlashFwdSm80Aux): the extra tensors after mUsedK and the scalar aux_flags
after max_seqlen_q; the kind is fixed at compile time.
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from ..common import aux_scores, bounds, masking, softmax, tiles


def aux_kind(aux):
    """The constructors' `aux` keyword as a kind: False (plain kernel), "mask" or "bias".  True means "bias",
    the single aux variant that existed before the kinds."""
    if aux is True:
        return "bias"
    if not aux:
        return False
    assert aux in ("mask", "bias"), aux
    return aux


class FlashFwdSm80:
    """The forward kernel.  `stages`: K/V shared-memory stages, 1 or 2 (the build chooses per arch and head dim
    from the shared memory per SM: two CTAs per SM with two stages where they fit, else one stage)."""

    def __new__(cls, *args, aux=False, **kwargs):
        # The DSL compiles __call__'s fixed signature, so the aux variants (both kinds: one ABI) are a subclass
        # with its own __call__.
        return super().__new__(FlashFwdSm80Aux if aux_kind(aux) else cls)

    def __init__(self, dtype, head_dim: int, block_m: int, block_n: int, num_threads: int, has_softcap: bool,
                 stages: int, *, aux=False):
        assert head_dim % 16 == 0
        aux = aux_kind(aux)  # False, "mask" or "bias"; every kind-specific choice below is a const_expr on it
        assert not (aux and has_softcap)  # aux variants are built without softcap
        assert bool(aux) == isinstance(self, FlashFwdSm80Aux)  # the __call__ matches the kernel body
        self.aux = aux
        assert stages in (1, 2)
        self.stages = stages
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.block_n = block_n
        self.num_threads = num_threads
        self.has_softcap = has_softcap

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        sQ_layout = tiles.smem_layout(dtype, self.block_m, self.head_dim)
        sKV_layout = tiles.smem_layout(dtype, self.block_n, self.head_dim)

        n_kv = cute.cosize(sKV_layout) * self.stages  # stage s of K/V starts at s * cosize

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, n_kv], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, n_kv], 1024]

        copy_in = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=True)
        copy_out = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=False)
        tiled_mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1),
            permutation_mnk=(self.num_threads // 32 * 16, 16, 16),
        )
        grid = (
            cute.ceil_div(max_seqlen_q, self.block_m),
            cute.size(mQ.shape[1]),
            cute.size(mUsedQ.shape[0]),
        )
        self.kernel(
            mQ, mK, mV, mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK,
            score_mul, cap_mul, window_left, window_right, bottom_right,
            sQ_layout, sKV_layout, copy_in, copy_out, tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        m_block_rev, head, batch = cute.arch.block_idx()
        # Highest query tiles first: under causal/bottom-right masks they carry the most K tiles, so
        # the long CTAs start early and the short ones fill the tail.
        m_block = cute.arch.grid_dim()[0] - 1 - m_block_rev
        q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
        if m_block * self.block_m < q_len:
            args = (
                mQ, mK, mV, mO, mLSE, mSinks, mCuK, mUsedK, score_mul, cap_mul,
                window_left, window_right, bottom_right, sQ_layout, sKV_layout,
                copy_in, copy_out, tiled_mma, SharedStorage, m_block, head, batch, q_start, q_len,
            )
            # Without softcap the scale (> 0, checked by the FFI handler) is folded into the exp2 FFMA.
            self.tile(*args, not self.has_softcap)

    @cute.jit
    def tile(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedK: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        m_block: cutlass.Int32,
        head: cutlass.Int32,
        batch: cutlass.Int32,
        q_start: cutlass.Int32,
        q_len: cutlass.Int32,
        raw_scores: cutlass.Constexpr,
        aux_in=None,
    ):
        """One query tile.  `aux_in` (aux variant only): (AuxView of this sequence and head, mRowMax, mLogSum)."""
        BM = self.block_m
        BN = self.block_n
        HD = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        k_start, k_len = bounds.used_length(mCuK, mUsedK, batch)
        off, left, right = bounds.window_bounds(q_len, k_len, window_left, window_right, bottom_right)
        n_min, n_max = bounds.n_block_range(m_block, BM, BN, q_len, k_len, off, left, right)
        view = None
        if cutlass.const_expr(self.aux):
            # Skip the key tiles where the mask shows this query tile nothing (an empty range leaves the
            # tile exactly as an empty visibility range does: O = 0, lse = -inf).
            view = aux_in[0]
            n_min, n_max = aux_scores.key_tiles(view, m_block, BM, BN, n_min, n_max)
        head_kv = head // (mQ.shape[1] // mK.shape[1])
        m0 = m_block * BM
        mul = cutlass.Float32(1.0)
        if cutlass.const_expr(self.aux == "bias"):
            # aux_scores.scores gives natural units (the scale already applied): the exp2 domain is log2(e) away.
            mul = cutlass.Float32(aux_scores.LOG2_E)
        elif cutlass.const_expr(raw_scores):
            # The plain kernel without softcap, and the mask kind: raw q.k, the scale folded into the exp2 FFMA.
            mul = score_mul

        # Global tiles of this sequence and head.
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]), (BM, HD), (m_block, 0))
        gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head_kv, None]), (BN, HD), (None, 0))
        gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head_kv, None]), (BN, HD), (None, 0))

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        kv_stage = cute.cosize(sKV_layout)
        sK = [cute.make_tensor(storage.sK.data_ptr() + s * kv_stage, sKV_layout) for s in range(self.stages)]
        sV = [cute.make_tensor(storage.sV.data_ptr() + s * kv_stage, sKV_layout) for s in range(self.stages)]
        sVt = [cute.composition(x, cute.make_layout((HD, BN), stride=(BN, 1))) for x in sV]

        thr_in = copy_in.get_slice(tidx)
        tQgQ = thr_in.partition_S(gQ)
        tQsQ = thr_in.partition_D(sQ)
        tKgK = thr_in.partition_S(gK)
        tVgV = thr_in.partition_S(gV)
        tKsK = [thr_in.partition_D(x) for x in sK]
        tVsV = [thr_in.partition_D(x) for x in sV]
        tQcQ = thr_in.partition_S(cute.make_identity_tensor((BM, HD)))
        tKcK = thr_in.partition_S(cute.make_identity_tensor((BN, HD)))

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, HD)), cutlass.Float32)
        acc_O.fill(0.0)

        copy_q, copy_k, copy_v = tiles.smem_tiled_copies(self.dtype, tiled_mma)
        sthr_q = copy_q.get_slice(tidx)
        sthr_k = copy_k.get_slice(tidx)
        sthr_v = copy_v.get_slice(tidx)
        tSsQ = sthr_q.partition_S(sQ)
        tSrQ_v = sthr_q.retile(tSrQ)
        tSsK = [sthr_k.partition_S(x) for x in sK]
        tSrK_v = sthr_k.retile(tSrK)
        tOsVt = [sthr_v.partition_S(x) for x in sVt]
        tOrVt_v = sthr_v.retile(tOrVt)

        # Tile-local (row, col) coordinates of this thread's score fragment.
        tScS = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))
        cS_mn = masking.acc_mn_view(tScS)

        n_rows = cute.size(acc_O, mode=[1]) * 2
        row_max = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)

        ctx = SimpleNamespace(
            tiled_mma=tiled_mma, thr_mma=thr_mma, copy_q=copy_q, copy_k=copy_k, copy_v=copy_v,
            tSsQ=tSsQ, tSrQ=tSrQ, tSrQ_v=tSrQ_v, tSrK=tSrK, tSrK_v=tSrK_v, tOrVt=tOrVt, tOrVt_v=tOrVt_v,
            acc_O=acc_O, row_max=row_max, row_sum=row_sum, cS_mn=cS_mn, score_mul=score_mul, cap_mul=cap_mul,
            mul=mul, raw_scores=raw_scores, m_block=m_block, m0=m0, q_len=q_len, k_len=k_len, off=off,
            left=left, right=right, view=view,
        )

        if cutlass.const_expr(self.stages == 1):
            # Q and the last K tile; V(n) is loaded during S(n) = Q K(n)^T, K(n-1) during softmax and P V(n).
            tiles.load_rows_zero_fill(copy_in, tQgQ, tQsQ, tQcQ, m0, q_len)
            if n_max > n_min:
                tiles.load_rows_zero_fill(copy_in, tKgK[None, None, None, n_max - 1], tKsK[0], tKcK, (n_max - 1) * BN, k_len)
            cute.arch.cp_async_commit_group()
            for it in cutlass.range(n_max - n_min, unroll=1):
                n_block = n_max - 1 - it
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                tiles.load_rows_zero_fill(copy_in, tVgV[None, None, None, n_block], tVsV[0], tKcK, n_block * BN, k_len)
                cute.arch.cp_async_commit_group()
                acc_S = self.qk(ctx, tSsK[0])
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if n_block > n_min:
                    tiles.load_rows_zero_fill(copy_in, tKgK[None, None, None, n_block - 1], tKsK[0], tKcK, (n_block - 1) * BN, k_len)
                    cute.arch.cp_async_commit_group()
                self.softmax_pv(ctx, acc_S, n_block, tOsVt[0])
        else:
            # Two K/V stages: the loads of tile n-1 fly during the whole of tile n.  One barrier per tile:
            # after it, tile n is visible to every warp and every warp is done with tile n+1's stage,
            # which then receives tile n-1.  The stage is a run-time index (one copy of the loop body).
            tiles.load_rows_zero_fill(copy_in, tQgQ, tQsQ, tQcQ, m0, q_len)
            if n_max > n_min:
                tiles.load_rows_zero_fill(copy_in, tKgK[None, None, None, n_max - 1], tKsK[0], tKcK, (n_max - 1) * BN, k_len)
                tiles.load_rows_zero_fill(copy_in, tVgV[None, None, None, n_max - 1], tVsV[0], tKcK, (n_max - 1) * BN, k_len)
            cute.arch.cp_async_commit_group()
            for it in cutlass.range(n_max - n_min, unroll=1):
                n_block = n_max - 1 - it
                # Stage offsets are multiples of a whole swizzled tile (>= 1 KB): tell the compiler, or
                # it assumes 2-byte alignment and rejects the 16-byte cp.async.
                cur = cute.assume((it % 2) * kv_stage, divby=kv_stage)
                nxt = cute.assume(kv_stage - cur, divby=kv_stage)
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if n_block > n_min:
                    nb = n_block - 1
                    sK_nxt = cute.make_tensor(storage.sK.data_ptr() + nxt, sKV_layout)
                    sV_nxt = cute.make_tensor(storage.sV.data_ptr() + nxt, sKV_layout)
                    tiles.load_rows_zero_fill(copy_in, tKgK[None, None, None, nb], thr_in.partition_D(sK_nxt), tKcK, nb * BN, k_len)
                    tiles.load_rows_zero_fill(copy_in, tVgV[None, None, None, nb], thr_in.partition_D(sV_nxt), tKcK, nb * BN, k_len)
                    cute.arch.cp_async_commit_group()
                sK_cur = cute.make_tensor(storage.sK.data_ptr() + cur, sKV_layout)
                sVt_cur = cute.composition(cute.make_tensor(storage.sV.data_ptr() + cur, sKV_layout),
                                           cute.make_layout((HD, BN), stride=(BN, 1)))
                acc_S = self.qk(ctx, sthr_k.partition_S(sK_cur))
                self.softmax_pv(ctx, acc_S, n_block, sthr_v.partition_S(sVt_cur))

        # Epilogue.  Wait for every copy (also when no tile was visited) before sQ is reused.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        lse_rows = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        # The head's attention sink joins each row's denominator here (-inf: the call has none).
        sink = softmax.read_sink(mSinks, head)
        max_rows, logsum_rows = None, None
        if cutlass.const_expr(self.aux):
            max_rows = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            logsum_rows = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
            if cutlass.const_expr(self.aux == "mask"):
                # The plain epilogue (this kind's backward reads lse), plus m and ln l in natural units: the
                # aux ABI returns them whatever the kind.
                softmax.finalize_with_stats(masking.acc_mn_view(acc_O), row_max, row_sum, lse_rows, mul, max_rows,
                                            logsum_rows, sink)
            else:
                # m and ln l kept apart (lse = m + ln l rounds to m when |m| >> ln l): the backward's exact P.
                softmax.finalize_exact(masking.acc_mn_view(acc_O), row_max, row_sum, lse_rows, max_rows,
                                       logsum_rows, sink)
        else:
            softmax.finalize(masking.acc_mn_view(acc_O), row_max, row_sum, lse_rows, mul, sink)

        # lse (and the aux variant's row statistics): one thread of each quad writes its valid rows.
        cO_mn = masking.acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((BM, HD))))
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                i = m0 + cO_mn[r, 0][0]
                if i < q_len:
                    mLSE[head, q_start + i] = lse_rows[r]
                    if cutlass.const_expr(self.aux):
                        aux_in[1][head, q_start + i] = max_rows[r]
                        aux_in[2][head, q_start + i] = logsum_rows[r]

        # O: registers -> shared (reuse sQ) -> global, valid rows only.
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, sQ_layout)
        copy_r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma)
        thr_r2s = copy_r2s.get_slice(tidx)
        cute.copy(copy_r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
        cute.arch.barrier()
        gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), (BM, HD), (m_block, 0))
        thr_out = copy_out.get_slice(tidx)
        tOsO = thr_out.partition_S(sO)
        tOgO = thr_out.partition_D(gO)
        tOcO = thr_out.partition_D(cute.make_identity_tensor((BM, HD)))
        tOrO = cute.make_fragment_like(tOgO, self.dtype)
        cute.copy(copy_out, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if m0 + tOcO[0, m, 0][0] < q_len:
                cute.copy(copy_out, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def qk(self, ctx: SimpleNamespace, tSsK: cute.Tensor):
        """S = Q K^T for one K tile (ldmatrix of k-slice k+1 overlapped with the mma of slice k)."""
        acc_S = cute.make_rmem_tensor(ctx.thr_mma.partition_shape_C((self.block_m, self.block_n)), cutlass.Float32)
        acc_S.fill(0.0)
        cute.copy(ctx.copy_q, ctx.tSsQ[None, None, 0], ctx.tSrQ_v[None, None, 0])
        cute.copy(ctx.copy_k, tSsK[None, None, 0], ctx.tSrK_v[None, None, 0])
        nk = cute.size(ctx.tSsQ.shape[2])
        for k in cutlass.range_constexpr(nk):
            if k + 1 < nk:
                cute.copy(ctx.copy_q, ctx.tSsQ[None, None, k + 1], ctx.tSrQ_v[None, None, k + 1])
                cute.copy(ctx.copy_k, tSsK[None, None, k + 1], ctx.tSrK_v[None, None, k + 1])
            cute.gemm(ctx.tiled_mma, acc_S, ctx.tSrQ[None, None, k], ctx.tSrK[None, None, k], acc_S)
        return acc_S

    @cute.jit
    def softmax_pv(self, ctx: SimpleNamespace, acc_S: cute.Tensor, n_block: cutlass.Int32, tOsVt: cute.Tensor):
        """Scores (raw, or scaled / soft-capped, or the bias kind's natural units, or the mask kind's raw scores
        with the mask), visibility mask, online softmax, O += P V."""
        s_mn = masking.acc_mn_view(acc_S)
        if cutlass.const_expr(self.aux):
            # tile_class is warp-collective: every thread runs this for every tile of its range.  A HIDDEN tile
            # inside the range comes out all -inf (P = 0, the softmax state unchanged).
            cls = aux_scores.tile_class(ctx.view, ctx.m_block, n_block, self.block_m, self.block_n)
            if cutlass.const_expr(self.aux == "mask"):
                # Raw scores stay raw (mul = score_mul folds the scale into the exp2 FFMA, as without a mask).
                aux_scores.mask_scores(s_mn, ctx.cS_mn, ctx.view, ctx.m0, n_block * self.block_n, ctx.q_len,
                                       ctx.k_len, cls, 0)
            else:
                aux_scores.scores(s_mn, ctx.cS_mn, ctx.view, ctx.m0, n_block * self.block_n, ctx.q_len, ctx.k_len,
                                  ctx.score_mul, cls, 0)
        elif cutlass.const_expr(self.has_softcap):
            acc_S.store(cute.math.tanh(acc_S.load() * ctx.score_mul, fastmath=False) * ctx.cap_mul)
        elif cutlass.const_expr(not ctx.raw_scores):
            acc_S.store(acc_S.load() * ctx.score_mul)
        if bounds.tile_needs_mask(n_block, ctx.m_block, self.block_m, self.block_n, ctx.q_len, ctx.k_len, ctx.off,
                                  ctx.left, ctx.right):
            masking.apply_visibility_mask(s_mn, ctx.cS_mn, ctx.m0, n_block * self.block_n, ctx.k_len, ctx.off,
                                          ctx.left, ctx.right)
        softmax.online_softmax_step(s_mn, masking.acc_mn_view(ctx.acc_O), ctx.row_max, ctx.row_sum, ctx.mul,
                                    exact=self.aux == "bias")
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        tOrP = cute.make_tensor(rP.iterator, self._c_to_a_layout(rP.layout))
        cute.copy(ctx.copy_v, tOsVt[None, None, 0], ctx.tOrVt_v[None, None, 0])
        nv = cute.size(tOrP.shape[2])
        for k in cutlass.range_constexpr(nv):
            if k + 1 < nv:
                cute.copy(ctx.copy_v, tOsVt[None, None, k + 1], ctx.tOrVt_v[None, None, k + 1])
            cute.gemm(ctx.tiled_mma, ctx.acc_O, tOrP[None, None, k], ctx.tOrVt[None, None, k], ctx.acc_O)

    def _c_to_a_layout(self, layout):
        """mma C fragment (4, MMA_M, MMA_N) -> A fragment ((4, 2), MMA_M, MMA_N / 2) for P @ V."""
        d = cute.logical_divide(layout, (None, None, 2))
        return cute.make_layout(
            ((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
            stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]),
        )


class FlashFwdSm80Aux(FlashFwdSm80):
    """The aux variants (what FlashFwdSm80(..., aux="mask" | "bias") builds; one ABI for both kinds): masks and
    biases as tensors, and the row statistics mRowMax / mLogSum ([N, total_q], natural units, written where
    mLSE is).  score_mul is the plain kernel's scale * log2 e for the mask kind, the scale for the bias kind.
    The mask's row ranges double as the view's column ranges, which the forward never reads."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mMask: cute.Tensor,
        mBias: cute.Tensor,
        mBias32: cute.Tensor,
        mTileMap: cute.Tensor,
        mRowRange: cute.Tensor,
        mRowMax: cute.Tensor,
        mLogSum: cute.Tensor,
        mSlopes: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        max_seqlen_q: cutlass.Int32,
        aux_flags: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        sQ_layout = tiles.smem_layout(dtype, self.block_m, self.head_dim)
        sKV_layout = tiles.smem_layout(dtype, self.block_n, self.head_dim)

        n_kv = cute.cosize(sKV_layout) * self.stages

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, n_kv], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, n_kv], 1024]

        copy_in = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=True)
        copy_out = tiles.gmem_tiled_copy(dtype, self.head_dim, self.num_threads, async_copy=False)
        tiled_mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1),
            permutation_mnk=(self.num_threads // 32 * 16, 16, 16),
        )
        grid = (
            cute.ceil_div(max_seqlen_q, self.block_m),
            cute.size(mQ.shape[1]),
            cute.size(mUsedQ.shape[0]),
        )
        self.kernel_aux(
            mQ, mK, mV, mO, mLSE, mSinks, mCuQ, mCuK, mUsedQ, mUsedK,
            mMask, mBias, mBias32, mTileMap, mRowRange, mRowMax, mLogSum, mSlopes,
            score_mul, cap_mul, window_left, window_right, bottom_right, aux_flags,
            sQ_layout, sKV_layout, copy_in, copy_out, tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel_aux(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: cute.Tensor,
        mCuQ: cute.Tensor,
        mCuK: cute.Tensor,
        mUsedQ: cute.Tensor,
        mUsedK: cute.Tensor,
        mMask: cute.Tensor,
        mBias: cute.Tensor,
        mBias32: cute.Tensor,
        mTileMap: cute.Tensor,
        mRowRange: cute.Tensor,
        mRowMax: cute.Tensor,
        mLogSum: cute.Tensor,
        mSlopes: cute.Tensor,
        score_mul: cutlass.Float32,
        cap_mul: cutlass.Float32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        bottom_right: cutlass.Int32,
        aux_flags: cutlass.Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        copy_in: cute.TiledCopy,
        copy_out: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        m_block_rev, head, batch = cute.arch.block_idx()
        m_block = cute.arch.grid_dim()[0] - 1 - m_block_rev
        q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
        if m_block * self.block_m < q_len:
            view = aux_scores.view(mMask, mBias, mBias32, mTileMap, mRowRange, mRowRange, mSlopes, aux_flags, batch,
                                   head, mQ.shape[1])
            self.tile(
                mQ, mK, mV, mO, mLSE, mSinks, mCuK, mUsedK, score_mul, cap_mul,
                window_left, window_right, bottom_right, sQ_layout, sKV_layout,
                copy_in, copy_out, tiled_mma, SharedStorage, m_block, head, batch, q_start, q_len,
                True, (view, mRowMax, mLogSum),
            )
