#!/usr/bin/env python
"""Does the bf16 layout of four-row groups read DRAM faster than row-major rows?

    .venv/bin/python tools/probe_bf16_stream.py [--rounds 4] [--calls 300]

Issue 38 asks for the bf16 trunk at >= 80% of the machine's DRAM read at batch 1. The kernels
take four weight rows at a time; row-major, that read four 2 KiB streams at once (with the
next group's four prefetched by software) and reached 0.75-0.87 of the DRAM figure
(docs/results.md). Format version 3 packs each four-row group as one stream, sixteen columns
of the four rows at a time (`layout`). This probe times, on all numba threads, a bf16
1024x1024 product at batch 1 with weights from pools twice the last-level cache (as the bench
does), interleaved call by call in one process:

- `entry.matmul_kernel`: moeshard's product (the four-row layout);
- the same sums over the layout written out flat here, without and with software prefetch
  of the next group;
- the same sums over row-major rows (the layout before version 3, next group prefetched);
- a plain parallel sum of the same 2 MiB blocks.

Each product is checked bit-equal to `PackedMatrix`'s before timing. Prints, per round, the
DRAM read (all threads summing 1 GiB) and each variant's GB/s over it.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from moeshard.bench.kernels import _arena, _parallel_sum, dram_read_gbs_threads
from moeshard.moe.kernels import entry, quant
from moeshard.moe.kernels.build import cpu_level
from moeshard.moe.kernels.fdots import (
    F32X16,
    _lanes_at,
    _matrix_at,
    _prefetch,
    _vsum,
    _zfma,
    _zload,
    _zload_bf16,
    _zpairs,
    _zzero,
    prefetch_line,
)

ROWS, COLS = 1024, 1024  # the 706 MB test model's attention products
_V16I16, _V16I32 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 16)


@intrinsic
def _row_load(typingctx, ary, r, j):
    """Row r of a row-major bf16 matrix (uint16 [R, cols]), elements j .. j + 15, widened."""
    if not _matrix_at(ary, r, j, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        halves = builder.load(_lanes_at(context, builder, sig, args, _V16I16), align=2)
        wide = builder.shl(builder.zext(halves, _V16I32), ir.Constant(_V16I32, [16] * 16))
        return builder.bitcast(wide, ir.VectorType(ir.FloatType(), 16))

    return F32X16(ary, r, j), codegen


@intrinsic
def _row_prefetch(typingctx, ary, r, j):
    """Prefetch row r, column j of a row-major bf16 matrix."""
    if not _matrix_at(ary, r, j, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        prefetch_line(builder, _lanes_at(context, builder, sig, args, ir.IntType(8)))
        return context.get_dummy_value()

    return types.none(ary, r, j), codegen


@njit(nogil=True, inline="always")
def _dot4_rows(w, r, x, last):
    """Rows r .. r + 3 of row-major w (uint16 [R, cols]) . x[0], the sums of
    `fdots._bf16_dot4_wide`; the next group's rows prefetched (the kernel before version 3)."""
    cols = x.shape[1]
    a0 = a1 = a2 = a3 = _zzero()
    for j in range(0, cols, 16):
        if j & 31 == 0:
            _row_prefetch(w, min(r + 4, last), j)
            _row_prefetch(w, min(r + 5, last), j)
            _row_prefetch(w, min(r + 6, last), j)
            _row_prefetch(w, min(r + 7, last), j)
        xj = _zload(x, 0, j)
        a0 = _zfma(_row_load(w, r, j), xj, a0)
        a1 = _zfma(_row_load(w, r + 1, j), xj, a1)
        a2 = _zfma(_row_load(w, r + 2, j), xj, a2)
        a3 = _zfma(_row_load(w, r + 3, j), xj, a3)
    return _vsum(_zpairs(a0)), _vsum(_zpairs(a1)), _vsum(_zpairs(a2)), _vsum(_zpairs(a3))


@njit(nogil=True, inline="always")
def _dot4_grouped(w4, r, x, ahead):
    """Rows r .. r + 3 (one group) of w4 (the kernel layout, uint16 [R / 4, 4 cols]) . x[0],
    the same sums; `ahead` > 0 prefetches the group `ahead` groups on."""
    cols, last = x.shape[1], 4 * w4.shape[0] - 1
    a0 = a1 = a2 = a3 = _zzero()
    for j in range(0, cols, 16):
        if ahead > 0:
            _prefetch(w4, min(r + 4 * ahead, last), j)
            _prefetch(w4, min(r + 4 * ahead + 2, last), j)
        xj = _zload(x, 0, j)
        a0 = _zfma(_zload_bf16(w4, r, j), xj, a0)
        a1 = _zfma(_zload_bf16(w4, r + 1, j), xj, a1)
        a2 = _zfma(_zload_bf16(w4, r + 2, j), xj, a2)
        a3 = _zfma(_zload_bf16(w4, r + 3, j), xj, a3)
    return _vsum(_zpairs(a0)), _vsum(_zpairs(a1)), _vsum(_zpairs(a2)), _vsum(_zpairs(a3))


@njit(nogil=True, parallel=True)
def _rows_kernel(w, x):
    rows = w.shape[0]
    out = np.empty((1, rows), np.float32)  # [1, rows]
    for it in prange(rows // 16):
        for r in range(16 * it, 16 * it + 16, 4):
            y = _dot4_rows(w, r, x, rows - 1)
            for i in range(4):
                out[0, r + i] = y[i]
    return out


@njit(nogil=True, parallel=True)
def _grouped_kernel(w4, x, ahead):
    rows = 4 * w4.shape[0]
    out = np.empty((1, rows), np.float32)  # [1, rows]
    for it in prange(rows // 16):
        for r in range(16 * it, 16 * it + 16, 4):
            y = _dot4_grouped(w4, r, x, ahead)
            for i in range(4):
                out[0, r + i] = y[i]
    return out


def _pools(packed: np.ndarray) -> tuple[list, list, list, list]:
    """Views into pools of copies: the packed bytes (for `matmul_kernel`), them as uint16
    [R / 4, 4 C], row-major uint16 [R, C], and uint64 for the sum."""
    flat = quant.unpack_to_ggml(packed, "bf16", ROWS, COLS).reshape(-1)  # row-major bytes
    arena, at = _arena(packed)
    farena, fat = _arena(np.ascontiguousarray(flat))
    n = packed.size
    raw = [arena[o : o + n] for o in at]
    grouped = [arena[o : o + n].view(np.uint16).reshape(ROWS // 4, 4 * COLS) for o in at]
    rows = [farena[o : o + n].view(np.uint16).reshape(ROWS, COLS) for o in fat]
    sums = [arena[o : o + n].view(np.uint64) for o in at]
    return raw, grouped, rows, sums


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=300, help="timed calls per variant and round")
    args = ap.parse_args()
    quant.spin_while_waiting()
    numba.set_num_threads(quant.threads())
    rng = np.random.default_rng(0)
    packed = quant.pack(rng.standard_normal((ROWS, COLS), dtype=np.float32), "bf16")
    x = rng.standard_normal((1, COLS), dtype=np.float32)  # [1, cols]
    matrix = quant.PackedMatrix(packed, "bf16", ROWS, COLS)
    ref = matrix(x)
    raw, grouped, rows, sums = _pools(packed)
    m_args = matrix._args[1:]
    code = quant._FMT_CODE["bf16"]
    variants = {
        "moeshard": lambda k: entry.matmul_kernel(code, quant._int8(), raw[k], *m_args, x),
        "grouped flat": lambda k: _grouped_kernel(grouped[k], x, 0),
        "grouped+prefetch": lambda k: _grouped_kernel(grouped[k], x, 1),
        "row-major": lambda k: _rows_kernel(rows[k], x),
        "plain sum": lambda k: _parallel_sum(sums[k]),
    }
    for name, fn in variants.items():
        if name != "plain sum" and not np.array_equal(fn(0), ref):
            raise SystemExit(f"{name}: not the bits of PackedMatrix")
    print(
        f"bf16 {ROWS}x{COLS} at batch 1 on {quant.threads()} thread(s), kernels at the "
        f"{cpu_level()} level, pools of {len(raw)} copies; GB/s as a share of the DRAM read"
    )
    n = len(raw)
    for _ in range(args.rounds):
        dram = dram_read_gbs_threads(1.0, 5)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(args.calls):
            for q, (name, fn) in enumerate(variants.items()):
                k = (7 * i + 3 * q) % n
                t0 = time.perf_counter()
                fn(k)
                times[name].append(time.perf_counter() - t0)
        cells = "  ".join(
            f"{name} {packed.size / float(np.median(t)) / 1e9 / dram:.2f}"
            for name, t in times.items()
        )
        print(f"DRAM read {dram:5.1f} GB/s | {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
