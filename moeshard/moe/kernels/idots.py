"""Integer q4_0/q8_0/mxfp4/q4_K/q6_K dot products: activations quantised to 8 bits per block,
as llama.cpp does.

For one activation row x and one weight row (codes q, block scales dw; ``e = q - 8`` for
q4_0, ``e = q`` for q8_0, twice the E2M1 value for mxfp4, whose dw is then half the E8M0
scale, as in ggml), the arithmetic, identical on every CPU, batch size and thread
split (tests/test_kernel_determinism.py emulates it in numpy bit for bit):

1. x is quantised per 32-column block k (`quantize_activations`): ``amax = max |x_c|``,
   ``dx_k = amax / 127`` and ``xq_c = rint(x_c * (1 / dx_k))`` (round half to even, always
   within -127..127), all float32; a block whose dx_k rounds to 0 (all zero, or amax below 127
   x 2^-149) gets ``dx_k = 0`` and zero codes, a block holding a nan or an inf gets
   ``dx_k = nan`` (its row's outputs become nan).
2. per block k, the 32 products summed exactly as integers: ``t_k = sum e_c xq_c``;
3. ``a = fma(dw_k * dx_k, float(t_k), a)`` from ``a = +0``: the scales' product rounded to
   float32, then one fused multiply-add (IEEE, one rounding: `llvm.fma`, the C library's fmaf
   where the CPU has no FMA instruction), blocks in increasing k; no fast-math flags
   anywhere; ``y = a``.

The weights come in groups of eight rows whose blocks are interleaved
(`moeshard.moe.kernels.quant`):
one 32-byte load holds the same four columns of the eight rows, so with those four activation
codes broadcast to all eight places, each 32-bit lane r of the integer products belongs to
row r.  A block's sums of the eight rows then end in the eight lanes of one register, and
step 3 runs once per block for all eight: one conversion, the eight scales as one 16-byte
load (float16 to float32, exact), one FMA, where a row at a time needed a conversion, a
broadcast scale and an FMA per row and a sum across lanes at the end (measured 1.5-2x faster;
llama.cpp repacks Q4_0 into the same kind of groups for the same reason).

Step 2 is where the time goes and is exact, so the CPU may do it any way it likes:

* x86 with AVX2: ``vpmaddubsw`` (unsigned byte x signed byte, pairs summed to 16 bits) then
  ``vpmaddwd`` by ones (pairs summed to 32 bits).  q4_0 codes are unsigned 0..15, so the -8
  is taken out afterwards with ``8 * sum xq`` of the block (computed once per activation row,
  `xc`), and the eight 16-bit results of a block are added before the one ``vpmaddwd``: each
  is at most 2 * 15 * 127, eight of them fit in 16 bits.  q8_0 codes are signed, so the sign
  moves onto the activations (``|e| * sign(e) xq``, llama.cpp's trick) and each load gets its
  own ``vpmaddwd`` (2 * 128 * 127 fits in 16 bits once, not twice).
  mxfp4 codes are looked up with ``vpshufb`` as value + 12 (unsigned 0..24; 12 * sum xq
  comes off afterwards), four 16-bit results added before each of two ``vpmaddwd``.
* anywhere else: plain LLVM vector integer code (widen, multiply, add groups of four), which
  gives the same integers.

LLVM does not emit ``vpmaddubsw`` from a plain loop, so the AVX2 form is written as calls to
LLVM's x86 intrinsics inside numba ``@intrinsic`` code generators.  Which form is compiled is
decided at import from the CPU numba compiles for (`ISA`; ``MOESHARD_KERNEL_ISA=avx2`` or
``generic`` forces a slower one, for tests and benches, with a numba cache of its own).
numba's on-disk cache is keyed by the CPU's name and features, so a cache built on one CPU is
never loaded on another.

* x86 with AVX-VNNI or AVX512-VNNI (+VL), the "vnni" form: ``vpdpbusd`` does both steps of
  the AVX2 form in one instruction and adds into 32-bit lanes without saturating, so every
  load of a block accumulates into one register (q8_0's codes in as q + 128 with 16 xc
  taken off after the block, which vpmaddubsw's saturation rules out on AVX2; mxfp4 looked
  up as value + 12).  The same integers; measured on a Xeon (Sapphire Rapids class) a q4_0
  768x1024 product in cache took 16.3 against 17.1 us: the loads, nibble masks and
  broadcasts around it are most of the work at batch 1.

ggml's K-quants, kept as GGUF files hold them (`layout`: q4_K, q6_K; integer kernels only,
so they take 8-bit activations in either activation mode) use the same 32-column activation
blocks (llama.cpp's own K-quant products take one activation scale per 256 columns):

* q4_K, value ``d sc_s q - dmin m_s`` per 32-column sub-block s, q unsigned 0..15 (loaded as
  q4_0's codes): with ``t = sum q xq`` and ``s = sum xq`` (``xc``), ``a = fma((d sc_s) dx, t,
  a)`` then ``a = fma((-(dmin m_s)) dx, s, a)``; ``d sc_s`` and ``dmin m_s`` are exact in
  float32 (an 11-bit significand by a 6-bit integer).
* q6_K, value ``d sc_j (q - 32)`` per 16 columns j, q unsigned 0..63 (low nibbles loaded as
  q4_0's, high bit pairs from two more loads): per half of a block, ``t = sum (q - 32) xq``
  exactly (the halves' ``sum xq`` are in ``xc``), ``a = fma((d sc_j) dx, t, a)``, the first
  half then the second.

Step 1 is shared with llama.cpp's q8_0 activations; steps 2-3 are an exact integer block sum
and one float32 accumulator per row, which need no particular instruction order.

Against the float path of `moeshard.moe.kernels.dots` this trades exact float32 activations for
8-bit ones (``moeshard quality`` prints what that costs) and does a quarter of the float work.
"""

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from moeshard.moe.kernels.build import target_features
from moeshard.moe.kernels.dots import (
    F32X8,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_MXFP4,
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q5_1,
    FMT_Q5_K,
    FMT_Q6_K,
    IQ4_VALUES,
    LANES,
    MXFP4_VALUES,
    QK,
    ROW_GROUP,
    _splat,
    _vstore,
    _vzero,
    prefetch_line,
)

ISAS = ("vnni", "avx2", "generic")  # the forms of step 2, fastest first


def _supported_isas(features: set[str]) -> list[str]:
    """The forms of step 2 a CPU with `features` runs: "vnni" wants `vpdpbusd` on 256-bit
    registers (AVX-VNNI, or AVX512-VNNI with AVX512VL: the same LLVM intrinsic either way)."""
    out = []
    if "+avx2" in features:
        vnni = "+avxvnni" in features or {"+avx512vnni", "+avx512vl"} <= features
        out += ["vnni"] if vnni else []
        out.append("avx2")
    return out + ["generic"]


def _target_isa() -> str:
    """The fastest form of step 2 the CPU numba compiles for runs (`ISAS`), or the one
    MOESHARD_KERNEL_ISA names (for tests and benches: `bench compare-llamacpp --isa avx2`)."""
    supported = _supported_isas(target_features())
    forced = os.environ.get("MOESHARD_KERNEL_ISA", "")
    if forced:
        if forced not in ISAS:
            raise ValueError(f"MOESHARD_KERNEL_ISA={forced!r}: expected one of {', '.join(ISAS)}")
        if forced not in supported:
            raise ValueError(
                f"MOESHARD_KERNEL_ISA={forced!r}: this CPU runs only {', '.join(supported)}"
            )
        return forced
    return supported[0]


ISA = _target_isa()
if ISA != _supported_isas(target_features())[0]:
    # numba's cache is keyed by the CPU, not by this choice: kernels compiled with the forced
    # form (here and in the modules importing this one, decorated after this line) keep to a
    # cache of their own, or the CPU's usual build would be loaded in their place
    config.CACHE_DIR = os.path.join(
        config.CACHE_DIR or os.path.expanduser("~/.cache/moeshard"), f"numba-isa-{ISA}"
    )
# float16 scales with vcvtph2ps, or integer operations where the CPU has no F16C (`_f16_lanes`)
F16C = "+f16c" in target_features()

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32I8 = ir.VectorType(_I8, 32)
_V16I8 = ir.VectorType(_I8, 16)
_V16I16 = ir.VectorType(_I16, 16)
_V8I32 = ir.VectorType(_I32, LANES)
_V32I32 = ir.VectorType(_I32, 32)
_V8F = ir.VectorType(ir.FloatType(), LANES)
_V8H = ir.VectorType(ir.HalfType(), LANES)


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
AHEAD = 1  # row groups between the one read and the one prefetched (2 and 3: slower)


@njit(cache=True, nogil=True)
def _mat(a):
    """(address, row stride in bytes) of a 2-D C-contiguous array."""
    return np.intp(a.ctypes.data), np.intp(a.strides[0])


def _at(context, builder, mat, row, offset):
    """i8* to byte `offset` of row `row` of a `_mat` pair (row and offset intp values)."""
    base, stride = cgutils.unpack_tuple(builder, mat, 2)
    address = builder.add(base, builder.add(builder.mul(row, stride), offset))
    return builder.inttoptr(address, _I8.as_pointer())


def _load(builder, ptr, vtype):
    return builder.load(builder.bitcast(ptr, vtype.as_pointer()), align=1)


def _splat_i32(builder, v):
    """<8 x i32> of eight copies of the i32 value v."""
    one = builder.insert_element(ir.Constant(_V8I32, ir.Undefined), v, _I32(0))
    return builder.shuffle_vector(one, one, ir.Constant(_V8I32, [0] * LANES))


def _broadcast4(builder, ptr):
    """The 4 activation codes at ptr, repeated for each of the 8 rows: <32 x i8> (one
    vpbroadcastd from memory on AVX2)."""
    four = builder.load(builder.bitcast(ptr, _I32.as_pointer()), align=1)
    return builder.bitcast(_splat_i32(builder, four), _V32I8)


# ---------------------------------------------------------------------------------------------
# step 2 for one 32-byte load: per row r (bytes 4r..4r+3), the sum of its four products


def _dot_avx2(builder, w, x, signed):
    """<8 x i32>, lane r: sum of the products of bytes 4r..4r+3 (vpmaddubsw, vpmaddwd)."""
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, _madd_avx2(builder, w, x, signed),
                 ir.Constant(_V16I16, [1] * 16))  # fmt: skip


def _madd_avx2(builder, w, x, signed):
    """<16 x i16>, lane j: the products of bytes 2j and 2j + 1, summed (exact: below 2^15)."""
    if signed:  # |w| * (x * sign(w)): maddubs wants its first operand unsigned
        zero = ir.Constant(_V32I8, [0] * 32)
        neg = builder.icmp_signed("<", w, zero)
        w_abs = builder.select(neg, builder.sub(zero, w), w)
        x = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, x, w)
        w = w_abs
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, w, x)


def _dot_generic(builder, w, x, signed):
    wide = builder.sext(w, _V32I32) if signed else builder.zext(w, _V32I32)
    p = builder.mul(wide, builder.sext(x, _V32I32))  # <32 x i32>
    s = None
    for g in range(4):  # lane r: products 4r .. 4r + 3
        part = builder.shuffle_vector(p, p, _indices(range(g, 32, 4)))
        s = part if s is None else builder.add(s, part)
    return s


def _dpbusd(builder, acc, w, x):
    """acc + (lane r: the four products of unsigned bytes 4r..4r+3 of w and signed ones of
    x), exact in 32 bits (vpdpbusd, no saturation): `_dot_avx2`'s integers in one
    instruction, added to the lane sums so far."""
    return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I32, acc,
                 builder.bitcast(w, _V8I32), builder.bitcast(x, _V8I32))  # fmt: skip


def _dot_vnni(builder, w, x, signed):
    if signed:  # |w| * (x * sign(w)), as for vpmaddubsw
        zero = ir.Constant(_V32I8, [0] * 32)
        neg = builder.icmp_signed("<", w, zero)
        x = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, x, w)
        w = builder.select(neg, builder.sub(zero, w), w)
    return _dpbusd(builder, ir.Constant(_V8I32, [0] * LANES), w, x)


def _dpbusd_all(builder, parts, xs, u):
    """Sum over (unsigned codes w, column col) of w . activation row u's codes at col."""
    acc = ir.Constant(_V8I32, [0] * LANES)
    for w, col in parts:
        acc = _dpbusd(builder, acc, w, xs(u, col))
    return acc


_DOT = {"vnni": _dot_vnni, "avx2": _dot_avx2, "generic": _dot_generic}[ISA]
# q4_0's and mxfp4's codes go in unsigned (an offset taken off after the block): the x86 forms
UNSIGNED_CODES = ISA in ("vnni", "avx2")
# q8_0's codes go in as q + 128 where vpdpbusd adds without saturating (vpmaddubsw would
# saturate 2 * 255 * 127); 128 sum xq = 16 xc comes off after the block
Q8_OFFSET = ISA == "vnni"


def _q4_sums(builder, loads, xs):
    """Block sums of the 8 rows of a q4_0 row group, sum q xq (without the -8), for each
    activation row: loads are the block's four 32-byte loads, xs(u, col) the broadcast codes
    of activation row u at column col of the block."""
    parts = []
    for c, w in enumerate(loads):
        parts.append((builder.and_(w, ir.Constant(_V32I8, [15] * 32)), 4 * c))  # columns 4c..
        parts.append((builder.lshr(w, ir.Constant(_V32I8, [4] * 32)), 16 + 4 * c))  # 16 + 4c..
    if ISA == "vnni":
        return [_dpbusd_all(builder, parts, xs, u) for u in range(xs.m)]
    out = []
    for u in range(xs.m):
        if ISA == "avx2":  # eight maddubs sums of at most 2 * 15 * 127 each: exact in 16 bits
            h = None
            for w, col in parts:
                p = _madd_avx2(builder, w, xs(u, col), signed=False)  # <16 x i16>
                h = p if h is None else builder.add(h, p)
            ones = ir.Constant(_V16I16, [1] * 16)
            out.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, h, ones))
        else:
            t = [_dot_generic(builder, w, xs(u, col), signed=False) for w, col in parts]
            out.append(_add_all(builder, t))
    return out


def _mx_values(builder, codes):
    """4-bit E2M1 codes (<32 x i8>, 0..15) -> their doubled values, int8 -12..12 (portable)."""

    def c(v):
        return ir.Constant(_V32I8, [v] * 32)

    mag = builder.and_(codes, c(7))  # 0..7 -> 0, 1, 2, 3, 4, 6, 8, 12
    e, f = builder.lshr(mag, c(1)), builder.and_(mag, c(1))
    small = builder.icmp_unsigned("==", e, c(0))
    shift = builder.select(small, c(0), builder.sub(e, c(1)))
    v = builder.select(small, f, builder.shl(builder.add(f, c(2)), shift))
    negative = builder.icmp_unsigned("!=", builder.and_(codes, c(8)), c(0))
    return builder.select(negative, builder.sub(c(0), v), v)


_MX_OFFSET = 12  # AVX2: codes looked up as value + 12 (0..24, unsigned), taken out after
_MX_TABLE_UNSIGNED = ir.Constant(_V32I8, [int(v) + _MX_OFFSET for v in MXFP4_VALUES] * 2)


def _mx_sums(builder, loads, xs):
    """`_q4_sums` for mxfp4: the same nibble order.  On AVX2 the codes are looked up
    (vpshufb, shared by every activation row) as value + 12, unsigned, so `vpmaddubsw` takes
    them without a sign trick; four of its 16-bit results (each at most 2 * 24 * 127) add up
    exactly, then `vpmaddwd`, and 12 * sum xq comes off in the caller (`_MX_OFFSET`).
    Elsewhere the signed values, and nothing to take off."""
    parts = []
    for c, w in enumerate(loads):
        lo = builder.and_(w, ir.Constant(_V32I8, [15] * 32))
        hi = builder.lshr(w, ir.Constant(_V32I8, [4] * 32))
        parts += [(lo, 4 * c), (hi, 16 + 4 * c)]
    if not UNSIGNED_CODES:
        vals = [(_mx_values(builder, w), col) for w, col in parts]
        return [
            _add_all(builder, [_dot_generic(builder, w, xs(u, col), True) for w, col in vals])
            for u in range(xs.m)
        ]
    table = _MX_TABLE_UNSIGNED
    vals = [(_call(builder, "llvm.x86.avx2.pshuf.b", _V32I8, table, w), col) for w, col in parts]
    if ISA == "vnni":
        return [_dpbusd_all(builder, vals, xs, u) for u in range(xs.m)]
    ones = ir.Constant(_V16I16, [1] * 16)
    out = []
    for u in range(xs.m):
        halves = []
        for half in (vals[:4], vals[4:]):
            h = None
            for w, col in half:
                p = _madd_avx2(builder, w, xs(u, col), signed=False)  # <16 x i16>
                h = p if h is None else builder.add(h, p)
            halves.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, h, ones))
        out.append(builder.add(*halves))
    return out


def _f16_lanes(builder, ptr):
    """Eight float16 scales at ptr -> <8 x float>, exact.  With F16C, LLVM's fpext
    (vcvtph2ps); without, LLVM would call compiler-rt's __extendhfsf2, which numba cannot link
    (compiling the kernels for such a CPU aborted), so integer operations give the same bits:
    finite values as the integer significand m times 2^(e - 25) (both exact in float32), inf
    and nan from their bits (nan quieted, as vcvtph2ps does), then the sign."""
    if F16C:
        return builder.fpext(_load(builder, ptr, _V8H), _V8F)
    h = builder.zext(_load(builder, ptr, ir.VectorType(ir.IntType(16), LANES)), _V8I32)

    def c(v):
        return ir.Constant(_V8I32, [v] * LANES)

    e, mant = builder.and_(builder.lshr(h, c(10)), c(0x1F)), builder.and_(h, c(0x3FF))
    normal = builder.icmp_unsigned("!=", e, c(0))
    m = builder.select(normal, builder.or_(mant, c(0x400)), mant)
    scale = builder.shl(builder.add(builder.select(normal, e, c(1)), c(127 - 25)), c(23))
    finite = builder.fmul(builder.sitofp(m, _V8F), builder.bitcast(scale, _V8F))
    special = builder.or_(c(0x7F800000), builder.shl(mant, c(13)))  # inf, or nan's payload
    quiet = builder.icmp_unsigned("!=", mant, c(0))
    special = builder.select(quiet, builder.or_(special, c(0x00400000)), special)
    bits = builder.select(
        builder.icmp_unsigned("==", e, c(0x1F)), special, builder.bitcast(finite, _V8I32)
    )
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(bits, sign), _V8F)


def _e8m0_half_lanes(builder, ptr):
    """Eight E8M0 scale bytes at ptr -> <8 x float> of 2^(e - 128) (`dots.e8m0_half`)."""
    e = builder.zext(_load(builder, ptr, ir.VectorType(_I8, LANES)), _V8I32)

    def c(v):
        return ir.Constant(_V8I32, [v] * LANES)

    small = builder.icmp_unsigned("<", e, c(2))
    bits = builder.select(
        small, builder.shl(c(0x00200000), e), builder.shl(builder.sub(e, c(1)), c(23))
    )
    return builder.bitcast(bits, _V8F)


def _q8_sums(builder, loads, xs):
    """`_q4_sums` for q8_0: eight loads, signed codes, columns 4c..4c+3 in load c.  With
    VNNI the codes go in unsigned, as q + 128 (one XOR of the sign bit per load, shared by
    every activation row), and 128 sum xq comes off after the block (`Q8_OFFSET`): one
    vpdpbusd per load and row, where moving the signs onto the activations took three."""
    if Q8_OFFSET:
        flip = ir.Constant(_V32I8, [-128] * 32)
        parts = [(builder.xor(w, flip), 4 * c) for c, w in enumerate(loads)]
        return [_dpbusd_all(builder, parts, xs, u) for u in range(xs.m)]
    return [
        _add_all(builder, [_DOT(builder, w, xs(u, 4 * c), True) for c, w in enumerate(loads)])
        for u in range(xs.m)
    ]


def _add_all(builder, vs):
    total = vs[0]
    for v in vs[1:]:
        total = builder.add(total, v)
    return total


class _Broadcasts:
    """xs(u, col): activation row u's codes at column `col` of the current block, broadcast."""

    def __init__(self, context, builder, mat, rows, col0):
        self.context, self.builder, self.mat, self.rows, self.col0 = (
            context, builder, mat, rows, col0,
        )  # fmt: skip
        self.m = len(rows)

    def __call__(self, u, col):
        offset = self.builder.add(self.col0, ir.Constant(self.col0.type, col))
        return _broadcast4(
            self.builder, _at(self.context, self.builder, self.mat, self.rows[u], offset)
        )


def _group_block_kernel(kind: str):
    """An intrinsic running steps 2-3 on block k of one row group for m activation rows
    (kind "q4_0", "q8_0" or "mxfp4"): ``(a, wq, g, k, ws, xq, us, xd, xc) -> a'``.  wq uint8
    [groups, group bytes] and ws [groups, ...] (the scales: eight float16 or E8M0 per block)
    are the packed matrix (`_mat` pairs, as xq, xd and xc), g the group; xq int8 [b, cols]
    holds the activation codes, rows `us` (an m-tuple), xd float32 [b, nb] their block
    scales and xc int32 [b, nb] 8 * their block sums (q4_0, and mxfp4 on AVX2); a is the m lane
    accumulators, lane r of a[u] for (activation row us[u], weight row 8g + r)."""
    n_loads = {"q8_0": 8, "q6_K": 6, "q5_K": 5, "q5_0": 5, "q5_1": 5}.get(kind, 4)  # per block
    sums_of = {
        "q4_0": _q4_sums,
        "q8_0": _q8_sums,
        "mxfp4": _mx_sums,
        "q4_K": _q4_sums,
        "q6_K": _q6_sums,
        "q5_K": _q5_sums,
        "iq4_nl": _iq4_sums,
        "iq4_xs": _iq4_sums,
        "q4_1": _q4_sums,
        "q5_0": _q5_sums,
        "q5_1": _q5_sums,
    }[kind]
    scale_bytes = {"mxfp4": 1, "q4_1": 4, "q5_1": 4}.get(kind, 2)  # per row and block
    # bytes per super-block and group of the formats with 256-column super-blocks
    super_scales = {"q4_K": 160, "q5_K": 160, "q6_K": 144, "iq4_xs": 80}.get(kind, 0)

    @intrinsic
    def block(typingctx, a, wq, g, k, ws, xq, us, xd, xc):
        if not isinstance(us, types.UniTuple):
            return None
        m = len(us)
        if not (
            a == types.UniTuple(F32X8, m)
            and wq == ws == xq == xd == xc == _MAT
            and all(isinstance(v, types.Integer) for v in (g, k, us.dtype))
        ):
            return None

        def codegen(context, builder, sig, args):
            def intp(value, ty):
                return context.cast(builder, value, ty, types.intp)

            def const(v):
                return ir.Constant(gi.type, v)

            acc = cgutils.unpack_tuple(builder, args[0], m)
            gi, ki = intp(args[2], g), intp(args[3], k)
            rows = [intp(v, us.dtype) for v in cgutils.unpack_tuple(builder, args[6], m)]
            wbase = builder.mul(ki, const(32 * n_loads))
            group = _at(context, builder, args[1], gi, wbase)  # i8* to the block's bytes
            loads = [
                _load(builder, builder.gep(group, [_I32(32 * c)]), _V32I8) for c in range(n_loads)
            ]
            if m <= 2:  # a decode's rows: the next group's block is read ahead, into L1
                nxt = _at(context, builder, args[1], builder.add(gi, const(AHEAD)), wbase)
                for line in range(0, 32 * n_loads, 64):
                    prefetch_line(builder, builder.gep(nxt, [_I32(line)]), into_l1=True)
                if super_scales:  # the super-block's 160 or 144 bytes: a line each at s = 0..2
                    sub = builder.and_(ki, const(7))
                    line = builder.select(builder.icmp_unsigned("<", sub, const(2)), sub, const(2))
                    first = builder.mul(builder.lshr(ki, const(3)), const(super_scales))
                    s_off = builder.add(first, builder.mul(line, const(64)))
                else:
                    s_off = builder.mul(ki, const(8 * scale_bytes))
                nxt_scales = builder.add(gi, const(AHEAD)), s_off
                prefetch_line(builder, _at(context, builder, args[4], *nxt_scales), into_l1=True)
            xs = _Broadcasts(context, builder, args[5], rows, builder.mul(ki, const(QK)))
            sums = sums_of(builder, loads, xs)  # m x <8 x i32>, exact
            if kind in ("q4_1", "q5_0", "q5_1"):
                out = _legacy_scale(kind, context, builder, args, ki, gi, rows, sums, acc)
                return context.make_tuple(builder, sig.return_type, out)
            if kind in ("q4_K", "q5_K", "q6_K", "iq4_xs"):
                scale = {
                    "q4_K": _q4k_scale,
                    "q5_K": _q4k_scale,  # (the same scales and arithmetic, q up to 31)
                    "q6_K": _q6k_scale,
                    "iq4_xs": _iq4xs_scale,
                }[kind]
                out = scale(context, builder, args, ki, gi, rows, sums, acc)
                return context.make_tuple(builder, sig.return_type, out)
            scale_ptr = _at(context, builder, args[4], gi, builder.mul(ki, const(8 * scale_bytes)))
            if kind == "mxfp4":
                dw = _e8m0_half_lanes(builder, scale_ptr)  # exact
            else:
                dw = _f16_lanes(builder, scale_ptr)  # exact
            k4 = builder.mul(ki, const(4))
            out = []
            for u in range(m):
                t = sums[u]
                if (
                    kind == "q4_0"
                    or (kind == "mxfp4" and UNSIGNED_CODES)
                    or (kind in ("q8_0", "iq4_nl") and Q8_OFFSET)
                ):
                    # q4_0: sum (q - 8) xq = sum q xq - 8 sum xq (xc holds 8 sum xq);
                    # mxfp4 on AVX2: sum (v + 12) xq - 12 sum xq;
                    # q8_0 with VNNI: sum (q + 128) xq - 128 sum xq; iq4_nl with VNNI:
                    # sum (v + 128) xq - 128 sum xq
                    k8 = builder.mul(ki, const(8))  # xc[u, 2k]: 8 sum xq
                    corr = _load(builder, _at(context, builder, args[8], rows[u], k8), _I32)
                    if kind == "mxfp4":
                        corr = builder.add(corr, builder.ashr(corr, _I32(1)))  # 12 sum xq
                    elif kind in ("q8_0", "iq4_nl"):
                        corr = builder.shl(corr, _I32(4))  # 128 sum xq
                    t = builder.sub(t, _splat_i32(builder, corr))
                dx = _load(builder, _at(context, builder, args[7], rows[u], k4), ir.FloatType())
                d = builder.fmul(dw, _splat(builder, dx))  # dw_r * dx, rounded to float32
                tf = builder.sitofp(t, _V8F)  # exact: |t| < 2^24
                out.append(_call(builder, "llvm.fma.v8f32", _V8F, d, tf, acc[u]))
            return context.make_tuple(builder, sig.return_type, out)

        return a(a, wq, g, k, ws, xq, us, xd, xc), codegen

    return block


def _q4k_scale(context, builder, args, ki, gi, rows, sums, acc):
    """Step 3 for q4_K's sub-block k (`_q4k_doc`): from the sums of q xq (q unsigned, 0..15),
    per activation row u: a = fma((d sc) dx, t, a), then a = fma((-(dmin m)) dx, s, a) with
    s = sum xq of the block; d sc and dmin m are exact in float32 (11 by 6 bits)."""
    ws, xd, xc = args[4], args[7], args[8]

    def const(v):
        return ir.Constant(ki.type, v)

    base = builder.mul(builder.lshr(ki, const(3)), const(160))  # the super-block's scales
    sub8 = builder.mul(builder.and_(ki, const(7)), const(8))

    def u8_lanes(offset):
        ptr = _at(context, builder, ws, gi, builder.add(base, offset))
        return builder.uitofp(_load(builder, ptr, ir.VectorType(_I8, LANES)), _V8F)

    d = _f16_lanes(builder, _at(context, builder, ws, gi, base))
    dmin = _f16_lanes(builder, _at(context, builder, ws, gi, builder.add(base, const(16))))
    ds = builder.fmul(d, u8_lanes(builder.add(sub8, const(32))))  # exact
    dm = builder.fmul(dmin, u8_lanes(builder.add(sub8, const(96))))  # exact
    k4, k8 = builder.mul(ki, const(4)), builder.mul(ki, const(8))
    out = []
    for u, row in enumerate(rows):
        dx = _splat(builder, _load(builder, _at(context, builder, xd, row, k4), ir.FloatType()))
        total = builder.ashr(_load(builder, _at(context, builder, xc, row, k8), _I32), _I32(3))
        a = _call(builder, "llvm.fma.v8f32", _V8F, builder.fmul(ds, dx),
                  builder.sitofp(sums[u], _V8F), acc[u])  # fmt: skip
        minus = builder.fmul(builder.fneg(dm), dx)  # (a nan dx stays +nan: one nan sign)
        s = builder.sitofp(_splat_i32(builder, total), _V8F)  # exact: |s| <= 32 * 127
        out.append(_call(builder, "llvm.fma.v8f32", _V8F, minus, s, a))
    return out


def _legacy_scale(kind, context, builder, args, ki, gi, rows, sums, acc):
    """Step 3 for q4_1, q5_0 and q5_1's block k, from t = sum q xq (q unsigned) and s =
    sum xq: q5_0 a = fma(d dx, t - 16 s, a); q4_1 and q5_1 a = fma(d dx, t, a) then
    a = fma(m dx, s, a) (value d q + m)."""
    ws, xd, xc = args[4], args[7], args[8]

    def const(v):
        return ir.Constant(ki.type, v)

    per_block = 16 if kind == "q5_0" else 32  # the eight rows' d (and m): float16 each
    base = builder.mul(ki, const(per_block))
    d = _f16_lanes(builder, _at(context, builder, ws, gi, base))
    m = (
        None
        if kind == "q5_0"
        else _f16_lanes(builder, _at(context, builder, ws, gi, builder.add(base, const(16))))
    )
    k4, k8 = builder.mul(ki, const(4)), builder.mul(ki, const(8))
    out = []
    for u, row in enumerate(rows):
        dx = _splat(builder, _load(builder, _at(context, builder, xd, row, k4), ir.FloatType()))
        sum8 = _load(builder, _at(context, builder, xc, row, k8), _I32)  # 8 sum xq
        t = sums[u]
        if kind == "q5_0":  # sum (q - 16) xq = t - 16 s = t - 2 (8 s)
            t = builder.sub(t, _splat_i32(builder, builder.shl(sum8, _I32(1))))
        a = _call(builder, "llvm.fma.v8f32", _V8F, builder.fmul(d, dx),
                  builder.sitofp(t, _V8F), acc[u])  # fmt: skip
        if m is not None:
            s = builder.sitofp(_splat_i32(builder, builder.ashr(sum8, _I32(3))), _V8F)
            a = _call(builder, "llvm.fma.v8f32", _V8F, builder.fmul(m, dx), s, a)
        out.append(a)
    return out


def _q5_sums(builder, loads, xs):
    """q5_K's block sums of q xq per activation row, q = low | top << 4 (0..31): loads 0..3
    hold the low nibbles as q4_0's codes, load 4 the top bits (`layout._q5k_split`): bit c
    for load c's low nibbles, bit 4 + c for its high ones.  AVX2: four vpmaddubsw results
    (each at most 2 * 31 * 127) add up exactly in 16 bits, then one vpmaddwd per four."""

    def c(v):
        return ir.Constant(_V32I8, [v] * 32)

    top = loads[4]
    parts = []
    for j, w in enumerate(loads[:4]):
        to_lo = builder.shl(top, c(4 - j))  # bit j -> bit 4
        to_hi = builder.lshr(top, c(j)) if j else top  # bit 4 + j -> bit 4
        parts.append((builder.or_(builder.and_(w, c(15)), builder.and_(to_lo, c(16))), 4 * j))
        parts.append((builder.or_(builder.lshr(w, c(4)), builder.and_(to_hi, c(16))), 16 + 4 * j))
    if ISA == "vnni":
        return [_dpbusd_all(builder, parts, xs, u) for u in range(xs.m)]
    out = []
    for u in range(xs.m):
        if ISA == "avx2":
            ones, fours = ir.Constant(_V16I16, [1] * 16), []
            for four in (parts[:4], parts[4:]):
                h16 = None
                for w, col in four:
                    p = _madd_avx2(builder, w, xs(u, col), signed=False)  # <16 x i16>
                    h16 = p if h16 is None else builder.add(h16, p)
                fours.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, h16, ones))
            out.append(builder.add(*fours))
        else:
            out.append(_add_all(builder, [_dot_generic(builder, w, xs(u, col), False)
                                          for w, col in parts]))  # fmt: skip
    return out


def _q6_sums(builder, loads, xs):
    """q6_K's block sums for each activation row u: (sum q xq over columns 0..15, over 16..31),
    q the unsigned 6-bit codes 0..63 (the -32 is taken off in `_q6k_scale`).  loads 0..3 hold
    the low nibbles as q4_0's do, loads 4 and 5 the high bit pairs (`layout._Q6_HIGH_ORDER`):
    load 4 + j's bit pairs 0-1 and 2-3 go with code load 2j's low and high nibbles, pairs 4-5
    and 6-7 with load 2j + 1's.  AVX2: two vpmaddubsw results (each at most 2 * 63 * 127) add
    up exactly in 16 bits, not four, so each half takes two vpmaddwd."""

    def c(v):
        return ir.Constant(_V32I8, [v] * 32)

    first, second = [], []
    for j, w in enumerate(loads[:4]):
        h = loads[4 + j // 2]
        shift = 4 * (j % 2)  # bit pairs 0-1/2-3 or 4-5/6-7 of the high load
        # ((h >> shift) & 3) << 4 and ((h >> (shift + 2)) & 3) << 4, as one shift and a mask
        hi_lo = builder.and_(builder.shl(h, c(4)) if shift == 0 else h, c(0x30))
        hi_hi = builder.and_(builder.shl(h, c(2)) if shift == 0 else builder.lshr(h, c(2)), c(0x30))
        first.append((builder.or_(builder.and_(w, c(15)), hi_lo), 4 * j))
        second.append((builder.or_(builder.lshr(w, c(4)), hi_hi), 16 + 4 * j))
    out_first, out_second = [], []
    for u in range(xs.m):
        for parts, out in ((first, out_first), (second, out_second)):
            if ISA == "vnni":
                out.append(_dpbusd_all(builder, parts, xs, u))
            elif ISA == "avx2":
                ones, pairs = ir.Constant(_V16I16, [1] * 16), []
                for a, b in (parts[:2], parts[2:]):
                    h16 = builder.add(
                        _madd_avx2(builder, a[0], xs(u, a[1]), signed=False),
                        _madd_avx2(builder, b[0], xs(u, b[1]), signed=False),
                    )
                    pairs.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, h16, ones))
                out.append(builder.add(*pairs))
            else:
                out.append(_add_all(builder, [_dot_generic(builder, w, xs(u, col), False)
                                              for w, col in parts]))  # fmt: skip
    return out_first, out_second


_IQ4_TABLE = ir.Constant(_V32I8, [int(v) for v in IQ4_VALUES] * 2)
_IQ4_TABLE_UNSIGNED = ir.Constant(_V32I8, [int(v) + 128 for v in IQ4_VALUES] * 2)


def _iq4_values(builder, codes):
    """4-bit codes (<32 x i8>, 0..15) -> their IQ4_VALUES, int8 (portable: a select chain)."""
    out = ir.Constant(_V32I8, [int(IQ4_VALUES[0])] * 32)
    for q in range(1, 16):
        hit = builder.icmp_unsigned("==", codes, ir.Constant(_V32I8, [q] * 32))
        out = builder.select(hit, ir.Constant(_V32I8, [int(IQ4_VALUES[q])] * 32), out)
    return out


def _iq4_sums(builder, loads, xs):
    """iq4_nl's and iq4_xs's block sums of v xq, v = IQ4_VALUES[q] (-127..113), q in q4_0's
    nibble order.  VNNI: looked up (vpshufb, shared by every activation row) as v + 128,
    unsigned, and 128 sum xq comes off in the caller; AVX2: the signed values with the sign
    moved onto the activations (vpmaddubsw would saturate 2 * 241 * 127), as q8_0's codes;
    elsewhere the signed values."""
    parts = []
    for c, w in enumerate(loads):
        lo = builder.and_(w, ir.Constant(_V32I8, [15] * 32))
        hi = builder.lshr(w, ir.Constant(_V32I8, [4] * 32))
        parts += [(lo, 4 * c), (hi, 16 + 4 * c)]

    def looked_up(table):
        return [(_call(builder, "llvm.x86.avx2.pshuf.b", _V32I8, table, w), c) for w, c in parts]

    if ISA == "vnni":
        vals = looked_up(_IQ4_TABLE_UNSIGNED)
        return [_dpbusd_all(builder, vals, xs, u) for u in range(xs.m)]
    if ISA == "avx2":
        vals = looked_up(_IQ4_TABLE)
    else:
        vals = [(_iq4_values(builder, w), col) for w, col in parts]
    return [
        _add_all(builder, [_DOT(builder, w, xs(u, col), True) for w, col in vals])
        for u in range(xs.m)
    ]


def _iq4xs_scale(context, builder, args, ki, gi, rows, sums, acc):
    """Step 3 for iq4_xs's sub-block k: a = fma((d (ls - 32)) dx, t, a), t the exact sum of
    v xq (less 128 sum xq where `_iq4_sums` took v + 128); d (ls - 32) is exact in float32."""
    ws, xd, xc = args[4], args[7], args[8]

    def const(v):
        return ir.Constant(ki.type, v)

    base = builder.mul(builder.lshr(ki, const(3)), const(80))  # the super-block's scales
    sub8 = builder.mul(builder.and_(ki, const(7)), const(8))
    d = _f16_lanes(builder, _at(context, builder, ws, gi, base))
    ls_ptr = _at(context, builder, ws, gi, builder.add(base, builder.add(sub8, const(16))))
    ls = builder.sitofp(_load(builder, ls_ptr, ir.VectorType(_I8, LANES)), _V8F)
    dl = builder.fmul(d, ls)  # exact
    k4, k8 = builder.mul(ki, const(4)), builder.mul(ki, const(8))
    out = []
    for u, row in enumerate(rows):
        dx = _splat(builder, _load(builder, _at(context, builder, xd, row, k4), ir.FloatType()))
        t = sums[u]
        if ISA == "vnni":
            corr = _load(builder, _at(context, builder, xc, row, k8), _I32)  # 8 sum xq
            t = builder.sub(t, _splat_i32(builder, builder.shl(corr, _I32(4))))
        out.append(_call(builder, "llvm.fma.v8f32", _V8F, builder.fmul(dl, dx),
                         builder.sitofp(t, _V8F), acc[u]))  # fmt: skip
    return out


def _q6k_scale(context, builder, args, ki, gi, rows, sums, acc):
    """Step 3 for q6_K's block k: its scales cover 16 columns each, so per activation row u
    a = fma((d sc_2s) dx, t1 - 32 s1, a) then a = fma((d sc_2s+1) dx, t2 - 32 s2, a), with
    t1, t2 the halves' sums of q xq (`_q6_sums`) and s1, s2 their sums of xq (`xc`); d sc is
    exact in float32 (11 by 8 bits), t - 32 s an exact integer."""
    ws, xd, xc = args[4], args[7], args[8]
    firsts, seconds = sums

    def const(v):
        return ir.Constant(ki.type, v)

    base = builder.mul(builder.lshr(ki, const(3)), const(144))  # the super-block's scales
    sub16 = builder.mul(builder.and_(ki, const(7)), const(16))  # sc[2s] of the eight rows

    def i8_lanes(offset):
        ptr = _at(context, builder, ws, gi, builder.add(base, offset))
        return builder.sitofp(_load(builder, ptr, ir.VectorType(_I8, LANES)), _V8F)

    d = _f16_lanes(builder, _at(context, builder, ws, gi, base))
    d1 = builder.fmul(d, i8_lanes(builder.add(sub16, const(16))))  # exact
    d2 = builder.fmul(d, i8_lanes(builder.add(sub16, const(24))))
    k4, k8 = builder.mul(ki, const(4)), builder.mul(ki, const(8))
    out = []
    for u, row in enumerate(rows):
        dx = _splat(builder, _load(builder, _at(context, builder, xd, row, k4), ir.FloatType()))
        total = builder.ashr(_load(builder, _at(context, builder, xc, row, k8), _I32), _I32(3))
        s1 = _load(builder, _at(context, builder, xc, row, builder.add(k8, const(4))), _I32)
        s2 = builder.sub(total, s1)
        a = acc[u]
        for t, dh, s in ((firsts[u], d1, s1), (seconds[u], d2, s2)):
            t = builder.sub(t, _splat_i32(builder, builder.shl(s, _I32(5))))  # sum (q - 32) xq
            a = _call(builder, "llvm.fma.v8f32", _V8F, builder.fmul(dh, dx),
                      builder.sitofp(t, _V8F), a)  # fmt: skip
        out.append(a)
    return out


_q4_group_block = _group_block_kernel("q4_0")
_q8_group_block = _group_block_kernel("q8_0")
_mx_group_block = _group_block_kernel("mxfp4")
_q4k_group_block = _group_block_kernel("q4_K")
_q6k_group_block = _group_block_kernel("q6_K")
_q5k_group_block = _group_block_kernel("q5_K")
_q41_group_block = _group_block_kernel("q4_1")
_q50_group_block = _group_block_kernel("q5_0")
_q51_group_block = _group_block_kernel("q5_1")
_iq4nl_group_block = _group_block_kernel("iq4_nl")
_iq4xs_group_block = _group_block_kernel("iq4_xs")


# ---------------------------------------------------------------------------------------------
# one row group against a few activation rows


@intrinsic
def _rows_from(typingctx, u, acc):
    """(u, u + 1, ..., u + m - 1) for an m-tuple acc."""
    if not (isinstance(u, types.Integer) and isinstance(acc, types.UniTuple)):
        return None
    m = len(acc)

    def codegen(context, builder, sig, args):
        base = context.cast(builder, args[0], u, types.intp)
        rows = [builder.add(base, ir.Constant(base.type, i)) for i in range(m)]
        return context.make_tuple(builder, sig.return_type, rows)

    return types.UniTuple(types.intp, m)(u, acc), codegen


@njit(cache=True, nogil=True)
def _group_rows(fmt, wq, ws, g, xq, xd, xc, u, acc, nb):
    """Lane r of the result's i-th vector: weight row 8g + r . quantised activation row u + i
    (every matrix a `_mat` pair), for as many rows as acc has (zero) vectors.  Each weight
    block is loaded and unpacked once for them all; numba compiles one version per count,
    and each row's arithmetic is the same in every one of them."""
    us = _rows_from(u, acc)
    for k in range(nb):
        if fmt == FMT_Q4_0:
            acc = _q4_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_MXFP4:
            acc = _mx_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_Q4_K:
            acc = _q4k_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_Q6_K:
            acc = _q6k_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_Q5_K:
            acc = _q5k_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_Q4_1:
            acc = _q41_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_Q5_0:
            acc = _q50_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_Q5_1:
            acc = _q51_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_IQ4_NL:
            acc = _iq4nl_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        elif fmt == FMT_IQ4_XS:
            acc = _iq4xs_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
        else:
            acc = _q8_group_block(acc, wq, g, k, ws, xq, us, xd, xc)
    return acc


@njit(cache=True, nogil=True)
def _put(out, u, r, r1, lanes, v):
    """out[u, r : min(r + 8, r1)] = the first lanes of v (lanes: an 8-float scratch)."""
    if r + LANES <= r1:
        _vstore(out[u], r, v)
    else:
        _vstore(lanes, 0, v)
        for i in range(r1 - r):
            out[u, r + i] = lanes[i]


@njit(cache=True, nogil=True)
def _put_rows(out, u, r, r1, lanes, ys):
    """`_put` of each vector of the tuple ys, for activation rows u, u + 1, ..."""
    for i in range(len(ys)):
        _put(out, u + i, r, r1, lanes, ys[i])


@njit(cache=True, nogil=True)
def int_rows(fmt, wq, ws, xq, xd, xc, out, r0, r1):
    """out[:, r0:r1] for quantised activations (xq, xd, xc) of any batch (q4_0/q8_0); r0 a
    multiple of 8 (a row group).

    One row group at a time: its bytes (nb * 128 or 256) are read from memory once and then
    stay in L1/L2 while every activation row, four at a time (the last three, two or one
    together), is multiplied with them; at one or two activation rows the next group's bytes
    are prefetched meanwhile (`dots.prefetch_line`).  The padding rows of a last partial group
    are computed and dropped."""
    b, nb = xq.shape[0], xd.shape[1]
    mw, ms, mx, md, mc = _mat(wq), _mat(ws), _mat(xq), _mat(xd), _mat(xc)
    lanes = np.empty(LANES, dtype=np.float32)
    z = _vzero()
    for g in range(r0 // ROW_GROUP, (r1 + ROW_GROUP - 1) // ROW_GROUP):
        r = ROW_GROUP * g
        for u in range(0, b - 3, 4):
            ys = _group_rows(fmt, mw, ms, g, mx, md, mc, u, (z, z, z, z), nb)
            _put_rows(out, u, r, r1, lanes, ys)
        u = b - b % 4
        if b % 4 == 3:
            ys = _group_rows(fmt, mw, ms, g, mx, md, mc, u, (z, z, z), nb)
            _put_rows(out, u, r, r1, lanes, ys)
        elif b % 4 == 2:
            ys = _group_rows(fmt, mw, ms, g, mx, md, mc, u, (z, z), nb)
            _put_rows(out, u, r, r1, lanes, ys)
        elif b % 4 == 1:
            (y,) = _group_rows(fmt, mw, ms, g, mx, md, mc, u, (z,), nb)
            _put(out, u, r, r1, lanes, y)
