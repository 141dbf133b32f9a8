"""The folds of the Hopper tree epilogue (``kernels.sm90.epilogue``): row and column reductions,
gathers and the quantize sink's block scales, as a mixin of ``Sm90TreeEpilogue``.

Roles: the consumer warpgroups' epilogue threads, per sub-tile and then per tile. Row values live
in the accumulator layout of WGMMA: each row of a 64-row atom is held by the 4 lanes of a quad
(2 adjacent columns per 8-column chunk), so a row's total is a thread's own values combined over
its quad (butterfly shuffles 1 and 2); columns combine over a warp's 8 row groups (shuffles 4,
8, 16) and then across warps through a shared-memory scratch row.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.fastmath import fast_exp, fast_max
from ..common.fp8_math import block_scale
from ..epilogue import nodes as N
from ..epilogue.edges import unmasked_max, zero_past_edge, zero_past_rows

_NEG_INF = -math.inf
#: the largest finite value of each quantize sink dtype
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
FP8_TYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2}


class SinkFolds:
    """Reductions, gathers and quantize scales over the tile (``self`` is the tree epilogue)."""

    def _row_init(self, r: N.RowReduce):
        slots = self.row_slots
        if r.op == "max":
            return [Float32(_NEG_INF)] * slots
        if r.op == "lse":
            return ([Float32(_NEG_INF)] * slots, [Float32(0.0)] * slots)
        return [Float32(0.0)] * slots

    @property
    def row_slots(self) -> int:
        """Distinct rows per thread in a tile (2 per 64-row WGMMA atom the thread covers)."""
        return 2 * (self.tile_mn[0] // (64 * (1 if self.pingpong else 2)))

    def _row_step(self, r, accum, lse_items: dict, emit, ctx, v: int, problem_mnl):
        """Fold element v into a row reduction: sum / sumsq / max at once; an lse collects a
        quad's values per row first (its rescale costs an exp per quad, not per value). Columns
        past N are masked out, except in a sum of a value that is zero there
        (``edges.zero_past_edge``: the residual stream's sum of squares, the SwiGLU backward's
        zdz) or a max of one that is also never negative (``edges.unmasked_max``: an amax),
        which saves a compare and a select per element."""
        x = _as_float(emit.value(r.x, v))
        if r.op == "sumsq":
            x = x * x
        slot = ctx.row_slot(v)
        out = list(accum)
        if r.op in ("sum", "sumsq") and zero_past_edge(r.x):  # the columns past N add zero
            out[slot] = out[slot] + Float32(x)
            return out
        if r.op == "max" and unmasked_max(r.x):  # a zero past N cannot raise a max of values >= 0
            out[slot] = fast_max(out[slot], x)
            return out
        valid = ctx.col_index(v) < problem_mnl[1]
        if r.op == "lse":
            lse_items.setdefault(slot, []).append((valid, x))
            return accum
        if r.op == "max":
            out[slot] = fast_max(out[slot], cutlass.select_(valid, x, Float32(_NEG_INF)))
        else:
            out[slot] = out[slot] + Float32(cutlass.select_(valid, x, Float32(0.0)))
        return out

    @cute.jit
    def _row_finish(self, r, accum, outs, acc_coords, tn, tl, problem_mnl):
        """Reduce each row over the 4 threads that share it and write the tile's partial."""
        lane = cute.arch.lane_idx()
        out0 = outs[self.out_slots[r.name]]
        out1 = outs[self.out_slots[r.name] + 1] if const_expr(r.op == "lse") else None
        for slot in cutlass.range_constexpr(self.row_slots):
            m = acc_coords[self.row_slot_index(slot)][0]
            if const_expr(r.op == "lse"):
                mx, sm = accum[0][slot], accum[1][slot]
                for off in cutlass.range_constexpr(2):
                    m_o = cute.arch.shuffle_sync_bfly(mx, offset=1 << off)
                    s_o = cute.arch.shuffle_sync_bfly(sm, offset=1 << off)
                    m_new = fast_max(mx, m_o)
                    sm = _rescale(sm, mx, m_new) + _rescale(s_o, m_o, m_new)
                    mx = m_new
                if lane % 4 == 0:
                    if m < problem_mnl[0] and tn * self.tile_mn[1] < problem_mnl[1]:
                        out0[(m, tn, tl)] = mx
                        out1[(m, tn, tl)] = sm
            else:
                x = accum[slot]
                for off in cutlass.range_constexpr(2):
                    x = _combine(r.op == "max", x, cute.arch.shuffle_sync_bfly(x, offset=1 << off))
                if lane % 4 == 0:
                    if m < problem_mnl[0] and tn * self.tile_mn[1] < problem_mnl[1]:
                        out0[(m, tn, tl)] = x

    def row_slot_index(self, slot: int):
        """Accumulator coordinate of the first register in row slot ``slot``."""
        return ((0, slot % 2, 0), slot // 2, 0)

    def _col_parts(self, c, n_frag: int):
        """A sub-tile's per-column partials of ``c`` in this thread: one per column it holds
        (n_frag / 2, its two row halves folded as they are computed)."""
        return cute.make_rmem_tensor(n_frag // 2, Float32)

    def _col_step(self, c, parts, emit, ctx, v: int, problem_mnl):
        """Fold element v into its column's partial once both of that column's row halves are
        computed (sub-tile element v = pair bit + 2 * row-half bit + 4 * chunk), so that a
        column-reduced value dies with its element instead of living to the sub-tile's end."""
        if v % 4 < 2:
            return
        is_max = c.op == "max"
        identity = Float32(_NEG_INF) if is_max else Float32(0.0)
        # rows past M are masked out, unless the value is zero there and the op cannot tell
        # (``edges``: a sum, or a max of values >= 0)
        masked = not (unmasked_max(c.x, "row") if is_max else zero_past_rows(c.x))
        parts_in = []
        for w in (v - 2, v):
            x = _as_float(emit.value(c.x, w))
            if c.op == "sumsq":
                x = x * x
            if masked:
                x = Float32(cutlass.select_(ctx.row_index(w) < problem_mnl[0], x, identity))
            parts_in.append(x)
        parts[(v // 4) * 2 + v % 2] = _combine(is_max, parts_in[0], parts_in[1])

    @cute.jit
    def _col_fold(self, c, parts, scratch, n_frag: cutlass.Constexpr, warp_in_epi, ctx):
        """This sub-tile's column partials over the warp's 8 row groups (lanes 4 apart), then
        into the warp's scratch row (warps combine in ``_col_finish``)."""
        is_max = c.op == "max"
        for j in cutlass.range_constexpr(n_frag // 4):
            for pair in cutlass.range_constexpr(2):
                x = parts[2 * j + pair]
                for off in cutlass.range_constexpr(3):
                    x = _combine(is_max, x, cute.arch.shuffle_sync_bfly(x, offset=4 << off))
                nl = ctx.tile_local(4 * j + pair)[1]
                if cute.arch.lane_idx() < 4:
                    scratch[(warp_in_epi, nl)] = _combine(is_max, scratch[(warp_in_epi, nl)], x)

    @cute.jit
    def _col_finish(self, c, scratch, out, tidx, tn, tm, tl, problem_mnl):
        is_max = c.op == "max"
        identity = Float32(_NEG_INF) if is_max else Float32(0.0)
        threads = self.epi_warps * 32
        for base in cutlass.range_constexpr(0, self.tile_mn[1], threads):
            col = base + tidx
            if col < self.tile_mn[1]:
                total = identity
                for w in cutlass.range_constexpr(self.epi_warps):
                    total = _combine(is_max, total, scratch[(w, col)])
                    scratch[(w, col)] = identity
                n = tn * self.tile_mn[1] + col
                # A cluster can run past the problem's last row tile: such tiles have no partial.
                if n < problem_mnl[1] and tm * self.tile_mn[0] < problem_mnl[0]:
                    out[(n, tm, tl)] = total

    @cute.jit
    def init_scratch(self, scratch, tidx):
        """Scratch starts at the reduction identity (afterwards ``_col_finish`` resets it)."""
        for c, s in zip(self.col_reds, scratch):
            identity = Float32(_NEG_INF) if c.op == "max" else Float32(0.0)
            threads = self.epi_warps * 32
            for i in cutlass.range_constexpr(0, cute.size(s), threads):
                idx = i + tidx
                if idx < cute.size(s):
                    s[idx] = identity

    @cute.jit
    def _gather_now(self, g, emit, ctx, v: cutlass.Constexpr, out, problem_mnl, tl):
        m = ctx.row_index(v)
        n = ctx.col_index(v)
        hit = (n == Int32(emit.value(g.index, v))) & (n < problem_mnl[1])
        x = _as_float(emit.value(g.x, v))
        if hit:
            if m < problem_mnl[0]:
                out[(m, tl)] = x

    def _gather_step(self, g, hits, emit, ctx, v: int, problem_mnl):
        """Keep element v's value in its row slot if its column is the row's index (a row's
        index lies in at most one column: a select, no branch per element)."""
        n = ctx.col_index(v)
        hit = (n == Int32(emit.value(g.index, v))) & (n < problem_mnl[1])
        slot = ctx.row_slot(v)
        out = list(hits)
        seen, val = out[slot]
        out[slot] = (seen | hit, Float32(cutlass.select_(hit, _as_float(emit.value(g.x, v)), val)))
        return out

    @cute.jit
    def _gather_finish(self, hits, out, acc_coords, tl, problem_mnl):
        """Write the gathered values of the tile's rows whose index column was in the tile."""
        for slot in cutlass.range_constexpr(self.row_slots):
            m = acc_coords[self.row_slot_index(slot)][0]
            seen, val = hits[slot]
            if seen:
                if m < problem_mnl[0]:
                    out[(m, tl)] = val

    def _quantize(self, q, vals, ctx, n_frag: int, sQ, buf, scales, problem_mnl, tl):
        """A quantize sink over one sub-tile (one aligned 128-value block of each of its rows: 128
        columns, or 64 of a double-width value's column pairs): per row, amax over the block
        (columns past N count as 0), reduced over the row's quad; the block scale s and 1 / s as
        the quantize kernels compute them (``fp8_math``); each pair of adjacent values cast to FP8
        (``cvt.rn.satfinite``) and staged as one 16-bit word for the TMA store; the quad's first
        lane writes the row's scale."""
        fp8 = FP8_TYPES[q.dtype]
        per = 2 if q.wide else 1  # values per fragment element
        slots = sorted({ctx.row_slot(v) for v in range(n_frag)})
        amax = {slot: Float32(0.0) for slot in slots}
        for i in range(per * n_frag):
            v = i // per
            x = Float32(cutlass.select_(ctx.col_index(v) < problem_mnl[1], vals[i], Float32(0.0)))
            vals[i] = x
            slot = ctx.row_slot(v)
            amax[slot] = cute.arch.fmax(amax[slot], cute.math.abs(x), nan=True)
        inv = {}
        for slot in slots:
            a = amax[slot]
            for off in (1, 2):
                a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=off), nan=True)
            amax[slot], inv[slot] = block_scale(a, Float32(FP8_MAX[q.dtype]), q.pow2)
        # the value pairs: a double-width element's own pair, else elements v and v + 1
        for i in range(0, per * n_frag, 2):
            v = i // per
            q8 = _fp8_pair(fp8, vals[i] * inv[ctx.row_slot(v)], vals[i + 1] * inv[ctx.row_slot(v)])
            word = cute.make_tensor(cute.recast_ptr(q8.iterator, dtype=cutlass.Int16), cute.make_layout(1))
            ml, nl = ctx.local(v)
            sQ[(ml, nl if q.wide else nl // 2, buf)] = word[0]
        for slot in slots:
            v = next(v for v in range(n_frag) if ctx.row_slot(v) == slot)
            blk = ctx.col_index(v) * per // N.QUANT_BLOCK
            self._write_scale(scales, ctx.row_index(v), blk, amax[slot], tl, problem_mnl, per)

    @cute.jit
    def _write_scale(self, scales, m, blk, scale, tl, problem_mnl, per: cutlass.Constexpr):
        """The quad's first lane writes its row's block scale (rows and blocks inside the problem;
        ``per`` values per output column)."""
        if cute.arch.lane_idx() % 4 == 0:
            if m < problem_mnl[0] and blk * N.QUANT_BLOCK < per * problem_mnl[1]:
                scales[(m, blk, tl)] = scale

    def _quantize_t(self, q, vals, ctx, n_frag: int, sT, buf, scratch, scales, warp_in_epi, tidx, barrier,
                    problem_mnl, tile_mnl):
        """A transposed quantize sink over one sub-tile (all 128 rows of each of its columns: one
        block of x^T's row): per column of x, amax over the thread's two rows (elements v and
        v + 2), the warp's 8 row groups (shuffles 4, 8, 16) and the 8 warps (the scratch rows,
        after a barrier); one thread per column computes s and 1 / s, writes s and leaves 1 / s
        in the scratch's last row for the others (a second barrier); every value is then cast to
        FP8 and staged at its transposed place for the TMA store of x^T. Rows past M count as 0.
        The columns of x: the output's (full width), its column pairs' (half: the value at the
        pair's even element), or two per output column (double: value h of element v at 2 v + h)."""
        fp8 = FP8_TYPES[q.dtype]
        # (value index, element, sub-tile row of x^T (a runtime value), the column's static key)
        # of each value the thread holds; elements v and v + 2 (the row halves) share a column,
        # so the key clears bit 1 of v
        if q.half:
            items = [(v, v, ctx.local(v)[1] // 2, v & ~2) for v in range(0, n_frag, 2)]
        elif q.wide:
            items = [(2 * v + h, v, 2 * ctx.local(v)[1] + h, (v & ~2, h)) for v in range(n_frag) for h in (0, 1)]
        else:
            items = [(v, v, ctx.local(v)[1], v & ~2) for v in range(n_frag)]
        for i, v, _, _ in items:
            vals[i] = Float32(cutlass.select_(ctx.row_index(v) < problem_mnl[0], vals[i], Float32(0.0)))
        column = {}
        for i, _, row, key in items:
            column.setdefault(key, (row, []))[1].append(i)
        for row, idx in column.values():
            a = Float32(0.0)
            for i in idx:
                a = cute.arch.fmax(a, cute.math.abs(vals[i]), nan=True)
            for off in (4, 8, 16):
                a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=off), nan=True)
            self._column_partial(scratch, warp_in_epi, row, a)
        barrier.arrive_and_wait()
        sub_rows = cute.size(sT, mode=[0])
        self._column_scales(q, scratch, scales, tidx, ctx.sub0[1], sub_rows, problem_mnl, tile_mnl)
        barrier.arrive_and_wait()
        inv_row = self.epi_warps
        for k in range(0, len(items), 2):
            q8 = _fp8_pair(fp8, *(vals[items[k + h][0]] * scratch[(inv_row, items[k + h][2])] for h in (0, 1)))
            for h in (0, 1):
                _, v, row, _ = items[k + h]
                sT[(row, ctx.local(v)[0], buf)] = q8[h]

    @cute.jit
    def _column_partial(self, scratch, warp_in_epi, row, amax):
        """The warp's amax of the sub-tile's column ``row`` of x^T (the lanes of one row group
        hold them all)."""
        if cute.arch.lane_idx() < 4:
            scratch[(warp_in_epi, row)] = amax

    @cute.jit
    def _column_scales(self, q, scratch, scales, tidx, sub_n0, sub_rows: cutlass.Constexpr, problem_mnl,
                       tile_mnl):
        """Thread ``tidx`` < the sub-tile's rows of x^T: its row's amax over the warps' partials,
        the block scale s (written to ``scales`` (rows of x^T, m tiles) where the row and the
        tile's rows are inside the problem) and 1 / s (left in the scratch's last row)."""
        tm, tn, tl = tile_mnl
        if tidx < sub_rows:
            a = scratch[(0, tidx)]
            for w in cutlass.range_constexpr(1, self.epi_warps):
                a = cute.arch.fmax(a, scratch[(w, tidx)], nan=True)
            s, inv = block_scale(a, Float32(FP8_MAX[q.dtype]), q.pow2)
            scratch[(self.epi_warps, tidx)] = inv
            # x^T's rows: the output columns, their pairs (half-width) or two each (double-width)
            first = (tn * self.tile_mn[1] + sub_n0) * sub_rows // self.epi_tile[1]
            rows = problem_mnl[1] // 2 if const_expr(q.half) else (2 * problem_mnl[1] if const_expr(q.wide)
                                                                  else problem_mnl[1])
            if first + tidx < rows and tm * self.tile_mn[0] < problem_mnl[0]:
                scales[(first + tidx, tm, tl)] = s


def _fp8_pair(fp8, a, b):
    """(a, b) cast to FP8 together (one ``cvt.rn.satfinite ...x2.f32``): a 2-element register
    tensor, a in the low byte."""
    pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
    pair[0], pair[1] = a, b
    q8 = cute.make_rmem_tensor(cute.make_layout(2), fp8)
    q8.store(pair.load().to(fp8))
    return q8


def _combine(is_max: bool, a, b):
    return fast_max(a, b) if is_max else a + b


def _as_float(x):
    return x if isinstance(x, Float32) else Float32(x)


def _lse_fold(accum, items: dict):
    """Fold a sub-tile's values per row slot into running (max, sum of exp) pairs."""
    mx, sm = list(accum[0]), list(accum[1])
    for slot, vals in items.items():
        m_sub = mx[slot]
        for valid, x in vals:
            m_sub = fast_max(m_sub, cutlass.select_(valid, x, Float32(_NEG_INF)))
        s_new = _rescale(sm[slot], mx[slot], m_sub)
        for valid, x in vals:
            s_new = s_new + Float32(cutlass.select_(valid, fast_exp(x - m_sub), Float32(0.0)))
        mx[slot], sm[slot] = m_sub, s_new
    return (mx, sm)


def _rescale(s, m_old, m_new):
    """s * exp(m_old - m_new), with an empty running sum (m_old = -inf) staying 0."""
    return Float32(cutlass.select_(m_old == m_new, s, s * fast_exp(m_old - m_new)))
