"""Roofline cost of each op: the FLOPs it must do and the fewest bytes it must move.

Every op here is one GEMM ``C[m, n] = A[m, k] B[k, n]`` plus an epilogue, so its cost is

    flops = 2·m·n·k  (the GEMM)  +  epilogue FLOPs
    bytes = Σ over tensors of (elements × element size), each input read once, each output
            written once (intermediates that stay in registers or shared memory cost nothing)
    SoL   = max(flops / peak(dtype), bytes / bandwidth)

with ``peak(dtype)`` the dense tensor-core rate of the GEMM's input dtype. Epilogue FLOPs are
added at that rate too: they run on the CUDA cores concurrently with the tensor cores and are
well under 1 % of the GEMM's count at training shapes, so a separate CUDA-core term would never be
the larger one. Epilogue counting convention: each add, multiply, divide, compare (max), exp,
sin, cos or rsqrt is 1 FLOP; a sign flip is free.

Shapes follow ``coda-math.md`` (notation there): M token rows, d hidden, f ffn width, V vocab;
W is stored like nn.Linear (out × in), so a projection is ``a Wᵀ`` with GEMM (m, n, k) = (M, out,
in). ``dtype`` is the GEMM operands' dtype (bf16, fp16, fp8); activations the epilogue reads or
writes (residual stream, outputs) are ``act`` (default: bf16, fp16 for fp16 GEMMs). FP8 GEMMs
also read one fp32 scale per row of A and per column of B (``torch._scaled_mm`` row-wise).

The norm-scaled ops read the RMSNorm partials ``p`` (M × t fp32, t = ceil(d / tile_n) of the
GEMM that produced them) and turn them into ``r_m = (Σ_t p_mt / d + ε)^(-1/2)``: t − 1 adds, one
multiply by 1/d, one add, one rsqrt = t + 2 FLOPs per row. γ sits in the consumer's weight
(coda-math 2.1, option B) unless an op says otherwise.

The *shadow* of an op (:meth:`OpCost.shadow`) is the plain GEMM of the same m, n, k and dtype:
what the op costs with its epilogue taken away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "int64": 8}
GEMM_DTYPES = ("bf16", "fp16", "fp8")
SCALE_BYTES = 4  # fp32 dequantization scale (FP8 row-wise)
STATS_BYTES = 4  # fp32 norm / softmax partials
DEFAULT_TILE_N = 256  # N-width of the large-problem tile (128×256) dispatch picks


@dataclass(frozen=True)
class OpCost:
    """FLOPs and minimal memory traffic of one op on one problem.

    ``traffic`` maps each tensor the op touches to the bytes moved for it (read once or written
    once), so every byte of ``bytes`` can be checked by hand.
    """

    op: str
    m: int
    n: int
    k: int
    dtype: str
    gemm_flops: int
    epilogue_flops: int
    traffic: Mapping[str, int] = field(default_factory=dict)

    @property
    def flops(self) -> int:
        return self.gemm_flops + self.epilogue_flops

    @property
    def bytes(self) -> int:
        return sum(self.traffic.values())

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte."""
        return self.flops / self.bytes

    def compute_ms(self, ceilings) -> float:
        return self.flops / ceilings.peak_flops(self.dtype) * 1e3

    def memory_ms(self, ceilings) -> float:
        return self.bytes / ceilings.bandwidth * 1e3

    def sol_ms(self, ceilings) -> float:
        """Speed-of-light time: max(flops / peak(dtype), bytes / bandwidth), in ms.

        ``ceilings`` is any object with ``peak_flops(dtype)`` (FLOP/s) and ``bandwidth``
        (bytes/s), e.g. :class:`coda_cute.sol.devices.Ceilings`.
        """
        return max(self.compute_ms(ceilings), self.memory_ms(ceilings))

    def bound(self, ceilings) -> str:
        return "compute" if self.compute_ms(ceilings) >= self.memory_ms(ceilings) else "memory"

    def shadow(self) -> "OpCost":
        """The plain GEMM of the same (m, n, k) and dtype: the op without its epilogue."""
        return gemm(self.m, self.n, self.k, self.dtype)

    @property
    def has_epilogue(self) -> bool:
        """Whether the op does more than its plain GEMM (arithmetic or traffic of its own)."""
        return bool(self.epilogue_flops) or dict(self.traffic) != dict(self.shadow().traffic)

    def unfused_bytes(self) -> int:
        """Bytes of the same math unfused: the plain GEMM writes its output, then one
        memory-bound pass reads it back with the epilogue's other inputs and writes the
        epilogue's outputs (the fewest bytes any unfused implementation moves)."""
        sh = self.shadow()
        return sh.bytes + self._epilogue_pass_bytes(sh)

    def unfused_sol_ms(self, ceilings) -> float:
        """Speed of light of :meth:`unfused_bytes`' two kernels, one after the other: the
        GEMM's, plus the pass at full bandwidth."""
        sh = self.shadow()
        return sh.sol_ms(ceilings) + self._epilogue_pass_bytes(sh) / ceilings.bandwidth * 1e3

    def _epilogue_pass_bytes(self, sh: "OpCost") -> int:
        operands = sh.bytes - sh.traffic["out"]
        return sh.traffic["out"] + self.bytes - operands


def _check_dtype(dtype: str) -> None:
    if dtype not in GEMM_DTYPES:
        raise ValueError(f"GEMM dtype must be one of {GEMM_DTYPES}, got {dtype!r}")


def _act(dtype: str, act: Optional[str]) -> str:
    return act or ("fp16" if dtype == "fp16" else "bf16")


def _operands(m: int, n: int, k: int, dtype: str, a: str = "a", b: str = "b") -> dict[str, int]:
    """Bytes of the two GEMM operands, plus the FP8 row/column scales."""
    e = DTYPE_BYTES[dtype]
    t = {a: m * k * e, b: n * k * e}
    if dtype == "fp8":
        t[f"scale_{a}"] = m * SCALE_BYTES
        t[f"scale_{b}"] = n * SCALE_BYTES
    return t


def _tiles(extent: int, tile_n: int) -> int:
    return -(-extent // tile_n)


def _rscale_flops(m: int, stats_tiles: int) -> int:
    """r_m from the t partials of one row: t − 1 adds, ×1/d, +ε, rsqrt."""
    return m * (stats_tiles + 2)


# -- plain GEMM -------------------------------------------------------------------------------------
def gemm(m: int, n: int, k: int, dtype: str = "bf16", out_dtype: Optional[str] = None,
         op: str = "gemm") -> OpCost:
    """Plain GEMM ``out[m, n] = A[m, k] B[k, n]`` (FP8: times the row/column scales).

    FLOPs: 2·m·n·k (no epilogue arithmetic counted; the FP8 scale multiply is part of the GEMM).
    Bytes: A m·k and B k·n in ``dtype``, out m·n in ``out_dtype`` (default: the input dtype for
    16-bit, bf16 for FP8); FP8 adds 4·m + 4·n for the fp32 scales.
    """
    _check_dtype(dtype)
    out_dtype = out_dtype or _act(dtype, None)
    traffic = _operands(m, n, k, dtype)
    traffic["out"] = m * n * DTYPE_BYTES[out_dtype]
    return OpCost(op, m, n, k, dtype, 2 * m * n * k, 0, traffic)


def gemm_blockwise(m: int, n: int, k: int, b_block: str = "128x128", op: str = "gemm_blockwise") -> OpCost:
    """Block-scaled FP8 GEMM (``coda.gemm_blockwise``): e4m3 A (m, k) with one fp32 scale per row
    and 128-deep k-block, B (n, k) with one per 128 x 128 block (``b_block="1x128"``, the
    weight-gradient form: per row and k-block too), bf16 out.

    FLOPs: 2·m·n·k (the per-k-block promotion is part of the GEMM). Bytes: A m·k and B n·k (1 B
    each), out m·n bf16, scales 4·m·⌈k/128⌉ and 4·⌈n/128⌉·⌈k/128⌉ (``1x128``: 4·n·⌈k/128⌉).
    """
    kb = -(-k // 128)
    rows_b = n if b_block == "1x128" else -(-n // 128)
    traffic = {"a": m * k, "b": n * k, "out": m * n * DTYPE_BYTES["bf16"],
               "scale_a": m * kb * SCALE_BYTES, "scale_b": rows_b * kb * SCALE_BYTES}
    return OpCost(op, m, n, k, "fp8", 2 * m * n * k, 0, traffic)


# -- CODA forward ops (coda-math.md section 2) ----------------------------------------------------------
def residual_norm_stats(m: int, d: int, k: int, dtype: str = "bf16", act: Optional[str] = None,
                        tile_n: int = DEFAULT_TILE_N, store_scaled: bool = False) -> OpCost:
    """Out-proj / down-proj with the residual add and the next RMSNorm's partials in the epilogue.

        h = a Wᵀ (GEMM m=M, n=d, k);  y = h + x;  p[m, t] = Σ_{n ∈ tile t} y_mn²

    FLOPs: 2·M·d·k + M·d (residual add) + 2·M·d (square, accumulate)
           [+ M·d for y⊙γ with ``store_scaled``].
    Bytes: a (M·k) and W (d·k) in ``dtype`` (+ FP8 scales); x read and y written, M·d each in
    ``act``; p written, M·ceil(d / tile_n) fp32. ``store_scaled`` (coda-math 2.1, option A)
    also reads γ (d) and writes y⊙γ (M·d), both in ``act``.
    """
    _check_dtype(dtype)
    act = _act(dtype, act)
    e = DTYPE_BYTES[act]
    traffic = _operands(m, d, k, dtype, "a", "w")
    traffic.update(x=m * d * e, y=m * d * e, p=m * _tiles(d, tile_n) * STATS_BYTES)
    epi = 3 * m * d
    if store_scaled:
        traffic.update(gamma=d * e, y_gamma=m * d * e)
        epi += m * d
    return OpCost("residual_norm_stats", m, d, k, dtype, 2 * m * d * k, epi, traffic)


def scaled_swiglu(m: int, f: int, d: int, dtype: str = "bf16", act: Optional[str] = None,
                  tile_n: int = DEFAULT_TILE_N, save_preact: bool = True) -> OpCost:
    """Gate/up projection with the RMSNorm scale and SwiGLU in the epilogue.

        z = y W_guᵀ (GEMM m=M, n=2f, k=d; gate/up columns interleaved);  z ← r·z;
        out_j = silu(z_2j) · z_2j+1

    FLOPs: 2·M·2f·d + M·(t + 2) (r from t = ceil(d / tile_n) partials) + 2·M·f (r-scale)
           + 4·M·f (silu(g) = g / (1 + exp(−g)): exp, add, divide; then × u).
    Bytes: y (M·d) and W_gu (2f·d) in ``dtype`` (+ FP8 scales); p read, M·t fp32; out written,
    M·f in ``act``; with ``save_preact`` also z (M·2f, ``act``), which the backward needs.
    """
    _check_dtype(dtype)
    act = _act(dtype, act)
    e = DTYPE_BYTES[act]
    t = _tiles(d, tile_n)
    traffic = _operands(m, 2 * f, d, dtype, "y", "w")
    traffic["p"] = m * t * STATS_BYTES
    if save_preact:
        traffic["z"] = m * 2 * f * e
    traffic["out"] = m * f * e
    epi = _rscale_flops(m, t) + 2 * m * f + 4 * m * f
    return OpCost("scaled_swiglu", m, 2 * f, d, dtype, 2 * m * 2 * f * d, epi, traffic)


def scaled_rope(m: int, d: int, n_heads: int, n_kv_heads: int, head_dim: int, dtype: str = "bf16",
                act: Optional[str] = None, tile_n: int = DEFAULT_TILE_N, qk_norm: bool = False,
                save_prerot: bool = False) -> OpCost:
    """QKV projection with the RMSNorm scale, optional QK-norm and RoPE in the epilogue.

        qkv = y W_qkvᵀ (GEMM m=M, n=(H + 2·Hkv)·hd, k=d);  qkv ← r·qkv;
        q, k: rotate adjacent pairs by θ = pos · base^(−2i/hd); v untouched

    With Q = (H + Hkv)·hd rotated columns per row and N = (H + 2·Hkv)·hd:
    FLOPs: 2·M·N·d + M·(t + 2) (r) + M·N (r-scale) + M·(hd/2)·3 (θ = pos·inv_freq, sin, cos:
           once per row and pair index, shared by the heads) + 3·M·Q (per pair 4 mul + 2 add).
           ``qk_norm`` adds 4·M·Q (square, accumulate, × rstd, × weight) and 3·M·(H + Hkv) (per
           row and head: × 1/hd, +ε, rsqrt).
    Bytes: y (M·d) and W_qkv (N·d) in ``dtype`` (+ FP8 scales); p read, M·t fp32; positions
    read, M int32; q, k, v written, M·N in ``act``. ``qk_norm`` reads the q and k norm weights
    (2·hd, ``act``); ``save_prerot`` also writes pre-rotation q, k (M·Q, ``act``).
    """
    _check_dtype(dtype)
    act = _act(dtype, act)
    e = DTYPE_BYTES[act]
    n = (n_heads + 2 * n_kv_heads) * head_dim
    rotated = (n_heads + n_kv_heads) * head_dim
    t = _tiles(d, tile_n)
    traffic = _operands(m, n, d, dtype, "y", "w")
    traffic.update(p=m * t * STATS_BYTES, positions=m * DTYPE_BYTES["int32"])
    epi = _rscale_flops(m, t) + m * n + m * (head_dim // 2) * 3 + 3 * m * rotated
    name = "scaled_rope"
    if qk_norm:
        traffic["qk_norm_weight"] = 2 * head_dim * e
        epi += 4 * m * rotated + 3 * m * (n_heads + n_kv_heads)
        name = "scaled_rope_qknorm"
    traffic["qkv"] = m * n * e
    if save_prerot:
        traffic["qk_prerot"] = m * rotated * e
    return OpCost(name, m, n, d, dtype, 2 * m * n * d, epi, traffic)


def scaled_proj(m: int, n: int, k: int, dtype: str = "bf16", act: Optional[str] = None,
                tile_n: int = DEFAULT_TILE_N) -> OpCost:
    """A projection of a normalized input with only the RMSNorm scale in the epilogue.

        out = r · (y Wᵀ)   (GEMM m=M, n, k = d)

    FLOPs: 2·M·n·k + M·(t + 2) (r from t = ceil(k / tile_n) partials) + M·n (r-scale).
    Bytes: y (M·k) and W (n·k) in ``dtype`` (+ FP8 scales); p read, M·t fp32; out written, M·n
    in ``act``.
    """
    _check_dtype(dtype)
    act = _act(dtype, act)
    t = _tiles(k, tile_n)
    traffic = _operands(m, n, k, dtype, "y", "w")
    traffic.update(p=m * t * STATS_BYTES, out=m * n * DTYPE_BYTES[act])
    epi = _rscale_flops(m, t) + m * n
    return OpCost("scaled_proj", m, n, k, dtype, 2 * m * n * k, epi, traffic)


def lm_head_ce(m: int, vocab: int, d: int, dtype: str = "bf16", tile_n: int = DEFAULT_TILE_N) -> OpCost:
    """LM head with the final RMSNorm scale and cross-entropy partials; logits never stored.

        logits = y W_lmᵀ (GEMM m=M, n=V, k=d);  logits ← r·logits;  per (row, N-tile):
        running max m_t and s_t = Σ exp(logit − m_t); the tile holding target_m writes its logit

    FLOPs: 2·M·V·d + M·(t + 2) (r from t = ceil(d / tile_n) partials) + M·V (r-scale)
           + 4·M·V (per logit: max, subtract, exp, add).
    Bytes: y (M·d) and W_lm (V·d) in ``dtype`` (+ FP8 scales); p read, M·t fp32; targets read,
    M int64 (as torch's cross-entropy takes them); (m_t, s_t) written, 2·M·ceil(V / tile_n)
    fp32; target logits written, M fp32. The tiny CE-finalize kernel is not part of this op.
    """
    _check_dtype(dtype)
    t = _tiles(d, tile_n)
    traffic = _operands(m, vocab, d, dtype, "y", "w")
    traffic.update(
        p=m * t * STATS_BYTES,
        targets=m * DTYPE_BYTES["int64"],
        softmax_partials=2 * m * _tiles(vocab, tile_n) * STATS_BYTES,
        target_logit=m * STATS_BYTES,
    )
    epi = _rscale_flops(m, t) + m * vocab + 4 * m * vocab
    return OpCost("lm_head_ce", m, vocab, d, dtype, 2 * m * vocab * d, epi, traffic)
