"""Read the header of a GGUF file (metadata and tensor infos), never its tensor data.

Layout parsed here (every integer little-endian):

    magic          4 bytes    b"GGUF"
    version        uint32     2 or 3
    tensor_count   uint64
    kv_count       uint64
    kv_count x     key: string, value_type: uint32, value
    tensor_count x name: string, n_dims: uint32, dims: uint64[n_dims],
                   ggml_type: uint32, offset: uint64 (relative to the data section)
    padding        zeros up to a multiple of `general.alignment` (a uint32 key, default 32)
    data section   starts here, at `data_offset`

    string  = uint64 byte length + that many utf-8 bytes (no terminator)
    value   = by value_type: 0 uint8, 1 int8, 2 uint16, 3 int16, 4 uint32, 5 int32,
              6 float32, 7 bool (1 byte), 8 string, 9 array, 10 uint64, 11 int64, 12 float64
    array   = uint32 item type + uint64 item count + the items (arrays may nest)

dims are stored innermost first (ggml's ne[0], the row length), the reverse of numpy's order;
TensorInfo.shape keeps the file's order.

Only the header bytes are read, with plain buffered file reads, so a file whose data section is
cut short still reads. Anything wrong with the bytes raises HeaderError naming the file; every
length and count is checked against the file size before anything is read or allocated.
Errors from opening or reading the file itself (OSError) propagate unchanged.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> struct format of the fixed-size types; 8 (string) and 9 (array) are variable
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}  # fmt: skip
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 12}  # empty string: length; empty array: type + count
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, ggml type, offset
_MAX_ARRAY_NESTING = 8  # deeper nesting is refused rather than recursed into


class HeaderError(ValueError):
    """The file is not a readable GGUF file; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as stored in the file: innermost dimension first
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset in the file (data section start + relative offset)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, object]  # strings decoded, arrays as lists, numbers as int/float/bool
    tensors: dict[str, TensorInfo]  # in file order
    data_offset: int  # absolute offset of the data section
    alignment: int

    def require(self, key: str) -> object:
        """The value of metadata `key`; HeaderError if the file does not have it."""
        if key not in self.metadata:
            raise HeaderError(f"{self.path}: missing metadata '{key}'")
        return self.metadata[key]


class _Cursor:
    """Sequential reads from an open file, each checked against the file size first."""

    def __init__(self, f: BinaryIO, path: Path, size: int):
        self.f, self.path, self.size, self.pos = f, path, size, 0

    def error(self, message: str) -> HeaderError:
        return HeaderError(f"{self.path}: {message}")

    def take(self, n: int) -> bytes:
        truncated = f"truncated header: needs {n} bytes at offset {self.pos}, file has {self.size}"
        if self.pos + n > self.size:
            raise self.error(truncated)
        data = self.f.read(n)
        if len(data) != n:  # the file shrank while being read
            raise self.error(truncated)
        self.pos += n
        return data

    def unpack(self, fmt: str, count: int = 1) -> tuple:
        layout = struct.Struct(f"<{count}{fmt}")
        return layout.unpack(self.take(layout.size))

    def u32(self) -> int:
        return self.unpack("I")[0]

    def count(self, what: str, min_item_bytes: int) -> int:
        """A uint64 count of items of at least `min_item_bytes` each, refused if it cannot fit."""
        at = self.pos
        n = self.unpack("Q")[0]
        if n * min_item_bytes > self.size:
            raise self.error(
                f"{what} {n} at offset {at} cannot fit in the file ({self.size} bytes)"
            )
        return n

    def string(self, what: str) -> str:
        n = self.count(f"{what} length", 1)
        at = self.pos
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} at offset {at} is not valid utf-8") from None


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> object:
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is not None:
        return cur.unpack(fmt)[0]
    if vtype == _STRING:
        return cur.string(f"value of '{key}'")
    if vtype != _ARRAY:
        raise cur.error(f"unknown metadata value type {vtype} for key '{key}'")
    if depth >= _MAX_ARRAY_NESTING:
        raise cur.error(f"arrays nested more than {_MAX_ARRAY_NESTING} deep in key '{key}'")
    item_type = cur.u32()
    fmt = _SCALAR_FORMATS.get(item_type)
    if fmt is not None:  # fixed-size items: one bulk unpack
        n = cur.count(f"array count of '{key}'", struct.calcsize(fmt))
        return list(cur.unpack(fmt, n))
    if item_type not in _MIN_ITEM_BYTES:
        raise cur.error(f"unknown metadata value type {item_type} in array '{key}'")
    n = cur.count(f"array count of '{key}'", _MIN_ITEM_BYTES[item_type])
    return [_read_value(cur, item_type, key, depth + 1) for _ in range(n)]


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse the GGUF header of `path` without touching its tensor data."""
    path = Path(path)
    with open(path, "rb") as f:
        cur = _Cursor(f, path, os.fstat(f.fileno()).st_size)
        magic = cur.take(4)
        if magic != MAGIC:
            raise cur.error(f"not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        version = cur.u32()
        if version not in SUPPORTED_VERSIONS:
            raise cur.error(f"GGUF version {version} is not supported (reads 2 and 3)")
        n_tensors = cur.count("tensor count", _MIN_TENSOR_INFO_BYTES)
        n_kv = cur.count("metadata kv count", _MIN_KV_BYTES)

        metadata: dict[str, object] = {}
        for _ in range(n_kv):
            at = cur.pos
            key = cur.string("metadata key")
            if key in metadata:
                raise cur.error(f"duplicate metadata key '{key}' at offset {at}")
            vtype = cur.u32()
            metadata[key] = _read_value(cur, vtype, key)
            if key == "general.alignment" and vtype != _UINT32:
                raise cur.error(f"general.alignment has value type {vtype}, expected uint32")

        infos: dict[str, tuple[tuple[int, ...], int, int]] = {}  # name -> shape, type, offset
        for _ in range(n_tensors):
            at = cur.pos
            name = cur.string("tensor name")
            if name in infos:
                raise cur.error(f"duplicate tensor name '{name}' at offset {at}")
            n_dims = cur.u32()
            if n_dims * 8 > cur.size:
                raise cur.error(f"tensor '{name}' has {n_dims} dims, cannot fit in the file")
            shape = cur.unpack("Q", n_dims)
            ggml_type, relative_offset = cur.unpack("IQ")
            infos[name] = (shape, ggml_type, relative_offset)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise cur.error(f"general.alignment {alignment} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment  # round up to the alignment
    tensors = {
        name: TensorInfo(name, shape, ggml_type, data_offset + relative_offset)
        for name, (shape, ggml_type, relative_offset) in infos.items()
    }
    return GGUFHeader(path, version, metadata, tensors, data_offset, alignment)
