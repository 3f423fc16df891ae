"""Weight formats, the on-disk/kernel byte layout, and matmul / expert FFN on packed bytes.

Formats: ``f32``, ``bf16``, ``q8_0``, ``q4_0``.  `quantize` / `dequantize` produce and read
ggml's byte order and delegate to ``gguf.quants`` so they are bit-identical to it by
construction.  `pack` writes the *kernel layout*, which is also the on-disk layout; it holds
exactly the same bits as ggml (`unpack_to_ggml` proves it) but arranged for the kernels:

Matrix layout (``rows x cols``; every section starts at a multiple of 64 bytes and the
matrix is zero-padded to a multiple of 64 bytes):

* ``f32``:  rows x cols little-endian float32, row-major.
* ``bf16``: rows x cols uint16 (upper half of the float32), row-major.
* ``q8_0``: ``qs`` int8 [rows, cols], then ``d`` float16 [rows, cols // 32].
* ``q4_0``: ``qs`` uint8 [rows, cols // 2], then ``d`` float16 [rows, cols // 32].
  Within a row, blocks are taken in pairs (2p, 2p+1) and stored as 32 bytes where byte j is
  ``q[2p][j] | q[2p+1][j] << 4`` (q = the unsigned 4-bit codes 0..15, value = d * (q - 8)),
  so one block unpacks with a single shift + mask over 32 contiguous bytes.  A trailing odd
  block keeps ggml's 16-byte order (byte j = ``q[j] | q[j + 16] << 4``).

Scales are separated from the payload so payload rows are contiguous and vector-friendly.
Sizes per weight equal ggml's (4.5 bits for q4_0, 8.5 for q8_0) apart from section padding.

Expert record (`pack_expert`): gate [inter, hidden], up [inter, hidden], down [hidden, inter],
each a matrix in the layout above, back to back (each starts at a multiple of 64 bytes).
"""

import time

import numpy as np
from gguf import GGMLQuantizationType, quants

from moe import kernels

FORMATS = ("f32", "bf16", "q8_0", "q4_0")

_QTYPE = {
    "f32": GGMLQuantizationType.F32,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}
_FMT_CODE = {
    "f32": kernels.FMT_F32,
    "bf16": kernels.FMT_BF16,
    "q8_0": kernels.FMT_Q8_0,
    "q4_0": kernels.FMT_Q4_0,
}
QK = kernels.QK
ALIGN = 64
# Below this many weights a matrix is computed on one thread: waking the pool costs more.
PARALLEL_MIN_WEIGHTS = 1 << 16


def _check_fmt(fmt: str) -> None:
    if fmt not in _QTYPE:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


def _check_dims(fmt: str, rows: int, cols: int) -> None:
    _check_fmt(fmt)
    if rows <= 0 or cols <= 0:
        raise ValueError(f"matrix shape must be positive, got ({rows}, {cols})")
    if fmt in ("q8_0", "q4_0") and cols % QK:
        raise ValueError(f"{fmt} needs cols to be a multiple of {QK}, got cols={cols}")


def _check_matrix(w: np.ndarray, fmt: str) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {w.shape}")
    _check_dims(fmt, *w.shape)
    return np.ascontiguousarray(w, dtype=np.float32)


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _payload_bytes(fmt: str, cols: int) -> int:
    """Bytes per row of the payload section."""
    return {"f32": 4 * cols, "bf16": 2 * cols, "q8_0": cols, "q4_0": cols // 2}[fmt]


def _sections(fmt: str, rows: int, cols: int) -> tuple[int, int, int]:
    """(payload bytes, scale section offset, scale bytes) of one packed matrix."""
    payload = rows * _payload_bytes(fmt, cols)
    scales = rows * (cols // QK) * 2 if fmt in ("q8_0", "q4_0") else 0
    return payload, _pad(payload), scales


def packed_nbytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of one rows x cols matrix in the kernel/disk layout (a multiple of 64)."""
    _check_dims(fmt, rows, cols)
    _, s_off, s_bytes = _sections(fmt, rows, cols)
    return _pad(s_off + s_bytes)


# ---------------------------------------------------------------------------------------------
# ggml byte order (reference)


def quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [rows, cols] -> uint8 ggml bytes [rows, row_bytes], identical to gguf's."""
    w = _check_matrix(w, fmt)
    q = quants.quantize(w, _QTYPE[fmt])
    return np.ascontiguousarray(q).view(np.uint8).reshape(w.shape[0], -1)  # [rows, row_bytes]


def dequantize(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """ggml bytes -> float32 [rows, cols], identical to gguf's."""
    rows, cols = shape
    _check_dims(fmt, rows, cols)
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    want = rows * _ggml_row_bytes(fmt, cols)
    if raw.size != want:
        raise ValueError(f"{fmt} {rows}x{cols} needs {want} ggml bytes, got {raw.size}")
    if fmt == "f32":
        return raw.view(np.float32).reshape(rows, cols).copy()
    out = quants.dequantize(raw.reshape(rows, -1), _QTYPE[fmt])
    return np.asarray(out, dtype=np.float32).reshape(rows, cols)


def _ggml_row_bytes(fmt: str, cols: int) -> int:
    return {"f32": 4 * cols, "bf16": 2 * cols, "q8_0": cols // QK * 34, "q4_0": cols // QK * 18}[
        fmt
    ]


# ---------------------------------------------------------------------------------------------
# kernel layout


def _q4_codes_to_pairs(codes: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit codes [rows, nb, 32] -> pair-interleaved payload [rows, nb * 16]."""
    rows, nb, _ = codes.shape
    npair = nb // 2
    out = np.empty((rows, nb * 16), dtype=np.uint8)  # [rows, cols // 2]
    pairs = codes[:, : 2 * npair].reshape(rows, npair, 2, QK)  # [rows, npair, 2, 32]
    out[:, : npair * 32] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(rows, -1)
    if nb & 1:
        tail = codes[:, -1]  # [rows, 32]
        out[:, npair * 32 :] = tail[:, :16] | (tail[:, 16:] << 4)
    return out


def _q4_pairs_to_codes(payload: np.ndarray, nb: int) -> np.ndarray:
    """Inverse of `_q4_codes_to_pairs`: [rows, nb * 16] -> codes [rows, nb, 32]."""
    rows = payload.shape[0]
    npair = nb // 2
    codes = np.empty((rows, nb, QK), dtype=np.uint8)  # [rows, nb, 32]
    pairs = payload[:, : npair * 32].reshape(rows, npair, QK)  # [rows, npair, 32]
    codes[:, 0 : 2 * npair : 2] = pairs & 15
    codes[:, 1 : 2 * npair : 2] = pairs >> 4
    if nb & 1:
        tail = payload[:, npair * 32 :]  # [rows, 16]
        codes[:, -1, :16] = tail & 15
        codes[:, -1, 16:] = tail >> 4
    return codes


def pack(w: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [packed_nbytes] in the kernel/disk layout."""
    w = _check_matrix(w, fmt)
    rows, cols = w.shape
    return _ggml_to_packed(quantize(w, fmt), fmt, rows, cols)


def _ggml_to_packed(g: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    out = np.zeros(packed_nbytes(fmt, rows, cols), dtype=np.uint8)
    payload, s_off, s_bytes = _sections(fmt, rows, cols)
    nb = cols // QK
    if fmt in ("f32", "bf16"):
        out[:payload] = g.reshape(-1)
        return out
    block_bytes = 34 if fmt == "q8_0" else 18
    blocks = g.reshape(rows, nb, block_bytes)  # [rows, nb, block_bytes]
    out[s_off : s_off + s_bytes] = blocks[:, :, :2].reshape(-1)
    qs = blocks[:, :, 2:]  # [rows, nb, 32 or 16]
    if fmt == "q8_0":
        out[:payload] = qs.reshape(-1)
    else:
        codes = np.concatenate([qs & 15, qs >> 4], axis=2)  # [rows, nb, 32]
        out[:payload] = _q4_codes_to_pairs(codes).reshape(-1)
    return out


def unpack_to_ggml(data: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """Kernel layout -> ggml bytes [rows, row_bytes] (the inverse of the layout step of `pack`)."""
    wq, ws = _views(data, fmt, rows, cols)
    if fmt in ("f32", "bf16"):
        return wq.copy()
    nb = cols // QK
    d = ws.view(np.uint8).reshape(rows, nb, 2)  # [rows, nb, 2]
    if fmt == "q8_0":
        qs = wq.reshape(rows, nb, QK)  # [rows, nb, 32]
    else:
        codes = _q4_pairs_to_codes(wq, nb)  # [rows, nb, 32]
        qs = codes[:, :, :16] | (codes[:, :, 16:] << 4)  # [rows, nb, 16]
    return np.concatenate([d, qs], axis=2).reshape(rows, -1)  # [rows, row_bytes]


def _views(data: np.ndarray, fmt: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated kernel views: payload uint8 [rows, row_bytes], scales uint16 [rows, nb]."""
    _check_dims(fmt, rows, cols)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError("packed weights must be a 1-D uint8 numpy array")
    want = packed_nbytes(fmt, rows, cols)
    if data.size != want:
        raise ValueError(f"{fmt} {rows}x{cols} packs to {want} bytes, got a buffer of {data.size}")
    if not data.flags.c_contiguous:
        raise ValueError("packed weights must be contiguous")
    payload, s_off, s_bytes = _sections(fmt, rows, cols)
    wq = data[:payload].reshape(rows, _payload_bytes(fmt, cols))  # [rows, row_bytes]
    if s_bytes:
        ws = data[s_off : s_off + s_bytes].view(np.uint16).reshape(rows, cols // QK)  # [rows, nb]
    else:
        ws = np.empty((rows, 0), dtype=np.uint16)
    return wq, ws


def _check_x(x: np.ndarray, cols: int) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"x must have shape [b, {cols}], got {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# compute


def matmul(data: np.ndarray, fmt: str, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """x float32 [b, cols] -> float32 [b, rows] = x @ W.T, computed on the packed bytes.

    Activations stay float32 (no Q8 activation quantisation); q4_0/q8_0 blocks are dequantised
    16-32 weights at a time in registers, f32/bf16 are accumulated in float64.
    """
    wq, ws = _views(data, fmt, rows, cols)
    x = _check_x(x, cols)
    par = rows * cols >= PARALLEL_MIN_WEIGHTS
    return kernels.matmul_kernel(_FMT_CODE[fmt], wq, ws, kernels.F16_LUT, x, par)


def expert_record_nbytes(fmt: str, hidden: int, inter: int) -> int:
    """Bytes of one packed expert record: gate, up [inter, hidden] then down [hidden, inter]."""
    return 2 * packed_nbytes(fmt, inter, hidden) + packed_nbytes(fmt, hidden, inter)


def pack_expert(gate: np.ndarray, up: np.ndarray, down: np.ndarray, fmt: str) -> np.ndarray:
    """gate, up float32 [inter, hidden], down [hidden, inter] -> uint8 [expert_record_nbytes]."""
    gate, up, down = (_check_matrix(m, fmt) for m in (gate, up, down))
    inter, hidden = gate.shape
    if up.shape != (inter, hidden) or down.shape != (hidden, inter):
        raise ValueError(
            f"expert shapes disagree: gate {gate.shape}, up {up.shape}, down {down.shape}; "
            f"want gate/up [inter, hidden] and down [hidden, inter]"
        )
    return np.concatenate([pack(gate, fmt), pack(up, fmt), pack(down, fmt)])


def _expert_views(record: np.ndarray, fmt: str, hidden: int, inter: int) -> list[np.ndarray]:
    _check_dims(fmt, inter, hidden)
    _check_dims(fmt, hidden, inter)
    want = expert_record_nbytes(fmt, hidden, inter)
    if not isinstance(record, np.ndarray) or record.dtype != np.uint8 or record.ndim != 1:
        raise ValueError("expert record must be a 1-D uint8 numpy array")
    if record.size != want:
        raise ValueError(
            f"{fmt} expert (hidden={hidden}, inter={inter}) needs {want} bytes, "
            f"got a record of {record.size}"
        )
    n_gu = packed_nbytes(fmt, inter, hidden)
    gq, gs = _views(record[:n_gu], fmt, inter, hidden)
    uq, us = _views(record[n_gu : 2 * n_gu], fmt, inter, hidden)
    dq, ds = _views(record[2 * n_gu :], fmt, hidden, inter)
    return [gq, gs, uq, us, dq, ds]


def expert_ffn(record: np.ndarray, fmt: str, hidden: int, inter: int, x: np.ndarray) -> np.ndarray:
    """x float32 [b, hidden] -> [b, hidden] = (silu(x@gate.T) * (x@up.T)) @ down.T.

    One kernel call on the packed record; the intermediate [b, inter] stays float32.
    """
    views = _expert_views(record, fmt, hidden, inter)
    x = _check_x(x, hidden)
    par = inter * hidden >= PARALLEL_MIN_WEIGHTS
    return kernels.expert_ffn_kernel(_FMT_CODE[fmt], *views, kernels.F16_LUT, x, par)


def warmup() -> float:
    """Compile (or load from numba's cache) every kernel for every format; returns seconds."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    hidden, inter = 64, 96  # odd number of q4_0 blocks in `down` rows exercises the tail path
    for fmt in FORMATS:
        gate, up = rng.standard_normal((2, inter, hidden), dtype=np.float32)
        down = rng.standard_normal((hidden, inter), dtype=np.float32)
        rec = pack_expert(gate, up, down, fmt)
        x = rng.standard_normal((2, hidden), dtype=np.float32)
        expert_ffn(rec, fmt, hidden, inter, x)
        views = _expert_views(rec, fmt, hidden, inter)
        for par in (False, True):
            kernels.matmul_kernel(_FMT_CODE[fmt], views[0], views[1], kernels.F16_LUT, x, par)
            kernels.expert_ffn_kernel(_FMT_CODE[fmt], *views, kernels.F16_LUT, x, par)
    return time.perf_counter() - t0
