"""Weight formats and their byte layout on disk and for the kernels (`quant` computes on it).

Formats: ``f32``, ``bf16``, ``q8_0``, ``q4_0``, ``mxfp4``.  `quantize` / `dequantize` produce
and read ggml's byte order and delegate to ``gguf.quants`` so they are bit-identical to it by
construction.  `pack` writes the *kernel layout*, which is also the on-disk layout; it holds
exactly the same bits as ggml (`unpack_to_ggml` proves it) but arranged for the kernels:

Matrix layout (``rows x cols``; every section starts at a multiple of 64 bytes and the
matrix is zero-padded to a multiple of 64 bytes):

* ``f32``:  rows x cols little-endian float32, row-major.
* ``bf16``: rows x cols uint16 (upper half of the float32), row-major.
* ``q8_0``, ``q4_0`` and ``mxfp4``: rows in groups of eight (a last group padded with zero
  rows), each
  group's blocks interleaved so that one 32-byte load holds the same four columns of all
  eight rows (as llama.cpp's repacked Q4_0x8 does): ``qs`` uint8 [groups, nb, chunks, 8, 4]
  then ``d`` float16 [groups, nb, 8].  Byte ``qs[g, k, c, r, i]`` is byte ``4c + i`` of ggml's
  quant bytes of block k of row 8g + r (ggml: 32 int8 codes for q8_0, c = 0..7; 16 bytes
  holding ``q[j] | q[j + 16] << 4`` for q4_0, c = 0..3, q the unsigned 4-bit codes 0..15 and
  value = d * (q - 8); mxfp4 the same nibble order, q an E2M1 code), and ``d[g, k, r]`` its
  scale (float16; mxfp4: the E8M0 byte, so ``d`` is [groups, nb, 8] uint8 there).  So a
  q4_0/mxfp4 load's low nibbles are columns 4c..4c+3 of the eight rows and its high nibbles
  columns 16+4c..16+4c+3, and the eight scales of a block are one 16-byte (8-byte) load
  (`moeshard.moe.kernels.idots` has why).  mxfp4 is ggml's MXFP4 (OCP MX: E2M1 values, one E8M0
  power-of-two scale per 32), the format published checkpoints such as Kimi K3 ship their
  experts in; its bytes are kept as published, only reordered.

Expert record (`pack_expert`): gate [inter, hidden], up [inter, hidden], down [hidden, inter],
each a matrix in the layout above, back to back (each starts at a multiple of 64 bytes).
"""

import functools

import numpy as np
from gguf import GGMLQuantizationType, quants

from moeshard.moe.kernels import dots

FORMATS = ("f32", "bf16", "q8_0", "q4_0", "mxfp4")
BLOCK_FORMATS = ("q8_0", "q4_0", "mxfp4")  # 32-column blocks, a scale each

_QTYPE = {
    "f32": GGMLQuantizationType.F32,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "mxfp4": GGMLQuantizationType.MXFP4,
}
_FMT_CODE = {
    "f32": dots.FMT_F32,
    "bf16": dots.FMT_BF16,
    "q8_0": dots.FMT_Q8_0,
    "q4_0": dots.FMT_Q4_0,
    "mxfp4": dots.FMT_MXFP4,
}
QK = dots.QK
ALIGN = 64
_F32 = np.dtype(np.float32)


def _check_fmt(fmt: str) -> None:
    if fmt not in _QTYPE:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


def _check_dims(fmt: str, rows: int, cols: int) -> None:
    _check_fmt(fmt)
    if rows <= 0 or cols <= 0:
        raise ValueError(f"matrix shape must be positive, got ({rows}, {cols})")
    if fmt in BLOCK_FORMATS and cols % QK:
        raise ValueError(f"{fmt} needs cols to be a multiple of {QK}, got cols={cols}")


def _check_matrix(w: np.ndarray, fmt: str) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {w.shape}")
    _check_dims(fmt, *w.shape)
    return np.ascontiguousarray(w, dtype=np.float32)


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


ROW_GROUP = dots.ROW_GROUP  # q4_0/q8_0 rows interleaved together
_QUANT_BYTES = {"q8_0": 32, "q4_0": 16, "mxfp4": 16}  # ggml's code bytes per block
_SCALE_BYTES = {"q8_0": 2, "q4_0": 2, "mxfp4": 1}  # the block scale before them: f16 / E8M0


def _groups(rows: int) -> int:
    return -(-rows // ROW_GROUP)


def _view_row_bytes(fmt: str, cols: int) -> int:
    """Bytes per row of the payload view: a matrix row (f32/bf16) or a row group (q4_0/q8_0)."""
    if fmt in _QUANT_BYTES:
        return cols // QK * ROW_GROUP * _QUANT_BYTES[fmt]
    return {"f32": 4 * cols, "bf16": 2 * cols}[fmt]


def _sections(fmt: str, rows: int, cols: int) -> tuple[int, int, int]:
    """(payload bytes, scale section offset, scale bytes) of one packed matrix."""
    if fmt in _QUANT_BYTES:
        payload = _groups(rows) * _view_row_bytes(fmt, cols)
        scales = _groups(rows) * (cols // QK) * ROW_GROUP * _SCALE_BYTES[fmt]
    else:
        payload, scales = rows * _view_row_bytes(fmt, cols), 0
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
    if fmt in BLOCK_FORMATS:
        return cols // QK * (_SCALE_BYTES[fmt] + _QUANT_BYTES[fmt])
    return {"f32": 4 * cols, "bf16": 2 * cols}[fmt]


# ---------------------------------------------------------------------------------------------
# kernel layout


def _interleave(per_row: np.ndarray, rows: int, unit: int) -> np.ndarray:
    """[rows, nb, n] per-row block bytes -> [groups, nb, n // unit, 8, unit]: rows padded with
    zeros to whole groups of eight, then each block's bytes dealt out `unit` at a time."""
    _, nb, n = per_row.shape
    padded = np.zeros((_groups(rows) * ROW_GROUP, nb, n), dtype=np.uint8)  # [rows8, nb, n]
    padded[:rows] = per_row
    split = padded.reshape(-1, ROW_GROUP, nb, n // unit, unit)  # [groups, 8, nb, chunks, unit]
    return split.transpose(0, 2, 3, 1, 4)  # [groups, nb, chunks, 8, unit]


def _deinterleave(grouped: np.ndarray, rows: int, nb: int, unit: int) -> np.ndarray:
    """Inverse of `_interleave`: the flat grouped bytes -> [rows, nb, n]."""
    split = grouped.reshape(
        -1, nb, grouped.size // (_groups(rows) * nb * ROW_GROUP * unit), ROW_GROUP, unit
    )  # [groups, nb, chunks, 8, unit]
    return split.transpose(0, 3, 1, 2, 4).reshape(-1, nb, split.shape[2] * unit)[:rows]


def pack(w: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [packed_nbytes] in the kernel/disk layout."""
    w = _check_matrix(w, fmt)
    rows, cols = w.shape
    return _ggml_to_packed(quantize(w, fmt), fmt, rows, cols)


def pack_ggml(g: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """ggml bytes of a rows x cols matrix ([rows, row_bytes], as `quantize` makes them or a
    checkpoint publishes them) -> the kernel/disk layout: the same bits, reordered."""
    _check_dims(fmt, rows, cols)
    g = np.ascontiguousarray(g, dtype=np.uint8).reshape(-1)
    want = rows * _ggml_row_bytes(fmt, cols)
    if g.size != want:
        raise ValueError(f"{fmt} {rows}x{cols} needs {want} ggml bytes, got {g.size}")
    return _ggml_to_packed(g, fmt, rows, cols)


def _ggml_to_packed(g: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    out = np.zeros(packed_nbytes(fmt, rows, cols), dtype=np.uint8)
    payload, s_off, s_bytes = _sections(fmt, rows, cols)
    if fmt in ("f32", "bf16"):
        out[:payload] = g.reshape(-1)
        return out
    nb, sb = cols // QK, _SCALE_BYTES[fmt]
    blocks = g.reshape(rows, nb, sb + _QUANT_BYTES[fmt])  # [rows, nb, block bytes]
    out[:payload] = _interleave(blocks[:, :, sb:], rows, 4).reshape(-1)
    out[s_off : s_off + s_bytes] = _interleave(blocks[:, :, :sb], rows, sb).reshape(-1)
    return out


def unpack_to_ggml(data: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """Kernel layout -> ggml bytes [rows, row_bytes] (the inverse of the layout step of `pack`)."""
    wq, ws = _views(data, fmt, rows, cols)
    if fmt in ("f32", "bf16"):
        return wq.copy()
    nb = cols // QK
    qs = _deinterleave(wq, rows, nb, 4)  # [rows, nb, 16 or 32]
    d = _deinterleave(ws.view(np.uint8), rows, nb, _SCALE_BYTES[fmt])  # [rows, nb, 2 or 1]
    return np.concatenate([d, qs], axis=2).reshape(rows, -1)  # [rows, row_bytes]


@functools.lru_cache(maxsize=4096)
def _matrix_layout(fmt: str, rows: int, cols: int) -> tuple[int, int, int]:
    """(packed bytes, bytes per payload view row, scale section offset or -1), validated."""
    _check_dims(fmt, rows, cols)
    _, s_off, s_bytes = _sections(fmt, rows, cols)
    return packed_nbytes(fmt, rows, cols), _view_row_bytes(fmt, cols), s_off if s_bytes else -1


def _check_buffer(data: np.ndarray, want: int, what: str) -> None:
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError(f"{what} must be a 1-D uint8 numpy array")
    if data.size != want:
        raise ValueError(f"{what} needs {want} bytes, got a buffer of {data.size}")
    if not data.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")


def _views(data: np.ndarray, fmt: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated numpy views: f32/bf16 payload [rows, row_bytes] and empty scales [rows, 0];
    q4_0/q8_0/mxfp4 payload uint8 [groups, group bytes] and scales as uint16 [groups,
    nb * 8 * scale bytes / 2] (mxfp4's one-byte E8M0 scales two to a uint16)."""
    nbytes, row_bytes, s_off = _matrix_layout(fmt, rows, cols)
    _check_buffer(data, nbytes, f"packed {fmt} {rows}x{cols} matrix")
    if s_off < 0:
        wq = data[: rows * row_bytes].reshape(rows, row_bytes)  # [rows, row_bytes]
        return wq, np.empty((rows, 0), dtype=np.uint16)
    groups, nb = _groups(rows), cols // QK
    wq = data[: groups * row_bytes].reshape(groups, row_bytes)  # [groups, nb * 8 * 16 or 32]
    s_bytes = groups * nb * ROW_GROUP * _SCALE_BYTES[fmt]
    ws = data[s_off : s_off + s_bytes].view(np.uint16).reshape(groups, -1)
    return wq, ws  # ws: [groups, nb * 8] (q4_0, q8_0) or [groups, nb * 4] (mxfp4)


def _check_x(x: np.ndarray, cols: int) -> np.ndarray:
    if (  # the common case first, in a few attribute reads (a decode step makes dozens of calls)
        type(x) is np.ndarray
        and x.dtype is _F32
        and x.ndim == 2
        and x.shape[1] == cols
        and x.shape[0]
        and x.flags.c_contiguous
    ):
        return _readonly(x)
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != cols or x.shape[0] == 0:
        raise ValueError(f"x must have shape [b, {cols}] with b >= 1, got {x.shape}")
    return _readonly(np.ascontiguousarray(x, dtype=np.float32))


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of a.  Numba compiles writable and read-only arrays separately;
    handing kernels only read-only inputs means one signature (the one `warmup` compiles)
    serves mmap'd read-only weights and ordinary arrays alike."""
    if a.flags.writeable:
        a = a.view()
        a.setflags(write=False)
    return a
