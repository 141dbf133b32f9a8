"""The FP8 block-quantization arithmetic the quantize kernels share, exactly as
``coda_cute.reference.quantize_blocks_ref`` specifies it:

    s = max(amax / FP8_MAX, 2^-126), 1 where amax = 0, NaN where amax is inf or NaN;
    q = clamp(x * (1 / s))   (the clamp: the saturating cast's)

(``pow2``: s rounded up to the power of two at or above it, ``Fp8Recipe.pow2_scales``), with IEEE
division for s and 1 / s (once per block) and NaN-keeping min / max, so a NaN spreads
to its block and nothing is silently clipped. The floor (the smallest normal fp32) keeps 1 / s
finite for a block of tiny values (a gradient row of denormals): 1 / s overflowing would turn
its zeros into 0 * inf = NaN. It applies only to blocks whose values all lie below
FP8_MAX * 2^-126 (about 5e-36 for E4M3).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

#: the smallest scale, 2^-126 (the smallest normal fp32): 1 / s stays finite
MIN_SCALE = 2.0 ** -126
#: fp32's mantissa field, and its sign and exponent fields (0xFF800000 as a signed int32)
MANTISSA_BITS = 0x007FFFFF
EXPONENT_BITS = -0x00800000


@cute.jit
def abs_max(amax, v, n: cutlass.Constexpr):
    """max(amax, |v[0]|, ..., |v[n - 1]|), NaN if any is NaN."""
    for e in cutlass.range_constexpr(n):
        amax = cute.arch.fmax(amax, cute.math.abs(v[e]), nan=True)
    return amax


@cute.jit
def pow2_ceil(s):
    """The power of two at or above ``s`` (positive, normal or inf), exactly: the exponent field
    rounded up unless the mantissa is zero, on the bits (an inf stays inf)."""
    t = cute.make_rmem_tensor(cute.make_layout(1), Float32)
    t[0] = s
    up = (t.load().bitcast(Int32) + MANTISSA_BITS) & EXPONENT_BITS
    return up.bitcast(Float32)[0]


@cute.jit
def block_scale(amax, fmax, pow2: cutlass.Constexpr = False):
    """(s, 1 / s) of a block with absolute maximum ``amax`` (``pow2``: s rounded up to a power of
    two, so 1 / s is exact too)."""
    s = Float32(cutlass.select_(amax == Float32(0.0), Float32(1.0), cute.arch.fmax(amax / fmax, Float32(MIN_SCALE))))
    if cutlass.const_expr(pow2):
        s = pow2_ceil(s)
    s = s + (amax - amax)  # NaN exactly where amax is inf or NaN, + 0 otherwise
    return s, Float32(1.0) / s


@cute.jit
def fold_factor(amax, s):
    """What a row-wise gradient row's scale ``s`` contributes to the other operand of its weight
    gradient (``Fp8Recipe(scaling="row")``: dW = sum_m q[m, :]^T (s_m x[m, :])): ``s``, but 0 for
    a zero row (amax 0), whose scale 1 would let its x row set the folded columns' amaxes for
    nothing; NaN where ``s`` is."""
    return Float32(cutlass.select_(amax == Float32(0.0), Float32(0.0), s))


@cute.jit
def quantize(v, inv, n: cutlass.Constexpr):
    """v * inv in fp32 registers, for the caller's cast to FP8. The clamp to +-FP8_MAX is the
    cast's: the DSL converts with ``cvt.rn.satfinite`` (``test_fp8_cpu`` checks the PTX), which
    saturates finite values beyond the format's range to its largest one and keeps NaN, exactly
    the reference's clamp then cast (|v| <= amax makes |v * inv| at most FP8_MAX plus rounding).
    Two min / max per value fewer: the quantize kernels are instruction-bound."""
    out = cute.make_rmem_tensor(cute.make_layout(v.shape), Float32)
    for e in cutlass.range_constexpr(n):
        out[e] = v[e] * inv
    return out.load()
