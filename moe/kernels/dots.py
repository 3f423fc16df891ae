"""Numba kernels, part 1 of 3: shared constants and the batch-1 q4_0/q8_0 row dots.

`moe.kernels.entry` holds the entry points called from Python (and the byte layout of the
``wq``/``ws`` views these helpers receive); `moe.kernels.tiles` holds the batch >= 2 tiles and
the f32/bf16 rows.  This module also sets OMP_WAIT_POLICY (below), so it must be imported
before any parallel kernel runs; `entry` and `tiles` import it first.

Batch 1, q4_0/q8_0 (`_q4_dot4`, `_q8_dot4`): one pass over four rows; each 32-byte group is
unpacked with a mask/shift on contiguous bytes, converted to float and FMA'd against x in zmm
registers.  A block's sum of q * x is scaled by its d once, and q4_0's -8 offset is applied
once per block as -8 * d * sum(x over the block) (`entry._block_sums`): two vector ops per
weight instead of four (measured 1.17x at 768 x 2048, one thread).

Notes for whoever edits these loops (here and in `moe.kernels.tiles`; checked with
``inspect_asm``):

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
* numba's cache (``cache=True``) checks only each function's own file, yet compiles in the
  helpers and constants it imports: after editing this module or `tiles`, the cached kernels
  of `tiles` and `entry` still hold the old code.  Delete ``moe/kernels/__pycache__/*.nbi``
  and ``*.nbc`` after such an edit.
"""

import os

import numpy as np
from numba import njit

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
