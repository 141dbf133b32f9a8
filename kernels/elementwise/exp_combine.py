"""The exp-form LM head's row step: after the logits GEMM has stored, per ``TILE``-column tile
``j`` of row ``m``, the bf16 values ``e[m, v] = exp(l_mv - K_mj)`` and the fp32 partial

    se[m, j] = sum_{v in j} e_mv,    K_mj = max(T_m, max_{v in j} l_mv - GUARD)
                                            (T_m = tl[m], the target's fp32 logit)

this kernel turns ``e`` into the operand of both gradient GEMMs, dl' = diag(rs) e, and gives the
row's LSE (``coda_cute.ops.lm_head_ce``'s docstring has the derivation). K is not stored: it is T
but in tiles holding a logit above T + GUARD, whose sum then reaches e^GUARD; only tiles whose
sum reaches e^(GUARD - 1) (those, and tiles with a logit above about T + GUARD - 6) have K
recovered, from the logit of the tile's largest e recomputed from u and w (``_recovered_k``).

    K'      = max_j K_mj,  f_j = exp(K_mj - K')         (f_j = 1 but in rows where a logit
                                                          exceeds T_m + GUARD)
    total   = sum_j f_j se[m, j];     LSE = K' + log(total);   s = coef / total
    others  = sum_{j != jt} f_j se[m, j] + f_jt sum_{v in jt, v != t} e_mv
    e[m, v] <- f_j e[m, v]   (v != t: the tiles with f_j != 1, in place),   e[m, t] <- -others
    rs[m] = rstd[m] s,  lse[m] = LSE

with t = targets[m] and jt its tile. So s e[m, v] = coef (softmax - onehot) at every column: at
the target s (-others) = coef (p_t - 1) = -coef sum_{v != t} p_v, the others' share, which keeps
its relative precision however close p_t is to 1 (1 - p_t from p_t would cancel). The target's
tile is read back from ``e`` (256 bytes per row) so that its target column is left out exactly
rather than subtracted from a sum it dominates.

Rows whose target is outside [0, V) get no target write (ignored rows, whose coef 0 makes rs 0;
a target out of range that is not ignored raises in the op's pending index check). A NaN
partial reaches the outputs through the row's total, never a silent number.

Roles: no specialization. A 128-thread CTA takes four rows, one per warp. The warp walks its
row's tiles in blocks of 32, one per lane: the K maximum (butterfly max), then the sums over the
same tiles (back from L1). A block's rare tiles (found by a ballot) have their K recovered, and
in the rare rows with K' > T (where every tile's f_j < 1 but the one holding K') the tiles are
rescaled, by the whole warp, one tile after another. Rows with K' = T skip both in the second
pass (every K is at least T, so all are T). Then
the warp reads the target's tile (``TILE / 32`` columns per lane), the sums are reduced with
butterflies in a fixed order (deterministic), and lane 0 writes the row's results and the
target's value.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .warp_dot import VEC, warp_row_dot, warp_sum

THREADS = 128
WARPS = THREADS // 32
#: how far above T a recomputed tile K must be to replace it (2^-10: a relative error of 0.1 %
#: at most in a tile taken as K = T, below bf16's rounding of e)
MARGIN = 2.0 ** -10


class ExpCombine:
    """See the module docstring. Arguments: ``e`` (M, V) bf16, in place; ``se`` (M, T) fp32
    with unit stride along T, T = ceil(V / tile); ``u`` (M, d) and ``w`` (V, d) bf16 with
    16-byte-aligned rows (the GEMM's operands, for the rare tiles' K); ``tl``, ``coef``,
    ``rstd`` (M,) fp32; ``targets`` (M,) int32; outputs ``lse``, ``rs`` (M,) fp32."""

    def __init__(self, tile: int, guard: float):
        self.tile = tile
        self.guard = guard

    @cute.jit
    def __call__(self, e: cute.Tensor, se: cute.Tensor, u: cute.Tensor, w: cute.Tensor, tl: cute.Tensor,
                 targets: cute.Tensor, coef: cute.Tensor, rstd: cute.Tensor, lse: cute.Tensor, rs: cute.Tensor,
                 stream):
        gu = cute.zipped_divide(u, (1, VEC))  # ((1, VEC), (M, d / VEC))
        gw = cute.zipped_divide(w, (1, VEC))
        self.kernel(e, se, gu, gw, tl, targets, coef, rstd, lse, rs).launch(
            grid=(cute.ceil_div(se.shape[0], WARPS), 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, e: cute.Tensor, se: cute.Tensor, gu: cute.Tensor, gw: cute.Tensor, tl: cute.Tensor,
               targets: cute.Tensor, coef: cute.Tensor, rstd: cute.Tensor, lse: cute.Tensor, rs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        m, v = e.shape
        nt = se.shape[1]
        lane = tidx % 32
        row = bid * WARPS + tidx // 32
        if row < m:
            t_row = tl[row]
            r_row = rstd[row]
            tgt = targets[row]
            valid = tgt >= 0 and tgt < v
            jt = Int32(cutlass.select_(valid, tgt // self.tile, Int32(-1)))

            # blocks of 32 tiles, one per lane, so that the warp recovers a rare tile's K together
            kp = Float32(-math.inf)
            for j0 in cutlass.range(0, nt, 32):
                j = j0 + lane
                inside = j < nt
                k_j = self._block_k(e, se, gu, gw, row, j0, inside, t_row, r_row, lane)
                kp = cute.arch.fmax(kp, Float32(cutlass.select_(inside, k_j, Float32(-math.inf))), nan=True)
            for off in (16, 8, 4, 2, 1):
                kp = cute.arch.fmax(kp, cute.arch.shuffle_sync_bfly(kp, offset=off), nan=True)

            total = Float32(0.0)
            others = Float32(0.0)
            plain = kp == t_row  # every K is at least T: the row's tiles all have K = T
            for j0 in cutlass.range(0, nt, 32):
                j = j0 + lane
                inside = j < nt
                k_j = t_row
                if not plain:
                    k_j = self._block_k(e, se, gu, gw, row, j0, inside, t_row, r_row, lane)
                f = Float32(1.0)
                if inside:
                    f = cute.math.exp(k_j - kp)
                    s_j = se[(row, j)] * f
                    total = total + s_j
                    if j != jt:
                        others = others + s_j
                if not plain:  # rare: a logit above T + GUARD somewhere in the row
                    self._rescale_block(e, row, j0, inside and j != jt and f != Float32(1.0), f, lane)
            total = warp_sum(total)

            if valid:
                k_t = t_row
                if not plain and se[(row, jt)] >= Float32(math.exp(self.guard - 1.0)):
                    k_t = self._recovered_k(e, gu, gw, row, jt, t_row, r_row, lane)
                ft = cute.math.exp(k_t - kp)
                cute.arch.sync_warp()  # the target tile is read (_recovered_k) before any lane rescales it
                o_t = Float32(0.0)
                for i in cutlass.range_constexpr(self.tile // 32):
                    c = jt * self.tile + i * 32 + lane
                    if c < v and c != tgt:
                        x = e[(row, c)].to(Float32)
                        o_t = o_t + x
                        if ft != Float32(1.0):
                            e[(row, c)] = (x * ft).to(e.element_type)
                others = cute.math.fma(ft, o_t, others)
            others = warp_sum(others)

            if lane == 0:
                lse[row] = kp + cute.math.log(total)
                rs[row] = r_row * (coef[row] / total)
                if valid:
                    e[(row, tgt)] = (-others).to(e.element_type)

    @cute.jit
    def _rescale_block(self, e, row, j0, mine, f, lane):
        """Tile j0 + b times lane b's f, for every lane b with ``mine`` (its tile not the
        target's, f != 1), by the whole warp: coalesced 2-byte accesses, a ballot's set bits in
        order. A sync first: the block's tiles were read (``_recovered_k``) by every lane."""
        m, v = e.shape
        cute.arch.sync_warp()
        need = cute.arch.vote_ballot_sync(mine)
        while need != 0:
            b = Int32(cute.arch.clz(cute.arch.brev(need)))
            fb = cute.arch.shuffle_sync(f, offset=b)
            for i in cutlass.range_constexpr(self.tile // 32):
                c = (j0 + b) * self.tile + i * 32 + lane
                if c < v:
                    e[(row, c)] = (e[(row, c)].to(Float32) * fb).to(e.element_type)
            need = need & (need - 1)

    @cute.jit
    def _block_k(self, e, se, gu, gw, row, j0, inside, t_row, r_row, lane):
        """This lane's tile j0 + lane's K: T, unless its sum reaches e^(GUARD - 1), which a tile
        whose K was its max - GUARD always does (its largest e is e^GUARD) and a tile with K = T
        only does with a logit above about T + GUARD - 1 - log(tile). Such tiles (rare) are
        found by a ballot and their K recovered by the whole warp, one after another
        (``_recovered_k``); every lane calls this with the same j0."""
        nt = se.shape[1]
        s_j = se[(row, cutlass.min(j0 + lane, nt - 1))]
        rare = inside and s_j >= Float32(math.exp(self.guard - 1.0))
        mask = cute.arch.vote_ballot_sync(rare)
        k_j = t_row
        while mask != 0:
            b = Int32(cute.arch.clz(cute.arch.brev(mask)))  # the lowest set bit: the next rare tile
            kk = self._recovered_k(e, gu, gw, row, j0 + b, t_row, r_row, lane)
            k_j = Float32(cutlass.select_(lane == b, kk, k_j))
            mask = mask & (mask - 1)
        return k_j

    @cute.jit
    def _recovered_k(self, e, gu, gw, row, jj, t_row, r_row, lane):
        """Tile jj's K from its stored values, by the whole warp (every lane calls it with the
        same jj, before any rescale of the tile): the column of its largest e (the first of
        equals: a butterfly over (value, column)), that column's logit l = rstd (u . w[col])
        recomputed in fp32 (lanes over 16-byte groups, a butterfly sum in a fixed order), and
        K = l - GUARD where that exceeds T by more than ``MARGIN``, else T. K's error: the
        logit's fp32 rounding and, where several logits round to the largest bf16 e, their
        spread (under bf16's relative step at e^GUARD, 2^-8: 0.004); the tile's values and the
        row's LSE carry it, at or below bf16's rounding of e."""
        m, v = e.shape
        best = Float32(-1.0)
        arg = Int32(jj * self.tile)
        for i in cutlass.range_constexpr(self.tile // 32):
            c = jj * self.tile + i * 32 + lane
            if c < v:
                x = e[(row, c)].to(Float32)
                if x > best:
                    best = x
                    arg = c
        for off in (16, 8, 4, 2, 1):
            ob = cute.arch.shuffle_sync_bfly(best, offset=off)
            oa = cute.arch.shuffle_sync_bfly(arg, offset=off)
            take = ob > best or (ob == best and oa < arg)
            best = Float32(cutlass.select_(take, ob, best))
            arg = Int32(cutlass.select_(take, oa, arg))
        top = r_row * warp_row_dot(gu, gw, row, arg, lane) - Float32(self.guard)
        return Float32(cutlass.select_(top > t_row + Float32(MARGIN), top, t_row))
