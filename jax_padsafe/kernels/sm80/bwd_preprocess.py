"""The backward's first kernel: Delta = rowsum(dO * O) - dlse per valid query row (SM80-class; the Hopper
backward launches it too)."""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from ..common import bounds, tile_schedule, tiles


class BwdPreprocess:
    """Delta = rowsum(dO * O) - dlse (float32), valid rows with a visible key only."""

    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim
        # Each thread holds its share of a (block_m, HD) tile of O and of dO in registers: 64 rows up to
        # hd128 (64 values per thread), 32 rows above (at most 64 values per thread at hd256).
        self.block_m = 64 if head_dim <= 128 else 32
        self.num_threads = 128

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mCuQ: cute.Tensor,
        mUsedQ: cute.Tensor,
        max_seqlen_q: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        copy_in = tiles.gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads, async_copy=False)
        # Dense or compact query tiles (tile_schedule.tile_grid), as the forward.
        args = (mO, mdO, mLSE, mdLSE, mDelta, mCuQ, mUsedQ, copy_in)
        heads, batch, total_q = cute.size(mO.shape[1]), cute.size(mUsedQ.shape[0]), cute.size(mO.shape[0])
        if tile_schedule.use_compact_grid(max_seqlen_q, total_q, batch, self.block_m) != 0:
            self.kernel(*args, True).launch(grid=tile_schedule.tile_grid(True, max_seqlen_q, total_q, heads, batch, self.block_m),
                                            block=[self.num_threads, 1, 1], stream=stream)
        else:
            self.kernel(*args, False).launch(grid=tile_schedule.tile_grid(False, max_seqlen_q, total_q, heads, batch, self.block_m),
                                             block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mCuQ: cute.Tensor,
        mUsedQ: cute.Tensor,
        copy_in: cute.TiledCopy,
        compact: cutlass.Constexpr,
    ):
        BM = self.block_m
        HD = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        batch, m_block = tile_schedule.tile_of_cta(compact, m_block, batch, mCuQ, cute.size(mUsedQ.shape[0]), BM)
        q_start, q_len = bounds.used_length(mCuQ, mUsedQ, batch)
        m0 = m_block * BM
        if m0 < q_len:
            gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), (BM, HD), (m_block, 0))
            gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, head, None]), (BM, HD), (m_block, 0))
            thr = copy_in.get_slice(tidx)
            tOgO = thr.partition_S(gO)
            tOgdO = thr.partition_S(gdO)
            tOcO = thr.partition_S(cute.make_identity_tensor((BM, HD)))
            rO = cute.make_fragment_like(tOgO, self.dtype)
            rdO = cute.make_fragment_like(tOgdO, self.dtype)
            rO.fill(0)
            rdO.fill(0)
            for m in cutlass.range_constexpr(cute.size(rO.shape[1])):
                if m0 + tOcO[0, m, 0][0] < q_len:
                    cute.copy(copy_in, tOgO[None, m, None], rO[None, m, None])
                    cute.copy(copy_in, tOgdO[None, m, None], rdO[None, m, None])
            tpr = tiles.row_block(HD) // (128 // self.dtype.width)
            for m in cutlass.range_constexpr(cute.size(rO.shape[1])):
                acc = cutlass.Float32(0.0)
                for a in cutlass.range_constexpr(cute.size(rO.shape[0])):
                    for kk in cutlass.range_constexpr(cute.size(rO.shape[2])):
                        acc += rO[a, m, kk].to(cutlass.Float32) * rdO[a, m, kk].to(cutlass.Float32)
                off = tpr // 2
                while off >= 1:  # reduce over the tpr consecutive threads sharing a row
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off, mask=-1, mask_and_clamp=31)
                    off = off // 2
                i = m0 + tOcO[0, m, 0][0]
                if tOcO[0, m, 0][1] == 0 and i < q_len:
                    lv = mLSE[head, q_start + i]
                    d = cutlass.Float32(0.0)
                    if lv != -cutlass.Float32.inf:
                        d = acc - mdLSE[head, q_start + i]
                    mDelta[head, q_start + i] = d
