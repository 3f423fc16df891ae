#!/usr/bin/env python
"""Would bf16 activations (`vdpbf16ps`) make the trunk's bf16 products faster on this CPU?

    .venv/bin/python tools/probe_dpbf16.py [--rounds 7]

Issue 38 asks for a `vdpbf16ps` path (activations rounded to bf16, as llama.cpp does for bf16
weights) as an explicit option if it is faster than moeshard's float32-activation bf16
kernel. This probe times, on one thread and in cache, moeshard's kernel (`PackedMatrix`, two
weight rows against eight activation rows, float32 FMAs on the widened weights) against two
`vdpbf16ps` loops written here: one weight row against eight activation rows (8 chains) and
two against eight (16 chains, the same tile as moeshard's). Shapes: the 706 MB test model's
products (1024 columns) and the demo's (256), at 16 and 96 activation rows (a batched decode
step, a prefill). Prints the CPU, then per shape each kernel's median time and GMAC/s.

A measurement probe, not a kernel of moeshard's: it runs only on a CPU with AVX512-BF16,
and its sums' order is LLVM's (`llvm.vector.reduce.fadd` of the sixteen lanes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from moeshard.moe.kernels import layout, quant
from moeshard.moe.kernels.fdots import _V16F, F32X16, _lanes_at, _matrix_at, _zzero

SHAPES = [(2048, 1024), (1024, 768), (512, 256)]  # (rows, cols) of a bf16 weight matrix
BATCHES = (16, 96)
_V16I32 = ir.VectorType(ir.IntType(32), 16)


class _BFloat(ir.types.Type):
    """LLVM's `bfloat` (llvmlite's IR builder has no such type; the intrinsic takes it)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


_V32BF = ir.VectorType(_BFloat(), 32)


@intrinsic
def _load32(typingctx, ary, r, j):
    """ary[r, j : j + 32] of a uint16 (bf16) matrix, held as sixteen 32-bit lanes."""
    if not _matrix_at(ary, r, j, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        ptr = _lanes_at(context, builder, sig, args, _V16I32)
        return builder.bitcast(builder.load(ptr, align=2), _V16F)

    return F32X16(ary, r, j), codegen


@intrinsic
def _dpbf16(typingctx, acc, w, x):
    """acc + the pairwise products of w's and x's 32 bf16 values (`vdpbf16ps` zmm)."""
    if not (acc == w == x == F32X16):
        return None

    def codegen(context, builder, sig, args):
        a, wv, xv = args
        fty = ir.FunctionType(_V16F, [_V16F, _V32BF, _V32BF])
        fn = cgutils.get_or_insert_function(builder.module, fty, "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [a, builder.bitcast(wv, _V32BF), builder.bitcast(xv, _V32BF)])

    return F32X16(acc, w, x), codegen


@intrinsic
def _lanes_sum(typingctx, a):
    if a != F32X16:
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fty = ir.FunctionType(f32, [f32, _V16F])
        fn = cgutils.get_or_insert_function(builder.module, fty, "llvm.vector.reduce.fadd.v16f32")
        return builder.call(fn, [ir.Constant(f32, 0.0), args[0]])

    return types.float32(a), codegen


@njit(nogil=True)
def rows_1x8(w, xb, out):
    """out [b, R] = xb [b, C] . w [R, C]^T (both bf16 bits), one weight row per pass."""
    b, cols = xb.shape
    for r in range(w.shape[0]):
        for u in range(0, b - 7, 8):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _zzero()
            for j in range(0, cols, 32):
                wv = _load32(w, r, j)
                a0 = _dpbf16(a0, wv, _load32(xb, u, j))
                a1 = _dpbf16(a1, wv, _load32(xb, u + 1, j))
                a2 = _dpbf16(a2, wv, _load32(xb, u + 2, j))
                a3 = _dpbf16(a3, wv, _load32(xb, u + 3, j))
                a4 = _dpbf16(a4, wv, _load32(xb, u + 4, j))
                a5 = _dpbf16(a5, wv, _load32(xb, u + 5, j))
                a6 = _dpbf16(a6, wv, _load32(xb, u + 6, j))
                a7 = _dpbf16(a7, wv, _load32(xb, u + 7, j))
            for i, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
                out[u + i, r] = _lanes_sum(a)


@njit(nogil=True)
def rows_2x8(w, xb, out):
    """As `rows_1x8`, two weight rows per pass (sixteen accumulators; R even)."""
    b, cols = xb.shape
    for r in range(0, w.shape[0] - 1, 2):
        for u in range(0, b - 7, 8):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _zzero()
            c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = _zzero()
            for j in range(0, cols, 32):
                w0, w1 = _load32(w, r, j), _load32(w, r + 1, j)
                x0, x1 = _load32(xb, u, j), _load32(xb, u + 1, j)
                x2, x3 = _load32(xb, u + 2, j), _load32(xb, u + 3, j)
                x4, x5 = _load32(xb, u + 4, j), _load32(xb, u + 5, j)
                x6, x7 = _load32(xb, u + 6, j), _load32(xb, u + 7, j)
                a0, a1 = _dpbf16(a0, w0, x0), _dpbf16(a1, w0, x1)
                a2, a3 = _dpbf16(a2, w0, x2), _dpbf16(a3, w0, x3)
                a4, a5 = _dpbf16(a4, w0, x4), _dpbf16(a5, w0, x5)
                a6, a7 = _dpbf16(a6, w0, x6), _dpbf16(a7, w0, x7)
                c0, c1 = _dpbf16(c0, w1, x0), _dpbf16(c1, w1, x1)
                c2, c3 = _dpbf16(c2, w1, x2), _dpbf16(c3, w1, x3)
                c4, c5 = _dpbf16(c4, w1, x4), _dpbf16(c5, w1, x5)
                c6, c7 = _dpbf16(c6, w1, x6), _dpbf16(c7, w1, x7)
            for i, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
                out[u + i, r] = _lanes_sum(a)
            for i, c in enumerate((c0, c1, c2, c3, c4, c5, c6, c7)):
                out[u + i, r + 1] = _lanes_sum(c)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even (no nan in these inputs)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def widened(bits: np.ndarray) -> np.ndarray:
    """bf16 bits -> their exact values, float64."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def check(w16, xb, x, w, out) -> None:
    """Both vdpbf16ps loops give the bf16 inputs' products to float32 accuracy (a probe of
    a wrong kernel would mislead); raises otherwise."""
    exact = widened(xb) @ widened(w16).T  # [b, R]
    scale = np.abs(exact).max()
    for kernel in (rows_1x8, rows_2x8):
        out[:] = np.nan
        kernel(w16, xb, out)
        err = np.abs(out - exact).max() / scale
        if not err < 1e-5:
            raise SystemExit(f"{kernel.__name__}: relative error {err:.1e} against exact")


def median_seconds(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    features = llvm.get_host_cpu_features()
    if not features.get("avx512bf16"):
        print("this CPU has no AVX512-BF16: nothing to probe")
        return 0
    print(f"cpu: {llvm.get_host_cpu_name()}, one thread, in cache; medians of {args.rounds}")
    quant.warmup()
    quant.set_threads(1)
    rng = np.random.default_rng(0)
    for rows, cols in SHAPES:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        packed = quant.PackedMatrix(layout.pack(w, "bf16"), "bf16", rows, cols)
        w16 = bf16_bits(w)
        for b in BATCHES:
            x = rng.standard_normal((b, cols), dtype=np.float32)
            xb, out = bf16_bits(x), np.empty((b, rows), dtype=np.float32)
            kernels = {
                "moeshard f32 activations": partial(packed, x),
                "vdpbf16ps 1x8": partial(rows_1x8, w16, xb, out),
                "vdpbf16ps 2x8": partial(rows_2x8, w16, xb, out),
            }
            for fn in kernels.values():
                fn()  # (compiled, caches warm)
            calls = max(5, 20_000_000 // (rows * cols * b))
            check(w16, xb, x, w, out)
            cells = []
            for name, fn in kernels.items():
                t = median_seconds(fn, calls, args.rounds)
                cells.append(f"{name} {t * 1e6:7.0f} us {rows * cols * b / t / 1e9:5.1f} GMAC/s")
            print(f"{rows}x{cols} b={b:3d}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
