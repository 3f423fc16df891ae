"""Numba kernels, part 2 of 3: the batch >= 2 q4_0/q8_0 tiles and the f32/bf16 rows.

`moe.kernels.dots` holds the shared constants, the batch-1 dots and the notes for whoever
edits these loops (they apply here too, including the one on numba's cache); the entry
points that call `_tile_rows` and `_float_rows` are in `moe.kernels.entry`.

* batch >= 2, q4_0/q8_0 (`_tile_rows`): a 4-row x 2048-column tile is dequantised into a
  float32 scratch (32 KiB), then a 4x4 (rows x batch) register-tiled micro-kernel runs
  over it.
* f32/bf16 (`_float_rows`): plain dot products accumulated in float64, so these formats are
  accurate to float32 rounding (they back the exactness tests).
"""

import numpy as np
from numba import njit

from moe.kernels.dots import _EIGHT, _FASTMATH, _ZERO, FMT_BF16, FMT_Q8_0, QK, TILE_COLS, TILE_ROWS

# ---------------------------------------------------------------------------------------------
# batch >= 2: dequantise a tile, then a register-tiled micro-kernel


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q4_dequant(wrow, srow, lut, dst):
    """Packed Q4_0 blocks (an even count, pair-aligned) -> float32 dst [len(srow) * 32]."""
    for p in range(srow.shape[0] // 2):
        o = p * 32
        d0 = lut[srow[2 * p]]
        d1 = lut[srow[2 * p + 1]]
        for j in range(32):
            v = wrow[o + j]
            dst[2 * o + j] = d0 * (np.float32(np.uint8(v & 15)) - _EIGHT)
            dst[2 * o + 32 + j] = d1 * (np.float32(np.uint8(v >> 4)) - _EIGHT)


@njit(cache=True, nogil=True)
def _q4_dequant_tail(tail, d, dst):
    for j in range(16):
        v = tail[j]
        dst[j] = d * (np.float32(np.uint8(v & 15)) - _EIGHT)
        dst[16 + j] = d * (np.float32(np.uint8(v >> 4)) - _EIGHT)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q8_dequant(wrow, srow, lut, dst):
    """Packed Q8_0 blocks -> float32 dst [len(srow) * 32] (two blocks per inner loop)."""
    nb = srow.shape[0]
    for p in range(nb // 2):
        o = p * 64
        d0 = lut[srow[2 * p]]
        d1 = lut[srow[2 * p + 1]]
        for j in range(32):
            dst[o + j] = d0 * np.float32(np.int8(wrow[o + j]))
            dst[o + 32 + j] = d1 * np.float32(np.int8(wrow[o + 32 + j]))
    if nb & 1:
        o = (nb - 1) * QK
        d = lut[srow[nb - 1]]
        for j in range(QK):
            dst[o + j] = d * np.float32(np.int8(wrow[o + j]))


@njit(cache=True, nogil=True)
def _dequant_tile(fmt, wq, ws, lut, r, nr, k0, k1, tile):
    """Rows r..r+nr, blocks k0..k1 -> tile[:nr, :(k1-k0)*32] float32."""
    for i in range(nr):
        wrow = wq[r + i]
        srow = ws[r + i]
        dst = tile[i]
        if fmt == FMT_Q8_0:
            _q8_dequant(wrow[k0 * QK : k1 * QK], srow[k0:k1], lut, dst)
        else:
            kp = k1 - ((k1 - k0) & 1)  # end of the paired blocks
            _q4_dequant(wrow[k0 * 16 : kp * 16], srow[k0:kp], lut, dst)
            if kp < k1:  # only the matrix's odd last block
                _q4_dequant_tail(wrow[kp * 16 : k1 * 16], lut[srow[kp]], dst[(kp - k0) * QK :])


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _micro4x4(t0, t1, t2, t3, x0, x1, x2, x3, n, acc):
    """acc[u, i] = dot(x_u[:n], t_i[:n]) for 4 weight rows x 4 activation rows."""
    s00 = s01 = s02 = s03 = _ZERO
    s10 = s11 = s12 = s13 = _ZERO
    s20 = s21 = s22 = s23 = _ZERO
    s30 = s31 = s32 = s33 = _ZERO
    for j in range(n):
        w0 = t0[j]
        w1 = t1[j]
        w2 = t2[j]
        w3 = t3[j]
        a = x0[j]
        s00 += w0 * a
        s01 += w1 * a
        s02 += w2 * a
        s03 += w3 * a
        a = x1[j]
        s10 += w0 * a
        s11 += w1 * a
        s12 += w2 * a
        s13 += w3 * a
        a = x2[j]
        s20 += w0 * a
        s21 += w1 * a
        s22 += w2 * a
        s23 += w3 * a
        a = x3[j]
        s30 += w0 * a
        s31 += w1 * a
        s32 += w2 * a
        s33 += w3 * a
    acc[0, 0], acc[0, 1], acc[0, 2], acc[0, 3] = s00, s01, s02, s03
    acc[1, 0], acc[1, 1], acc[1, 2], acc[1, 3] = s10, s11, s12, s13
    acc[2, 0], acc[2, 1], acc[2, 2], acc[2, 3] = s20, s21, s22, s23
    acc[3, 0], acc[3, 1], acc[3, 2], acc[3, 3] = s30, s31, s32, s33


@njit(cache=True, nogil=True)
def _tile_rows(fmt, wq, ws, lut, x, out, r0, r1):
    """out[:, r0:r1] for batch >= 2 (q4_0/q8_0).

    Row tiles are the outer loop so each weight row is streamed front to back (friendlier to
    the hardware prefetcher than hopping between rows per column chunk; measured faster at
    batch 4 and equal at batch 32).  Short row tiles leave stale rows in the scratch tile;
    their sums are computed and dropped.
    """
    b = x.shape[0]
    nb = ws.shape[1]
    tile = np.zeros((TILE_ROWS, TILE_COLS), dtype=np.float32)  # [4, TILE_COLS]
    acc = np.empty((4, TILE_ROWS), dtype=np.float32)  # [batch 4, rows 4]
    out[:, r0:r1] = 0.0
    for r in range(r0, r1, TILE_ROWS):
        nr = min(TILE_ROWS, r1 - r)
        for k0 in range(0, nb, TILE_COLS // QK):
            k1 = min(nb, k0 + TILE_COLS // QK)
            n = (k1 - k0) * QK
            c0 = k0 * QK
            _dequant_tile(fmt, wq, ws, lut, r, nr, k0, k1, tile)
            for bi in range(0, b, 4):
                _micro4x4(
                    tile[0],
                    tile[1],
                    tile[2],
                    tile[3],
                    x[bi, c0:],
                    x[min(bi + 1, b - 1), c0:],
                    x[min(bi + 2, b - 1), c0:],
                    x[min(bi + 3, b - 1), c0:],
                    n,
                    acc,
                )
                for u in range(min(4, b - bi)):
                    for i in range(nr):
                        out[bi + u, r + i] += acc[u, i]


# ---------------------------------------------------------------------------------------------
# f32 / bf16: float64 accumulation


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _f32_dot(w, x64row):
    s = 0.0
    for j in range(w.shape[0]):
        s += np.float64(w[j]) * x64row[j]
    return s


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _bf16_dot(w, x64row):
    s = 0.0
    for j in range(w.shape[0]):
        wf = np.uint32(np.uint32(w[j]) << 16).view(np.float32)
        s += np.float64(wf) * x64row[j]
    return s


@njit(cache=True, nogil=True)
def _float_rows(fmt, wq, x64, out, r0, r1):
    for r in range(r0, r1):
        for bi in range(x64.shape[0]):
            if fmt == FMT_BF16:
                out[bi, r] = _bf16_dot(wq[r].view(np.uint16), x64[bi])
            else:
                out[bi, r] = _f32_dot(wq[r].view(np.float32), x64[bi])
