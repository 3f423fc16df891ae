"""Numba kernels: shared constants, the 8-lane vector primitives, and the batch-1 q4_0/q8_0 row
dots for float32 activations.

`moe.kernels.entry` holds the entry points called from Python (and the byte layout of the
``wq``/``ws`` views these helpers receive); `moe.kernels.tiles` holds the batch >= 2 tiles.
This module also sets OMP_WAIT_POLICY (below), so it must be imported before any parallel
kernel runs; `entry` and `tiles` import it first.  (With 8-bit activations, the default,
q4_0/q8_0 go through `moe.kernels.idots` instead, which defines its own arithmetic.)

The float-activation q4_0/q8_0 arithmetic (every batch size, thread count and CPU;
docs/kernels.md has the reasons and the measurements).  For one activation row x and one
weight row of ``cols``, with codes q and per-block float16 scales d (``e_c = q_c - 8`` for
q4_0, ``e_c = q_c`` for q8_0):

1. eight lanes, lane l taking columns l, l + 8, l + 16, ...;
2. per 32-column block k, in increasing k: each lane first sums its four products of the
   block, ``t_l = ((e_c0 x_c0 + e_c1 x_c1) + e_c2 x_c2) + e_c3 x_c3`` (c_g = 32k + 8g + l),
   then ``a_l = a_l + d_k * t_l``.  Every product and every sum is rounded to float32 on its
   own: no step is ever fused into an FMA;
3. ``y = ((a_0 + a_4) + (a_2 + a_6)) + ((a_1 + a_5) + (a_3 + a_7))``.

Scaling once per block (step 2) rather than each weight saves a multiply per weight at batch 1,
where these kernels are compute-bound on this machine (measured 1.2-1.3x faster, one thread).
Step 2 is written once, in `_block_kernel`; the batch-1 dots here and the batch >= 2 tiles in
`moe.kernels.tiles` call the intrinsics it generates.

Nothing here depends on how many rows share the call or on how LLVM would vectorise a sum,
because none of these kernels has a fast-math flag: LLVM must keep IEEE semantics, so it may
neither reassociate the sums nor contract a multiply and an add into an FMA, and the result is
the same on AVX2, AVX-512, baseline x86-64 or any other IEEE machine (and in numpy:
tests/test_kernel_determinism.py emulates it bit for bit).  Without reassociation LLVM's loop
vectoriser will not split a float sum into lanes (and numba runs no SLP vectoriser), so the
lanes are written out: `F32X8` is an LLVM ``<8 x float>`` value (a ymm register on AVX2, two
xmm on baseline x86-64) handled through the small intrinsics below.

Batch 1 (`_q4_dot4`, `_q8_dot4`): four weight rows per pass, codes unpacked and converted in
registers, x loaded once per four rows.

Notes for whoever edits these loops (here and in `moe.kernels.tiles`):

* Keep fast-math flags off every q4_0/q8_0 kernel and helper: one ``contract`` or
  ``reassoc`` lets the compiler change the rounding again (per CPU and per call site).
* The vector intrinsics read and write 8 (or a block's 32) consecutive elements from the
  given index with no bounds check; callers keep offsets inside the row.  They accept only
  C-contiguous 1-D arrays (a row of a C-contiguous 2-D array, or a slice of one, is).
* Every path must follow step 2 exactly: blocks in order, and within a block the four groups
  of 8 columns in order.  In the pair layout the low nibbles of a 32-byte group are block 2p
  and the high ones block 2p + 1; in the odd last block (ggml order) the low nibbles of bytes
  0..15 are its columns 0..15 and the high nibbles 16..31.
* numba's cache (``cache=True``) checks only each function's own file, yet compiles in the
  helpers and constants it imports: after editing this module or `tiles`, the cached kernels
  of `tiles` and `entry` still hold the old code.  Delete ``moe/kernels/__pycache__/*.nbi``
  and ``*.nbc`` after such an edit.
"""

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

# GNU OpenMP (numba's default threading layer here) spins at barriers by default.  On a
# shared or oversubscribed box (other processes, or this process's own SSD reader threads)
# the spinning starves the team thread it waits for: measured here under load, a 2.6 MB
# Qwen3 expert took a median 3-16 ms instead of 0.5 ms, p90 20-40 ms.  PASSIVE makes waiting
# threads sleep (median 0.48 ms, p90 0.55 ms under the same load) at the cost of a futex
# wake per parallel region on an idle machine.  libgomp reads this once, when numba first
# starts its pool, so set it before the first parallel kernel call; an explicit setting wins.
# Other programs this process starts (llama.cpp in `bench compare-llamacpp`) must not
# inherit it: `OMP_WAIT_POLICY_DEFAULTED` says it was set here, not by the user.
OMP_WAIT_POLICY_DEFAULTED = "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FMT_F32 = 0
FMT_BF16 = 1
FMT_Q8_0 = 2
FMT_Q4_0 = 3

QK = 32  # weights per quantisation block
LANES = 8  # float32 partial sums per (activation row, weight row) pair
TILE_ROWS = 4  # rows per unpacked tile (micro-kernel height)
TILE_COLS = 1024  # columns per micro-kernel chunk of a tile (a multiple of 32)
ROWS_PER_ITEM = 16  # rows per parallel work item (a multiple of TILE_ROWS)

# float16 bit pattern -> float32 value, exact (subnormals, inf and nan included).
F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# ---------------------------------------------------------------------------------------------
# eight float32 lanes as one LLVM vector value

_V8F = ir.VectorType(ir.FloatType(), LANES)
_V8I8 = ir.VectorType(ir.IntType(8), LANES)
_I32 = ir.IntType(32)


class _F32x8(types.Type):
    """Eight float32 lanes, held as one LLVM ``<8 x float>`` value (a register)."""

    def __init__(self):
        super().__init__(name="F32x8")


F32X8 = _F32x8()


@register_model(_F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V8F)


def _row(ary, dtype) -> bool:
    """A C-contiguous 1-D array of `dtype` (what the vector loads and stores accept)."""
    return (
        isinstance(ary, types.Array) and ary.ndim == 1 and ary.layout == "C" and ary.dtype == dtype
    )


def _lanes_ptr(context, builder, sig, args, lane_type):
    """Pointer to args[0][args[1]] (a 1-D C array and an index), as a pointer to 8 lanes."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    return builder.bitcast(builder.gep(ary.data, [idx]), lane_type.as_pointer())


@intrinsic
def _vzero(typingctx):
    """Eight lanes of +0.0."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_V8F, [0.0] * LANES)

    return F32X8(), codegen


@intrinsic
def _vload(typingctx, ary, i):
    """ary[i : i + 8] of a float32 row."""
    if not (_row(ary, types.float32) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_lanes_ptr(context, builder, sig, args, _V8F), align=4)

    return F32X8(ary, i), codegen


@intrinsic
def _vstore(typingctx, ary, i, v):
    """ary[i : i + 8] = v for a writable float32 row."""
    if not (_row(ary, types.float32) and ary.mutable and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _lanes_ptr(context, builder, sig, args, _V8F), align=4)
        return context.get_dummy_value()

    return types.none(ary, i, F32X8), codegen


def _splat(builder, s):
    """<8 x float> of eight copies of the float32 scalar s."""
    one = builder.insert_element(ir.Constant(_V8F, ir.Undefined), s, _I32(0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, LANES), 0))


def _at(builder, data, base, offset):
    """Pointer to data[base + offset] (base an intp value, offset a Python int)."""
    return builder.gep(data, [builder.add(base, base.type(offset))])


def _floats(builder, ptr):
    """8 float32 lanes from ptr."""
    return builder.load(builder.bitcast(ptr, _V8F.as_pointer()), align=4)


def _codes(convert):
    """A group loader for 8 code bytes at ptr: convert(builder, <8 x i8>) -> <8 x float>."""

    def load(builder, ptr):
        return convert(builder, builder.load(builder.bitcast(ptr, _V8I8.as_pointer()), align=1))

    return load


def _i8(v):
    return ir.Constant(_V8I8, v)


# How one 32-column block is stored: (offset in the row, group loader) for its 4 groups of 8
# columns, in column order.  A q4_0 block pair shares 32 bytes (low nibbles: the first block,
# high nibbles: the second); the odd last q4_0 block keeps ggml's order, 16 bytes with byte j
# = q[j] | q[j + 16] << 4.  Codes come out as float32 q - 8 (q4_0) or q (q8_0), exact.
_Q4LO = _codes(lambda bld, b: bld.sitofp(bld.sub(bld.and_(b, _i8(15)), _i8(8)), _V8F))
_Q4HI = _codes(lambda bld, b: bld.sitofp(bld.sub(bld.lshr(b, _i8(4)), _i8(8)), _V8F))
_Q8 = _codes(lambda bld, b: bld.sitofp(b, _V8F))
_Q4_LOW_BLOCK = [(0, _Q4LO), (8, _Q4LO), (16, _Q4LO), (24, _Q4LO)]
_Q4_HIGH_BLOCK = [(0, _Q4HI), (8, _Q4HI), (16, _Q4HI), (24, _Q4HI)]
_Q4_TAIL_BLOCK = [(0, _Q4LO), (8, _Q4LO), (0, _Q4HI), (8, _Q4HI)]
_Q8_BLOCK = [(0, _Q8), (8, _Q8), (16, _Q8), (24, _Q8)]
_FLOAT_BLOCK = [(0, _floats), (8, _floats), (16, _floats), (24, _floats)]


def _block_kernel(dtype, layout):
    """An intrinsic running step 2 of the arithmetic (module docstring) on one block for n
    weight rows and m activation rows at once: ``(a, d, rows, i, xs, j) -> a'``.  rows is an
    n-tuple of weight rows (1-D C arrays of `dtype`) holding the block at ``rows[r][i:]`` as
    `layout` says, d their n block scales, xs an m-tuple of float32 activation rows with the
    block's activations at ``xs[u][j : j + 32]``, and a the m * n lane accumulators, pair
    (u, r) at a[u * n + r].

    This is the one place the arithmetic is written: per pair, t = e0 * x0, then
    t = t + eg * xg for g = 1, 2, 3, then a' = a + d * t, each fmul/fadd without fast-math
    flags.  The IR interleaves the pairs group by group (measured 15% faster at batch 1 than
    one row after the other) and loads each weight group once for all m activation rows;
    neither changes any pair's own sequence of operations."""

    @intrinsic
    def block(typingctx, a, d, rows, i, xs, j):
        if not (isinstance(rows, types.UniTuple) and isinstance(xs, types.UniTuple)):
            return None
        n, m = len(rows), len(xs)
        if not (
            a == types.UniTuple(F32X8, n * m)
            and d == types.UniTuple(types.float32, n)
            and _row(rows.dtype, dtype)
            and isinstance(i, types.Integer)
            and _row(xs.dtype, types.float32)
            and isinstance(j, types.Integer)
        ):
            return None

        def codegen(context, builder, sig, args):
            def data(k):  # data pointers of the tuple of arrays args[k]
                arrays = cgutils.unpack_tuple(builder, args[k], len(sig.args[k]))
                return [
                    context.make_array(sig.args[k].dtype)(context, builder, v).data for v in arrays
                ]

            acc = cgutils.unpack_tuple(builder, args[0], n * m)
            scale = cgutils.unpack_tuple(builder, args[1], n)
            wdata, xdata = data(2), data(4)
            base = context.cast(builder, args[3], sig.args[3], types.intp)
            xbase = context.cast(builder, args[5], sig.args[5], types.intp)
            t = [None] * (n * m)
            for g, (offset, load) in enumerate(layout):
                xg = [_floats(builder, _at(builder, xd, xbase, 8 * g)) for xd in xdata]
                for r in range(n):
                    e = load(builder, _at(builder, wdata[r], base, offset))
                    for u in range(m):
                        p = builder.fmul(e, xg[u])
                        k = u * n + r
                        t[k] = p if g == 0 else builder.fadd(t[k], p)
            out = [
                builder.fadd(acc[u * n + r], builder.fmul(_splat(builder, scale[r]), t[u * n + r]))
                for u in range(m)
                for r in range(n)
            ]
            return context.make_tuple(builder, sig.return_type, out)

        return a(a, d, rows, i, xs, j), codegen

    return block


def _unpack_kernel(layout):
    """An intrinsic ``(src, i, dst, j)``: the block stored at uint8 ``src[i:]`` as `layout`
    says -> its 32 codes as float32 into ``dst[j : j + 32]`` (for the batch >= 2 tiles)."""

    @intrinsic
    def unpack(typingctx, src, i, dst, j):
        if not (
            _row(src, types.uint8)
            and isinstance(i, types.Integer)
            and _row(dst, types.float32)
            and dst.mutable
            and isinstance(j, types.Integer)
        ):
            return None

        def codegen(context, builder, sig, args):
            sdata = context.make_array(sig.args[0])(context, builder, args[0]).data
            base = context.cast(builder, args[1], sig.args[1], types.intp)
            ddata = context.make_array(sig.args[2])(context, builder, args[2]).data
            dbase = context.cast(builder, args[3], sig.args[3], types.intp)
            for g, (offset, load) in enumerate(layout):
                ptr = builder.bitcast(_at(builder, ddata, dbase, 8 * g), _V8F.as_pointer())
                builder.store(load(builder, _at(builder, sdata, base, offset)), ptr, align=4)
            return context.get_dummy_value()

        return types.none(src, i, dst, j), codegen

    return unpack


_q4lo_block = _block_kernel(types.uint8, _Q4_LOW_BLOCK)
_q4hi_block = _block_kernel(types.uint8, _Q4_HIGH_BLOCK)
_q4tail_block = _block_kernel(types.uint8, _Q4_TAIL_BLOCK)
_q8_block = _block_kernel(types.uint8, _Q8_BLOCK)
_float_block = _block_kernel(types.float32, _FLOAT_BLOCK)  # rows of unpacked codes (tiles)
_q4lo_unpack = _unpack_kernel(_Q4_LOW_BLOCK)
_q4hi_unpack = _unpack_kernel(_Q4_HIGH_BLOCK)
_q4tail_unpack = _unpack_kernel(_Q4_TAIL_BLOCK)
_q8_unpack = _unpack_kernel(_Q8_BLOCK)


@intrinsic
def _vsum(typingctx, v):
    """((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): the lanes halved in a fixed order."""
    if v != F32X8:
        return None

    def half(builder, a, n):
        lo = builder.shuffle_vector(a, a, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(
            a, a, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n)))
        )
        return builder.fadd(lo, hi)

    def codegen(context, builder, sig, args):
        s2 = half(builder, half(builder, args[0], 4), 2)  # <2 x float>
        return builder.fadd(
            builder.extract_element(s2, _I32(0)), builder.extract_element(s2, _I32(1))
        )

    return types.float32(v), codegen


# ---------------------------------------------------------------------------------------------
# batch 1: four rows per pass, codes converted in registers


@njit(cache=True, nogil=True)
def _q4_dot4(w0, w1, w2, w3, s0, s1, s2, s3, lut, x):
    """Four packed Q4_0 rows (pair-interleaved nibbles; payload w, scales s) . float32 x [cols].
    (Accumulators as separate variables and a loop over pairs: measured 20% faster than a
    loop-carried tuple and a stepped range.)"""
    nb = s0.shape[0]
    a0 = a1 = a2 = a3 = _vzero()
    w = (w0, w1, w2, w3)
    xs = (x,)
    for p in range(nb // 2):  # blocks k = 2p, 2p + 1 share 32 bytes from byte o
        k = 2 * p
        o = 32 * p
        d = (lut[s0[k]], lut[s1[k]], lut[s2[k]], lut[s3[k]])
        a0, a1, a2, a3 = _q4lo_block((a0, a1, a2, a3), d, w, o, xs, 2 * o)
        d = (lut[s0[k + 1]], lut[s1[k + 1]], lut[s2[k + 1]], lut[s3[k + 1]])
        a0, a1, a2, a3 = _q4hi_block((a0, a1, a2, a3), d, w, o, xs, 2 * o + QK)
    if nb & 1:  # the odd last block, ggml order
        k = nb - 1
        d = (lut[s0[k]], lut[s1[k]], lut[s2[k]], lut[s3[k]])
        a0, a1, a2, a3 = _q4tail_block((a0, a1, a2, a3), d, w, 16 * k, xs, 32 * k)
    return _vsum(a0), _vsum(a1), _vsum(a2), _vsum(a3)


@njit(cache=True, nogil=True)
def _q8_dot4(w0, w1, w2, w3, s0, s1, s2, s3, lut, x):
    """Four packed Q8_0 rows (payload w, scales s) . float32 x [cols]."""
    a0 = a1 = a2 = a3 = _vzero()
    w = (w0, w1, w2, w3)
    xs = (x,)
    for k in range(s0.shape[0]):  # block k: bytes and columns 32k .. 32k + 31
        d = (lut[s0[k]], lut[s1[k]], lut[s2[k]], lut[s3[k]])
        a0, a1, a2, a3 = _q8_block((a0, a1, a2, a3), d, w, 32 * k, xs, 32 * k)
    return _vsum(a0), _vsum(a1), _vsum(a2), _vsum(a3)


@njit(cache=True, nogil=True)
def _b1_rows(fmt, wq, ws, lut, x, out, r0, r1):
    """out[0, r0:r1] for batch 1 (q4_0/q8_0): four rows per pass (measured 7% faster than two
    in cache, 3% from DRAM).  A last group of fewer than four rows repeats its last row in the
    missing places (every row has lanes of its own, so that changes no result)."""
    xrow = x[0]
    for r in range(r0, r1, 4):
        ra, rb, rc = min(r + 1, r1 - 1), min(r + 2, r1 - 1), min(r + 3, r1 - 1)
        if fmt == FMT_Q4_0:
            y = _q4_dot4(wq[r], wq[ra], wq[rb], wq[rc], ws[r], ws[ra], ws[rb], ws[rc], lut, xrow)
        else:
            y = _q8_dot4(wq[r], wq[ra], wq[rb], wq[rc], ws[r], ws[ra], ws[rb], ws[rc], lut, xrow)
        for i in range(min(4, r1 - r)):
            out[0, r + i] = y[i]
