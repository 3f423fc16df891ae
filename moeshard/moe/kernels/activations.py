"""Step 1 of the integer kernels (`moeshard.moe.kernels.idots` has all the steps): the
activations quantised to 8 bits per 32-column block, with each block's scale, 8 x the sum of
its codes and the sum of its first 16 (q6_K's scales cover 16 columns), once per call for
every row group that multiplies them.

A block's largest magnitude and its codes' sums are taken as whole vectors (LLVM's
`llvm.vector.reduce.*`, lowered to the CPU's own lanes): written as loops, LLVM unrolled them
into chains of 32 scalar compares and adds, and quantising cost ~1.1-1.8 ns an element, a
fifth of a small model's expert products in prefill.  Integer max and sums are exact, so the
bits are those of the loops (tests/test_kernel_determinism.py emulates step 1 in numpy)."""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from moeshard.moe.kernels.dots import QK
from moeshard.moe.kernels.fdots import _lanes_at, _matrix_at

_I32 = ir.IntType(32)
_V32I32 = ir.VectorType(_I32, QK)
_V16I32 = ir.VectorType(_I32, QK // 2)
_V32I8 = ir.VectorType(ir.IntType(8), QK)
_MAGNITUDE = 0x7FFFFFFF  # a float32's bits without the sign
_INF_BITS = np.int32(0x7F800000)  # +inf's bits: at or above them, an inf or a nan


def _reduce(builder, op: str, vector, vector_type):
    """`llvm.vector.reduce.<op>` of an integer vector -> its i32 scalar."""
    fn = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(_I32, [vector_type]),
        f"llvm.vector.reduce.{op}.v{vector_type.count}i32",
    )
    return builder.call(fn, [vector])


@intrinsic
def _magnitude_bits(typingctx, ary, r, j):
    """The largest of |ary[r, j + c]|, c < 32 (a float32 matrix), as its int32 bits: for
    finite values and infinities the order of the bits is the order of the magnitudes, and a
    nan's bits are above +inf's."""
    if not _matrix_at(ary, r, j, types.float32):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_lanes_at(context, builder, sig, args, _V32I32), align=4)
        v = builder.and_(v, ir.Constant(_V32I32, [_MAGNITUDE] * QK))
        return _reduce(builder, "umax", v, _V32I32)

    return types.int32(ary, r, j), codegen


@intrinsic
def _code_sums(typingctx, ary, r, j):
    """(sum of ary[r, j : j + 16], sum of ary[r, j + 16 : j + 32]) of an int8 matrix, int32."""
    if not _matrix_at(ary, r, j, types.int8):
        return None
    pair = types.UniTuple(types.int32, 2)

    def codegen(context, builder, sig, args):
        codes = builder.load(_lanes_at(context, builder, sig, args, _V32I8), align=1)
        wide = builder.sext(codes, _V32I32)
        halves = []
        for lo in (0, QK // 2):
            idx = ir.Constant(ir.VectorType(_I32, QK // 2), list(range(lo, lo + QK // 2)))
            half = builder.shuffle_vector(wide, wide, idx)
            halves.append(_reduce(builder, "add", half, _V16I32))
        return context.make_tuple(builder, sig.return_type, halves)

    return pair(ary, r, j), codegen


@njit(cache=True, nogil=True)
def quantize_activations(x, xq, xd, xc):
    """x float32 [b, cols] -> codes xq int8 [b, cols], block scales xd float32 [b, cols // 32]
    and xc int32 [b, 2 * (cols // 32)]: xc[u, 2k] = 8 * the sum of block k's codes, xc[u,
    2k + 1] the sum of its first 16 (step 1 of the module doc).  A block whose largest
    magnitude is below 127 times the smallest subnormal (its scale rounds to 0) is quantised
    as an all-zero block."""
    for u in range(x.shape[0]):
        for k in range(x.shape[1] // QK):
            c0 = QK * k
            top = _magnitude_bits(x, u, c0)
            d = np.int32(top).view(np.float32) / np.float32(127.0)  # (top's bits as a float32)
            if top >= _INF_BITS or d == 0:
                xd[u, k] = np.float32(np.nan) if top >= _INF_BITS else np.float32(0.0)
                for c in range(QK):
                    xq[u, c0 + c] = 0
                xc[u, 2 * k] = 0
                xc[u, 2 * k + 1] = 0
                continue
            xd[u, k] = d
            inv = np.float32(1.0) / d
            for c in range(QK):
                q = np.rint(x[u, c0 + c] * inv)
                xq[u, c0 + c] = np.int8(min(max(q, np.float32(-127.0)), np.float32(127.0)))
            first, second = _code_sums(xq, u, c0)
            xc[u, 2 * k] = 8 * (first + second)
            xc[u, 2 * k + 1] = first


@njit(cache=True, nogil=True)
def activation_buffers(b, cols):
    """Empty (xq, xd, xc) for `quantize_activations` of a [b, cols] activation."""
    nb = cols // QK
    xq = np.empty((b, cols), dtype=np.int8)  # [b, cols]
    xd = np.empty((b, nb), dtype=np.float32)  # [b, nb]
    xc = np.empty((b, 2 * nb), dtype=np.int32)  # [b, 2 nb]: 8 x block sums, first halves
    return xq, xd, xc
