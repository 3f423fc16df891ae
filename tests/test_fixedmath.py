"""The gated unit's exp and tanh (`moeshard.moe.kernels.fixedmath`): numba and numpy give the same
bits, and both stay within a stated number of ulps of numpy's (libm-like) exp and tanh.

A coordinator recomputes a node's expert output and requires equal bits, so these functions
are part of the audit contract: the numba version runs in the kernels (`entry._glu_mul`), the
numpy twin in `quant.glu_reference`.  tests/test_kernel_isa.py checks that the compiled
kernels give the same bits on other CPU levels.
"""

import numpy as np
import pytest
from numba import njit

from moeshard.moe.kernels import entry, fixedmath, quant

EDGES = [
    0.0,
    -0.0,
    np.inf,
    -np.inf,
    np.nan,
    -np.nan,
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    1e-300,
    2.0**-28,
    -(2.0**-28),
    0.34657359027997264,  # ln 2 / 2: where the reduction's k changes
    -0.34657359027997264,
    1.0,
    -1.0,
    19.06,
    20.0,
    -20.0,
    22.0,
    -708.3964185322641,  # exp: the smallest normal result
    -708.4,
    -709.0,
    -745.1332191019411,  # exp: the smallest subnormal, then 0
    -745.1332191019412,
    -746.0,
    -1e6,
    709.782712893384,  # exp: the largest finite result, then inf
    709.7827128933841,
    710.0,
    1e6,
    1.7976931348623157e308,
    -1.7976931348623157e308,
]


def values(n: int, seed: int) -> np.ndarray:
    """float64 [~5n]: log-uniform magnitudes from 1e-20 to 1e3 of both signs, uniform over
    exp's finite range and the small ones, floats near float32 values, and `EDGES`."""
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], n)
    return np.concatenate(
        [
            signs * 10.0 ** rng.uniform(-20, 3, n),
            rng.uniform(-746, 710, n),
            rng.uniform(-1, 1, n),
            rng.uniform(-40, 40, n),
            (rng.standard_normal(n) * 3).astype(np.float32).astype(np.float64),
            np.array(EDGES),
        ]
    )


@njit(cache=False)
def numba_exp(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = fixedmath.exp(x[i])
    return out


@njit(cache=False)
def numba_tanh(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = fixedmath.tanh(x[i])
    return out


def same_bits64(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint64), b.view(np.uint64))


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many float64 values lie between a and b (0: equal; +0 and -0 count as equal)."""
    ia, ib = a.view(np.int64), b.view(np.int64)
    ia = np.where(ia < 0, np.int64(-(2**63)) - ia, ia)  # ordered like the values
    ib = np.where(ib < 0, np.int64(-(2**63)) - ib, ib)
    return np.abs(ia - ib)


@pytest.mark.parametrize("name", ["exp", "tanh"])
def test_numba_equals_numpy_twin_bit_for_bit(name):
    x = values(400_000, seed=1)
    compiled = {"exp": numba_exp, "tanh": numba_tanh}[name](x)
    twin = {"exp": fixedmath.exp_array, "tanh": fixedmath.tanh_array}[name](x)
    assert same_bits64(compiled, twin)
    scalar = {"exp": fixedmath.exp, "tanh": fixedmath.tanh}[name]  # as the kernels call it
    one_by_one = np.array([scalar(v) for v in EDGES])
    assert same_bits64(one_by_one, twin[-len(EDGES) :])


def test_exp_within_its_ulps_of_numpy():
    x = values(1_000_000, seed=2)
    got = fixedmath.exp_array(x)
    with np.errstate(over="ignore"):
        want = np.exp(x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert ulps(got[~nan], want[~nan]).max() <= fixedmath.EXP_ULPS
    if np.finfo(np.longdouble).nmant > 52:  # x86's 80-bit long double: the error itself
        ok = ~nan & (want > 2.2250738585072014e-308) & np.isfinite(want)
        exact = np.exp(x[ok].astype(np.longdouble))
        err = np.abs((got[ok] - exact) / np.spacing(got[ok]).astype(np.longdouble))
        assert err.max() < 1.0  # fdlibm's bound


def test_tanh_within_its_ulps_of_numpy():
    x = values(1_000_000, seed=3)
    got = fixedmath.tanh_array(x)
    want = np.tanh(x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert ulps(got[~nan], want[~nan]).max() <= fixedmath.TANH_ULPS
    tiny = ~nan & (np.abs(x) < 1e-9)  # tanh(y) = y there: relative accuracy kept
    assert ulps(got[tiny], x[tiny]).max() <= 1
    if np.finfo(np.longdouble).nmant > 52:
        ok = ~nan & (want != 0)
        exact = np.tanh(x[ok].astype(np.longdouble))
        err = np.abs((got[ok] - exact) / np.spacing(np.abs(got[ok])).astype(np.longdouble))
        assert err.max() < 2.5


def test_special_values():
    for f in (fixedmath.exp, fixedmath.exp_array):
        assert np.isnan(f(np.nan))
        assert f(np.inf) == np.inf and f(1e6) == np.inf and f(709.7827128933841) == np.inf
        assert f(709.782712893384) == 1.7976931348622732e308
        assert f(-np.inf) == 0.0 and f(-1e6) == 0.0 and f(-745.1332191019412) == 0.0
        assert f(-745.1332191019411) == 5e-324
        assert f(0.0) == 1.0 and f(-0.0) == 1.0 and f(5e-324) == 1.0
    for f in (fixedmath.tanh, fixedmath.tanh_array):
        assert np.isnan(f(np.nan))
        assert f(np.inf) == 1.0 and f(-np.inf) == -1.0 and f(20.0) == 1.0 and f(-1e300) == -1.0
        assert np.signbit(f(-0.0)) and not np.signbit(f(0.0)) and f(0.0) == 0.0
        assert f(5e-324) == 5e-324 and f(-1e-300) == -1e-300


def gates(shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gate and up values float32 [rows, cols], rows of standard deviations 0.1 to 5 (as an
    expert's, see docs/kernels.md), with a few non-finite and extreme ones."""
    rng = np.random.default_rng(seed)
    sd = 10.0 ** rng.uniform(-1, 0.7, (shape[0], 1))
    g = (rng.standard_normal(shape) * sd).astype(np.float32)  # [rows, cols]
    u = (rng.standard_normal(shape) * sd).astype(np.float32)  # [rows, cols]
    g[0, :9] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38]
    u[0, 9:18] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38]
    return g, u


@pytest.mark.parametrize("glu", [quant.SWIGLU, quant.situ(4.0, 25.0), quant.situ(0.5, 2.0)])
def test_gated_unit_kernel_equals_reference_bit_for_bit(glu):
    g, u = gates((64, 2048), seed=4)
    got = entry._glu_mul(g, u, quant._glu(glu))  # [64, 2048]
    with np.errstate(all="ignore"):  # the non-finite gates
        want = quant.glu_reference(g, u, glu).astype(np.float32)  # [64, 2048]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    g3, u3 = g.reshape(8, 8, 2048), u.reshape(8, 8, 2048)[::-1]  # [8, 8, 2048]: any shape
    g3.setflags(write=False)  # a read-only gate, a non-contiguous up
    trunk = quant.gated_unit(g3, u3, glu)  # what the trunk's FFNs call
    with np.errstate(all="ignore"):
        want3 = quant.glu_reference(g3, u3, glu).astype(np.float32)
    assert trunk.shape == g3.shape and np.array_equal(trunk.view(np.uint32), want3.view(np.uint32))


@pytest.mark.parametrize("glu", [quant.SWIGLU, quant.situ(4.0, 25.0)])
def test_gated_unit_rounds_to_libms_float32_almost_always(glu):
    """The float32 gated unit is what the expert FFN keeps: against the same formula with
    numpy's exp and tanh it changed 0 of 104,857,600 values of each kind (docs/kernels.md);
    here 4 M, allowing a handful for another libm."""
    g, u = gates((256, 16384), seed=5)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    with np.errstate(all="ignore"):
        new = quant.glu_reference(g, u, glu).astype(np.float32)
        if glu.kind == 1:
            b, lb = glu.beta, glu.linear_beta
            old = b * np.tanh(g64 / b) / (1.0 + np.exp(-g64)) * (lb * np.tanh(u64 / lb))
        else:
            old = g64 / (1.0 + np.exp(-g64)) * u64
        old = old.astype(np.float32)
    changed = np.count_nonzero(new.view(np.uint32) != old.view(np.uint32))
    assert changed <= 4
