"""f32 and bf16 weight rows: float32 lanes and fused multiply-adds, the same bits on every CPU.

For one activation row x (float32) and one weight row w (float32, or bfloat16 widened exactly
to float32), with C = cols rounded down to a multiple of 16:

1. sixteen lanes, two sets of eight: lane l of set s (s = 0, 1) takes the columns c(i, s, l)
   for i = 0, 1, ... below C, in increasing i: ``a_sl = fma(w_c, x_c, a_sl)``, where
   c = 16i + 8s + l for f32 rows and c = 16i + 2l + s for bf16 rows (even columns in set 0,
   odd in set 1: one 32-byte load of sixteen bf16 values gives both sets with an AND and a
   shift, 2-2.7x faster than widening eight at a time; x is permuted to match once per call)
   (one rounding per step: IEEE fused multiply-add, `llvm.fma`, on any CPU; where the CPU has
   no FMA instruction LLVM calls the C library's fmaf, which rounds the same way);
2. ``v_l = a_0l + a_1l``, then ``y = ((v_0 + v_4) + (v_2 + v_6)) + ((v_1 + v_5) + (v_3 + v_7))``;
3. the columns from C on, in order: ``y = fma(w_c, x_c, y)``.

bf16 rows are read from the packed layout's groups of four rows, sixteen columns of the four
at a time (`layout`; `_bf16_lanes_at` addresses a value): the same values in the same order,
one memory stream per group instead of four.

Nothing depends on how many rows share the call or on the thread split, and no step is left
to the compiler's choice (no fast-math flags), so a row's bits are the same in any batch and
on any CPU.  Four weight rows are taken per pass (eight independent FMA chains: enough to hide
the FMA latency), x loaded once for the four.  Against the float64 sums used before, this is
about twice as fast at batch 1 and loses about 1e-6 of relative accuracy: float32
accumulation, like transformers' own float32 matmuls.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from moeshard.moe.kernels.build import cpu_level
from moeshard.moe.kernels.dots import (
    BF16_GROUP,
    BF16_PIECE,
    F32X8,
    FMT_BF16,
    LANES,
    _vsum,
    _vzero,
    prefetch_line,
)

_V8F = ir.VectorType(ir.FloatType(), LANES)
_V8I16 = ir.VectorType(ir.IntType(16), LANES)
_V8I32 = ir.VectorType(ir.IntType(32), LANES)


def _grid(ary, dtype) -> bool:
    """A C-contiguous 2-D array of `dtype`."""
    return (
        isinstance(ary, types.Array) and ary.ndim == 2 and ary.layout == "C" and ary.dtype == dtype
    )


def _ptr2(context, builder, ary_type, ary, row, col, lane_type):
    """ary[row, col] of a 2-D C array as a pointer to `lane_type`: rows addressed by number,
    not sliced into views (a view per row group costs reference counting that short rows,
    a small model's 256 columns, cannot amortise)."""
    a = context.make_array(ary_type)(context, builder, ary)
    cols = cgutils.unpack_tuple(builder, a.shape, 2)[1]
    index = builder.add(builder.mul(row, cols), col)
    return builder.bitcast(builder.gep(a.data, [index]), lane_type.as_pointer())


def _matrix_at(ary, r, j, dtype) -> bool:
    """Typing check of an intrinsic (ary, r, j) reading row r of a `dtype` matrix from j."""
    return _grid(ary, dtype) and isinstance(r, types.Integer) and isinstance(j, types.Integer)


def _lanes_at(context, builder, sig, args, lane_type):
    """Codegen of such an intrinsic: pointer to args[0][args[1], args[2]] as `lane_type`."""
    row = context.cast(builder, args[1], sig.args[1], types.intp)
    col = context.cast(builder, args[2], sig.args[2], types.intp)
    return _ptr2(context, builder, sig.args[0], args[0], row, col, lane_type)


def _bf16_lanes_at(context, builder, sig, args, lane_type):
    """Codegen: a pointer (as `lane_type`) to value (r, j) = (args[1], args[2]) of a bf16
    matrix in the kernel layout, args[0] uint16 [groups, pieces * 64] (`layout`: value
    w[4g + i, 16p + l] at [g, 64p + 16i + l])."""
    r = context.cast(builder, args[1], sig.args[1], types.intp)
    j = context.cast(builder, args[2], sig.args[2], types.intp)
    a = context.make_array(sig.args[0])(context, builder, args[0])
    width = cgutils.unpack_tuple(builder, a.shape, 2)[1]
    k = r.type

    def const(v):
        return ir.Constant(k, v)

    group = builder.mul(builder.ashr(r, const(2)), width)
    piece = builder.shl(builder.ashr(j, const(4)), const(6))
    inner = builder.add(
        builder.shl(builder.and_(r, const(3)), const(4)), builder.and_(j, const(15))
    )
    index = builder.add(builder.add(group, piece), inner)
    return builder.bitcast(builder.gep(a.data, [index]), lane_type.as_pointer())


@njit(cache=True, nogil=True, inline="always")
def _bf16_at(w, r, c):
    """Value (r, c) of a bf16 matrix in the kernel layout (`_bf16_lanes_at`) as its exact
    float32."""
    g, i = r // BF16_GROUP, r % BF16_GROUP
    return _widen(
        w[g, (c // BF16_PIECE) * (BF16_GROUP * BF16_PIECE) + i * BF16_PIECE + c % BF16_PIECE]
    )


@intrinsic
def _vload2(typingctx, ary, r, j):
    """ary[r, j : j + 8] of a float32 matrix."""
    if not _matrix_at(ary, r, j, types.float32):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_lanes_at(context, builder, sig, args, _V8F), align=4)

    return F32X8(ary, r, j), codegen


_ODD_MASK = -(1 << 16)  # 0xFFFF0000 as an i32: the high bf16 of a 32-bit pair, in place


@intrinsic
def _vload2_bf16_pairs(typingctx, ary, r, j):
    """Row r of a bfloat16 matrix in the kernel layout (`_bf16_lanes_at`), elements j .. j + 15
    (j a multiple of 16), as two exact float32 vectors: (even elements j, j+2, ..., odd
    elements j+1, j+3, ...).  Each 32-bit lane holds a pair; its high half is the odd
    value's float32 bits with the low half cleared, and shifted left by 16 the even one's."""
    if not _matrix_at(ary, r, j, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        pairs = builder.load(_bf16_lanes_at(context, builder, sig, args, _V8I32), align=2)
        odd = builder.and_(pairs, ir.Constant(_V8I32, [_ODD_MASK] * LANES))
        even = builder.shl(pairs, ir.Constant(_V8I32, [16] * LANES))
        lanes = [builder.bitcast(even, _V8F), builder.bitcast(odd, _V8F)]
        return context.make_tuple(builder, sig.return_type, lanes)

    return types.UniTuple(F32X8, 2)(ary, r, j), codegen


@intrinsic
def _vfma(typingctx, a, b, c):
    """a * b + c lane by lane with one rounding (`llvm.fma.v8f32`)."""
    if not (a == b == c == F32X8):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32"
        )
        return builder.call(fn, args)

    return F32X8(a, b, c), codegen


@intrinsic
def _vadd(typingctx, a, b):
    if not (a == b == F32X8):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return F32X8(a, b), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c for float32 scalars, one rounding (`llvm.fma.f32`)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32"
        )
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen


@intrinsic
def _prefetch(typingctx, ary, r, j):
    """`prefetch_line` of value (r, j) of a bf16 matrix (in the kernel layout) or f32 one."""
    bf16 = _matrix_at(ary, r, j, types.uint16)
    if not (bf16 or _matrix_at(ary, r, j, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        at = _bf16_lanes_at if bf16 else _lanes_at
        prefetch_line(builder, at(context, builder, sig, args, ir.IntType(8)))
        return context.get_dummy_value()

    return types.none(ary, r, j), codegen


@njit(cache=True, nogil=True, inline="always")
def _fetch_ahead(w, ahead, j):
    """Prefetch column j of the four rows `ahead` (the next group's; the group's own rows,
    already in cache, where nothing is to be fetched: no branch in the products' loop)."""
    _prefetch(w, ahead[0], j)
    _prefetch(w, ahead[1], j)
    _prefetch(w, ahead[2], j)
    _prefetch(w, ahead[3], j)


@njit(cache=True, nogil=True)
def _bf16_dot4(w, rows, x, xp, u):
    """Four bfloat16 rows of w (the kernel layout; row numbers `rows`) . float32 row u of x
    [b, cols] (steps 1-3 of the module doc); xp is x with each 16 columns reordered evens
    then odds (`even_odd`), the order the bf16 lanes take them in.  No software prefetch: the
    group is one stream (`layout`), which the hardware prefetcher follows (prefetching the
    next group as well was slower: `tools/probe_bf16_stream.py`, docs/kernels.md)."""
    cols = x.shape[1]
    r0, r1, r2, r3 = rows
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _vzero()
    c16 = cols - cols % 16
    for j in range(0, c16, 16):
        xa, xb = _vload2(xp, u, j), _vload2(xp, u, j + 8)  # x's even, odd columns
        e0, o0 = _vload2_bf16_pairs(w, r0, j)
        e1, o1 = _vload2_bf16_pairs(w, r1, j)
        e2, o2 = _vload2_bf16_pairs(w, r2, j)
        e3, o3 = _vload2_bf16_pairs(w, r3, j)
        a0, b0 = _vfma(e0, xa, a0), _vfma(o0, xb, b0)
        a1, b1 = _vfma(e1, xa, a1), _vfma(o1, xb, b1)
        a2, b2 = _vfma(e2, xa, a2), _vfma(o2, xb, b2)
        a3, b3 = _vfma(e3, xa, a3), _vfma(o3, xb, b3)
    y0, y1 = _vsum(_vadd(a0, b0)), _vsum(_vadd(a1, b1))
    y2, y3 = _vsum(_vadd(a2, b2)), _vsum(_vadd(a3, b3))
    for c in range(c16, cols):
        xc = x[u, c]
        y0 = _fma(_bf16_at(w, r0, c), xc, y0)
        y1 = _fma(_bf16_at(w, r1, c), xc, y1)
        y2 = _fma(_bf16_at(w, r2, c), xc, y2)
        y3 = _fma(_bf16_at(w, r3, c), xc, y3)
    return y0, y1, y2, y3


@njit(cache=True, nogil=True)
def even_odd(x):
    """x [b, cols] with each full 16 columns reordered: the 8 even ones, then the 8 odd."""
    b, cols = x.shape
    xp = np.empty((b, cols - cols % 16), dtype=np.float32)  # [b, C]
    for u in range(b):
        for j in range(0, xp.shape[1], 16):
            for l in range(LANES):
                xp[u, j + l] = x[u, j + 2 * l]
                xp[u, j + LANES + l] = x[u, j + 2 * l + 1]
    return xp


@njit(cache=True, nogil=True)
def _f32_dot4(w, rows, x, u, ahead):
    """Four float32 rows of w ([R, cols]; row numbers `rows`) . float32 row u of x [b, cols]
    (steps 1-3 of the module doc); the rows `ahead` are prefetched as these are read."""
    cols = x.shape[1]
    r0, r1, r2, r3 = rows
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _vzero()
    c16 = cols - cols % 16
    for j in range(0, c16, 16):
        _fetch_ahead(w, ahead, j)  # a cache line holds 16 f32 values
        xa, xb = _vload2(x, u, j), _vload2(x, u, j + 8)
        a0 = _vfma(_vload2(w, r0, j), xa, a0)
        a1 = _vfma(_vload2(w, r1, j), xa, a1)
        a2 = _vfma(_vload2(w, r2, j), xa, a2)
        a3 = _vfma(_vload2(w, r3, j), xa, a3)
        b0 = _vfma(_vload2(w, r0, j + 8), xb, b0)
        b1 = _vfma(_vload2(w, r1, j + 8), xb, b1)
        b2 = _vfma(_vload2(w, r2, j + 8), xb, b2)
        b3 = _vfma(_vload2(w, r3, j + 8), xb, b3)
    y0, y1 = _vsum(_vadd(a0, b0)), _vsum(_vadd(a1, b1))
    y2, y3 = _vsum(_vadd(a2, b2)), _vsum(_vadd(a3, b3))
    for c in range(c16, cols):
        xc = x[u, c]
        y0 = _fma(w[r0, c], xc, y0)
        y1 = _fma(w[r1, c], xc, y1)
        y2 = _fma(w[r2, c], xc, y2)
        y3 = _fma(w[r3, c], xc, y3)
    return y0, y1, y2, y3


@njit(cache=True, nogil=True)
def _widen(bits):
    """A bfloat16 bit pattern (uint16) -> its exact float32 value."""
    return np.uint32(np.uint32(bits) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------
# bf16 rows in sixteen lanes at once (AVX-512): the same sums, arranged otherwise
#
# Sixteen bf16 values widened in order fill the lanes m = 0..15 with columns 16i + m.  The
# module doc's lane l of set s takes the columns 16i + 2l + s: that is lane m = 2l + s here,
# the same sixteen accumulators in another arrangement, each summing its columns in the same
# order.  So step 2 pairs lane 2l with 2l + 1 (set 0's lane l with set 1's) and the rest is
# unchanged: the same bits as the eight-lane form, with one FMA per sixteen columns instead of
# two, and x read as it is (no even/odd reordering).  Used where numba compiles for AVX-512.
WIDE_BF16 = cpu_level() == "avx512"

_V16F = ir.VectorType(ir.FloatType(), 16)
_V16I16 = ir.VectorType(ir.IntType(16), 16)
_V16I32 = ir.VectorType(ir.IntType(32), 16)


class _F32x16(types.Type):
    """Sixteen float32 lanes, one LLVM ``<16 x float>`` value (a zmm register on AVX-512)."""

    def __init__(self):
        super().__init__(name="F32x16")


F32X16 = _F32x16()


@register_model(_F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V16F)


@intrinsic
def _zzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V16F, [0.0] * 16)

    return F32X16(), codegen


@intrinsic
def _zload(typingctx, ary, r, j):
    """ary[r, j : j + 16] of a float32 matrix."""
    if not _matrix_at(ary, r, j, types.float32):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_lanes_at(context, builder, sig, args, _V16F), align=4)

    return F32X16(ary, r, j), codegen


@intrinsic
def _zload_bf16(typingctx, ary, r, j):
    """Row r of a bfloat16 matrix in the kernel layout (`_bf16_lanes_at`), elements j .. j + 15
    (j a multiple of 16) in order, as sixteen exact float32 values (zero-extended, shifted
    into the high half)."""
    if not _matrix_at(ary, r, j, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        halves = builder.load(_bf16_lanes_at(context, builder, sig, args, _V16I16), align=2)
        wide = builder.shl(builder.zext(halves, _V16I32), ir.Constant(_V16I32, [16] * 16))
        return builder.bitcast(wide, _V16F)

    return F32X16(ary, r, j), codegen


@intrinsic
def _zfma(typingctx, a, b, c):
    """a * b + c lane by lane with one rounding (`llvm.fma.v16f32`)."""
    if not (a == b == c == F32X16):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32"
        )
        return builder.call(fn, args)

    return F32X16(a, b, c), codegen


@intrinsic
def _zpairs(typingctx, a):
    """v_l = a_(2l) + a_(2l+1): set 0's lane l plus set 1's (step 2's first addition)."""
    if a != F32X16:
        return None

    def codegen(context, builder, sig, args):
        idx = ir.VectorType(ir.IntType(32), LANES)
        even = builder.shuffle_vector(args[0], args[0], ir.Constant(idx, list(range(0, 16, 2))))
        odd = builder.shuffle_vector(args[0], args[0], ir.Constant(idx, list(range(1, 16, 2))))
        return builder.fadd(even, odd)

    return F32X8(a), codegen


@njit(cache=True, nogil=True)
def _bf16_dot4_wide(w, rows, x, u):
    """`_bf16_dot4` in sixteen lanes (see WIDE_BF16): the same bits, x read in order."""
    cols = x.shape[1]
    r0, r1, r2, r3 = rows
    a0 = a1 = a2 = a3 = _zzero()
    c16 = cols - cols % 16
    for j in range(0, c16, 16):
        xj = _zload(x, u, j)
        a0 = _zfma(_zload_bf16(w, r0, j), xj, a0)
        a1 = _zfma(_zload_bf16(w, r1, j), xj, a1)
        a2 = _zfma(_zload_bf16(w, r2, j), xj, a2)
        a3 = _zfma(_zload_bf16(w, r3, j), xj, a3)
    y0, y1 = _vsum(_zpairs(a0)), _vsum(_zpairs(a1))
    y2, y3 = _vsum(_zpairs(a2)), _vsum(_zpairs(a3))
    for c in range(c16, cols):
        xc = x[u, c]
        y0 = _fma(_bf16_at(w, r0, c), xc, y0)
        y1 = _fma(_bf16_at(w, r1, c), xc, y1)
        y2 = _fma(_bf16_at(w, r2, c), xc, y2)
        y3 = _fma(_bf16_at(w, r3, c), xc, y3)
    return y0, y1, y2, y3


@njit(cache=True, nogil=True)
def _bf16_dot4x2_wide(w, rows, x, u):
    """`_bf16_dot4_wide` for activation rows u and u + 1 at once: each weight load widened
    once for the two (eight sums in flight), the same bits per (row, activation row)."""
    cols = x.shape[1]
    r0, r1, r2, r3 = rows
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _zzero()
    c16 = cols - cols % 16
    for j in range(0, c16, 16):
        xa, xb = _zload(x, u, j), _zload(x, u + 1, j)
        w0, w1 = _zload_bf16(w, r0, j), _zload_bf16(w, r1, j)
        w2, w3 = _zload_bf16(w, r2, j), _zload_bf16(w, r3, j)
        a0, b0 = _zfma(w0, xa, a0), _zfma(w0, xb, b0)
        a1, b1 = _zfma(w1, xa, a1), _zfma(w1, xb, b1)
        a2, b2 = _zfma(w2, xa, a2), _zfma(w2, xb, b2)
        a3, b3 = _zfma(w3, xa, a3), _zfma(w3, xb, b3)
    p0, p1, p2, p3 = _vsum(_zpairs(a0)), _vsum(_zpairs(a1)), _vsum(_zpairs(a2)), _vsum(_zpairs(a3))
    q0, q1, q2, q3 = _vsum(_zpairs(b0)), _vsum(_zpairs(b1)), _vsum(_zpairs(b2)), _vsum(_zpairs(b3))
    for c in range(c16, cols):
        xca, xcb = x[u, c], x[u + 1, c]
        w0c, w1c = _bf16_at(w, r0, c), _bf16_at(w, r1, c)
        w2c, w3c = _bf16_at(w, r2, c), _bf16_at(w, r3, c)
        p0, q0 = _fma(w0c, xca, p0), _fma(w0c, xcb, q0)
        p1, q1 = _fma(w1c, xca, p1), _fma(w1c, xcb, q1)
        p2, q2 = _fma(w2c, xca, p2), _fma(w2c, xcb, q2)
        p3, q3 = _fma(w3c, xca, p3), _fma(w3c, xcb, q3)
    return (p0, p1, p2, p3), (q0, q1, q2, q3)


@njit(cache=True, nogil=True)
def _bf16_dot2x8_wide(w, r0, r1, x, u, ahead):
    """Rows r0, r1 of w against activation rows u .. u + 7 of x, in sixteen lanes: each weight
    load widened once for eight FMAs (sixteen sums in flight, against two per widening in
    `_bf16_dot4x2_wide`: at many rows the widening, not memory, bounds the bf16 products),
    the same bits per (row, activation row).  The line holding row `ahead` (with its pair
    row: one line per sixteen columns, `layout`) is prefetched."""
    cols = x.shape[1]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _zzero()
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = _zzero()
    c16 = cols - cols % 16
    for j in range(0, c16, 16):
        _prefetch(w, ahead, j)
        v, t = _zload_bf16(w, r0, j), _zload_bf16(w, r1, j)
        x0, x1, x2, x3 = (
            _zload(x, u, j),
            _zload(x, u + 1, j),
            _zload(x, u + 2, j),
            _zload(x, u + 3, j),
        )
        a0, b0 = _zfma(v, x0, a0), _zfma(t, x0, b0)
        a1, b1 = _zfma(v, x1, a1), _zfma(t, x1, b1)
        a2, b2 = _zfma(v, x2, a2), _zfma(t, x2, b2)
        a3, b3 = _zfma(v, x3, a3), _zfma(t, x3, b3)
        x4, x5, x6, x7 = (
            _zload(x, u + 4, j),
            _zload(x, u + 5, j),
            _zload(x, u + 6, j),
            _zload(x, u + 7, j),
        )
        a4, b4 = _zfma(v, x4, a4), _zfma(t, x4, b4)
        a5, b5 = _zfma(v, x5, a5), _zfma(t, x5, b5)
        a6, b6 = _zfma(v, x6, a6), _zfma(t, x6, b6)
        a7, b7 = _zfma(v, x7, a7), _zfma(t, x7, b7)
    p0, p1, p2, p3 = _vsum(_zpairs(a0)), _vsum(_zpairs(a1)), _vsum(_zpairs(a2)), _vsum(_zpairs(a3))
    p4, p5, p6, p7 = _vsum(_zpairs(a4)), _vsum(_zpairs(a5)), _vsum(_zpairs(a6)), _vsum(_zpairs(a7))
    q0, q1, q2, q3 = _vsum(_zpairs(b0)), _vsum(_zpairs(b1)), _vsum(_zpairs(b2)), _vsum(_zpairs(b3))
    q4, q5, q6, q7 = _vsum(_zpairs(b4)), _vsum(_zpairs(b5)), _vsum(_zpairs(b6)), _vsum(_zpairs(b7))
    for c in range(c16, cols):
        v0, v1 = _bf16_at(w, r0, c), _bf16_at(w, r1, c)
        p0, q0 = _fma(v0, x[u, c], p0), _fma(v1, x[u, c], q0)
        p1, q1 = _fma(v0, x[u + 1, c], p1), _fma(v1, x[u + 1, c], q1)
        p2, q2 = _fma(v0, x[u + 2, c], p2), _fma(v1, x[u + 2, c], q2)
        p3, q3 = _fma(v0, x[u + 3, c], p3), _fma(v1, x[u + 3, c], q3)
        p4, q4 = _fma(v0, x[u + 4, c], p4), _fma(v1, x[u + 4, c], q4)
        p5, q5 = _fma(v0, x[u + 5, c], p5), _fma(v1, x[u + 5, c], q5)
        p6, q6 = _fma(v0, x[u + 6, c], p6), _fma(v1, x[u + 6, c], q6)
        p7, q7 = _fma(v0, x[u + 7, c], p7), _fma(v1, x[u + 7, c], q7)
    return (p0, p1, p2, p3, p4, p5, p6, p7), (q0, q1, q2, q3, q4, q5, q6, q7)


@njit(cache=True, nogil=True)
def _bf16_rows_x8_wide(w, x, out, r0, r1, b8):
    """out[:b8, r0:r1] (b8 a multiple of 8) for bfloat16 rows w (the kernel layout), two
    weight rows at a time against eight activation rows (`_bf16_dot2x8_wide`); an odd last
    row is paired with itself.  Eight activation rows stay in L1 while the item's weight rows
    pass (from L2 after the first eight, which prefetch the next pair from memory): the
    other way round, sixteen activation rows were re-read from L2 for every pair, and that,
    not the FMAs, bounded the products."""
    last = BF16_GROUP * w.shape[0] - 1
    for u in range(0, b8, 8):
        for r in range(r0, r1, 2):
            s = min(r + 1, r1 - 1)
            p, q = _bf16_dot2x8_wide(w, r, s, x, u, min(r + 2, last) if u == 0 else r)
            for i in range(8):
                out[u + i, r] = p[i]
                out[u + i, s] = q[i]


# Rows at most this wide take one weight row against four activation rows (`_bf16_rows_x4`):
# the four rows of x stay in L1 and are read straight into the FMAs, the weight row is widened
# once for the four. Measured on one thread at 16 activation rows (Zen 3, AVX2): 1.9x the
# four-weight-row pass at 256 columns, 1.7x at 512, 0.9x at 1024 and 1.0x at 2048.
NARROW_COLS = 512

# From this many activation rows, AVX-512 takes two weight rows against eight activation rows
# (`_bf16_rows_x8_wide`); below, four weight rows against two.
WIDE_MANY_ROWS = 8


@njit(cache=True, nogil=True)
def float_rows(fmt, wq, x, xp, out, r0, r1):
    """out[:, r0:r1] for f32/bf16 payload rows wq (raw bytes) and float32 x [b, cols]; xp
    is `even_odd(x)` for bf16 (made once per kernel call by the caller), unused for f32.

    Four weight rows at a time (a short last group repeats its last row; those results are
    dropped), every activation row against them while they are in cache.  bf16 rows are
    widened in registers for every activation row: two integer operations per sixteen
    weights, cheaper than a float32 scratch copy.  Narrow bf16 rows (`NARROW_COLS`) with four
    or more activation rows go four activation rows at a time instead; every (weight row,
    activation row) pair is summed in the same order either way, so the bits are the same.
    The first pass over an f32 group prefetches the next group's rows (`dots.prefetch_line`);
    a bf16 group is one stream (`layout`), left to the hardware prefetcher."""
    b, cols = x.shape
    w32 = wq.view(np.float32) if fmt != FMT_BF16 else np.empty((0, 0), dtype=np.float32)
    w16 = wq.view(np.uint16) if fmt == FMT_BF16 else np.empty((0, 0), dtype=np.uint16)
    first = 0  # the first activation row left for the four-weight-row pass
    if fmt == FMT_BF16 and WIDE_BF16 and b >= WIDE_MANY_ROWS:
        first = b - b % 8
        _bf16_rows_x8_wide(w16, x, out, r0, r1, first)
    elif fmt == FMT_BF16 and b >= 4 and cols <= NARROW_COLS:
        first = b - b % 4
        _bf16_rows_x4(w16, x, xp, out, r0, r1, first)
    last = wq.shape[0] - 1
    for r in range(r0, r1, 4):
        group = (r, min(r + 1, r1 - 1), min(r + 2, r1 - 1), min(r + 3, r1 - 1))
        n = min(4, r1 - r)
        if fmt == FMT_BF16 and WIDE_BF16:
            for u in range(first, b - 1, 2):
                ya, yb = _bf16_dot4x2_wide(w16, group, x, u)
                for i in range(n):
                    out[u, r + i] = ya[i]
                    out[u + 1, r + i] = yb[i]
            if (b - first) & 1:
                y = _bf16_dot4_wide(w16, group, x, b - 1)
                for i in range(n):
                    out[b - 1, r + i] = y[i]
            continue
        for u in range(first, b):
            if fmt == FMT_BF16:
                y = _bf16_dot4(w16, group, x, xp, u)
            else:
                # the next group's rows are prefetched while this one is read, by its first pass
                ahead = (min(r + 4, last), min(r + 5, last), min(r + 6, last), min(r + 7, last))
                y = _f32_dot4(w32, group, x, u, ahead if u == first else group)
            for i in range(n):
                out[u, r + i] = y[i]


@njit(cache=True, nogil=True)
def _bf16_rows_x4(w, x, xp, out, r0, r1, b4):
    """out[:b4, r0:r1] (b4 a multiple of 4) for bfloat16 rows w (the kernel layout): each
    weight row against activation rows u .. u + 3."""
    for r in range(r0, r1):
        for u in range(0, b4, 4):
            y0, y1, y2, y3 = _bf16_dot1x4(w, r, x, xp, u)
            out[u, r] = y0
            out[u + 1, r] = y1
            out[u + 2, r] = y2
            out[u + 3, r] = y3


@njit(cache=True, nogil=True, inline="always")
def _bf16_dot1x4(w, r, x, xp, u):
    """Row r of w . rows u .. u + 3 of x, each by steps 1-3 of the module doc (the sums of
    `_bf16_dot4`, bit for bit). Inlined: a call per four dot products costs more than the
    16-column loop itself at 256 columns."""
    cols = x.shape[1]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _vzero()
    c16 = cols - cols % 16
    for j in range(0, c16, 16):
        e, o = _vload2_bf16_pairs(w, r, j)  # the row's even, odd columns
        a0, b0 = _vfma(e, _vload2(xp, u, j), a0), _vfma(o, _vload2(xp, u, j + 8), b0)
        a1, b1 = _vfma(e, _vload2(xp, u + 1, j), a1), _vfma(o, _vload2(xp, u + 1, j + 8), b1)
        a2, b2 = _vfma(e, _vload2(xp, u + 2, j), a2), _vfma(o, _vload2(xp, u + 2, j + 8), b2)
        a3, b3 = _vfma(e, _vload2(xp, u + 3, j), a3), _vfma(o, _vload2(xp, u + 3, j + 8), b3)
    y0, y1 = _vsum(_vadd(a0, b0)), _vsum(_vadd(a1, b1))
    y2, y3 = _vsum(_vadd(a2, b2)), _vsum(_vadd(a3, b3))
    for c in range(c16, cols):
        wc = _bf16_at(w, r, c)
        y0 = _fma(wc, x[u, c], y0)
        y1 = _fma(wc, x[u + 1, c], y1)
        y2 = _fma(wc, x[u + 2, c], y2)
        y3 = _fma(wc, x[u + 3, c], y3)
    return y0, y1, y2, y3
