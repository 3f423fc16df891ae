#!/usr/bin/env python
"""Would the bf16 products read DRAM faster if each four-row group were one stream?

    .venv/bin/python tools/probe_bf16_stream.py [--rounds 4] [--calls 300]

Issue 38 asks for the bf16 trunk at >= 80% of the machine's DRAM read at batch 1; `bench
compare-llamacpp` puts it at 0.77-0.84 while a plain sum of the same blocks reads more
(docs/results.md). The kernel takes four weight rows at a time, so it reads four 2 KiB
streams at once and prefetches the next group's four by software. This probe times, on all
numba threads, a bf16 1024x1024 product at batch 1 with weights from pools twice the
last-level cache (as the bench does), interleaved call by call in one process:

- `entry.matmul_kernel`: moeshard's product as it is (row-major bf16 rows);
- the same loop written out flat here (row-major, next group prefetched into L2);
- the same sums over a layout in which a group's four rows are interleaved in 32-byte
  pieces (one linear stream per group), without and with software prefetch;
- a plain parallel sum of the same 2 MiB blocks.

Each product is checked bit-equal to `PackedMatrix`'s before timing. Prints, per round, the
DRAM read (all threads summing 1 GiB) and each variant's GB/s over it. A measurement probe,
not a kernel of moeshard's: the interleaved layout is not one moeshard packs.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange

from moeshard.bench.kernels import _arena, _parallel_sum, dram_read_gbs_threads
from moeshard.moe.kernels import entry, quant
from moeshard.moe.kernels.build import cpu_level
from moeshard.moe.kernels.fdots import (
    _prefetch,
    _vsum,
    _zfma,
    _zload,
    _zload_bf16,
    _zpairs,
    _zzero,
)

ROWS, COLS = 1024, 1024  # the 706 MB test model's attention products


@njit(nogil=True, inline="always")
def _dot4_rows(w, r, x, last):
    """Rows r .. r + 3 of w (uint16 [R, cols]) . x[0], the sums of `fdots._bf16_dot4_wide`;
    the next group's rows prefetched."""
    cols = x.shape[1]
    a0 = a1 = a2 = a3 = _zzero()
    for j in range(0, cols, 16):
        if j & 31 == 0:
            _prefetch(w, min(r + 4, last), j)
            _prefetch(w, min(r + 5, last), j)
            _prefetch(w, min(r + 6, last), j)
            _prefetch(w, min(r + 7, last), j)
        xj = _zload(x, 0, j)
        a0 = _zfma(_zload_bf16(w, r, j), xj, a0)
        a1 = _zfma(_zload_bf16(w, r + 1, j), xj, a1)
        a2 = _zfma(_zload_bf16(w, r + 2, j), xj, a2)
        a3 = _zfma(_zload_bf16(w, r + 3, j), xj, a3)
    return _vsum(_zpairs(a0)), _vsum(_zpairs(a1)), _vsum(_zpairs(a2)), _vsum(_zpairs(a3))


@njit(nogil=True, inline="always")
def _dot4_interleaved(w4, g, x, ahead):
    """Group g of w4 (uint16 [R / 4, 4 cols]: columns j .. j + 15 of the group's row i at
    w4[g, 4j + 16i]) . x[0], the same sums; `ahead` > 0 prefetches group g + ahead."""
    cols, last = x.shape[1], w4.shape[0] - 1
    a0 = a1 = a2 = a3 = _zzero()
    for j in range(0, cols, 16):
        o = 4 * j
        if ahead > 0:
            _prefetch(w4, min(g + ahead, last), o)
            _prefetch(w4, min(g + ahead, last), o + 32)
        xj = _zload(x, 0, j)
        a0 = _zfma(_zload_bf16(w4, g, o), xj, a0)
        a1 = _zfma(_zload_bf16(w4, g, o + 16), xj, a1)
        a2 = _zfma(_zload_bf16(w4, g, o + 32), xj, a2)
        a3 = _zfma(_zload_bf16(w4, g, o + 48), xj, a3)
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
def _interleaved_kernel(w4, x, ahead):
    groups = w4.shape[0]
    out = np.empty((1, 4 * groups), np.float32)  # [1, rows]
    for it in prange(groups // 4):
        for g in range(4 * it, 4 * it + 4):
            y = _dot4_interleaved(w4, g, x, ahead)
            for i in range(4):
                out[0, 4 * g + i] = y[i]
    return out


def _pools(packed: np.ndarray) -> tuple[list, list, list, list]:
    """Views into pools of copies: row-major uint16 [R, C], its packed bytes (for
    `matmul_kernel`), the interleaved uint16 [R / 4, 4 C], and uint64 for the sum."""
    w16 = packed.view(np.uint16).reshape(ROWS, COLS)
    inter = w16.reshape(ROWS // 4, 4, COLS // 16, 16).transpose(0, 2, 1, 3)  # [g, c, i, 16]
    arena, at = _arena(packed)
    iarena, iat = _arena(np.ascontiguousarray(inter).reshape(-1).view(np.uint8))
    n = packed.size
    rows = [arena[o : o + n].view(np.uint16).reshape(ROWS, COLS) for o in at]
    raw = [arena[o : o + n] for o in at]
    inters = [iarena[o : o + n].view(np.uint16).reshape(ROWS // 4, 4 * COLS) for o in iat]
    sums = [arena[o : o + n].view(np.uint64) for o in at]
    return rows, raw, inters, sums


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
    rows, raw, inters, sums = _pools(packed)
    m_args = matrix._args[1:]
    code = quant._FMT_CODE["bf16"]
    variants = {
        "moeshard now": lambda k: entry.matmul_kernel(code, quant._int8(), raw[k], *m_args, x),
        "flat rows": lambda k: _rows_kernel(rows[k], x),
        "interleaved": lambda k: _interleaved_kernel(inters[k], x, 0),
        "interleaved+prefetch": lambda k: _interleaved_kernel(inters[k], x, 1),
        "plain sum": lambda k: _parallel_sum(sums[k]),
    }
    for name, fn in variants.items():
        if name != "plain sum" and not np.array_equal(fn(0), ref):
            raise SystemExit(f"{name}: not the bits of PackedMatrix")
    print(
        f"bf16 {ROWS}x{COLS} at batch 1 on {quant.threads()} thread(s), kernels at the "
        f"{cpu_level()} level, pools of {len(rows)} copies; GB/s as a share of the DRAM read"
    )
    n = len(rows)
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
