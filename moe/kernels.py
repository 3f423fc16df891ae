"""Numba kernels behind `moe.quant`: matmul and fused expert FFN on packed weight bytes.

Every weight matrix reaches a kernel as two 2-D views built by `moe.quant` (see its docstring
for the byte layout):

* ``wq`` uint8 [rows, row_bytes]: the per-row payload (nibbles, int8 or raw f32/bf16 bytes);
* ``ws`` uint16 [rows, cols // 32]: the per-block f16 scales (an empty [rows, 0] for f32/bf16).

The quantised kernels dequantise one 32-weight block into a small float32 scratch vector and
FMA it into per-lane accumulators ``acc[b, 16]``; the lanes are only summed at the end of a
row.  Keeping the activations in float32 (instead of quantising them to Q8 like llama.cpp)
costs some throughput at large batch but adds no activation-quantisation error, and with
per-lane accumulators there is no horizontal reduction per block, so LLVM turns the inner
loops into plain ymm/zmm convert+FMA code.  ``fastmath`` is on for those loops only to let
LLVM reassociate the lane sums; the dequantised weights themselves are bit-identical to
``gguf.quants.dequantize`` (``d * (q - 8)`` / ``d * q`` in float32).

f32/bf16 rows are dotted in float64 so those formats stay accurate to float32 rounding (they
back the exactness tests).

Rows are split across threads in chunks (`prange`) so scratch buffers are allocated once per
chunk, not once per row.
"""

import numpy as np
from numba import njit, prange

FMT_F32 = 0
FMT_BF16 = 1
FMT_Q8_0 = 2
FMT_Q4_0 = 3

QK = 32  # weights per quantisation block
LANES = 16  # float32 accumulator lanes per batch row (one zmm / two ymm)
ROW_CHUNK = 16  # rows per parallel work item

_EIGHT = np.float32(8.0)

# float16 bit pattern -> float32 value, exact (ties, subnormals, inf and nan included).
F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, nogil=True, fastmath=True)
def _q4_row(wrow, srow, lut, x, acc, wdeq, out, r):
    """out[:, r] = x @ row for one Q4_0 row in the pair-interleaved layout."""
    b = x.shape[0]
    nb = srow.shape[0]
    npaired = nb - (nb & 1)
    acc[:, :] = 0.0  # [b, LANES]
    for k in range(nb):
        d = lut[srow[k]]
        o = (k >> 1) * 32
        if k < npaired:
            # blocks 2p and 2p+1 share 32 bytes: low nibbles = block 2p, high = block 2p+1
            sh = (k & 1) * 4
            for j in range(QK):
                q = np.float32((np.int32(wrow[o + j]) >> sh) & 15)
                wdeq[j] = d * (q - _EIGHT)  # [32]
        else:
            # odd tail block keeps ggml's order: byte j = q[j] | q[j + 16] << 4
            for j in range(16):
                v = np.int32(wrow[o + j])
                wdeq[j] = d * (np.float32(v & 15) - _EIGHT)
                wdeq[j + 16] = d * (np.float32(v >> 4) - _EIGHT)
        xo = k * QK
        for bi in range(b):
            for j in range(LANES):
                acc[bi, j] += wdeq[j] * x[bi, xo + j] + wdeq[j + LANES] * x[bi, xo + LANES + j]
    for bi in range(b):
        out[bi, r] = acc[bi].sum()


@njit(cache=True, nogil=True, fastmath=True)
def _q8_row(wrow, srow, lut, x, acc, wdeq, out, r):
    """out[:, r] = x @ row for one Q8_0 row (int8 weights, one f16 scale per 32)."""
    b = x.shape[0]
    nb = srow.shape[0]
    acc[:, :] = 0.0  # [b, LANES]
    for k in range(nb):
        d = lut[srow[k]]
        o = k * QK
        for j in range(QK):
            wdeq[j] = d * np.float32(np.int8(wrow[o + j]))  # [32]
        for bi in range(b):
            for j in range(LANES):
                acc[bi, j] += wdeq[j] * x[bi, o + j] + wdeq[j + LANES] * x[bi, o + LANES + j]
    for bi in range(b):
        out[bi, r] = acc[bi].sum()


@njit(cache=True, nogil=True, fastmath=True)
def _f32_row(wrow, x64, out, r):
    """out[:, r] = x @ row for a float32 row, accumulated in float64."""
    w = wrow.view(np.float32)  # [cols]
    for bi in range(x64.shape[0]):
        s = 0.0
        for j in range(w.shape[0]):
            s += np.float64(w[j]) * x64[bi, j]
        out[bi, r] = s


@njit(cache=True, nogil=True, fastmath=True)
def _bf16_row(wrow, x64, out, r):
    """out[:, r] = x @ row for a bf16 row (upper halves of float32), accumulated in float64."""
    w = wrow.view(np.uint16)  # [cols]
    for bi in range(x64.shape[0]):
        s = 0.0
        for j in range(w.shape[0]):
            wf = np.uint32(np.uint32(w[j]) << 16).view(np.float32)
            s += np.float64(wf) * x64[bi, j]
        out[bi, r] = s


@njit(cache=True, nogil=True)
def _rows(fmt, wq, ws, lut, x, x64, out, r0, r1):
    """Compute out[:, r0:r1] serially; scratch is allocated once for the whole range."""
    acc = np.empty((x.shape[0], LANES), dtype=np.float32)
    wdeq = np.empty(QK, dtype=np.float32)
    for r in range(r0, r1):
        if fmt == FMT_Q4_0:
            _q4_row(wq[r], ws[r], lut, x, acc, wdeq, out, r)
        elif fmt == FMT_Q8_0:
            _q8_row(wq[r], ws[r], lut, x, acc, wdeq, out, r)
        elif fmt == FMT_BF16:
            _bf16_row(wq[r], x64, out, r)
        else:
            _f32_row(wq[r], x64, out, r)


@njit(cache=True, nogil=True, parallel=True)
def _rows_parallel(fmt, wq, ws, lut, x, x64, out):
    rows = wq.shape[0]
    nchunks = (rows + ROW_CHUNK - 1) // ROW_CHUNK
    for c in prange(nchunks):
        _rows(fmt, wq, ws, lut, x, x64, out, c * ROW_CHUNK, min(rows, (c + 1) * ROW_CHUNK))


@njit(cache=True, nogil=True)
def matmul_kernel(fmt, wq, ws, lut, x, parallel):
    """x float32 [b, cols] -> float32 [b, rows] = x @ W.T."""
    b = x.shape[0]
    rows = wq.shape[0]
    out = np.empty((b, rows), dtype=np.float32)  # [b, rows]
    if fmt == FMT_F32 or fmt == FMT_BF16:
        x64 = x.astype(np.float64)  # [b, cols]
    else:
        x64 = np.empty((0, 0), dtype=np.float64)
    if parallel:
        _rows_parallel(fmt, wq, ws, lut, x, x64, out)
    else:
        _rows(fmt, wq, ws, lut, x, x64, out, 0, rows)
    return out


@njit(cache=True, nogil=True)
def _silu_mul(g, u):
    """silu(g) * u elementwise (float32 in, float32 out; computed in float64)."""
    h = np.empty_like(g)  # [b, inter]
    for i in range(g.shape[0]):
        for j in range(g.shape[1]):
            gv = np.float64(g[i, j])
            h[i, j] = gv / (1.0 + np.exp(-gv)) * np.float64(u[i, j])
    return h


@njit(cache=True, nogil=True)
def expert_ffn_kernel(fmt, gq, gs, uq, us, dq, ds, lut, x, parallel):
    """(silu(x @ gate.T) * (x @ up.T)) @ down.T for x float32 [b, hidden] -> [b, hidden]."""
    g = matmul_kernel(fmt, gq, gs, lut, x, parallel)  # [b, inter]
    u = matmul_kernel(fmt, uq, us, lut, x, parallel)  # [b, inter]
    h = _silu_mul(g, u)  # [b, inter]
    return matmul_kernel(fmt, dq, ds, lut, h, parallel)  # [b, hidden]
