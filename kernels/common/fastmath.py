"""Fast fp32 math shared by the epilogue code generator and the element-wise kernels.

Transcendentals use the hardware approximations (ex2 / rcp / sin / cos ``.approx``, ~1e-6
relative), well inside the bf16 rounding of every output they feed. Sin and cos first reduce the
angle into [-pi, pi], where the approximations are accurate to ~1e-6 absolute.
"""

from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32

LOG2E = 1.0 / math.log(2.0)

# 2 pi = _TWO_PI_HI + _TWO_PI_LO, _TWO_PI_HI with 8 significant bits: n * _TWO_PI_HI is exact in
# fp32 for |n| < 2^16, i.e. angles up to ~4e5.
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 2.0 * math.pi - 6.28125


def fast_exp(x):
    """exp(x) as ex2.approx(x * log2 e)."""
    return cute.math.exp2(x * LOG2E, fastmath=True)


def fast_sigmoid(x):
    return cute.arch.rcp_approx(1.0 + fast_exp(-x))


def reduce_angle(x):
    """x - 2 pi n in [-pi, pi] (Cody-Waite), where the hardware sin/cos approximations are
    accurate to ~1e-6 absolute; outside that range their error grows with |x|."""
    n = cute.math.roundeven(x * (0.5 / math.pi))
    return cute.math.fma(-n, Float32(_TWO_PI_LO), cute.math.fma(-n, Float32(_TWO_PI_HI), x))


def fast_sin(x):
    return cute.math.sin(reduce_angle(x), fastmath=True)


def fast_cos(x):
    return cute.math.cos(reduce_angle(x), fastmath=True)


def fast_max(a, b):
    """max(a, b) of fp32 values in one FMNMX.NaN. NaN propagates, as in ``cutlass.max``
    (``arith.maximumf``), whose lowering also orders -0 below +0 with compares and selects around
    each max (the row-wise FP8 SwiGLU backward with four amax reductions: 8160 SASS instructions
    with it, 6408 with this); here a max of zeros of opposite signs may return either (they
    compare equal)."""
    return cute.arch.fmax(Float32(a), Float32(b), nan=True)


def fast_min(a, b):
    """min(a, b) of fp32 values in one FMNMX.NaN (as :func:`fast_max`)."""
    return cute.arch.fmin(Float32(a), Float32(b), nan=True)
