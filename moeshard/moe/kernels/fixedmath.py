"""exp and tanh in float64 from a fixed sequence of IEEE operations: the same bits on every CPU.

The expert FFN's gated unit (`moeshard.moe.kernels.entry._glu_mul`: silu, or Kimi K3's SiTU) needs
exp and tanh.  libm's are not a contract: glibc picks its exp by CPU at run time (FMA and non-FMA
variants, not correctly rounded), other C libraries and versions differ, and numba may
vectorise calls to them with Intel's SVML where that is installed.  A coordinator recomputes a
node's expert output and requires equal bits, so an honest node on another CPU must not
differ in a last bit.  These functions use only ``+ - * /``, comparisons, exact conversions
between integers and floats, exact sign changes and powers of two built from their bits, in
one fixed order, with no fast-math flag (so no FMA contraction, no reassociation): IEEE 754
defines the result of each step, so the result is the same on any x86-64 level (native AVX-512,
SSE2-only and `generic` builds are compared in tests/test_kernel_isa.py) and in numpy.
``error_model="numpy"`` spares numba's test for a zero divisor (no divisor here can be zero),
which let LLVM vectorise the gated unit's loop: the same bits, 2-6.5x faster than libm.

exp(x) is fdlibm's (FreeBSD's e_exp.c, error below 1 ulp): ``k = round(x / ln2)``, ``hi = x -
k ln2_hi`` (exact: ln2_hi has 32 significant bits), ``lo = k ln2_lo``, ``r = hi - lo``
(|r| <= ln2 / 2 or a hair more), ``c = r - r^2 P(r^2)`` (P fdlibm's degree-4 minimax
polynomial), ``exp(r) - 1 = hi - (lo - r c / (2 - c))``, then ``(1 + that) 2^k`` as two exact
powers of two, so that an overflow or an underflow into subnormals rounds once.  k is rounded
with ``(x log2e + 1.5 * 2^52) - 1.5 * 2^52`` (half to even); x is first clamped to
[-746, 710], beyond which exp is 0 or inf all the same.

tanh(y) = -t / (t + 2) with ``t = expm1(-2|y|)`` (in (-1, 0]: no cancellation, so tiny |y|
keep their relative accuracy) computed from the same reduction, ``2^k (exp(r) - 1) + (2^k - 1)``;
|y| is clamped to 20 (tanh(20) = 1 - 8.5e-18 rounds to 1), and the sign is y's (so
tanh(-0) = -0).  nan gives nan (the argument itself), exp(inf) = inf, exp(-inf) = 0,
tanh(+-inf) = +-1.

Accuracy (tests/test_fixedmath.py, docs/kernels.md): within EXP_ULPS and TANH_ULPS (below) of
numpy's exp and tanh over millions of values; measured at most 0.89 and 2.5 ulps from the
exact values.

`exp`/`tanh` are the numba functions (scalars, inlined into the kernels); `exp_array`/
`tanh_array` are their numpy twins, the same operations on float64 arrays in the same order,
hence the same bits (tested).  Editing either means editing both, and `build.ARITHMETIC`
(numba's cache then starts afresh by itself: `numba_cache`).
"""

import numpy as np
from numba import njit

LOG2E = 1.4426950408889634  # 1 / ln 2, rounded
LN2_HI = 6.93147180369123816490e-01  # 0x3fe62e42fee00000: ln 2 to 32 bits, k * LN2_HI exact
LN2_LO = 1.90821492927058770002e-10  # 0x3dea39ef35793c76: ln 2 - LN2_HI, rounded
SHIFT = 6755399441055744.0  # 1.5 * 2^52: (v + SHIFT) - SHIFT is v rounded to an integer
# fdlibm's minimax fit r (e^r + 1) / (e^r - 1) ~ 2 + P1 r^2 + P2 r^4 + ... + P5 r^10, |r| <= ln2 / 2
P1 = 1.66666666666666019037e-01
P2 = -2.77777777770155933842e-03
P3 = 6.61375632143793436117e-05
P4 = -1.65339022054652515390e-06
P5 = 4.13813679705723846039e-08
EXP_LO, EXP_HI = -746.0, 710.0  # exp is 0 below, inf above (and the clamp keeps k in range)
TANH_HI = 20.0  # tanh(y) rounds to 1 from here on
# measured bounds (tests/test_fixedmath.py): distance from numpy's float64 result, in ulps
EXP_ULPS = 1
TANH_ULPS = 3


@njit(cache=True, nogil=True, error_model="numpy")
def _pow2(k):
    """2^k for an integer -1022 <= k <= 1023, from its bits."""
    return np.int64((k + 1023) << 52).view(np.float64)


@njit(cache=True, nogil=True, error_model="numpy")
def _reduce(x):
    """x finite in [EXP_LO, EXP_HI] -> (k, m) with exp(x) = 2^k (1 + m)."""
    kf = (x * LOG2E + SHIFT) - SHIFT
    hi = x - kf * LN2_HI
    lo = kf * LN2_LO
    r = hi - lo
    t = r * r
    c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))))
    return np.int64(kf), hi - (lo - r * c / (2.0 - c))


@njit(cache=True, nogil=True, error_model="numpy")
def exp(x):
    """e^x of a float64, the same bits on every CPU (the module's docstring)."""
    if x != x:
        return x
    if x < EXP_LO:
        x = EXP_LO
    elif x > EXP_HI:
        x = EXP_HI
    k, m = _reduce(x)
    k1 = k >> 1  # two factors, each a normal number, for k from -1076 to 1024
    return (1.0 + m) * _pow2(k1) * _pow2(k - k1)


@njit(cache=True, nogil=True, error_model="numpy")
def tanh(y):
    """tanh of a float64, the same bits on every CPU (the module's docstring)."""
    if y != y:
        return y
    a = min(abs(y), TANH_HI)
    k, m = _reduce(-2.0 * a)  # k in -58..0
    s = _pow2(k)
    t = s * m + (s - 1.0)  # expm1(-2a)
    return np.copysign(-t / (t + 2.0), y)


# ---------------------------------------------------------------------------------------------
# numpy twins: the same operations on float64 arrays, in the same order


def _pow2_array(k: np.ndarray) -> np.ndarray:
    return ((k + 1023) << 52).view(np.float64)


def _reduce_array(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    kf = (x * LOG2E + SHIFT) - SHIFT  # [n]
    hi = x - kf * LN2_HI  # [n]
    lo = kf * LN2_LO  # [n]
    r = hi - lo  # [n]
    t = r * r  # [n]
    c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))))  # [n]
    return kf.astype(np.int64), hi - (lo - r * c / (2.0 - c))


def exp_array(x: np.ndarray) -> np.ndarray:
    """`exp` elementwise (the same bits): float64 array -> float64 array of its shape."""
    x = np.asarray(x, dtype=np.float64)
    nan = x != x
    clamped = np.where(nan, 0.0, np.minimum(np.maximum(x, EXP_LO), EXP_HI))  # [...]
    k, m = _reduce_array(clamped)
    k1 = k >> 1
    with np.errstate(over="ignore"):
        y = (1.0 + m) * _pow2_array(k1) * _pow2_array(k - k1)  # [...]
    return np.where(nan, x, y)


def tanh_array(y: np.ndarray) -> np.ndarray:
    """`tanh` elementwise (the same bits): float64 array -> float64 array of its shape."""
    y = np.asarray(y, dtype=np.float64)
    nan = y != y
    a = np.where(nan, 0.0, np.minimum(np.abs(y), TANH_HI))  # [...]
    k, m = _reduce_array(-2.0 * a)
    s = _pow2_array(k)  # [...]
    t = s * m + (s - 1.0)  # [...]
    return np.where(nan, y, np.copysign(-t / (t + 2.0), y))
