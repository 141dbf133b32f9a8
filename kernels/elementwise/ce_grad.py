"""Cross-entropy gradient in place, for a fused LM-head backward.

For every row ``m`` of ``logits`` (M, V) and column ``v``, with ``l = float(logits[m, v])`` read
before it is overwritten (at the target column ``l = target_logit[m]``, the fp32 value the logits
GEMM gathered before it rounded the logits to bf16) and ``p = exp(l - lse[m])``:

    logits[m, v]   <- bf16( rstd[m] * coef[m] * (p - [v == targets[m]]) )
    partials[m, j]  = coef[m] * ( sum_{v in chunk j} p * l  -  [targets[m] in chunk j] * l_target )

where chunk ``j`` is the columns ``[j * CHUNK, (j + 1) * CHUNK) & [0, V)`` and ``0 <= j < T =
num_chunks(V)``. The partials are the per-chunk terms of ``s[m] = sum_v dlogit[m, v] * l[m, v]``
(``dlogit = coef * (softmax - onehot)``); a later GEMM epilogue sums them over ``j``. Each is
computed as ``coef[m] * sum_v (p - [v == target]) * l`` in a fixed order (no atomics), and every
one of them is written, so ``partials`` needs no zero-init.

Why the target takes the fp32 logit: 1 - p_t of a confident row (the target's logit well above
the others) is far below the bf16 rounding of that logit (0.03 at 15), so p_t from the stored
logit made the target's term of the gradient mostly rounding (``scripts/exp_lm_head_exp_form.py``:
G's relative error against float64 8.8 with the target 15 nats up, 1.7e-3 with the fp32 target).

Ignored rows have ``coef[m] == 0`` and any ``targets[m]`` (e.g. -100): the target is only ever
compared with column indices, never used as an address. Their ``lse`` is replaced by +inf, so
their gradient row and partials are exact zeros whatever ``lse`` holds there.

Bandwidth-bound: 2 bytes read + 2 written per element. Launch: a flat grid of ``ceil(M / ROWS) *
T`` CTAs of ``THREADS`` threads, chunk index fastest, so that the CTAs resident together sweep
whole rows, i.e. contiguous memory. No specialization: CTA ``b * T + j`` owns rows ``[b * ROWS,
(b + 1) * ROWS)`` of chunk ``j``, and each of its threads ``VPT`` 8-element (16-byte) column groups
of each of those rows, ``THREADS`` groups apart (a warp covers 512 contiguous bytes per access). A
thread issues all its ``ROWS * VPT`` 16-byte loads, then the row scalars (lse, rstd, coef, target:
one broadcast load each per row), then per vector computes ``p`` in fp32, stores the bf16
gradient and folds ``(p - onehot) * l`` into its running sum. (That is the PTX order; ptxas
issues the first two loads before any math and the other two after the first vector's, to save
registers. 10 resident CTAs per SM keep enough in flight regardless.) The CTA reduces each row's sum with
butterfly shuffles (fixed order) and a ``(ROWS, WARPS)`` shared-memory step in which one thread
per row adds the warps' sums in warp order and writes the partial.

Only CTAs of the last row band or of the chunk holding column ``V - 1`` (when that chunk is not
whole) take the guarded path: whole vectors under predicates and, when ``V`` is no multiple of 8,
the row's ragged end (``V % 8`` columns) read and written element by element (2-byte accesses)
by the thread whose next vector it would be, so no byte past column ``V - 1`` of a row is ever
touched. Rows must start 16-byte aligned: base 16-byte aligned, row stride a multiple of 8.

Measured on an H200 (the cubin launched directly; median of 20): M=4096, V=128256 in 515-518 us,
4.06-4.08 TB/s counting 4 bytes per element, 97 % of torch's device-to-device copy_ of the same
bytes (4.17-4.20 TB/s); M=8192 96-97 %; M=1024 or V=32000 3.64-3.70 TB/s, 90-92 %.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.fastmath import fast_exp

#: columns per partial (one CTA column extent)
CHUNK = 4096
#: elements per access (16 bytes of bf16)
VEC = 8
THREADS = 128
WARPS = THREADS // 32
#: rows per CTA. One row (4 loads per thread, 48 registers, 10 CTAs per SM) measured as fast as
#: 4 rows of 256 threads (8 loads per thread, 80 registers) and 2 % faster than 2 rows of 128.
ROWS = 1
#: 16-byte vectors per thread and row: the independent loads each thread issues before any math
VPT = CHUNK // (VEC * THREADS)
assert VPT * VEC * THREADS == CHUNK and ROWS <= WARPS


def num_chunks(v: int) -> int:
    """T, the number of partials per row (columns of ``partials``) for a vocabulary of ``v``."""
    return -(-v // CHUNK)


class CrossEntropyGrad:
    """``logits <- rstd * coef * (softmax - onehot)`` in place, plus per-chunk partials of
    ``sum_v dlogit * logit``; see the module docstring. Arguments: ``logits`` (M, V) bf16 with a
    16-byte-aligned base and row stride; ``lse``, ``rstd``, ``coef`` (M,) fp32; ``targets`` (M,)
    int32; ``target_logit`` (M,) fp32; ``partials`` (M, >= T) fp32."""

    def __init__(self, dtype=cutlass.BFloat16):
        if dtype is not cutlass.BFloat16:
            raise NotImplementedError(f"CrossEntropyGrad is bf16 only, got {dtype}")
        self.dtype = dtype

    @cute.jit
    def __call__(self, logits: cute.Tensor, lse: cute.Tensor, rstd: cute.Tensor, coef: cute.Tensor,
                 targets: cute.Tensor, target_logit: cute.Tensor, partials: cute.Tensor, stream):
        m, v = logits.shape
        # one flat grid: no 65535 limit (grid y) on M
        self.kernel(logits, lse, rstd, coef, targets, target_logit, partials).launch(
            grid=(cute.ceil_div(m, ROWS) * cute.ceil_div(v, CHUNK), 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, logits: cute.Tensor, lse: cute.Tensor, rstd: cute.Tensor, coef: cute.Tensor,
               targets: cute.Tensor, target_logit: cute.Tensor, partials: cute.Tensor):
        gl = cute.zipped_divide(logits, (1, VEC))  # ((1, VEC), (M, ceil(V / VEC))) 16-byte vectors
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        m, v = logits.shape
        # chunk fastest: CTAs resident together sweep whole row bands, i.e. contiguous memory
        # (a 2-D grid with row bands fastest measured 10 % slower: 8 KB pieces a row apart)
        t = (v + CHUNK - 1) // CHUNK
        band, chunk = bid // t, bid % t
        nfull = v // VEC  # whole 16-byte vectors per row
        row0 = band * ROWS
        q0 = chunk * (CHUNK // VEC) + tidx  # this thread's first vector; then every THREADS

        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((ROWS, WARPS)), 16)

        acc = cute.make_rmem_tensor(cute.make_layout(ROWS), Float32)
        acc.fill(0.0)
        if row0 + ROWS <= m and (chunk + 1) * (CHUNK // VEC) <= nfull:
            # interior: every load issued before the first use
            vals = [gl[(None, (row0 + k // VPT, q0 + (k % VPT) * THREADS))].load() for k in range(ROWS * VPT)]
            lse_r, rc_r, tgt_r, tl_r = self._row_scalars(lse, rstd, coef, targets, target_logit, row0, m)
            for k in cutlass.range_constexpr(ROWS * VPT):
                r, q = k // VPT, q0 + (k % VPT) * THREADS
                g, s = self._grad(vals[k].to(Float32), lse_r[r], rc_r[r], tgt_r[r] - q * VEC, tl_r[r])
                gl[(None, (row0 + r, q))].store(g.to(self.dtype))
                acc[r] = acc[r] + s
        else:
            # edge (last row band, or the chunk holding column V - 1): whole vectors under guards,
            # loaded into zero-filled registers, all before the first use ...
            buf = cute.make_rmem_tensor(cute.make_layout(((1, VEC), ROWS * VPT)), self.dtype)
            buf.fill(0.0)
            for k in cutlass.range_constexpr(ROWS * VPT):
                row, q = row0 + k // VPT, q0 + (k % VPT) * THREADS
                if row < m and q < nfull:
                    buf[(None, k)].store(gl[(None, (row, q))].load())
            lse_r, rc_r, tgt_r, tl_r = self._row_scalars(lse, rstd, coef, targets, target_logit, row0, m)
            for k in cutlass.range_constexpr(ROWS * VPT):
                r = k // VPT
                row, q = row0 + r, q0 + (k % VPT) * THREADS
                g, s = self._grad(buf[(None, k)].load().to(Float32), lse_r[r], rc_r[r], tgt_r[r] - q * VEC,
                                  tl_r[r])
                inside = row < m and q < nfull
                acc[r] = acc[r] + Float32(cutlass.select_(inside, s, Float32(0.0)))
                if inside:
                    gl[(None, (row, q))].store(g.to(self.dtype))
            # ... then the ragged end of a row (V % VEC columns) element by element, by the thread
            # whose next vector it would be, so nothing past column V - 1 is read or written
            rel = nfull - q0
            if v % VEC != 0 and rel >= 0 and rel < VPT * THREADS and rel % THREADS == 0:
                for r in cutlass.range_constexpr(ROWS):
                    if row0 + r < m:
                        for e in cutlass.range_constexpr(VEC - 1):
                            col = nfull * VEC + e
                            if col < v:
                                is_target = tgt_r[r] == col
                                x = Float32(cutlass.select_(is_target, tl_r[r], logits[(row0 + r, col)].to(Float32)))
                                d = self._dprob(x, lse_r[r], is_target)
                                acc[r] = cute.math.fma(d, x, acc[r])
                                logits[(row0 + r, col)] = (rc_r[r] * d).to(self.dtype)

        # Row sums: warp butterfly, then one thread per row adds the warps' sums in order.
        warp, lane = tidx // 32, tidx % 32
        for r in cutlass.range_constexpr(ROWS):
            s = acc[r]
            for off in (16, 8, 4, 2, 1):
                s = s + cute.arch.shuffle_sync_bfly(s, offset=off)
            if lane == 0:
                red[(r, warp)] = s
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(ROWS):
            if tidx == r * 32 and row0 + r < m:
                tot = red[(r, 0)]
                for w in cutlass.range_constexpr(1, WARPS):
                    tot = tot + red[(r, w)]
                partials[(row0 + r, chunk)] = coef[row0 + r] * tot

    @staticmethod
    def _row_scalars(lse, rstd, coef, targets, target_logit, row0, m):
        """Per row of the band: ``lse`` (+inf on ignored rows, whose gradient is then exactly 0
        whatever their lse holds), ``rstd * coef``, the target and its fp32 logit. Read after the
        band's vector loads are issued, so that the two round trips to memory overlap instead of
        queueing. Rows past M read row M - 1 (a broadcast, never stored)."""
        lse_r, rc_r, tgt_r, tl_r = [], [], [], []
        for r in range(ROWS):
            row = cutlass.min(row0 + r, m - 1)
            c = coef[row]
            lse_r.append(Float32(cutlass.select_(c == Float32(0.0), Float32(math.inf), lse[row])))
            rc_r.append(rstd[row] * c)
            tgt_r.append(targets[row])
            tl_r.append(target_logit[row])
        return lse_r, rc_r, tgt_r, tl_r

    @staticmethod
    def _dprob(x, lse, is_target):
        """``p - onehot`` of one element: ``exp(x - lse)``, less 1 at the target."""
        p = fast_exp(x - lse)
        return Float32(cutlass.select_(is_target, p - Float32(1.0), p))

    def _grad(self, x, lse, rc, hit, tl):
        """One vector's gradient ``rc * (p - onehot)`` (fp32, shaped like ``x``) and its share
        ``sum (p - onehot) * x`` of the row's partial (summed in element order), the target's
        element taking ``tl``, its fp32 logit. ``hit`` is the target's offset from the vector's
        first column (a match only for 0 <= hit < VEC)."""
        g = cute.make_rmem_tensor(cute.make_layout(x.shape), Float32)
        s = Float32(0.0)
        for e in range(VEC):
            is_target = hit == e
            xe = Float32(cutlass.select_(is_target, tl, x[e]))
            d = self._dprob(xe, lse, is_target)
            s = cute.math.fma(d, xe, s)
            g[e] = rc * d
        return g.load(), s
