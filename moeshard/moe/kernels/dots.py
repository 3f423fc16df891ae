"""Numba kernels: shared constants, the 8-lane vector primitives, and the arithmetic of the
q4_0/q8_0 rows for float32 activations.

`moeshard.moe.kernels.entry` holds the entry points called from Python (and the byte layout of the
``wq``/``ws`` views these helpers receive); `moeshard.moe.kernels.tiles` holds the tiles that
compute this arithmetic, for every batch size.
This module also sets OMP_WAIT_POLICY (below), so it must be imported before any parallel
kernel runs; `entry` and `tiles` import it first.  (With 8-bit activations, the default,
q4_0/q8_0 go through `moeshard.moe.kernels.idots` instead, which defines its own arithmetic.)

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

Scaling once per block (step 2) rather than each weight saves a multiply per weight.  Step 2 is
written once, in `_block_kernel`; the tiles in `moeshard.moe.kernels.tiles` call the intrinsic it
generates on codes unpacked to float32.

Nothing here depends on how many rows share the call or on how LLVM would vectorise a sum,
because none of these kernels has a fast-math flag: LLVM must keep IEEE semantics, so it may
neither reassociate the sums nor contract a multiply and an add into an FMA, and the result is
the same on AVX2, AVX-512, baseline x86-64 or any other IEEE machine (and in numpy:
tests/test_kernel_determinism.py emulates it bit for bit).  Without reassociation LLVM's loop
vectoriser will not split a float sum into lanes (and numba runs no SLP vectoriser), so the
lanes are written out: `F32X8` is an LLVM ``<8 x float>`` value (a ymm register on AVX2, two
xmm on baseline x86-64) handled through the small intrinsics below.

Notes for whoever edits these loops (here and in `moeshard.moe.kernels.tiles`):

* Keep fast-math flags off every q4_0/q8_0 kernel and helper: one ``contract`` or
  ``reassoc`` lets the compiler change the rounding again (per CPU and per call site).
* The vector intrinsics read and write 8 (or a block's 32) consecutive elements from the
  given index with no bounds check; callers keep offsets inside the row.  They accept only
  C-contiguous 1-D arrays (a row of a C-contiguous 2-D array, or a slice of one, is).
* Every path must follow step 2 exactly: blocks in order, and within a block the four groups
  of 8 columns in order.
* numba's cache (``cache=True``) checks only each function's own file, yet compiles in the
  helpers and constants it imports: after editing this module or `tiles`, the cached kernels
  of `tiles` and `entry` would still hold the old code.  `numba_cache` keeps the cache in a
  directory of the sources' version, so any edit starts a fresh one.
"""

import functools
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
FMT_MXFP4 = 4
FMT_Q4_K = 5  # K-quants: integer kernels only (`idots`), 8-bit activations in either mode
FMT_Q6_K = 6
FMT_IQ4_NL = 7
FMT_IQ4_XS = 8
FMT_Q5_K = 9
FMT_Q4_1 = 10
FMT_Q5_0 = 11
FMT_Q5_1 = 12  # (format codes stay below 16: `entry._halves`)
# IQ4_NL and IQ4_XS: the int8 value of each 4-bit code (ggml's kvalues_iq4nl)
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)

QK = 32  # weights per quantisation block
LANES = 8  # float32 partial sums per (activation row, weight row) pair
TILE_ROWS = 4  # rows per unpacked tile (micro-kernel height)
TILE_COLS = 1024  # columns per micro-kernel chunk of a tile (a multiple of 32)
ROW_GROUP = 8  # q4_0/q8_0 rows interleaved in the packed layout (`moeshard.moe.kernels.quant`)
ROWS_PER_ITEM = 16  # rows per parallel work item (a multiple of TILE_ROWS and ROW_GROUP)
# bf16 rows interleaved in fours, sixteen columns (32 bytes) at a time (`layout`, `fdots`)
BF16_GROUP, BF16_PIECE = 4, 16

# MXFP4: the E2M1 value of each 4-bit code, doubled (exact small integers; ggml's kvalues),
# and the E8M0 block scale halved to match (`e8m0_half`).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


@njit(cache=True, nogil=True)
def e8m0_half(e):
    """An MXFP4 block's E8M0 scale byte -> half its value, 2^(e - 128), as float32 (exact; the
    two smallest as subnormals, 255 as 2^127, as ggml's ggml_e8m0_to_fp32_half does)."""
    x = np.uint32(e)
    bits = np.uint32(0x00200000) << x if x < 2 else (x - np.uint32(1)) << np.uint32(23)
    return np.uint32(bits).view(np.float32)


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


_float_block = _block_kernel(types.float32, _FLOAT_BLOCK)  # rows of unpacked codes (tiles)


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


@intrinsic
def _pause(typingctx):
    """x86's `pause`: the instruction libgomp's spinning threads repeat (its cpu_relax)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@njit(cache=True, nogil=True)
def _pauses(n):
    for _ in range(n):
        _pause()


@functools.cache
def pause_seconds() -> float:
    """Seconds one `pause` takes on this CPU (median of 5 runs of 20,000): 10 to 140 cycles
    depending on the core, so a spin count means a different time on every machine."""
    import platform
    import time

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 1e-8  # libgomp's cpu_relax elsewhere is a plain barrier: about this
    n, times = 20_000, []
    _pauses(10)
    for _ in range(5):
        t0 = time.perf_counter()
        _pauses(n)
        times.append(time.perf_counter() - t0)
    return sorted(times)[2] / n


def prefetch_line(builder, ptr, into_l1: bool = False):
    """A hint to bring the cache line at i8* `ptr` into L2 (`llvm.prefetch`: read, locality
    2, i.e. prefetcht1 on x86): no value changes, and an address past the end cannot fault.
    From DRAM one core keeps too few reads in flight on its own. Measured on a 2-vCPU Xeon
    (SPR class), a bf16 1024 x 1024 product at batch 1 from a 960 MiB pool, two threads: 17.6
    GB/s without, 22.5-23 prefetching the next row group into L1 (prefetcht0), 22.5-24 into
    L2, 11 non-temporal (DRAM summing: 31); four q4_0 experts 20 -> 22. A group further
    ahead was slower for the experts (21).

    `into_l1` asks for L1 too (locality 3, prefetcht0): the integer kernels' next block, on
    a 2-vCPU AMD EPYC (Zen 4), four q4_0 experts at batch 1 from a 256 MiB pool, one thread:
    21 -> 25 GB/s (DRAM summing: 35); the 706 MB model's decode faster in 6 of 7 alternated
    processes (median +3.6%). The bf16 products there fell from 20 to 12 GB/s with it, so
    they keep L2."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
    )
    builder.call(fn, [ptr, i32(0), i32(3 if into_l1 else 2), i32(1)])


@intrinsic
def _prefetch_byte(typingctx, ary, i):
    """`prefetch_line` of byte i of a C-contiguous array's data (any dtype, any rank)."""
    if not (isinstance(ary, types.Array) and ary.layout == "C" and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8p = builder.bitcast(data, ir.IntType(8).as_pointer())
        index = context.cast(builder, args[1], sig.args[1], types.intp)
        prefetch_line(builder, builder.gep(i8p, [index]))
        return context.get_dummy_value()

    return types.none(ary, i), codegen


@njit(cache=True, nogil=True)
def prefetch_span(ary, begin, end):
    """Ask for bytes begin..end of a C-contiguous array's data (clipped to the array) in
    cache, a line at a time, and return at once: for data a kernel will read soon, asked for
    while the bus is busy with other reads, so a phase that would wait on memory (a decode
    layer's attention and router: `model.fused_layer.decode_layers`) finds it near.
    Changes no value."""
    for i in range(max(begin, 0), min(end, ary.nbytes), 64):
        _prefetch_byte(ary, i)
