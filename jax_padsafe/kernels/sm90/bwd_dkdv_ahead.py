"""The plain Hopper dK/dV kernel's steps with the next step's S^T and dP^T issued under the current step's dK
GEMM (`PlainStepsAhead`, a mixin of `BwdDKDVSm90`, taken where the head dim's tuning says `dkdv_steps_ahead`).

`DKDVSteps.consume` issues a step's S^T and dP^T only after its previous step's dK GEMM has completed, so the
tensor cores wait through the step's turn: the row statistics' store and barrier, the wait for the next Q / dO
stage, the issue itself.  Here the loop is rotated: it starts with a step's P^T formed and its dP^T complete,
issues the step's dV and dK GEMMs, then the next step's S^T and dP^T behind them, and only then waits for dK.
No wgmma group is in flight across the loop's back edge or a branch's merge (ptxas serialises every wgmma of
the kernel otherwise).  The values, and the order of every floating-point operation, are those of `consume`.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from ..common import bounds, bwd_scores, masking
from . import common as sc
from .bwd_base import BAR_WG_BASE


class PlainStepsAhead:
    """Mixin of `BwdDKDVSm90` (with `DKDVSteps`): the plain kind's step loop with the GEMMs issued a step ahead."""

    @cute.jit
    def plain_steps_ahead(self, sStat, sQ, sdO, pipe_q, mLSE, mDelta, mma_s0, mma_s, mma_kv, tSrK, tSrV, tSrQ, tSrdO,
                          tKrQt, tVrdOt, acc_dK, acc_dV, rP, rdS, tPrP, tPrdS, cS_mn, lse2, delta, s_shape, stat,
                          n_block, slot, head, m_block, m_min, n_m, total, tb, score_mul, cap_mul, state):
        """`consume`'s steps (module docstring) for the plain kind with one warpgroup per 64 keys, without
        softcap; returns the advanced Q / dO pipeline state."""
        BM = self.block_m
        q_start, q_len, _, k_len, _, off, left, right, _, _ = tb
        dt = self.dtype
        tidx_all, _, _ = cute.arch.thread_idx()
        tidx = tidx_all - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        t_wg = tidx % 128
        stat_kind = t_wg // BM
        stat_row = t_wg % BM
        opaque_zero = cute.size(mLSE.shape[1]) >> 30  # total query rows < 2^30
        acc_S = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, cutlass.Float32)
        s_mn = masking.acc_mn_view_sm90(acc_S)
        dp_mn = masking.acc_mn_view_sm90(acc_dP)

        # Step 0: its statistics, its GEMMs, its P^T.
        self.put_stats(sStat, stat, 0, wg, t_wg, stat_row, stat_kind)
        next_head, next_m = self.next_step(head, m_block, m_min, n_m)
        if total > 1:
            stat = self.stat_load(mLSE, mDelta, next_head, q_start, q_len, next_m * BM + stat_row, stat_kind)
        # The key tile is read before each issue (see `consume`).
        n_step = self.key_tile(n_block, slot)
        stage = self.issue_scores(pipe_q, state, sQ, sdO, mma_s0, mma_s, tSrK, tSrV, tSrQ, tSrdO, acc_S, acc_dP,
                                  m_block, q_len, t_wg, wg)
        interior = self.plain_probs(acc_S, rP, sStat, cS_mn, lse2, delta, 0, wg, n_step, m_block, q_len, k_len, off,
                                    left, right, score_mul, cap_mul, opaque_zero)
        for it in cutlass.range(total - 1, unroll=1):
            # This step's dV and dK GEMMs, dS^T formed under the first.
            sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
            self.plain_dscores(s_mn, dp_mn, delta, interior)
            rdS.store(acc_dP.load().to(dt))
            sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
            # The next step's S^T and dP^T behind them, then its statistics and the loads of the one after.
            head = next_head
            m_block = next_m
            state_next = state.clone()
            state_next.advance()
            n_step = self.key_tile(n_block, slot)
            stage = self.issue_scores(pipe_q, state_next, sQ, sdO, mma_s0, mma_s, tSrK, tSrV, tSrQ, tSrdO, acc_S,
                                      acc_dP, m_block, q_len, t_wg, wg)
            self.put_stats(sStat, stat, (it + 1) % 2, wg, t_wg, stat_row, stat_kind)
            next_head, next_m = self.next_step(head, m_block, m_min, n_m)
            if it + 2 < total:
                stat = self.stat_load(mLSE, mDelta, next_head, q_start, q_len, next_m * BM + stat_row, stat_kind)
            # dV and dK complete (they read this step's Q / dO stage, rP and rdS): release the stage.
            warpgroup.wait_group(2)
            pipe_q.consumer_release(state)
            state.advance()
            interior = self.plain_probs(acc_S, rP, sStat, cS_mn, lse2, delta, (it + 1) % 2, wg, n_step, m_block,
                                        q_len, k_len, off, left, right, score_mul, cap_mul, opaque_zero)
        # The last step's gradients.
        sc.gemm(mma_kv, mma_kv, acc_dV, tPrP, tVrdOt[None, None, None, stage], False)
        self.plain_dscores(s_mn, dp_mn, delta, interior)
        rdS.store(acc_dP.load().to(dt))
        sc.gemm(mma_kv, mma_kv, acc_dK, tPrdS, tKrQt[None, None, None, stage], False)
        warpgroup.wait_group(0)
        pipe_q.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def put_stats(self, sStat, stat, par, wg, t_wg, stat_row, stat_kind):
        """Store a step's row statistics (`stat`, loaded a step ahead) in buffer `par`, then the warpgroup's
        barrier: the fragments read them after it."""
        if t_wg < 2 * self.block_m:
            sStat[stat_row, stat_kind, par, wg] = self.stat_finish(stat, stat_kind)
        cute.arch.barrier(barrier_id=BAR_WG_BASE + wg, number_of_threads=128)

    @cute.jit
    def next_step(self, head, m_block, m_min, n_m):
        """The plain kind's step after (head, m_block): the next query tile, or the next query head's first."""
        next_head = head
        next_m = m_block + 1
        if next_m == m_min + n_m:
            next_m = m_min
            next_head = head + 1
        return next_head, next_m

    @cute.jit
    def issue_scores(self, pipe_q, state, sQ, sdO, mma_s0, mma_s, tSrK, tSrV, tSrQ, tSrdO, acc_S, acc_dP, m_block,
                     q_len, t_wg, wg):
        """Wait for the step's Q / dO stage, zero its query rows past q_len, issue S^T and dP^T (one group each);
        returns the stage."""
        BM, HD = self.block_m, self.head_dim
        pipe_q.consumer_wait(state)
        stage = state.index
        m0 = m_block * BM
        if m0 + BM > q_len:
            # Query rows past q_len: zeros before any GEMM reads the stage (0 * NaN = NaN otherwise).
            sc.zero_rows_from(self.dtype, BM, HD, sQ[None, None, stage], q_len - m0, t_wg, BAR_WG_BASE + wg)
            sc.zero_rows_from(self.dtype, BM, HD, sdO[None, None, stage], q_len - m0, t_wg, BAR_WG_BASE + wg)
        sc.gemm(mma_s0, mma_s, acc_S, tSrK, tSrQ[None, None, None, stage], True)
        sc.gemm(mma_s0, mma_s, acc_dP, tSrV, tSrdO[None, None, None, stage], True)
        return stage

    @cute.jit
    def plain_probs(self, acc_S, rP, sStat, cS_mn, lse2, delta, par, wg, n_step, m_block, q_len, k_len, off, left,
                    right, score_mul, cap_mul, opaque_zero):
        """A step's P^T (in acc_S, and rP in the input dtype) once S^T is complete, and its Delta; returns whether
        the tile took the interior path.  Waits for every group (dP^T included)."""
        BM, BN = self.block_m, self.block_n
        n_cols = cute.size(cS_mn, mode=[1])
        for x in cutlass.range_constexpr(n_cols):
            lse2[x] = sStat[cS_mn[0, x][1], 0, par, wg]
        need = bounds.tile_needs_mask(n_step, m_block, BM, BN, q_len, k_len, off, left, right)
        interior = bounds.tile_interior(m_block, BM, q_len, need)
        warpgroup.wait_group(1)
        s_mn = masking.acc_mn_view_sm90(acc_S)
        if interior:
            bwd_scores.probs_interior(s_mn, lse2, score_mul, 1)
        else:
            bwd_scores.probs_and_dscale(s_mn, s_mn, cS_mn, lse2, m_block * BM, n_step * BN, k_len, off, left, right,
                                        score_mul, cap_mul, need, 1, False)
        rP.store(acc_S.load().to(self.dtype))
        for x in cutlass.range_constexpr(n_cols):
            delta[x] = sStat[cS_mn[0, x][1], 1, par, wg]
        if cutlass.const_expr(self.pin_waits):
            sc.wgmma_wait_after(rP, opaque_zero, 0)
        warpgroup.wait_group(0)
        return interior

    @cute.jit
    def plain_dscores(self, s_mn, dp_mn, delta, interior):
        """dS^T = P^T (dP^T - Delta) in dp_mn, by select unless the tile took the interior path."""
        if interior:
            bwd_scores.dscores_interior(s_mn, dp_mn, delta, 1)
        else:
            bwd_scores.dscores(s_mn, dp_mn, s_mn, delta, 1, False)
