"""The consumer warpgroups of the Hopper dK/dV kernel: one key tile's steps (S^T, dP^T, P^T, dS^T and the dV / dK
GEMMs per query tile), the head-dim split's exchange step, the row statistics and the epilogue."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from ..common import aux_scores, bias_stage, bounds, bwd_scores, masking
from . import bwd_aux
from . import common as sc
from .bwd_base import BAR_CONSUMERS, BAR_DS_READY, BAR_P_READY, BAR_WG_BASE


class DKDVSteps:
    """Mixin of `BwdDKDVSm90`: what its consumer warpgroups compute for one key tile."""

    @cute.jit
    def consume(self, sK, sV, sQ, sdO, sStat, sdS, sdQ, pipe_kv, pipe_q, mLSE, mDelta, mdK, mdV, mma_s, mma_kv,
                copy_out, score_mul, cap_mul, dscale, n_block, slot, head_kv, group, n_m, total, tb, state_kv, state,
                release_kv: cutlass.Constexpr, out_tiles=None, aux_tile=None):
        """The consumers' part of one key tile (`tb`: its bounds.TileBounds; `total` = group x n_m steps, one per
        query head of the group and query tile that sees the key tile); returns the advanced pipeline states.
        `release_kv`: free the K / V stage for the next tile: right after the last step's GEMMs where `out_tiles` (two staging tiles of
        sK's layout) take dK / dV, else once the epilogue, staged through sK / sV, has read them.
        `aux_tile` (aux variants: (bwd_aux.BwdAux, sequence, m_max, q_len, k_len, the staged bias's buffers or
        None)): the steps walk each query
        head's narrowed range as the producer does (`total` counts them).  "bias": S^T becomes natural-unit
        scores with the head's mask and bias (aux_scores.scores), and P^T comes from the forward's m and ln l
        (bwd_scores.probs_exact);
        "mask": S^T gets -inf where the head's mask hides a pair (aux_scores.mask_scores), and P^T comes from lse
        as in the plain kernel."""
        BM, BN, HD = self.block_m, self.block_n, self.head_dim
        q_start, q_len, k_start, k_len, k_slot, off, left, right, m_min, _ = tb
        dt = self.dtype
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        n0 = n_block * BN
        # The aux kinds: "bias" stages and reads the forward's m and ln l (bwd_aux.stat_load); "mask" stages lse
        # and Delta as the plain kernel does, and differs from it only in the step cursor and mask_scores.
        exact = aux_tile is not None and self.aux == "bias"
        masked = aux_tile is not None and self.aux == "mask"

        # Accumulate flags are fixed per TiledMma object (never set inside staged control flow): the first
        # k-block of S^T / dP^T uses mma_s0 (overwrite), everything else accumulates.
        mma_s0 = self._mma_s()
        mma_s0.set(warpgroup.Field.ACCUMULATE, False)
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        mma_kv.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(self.split_head_dim):
            # mma_s is one warpgroup's tile: S^T in warpgroup 0, dP^T in warpgroup 1.
            wg_s = mma_s.get_slice(0)
            thr_s = mma_s.get_slice(tidx % 128)
        else:
            wg_s = mma_s.get_slice(wg * 128)
            thr_s = mma_s.get_slice(tidx)
        wg_kv = mma_kv.get_slice(wg * 128)
        thr_kv = mma_kv.get_slice(tidx)
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))
        tSrV = wg_s.make_fragment_A(wg_s.partition_A(sV))
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ))
        tSrdO = wg_s.make_fragment_B(wg_s.partition_B(sdO))
        tKrQt = wg_kv.make_fragment_B(wg_kv.partition_B(sc.transposed(sQ)))
        tVrdOt = wg_kv.make_fragment_B(wg_kv.partition_B(sc.transposed(sdO)))
        acc_dK = thr_kv.make_fragment_C(thr_kv.partition_shape_C((BN, HD)))
        acc_dV = thr_kv.make_fragment_C(thr_kv.partition_shape_C((BN, HD)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        s_shape = thr_s.partition_shape_C((BN, BM))
        # (key, query) coordinates of this thread's S^T fragment (the warpgroup's 64 keys included).
        cS_mn = masking.acc_mn_view_sm90(thr_s.partition_C(cute.make_identity_tensor((BN, BM))))
        n_cols = cute.size(cS_mn, mode=[1])
        lse2 = cute.make_rmem_tensor((n_cols,), cutlass.Float32)
        delta = cute.make_rmem_tensor((n_cols,), cutlass.Float32)
        # Aux "bias": lse2 holds ln l * log2(e), row_max the row max m (bwd_scores.probs_exact).
        row_max = None
        if cutlass.const_expr(exact):
            row_max = cute.make_rmem_tensor((n_cols,), cutlass.Float32)
        rP = cute.make_rmem_tensor(s_shape, dt)
        tPrP = cute.make_tensor(rP.iterator, sc.c_to_a_layout(rP.layout))
        rdS = cute.make_rmem_tensor(s_shape, dt)
        tPrdS = cute.make_tensor(rdS.iterator, sc.c_to_a_layout(rdS.layout))

        # Row statistics of a step (lse2 / Delta of block_m queries) go through shared memory: each of the
        # warpgroup's threads loads one value from global memory one step ahead (1 register instead of
        # 2 x 16), stores it, and the fragments read them back right before use (register pressure: the
        # dK and dV accumulators take 128 registers per thread).
        t_wg = tidx % 128
        stat_kind = t_wg // BM
        stat_row = t_wg % BM
        # The aux variants walk a cursor (query head, query tile, end of that head's narrowed range) instead of
        # counting through group x n_m steps; the bias kind stages ln l and m where the plain kernel stages lse.
        m_hi = None
        head = None
        m_block = None
        if cutlass.const_expr(aux_tile is None):
            stat = self.stat_load(mLSE, mDelta, head_kv * group, q_start, q_len, m_min * BM + stat_row, stat_kind)
        else:
            head, m_block, m_hi = self.aux_first(aux_tile, head_kv, group, self.key_tile(n_block, slot), m_min)
            if cutlass.const_expr(masked):
                stat = self.stat_load(mLSE, mDelta, head, q_start, q_len, m_block * BM + stat_row, stat_kind)
            else:
                stat = bwd_aux.stat_load(aux_tile[0], mDelta, head, q_start, q_len, m_block * BM + stat_row,
                                         stat_kind)
        # "bias" where the kernel stages it: this warpgroup's keys x the step's queries of the bias, the first
        # step's copies issued here, each next step's after the current step's read (bias_stage).
        bias_st = None
        if cutlass.const_expr(exact and self.stage_bias):
            bias_st = bias_stage.make(aux_tile[5], 0, BM, wg * (BN // 2), BN // 2, BAR_WG_BASE + wg)
            aux_scores.stage_bias(bias_st, bwd_aux.view(aux_tile[0], aux_tile[1], head), m_block * BM,
                                  self.key_tile(n_block, slot) * BN, q_len, k_len, tidx % 128)

        # Head-dim split: per-thread views of P^T (fp32) and dS^T in shared memory,
        # in the S^T fragment's layout (the same thread of the other warpgroup reads what this one wrote).
        copy_px = None
        copy_dsx = None
        if cutlass.const_expr(self.split_head_dim):
            copy_px = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32),
                                             mma_s)
            copy_dsx = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt), mma_s)

        pipe_kv.consumer_wait(state_kv)
        # (query head, query tile) of the step, advanced by counting (no integer division per step); the aux
        # variant's cursor started above.
        if cutlass.const_expr(aux_tile is None):
            head = head_kv * group
            m_block = m_min
        if cutlass.const_expr(self.steps_ahead and aux_tile is None):
            state = self.plain_steps_ahead(sStat, sQ, sdO, pipe_q, mLSE, mDelta, mma_s0, mma_s, mma_kv, tSrK, tSrV,
                                           tSrQ, tSrdO, tKrQt, tVrdOt, acc_dK, acc_dV, rP, rdS, tPrP, tPrdS, cS_mn,
                                           lse2, delta, s_shape, stat, n_block, slot, head, m_block, m_min, n_m, total,
                                           tb, score_mul, cap_mul, state)
        else:
            for it in cutlass.range(total, unroll=1):
                m0 = m_block * BM
                par = it % 2
                if t_wg < 2 * BM:
                    if cutlass.const_expr(not exact):
                        sStat[stat_row, stat_kind, par, wg] = self.stat_finish(stat, stat_kind)
                    else:
                        st_a, st_b = bwd_aux.stat_finish(stat[0], stat[1], stat_kind)
                        sStat[stat_row, stat_kind, par, wg] = st_a
                        if stat_kind == 0:
                            sStat[stat_row, 2, par, wg] = st_b
                cute.arch.barrier(barrier_id=BAR_WG_BASE + wg, number_of_threads=128)
                next_head = head
                next_m = m_block + 1
                next_hi = m_hi
                if cutlass.const_expr(aux_tile is None):
                    if next_m == m_min + n_m:
                        next_m = m_min
                        next_head = head + 1
                else:
                    next_head, next_m, next_hi = self.aux_next(aux_tile, head_kv, group, self.key_tile(n_block, slot),
                                                               m_min, head, m_block, m_hi)
                if it + 1 < total:
                    # Issued a step ahead; nothing reads the loaded values before the next step's store.
                    if cutlass.const_expr(not exact):
                        stat = self.stat_load(mLSE, mDelta, next_head, q_start, q_len, next_m * BM + stat_row, stat_kind)
                    else:
                        stat = bwd_aux.stat_load(aux_tile[0], mDelta, next_head, q_start, q_len, next_m * BM + stat_row,
                                                 stat_kind)
                # Aux: the step's view (its query head's mask and bias).
                view = None
                if cutlass.const_expr(aux_tile is not None):
                    view = bwd_aux.view(aux_tile[0], aux_tile[1], head)
                pipe_q.consumer_wait(state)
                stage = state.index
                if m0 + BM > q_len:
                    # Query rows past q_len: zeros before any GEMM reads the stage (0 * NaN = NaN otherwise).
                    sc.zero_rows_from(dt, BM, HD, sQ[None, None, stage], q_len - m0, tidx % 128, BAR_WG_BASE + wg)
                    sc.zero_rows_from(dt, BM, HD, sdO[None, None, stage], q_len - m0, tidx % 128, BAR_WG_BASE + wg)
                if cutlass.const_expr(self.split_head_dim):
                    self.exchange_step(wg, tidx % 128, stage, par, sStat, sdQ, sdS, copy_px, copy_dsx, mma_s0, mma_s,
                                       mma_kv, tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, acc_dK, acc_dV, rP, rdS, tPrP,
                                       tPrdS, cS_mn, lse2, delta, s_shape, self.key_tile(n_block, slot), m_block,
                                       q_len, k_len, off, left, right, score_mul, cap_mul, view, row_max)
                else:
                    # The key tile (key_tile) is read before the GEMMs are issued: read after them, the shared-memory
                    # load queued behind the GEMMs' operand reads and its first use stalled.
                    n_step = self.key_tile(n_block, slot)
                    acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                    sc.gemm(mma_s0, mma_s, acc_S, tSrK, tSrQ[None, None, None, stage], True)
                    acc_dP = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                    sc.gemm(mma_s0, mma_s, acc_dP, tSrV, tSrdO[None, None, None, stage], True)
                    # Shared-memory reads of the row statistics before the waits, so their latency hides under the
                    # GEMMs (Nsight Compute on an H100: read after the wait, the exp2's FFMA stalled on them).  With
                    # softcap they stay after the waits: that kernel spills either way (ptxas 152 B of stack, early
                    # or late), and early reads were not timed there.  The aux variant reads them after its scores
                    # (below): held through aux_scores.scores, lse2 and m (2 x 16 registers) made ptxas spill inside
                    # the step (208 B at hd128, sm_90a), and 28 B outside it when read after.  The mask kind reads
                    # lse2 and Delta where the plain kernel does: it holds one statistic, not two, and at hd128 ptxas
                    # spills 72 B with lse2 read early, 88 B with it read after mask_scores (sm_90a, 2026-11-28).
                    early_stats = not self.has_softcap and not exact
                    if cutlass.const_expr(early_stats):
                        for x in cutlass.range_constexpr(n_cols):
                            lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
                    need = bounds.tile_needs_mask(n_step, m_block, BM, BN, q_len, k_len, off, left, right)
                    cls = None
                    if cutlass.const_expr(view is not None):
                        # Aux: the load half of the tile's mask class, issued under the GEMMs (every lane of each warp
                        # takes part, as tile_class needs); the vote comes after the wait for S^T.
                        cls = aux_scores.tile_class_entry(view, m_block, n_step, BM, BN)
                    warpgroup.wait_group(1)
                    if cutlass.const_expr(view is not None):
                        # The vote reads the entry OR'ed with (a score's bits & a run-time 0), so ptxas cannot hoist it
                        # above the wait: voting right after the load stalled each warp on the load's latency
                        # (SASS: the VOTE.ALL pair sat before WARPGROUP.DEPBAR, the forward's fwd_aux.tile_class_entry
                        # says what that cost there).
                        opaque_zero = cute.size(mLSE.shape[1]) >> 30  # total query rows < 2^30
                        cls = aux_scores.tile_class_vote(
                            view, cls | (cute.recast_tensor(acc_S, cutlass.Int32)[0] & opaque_zero), BM, BN)
                    if cutlass.const_expr(not early_stats and view is None):
                        for x in cutlass.range_constexpr(n_cols):
                            lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
                    s_mn = masking.acc_mn_view_sm90(acc_S)
                    t_mn = s_mn
                    if cutlass.const_expr(self.has_softcap):
                        acc_T = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                        t_mn = masking.acc_mn_view_sm90(acc_T)
                    n0_step = self.key_tile(n_block, slot) * BN
                    # The interior path (no softcap): the step's tile inside the valid rectangle with every pair
                    # visible (and, with aux inputs, VISIBLE): P^T and dS^T without per-score selects.
                    # Uniform over the warpgroup.
                    interior = None
                    if cutlass.const_expr(not self.has_softcap):
                        interior = bounds.tile_interior(m_block, BM, q_len, need)
                        if cutlass.const_expr(view is not None):
                            interior = interior and aux_scores.tile_plain(view, cls, n0_step + BN)
                    if cutlass.const_expr(view is None):
                        if cutlass.const_expr(interior is not None):
                            if interior:
                                bwd_scores.probs_interior(s_mn, lse2, score_mul, 1)
                            else:
                                bwd_scores.probs_and_dscale(s_mn, t_mn, cS_mn, lse2, m0, n0_step, k_len, off, left,
                                                            right, score_mul, cap_mul, need, 1, False)
                        else:
                            bwd_scores.probs_and_dscale(s_mn, t_mn, cS_mn, lse2, m0, n0_step, k_len, off, left, right,
                                                        score_mul, cap_mul, need, 1, True)
                    elif cutlass.const_expr(masked):
                        # Raw scores, -inf where the mask hides a pair (exp2(-inf) = 0), then the plain kernel's P^T
                        # with its score_mul (scale * log2 e).  The step's lse2 (read from shared memory each step)
                        # takes the folded ALiBi term's query part (aux_scores.AlibiFold).  On an interior tile (VISIBLE)
                        # mask_scores adds the ALiBi term only.
                        aux_scores.mask_scores(s_mn, cS_mn, view, m0, n0_step, q_len, k_len, cls, 1, sc.map_group(1),
                                               aux_scores.AlibiFold(lse2, -score_mul), (BM, BN))
                        if interior:
                            bwd_scores.probs_interior(s_mn, lse2, score_mul, 1)
                        else:
                            bwd_scores.probs_and_dscale(s_mn, t_mn, cS_mn, lse2, m0, n0_step, k_len, off, left, right,
                                                        score_mul, cap_mul, need, 1, False)
                    else:
                        # Natural-unit scores with the mask (-inf) and the bias, then P^T from m and ln l; the
                        # visibility rule applies after, inside probs_exact, as in the plain kernel.  ln l * log2 e
                        # and m are read only now (register pressure, see early_stats).
                        staged = None
                        two = False
                        if cutlass.const_expr(bias_st is not None):
                            two = bias_stage.buffer_count(bias_st) == 2
                            staged = bias_st._replace(parity=par if two else 0)
                        aux_scores.scores(s_mn, cS_mn, view, m0, n0_step, q_len, k_len, score_mul, cls, 1, staged=staged,
                                          map_group=sc.map_group(1))
                        if cutlass.const_expr(bias_st is not None):
                            if it + 1 < total:
                                if cutlass.const_expr(not two):
                                    # One buffer: every thread of the warpgroup has read it before anyone overwrites it.
                                    cute.arch.barrier(barrier_id=bias_st.barrier, number_of_threads=128)
                                aux_scores.stage_bias(bias_st._replace(parity=1 - par if two else 0),
                                                      bwd_aux.view(aux_tile[0], aux_tile[1], next_head), next_m * BM,
                                                      n0_step, q_len, k_len, tidx % 128)
                        for x in cutlass.range_constexpr(n_cols):
                            row_max[x] = sStat[cS_mn[0, x][1], 2, par, wg]
                        for x in cutlass.range_constexpr(n_cols):
                            lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
                        if interior:
                            bwd_scores.probs_exact_interior(s_mn, row_max, lse2, 1)
                        else:
                            bwd_scores.probs_exact(s_mn, cS_mn, row_max, lse2, m0, n0_step, k_len, off, left, right,
                                                   need, 1)
                    rP.store(acc_S.load().to(dt))
                    if cutlass.const_expr(early_stats):
                        for x in cutlass.range_constexpr(n_cols):
                            delta[x] = sStat[cS_mn[0, x][1], 1, par, wg]
                    if cutlass.const_expr(self.pin_waits):
                        sc.wgmma_wait_after(rP, cute.size(mLSE.shape[1]) >> 30, 0)  # total query rows < 2^30
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(not early_stats):
                        for x in cutlass.range_constexpr(n_cols):
                            delta[x] = sStat[cS_mn[0, x][1], 1, par, wg]
                    # dV += P^T dO runs while dS^T is formed.
                    sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
                    if cutlass.const_expr(interior is not None):
                        if interior:
                            bwd_scores.dscores_interior(s_mn, masking.acc_mn_view_sm90(acc_dP), delta, 1)
                        else:
                            bwd_scores.dscores(s_mn, masking.acc_mn_view_sm90(acc_dP), t_mn, delta, 1, False)
                    else:
                        bwd_scores.dscores(s_mn, masking.acc_mn_view_sm90(acc_dP), t_mn, delta, 1, self.has_softcap)
                    rdS.store(acc_dP.load().to(dt))
                    sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
                warpgroup.wait_group(0)
                pipe_q.consumer_release(state)
                state.advance()
                head = next_head
                m_block = next_m
                if cutlass.const_expr(aux_tile is not None):
                    m_hi = next_hi

        # Epilogue: dK (times the softmax scale) and dV through sK / sV, or the staging tiles (every consumer's
        # GEMMs are complete after the barrier; with staging tiles it also orders this tile's writes after the
        # previous tile's reads): valid key rows, then zeros up to the slot end.
        sOutK, sOutV = sK, sV
        if cutlass.const_expr(release_kv and out_tiles is not None):
            # This warp's GEMMs that read sK / sV are complete (the last step waited for them): the producer
            # may load the next tile's K / V once every consumer warp has arrived, while this one stores.
            pipe_kv.consumer_release(state_kv)
            sOutK, sOutV = out_tiles
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
        n_block = self.key_tile(n_block, slot)
        n0 = n_block * BN
        head_kv, k_start, k_len, k_slot, tidx_e = self.epilogue_rows(slot, head_kv, k_start, k_len, k_slot, tidx)
        gdK = cute.local_tile(cute.domain_offset((k_start, 0), mdK[None, head_kv, None]), (BN, HD), (n_block, 0))
        gdV = cute.local_tile(cute.domain_offset((k_start, 0), mdV[None, head_kv, None]), (BN, HD), (n_block, 0))
        sc.store_rows_via_smem(acc_dK, dscale, dt, mma_kv, copy_out, sOutK, gdK, BN, HD, n0, k_len, tidx_e,
                               BAR_CONSUMERS, self.num_consumer_threads, k_slot)
        sc.store_rows_via_smem(acc_dV, cutlass.Float32(1.0), dt, mma_kv, copy_out, sOutV, gdV, BN, HD, n0, k_len,
                               tidx_e, BAR_CONSUMERS, self.num_consumer_threads, k_slot)
        if cutlass.const_expr(release_kv and out_tiles is None):
            # Every consumer has read sK / sV out: the producer may load the next tile's K / V.
            cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=self.num_consumer_threads)
            pipe_kv.consumer_release(state_kv)
        state_kv.advance()
        return state_kv, state

    @cute.jit
    def key_tile(self, n_block, slot):
        """The consumers' key tile, where a step or the epilogue needs it.  The dense kernel's is blockIdx.x,
        which ptxas re-reads from SR_CTAID at each use; the compact kernel's comes from the producer's search, and
        a register holding it through the loop would compete with the dK / dV accumulators.  So the compact
        kernel loads it from the tile's queue slot in shared memory (`slot`) at each use; the loop's barriers
        keep those loads inside the loop.  (A compact kernel in which every warp searched and kept the result
        spilled 19 values in the loop; this one spills 3 at hd128.)"""
        if cutlass.const_expr(slot is None):
            return n_block
        return slot[1]

    @cute.jit
    def epilogue_rows(self, slot, head_kv, k_start, k_len, k_slot, tidx):
        """(kv head, k_start, k_len, k_slot, thread index) where the epilogue needs them.  The queued kernel
        re-reads them from its tile's slot, after the epilogue's barrier, and adds the slot's run-time 0 to the
        thread index, so that ptxas computes the epilogue's addresses in the epilogue: it hoisted them out of
        the tile loop otherwise, and at head dim 128, with no register to spare across the step loop, kept 35 of
        them per thread in local memory, reloaded by every tile's epilogue."""
        if cutlass.const_expr(slot is None):
            return head_kv, k_start, k_len, k_slot, tidx
        return slot[2], slot[3], slot[4], slot[5], tidx + slot[6]

    @cute.jit
    def exchange_step(self, wg, tidx_wg, stage, par, sStat, sPx, sdSx, copy_px, copy_dsx, mma_s0, mma_s, mma_kv, tSrK,
                      tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, acc_dK, acc_dV, rP, rdS, tPrP, tPrdS, cS_mn, lse2, delta,
                      s_shape, n_block, m_block, q_len, k_len, off, left, right, score_mul, cap_mul, view=None,
                      row_max=None):
        """One step of the head-dim split.  Warpgroup 0: S^T = K Q^T, P^T (masks by select), P^T -> sPx,
        dV_0 += P^T dO_0 (its half of the head dim), then dS^T <- sdSx and dK_0 += dS^T Q_0.  Warpgroup 1:
        dP^T = V dO^T, P^T <- sPx, dS^T = P^T (dP^T - Delta) (0 where P^T = 0, by select), dS^T -> sdSx,
        dV_1 += P^T dO_1, dK_1 += dS^T Q_1.  Each shared tile has one writer and one reader per step; the named
        barriers order them, and a warpgroup writes the next step's tile only after it has waited for the
        other's tile of this step, which the other wrote after reading this step's (so one buffer each is
        enough).  Without softcap P^T crosses in fp32, so dS^T is the same expression on the same values as in
        a kernel that computes both.  With softcap the fp32 tile carries P^T (1 - tanh^2) instead (0 by select
        where P^T = 0, so a NaN score of a key past its length cannot reach it), and P^T crosses in the input
        dtype for warpgroup 1's dV GEMM, through the dS^T tile: each thread of warpgroup 1 reads its elements of
        P^T there before it writes its elements of dS^T to the same addresses, and warpgroup 0 writes the next
        P^T there only after reading dS^T.  Aux (`view`: the step's aux_scores.AuxView; "bias" also `row_max`: m):
        warpgroup 0 forms P^T as `consume` does, from natural-unit scores and m, ln l (bwd_scores.probs_exact) or,
        for "mask", from raw scores with the mask's -inf and lse."""
        BM, BN = self.block_m, self.block_n
        dt = self.dtype
        n_cols = cute.size(cS_mn, mode=[1])
        acc_X = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        x_mn = masking.acc_mn_view_sm90(acc_X)
        thr_px = copy_px.get_slice(tidx_wg)
        thr_dsx = copy_dsx.get_slice(tidx_wg)
        if wg == 0:
            sc.gemm(mma_s0, mma_s, acc_X, tSrK, tSrQ[None, None, None, stage], True)
            need = bounds.tile_needs_mask(n_block, m_block, BM, BN, q_len, k_len, off, left, right)
            cls = None
            if cutlass.const_expr(view is not None):
                # Every lane of warpgroup 0's warps (tile_class votes per warp).  The bias kind reads its row
                # statistics after the scores, as in `consume` (hd256: 88 B of spills when held through them,
                # none after); the mask kind reads lse2 here, as the plain kernel does.
                cls = aux_scores.tile_class(view, m_block, n_block, BM, BN)
            if cutlass.const_expr(view is None or self.aux == "mask"):
                for x in cutlass.range_constexpr(n_cols):
                    lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
            warpgroup.wait_group(0)
            if cutlass.const_expr(self.has_softcap):
                acc_T = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                t_mn = masking.acc_mn_view_sm90(acc_T)
                bwd_scores.probs_and_dscale(x_mn, t_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off, left, right,
                                    score_mul, cap_mul, need, 1, True)
                for r in cutlass.range_constexpr(cute.size(x_mn, mode=[0])):
                    for c in cutlass.range_constexpr(n_cols):
                        p = x_mn[r, c]
                        pt = p * t_mn[r, c]
                        if p == cutlass.Float32(0.0):
                            pt = cutlass.Float32(0.0)
                        t_mn[r, c] = pt
                cute.copy(copy_px, thr_px.retile(acc_T), thr_px.partition_D(sPx))
                rP.store(acc_X.load().to(dt))
                cute.copy(copy_dsx, thr_dsx.retile(rP), thr_dsx.partition_D(sdSx))
                cute.arch.barrier_arrive(barrier_id=BAR_P_READY, number_of_threads=self.num_consumer_threads)
            else:
                if cutlass.const_expr(view is None):
                    bwd_scores.probs_and_dscale(x_mn, x_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off, left,
                                                right, score_mul, cap_mul, need, 1, False)
                elif cutlass.const_expr(self.aux == "mask"):
                    aux_scores.mask_scores(x_mn, cS_mn, view, m_block * BM, n_block * BN, q_len, k_len, cls, 1,
                                           sc.map_group(1), aux_scores.AlibiFold(lse2, -score_mul), (BM, BN))
                    bwd_scores.probs_and_dscale(x_mn, x_mn, cS_mn, lse2, m_block * BM, n_block * BN, k_len, off, left,
                                                right, score_mul, cap_mul, need, 1, False)
                else:
                    aux_scores.scores(x_mn, cS_mn, view, m_block * BM, n_block * BN, q_len, k_len, score_mul, cls, 1,
                                      map_group=sc.map_group(1))
                    for x in cutlass.range_constexpr(n_cols):
                        lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
                        row_max[x] = sStat[cS_mn[0, x][1], 2, par, wg]
                    bwd_scores.probs_exact(x_mn, cS_mn, row_max, lse2, m_block * BM, n_block * BN, k_len, off, left,
                                           right, need, 1)
                cute.copy(copy_px, thr_px.retile(acc_X), thr_px.partition_D(sPx))
                cute.arch.barrier_arrive(barrier_id=BAR_P_READY, number_of_threads=self.num_consumer_threads)
                rP.store(acc_X.load().to(dt))
            # dV_0 += P^T dO_0 runs while warpgroup 1 forms dS^T.
            sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
            cute.arch.barrier(barrier_id=BAR_DS_READY, number_of_threads=self.num_consumer_threads)
            cute.copy(copy_dsx, thr_dsx.partition_S(sdSx), thr_dsx.retile(rdS))
            sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
            # Retire every wgmma group inside the branch: with a group in flight across the branches' merge
            # ptxas serialises every wgmma of the kernel (a wait after each HGMMA in SASS).
            warpgroup.wait_group(0)
        else:
            sc.gemm(mma_s0, mma_s, acc_X, tSrV, tSrdO[None, None, None, stage], True)
            for x in cutlass.range_constexpr(n_cols):
                delta[x] = sStat[cS_mn[0, x][1], 1, par, wg]
            acc_P = cute.make_rmem_tensor(s_shape, cutlass.Float32)
            warpgroup.wait_group(0)
            cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=self.num_consumer_threads)
            cute.copy(copy_px, thr_px.partition_S(sPx), thr_px.retile(acc_P))
            if cutlass.const_expr(self.has_softcap):
                cute.copy(copy_dsx, thr_dsx.partition_S(sdSx), thr_dsx.retile(rP))
            p_mn = masking.acc_mn_view_sm90(acc_P)
            # With softcap p_mn holds P^T (1 - tanh^2): the same select, one multiplication fewer.
            bwd_scores.dscores(p_mn, x_mn, p_mn, delta, 1, False)
            rdS.store(acc_X.load().to(dt))
            cute.copy(copy_dsx, thr_dsx.retile(rdS), thr_dsx.partition_D(sdSx))
            cute.arch.barrier_arrive(barrier_id=BAR_DS_READY, number_of_threads=self.num_consumer_threads)
            if cutlass.const_expr(not self.has_softcap):
                rP.store(acc_P.load().to(dt))
            sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
            sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
            warpgroup.wait_group(0)

    @cute.jit
    def stat_load(self, mLSE: cute.Tensor, mDelta: cute.Tensor, head: cutlass.Int32, q_start: cutlass.Int32,
                  q_len: cutlass.Int32, i: cutlass.Int32, kind: cutlass.Int32):
        """The raw value for `stat_finish`: kind 0 the lse of query i, kind 1 its Delta.  No branch depends on
        the loaded value, so the load stays in flight until the next step stores it (Nsight Compute on an
        H100: testing lse right after the load exposed the global-memory latency every step).  Padded queries
        (i >= q_len) load nothing and get lse = -inf, Delta = 0."""
        v = cutlass.Float32(0.0)
        if kind == 0:
            v = -cutlass.Float32.inf
        if i < q_len:
            if kind == 0:
                v = mLSE[head, q_start + i]
            else:
                v = mDelta[head, q_start + i]
        return v

    @cute.jit
    def stat_finish(self, v: cutlass.Float32, kind: cutlass.Int32):
        """kind 0: lse2 = lse * log2(e), with the sentinel +inf for padded queries and queries with lse = -inf
        (their P and dS become 0 by select); kind 1: Delta as loaded (only reaches dS where P != 0, i.e. rows
        with a finite lse)."""
        r = v
        if kind == 0:
            r = cutlass.Float32.inf
            if v != -cutlass.Float32.inf:
                r = v * bwd_scores.LOG2_E
        return r
