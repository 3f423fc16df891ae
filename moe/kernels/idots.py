"""Integer q4_0/q8_0 dot products: activations quantised to 8 bits per block, as llama.cpp does.

For one activation row x and one weight row (codes q, float16 block scales dw; ``e = q - 8``
for q4_0, ``e = q`` for q8_0), the arithmetic, identical on every CPU, batch size and thread
split (tests/test_kernel_determinism.py emulates it in numpy bit for bit):

1. x is quantised per 32-column block k (`quantize_activations`): ``amax = max |x_c|``,
   ``dx_k = amax / 127`` and ``xq_c = rint(x_c * (1 / dx_k))`` (round half to even, always
   within -127..127), all float32; an all-zero block gets ``dx_k = 0`` and zero codes, a block
   holding a nan or an inf gets ``dx_k = nan`` (its row's outputs become nan).
2. per block k, lane l (l = 0..7) takes the block's columns 4l..4l+3 and sums their four
   products exactly as integers: ``t_l = sum e_c xq_c``;
3. ``a_l = fma(dw_k * dx_k, float(t_l), a_l)``: the scales' product rounded to float32, then
   one fused multiply-add (IEEE, one rounding: `llvm.fma`, the C library's fmaf where the CPU
   has no FMA instruction), blocks in increasing k; no fast-math flags anywhere;
4. ``y = ((a_0 + a_4) + (a_2 + a_6)) + ((a_1 + a_5) + (a_3 + a_7))``.

Step 2 is where the time goes and is exact, so the CPU may do it any way it likes:

* x86 with AVX2: ``vpmaddubsw`` (unsigned byte x signed byte, pairs summed to 16 bits) then
  ``vpmaddwd`` by ones (pairs summed to 32 bits), 32 products in two instructions.  q4_0 codes
  are unsigned 0..15, so the -8 is taken out afterwards with the block's per-lane sums of
  ``8 * xq`` (computed once per activation row, `xc`); q8_0 codes are signed, so the sign
  moves onto the activations (``|e| * sign(e) xq``, llama.cpp's trick).  No pair sum can
  saturate: 2 * 15 * 127 and 2 * 128 * 127 fit in 16 bits.
* anywhere else: plain LLVM vector integer code (widen, multiply, add groups of four), which
  gives the same integers.

LLVM does not emit ``vpmaddubsw`` from a plain loop, so the AVX2 form is written as calls to
LLVM's x86 intrinsics inside numba ``@intrinsic`` code generators.  Which form is compiled is
decided at import from the CPU numba compiles for (`ISA`; ``MOESHARD_KERNEL_ISA=generic``
forces the portable one, for tests).  numba's on-disk cache is keyed by the CPU's name and
features, so a cache built on one CPU is never loaded on another.  (AVX-VNNI and AVX512-VNNI
``vpdpbusd`` would fuse the two instructions into one; this machine has neither, so that form
is not written: it could not be run here.)

Against the float path of `moe.kernels.dots` this trades exact float32 activations for 8-bit
ones (``moeshard quality`` prints what that costs) and does a quarter of the float work.
"""

import os

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from moe.kernels.dots import F32X8, FMT_Q4_0, LANES, QK, _splat, _vsum, _vzero


def _target_isa() -> str:
    """ "avx2" when the CPU numba compiles for has AVX2, else "generic"."""
    forced = os.environ.get("MOESHARD_KERNEL_ISA", "")
    if forced:
        if forced not in ("avx2", "generic"):
            raise ValueError(f"MOESHARD_KERNEL_ISA={forced!r}: expected avx2 or generic")
        return forced
    if config.CPU_NAME and config.CPU_NAME != "host":  # NUMBA_CPU_NAME: a portable build
        return "avx2" if "+avx2" in (config.CPU_FEATURES or "") else "generic"
    return "avx2" if "+avx2" in llvm.get_host_cpu_features().flatten().split(",") else "generic"


ISA = _target_isa()

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32I8 = ir.VectorType(_I8, 32)
_V16I8 = ir.VectorType(_I8, 16)
_V16I16 = ir.VectorType(_I16, 16)
_V8I32 = ir.VectorType(_I32, LANES)
_V32I32 = ir.VectorType(_I32, 32)
_V8F = ir.VectorType(ir.FloatType(), LANES)


def _call(builder, name, ret, *args):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name
    )
    return builder.call(fn, args)


def _indices(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


# Matrices reach the block kernels as (address, row stride in bytes) pairs of intp, not as
# arrays: an array argument costs an atomic reference-count increment and decrement per call
# of a row-group function (a dozen per group of four rows), which a short row (a small
# expert's 64 or 256 columns) cannot amortise.  `_mat` makes the pair; the caller keeps the
# array alive.
_MAT = types.UniTuple(types.intp, 2)


@njit(cache=True, nogil=True)
def _mat(a):
    """(address, row stride in bytes) of a 2-D C-contiguous array."""
    return np.intp(a.ctypes.data), np.intp(a.strides[0])


def _at(context, builder, mat, mat_type, row, offset):
    """i8* to byte `offset` of row `row` of a `_mat` pair (row and offset intp values)."""
    base, stride = cgutils.unpack_tuple(builder, mat, 2)
    address = builder.add(base, builder.add(builder.mul(row, stride), offset))
    return builder.inttoptr(address, _I8.as_pointer())


def _scalar_at(ty, width):
    """An intrinsic (mat, r, k) -> element k of row r of a `_mat` pair, of numba type ty and
    `width` bytes."""

    @intrinsic
    def at(typingctx, mat, r, k):
        if not (mat == _MAT and isinstance(r, types.Integer) and isinstance(k, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            row = context.cast(builder, args[1], sig.args[1], types.intp)
            col = context.cast(builder, args[2], sig.args[2], types.intp)
            offset = builder.mul(col, ir.Constant(col.type, width))
            ptr = _at(context, builder, args[0], _MAT, row, offset)
            llty = context.get_value_type(ty)
            return builder.load(builder.bitcast(ptr, llty.as_pointer()), align=1)

        return ty(mat, r, k), codegen

    return at


_u16_at = _scalar_at(types.uint16, 2)
_f32_at = _scalar_at(types.float32, 4)


def _load(builder, ptr, vtype):
    return builder.load(builder.bitcast(ptr, vtype.as_pointer()), align=1)


# ---------------------------------------------------------------------------------------------
# one block's weight codes as <32 x i8>, from the kernel layout of `moe.kernels.quant`


def _q4_low(builder, ptr):  # block 2p of a pair: low nibbles of the pair's 32 bytes
    return builder.and_(_load(builder, ptr, _V32I8), ir.Constant(_V32I8, [15] * 32))


def _q4_high(builder, ptr):  # block 2p + 1 of a pair: high nibbles
    return builder.lshr(_load(builder, ptr, _V32I8), ir.Constant(_V32I8, [4] * 32))


def _q4_tail(builder, ptr):  # the odd last block, ggml order: 16 bytes, q[j] | q[j + 16] << 4
    b = _load(builder, ptr, _V16I8)
    lo = builder.and_(b, ir.Constant(_V16I8, [15] * 16))
    hi = builder.lshr(b, ir.Constant(_V16I8, [4] * 16))
    return builder.shuffle_vector(lo, hi, _indices(range(32)))


def _q8(builder, ptr):
    return _load(builder, ptr, _V32I8)


# ---------------------------------------------------------------------------------------------
# step 2: eight exact int32 sums of four products each


def _dot_avx2(builder, w, x, signed):
    if signed:  # |w| * (x * sign(w)): maddubs wants its first operand unsigned
        zero = ir.Constant(_V32I8, [0] * 32)
        neg = builder.icmp_signed("<", w, zero)
        w_abs = builder.select(neg, builder.sub(zero, w), w)
        x = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, x, w)
        w = w_abs
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, w, x)  # <16 x i16>
    ones = ir.Constant(_V16I16, [1] * 16)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, pairs, ones)  # <8 x i32>


def _dot_generic(builder, w, x, signed):
    wide = builder.sext(w, _V32I32) if signed else builder.zext(w, _V32I32)
    p = builder.mul(wide, builder.sext(x, _V32I32))  # <32 x i32>
    s = None
    for g in range(4):  # lane l: products 4l .. 4l + 3
        part = builder.shuffle_vector(p, p, _indices(range(g, 32, 4)))
        s = part if s is None else builder.add(s, part)
    return s


_DOT = {"avx2": _dot_avx2, "generic": _dot_generic}[ISA]


def _iblock_kernel(codes, signed: bool, q4: bool):
    """An intrinsic running steps 2-3 on one block for n weight rows and m activation rows:
    ``(a, dw, dx, wq, rows, i, xq, us, j, xc, c) -> a'``.  wq: the uint8 weight matrix (a
    `_mat` pair, as xq and xc), its rows `rows` (an n-tuple of row numbers) holding the block
    at ``wq[r, i:]`` (read by `codes`); dw: their n float32 block scales; xq: the int8
    activations, rows `us` (an m-tuple) with the block at ``xq[u, j : j + 32]``; dx: their m
    block scales; xc: the int32 per-lane sums of 8 * xq, the block's at ``xc[u, c : c + 8]``
    (q4_0 only); a: the m * n lane accumulators, pair (u, r) at a[u * n + r]."""

    @intrinsic
    def block(typingctx, a, dw, dx, wq, rows, i, xq, us, j, xc, c):
        if not (isinstance(rows, types.UniTuple) and isinstance(us, types.UniTuple)):
            return None
        n, m = len(rows), len(us)
        if not (
            a == types.UniTuple(F32X8, n * m)
            and dw == types.UniTuple(types.float32, n)
            and dx == types.UniTuple(types.float32, m)
            and wq == xq == xc == _MAT
            and all(isinstance(v, types.Integer) for v in (rows.dtype, us.dtype, i, j, c))
        ):
            return None

        def codegen(context, builder, sig, args):
            def intp(value, ty):
                return context.cast(builder, value, ty, types.intp)

            acc = cgutils.unpack_tuple(builder, args[0], n * m)
            dws = cgutils.unpack_tuple(builder, args[1], n)
            dxs = cgutils.unpack_tuple(builder, args[2], m)
            rs = [intp(v, rows.dtype) for v in cgutils.unpack_tuple(builder, args[4], n)]
            xs = [intp(v, us.dtype) for v in cgutils.unpack_tuple(builder, args[7], m)]
            col_w, col_x = intp(args[5], i), intp(args[8], j)
            col_c = builder.mul(intp(args[10], c), ir.Constant(col_w.type, 4))  # int32 lanes
            w = [codes(builder, _at(context, builder, args[3], wq, r, col_w)) for r in rs]
            x = [_q8(builder, _at(context, builder, args[6], xq, u, col_x)) for u in xs]
            if q4:
                corr = [
                    _load(builder, _at(context, builder, args[9], xc, u, col_c), _V8I32) for u in xs
                ]
            out = []
            for u in range(m):
                for r in range(n):
                    t = _DOT(builder, w[r], x[u], signed)  # <8 x i32>, exact
                    if q4:
                        t = builder.sub(t, corr[u])  # sum (q - 8) xq = sum q xq - 8 sum xq
                    d = builder.fmul(dws[r], dxs[u])
                    tf = builder.sitofp(t, _V8F)  # exact: |t| < 2^16
                    acc_ur = acc[u * n + r]
                    out.append(
                        _call(builder, "llvm.fma.v8f32", _V8F, _splat(builder, d), tf, acc_ur)
                    )
            return context.make_tuple(builder, sig.return_type, out)

        return a(a, dw, dx, wq, rows, i, xq, us, j, xc, c), codegen

    return block


_q4lo_iblock = _iblock_kernel(_q4_low, signed=False, q4=True)
_q4hi_iblock = _iblock_kernel(_q4_high, signed=False, q4=True)
_q4tail_iblock = _iblock_kernel(_q4_tail, signed=False, q4=True)
_q8_iblock = _iblock_kernel(_q8, signed=True, q4=False)


# ---------------------------------------------------------------------------------------------
# step 1: activations to 8 bits per block


@njit(cache=True, nogil=True)
def quantize_activations(x, xq, xd, xc):
    """x float32 [b, cols] -> codes xq int8 [b, cols], block scales xd float32 [b, cols // 32]
    and per-lane sums of 8 * codes xc int32 [b, cols // 32 * 8] (step 1 of the module doc)."""
    for u in range(x.shape[0]):
        for k in range(x.shape[1] // QK):
            c0 = QK * k
            amax = np.float32(0.0)
            finite = True
            for c in range(c0, c0 + QK):
                v = abs(x[u, c])
                if v > amax:
                    amax = v
                elif not (v == v):
                    finite = False
            if not finite or amax == np.inf:
                xd[u, k] = np.float32(np.nan)
                for c in range(c0, c0 + QK):
                    xq[u, c] = 0
            elif amax == 0:
                xd[u, k] = np.float32(0.0)
                for c in range(c0, c0 + QK):
                    xq[u, c] = 0
            else:
                d = amax / np.float32(127.0)
                inv = np.float32(1.0) / d
                xd[u, k] = d
                for c in range(c0, c0 + QK):
                    q = np.rint(x[u, c] * inv)
                    xq[u, c] = np.int8(min(max(q, np.float32(-127.0)), np.float32(127.0)))
            for lane in range(LANES):
                s = 0
                for c in range(c0 + 4 * lane, c0 + 4 * lane + 4):
                    s += np.int32(xq[u, c])
                xc[u, LANES * k + lane] = 8 * s


@njit(cache=True, nogil=True)
def activation_buffers(b, cols):
    """Empty (xq, xd, xc) for `quantize_activations` of a [b, cols] activation."""
    nb = cols // QK
    xq = np.empty((b, cols), dtype=np.int8)  # [b, cols]
    xd = np.empty((b, nb), dtype=np.float32)  # [b, nb]
    xc = np.empty((b, nb * LANES), dtype=np.int32)  # [b, nb * 8]
    return xq, xd, xc


# ---------------------------------------------------------------------------------------------
# four weight rows against one or two activation rows


@njit(cache=True, nogil=True)
def _scales(ws, rows, lut, k):
    """The float32 scales of block k of four weight rows (ws: float16 bits, lut: their
    values, both `_mat` pairs)."""
    return (
        _f32_at(lut, 0, _u16_at(ws, rows[0], k)),
        _f32_at(lut, 0, _u16_at(ws, rows[1], k)),
        _f32_at(lut, 0, _u16_at(ws, rows[2], k)),
        _f32_at(lut, 0, _u16_at(ws, rows[3], k)),
    )


@njit(cache=True, nogil=True)
def _q4_idot4x1(wq, ws, rows, lut, xq, xd, xc, u, nb):
    """Four q4_0 weight rows (row numbers `rows` of payload wq and scales ws) . quantised
    activation row u -> four floats; nb blocks per row; every matrix a `_mat` pair."""
    a0 = a1 = a2 = a3 = _vzero()
    us = (u,)
    for p in range(nb // 2):  # blocks k = 2p, 2p + 1 share 32 bytes from byte 32p
        k = 2 * p
        a0, a1, a2, a3 = _q4lo_iblock(
            (a0, a1, a2, a3), _scales(ws, rows, lut, k), (_f32_at(xd, u, k),), wq, rows, 32 * p,
            xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
        k += 1
        a0, a1, a2, a3 = _q4hi_iblock(
            (a0, a1, a2, a3), _scales(ws, rows, lut, k), (_f32_at(xd, u, k),), wq, rows, 32 * p,
            xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
    if nb & 1:
        k = nb - 1
        a0, a1, a2, a3 = _q4tail_iblock(
            (a0, a1, a2, a3), _scales(ws, rows, lut, k), (_f32_at(xd, u, k),), wq, rows, 16 * k,
            xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
    return _vsum(a0), _vsum(a1), _vsum(a2), _vsum(a3)


@njit(cache=True, nogil=True)
def _q4_idot4x2(wq, ws, rows, lut, xq, xd, xc, u, nb):
    """`_q4_idot4x1` for activation rows u and u + 1: each weight block is loaded once."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _vzero()
    us = (u, u + 1)
    for p in range(nb // 2):
        k = 2 * p
        a0, a1, a2, a3, b0, b1, b2, b3 = _q4lo_iblock(
            (a0, a1, a2, a3, b0, b1, b2, b3), _scales(ws, rows, lut, k),
            (_f32_at(xd, u, k), _f32_at(xd, u + 1, k)),
            wq, rows, 32 * p, xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
        k += 1
        a0, a1, a2, a3, b0, b1, b2, b3 = _q4hi_iblock(
            (a0, a1, a2, a3, b0, b1, b2, b3), _scales(ws, rows, lut, k),
            (_f32_at(xd, u, k), _f32_at(xd, u + 1, k)),
            wq, rows, 32 * p, xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
    if nb & 1:
        k = nb - 1
        a0, a1, a2, a3, b0, b1, b2, b3 = _q4tail_iblock(
            (a0, a1, a2, a3, b0, b1, b2, b3), _scales(ws, rows, lut, k),
            (_f32_at(xd, u, k), _f32_at(xd, u + 1, k)),
            wq, rows, 16 * k, xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
    ya = (_vsum(a0), _vsum(a1), _vsum(a2), _vsum(a3))
    return ya, (_vsum(b0), _vsum(b1), _vsum(b2), _vsum(b3))


@njit(cache=True, nogil=True)
def _q8_idot4x1(wq, ws, rows, lut, xq, xd, xc, u, nb):
    """Four q8_0 rows . quantised activation row u (xc is not read: q8_0 codes need no
    correction)."""
    a0 = a1 = a2 = a3 = _vzero()
    us = (u,)
    for k in range(nb):
        a0, a1, a2, a3 = _q8_iblock(
            (a0, a1, a2, a3), _scales(ws, rows, lut, k), (_f32_at(xd, u, k),), wq, rows, QK * k,
            xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
    return _vsum(a0), _vsum(a1), _vsum(a2), _vsum(a3)


@njit(cache=True, nogil=True)
def _q8_idot4x2(wq, ws, rows, lut, xq, xd, xc, u, nb):
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _vzero()
    us = (u, u + 1)
    for k in range(nb):
        a0, a1, a2, a3, b0, b1, b2, b3 = _q8_iblock(
            (a0, a1, a2, a3, b0, b1, b2, b3), _scales(ws, rows, lut, k),
            (_f32_at(xd, u, k), _f32_at(xd, u + 1, k)),
            wq, rows, QK * k, xq, us, QK * k, xc, LANES * k,
        )  # fmt: skip
    ya = (_vsum(a0), _vsum(a1), _vsum(a2), _vsum(a3))
    return ya, (_vsum(b0), _vsum(b1), _vsum(b2), _vsum(b3))


@njit(cache=True, nogil=True)
def int_rows(fmt, wq, ws, lut, xq, xd, xc, out, r0, r1):
    """out[:, r0:r1] for quantised activations (xq, xd, xc) of any batch (q4_0/q8_0).

    Four weight rows at a time; each group's bytes (a few KB) are read from memory once and
    then stay in L1 while every activation row, two at a time, is multiplied with them.  A
    last group of fewer than four rows repeats its last row (those lanes are dropped)."""
    b, nb = xq.shape[0], xd.shape[1]
    mw, ms, mx, md, mc = _mat(wq), _mat(ws), _mat(xq), _mat(xd), _mat(xc)
    mlut = (np.intp(lut.ctypes.data), np.intp(0))
    for r in range(r0, r1, 4):
        rows = (r, min(r + 1, r1 - 1), min(r + 2, r1 - 1), min(r + 3, r1 - 1))
        n = min(4, r1 - r)
        for u in range(0, b - 1, 2):
            if fmt == FMT_Q4_0:
                ya, yb = _q4_idot4x2(mw, ms, rows, mlut, mx, md, mc, u, nb)
            else:
                ya, yb = _q8_idot4x2(mw, ms, rows, mlut, mx, md, mc, u, nb)
            for i in range(n):
                out[u, r + i] = ya[i]
                out[u + 1, r + i] = yb[i]
        if b & 1:
            u = b - 1
            if fmt == FMT_Q4_0:
                y = _q4_idot4x1(mw, ms, rows, mlut, mx, md, mc, u, nb)
            else:
                y = _q8_idot4x1(mw, ms, rows, mlut, mx, md, mc, u, nb)
            for i in range(n):
                out[u, r + i] = y[i]
