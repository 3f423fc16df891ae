"""Weight formats and their byte layout on disk and for the kernels (`quant` computes on it).

Formats: ``f32``, ``bf16``, ``q8_0``, ``q4_0``, ``mxfp4``, and ggml's ``q4_K`` and ``q6_K``
kept from GGUF files.  `quantize` / `dequantize` produce
and read ggml's byte order and delegate to ``gguf.quants`` so they are bit-identical to it by
construction.  `pack` writes the *kernel layout*, which is also the on-disk layout; it holds
exactly the same bits as ggml (`unpack_to_ggml` proves it) but arranged for the kernels:

Matrix layout (``rows x cols``; every section starts at a multiple of 64 bytes and the
matrix is zero-padded to a multiple of 64 bytes):

* ``f32``:  rows x cols little-endian float32, row-major.
* ``bf16``: uint16 values (the upper half of the float32) in groups of four rows (a last
  group padded with zero rows), each group's rows dealt out sixteen columns at a time:
  ``[groups, pieces, 4, 16]`` with pieces = cols / 16 rounded up (a last piece padded with
  zeros), so value ``w[4g + i, 16p + l]`` is at ``[g, p, i, l]``.  The kernels take four rows
  at a time; row-major, that was four 2 KiB streams at once, too short for the hardware
  prefetcher to follow, and the batch-1 product read 0.75-0.87 of the DRAM rate; as one
  stream per group, 0.91-0.94 with the same sums (AVX-512; `tools/probe_bf16_stream.py`,
  docs/results.md).
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

* ``q4_K`` and ``q6_K`` (ggml's K-quants, only from GGUF files: gguf-py cannot make them):
  per 32-column block the codes as q4_0's 16 bytes (q6_K: their low nibbles, then 8 bytes of
  high bit pairs, `_Q6_HIGH_ORDER`), interleaved by eight rows likewise; the scales per row
  group and 256-column super-block (`_q4k_group_scales`, `_q6k_group_scales`).

Expert record (`pack_expert`): gate [inter, hidden], up [inter, hidden], down [hidden, inter],
each a matrix in the layout above, back to back (each starts at a multiple of 64 bytes).
"""

import functools

import numpy as np
from gguf import GGMLQuantizationType, quants

from moeshard.moe.kernels import dots
from moeshard.moe.kernels.entry import bf16_rows_at, f32_rows_at

FORMATS = ("f32", "bf16", "q8_0", "q4_0", "mxfp4")  # `quantize` makes these from floats
BLOCK_FORMATS = ("q8_0", "q4_0", "mxfp4")  # 32-column blocks, a scale each
# ggml's K-quants, IQ4 and its older 32-column formats, kept as a GGUF file holds them
# (`pack_ggml`); integer kernels only
GGML_FORMATS = ("q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs", "q4_1", "q5_0", "q5_1")
# ggml's 32-column formats with a second scale (q4_1, q5_1: value = d q + m) or a top bit
ALL_FORMATS = FORMATS + GGML_FORMATS
QK_K = 256  # weights per K-quant super-block

_QTYPE = {
    "f32": GGMLQuantizationType.F32,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "mxfp4": GGMLQuantizationType.MXFP4,
    "q4_K": GGMLQuantizationType.Q4_K,
    "q6_K": GGMLQuantizationType.Q6_K,
    "q5_K": GGMLQuantizationType.Q5_K,
    "iq4_nl": GGMLQuantizationType.IQ4_NL,
    "iq4_xs": GGMLQuantizationType.IQ4_XS,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q5_0": GGMLQuantizationType.Q5_0,
    "q5_1": GGMLQuantizationType.Q5_1,
}
_FMT_CODE = {
    "f32": dots.FMT_F32,
    "bf16": dots.FMT_BF16,
    "q8_0": dots.FMT_Q8_0,
    "q4_0": dots.FMT_Q4_0,
    "mxfp4": dots.FMT_MXFP4,
    "q4_K": dots.FMT_Q4_K,
    "q6_K": dots.FMT_Q6_K,
    "q5_K": dots.FMT_Q5_K,
    "iq4_nl": dots.FMT_IQ4_NL,
    "iq4_xs": dots.FMT_IQ4_XS,
    "q4_1": dots.FMT_Q4_1,
    "q5_0": dots.FMT_Q5_0,
    "q5_1": dots.FMT_Q5_1,
}
QK = dots.QK
ALIGN = 64
_F32 = np.dtype(np.float32)


def _check_fmt(fmt: str) -> None:
    if fmt not in _QTYPE:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {ALL_FORMATS}")


def _check_dims(fmt: str, rows: int, cols: int) -> None:
    _check_fmt(fmt)
    if rows <= 0 or cols <= 0:
        raise ValueError(f"matrix shape must be positive, got ({rows}, {cols})")
    if fmt in BLOCK_FORMATS and cols % QK:
        raise ValueError(f"{fmt} needs cols to be a multiple of {QK}, got cols={cols}")
    if fmt in GGML_FORMATS and cols % _ggml_block(fmt):
        raise ValueError(
            f"{fmt} needs cols to be a multiple of {_ggml_block(fmt)}, got cols={cols}"
        )


def _check_matrix(w: np.ndarray, fmt: str) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {w.shape}")
    _check_dims(fmt, *w.shape)
    return np.ascontiguousarray(w, dtype=np.float32)


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


ROW_GROUP = dots.ROW_GROUP  # q4_0/q8_0 rows interleaved together
BF16_GROUP, BF16_PIECE = dots.BF16_GROUP, dots.BF16_PIECE  # bf16 rows, columns per piece
# code bytes per 32 columns and row (q6_K: 16 of low nibbles, 8 of high 2-bit parts)
_QUANT_BYTES = {
    "q8_0": 32, "q4_0": 16, "mxfp4": 16, "q4_K": 16, "q5_K": 20, "q6_K": 24, "iq4_nl": 16,
    "iq4_xs": 16,
    "q4_1": 16,
    "q5_0": 20,
    "q5_1": 20,
}  # fmt: skip
# the 32-column block's scale before its codes in ggml (f16, E8M0), where it has one
_SCALE_BYTES = {"q8_0": 2, "q4_0": 2, "mxfp4": 1, "iq4_nl": 2, "q5_0": 2, "q4_1": 4, "q5_1": 4}
_LEGACY = {"q4_1", "q5_0", "q5_1"}  # ggml's older 32-column blocks with a min or a top bit
# q4_K's scales per row and super-block in the kernel layout: d, dmin (float16) and the eight
# sub-blocks' 6-bit scales and mins, a byte each (ggml packs those 16 into 12 bytes)
Q4K_SCALE_BYTES = 20
# q6_K's per row and super-block: d (float16) and sixteen int8 scales, one per 16 columns
Q6K_SCALE_BYTES = 18
# iq4_xs's per row and super-block: d (float16) and its eight 6-bit scales less 32, an int8 each
IQ4XS_SCALE_BYTES = 10
_SUPER_SCALE_BYTES = {
    "q4_K": Q4K_SCALE_BYTES,
    "q5_K": Q4K_SCALE_BYTES,  # (q5_K's scales are q4_K's)
    "q6_K": Q6K_SCALE_BYTES,
    "iq4_xs": IQ4XS_SCALE_BYTES,
}


def _ggml_block(fmt: str) -> int:
    """Columns per ggml block of a kept-only format: 256 (K-quants, iq4_xs) or 32 (iq4_nl)."""
    return quants.GGML_QUANT_SIZES[_QTYPE[fmt]][0]


# where each format's float16 scales sit in its ggml block (d, and dmin or m); every other
# byte of a block may be anything (`bench kernels` and the tests make blocks so)
F16_SCALE_BYTES = {
    "q8_0": (0, 2),
    "q4_0": (0, 2),
    "iq4_nl": (0, 2),
    "q5_0": (0, 2),
    "q4_1": (0, 4),
    "q5_1": (0, 4),
    "q4_K": (0, 4),
    "q5_K": (0, 4),
    "q6_K": (208, 210),
    "iq4_xs": (0, 2),
}


def nonfinite_scales(g: np.ndarray, fmt: str, rows: int, cols: int) -> int:
    """Blocks of ggml bytes [rows, row_bytes] whose float16 scales are nan or inf: 0 in any
    file a quantiser wrote. A network's nodes must give the same bits for a record, and a nan
    scale's products carry a nan whose sign the CPU's instruction order decides."""
    if fmt not in F16_SCALE_BYTES:
        return 0
    lo, hi = F16_SCALE_BYTES[fmt]
    width = ggml_block_size(fmt)[1] if fmt in GGML_FORMATS else _ggml_row_bytes(fmt, QK)
    blocks = np.ascontiguousarray(g, dtype=np.uint8).reshape(-1, width)  # [blocks, bytes]
    scales = blocks[:, lo:hi].copy().view(np.uint16)  # [blocks, 1 or 2]
    return int(np.count_nonzero(((scales >> 10) & 0x1F) == 0x1F))


def ggml_block_size(fmt: str) -> tuple[int, int]:
    """(columns, bytes) of one ggml block of `fmt` (a GGUF file's row is whole blocks)."""
    _check_fmt(fmt)
    return tuple(quants.GGML_QUANT_SIZES[_QTYPE[fmt]])


def _groups(rows: int) -> int:
    return -(-rows // ROW_GROUP)


def _bf16_groups(rows: int) -> int:
    return -(-rows // BF16_GROUP)


def _bf16_pieces(cols: int) -> int:
    return -(-cols // BF16_PIECE)


def _view_row_bytes(fmt: str, cols: int) -> int:
    """Bytes per row of the payload view: a matrix row (f32), a group of four rows (bf16) or
    of eight (q4_0/q8_0 and the rest)."""
    if fmt in _QUANT_BYTES:
        return cols // QK * ROW_GROUP * _QUANT_BYTES[fmt]
    if fmt == "bf16":
        return _bf16_pieces(cols) * BF16_GROUP * BF16_PIECE * 2
    return 4 * cols


def _sections(fmt: str, rows: int, cols: int) -> tuple[int, int, int]:
    """(payload bytes, scale section offset, scale bytes) of one packed matrix."""
    if fmt in _QUANT_BYTES:
        payload = _groups(rows) * _view_row_bytes(fmt, cols)
        if fmt in _SUPER_SCALE_BYTES:
            scales = _groups(rows) * (cols // QK_K) * ROW_GROUP * _SUPER_SCALE_BYTES[fmt]
        else:
            scales = _groups(rows) * (cols // QK) * ROW_GROUP * _SCALE_BYTES[fmt]
    elif fmt == "bf16":
        payload, scales = _bf16_groups(rows) * _view_row_bytes(fmt, cols), 0
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
    if fmt in GGML_FORMATS:  # gguf-py has no quantiser for them; llama-quantize makes them
        raise ValueError(f"{fmt} is kept from GGUF files only; it cannot be made from floats")
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
    if fmt in GGML_FORMATS:
        return cols // _ggml_block(fmt) * quants.GGML_QUANT_SIZES[_QTYPE[fmt]][1]
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
    if fmt == "f32":
        out[:payload] = g.reshape(-1)
        return out
    if fmt == "bf16":
        _bf16_interleave(g.view(np.uint16).reshape(rows, cols), out[:payload].view(np.uint16))
        return out
    if fmt == "q4_K":
        codes, scales = _q4k_split(g.reshape(rows, cols // QK_K, -1))
        out[:payload] = _interleave(codes, rows, 4).reshape(-1)
        out[s_off : s_off + s_bytes] = _q4k_group_scales(scales, rows).reshape(-1)
        return out
    if fmt in _LEGACY:
        codes, scales = _legacy_split(g.reshape(rows, cols // QK, -1), fmt)
        out[:payload] = _interleave(codes, rows, 4).reshape(-1)
        out[s_off : s_off + s_bytes] = _interleave(scales, rows, 2).reshape(-1)
        return out
    if fmt == "q5_K":
        low, high, scales = _q5k_split(g.reshape(rows, cols // QK_K, -1))
        both = np.concatenate([low, high], axis=2)  # [rows, nb, 20]
        out[:payload] = _interleave(both, rows, 4).reshape(-1)
        out[s_off : s_off + s_bytes] = _q4k_group_scales(scales, rows).reshape(-1)
        return out
    if fmt == "iq4_xs":
        codes, scales = _iq4xs_split(g.reshape(rows, cols // QK_K, -1))
        out[:payload] = _interleave(codes, rows, 4).reshape(-1)
        out[s_off : s_off + s_bytes] = _iq4xs_group_scales(scales, rows).reshape(-1)
        return out
    if fmt == "q6_K":
        low, high, scales = _q6k_split(g.reshape(rows, cols // QK_K, -1))
        both = np.concatenate([low, high], axis=2)  # [rows, nb, 24]
        out[:payload] = _interleave(both, rows, 4).reshape(-1)
        out[s_off : s_off + s_bytes] = _q6k_group_scales(scales, rows).reshape(-1)
        return out
    nb, sb = cols // QK, _SCALE_BYTES[fmt]
    blocks = g.reshape(rows, nb, sb + _QUANT_BYTES[fmt])  # [rows, nb, block bytes]
    out[:payload] = _interleave(blocks[:, :, sb:], rows, 4).reshape(-1)
    out[s_off : s_off + s_bytes] = _interleave(blocks[:, :, :sb], rows, sb).reshape(-1)
    return out


def _bf16_interleave(w: np.ndarray, out: np.ndarray) -> None:
    """bf16 bits uint16 [rows, cols] -> out, the kernel layout's uint16 [groups * pieces * 64],
    written in place (a table of gigabytes, an embedding, is not copied on the way); out
    must be zeros, which the padding keeps."""
    rows, cols = w.shape
    whole = cols - cols % BF16_PIECE
    dest = out.reshape(_bf16_groups(rows), -1, BF16_GROUP, BF16_PIECE)  # [g, p, i, l]
    for i in range(BF16_GROUP):
        part = w[i::BF16_GROUP]  # [rows of this place in their group, cols]
        n = part.shape[0]
        full = whole // BF16_PIECE
        dest[:n, :full, i] = part[:, :whole].reshape(n, full, BF16_PIECE)
        if whole < cols:
            dest[:n, full, i, : cols - whole] = part[:, whole:]


def _bf16_deinterleave(pieces: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The inverse of `_bf16_interleave`: a view [groups, pieces, 4, 16] -> uint16 [rows, cols]."""
    groups, n = pieces.shape[:2]
    flat = pieces.transpose(0, 2, 1, 3).reshape(groups * BF16_GROUP, n * BF16_PIECE)
    return flat[:rows, :cols]


def float_rows_view(data: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """A packed f32 or bf16 matrix's values as their bits, validated: uint32 [rows, cols] for
    f32, uint16 [groups, pieces, 4, 16] for bf16 (the layout's; what `float_rows_at` reads an
    embedding row from)."""
    if fmt not in ("f32", "bf16"):
        raise ValueError(f"{fmt} rows are not float rows")
    wq, _ = _views(data, fmt, rows, cols)  # [rows or groups, row_bytes]
    if fmt == "f32":
        return wq.view(np.uint32)
    return wq.view(np.uint16).reshape(wq.shape[0], -1, BF16_GROUP, BF16_PIECE)


def float_rows_at(view: np.ndarray, rows: int, cols: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` (int64 [n]) of `float_rows_view`'s view of a rows x cols matrix -> float32
    [n, cols], exactly (an id outside 0..rows - 1 raises IndexError)."""
    if view.ndim == 2:
        return f32_rows_at(view, ids)
    return bf16_rows_at(view, rows, cols, ids)


def dequantize_rows(data: np.ndarray, fmt: str, rows: int, cols: int, ids) -> np.ndarray:
    """Rows `ids` of a packed [rows, cols] matrix as float32 [len(ids), cols], decoding only
    the row groups that hold them (an embedding lookup: the whole table as float32 would be
    twice a bf16 table's bytes, gigabytes for a 200k-token vocabulary)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [n]
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise IndexError(f"row ids must be within 0..{rows - 1}")  # (as numpy indexing)
    if fmt in ("f32", "bf16"):
        return float_rows_at(float_rows_view(data, fmt, rows, cols), rows, cols, ids)
    wq, ws = _views(data, fmt, rows, cols)
    groups, where = np.unique(ids // ROW_GROUP, return_inverse=True)  # [g], [n]
    n = groups.size * ROW_GROUP  # the groups' rows, as one smaller packed matrix
    payload, s_off, s_bytes = _sections(fmt, n, cols)
    mini = np.zeros(packed_nbytes(fmt, n, cols), dtype=np.uint8)
    mini[:payload] = wq[groups].reshape(-1)
    mini[s_off : s_off + s_bytes] = ws[groups].view(np.uint8).reshape(-1)
    values = dequantize(unpack_to_ggml(mini, fmt, n, cols), fmt, (n, cols))  # [n, cols]
    return values[where * ROW_GROUP + ids % ROW_GROUP]  # [len(ids), cols]


def unpack_to_ggml(data: np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """Kernel layout -> ggml bytes [rows, row_bytes] (the inverse of the layout step of `pack`)."""
    wq, ws = _views(data, fmt, rows, cols)
    if fmt == "f32":
        return wq.copy()
    if fmt == "bf16":
        view = float_rows_view(data, fmt, rows, cols)  # [groups, pieces, 4, 16]
        return np.ascontiguousarray(_bf16_deinterleave(view, rows, cols)).view(np.uint8)
    nb = cols // QK
    if fmt == "q4_K":
        codes = _deinterleave(wq, rows, nb, 4)  # [rows, nb, 16]
        return _q4k_join(codes, _q4k_row_scales(ws.view(np.uint8), rows, nb // 8))
    if fmt in _LEGACY:
        codes = _deinterleave(wq, rows, nb, 4)  # [rows, nb, 16 or 20]
        scales = _deinterleave(ws.view(np.uint8), rows, nb, 2)  # [rows, nb, 2 or 4]
        return _legacy_join(codes, scales, fmt)
    if fmt == "q5_K":
        both = _deinterleave(wq, rows, nb, 4)  # [rows, nb, 20]
        scales = _q4k_row_scales(ws.view(np.uint8), rows, nb // 8)
        return _q5k_join(both[:, :, :16], both[:, :, 16:], scales)
    if fmt == "iq4_xs":
        codes = _deinterleave(wq, rows, nb, 4)  # [rows, nb, 16]
        return _iq4xs_join(codes, _iq4xs_row_scales(ws.view(np.uint8), rows, nb // 8))
    if fmt == "q6_K":
        both = _deinterleave(wq, rows, nb, 4)  # [rows, nb, 24]
        scales = _q6k_row_scales(ws.view(np.uint8), rows, nb // 8)
        return _q6k_join(both[:, :, :16], both[:, :, 16:], scales)
    qs = _deinterleave(wq, rows, nb, 4)  # [rows, nb, 16 or 32]
    d = _deinterleave(ws.view(np.uint8), rows, nb, _SCALE_BYTES[fmt])  # [rows, nb, 2 or 1]
    return np.concatenate([d, qs], axis=2).reshape(rows, -1)  # [rows, row_bytes]


# ---------------------------------------------------------------------------------------------
# q4_K: ggml's block (per 256 columns: d, dmin float16, 12 bytes of 6-bit scales and mins,
# 128 bytes of codes whose 32-byte chunk j holds sub-block 2j in its low nibbles and 2j + 1
# in its high ones) <-> per 32-column sub-block q4_0's 16 code bytes, and per row and
# super-block d, dmin, sc[8], m[8]; value = d * sc[s] * q - dmin * m[s], as gguf's
# dequantisation computes it.


def _q4k_split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml q4_K blocks uint8 [rows, nsup, 144] -> (codes [rows, nsup * 8, 16] in q4_0's
    nibble order, scales [rows, nsup, 20]: d, dmin bytes then sc[8], m[8])."""
    rows, nsup, _ = blocks.shape
    qs = blocks[:, :, 16:].reshape(rows, nsup, 4, 1, 32)  # [rows, nsup, chunk, 1, 32]
    q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15  # [.., chunk, half, 32]
    q = q.reshape(rows, nsup * 8, 32)  # [rows, sub-blocks, 32]: codes in column order
    codes = q[:, :, :16] | (q[:, :, 16:] << 4)  # [rows, nb, 16]
    sc, m = _q4k_unpack_scales(blocks[:, :, 4:16])  # [rows, nsup, 8] each
    return codes, np.concatenate([blocks[:, :, :4], sc, m], axis=2)


def _q4k_join(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of `_q4k_split` -> ggml bytes [rows, nsup * 144]."""
    rows, nb, _ = codes.shape
    q = np.concatenate([codes & 15, codes >> 4], axis=2)  # [rows, nb, 32]
    q = q.reshape(rows, nb // 8, 4, 2, 32)  # [rows, nsup, chunk, half, 32]
    qs = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [rows, nsup, 4, 32]
    packed = _q4k_pack_scales(scales[:, :, 4:12], scales[:, :, 12:20])  # [rows, nsup, 12]
    blocks = np.concatenate([scales[:, :, :4], packed, qs.reshape(rows, nb // 8, 128)], axis=2)
    return blocks.reshape(rows, -1)


def _q4k_unpack_scales(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's 12 bytes [..., 12] -> the 6-bit scales and mins [..., 8] each (ggml's
    get_scale_min_k4): bytes 0-3 and 4-7 hold sc[0..3] and m[0..3] in their low 6 bits and
    the top 2 bits of sc[4..7] and m[4..7] above; bytes 8-11 their low 4 bits."""
    lo, mid, top = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _q4k_pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of `_q4k_unpack_scales`."""
    lo = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    top = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate([lo, mid, top], axis=-1).astype(np.uint8)


def _q4k_group_scales(scales: np.ndarray, rows: int) -> np.ndarray:
    """Per-row scales [rows, nsup, 20] -> per row group and super-block [groups, nsup, 160]:
    d of the eight rows (float16 x 8), dmin x 8, then sc[s] of the eight rows for s = 0..7,
    then m[s] likewise, so each is one 16- or 8-byte load of the eight rows' values."""
    _, nsup, _ = scales.shape
    padded = np.zeros((_groups(rows) * ROW_GROUP, nsup, Q4K_SCALE_BYTES), dtype=np.uint8)
    padded[:rows] = scales
    g = padded.reshape(-1, ROW_GROUP, nsup, Q4K_SCALE_BYTES).transpose(0, 2, 1, 3)
    d = g[..., 0:2].reshape(-1, nsup, 16)  # [groups, nsup, 8 rows x 2 bytes]
    dmin = g[..., 2:4].reshape(-1, nsup, 16)
    sc = g[..., 4:12].transpose(0, 1, 3, 2).reshape(-1, nsup, 64)  # [groups, nsup, s x rows]
    m = g[..., 12:20].transpose(0, 1, 3, 2).reshape(-1, nsup, 64)
    return np.concatenate([d, dmin, sc, m], axis=2)  # [groups, nsup, 160]


def _q4k_row_scales(section: np.ndarray, rows: int, nsup: int) -> np.ndarray:
    """Inverse of `_q4k_group_scales` -> [rows, nsup, 20]."""
    g = section.reshape(-1, nsup, 160)
    d = g[..., 0:16].reshape(-1, nsup, ROW_GROUP, 2)
    dmin = g[..., 16:32].reshape(-1, nsup, ROW_GROUP, 2)
    sc = g[..., 32:96].reshape(-1, nsup, 8, ROW_GROUP).transpose(0, 1, 3, 2)
    m = g[..., 96:160].reshape(-1, nsup, 8, ROW_GROUP).transpose(0, 1, 3, 2)
    per_row = np.concatenate([d, dmin, sc, m], axis=3)  # [groups, nsup, 8, 20]
    return per_row.transpose(0, 2, 1, 3).reshape(-1, nsup, Q4K_SCALE_BYTES)[:rows]


# ---------------------------------------------------------------------------------------------
# q4_1, q5_0, q5_1: ggml's block is d (float16), for q4_1 and q5_1 m (float16), for q5_0 and
# q5_1 qh (32 top bits, bit j for column j, little-endian), then q4_0's 16 code bytes; value
# = d q + m, or d (q - 16) for q5_0.  Kernel layout: the codes as q4_0's, q5's top bits after
# them as q5_K's (`_q5_top_bytes`), and per block d of the eight rows then m of the eight.


def _q5_top_bytes(bits: np.ndarray) -> np.ndarray:
    """Top bits [rows, nb, 32] (0 or 1, column order) -> [rows, nb, 4]: bit c of byte i for
    column 4c + i, bit 4 + c for column 16 + 4c + i (`idots._q5_sums`)."""
    cols = bits.reshape(*bits.shape[:2], 2, 4, 4)  # [rows, nb, half, c, i]
    out = np.zeros((*bits.shape[:2], 4), dtype=np.uint8)
    for half in range(2):
        for c in range(4):
            out |= cols[:, :, half, c, :] << (4 * half + c)
    return out


def _q5_top_bits(top: np.ndarray) -> np.ndarray:
    """Inverse of `_q5_top_bytes` -> [rows, nb, 32]."""
    bits = np.zeros((*top.shape[:2], 2, 4, 4), dtype=np.uint8)
    for half in range(2):
        for c in range(4):
            bits[:, :, half, c, :] = (top >> (4 * half + c)) & 1
    return bits.reshape(*top.shape[:2], 32)


def _legacy_split(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """ggml q4_1/q5_0/q5_1 blocks [rows, nb, bytes] -> (codes [rows, nb, 16 or 20]: q4_0's
    code bytes, then q5's top bits; scales [rows, nb, 2 or 4]: d, then m)."""
    scale = _SCALE_BYTES[fmt]
    scales, codes = blocks[:, :, :scale], blocks[:, :, -16:]
    if fmt == "q4_1":
        return codes, scales
    qh = blocks[:, :, scale : scale + 4].copy().view("<u4")  # [rows, nb, 1]
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, nb, 32]
    return np.concatenate([codes, _q5_top_bytes(bits)], axis=2), scales


def _legacy_join(codes: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    """Inverse of `_legacy_split` -> ggml bytes [rows, nb * bytes]."""
    rows = codes.shape[0]
    if fmt == "q4_1":
        return np.concatenate([scales, codes], axis=2).reshape(rows, -1)
    bits = _q5_top_bits(codes[:, :, 16:]).astype(np.uint32)  # [rows, nb, 32]
    qh = (bits << np.arange(32, dtype=np.uint32)).sum(axis=2, dtype=np.uint32)  # [rows, nb]
    qh_bytes = qh.astype("<u4")[..., None].view(np.uint8)  # [rows, nb, 4]
    return np.concatenate([scales, qh_bytes, codes[:, :, :16]], axis=2).reshape(rows, -1)


# ---------------------------------------------------------------------------------------------
# q5_K: q4_K's block (d, dmin, the same 12 scale bytes, the same low nibbles) with qh[32]
# between the scales and the codes, bit i of qh[l] the top bit of column 32i + l; value =
# d sc_s q - dmin m_s, q = low | high << 4, 0..31.  Kernel layout: q4_K's, with 4 bytes of top
# bits per row after each 32-column block's codes, bit c of byte i for column 4c + i and bit
# 4 + c for column 16 + 4c + i, so one 32-byte load of the eight rows' lines up with the
# block's four code loads (`idots._q5_sums`).


def _q5k_split(blocks: np.ndarray):
    """ggml q5_K blocks [rows, nsup, 176] -> (low [rows, nb, 16] in q4_0's nibble order, high
    [rows, nb, 4], scales [rows, nsup, 20] as q4_K's)."""
    rows, nsup, _ = blocks.shape
    qs = blocks[:, :, 48:].reshape(rows, nsup, 4, 1, 32)
    lo = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15).reshape(rows, -1, 32)
    qh = blocks[:, :, 16:48].reshape(rows, nsup, 1, 32)  # [rows, nsup, 1, 32]
    hi = ((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1).reshape(rows, -1, 32)
    low = lo[:, :, :16] | (lo[:, :, 16:] << 4)  # [rows, nb, 16]
    sc, m = _q4k_unpack_scales(blocks[:, :, 4:16])
    return low, _q5_top_bytes(hi), np.concatenate([blocks[:, :, :4], sc, m], axis=2)


def _q5k_join(low: np.ndarray, high: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of `_q5k_split` -> ggml bytes [rows, nsup * 176]."""
    rows, nb, _ = low.shape
    hi = _q5_top_bits(high).reshape(rows, nb // 8, 8, 32)  # [rows, nsup, sub-block i, l]
    qh = np.zeros((rows, nb // 8, 32), dtype=np.uint8)
    for i in range(8):
        qh |= hi[:, :, i, :] << i
    lo = np.concatenate([low & 15, low >> 4], axis=2).reshape(rows, nb // 8, 4, 2, 32)
    qs = lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)  # [rows, nsup, 4, 32]
    packed = _q4k_pack_scales(scales[:, :, 4:12], scales[:, :, 12:20])
    blocks = np.concatenate([scales[:, :, :4], packed, qh, qs.reshape(rows, -1, 128)], axis=2)
    return blocks.reshape(rows, -1)


# ---------------------------------------------------------------------------------------------
# q6_K: ggml's block (per 256 columns: ql[128] low nibbles, qh[64] high 2-bit parts, sixteen
# int8 scales, d float16; value = d * sc[j // 16] * (q - 32), q = low | high << 4, 0..63)
# <-> per 32-column block: the low nibbles as q4_0's 16 bytes, and 8 bytes of high parts
# where byte 4j + i holds those of columns 8j + i, 8j + 16 + i, 8j + 4 + i, 8j + 20 + i in
# its bit pairs 0-1, 2-3, 4-5, 6-7: so 32-byte load j of the high parts (eight rows' bytes
# 4j..4j + 3) lines up with code loads 2j and 2j + 1 (`idots._q6_codes`).


def _q6k_codes(blocks: np.ndarray) -> np.ndarray:
    """ggml q6_K blocks [rows, nsup, 210] -> the 6-bit codes [rows, nsup * 256], 0..63."""
    rows, nsup, _ = blocks.shape
    ql = blocks[:, :, :128].reshape(rows, nsup, 2, 1, 64)  # [.., half, 1, 64]
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15  # [.., half, 2, 64]
    qh = blocks[:, :, 128:192].reshape(rows, nsup, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3  # [.., half, 4, 32]
    return (low.reshape(rows, -1) | (high.reshape(rows, -1) << 4)).astype(np.uint8)


_Q6_HIGH_ORDER = np.array([[8 * j + i, 8 * j + 16 + i, 8 * j + 4 + i, 8 * j + 20 + i]
                           for j in range(2) for i in range(4)])  # fmt: skip  # [8 bytes, 4]


def _q6k_split(blocks: np.ndarray):
    """ggml q6_K blocks [rows, nsup, 210] -> (low [rows, nb, 16] in q4_0's nibble order,
    high [rows, nb, 8] (`_Q6_HIGH_ORDER`), scales [rows, nsup, 18]: d's bytes then sc[16])."""
    rows, nsup, _ = blocks.shape
    q = _q6k_codes(blocks).reshape(rows, nsup * 8, 32)  # [rows, nb, 32]
    lo, hi = q & 15, q >> 4
    low = lo[:, :, :16] | (lo[:, :, 16:] << 4)
    parts = hi[:, :, _Q6_HIGH_ORDER]  # [rows, nb, 8, 4]
    high = parts[..., 0] | (parts[..., 1] << 2) | (parts[..., 2] << 4) | (parts[..., 3] << 6)
    scales = np.concatenate([blocks[:, :, 208:210], blocks[:, :, 192:208]], axis=2)
    return low, high.astype(np.uint8), scales


def _q6k_join(low: np.ndarray, high: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of `_q6k_split` -> ggml bytes [rows, nsup * 210]."""
    rows, nb, _ = low.shape
    q = np.zeros((rows, nb, 32), dtype=np.uint8)
    q[:, :, :16], q[:, :, 16:] = low & 15, low >> 4
    for pair in range(4):
        q[:, :, _Q6_HIGH_ORDER[:, pair]] |= ((high >> (2 * pair)) & 3) << 4
    q = q.reshape(rows, nb // 8, 256)  # [rows, nsup, 256]
    lo, hi = q & 15, q >> 4
    lo = lo.reshape(rows, nb // 8, 2, 2, 64)  # [.., half, nibble, 64]
    ql = lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)  # [.., half, 64]
    hi = hi.reshape(rows, nb // 8, 2, 4, 32)  # [.., half, pair, 32]
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    blocks = np.concatenate(
        [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), scales[:, :, 2:], scales[:, :, :2]],
        axis=2,
    )
    return blocks.reshape(rows, -1)


def _q6k_group_scales(scales: np.ndarray, rows: int) -> np.ndarray:
    """Per-row [rows, nsup, 18] -> per row group and super-block [groups, nsup, 144]: d of the
    eight rows (float16 x 8), then sc[j] of the eight rows for j = 0..15 (int8 x 8 each)."""
    _, nsup, _ = scales.shape
    padded = np.zeros((_groups(rows) * ROW_GROUP, nsup, Q6K_SCALE_BYTES), dtype=np.uint8)
    padded[:rows] = scales
    g = padded.reshape(-1, ROW_GROUP, nsup, Q6K_SCALE_BYTES).transpose(0, 2, 1, 3)
    d = g[..., 0:2].reshape(-1, nsup, 16)  # [groups, nsup, 8 rows x 2 bytes]
    sc = g[..., 2:18].transpose(0, 1, 3, 2).reshape(-1, nsup, 128)  # [groups, nsup, j x rows]
    return np.concatenate([d, sc], axis=2)


def _q6k_row_scales(section: np.ndarray, rows: int, nsup: int) -> np.ndarray:
    """Inverse of `_q6k_group_scales` -> [rows, nsup, 18]."""
    g = section.reshape(-1, nsup, 144)
    d = g[..., 0:16].reshape(-1, nsup, ROW_GROUP, 2)
    sc = g[..., 16:144].reshape(-1, nsup, 16, ROW_GROUP).transpose(0, 1, 3, 2)
    per_row = np.concatenate([d, sc], axis=3)  # [groups, nsup, 8, 18]
    return per_row.transpose(0, 2, 1, 3).reshape(-1, nsup, Q6K_SCALE_BYTES)[:rows]


# ---------------------------------------------------------------------------------------------
# iq4_nl: ggml's 32-column block is q4_0's (float16 d, 16 bytes of codes in q4_0's nibble
# order), value = d * IQ4_VALUES[q]: the q4_0 layout holds it as it is.  iq4_xs: per 256
# columns d (float16), scales_h (uint16: bit pair s is the top of sub-block s's scale),
# scales_l[4] (nibble s % 2 of byte s // 2: its low four bits), then sub-block s's codes in
# bytes 16s..16s + 15 in q4_0's order; value = d * (ls_s - 32) * IQ4_VALUES[q].


def _iq4xs_split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml iq4_xs blocks [rows, nsup, 136] -> (codes [rows, nsup * 8, 16], scales [rows,
    nsup, 10]: d's bytes, then ls_s - 32 as int8 for s = 0..7)."""
    rows, nsup, _ = blocks.shape
    codes = blocks[:, :, 8:].reshape(rows, nsup * 8, 16)
    high = blocks[:, :, 2:4].copy().view(np.uint16)  # [rows, nsup, 1]
    low = blocks[:, :, 4:8]  # [rows, nsup, 4]
    s = np.arange(8)
    ls = ((low[:, :, s // 2] >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4)
    shifted = (ls.astype(np.int16) - 32).astype(np.int8).view(np.uint8)  # [rows, nsup, 8]
    return codes, np.concatenate([blocks[:, :, :2], shifted], axis=2)


def _iq4xs_join(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of `_iq4xs_split` -> ggml bytes [rows, nsup * 136]."""
    rows, nb, _ = codes.shape
    ls = (scales[:, :, 2:].view(np.int8).astype(np.int16) + 32).astype(np.uint16)  # [.., 8]
    high = np.zeros(ls.shape[:2], dtype=np.uint16)
    for s in range(8):
        high |= (ls[:, :, s] >> 4) << (2 * s)
    low = (ls[:, :, 0::2] & 15) | ((ls[:, :, 1::2] & 15) << 4)  # [rows, nsup, 4]
    blocks = np.concatenate(
        [scales[:, :, :2], high[..., None].view(np.uint8), low.astype(np.uint8),
         codes.reshape(rows, nb // 8, 128)],
        axis=2,
    )  # fmt: skip
    return blocks.reshape(rows, -1)


def _iq4xs_group_scales(scales: np.ndarray, rows: int) -> np.ndarray:
    """Per-row [rows, nsup, 10] -> per row group and super-block [groups, nsup, 80]: d of the
    eight rows (float16 x 8), then ls_s - 32 of the eight rows for s = 0..7 (int8 x 8)."""
    _, nsup, _ = scales.shape
    padded = np.zeros((_groups(rows) * ROW_GROUP, nsup, IQ4XS_SCALE_BYTES), dtype=np.uint8)
    padded[:rows] = scales
    g = padded.reshape(-1, ROW_GROUP, nsup, IQ4XS_SCALE_BYTES).transpose(0, 2, 1, 3)
    d = g[..., 0:2].reshape(-1, nsup, 16)
    ls = g[..., 2:10].transpose(0, 1, 3, 2).reshape(-1, nsup, 64)  # [groups, nsup, s x rows]
    return np.concatenate([d, ls], axis=2)


def _iq4xs_row_scales(section: np.ndarray, rows: int, nsup: int) -> np.ndarray:
    """Inverse of `_iq4xs_group_scales` -> [rows, nsup, 10]."""
    g = section.reshape(-1, nsup, 80)
    d = g[..., 0:16].reshape(-1, nsup, ROW_GROUP, 2)
    ls = g[..., 16:80].reshape(-1, nsup, 8, ROW_GROUP).transpose(0, 1, 3, 2)
    per_row = np.concatenate([d, ls], axis=3)  # [groups, nsup, 8, 10]
    return per_row.transpose(0, 2, 1, 3).reshape(-1, nsup, IQ4XS_SCALE_BYTES)[:rows]


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
    """Validated numpy views: f32 payload [rows, row_bytes], bf16 payload [groups of four rows,
    row_bytes], and empty scales [rows, 0]; q4_0/q8_0/mxfp4 payload uint8 [groups, group
    bytes] and scales as uint16 [groups, nb * 8 * scale bytes / 2] (mxfp4's one-byte E8M0
    scales two to a uint16)."""
    nbytes, row_bytes, s_off = _matrix_layout(fmt, rows, cols)
    _check_buffer(data, nbytes, f"packed {fmt} {rows}x{cols} matrix")
    if s_off < 0:
        n = _bf16_groups(rows) if fmt == "bf16" else rows
        wq = data[: n * row_bytes].reshape(n, row_bytes)  # [rows or groups, row_bytes]
        return wq, np.empty((rows, 0), dtype=np.uint16)
    groups = _groups(rows)
    wq = data[: groups * row_bytes].reshape(groups, row_bytes)  # [groups, nb * 8 * 16 or 32]
    _, _, s_bytes = _sections(fmt, rows, cols)
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
