"""Numba kernels behind `moe.quant`: matmul and fused expert FFN on packed weight bytes.

Entry points (called by `moe.quant` only): `matmul_kernel` and `expert_ffn_kernel`.  They
take the packed bytes as one read-only uint8 array plus its layout numbers, and slice each
matrix into two 2-D views (`_matrix_views`; `moe.quant`'s docstring has the byte layout):

* ``wq`` uint8 [rows, row_bytes]: per-row payload (q4_0 nibbles, q8_0 int8, raw f32/bf16);
* ``ws`` uint16 [rows, cols // 32]: per-block float16 scales ([rows, 0] for f32/bf16).

Activations stay float32 (no Q8 activation quantisation as in llama.cpp).  An int8 path
(Q8 activations, int32 block sums: LLVM emits vpmaddwd/vpdpwssd) measured no faster at
batch 1 than the float path below and added ~5e-3 relative error, so it was dropped.

Three kernel shapes:

* batch 1, q4_0/q8_0 (`_q4_dot4`, `_q8_dot4`): one pass over four rows; each 32-byte group
  is unpacked with a mask/shift on contiguous bytes, converted to float and FMA'd against x
  in zmm registers.  A block's sum of q * x is scaled by its d once, and q4_0's -8 offset is
  applied once per block as -8 * d * sum(x over the block) (`_block_sums`): two vector ops
  per weight instead of four (measured 1.17x at 768 x 2048, one thread).
* batch >= 2, q4_0/q8_0 (`_tile_rows`): a 4-row x 2048-column tile is dequantised into a
  float32 scratch (32 KiB), then a 4x4 (rows x batch) register-tiled micro-kernel runs
  over it.
* f32/bf16 (`_float_rows`): plain dot products accumulated in float64, so these formats are
  accurate to float32 rounding (they back the exactness tests).

Notes for whoever edits these loops (checked with ``inspect_asm``):

* Nibble ops are cast back to uint8 (``np.uint8(v & 15)``); numba otherwise types them as
  int64 and LLVM vectorises with 8-lane qword converts, roughly halving throughput.
* Inner loops index 1-D row views from 0; offsets LLVM cannot prove non-negative keep
  numba's negative-index wraparound select alive and the loop stays scalar.
* A 32-trip inner loop must touch two blocks (see `_q8_dot`); with one, LLVM unrolls it
  and vectorises the outer loop with gathers instead.
* ``_FASTMATH`` only licenses reassociating the float sums.  In the batch >= 2 tiles each
  dequantised weight is ``d * (q - 8)`` / ``d * q`` in float32, bit-identical to
  ``gguf.quants.dequantize``; the batch-1 dots factor d (and the -8) out of each block's sum,
  which changes only the float32 rounding.
"""

import os

import numpy as np
from numba import njit, prange

# GNU OpenMP (numba's default threading layer here) spins at barriers by default.  On a
# shared or oversubscribed box (other processes, or this process's own SSD reader threads)
# the spinning starves the team thread it waits for: measured here under load, a 2.6 MB
# Qwen3 expert took a median 3-16 ms instead of 0.5 ms, p90 20-40 ms.  PASSIVE makes waiting
# threads sleep (median 0.48 ms, p90 0.55 ms under the same load) at the cost of a futex
# wake per parallel region on an idle machine.  libgomp reads this once, when numba first
# starts its pool, so set it before the first parallel kernel call; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FMT_F32 = 0
FMT_BF16 = 1
FMT_Q8_0 = 2
FMT_Q4_0 = 3

QK = 32  # weights per quantisation block
TILE_ROWS = 4  # rows per dequantised tile (micro-kernel height)
TILE_COLS = 2048  # columns per tile; a multiple of 64 so q4_0 block pairs never straddle
ROWS_PER_ITEM = 16  # rows per parallel work item (a multiple of TILE_ROWS)

# Only reassociation (to vectorise the float sums) and FMA contraction: no nnan/ninf, so
# inf/nan in weights or activations propagate as in the numpy reference.
_FASTMATH = {"reassoc", "contract"}
_EIGHT = np.float32(8.0)
_ZERO = np.float32(0.0)

# float16 bit pattern -> float32 value, exact (subnormals, inf and nan included).
F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# batch 1: one pass per row


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q4_dot(wrow, srow, lut, xrow, xsum):
    """Dot of one packed Q4_0 row (pair-interleaved nibbles) with float32 x [cols];
    xsum [cols // 32]: x summed per block (`_block_sums`)."""
    nb = srow.shape[0]
    npair = nb // 2
    acc = _ZERO
    for p in range(npair):
        o = p * 32
        ta = tb = _ZERO
        for j in range(32):
            v = wrow[o + j]
            ta += np.float32(np.uint8(v & 15)) * xrow[2 * o + j]  # block 2p, weight j
            tb += np.float32(np.uint8(v >> 4)) * xrow[2 * o + 32 + j]  # block 2p+1
        acc += lut[srow[2 * p]] * (ta - _EIGHT * xsum[2 * p])
        acc += lut[srow[2 * p + 1]] * (tb - _EIGHT * xsum[2 * p + 1])
    if nb & 1:
        acc += _q4_tail_dot(wrow[npair * 32 :], lut[srow[nb - 1]], xrow[npair * 64 :])
    return acc


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q4_tail_dot(tail, d, xt):
    """Dot of a trailing odd Q4_0 block (ggml order: byte j = q[j] | q[j+16] << 4)."""
    s = _ZERO
    for j in range(16):
        v = tail[j]
        s += (np.float32(np.uint8(v & 15)) - _EIGHT) * xt[j]
        s += (np.float32(np.uint8(v >> 4)) - _EIGHT) * xt[16 + j]
    return d * s


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q8_dot(wrow, srow, lut, xrow):
    """Dot of one packed Q8_0 row with float32 x [cols]; blocks are taken two at a time."""
    nb = srow.shape[0]
    acc = _ZERO
    for p in range(nb // 2):
        o = p * 64
        ta = tb = _ZERO
        for j in range(32):
            ta += np.float32(np.int8(wrow[o + j])) * xrow[o + j]
            tb += np.float32(np.int8(wrow[o + 32 + j])) * xrow[o + 32 + j]
        acc += lut[srow[2 * p]] * ta + lut[srow[2 * p + 1]] * tb
    if nb & 1:
        o = (nb - 1) * QK
        acc += _q8_tail_dot(wrow[o:], lut[srow[nb - 1]], xrow[o:])
    return acc


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q4_dot4(w0, w1, w2, w3, s0, s1, s2, s3, lut, xrow, xsum):
    """`_q4_dot` for four rows at once: x is loaded once per four rows."""
    nb = s0.shape[0]
    npair = nb // 2
    a0 = a1 = a2 = a3 = _ZERO
    for p in range(npair):
        o = p * 32
        k = 2 * p
        t0a = t0b = t1a = t1b = t2a = t2b = t3a = t3b = _ZERO
        for j in range(32):
            xa = xrow[2 * o + j]  # block 2p
            xb = xrow[2 * o + 32 + j]  # block 2p+1
            v = w0[o + j]
            t0a += np.float32(np.uint8(v & 15)) * xa
            t0b += np.float32(np.uint8(v >> 4)) * xb
            v = w1[o + j]
            t1a += np.float32(np.uint8(v & 15)) * xa
            t1b += np.float32(np.uint8(v >> 4)) * xb
            v = w2[o + j]
            t2a += np.float32(np.uint8(v & 15)) * xa
            t2b += np.float32(np.uint8(v >> 4)) * xb
            v = w3[o + j]
            t3a += np.float32(np.uint8(v & 15)) * xa
            t3b += np.float32(np.uint8(v >> 4)) * xb
        xa8 = _EIGHT * xsum[k]  # the -8 offset of every weight in block 2p, applied once
        xb8 = _EIGHT * xsum[k + 1]
        a0 += lut[s0[k]] * (t0a - xa8) + lut[s0[k + 1]] * (t0b - xb8)
        a1 += lut[s1[k]] * (t1a - xa8) + lut[s1[k + 1]] * (t1b - xb8)
        a2 += lut[s2[k]] * (t2a - xa8) + lut[s2[k + 1]] * (t2b - xb8)
        a3 += lut[s3[k]] * (t3a - xa8) + lut[s3[k + 1]] * (t3b - xb8)
    if nb & 1:
        o = npair * 32
        xt = xrow[npair * 64 :]
        a0 += _q4_tail_dot(w0[o:], lut[s0[nb - 1]], xt)
        a1 += _q4_tail_dot(w1[o:], lut[s1[nb - 1]], xt)
        a2 += _q4_tail_dot(w2[o:], lut[s2[nb - 1]], xt)
        a3 += _q4_tail_dot(w3[o:], lut[s3[nb - 1]], xt)
    return a0, a1, a2, a3


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q8_dot4(w0, w1, w2, w3, s0, s1, s2, s3, lut, xrow):
    """`_q8_dot` for four rows at once."""
    nb = s0.shape[0]
    a0 = a1 = a2 = a3 = _ZERO
    for p in range(nb // 2):
        o = p * 64
        k = 2 * p
        t0a = t0b = t1a = t1b = t2a = t2b = t3a = t3b = _ZERO
        for j in range(32):
            xa = xrow[o + j]
            xb = xrow[o + 32 + j]
            t0a += np.float32(np.int8(w0[o + j])) * xa
            t0b += np.float32(np.int8(w0[o + 32 + j])) * xb
            t1a += np.float32(np.int8(w1[o + j])) * xa
            t1b += np.float32(np.int8(w1[o + 32 + j])) * xb
            t2a += np.float32(np.int8(w2[o + j])) * xa
            t2b += np.float32(np.int8(w2[o + 32 + j])) * xb
            t3a += np.float32(np.int8(w3[o + j])) * xa
            t3b += np.float32(np.int8(w3[o + 32 + j])) * xb
        a0 += lut[s0[k]] * t0a + lut[s0[k + 1]] * t0b
        a1 += lut[s1[k]] * t1a + lut[s1[k + 1]] * t1b
        a2 += lut[s2[k]] * t2a + lut[s2[k + 1]] * t2b
        a3 += lut[s3[k]] * t3a + lut[s3[k + 1]] * t3b
    if nb & 1:
        o = (nb - 1) * QK
        xt = xrow[o:]
        a0 += _q8_tail_dot(w0[o:], lut[s0[nb - 1]], xt)
        a1 += _q8_tail_dot(w1[o:], lut[s1[nb - 1]], xt)
        a2 += _q8_tail_dot(w2[o:], lut[s2[nb - 1]], xt)
        a3 += _q8_tail_dot(w3[o:], lut[s3[nb - 1]], xt)
    return a0, a1, a2, a3


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _q8_tail_dot(tail, d, xt):
    s = _ZERO
    for j in range(QK):
        s += np.float32(np.int8(tail[j])) * xt[j]
    return d * s


@njit(cache=True, nogil=True)
def _b1_rows(fmt, wq, ws, lut, x, xsum, out, r0, r1):
    """out[0, r0:r1] for batch 1 (q4_0/q8_0): four rows per pass, then single rows."""
    xrow = x[0]
    r = r0
    while r + 4 <= r1:
        w0, w1, w2, w3 = wq[r], wq[r + 1], wq[r + 2], wq[r + 3]
        s0, s1, s2, s3 = ws[r], ws[r + 1], ws[r + 2], ws[r + 3]
        if fmt == FMT_Q4_0:
            y = _q4_dot4(w0, w1, w2, w3, s0, s1, s2, s3, lut, xrow, xsum)
        else:
            y = _q8_dot4(w0, w1, w2, w3, s0, s1, s2, s3, lut, xrow)
        out[0, r], out[0, r + 1], out[0, r + 2], out[0, r + 3] = y
        r += 4
    for rr in range(r, r1):
        if fmt == FMT_Q4_0:
            out[0, rr] = _q4_dot(wq[rr], ws[rr], lut, xrow, xsum)
        else:
            out[0, rr] = _q8_dot(wq[rr], ws[rr], lut, xrow)


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


# ---------------------------------------------------------------------------------------------
# drivers
#
# No njit function here calls a parallel=True function: with cache=True that combination
# segfaults when loaded from numba's cache (numba issues #4807, #8578; reproduced here).  So
# the two parallel=True entry points are called from Python only, and share the serial
# helpers above.


@njit(cache=True, nogil=True)
def _rows(fmt, wq, ws, lut, x, x64, xsum, out, r0, r1):
    """Compute out[:, r0:r1] on the calling thread."""
    if fmt == FMT_F32 or fmt == FMT_BF16:
        _float_rows(fmt, wq, x64, out, r0, r1)
    elif x.shape[0] == 1:
        _b1_rows(fmt, wq, ws, lut, x, xsum, out, r0, r1)
    else:
        _tile_rows(fmt, wq, ws, lut, x, out, r0, r1)


@njit(cache=True, nogil=True)
def _matrix_views(data, rows, cols, row_bytes, scale_off):
    """Payload uint8 [rows, row_bytes] and scales uint16 [rows, cols // 32] of one packed
    matrix (scale_off < 0: no scales, f32/bf16)."""
    wq = data[: rows * row_bytes].reshape((rows, row_bytes))
    if scale_off >= 0:
        nb = cols // QK
        ws = data[scale_off : scale_off + rows * nb * 2].view(np.uint16).reshape((rows, nb))
    else:
        ws = np.empty((rows, 0), dtype=np.uint16)
    return wq, ws


@njit(cache=True, nogil=True)
def _x64(fmt, x):
    """float64 copy of x for the f32/bf16 kernels (an empty array otherwise)."""
    if fmt == FMT_F32 or fmt == FMT_BF16:
        return x.astype(np.float64)  # [b, cols]
    return np.empty((0, 0), dtype=np.float64)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _block_sums(fmt, x):
    """float32 [nb]: x[0] summed per 32-column block, for the batch-1 q4_0 kernels (the
    weights' -8 offset is applied once per block as -8 * d * sum(x)); empty otherwise."""
    if fmt != FMT_Q4_0 or x.shape[0] != 1:
        return np.empty(0, dtype=np.float32)
    nb = x.shape[1] // QK
    xs = np.empty(nb, dtype=np.float32)  # [nb]
    for k in range(nb):
        s = _ZERO
        for j in range(QK):
            s += x[0, k * QK + j]
        xs[k] = s
    return xs


@njit(cache=True, nogil=True)
def _item(it, rows):
    """Row range of parallel work item `it`."""
    r0 = it * ROWS_PER_ITEM
    return r0, min(rows, r0 + ROWS_PER_ITEM)


@njit(cache=True, nogil=True)
def _silu_mul(g, u):
    """silu(g) * u elementwise, float32 [b, inter] (computed in float64)."""
    h = np.empty_like(g)  # [b, inter]
    for i in range(g.shape[0]):
        for j in range(g.shape[1]):
            gv = np.float64(g[i, j])
            h[i, j] = gv / (1.0 + np.exp(-gv)) * np.float64(u[i, j])
    return h


@njit(cache=True, nogil=True, parallel=True)
def matmul_kernel(fmt, data, rows, cols, row_bytes, scale_off, lut, x):
    """x float32 [b, cols] -> float32 [b, rows] = x @ W.T for the packed matrix in data.

    Rows are split across numba's threads in ROWS_PER_ITEM work items (the caller sets
    numba.set_num_threads(1) for matrices too small to pay for waking the pool).
    """
    wq, ws = _matrix_views(data, rows, cols, row_bytes, scale_off)
    out = np.empty((x.shape[0], rows), dtype=np.float32)  # [b, rows]
    x64 = _x64(fmt, x)
    xsum = _block_sums(fmt, x)
    for it in prange((rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
        r0, r1 = _item(it, rows)
        _rows(fmt, wq, ws, lut, x, x64, xsum, out, r0, r1)
    return out


@njit(cache=True, nogil=True)
def _expert_views(record, hidden, inter, layout):
    n_gu, rb_gu, s_gu, rb_d, s_d = layout
    gq, gs = _matrix_views(record[:n_gu], inter, hidden, rb_gu, s_gu)
    uq, us = _matrix_views(record[n_gu : 2 * n_gu], inter, hidden, rb_gu, s_gu)
    dq, ds = _matrix_views(record[2 * n_gu :], hidden, inter, rb_d, s_d)
    return gq, gs, uq, us, dq, ds


@njit(cache=True, nogil=True, parallel=True)
def expert_ffn_kernel(fmt, record, hidden, inter, layout, lut, x):
    """(silu(x @ gate.T) * (x @ up.T)) @ down.T for x float32 [b, hidden] -> [b, hidden].

    layout = (gate/up matrix bytes, their row bytes, their scale offset, down row bytes,
    down scale offset), as computed by `moe.quant`.  Gate and up rows share one parallel
    region, down rows a second; the [b, inter] activation stays float32.
    """
    gq, gs, uq, us, dq, ds = _expert_views(record, hidden, inter, layout)
    b = x.shape[0]
    x64 = _x64(fmt, x)
    xsum = _block_sums(fmt, x)
    g = np.empty((b, inter), dtype=np.float32)  # [b, inter]
    u = np.empty((b, inter), dtype=np.float32)  # [b, inter]
    n_items = (inter + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    for it in prange(2 * n_items):
        if it < n_items:
            r0, r1 = _item(it, inter)
            _rows(fmt, gq, gs, lut, x, x64, xsum, g, r0, r1)
        else:
            r0, r1 = _item(it - n_items, inter)
            _rows(fmt, uq, us, lut, x, x64, xsum, u, r0, r1)
    h = _silu_mul(g, u)  # [b, inter]
    h64 = _x64(fmt, h)
    hsum = _block_sums(fmt, h)
    y = np.empty((b, hidden), dtype=np.float32)  # [b, hidden]
    for it in prange((hidden + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
        r0, r1 = _item(it, hidden)
        _rows(fmt, dq, ds, lut, h, h64, hsum, y, r0, r1)
    return y


@njit(cache=True, nogil=True)
def _expert_b1(fmt, record, hidden, inter, layout, lut, x, y):
    """One expert on the calling thread, batch 1: x float32 [1, hidden] -> y [hidden]."""
    gq, gs, uq, us, dq, ds = _expert_views(record, hidden, inter, layout)
    x64 = _x64(fmt, x)
    xsum = _block_sums(fmt, x)
    g = np.empty((1, inter), dtype=np.float32)  # [1, inter]
    u = np.empty((1, inter), dtype=np.float32)  # [1, inter]
    _rows(fmt, gq, gs, lut, x, x64, xsum, g, 0, inter)
    _rows(fmt, uq, us, lut, x, x64, xsum, u, 0, inter)
    h = _silu_mul(g, u)  # [1, inter]
    out = np.empty((1, hidden), dtype=np.float32)  # [1, hidden]
    _rows(fmt, dq, ds, lut, h, _x64(fmt, h), _block_sums(fmt, h), out, 0, hidden)
    y[:] = out[0]


@njit(cache=True, nogil=True, parallel=True)
def experts_b1_kernel(fmt, arena, offsets, nbytes, hidden, inter, layout, lut, x):
    """Several experts at batch 1 in one parallel region: expert e is the record at
    arena[offsets[e] : offsets[e] + nbytes], applied to x[e] (float32 [m, hidden]) -> [m, hidden].

    Whole experts are split across the threads, so a decode layer pays for one wake-up of
    numba's pool instead of two per expert (`expert_ffn_kernel`), and each thread streams
    its own records: measured 1.33x faster for 16 cold 2.65 MB experts on 2 threads.
    Results are bit-identical to `expert_ffn_kernel` at batch 1 (same row kernels).
    """
    m = offsets.shape[0]
    y = np.empty((m, hidden), dtype=np.float32)  # [m, hidden]
    for e in prange(m):
        record = arena[offsets[e] : offsets[e] + nbytes]
        _expert_b1(fmt, record, hidden, inter, layout, lut, x[e : e + 1], y[e])
    return y
