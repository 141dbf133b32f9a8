"""RoPE (+ QK-norm) backward, after attention's backward: the gradient ``g`` of the QKV GEMM's
r-scaled output and the row statistic ``s`` of the RMSNorm backward (coda-math section 3.1).

Layout: M = B*S token rows (row ``m = b*S + s``); ``qkv`` (M, N) holds, per row, the columns
[Q: H heads | K: Hkv heads | V: Hkv heads] x D, N = (H + 2 Hkv) D, n_qk = (H + Hkv) D. RoPE uses
adjacent pairs: element 2k of a head pairs with 2k+1, at the angle
``theta = float32(positions[m]) * inv_freq[k]`` (fp32 product), as in the forward epilogue
(``norm_rope_qkv_tree``, the same fast_sin / fast_cos). The incoming gradients are those of
scaled_dot_product_attention: ``dq`` (B, H, S, D), ``dk`` / ``dv`` (B, Hkv, S, D).

With ``r = rstd[m]``, per Q/K head of row m (``d``: that head's D values of dq or dk), per pair
``(a, b)`` of ``d`` at pair index k, the inverse rotation (by -theta):

    dqn_a = a cos(theta) + b sin(theta),   dqn_b = -a sin(theta) + b cos(theta)

* plain:    dz = dqn on Q/K;  dz = dv on V;
            s[m] = sum_j qkv[m, j] * [dq | dk | dv][m, j]   (= sum z dz: the rotation is orthogonal)
* QK-norm:  x = x_pre[m, head] (the r-scaled, pre-norm, pre-rotation values), w = q_w on a Q
            head, k_w on a K head:
            rs = (mean(x^2) + qk_eps)^(-1/2), xh = x rs, gw = dqn w,
            dz = rs (gw - xh mean(gw xh))                 (means over the head's D values)
            s[m] = sum_{Q/K} x dz + sum_V qkv dv,  a head's sum x dz taken in the exact closed
                   form  qk_eps rs^3 sum(x gw)  (the literal sum cancels down to ~qk_eps)
            dw_partials[p, 0 | 1, e] = sum over the rows of CTA p and its Q | K heads of
                                       dqn[m, head, e] xh[m, head, e]
            dq_w[e], dk_w[e] = sum over p of dw_partials[p, 0 | 1, e]   (in the weights' dtype)
* always:   g[m, j] = bf16(r dz[m, j]).

Bandwidth-bound: dq/dk/dv and qkv (QK-norm: x_pre on Q/K, qkv on V) are read and g written,
once, 16 bytes (8 bf16 = 4 pairs) per access. D % 8 == 0, so a vector never crosses a head: it
has one source tensor and one range of pair indices.

Roles (no specialization). ``ctas_per_sm`` CTAs per SM in one wave (grid P =
``num_row_blocks(M)``, at most one per SM by default), each owning a contiguous, even share of
the rows (CTA p: ``M // P`` rows, one more for the first ``M % P``). ``C`` consecutive threads
share a row (C a multiple of 32, THREADS / C rows side by side), and slot t of a row owns the
``VPT`` vectors ``v = t + C i`` of every row it visits: fixed columns, so its gradient source
(dq, dk or dv: picked once, no per-row branch), its QK-norm weights and dw accumulators are set
up once. For H=32, Hkv=8 a row is one vector per thread: C = 768 for D=128, 384 for D=64
(the plain variant runs two such rows side by side, 768 threads; QK-norm one).

The rows go in chunks of ~``chunk_rows`` (64). Before a chunk, the whole CTA fills a
shared-memory table for it: per row (b, s) (unstaged) and r, and per (row, pair quartet) cos /
sin of theta, computed in registers with fast_cos / fast_sin exactly as the forward epilogue
does. Every head of a row shares the angles, so this is one sin/cos per (row, pair) instead of
one per (row, pair, head), and no table is ever read from global memory. Plain variant: the
quartets hold r cos, r sin, plus one (r, 0) quartet that the V slots read, so every slot runs
the same r-scaled rotation.

Loads are issued a step ahead of their use. Plain: a step is 4 rows per thread, all of their
16-byte loads issued into registers before the first use. QK-norm needs ~40 more registers per
row, and unstaged ptxas sinks each row's loads to their first use, past the previous row's head
sums (seen in the SASS: the rows' loads would not be in flight together), so there the loads go
through a ``stages``-deep cp.async pipeline in shared memory instead: each thread copies its
own vectors for step k + stages - 1, waits for step k's group and computes step k from shared
memory (it reads only what it copied itself: no barrier). Its addresses come from a cursor that
moves a row at a time by additions and selects (the (b, s) of its first row from one division,
at the start), and rows past the end are not loaded (their stage slots keep whatever they held,
computed on and never stored). A stage holds ``stage_rows`` consecutive rows per thread, copied
back to back: one wait and one loop trip for that many rows, and rows with no dependence on
each other for the scheduler to interleave (which tuning the H200 runs fastest is what
``bench_rope_backward.py --sweep`` times). One head's vectors sit in D / 8 consecutive lanes of
a warp, so the QK-norm head sums are butterfly shuffles within those lanes (run by every lane,
outside any branch). The row sum s is a warp butterfly and a ``(warps per row, chunk)``
shared-memory step (double buffered), added in warp order by one thread per row after the
chunk's one barrier: deterministic, written once. With QK-norm the side-by-side rows' dw
accumulators are added in shared memory at the end, in order, then the heads' (the staged path
reuses the stages' memory), one thread per (Q | K, e) adding them in head order, and row p of
``dw_partials`` is written (every entry, no atomics on data). The CTAs then count themselves on
``counter`` (an int32 that is 0 at launch): the last to arrive adds every CTA's row in CTA order
(a few groups of threads over disjoint CTA ranges, then the groups in order: deterministic) and
writes dq_w / dk_w in the weights' dtype, and sets the counter back to 0 for the next launch.
So the op is this one launch (before: the weights expanded per column and cast, then a sum over
the CTAs and over the heads and two casts, each a launch of its own).

The kernel is correct for any grid size: with QK-norm it takes P from ``dw_partials.shape[0]``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.fastmath import fast_cos, fast_sin

#: elements per access (16 bytes of bf16)
VEC = 8
#: the most threads that share one row
MAX_ROW_THREADS = 768
#: fewest rows per CTA: small M uses fewer CTAs rather than CTAs with a handful of rows
MIN_ROWS = 16
NUM_SMS = 132
#: shared memory a CTA may take (the sm_90 opt-in limit, 227 KB, less 1 KB of alignment slack)
SMEM_BUDGET = 227 * 1024 - 1024
#: shared memory of an SM (sm_90): n CTAs on one SM share it, each also reserving 1 KB
SMEM_PER_SM = 228 * 1024


def smem_budget(ctas_per_sm: int) -> int:
    """Shared memory one of ``ctas_per_sm`` co-resident CTAs may take (alignment slack kept)."""
    return min(SMEM_BUDGET, SMEM_PER_SM // ctas_per_sm - 2048)


def num_row_blocks(m: int, num_sms: int = NUM_SMS, ctas_per_sm: int = 1) -> int:
    """P, the CTA count and the rows of ``dw_partials``, for ``m`` rows: one wave of
    ``ctas_per_sm`` CTAs per SM with equal shares (no tail wave), fewer when ``m`` is small.
    0 for ``m == 0`` (launch nothing then)."""
    return min(-(-m // MIN_ROWS), num_sms * ctas_per_sm)


def row_layout(nv: int, min_vpt: int = 1) -> tuple[int, int]:
    """(C, VPT) for a row of ``nv`` 16-byte vectors: the fewest vectors per thread, at least
    ``min_vpt``, such that C = nv / VPT is a multiple of 32 of at most MAX_ROW_THREADS; else
    (ragged) the fewest warps covering the row."""
    for vpt in range(min_vpt, nv + 1):
        c, rem = divmod(nv, vpt)
        if rem == 0 and c % 32 == 0 and c <= MAX_ROW_THREADS:
            return c, vpt
    vpt = max(min_vpt, -(-nv // MAX_ROW_THREADS))
    return 32 * -(-nv // (32 * vpt)), vpt


class RopeBackward:
    """See the module docstring. ``__call__(dq, dk, dv, qkv, rstd, positions, inv_freq, g, s,
    x_pre, q_w, k_w, dw_partials, counter, dq_w, dk_w, qk_eps, stream)``:

    dq (B, H, S, D), dk / dv (B, Hkv, S, D) bf16, any strides with D contiguous, the others
    multiples of 8 elements, 16-byte-aligned bases; qkv, g (M, N) bf16 and x_pre (M, N) bf16
    (QK-norm; only its first n_qk columns are read), rows 16-byte aligned; rstd (M,) fp32;
    positions (M,) int32; inv_freq (D/2,) fp32, 16-byte aligned; s (M,) fp32 out; q_w, k_w (D,)
    contiguous, both fp32 or both bf16 (read once per thread, any alignment); dw_partials
    (P, 2, D) fp32, contiguous: the CTAs' workspace; counter (1,) int32, 0 at launch and again
    after it (one launch at a time may use it); dq_w, dk_w (D,) out, contiguous, the weights'
    dtype; qk_eps fp32. Without QK-norm x_pre, q_w, k_w, dw_partials, counter, dq_w and dk_w are
    None and qk_eps is ignored.

    Tuning (keyword arguments; defaults in ``DEFAULTS``, picked on an H200 at M = 16384,
    H = 32, Hkv = 8, D = 64 / 128): ``target_threads`` (CTA size aimed at: THREADS / C rows
    side by side), ``min_vpt`` (vectors per thread and row), ``stages`` (> 1: stage the loads
    through shared memory with cp.async, ``stages - 1`` steps ahead; capped to what fits in
    ``smem_budget(ctas_per_sm)``), ``stage_rows`` (staged: consecutive rows per thread and
    stage, their copies issued back to back), ``vecs_in_flight`` (unstaged: rows in flight x VPT
    per thread, held in registers), ``chunk_rows`` (rows per angle table and s flush, rounded to
    whole steps), ``ctas_per_sm`` (grid = num_sms x this; > 1 is also a launch bound).
    """

    #: qk_norm -> tuning. Plain: rows in registers, 4 in flight per thread (768 threads, 62-70
    #: registers). QK-norm needs ~40 more registers per row, so its rows are staged instead, two
    #: consecutive rows per thread and stage, 32-row tables: the fastest of the H200 sweep at
    #: both head dims (2026-12-05, bench_rope_backward.py --sweep, 4 x 4096 tokens, 32 / 8 heads:
    #: 0.860 / 0.900 of copy bandwidth at head_dim 64 / 128 for the kernel and its partials'
    #: sum then, against 0.849 / 0.894 for one row per stage and 64-row tables; with the last
    #: CTA's finish, the op in one launch: 0.878 / 0.907).
    DEFAULTS = {
        False: dict(target_threads=768, min_vpt=1, vecs_in_flight=4, stages=0, stage_rows=1,
                    chunk_rows=64, ctas_per_sm=1),
        True: dict(target_threads=384, min_vpt=1, vecs_in_flight=1, stages=6, stage_rows=2,
                   chunk_rows=32, ctas_per_sm=1),
    }

    def __init__(self, qk_norm: bool, head_dim: int, n_heads: int, n_kv_heads: int,
                 num_sms: int = NUM_SMS, **tuning):
        if head_dim < VEC or head_dim % VEC:
            raise ValueError(f"head_dim must be a positive multiple of {VEC}, got {head_dim}")
        if n_heads < 1 or n_kv_heads < 1:
            raise ValueError(f"need at least one Q and one KV head, got {n_heads}, {n_kv_heads}")
        self.qk_norm = bool(qk_norm)
        unknown = set(tuning) - set(self.DEFAULTS[self.qk_norm])
        if unknown:
            raise TypeError(f"unknown tuning options {sorted(unknown)}")
        cfg = dict(self.DEFAULTS[self.qk_norm], **tuning)
        self.head_dim, self.n_heads, self.n_kv_heads = head_dim, n_heads, n_kv_heads
        self.num_sms, self.ctas_per_sm = num_sms, cfg["ctas_per_sm"]
        self.lph = head_dim // VEC  # vectors (lanes) per head
        if self.qk_norm and 32 % self.lph:
            raise ValueError(f"QK-norm reduces a head over D/8 lanes of one warp, so D/8 must "
                             f"divide 32; got head_dim {head_dim}")
        self.nv = (n_heads + 2 * n_kv_heads) * self.lph  # vectors per row
        self.nv_qk = (n_heads + n_kv_heads) * self.lph
        self.c, self.vpt = row_layout(self.nv, cfg["min_vpt"])
        self.sub_rows = max(1, cfg["target_threads"] // self.c)  # rows side by side
        self.threads = self.c * self.sub_rows
        self.stages = cfg["stages"]
        self.staged = self.stages > 1
        # rows per thread and step: in flight together (in registers when not staged, in one
        # stage's shared memory when staged). The default stage_rows belongs to the staged
        # default, so unstaging (stages=0 alone) drops it; one asked for without staging is refused
        if cfg["stage_rows"] < 1 or ("stage_rows" in tuning and cfg["stage_rows"] > 1 and not self.staged):
            raise ValueError(f"stage_rows must be at least 1, and 1 unless the loads are staged "
                             f"(stages > 1); got {cfg['stage_rows']} with stages {self.stages}")
        if not self.staged:
            cfg["stage_rows"] = 1
        self.rif = cfg["stage_rows"] if self.staged else max(1, cfg["vecs_in_flight"] // self.vpt)
        self.step = self.sub_rows * self.rif  # rows per step
        self.chunk = self.step * max(1, cfg["chunk_rows"] // self.step)  # rows per table / s flush
        # angle quartets per table row: D/8, plus one identity quartet for the V slots
        self.nq = self.lph + 1
        self.ragged = self.nv % self.c != 0  # some slots t + C i fall past the row
        self.warps_per_row = self.c // 32
        budget = smem_budget(self.ctas_per_sm)
        while self.staged and self.stages > 2 and self.smem_bytes() > budget:
            self.stages -= 1
        self.tuning = dict(cfg, stages=self.stages)
        if self.chunk > self.threads or self.threads > 1024 or self.smem_bytes() > budget:
            raise ValueError(f"no launch for this layout: {self.threads} threads, "
                             f"{self.smem_bytes()} bytes of shared memory")

    def num_row_blocks(self, m: int) -> int:
        """P for this kernel (the rows of ``dw_partials`` to allocate)."""
        return num_row_blocks(m, self.num_sms, self.ctas_per_sm)

    def smem_bytes(self) -> int:
        """Shared memory per CTA, alignment padding aside: two chunks' tables (cos / sin
        quartets, (b, s) unstaged, r), the s step, the staged vectors, the dw sums (the
        side-by-side rows'; the heads', in the stages' memory when staged: it holds at least
        two rows of both operands, more than a row of fp32 dw)."""
        row = self.nq * 2 * 4 * 4 + 4 + (0 if self.staged else 8)
        n = 2 * self.chunk * row + 2 * self.chunk * self.warps_per_row * 4
        if self.staged:
            n += self.stages * self.rif * self.threads * self.vpt * 2 * VEC * 2
        elif self.qk_norm:
            n += self.nv_qk * VEC * 4
        if self.qk_norm and self.sub_rows > 1:
            n += (self.sub_rows - 1) * self.c * self.vpt * VEC * 4
        if self.qk_norm:
            n += 16  # the arrival count
        return n

    @property
    def finish_groups(self) -> int:
        """G, the groups of threads that add the CTAs' dw rows over disjoint CTA ranges in the
        last CTA (their 2 D partial sums go to the heads' sum buffer, of (H + Hkv) D floats)."""
        return max(1, min(self.threads // (2 * self.head_dim), (self.n_heads + self.n_kv_heads) // 2))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, dq: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, qkv: cute.Tensor,
                 rstd: cute.Tensor, positions: cute.Tensor, inv_freq: cute.Tensor, g: cute.Tensor,
                 s: cute.Tensor, x_pre, q_w, k_w, dw_partials, counter, dq_w, dk_w, qk_eps: Float32,
                 stream):
        m = qkv.shape[0]
        if const_expr(self.qk_norm):
            blocks = dw_partials.shape[0]  # whatever P the caller allocated
        else:
            blocks = cutlass.min(cute.ceil_div(m, MIN_ROWS), self.num_sms * self.ctas_per_sm)
        # minctasm > 1 also needs the carveout given, else the DSL asks the device for its
        # shared-memory size at compile time. With QK-norm, one CTA per SM is said too: its
        # shared memory allows no second one, and unsaid, ptxas held the kernel to 80 registers
        # (room for two 384-thread CTAs) and spilled
        if const_expr(self.ctas_per_sm > 1):
            bounds = dict(min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)
        else:
            bounds = dict(min_blocks_per_mp=1) if self.qk_norm else {}
        self.kernel(dq, dk, dv, qkv, rstd, positions, inv_freq, g, s, x_pre, q_w, k_w, dw_partials,
                    counter, dq_w, dk_w, qk_eps).launch(grid=(blocks, 1, 1), block=(self.threads, 1, 1),
                                                        stream=stream, **bounds)

    @cute.kernel
    def kernel(self, dq: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, qkv: cute.Tensor,
               rstd: cute.Tensor, positions: cute.Tensor, inv_freq: cute.Tensor, g: cute.Tensor,
               s_out: cute.Tensor, x_pre, q_w, k_w, dw_partials, counter, dq_w, dk_w,
               qk_eps: Float32):
        H, HKV, LPH, C, VPT, RIF = (self.n_heads, self.n_kv_heads, self.lph, self.c, self.vpt,
                                    self.rif)
        tidx, _, _ = cute.arch.thread_idx()
        p, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        m_total = qkv.shape[0]
        seq = dq.shape[2]
        sub = tidx // C  # which of the side-by-side rows
        t = tidx - sub * C  # slot within the row
        wrow = t // 32  # warp within the row

        # this CTA's rows [start, end): an even share, no overflow for any M
        share = m_total // nblk
        extra = m_total - share * nblk
        start = p * share + cutlass.min(p, extra)
        end = start + share + Int32(cutlass.select_(p < extra, 1, 0))

        smem = cutlass.memory.SmemAllocator()
        # per chunk (double buffered): the rows' cos / sin quartets, (b, s) (unstaged: the
        # staged loads keep a cursor instead) and r
        tab_cs = smem.allocate_tensor(Float32, cute.make_layout((4, self.nq, 2, self.chunk, 2)), 16)
        tab_bs = None
        if const_expr(not self.staged):
            tab_bs = smem.allocate_tensor(Int32, cute.make_layout((2, self.chunk, 2)), 16)
        tab_r = smem.allocate_tensor(Float32, cute.make_layout((self.chunk, 2)), 16)
        red = smem.allocate_tensor(Float32, cute.make_layout((self.warps_per_row, self.chunk, 2)), 16)
        st_v = None
        if const_expr(self.staged):
            # the pipeline: (vector, thread, d|z, slot, row, stage); consecutive threads'
            # 16-byte vectors adjacent, so the shared-memory reads are conflict-free
            T, S = self.threads, self.stages
            st_v = smem.allocate_tensor(BFloat16, cute.make_layout(
                (VEC, T, 2, VPT, RIF, S),
                stride=(1, VEC, VEC * T, 2 * VEC * T, 2 * VEC * T * VPT, 2 * VEC * T * VPT * RIF)), 16)
        hsum = None  # QK-norm, unstaged: the CTA's dw per column, summed over heads at the end
        if const_expr(self.qk_norm and not self.staged):
            hsum = smem.allocate_tensor(Float32, cute.make_layout((self.nv_qk * VEC,)), 16)
        arrived = None  # QK-norm: how many CTAs had finished before this one
        if const_expr(self.qk_norm):
            arrived = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)
        xs = None  # QK-norm: the dw accumulators of the other side-by-side rows, added at the end
        if const_expr(self.qk_norm and self.sub_rows > 1):
            xs = smem.allocate_tensor(Float32, cute.make_layout(
                (VEC // 2, C, 2, VPT, self.sub_rows - 1),
                stride=(1, VEC // 2, VEC // 2 * C, VEC * C, VEC * C * VPT)), 16)

        # -- per-thread constants: this thread's vectors, the same in every row ---------------
        # Each vector's gradient source (dq, dk or dv) is chosen once: its (b, s) plane as a
        # tensor of its own, so a row's load is one address computation and no branch.
        srcs, zsrcs, vs, is_qk, valid, quart = [], [], [], [], [], []
        # the same sources as addresses and strides, for the staged loads' cursor: per slot
        # (gradient address, its b stride in elements, in bytes its s stride and the step from
        # (b, S - 1) to (b + 1, 0), z address, z row stride in bytes)
        flat, waddrs = [], []
        for i in cutlass.range_constexpr(VPT):
            v = t + C * i
            if const_expr(self.ragged):
                valid.append(v < self.nv)
                v = cutlass.min(v, self.nv - 1)  # read a real (V) vector, never store it
            h = v // LPH
            d8 = v - h * LPH
            q, kk = h < H, h < H + HKV  # kk only tested after q
            # head indices clamped into each tensor: only the selected one is dereferenced
            heads = (cutlass.min(h, H - 1), cutlass.max(cutlass.min(h - H, HKV - 1), 0),
                     cutlass.max(h - H - HKV, 0))
            addr, sb, ss = [], [], []
            for tsr, hh in zip((dq, dk, dv), heads):
                addr.append(cute.local_tile(tsr[(0, hh, 0, None)], (VEC,), (d8,)).iterator.toint())
                sb.append(tsr.stride[0])
                ss.append(tsr.stride[2])
            daddr, dsb, dss = self._pick(q, kk, addr), self._pick(q, kk, sb), self._pick(q, kk, ss)
            ptr = cute.make_ptr(BFloat16, daddr, cute.AddressSpace.gmem, assumed_align=16)
            srcs.append(cute.make_tensor(ptr, cute.make_layout(
                (VEC, dq.shape[0], seq), stride=(1, cute.assume(dsb, divby=VEC),
                                                 cute.assume(dss, divby=VEC)))))
            # the values z are read from: qkv, or with QK-norm x_pre on the Q/K columns
            zsrc = cute.make_tensor(cute.local_tile(qkv[(0, None)], (VEC,), (v,)).iterator,
                                    cute.make_layout((VEC, m_total), stride=(1, qkv.stride[0])))
            zaddr, zstride = zsrc.iterator.toint(), Int64(qkv.stride[0])
            if const_expr(self.qk_norm):
                zx = cute.local_tile(x_pre[(0, None)], (VEC,), (v,))
                zaddr = Int64(cutlass.select_(v < self.nv_qk, zx.iterator.toint(),
                                              zsrc.iterator.toint()))
                zstride = Int64(cutlass.select_(v < self.nv_qk, x_pre.stride[0], qkv.stride[0]))
                zptr = cute.make_ptr(BFloat16, zaddr, cute.AddressSpace.gmem, assumed_align=16)
                zsrc = cute.make_tensor(zptr, cute.make_layout(
                    (VEC, m_total), stride=(1, cute.assume(zstride, divby=VEC))))
            zsrcs.append(zsrc)
            if const_expr(self.qk_norm):  # the head's norm weights (k_w for a V slot, unused)
                waddrs.append(Int64(cutlass.select_(
                    q, cute.local_tile(q_w, (VEC,), (d8,)).iterator.toint(),
                    cute.local_tile(k_w, (VEC,), (d8,)).iterator.toint())))
            flat.append((Int64(daddr), Int64(dsb), Int64(dss) * 2,
                         (Int64(dsb) - Int64(dss) * Int64(seq - 1)) * 2, Int64(zaddr), Int64(zstride) * 2))
            vs.append(v)
            is_qk.append(v < self.nv_qk)
            # the angle quartet it reads; V slots read the identity one
            quart.append(Int32(cutlass.select_(v < self.nv_qk, d8, LPH)))
        wts, dw_acc = None, None
        if const_expr(self.qk_norm):
            # the norm weights of the vector's columns, in registers (read once: no alignment
            # asked of them); the dw accumulators, (4, 2, VPT) per thread
            wts = []
            wty = q_w.element_type
            for i in cutlass.range_constexpr(VPT):
                w = cute.make_rmem_tensor((VEC,), Float32)
                wptr = cute.make_ptr(wty, waddrs[i], cute.AddressSpace.gmem, assumed_align=wty.width // 8)
                w.store(cute.make_tensor(wptr, cute.make_layout((VEC,))).load().to(Float32))
                if not is_qk[i]:  # a V slot: weights of 1 (with its identity rotation, gw = dv)
                    w.fill(1.0)
                wts.append(w.load())
            dw_acc = cute.make_rmem_tensor((VEC // 2, 2, VPT), Float32)
            dw_acc.fill(0.0)
        out = cute.make_rmem_tensor((VEC,), Float32)
        s_acc = cute.make_rmem_tensor((RIF,), Float32)
        ctx = (vs, quart, valid, is_qk, wts, dw_acc, qk_eps, out, s_acc, tab_cs, tab_r,
               red, g, sub, wrow, tidx)
        n_chunks = cute.ceil_div(end - start, self.chunk)
        if n_chunks > 0:
            self._fill_table(start, end, 0, seq, tidx, rstd, positions, inv_freq, tab_cs, tab_bs, tab_r)
        cute.arch.sync_threads()
        if const_expr(self.staged):
            S = self.stages
            spc = self.chunk // self.step  # steps per chunk
            n_steps = cute.ceil_div(end - start, self.step)
            cp_vec = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                num_bits_per_copy=128)
            src = self._cursor(start + sub * RIF, seq, flat)
            for k in cutlass.range_constexpr(S - 1):  # the prologue: steps 0 .. S - 2
                if k < n_steps:
                    self._issue(k, end, seq, tidx, src, st_v, cp_vec)
                cute.arch.cp_async_commit_group()
            for ci in cutlass.range(n_chunks, unroll=1):
                c0 = start + ci * self.chunk
                cnt = cutlass.min(self.chunk, end - c0)
                buf = ci % 2
                for st in cutlass.range(cutlass.min(spc, n_steps - ci * spc), unroll=1):
                    k = ci * spc + st
                    if k + S - 1 < n_steps:
                        self._issue((k + S - 1) % S, end, seq, tidx, src, st_v, cp_vec)
                    cute.arch.cp_async_commit_group()  # (an empty group past the end)
                    cute.arch.cp_async_wait_group(S - 1)  # step k's copies (this thread's) landed
                    stage = k % S
                    for j in cutlass.range_constexpr(RIF):  # this thread's consecutive rows
                        self._row(j, st * self.step + sub * RIF + j, cnt, c0, buf, ctx,
                                  [st_v[(None, tidx, 0, i, j, stage)].load() for i in range(VPT)],
                                  [st_v[(None, tidx, 1, i, j, stage)].load() for i in range(VPT)])
                self._next_chunk(ci, n_chunks, c0, cnt, buf, start, end, seq, tidx, rstd,
                                 positions, inv_freq, tab_cs, tab_bs, tab_r, red, s_out)
        else:
            buf_d = cute.make_rmem_tensor((VEC, RIF * VPT), BFloat16)
            buf_z = cute.make_rmem_tensor((VEC, RIF * VPT), BFloat16)
            for ci in cutlass.range(n_chunks, unroll=1):
                c0 = start + ci * self.chunk
                cnt = cutlass.min(self.chunk, end - c0)
                buf = ci % 2
                for st in cutlass.range(0, cnt, self.step, unroll=1):
                    # every load of the step before the first use; rows past the end redo the
                    # chunk's last row (and store nothing)
                    for j in cutlass.range_constexpr(RIF):
                        rl = cutlass.min(st + j * self.sub_rows + sub, cnt - 1)
                        b, sq = tab_bs[(0, rl, buf)], tab_bs[(1, rl, buf)]
                        for i in cutlass.range_constexpr(VPT):
                            buf_d[(None, j * VPT + i)].store(srcs[i][(None, b, sq)].load())
                            buf_z[(None, j * VPT + i)].store(zsrcs[i][(None, c0 + rl)].load())
                    for j in cutlass.range_constexpr(RIF):
                        self._row(j, st + j * self.sub_rows + sub, cnt, c0, buf, ctx,
                                  [buf_d[(None, j * VPT + i)].load() for i in range(VPT)],
                                  [buf_z[(None, j * VPT + i)].load() for i in range(VPT)])
                self._next_chunk(ci, n_chunks, c0, cnt, buf, start, end, seq, tidx, rstd,
                                 positions, inv_freq, tab_cs, tab_bs, tab_r, red, s_out)

        if const_expr(self.qk_norm):
            # the heads' dw sums: in the stages' memory once no copy or read of it is left
            # (every real copy was waited for at its step; empty groups aside), or their own
            if const_expr(self.staged):
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                hsum = cute.make_tensor(cute.recast_ptr(st_v.iterator, dtype=Float32),
                                        cute.make_layout((self.nv_qk * VEC,)))
            self._write_dw(dw_partials, dw_acc, xs, hsum, p, sub, t, tidx, vs, is_qk)
            self._finish_dw(dw_partials, counter, dq_w, dk_w, hsum, arrived, tidx)

    # -- pieces ----------------------------------------------------------------------------------
    @cute.jit
    def _row(self, j, rl, cnt, c0, buf, ctx, ds, zs):
        """Row rl of the chunk (its vectors ds / zs, bf16): g and the row's s share (row j of the
        step), reduced over the warp into the shared-memory step. rl >= cnt: past the end, with
        the chunk's last row's table entries and whatever ds / zs hold (the unstaged path's
        clamped loads: that row again; staged: stale or never-written shared memory, NaN or Inf
        possibly); nothing of it may reach memory or a live row. So its values leave only
        through ``select_`` or under ``if ok`` (never a product with a 0 / 1 mask: NaN * 0 is
        NaN), and every shuffle stays within one row (C is a multiple of 32: a warp holds one
        row, live or not)."""
        (vs, quart, valid, is_qk, wts, dw_acc, qk_eps, out, s_acc, tab_cs, tab_r, red, g, sub,
         wrow, tidx) = ctx
        live = rl < cnt
        rlc = cutlass.min(rl, cnt - 1)
        m = c0 + rlc
        s_acc[j] = Float32(0.0)
        for i in cutlass.range_constexpr(self.vpt):
            cs = (tab_cs[(None, quart[i], 0, rlc, buf)].load(),
                  tab_cs[(None, quart[i], 1, rlc, buf)].load())
            vg = cute.local_tile(g[(m, None)], (VEC,), (vs[i],))
            ok = live
            if const_expr(self.ragged):
                ok = live & valid[i]
            if const_expr(self.qk_norm):
                self._vec_qk_norm(j, i, ds[i], zs[i], ok, tab_r[(rlc, buf)], cs, qk_eps, wts,
                                  dw_acc, out, s_acc, vg, is_qk[i])
            else:
                self._vec_plain(j, ds[i], zs[i], ok, cs, out, s_acc, vg)
        # the row's sum over this warp, then over the row's warps in shared memory; with QK-norm
        # every lane already holds its head's share, so only one lane per head is summed over
        tot = s_acc[j]
        for off in (16, 8, 4, 2, 1):
            if const_expr(not self.qk_norm or off >= self.lph):
                tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=off)
        if tidx % 32 == 0:
            red[(wrow, rl, buf)] = tot

    @cute.jit
    def _next_chunk(self, ci, n_chunks, c0, cnt, buf, start, end, seq, tidx, rstd, positions,
                    inv_freq, tab_cs, tab_bs, tab_r, red, s_out):
        """The next chunk's table, then one barrier: it publishes that table and this chunk's
        warp sums (the buffers written next were last read before the previous barrier); then
        one thread per row adds the row's warp sums in order and writes s."""
        if ci + 1 < n_chunks:
            self._fill_table(start, end, ci + 1, seq, tidx, rstd, positions, inv_freq, tab_cs,
                             tab_bs, tab_r)
        cute.arch.sync_threads()
        if tidx < cnt:
            tot = red[(0, tidx, buf)]
            for w in cutlass.range_constexpr(1, self.warps_per_row):
                tot = tot + red[(w, tidx, buf)]
            s_out[c0 + tidx] = tot

    @cute.jit
    def _cursor(self, m, seq, flat):
        """(flat, cur, addrs): the staged loads' cursor at row m: ``cur`` the next row this
        thread loads and its s, ``addrs`` per slot the addresses of that row's vectors (gradient,
        z); set once by a division here, then moved on a row at a time (:meth:`_next_row`)."""
        cur = cute.make_rmem_tensor((2,), Int32)
        addrs = cute.make_rmem_tensor((2, self.vpt), Int64)
        b, sq = self._divmod(m, seq, 1.0 / cutlass.Float64(seq))
        cur[0] = m
        cur[1] = sq
        for i in cutlass.range_constexpr(self.vpt):
            daddr, dsb, dss2, _, zaddr, zstride2 = flat[i]
            addrs[(0, i)] = daddr + Int64(b) * dsb * 2 + Int64(sq) * dss2
            addrs[(1, i)] = zaddr + Int64(m) * zstride2
        return flat, cur, addrs

    @cute.jit
    def _issue(self, stage, end, seq, tidx, src, st_v, cp_vec):
        """cp.async this thread's vectors of its next step into ``stage``: its ``rif``
        consecutive rows m0 + j (m0 = start + k * step + sub * rif for step k), issued back to
        back; rows past the end are not loaded (their stage slots keep whatever they held, which
        the step computes on and never stores). The cursor then moves on to the thread's first row
        of the step after: a row at a time, by additions and selects (no division, no 64-bit
        product, no branch)."""
        flat, cur, addrs = src
        for j in cutlass.range_constexpr(self.rif):
            live = cur[0] < end
            for i in cutlass.range_constexpr(self.vpt):
                for w in cutlass.range_constexpr(2):
                    ptr = cute.make_ptr(BFloat16, addrs[(w, i)], cute.AddressSpace.gmem,
                                        assumed_align=16)
                    if live:
                        cute.copy(cp_vec, cute.make_tensor(ptr, cute.make_layout((VEC,))),
                                  st_v[(None, tidx, w, i, j, stage)])
            self._next_row(seq, flat, cur, addrs)
        for _ in cutlass.range_constexpr((self.sub_rows - 1) * self.rif):  # the other sub-rows'
            self._next_row(seq, flat, cur, addrs)

    @cute.jit
    def _next_row(self, seq, flat, cur, addrs):
        """The cursor one row on: s + 1, or (b + 1, 0) past the sequence's last row."""
        sq = cur[1] + 1
        wrap = sq == seq
        cur[0] = cur[0] + 1
        cur[1] = Int32(cutlass.select_(wrap, 0, sq))
        for i in cutlass.range_constexpr(self.vpt):
            _, _, dss2, dwrap2, _, zstride2 = flat[i]
            addrs[(0, i)] = addrs[(0, i)] + Int64(cutlass.select_(wrap, dwrap2, dss2))
            addrs[(1, i)] = addrs[(1, i)] + zstride2

    @cute.jit
    def _divmod(self, m, seq, inv_seq):
        """(m // seq, m % seq) for 0 <= m < 2^31: an fp64 estimate (off by at most one), then
        one correction either way; cheaper than the integer division."""
        b = Int32(cutlass.Float64(m) * inv_seq)
        sq = m - b * seq
        if sq < 0:
            b = b - 1
            sq = sq + seq
        if sq >= seq:
            b = b + 1
            sq = sq - seq
        return b, sq

    @staticmethod
    def _pick(q, kk, x):
        """x[0] for a Q slot, x[1] for a K slot, x[2] for a V slot (as Int64)."""
        return Int64(cutlass.select_(q, x[0], cutlass.select_(kk, x[1], x[2])))

    @cute.jit
    def _fill_table(self, start, end, ci, seq, tidx, rstd, positions, inv_freq, tab_cs, tab_bs,
                    tab_r):
        """Chunk ci's table, by the whole CTA: per row (rows past the end: the last row) its
        (b, s) = divmod(m, S) (unstaged only), r, and per pair quartet the (cos, sin) of theta = float(pos) *
        inv_freq[k] (fast_cos / fast_sin, as the forward epilogue), times r for the plain
        variant; the extra quartet, the V columns' identity rotation, is (r, 0) plain, (1, 0)
        with QK-norm."""
        c0 = start + ci * self.chunk
        last = cutlass.min(self.chunk, end - c0) - 1
        buf = ci % 2
        for e in cutlass.range(tidx, self.chunk * self.nq, self.threads, unroll=1):
            rl = e // self.nq
            qd = e - rl * self.nq
            m = c0 + cutlass.min(rl, last)
            posf = Float32(positions[m])
            scale = Float32(1.0) if const_expr(self.qk_norm) else rstd[m]
            freq = cute.local_tile(inv_freq, (VEC // 2,), (cutlass.min(qd, self.lph - 1),)).load()
            vc = cute.make_rmem_tensor((4,), Float32)
            vsn = cute.make_rmem_tensor((4,), Float32)
            for k in cutlass.range_constexpr(4):
                theta = posf * freq[k]
                vc[k] = scale * fast_cos(theta)
                vsn[k] = scale * fast_sin(theta)
            if qd == self.lph:  # the V slots' identity rotation
                vc.fill(scale)
                vsn.fill(0.0)
            tab_cs[(None, qd, 0, rl, buf)].store(vc.load())
            tab_cs[(None, qd, 1, rl, buf)].store(vsn.load())
        if tidx < self.chunk:
            m = c0 + cutlass.min(tidx, last)
            if const_expr(not self.staged):
                b = m // seq
                tab_bs[(0, tidx, buf)] = b
                tab_bs[(1, tidx, buf)] = m - b * seq
            tab_r[(tidx, buf)] = rstd[m]

    @cute.jit
    def _vec_plain(self, j, dv, zv, ok, cs, out, s_acc, vg):
        """g = bf16(r dz) for one vector (dv: the gradient, zv: qkv) of row j of the step;
        s_acc[j] += sum qkv dqkv. The table's quartet holds r cos, r sin (the (r, 0) one for a
        V slot)."""
        d = dv.to(Float32)
        z = zv.to(Float32)
        dots = Float32(0.0)
        for e in cutlass.range_constexpr(VEC):
            dots = cute.math.fma(z[e], d[e], dots)
        s_acc[j] = s_acc[j] + Float32(cutlass.select_(ok, dots, Float32(0.0)))
        for q in cutlass.range_constexpr(VEC // 2):
            c, sn = cs[0][q], cs[1][q]
            a, bb = d[2 * q], d[2 * q + 1]
            out[2 * q] = cute.math.fma(a, c, bb * sn)
            out[2 * q + 1] = cute.math.fma(bb, c, -(a * sn))
        if ok:
            vg.store(out.load().to(BFloat16))

    @cute.jit
    def _vec_qk_norm(self, j, i, dv, zv, ok, r, cs, qk_eps, wts, dw_acc, out, s_acc, vg, qk):
        """The QK-norm variant of :meth:`_vec_plain` (slot i; zv: x_pre, or qkv on V), plus
        the dw accumulation. A V slot's rotation is the identity and its weights 1, so its gw is
        dv and the head sum of x gw is the head's share of s (sum qkv dv) in every lane of it;
        a Q/K slot's share, qk_eps rs^3 sum(x gw), is too."""
        inv_d = 1.0 / self.head_dim
        half = cute.make_rmem_tensor((VEC // 2,), Float32)
        d = dv.to(Float32)
        x = zv.to(Float32)
        dqn = []
        for q in cutlass.range_constexpr(VEC // 2):
            c, sn = cs[0][q], cs[1][q]
            a, bb = d[2 * q], d[2 * q + 1]
            dqn.append(cute.math.fma(a, c, bb * sn))
            dqn.append(cute.math.fma(bb, c, -(a * sn)))
        w = wts[i]
        gw = [dqn[e] * w[e] for e in range(VEC)]
        sxx, sxg = Float32(0.0), Float32(0.0)
        for e in cutlass.range_constexpr(VEC):
            sxx = cute.math.fma(x[e], x[e], sxx)
            sxg = cute.math.fma(x[e], gw[e], sxg)
        # head sums over the head's LPH consecutive lanes (every lane, V slots included): every
        # lane of the head ends with them
        off = self.lph // 2
        while off > 0:
            sxx = sxx + cute.arch.shuffle_sync_bfly(sxx, offset=off)
            sxg = sxg + cute.arch.shuffle_sync_bfly(sxg, offset=off)
            off //= 2
        if qk:
            rs = cute.math.rsqrt(sxx * inv_d + qk_eps, fastmath=True)
            rs3 = rs * rs * rs
            # dz = rs gw - xh mean(gw xh) = rs gw - x (rs^3 sum(x gw) / D); r folded in
            rrs, rcoef = r * rs, r * (rs3 * sxg * inv_d)
            for e in cutlass.range_constexpr(VEC):
                out[e] = cute.math.fma(rrs, gw[e], -(x[e] * rcoef))
            # the head's sum x dz = qk_eps rs^3 sum(x gw)
            s_acc[j] = s_acc[j] + Float32(cutlass.select_(ok, qk_eps * rs3 * sxg, Float32(0.0)))
            if ok:
                vg.store(out.load().to(BFloat16))
                for hf in cutlass.range_constexpr(2):  # dw += dqn xh, a 16-byte half at a time
                    acc = dw_acc[(None, hf, i)]
                    cur = acc.load()
                    for e in cutlass.range_constexpr(VEC // 2):
                        f = hf * (VEC // 2) + e
                        half[e] = cute.math.fma(dqn[f], x[f] * rs, cur[e])
                    acc.store(half.load())
        else:
            for e in cutlass.range_constexpr(VEC):
                out[e] = r * d[e]
            s_acc[j] = s_acc[j] + Float32(cutlass.select_(ok, sxg, Float32(0.0)))
            if ok:
                vg.store(out.load().to(BFloat16))

    @cute.jit
    def _write_dw(self, dw_partials, dw_acc, xs, hsum, p, sub, t, tidx, vs, is_qk):
        """Row p of dw_partials (2, D): the CTA's sums over its rows and over the Q heads (0) or
        the K heads (1). The side-by-side rows' accumulators are added in shared memory (in
        order), each Q/K column's sum goes to ``hsum``, then one thread per (Q | K, e) adds the
        heads' in head order (zeros from a CTA without rows)."""
        if const_expr(self.sub_rows > 1):
            if sub > 0:
                for i in cutlass.range_constexpr(self.vpt):
                    for hf in cutlass.range_constexpr(2):
                        xs[(None, t, hf, i, sub - 1)].store(dw_acc[(None, hf, i)].load())
            cute.arch.sync_threads()
            if sub == 0:
                for u in cutlass.range_constexpr(self.sub_rows - 1):
                    for i in cutlass.range_constexpr(self.vpt):
                        for hf in cutlass.range_constexpr(2):
                            acc = dw_acc[(None, hf, i)]
                            acc.store(acc.load() + xs[(None, t, hf, i, u)].load())
        if sub == 0:
            for i in cutlass.range_constexpr(self.vpt):
                if is_qk[i]:
                    col = cute.local_tile(hsum, (VEC,), (vs[i],))
                    for hf in cutlass.range_constexpr(2):
                        cute.local_tile(col, (VEC // 2,), (hf,)).store(dw_acc[(None, hf, i)].load())
        cute.arch.sync_threads()
        D, H, HKV = self.head_dim, self.n_heads, self.n_kv_heads
        for e in cutlass.range(tidx, 2 * D, self.threads, unroll=1):
            # (a loop, not unrolled: its loads all in flight at once would take the registers
            # the main loop needs)
            kv = e // D
            first = kv * H
            tot = Float32(0.0)
            for hh in cutlass.range(first, first + cutlass.select_(kv == 0, H, HKV), unroll=1):
                tot = tot + hsum[hh * D + e - kv * D]
            dw_partials[(p, kv, e - kv * D)] = tot

    @cute.jit
    def _finish_dw(self, dw_partials, counter, dq_w, dk_w, hsum, arrived, tidx):
        """The last CTA to finish writes dq_w / dk_w: each CTA's row p of dw_partials is written
        (by :meth:`_write_dw`) before one thread releases it at GPU scope and counts the CTA
        in; the CTA that counts P - 1 acquires every row, and G groups of its threads add the
        rows of CTAs [g * per, (g + 1) * per) in CTA order into ``hsum`` (its heads' sums are
        read: a barrier ago), then one thread per (Q | K, e) adds the groups in order and stores
        the weight's dtype. That CTA sets the counter back to 0."""
        D, G = self.head_dim, self.finish_groups
        nblk = dw_partials.shape[0]
        cute.arch.sync_threads()  # the CTA's row is written, its heads' sums read
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            arrived[0] = cute.arch.atomic_add(counter.iterator, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.sync_threads()
        if arrived[0] == nblk - 1:
            per = cute.ceil_div(nblk, G)
            for e in cutlass.range(tidx, G * 2 * D, self.threads, unroll=1):
                grp = e // (2 * D)
                col = e - grp * (2 * D)
                kv = col // D
                tot = Float32(0.0)
                # unrolled: the loads of 8 CTAs' rows are in flight together (one at a time,
                # ~44 L2 round trips at head_dim 64, cost ~5 us of tail on the H200)
                for q in cutlass.range(grp * per, cutlass.min(grp * per + per, nblk), unroll=8):
                    tot = tot + dw_partials[(q, kv, col - kv * D)]
                hsum[e] = tot
            cute.arch.sync_threads()
            wty = dq_w.element_type
            for e in cutlass.range(tidx, 2 * D, self.threads, unroll=1):
                tot = hsum[e]
                for grp in cutlass.range_constexpr(1, G):
                    tot = tot + hsum[grp * 2 * D + e]
                # one store through the selected weight's address (two stores under a branch
                # took ptxas down to 80 registers and a spill)
                kv = e // D
                addr = Int64(cutlass.select_(kv == 0, dq_w.iterator.toint(), dk_w.iterator.toint()))
                out = cute.make_tensor(cute.make_ptr(wty, addr, cute.AddressSpace.gmem,
                                                     assumed_align=wty.width // 8), cute.make_layout((D,)))
                out[e - kv * D] = wty(tot)
            if tidx == 0:
                counter[0] = Int32(0)
