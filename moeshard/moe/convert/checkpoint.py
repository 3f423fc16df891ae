"""Read a Hugging Face safetensors checkpoint tensor by tensor, with bounded memory.

Files are parsed here (the format is an 8-byte header length, a JSON header, then raw
little-endian data) because numpy has no bfloat16 or float8 and the checkpoint may be larger
than RAM: each tensor (or one expert's slice of a stacked tensor) is read with pread into a
buffer of its own when asked for, converted to float32, and freed after use, so the process
never maps or holds more than the tensor at hand.

FP8 block-scaled weights (DeepSeek-V3 / Kimi-K2): a float8_e4m3fn `X.weight` [out, in] comes
with a float32 `X.weight_scale_inv` [ceil(out/B), ceil(in/B)]; the real weight is
fp8_value * scale_inv of the block that holds it (B = weight_block_size, 128 as published).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.errors import CheckpointError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # widened to float32 by shifting into the high half
    "F8_E4M3": np.uint8,  # decoded through a 256-entry table
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _e4m3fn_table() -> np.ndarray:
    """float32 value of every float8_e4m3fn byte (1 sign, 4 exponent bits bias 7, 3 mantissa)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.power(2.0, exponent.astype(np.float64) - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    value = sign * np.where(exponent == 0, subnormal, normal)
    value[(codes & 0x7F) == 0x7F] = np.nan  # e4m3fn has no infinities; S.1111.111 is NaN
    return value.astype(np.float32)


E4M3FN_TO_F32 = _e4m3fn_table()


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One .safetensors file: header parsed, data memory-mapped, tensors read on demand."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._fh = open(path, "rb")
            size = path.stat().st_size
            head = self._fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, 100 * 2**20):
                raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(self._fh.read(header_len))
        except CheckpointError:
            raise
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
        base = 8 + header_len
        self.entries: dict[str, TensorEntry] = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
                start, end = (base + int(o) for o in meta["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: malformed header entry for '{name}'") from None
            if dtype not in _DTYPES:
                raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
            expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
            if end - start != expected:
                raise CheckpointError(
                    f"{path}: tensor '{name}' has {end - start} bytes, shape {list(shape)} "
                    f"{dtype} needs {expected}"
                )
            if end > size:
                raise CheckpointError(
                    f"{path}: truncated: tensor '{name}' ends at byte {end}, file has {size}"
                )
            self.entries[name] = TensorEntry(path, dtype, shape, start, end)

    def raw(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor's stored values (no conversion), or only its slice [index] on axis 0."""
        e = self.entries[name]
        start, nbytes, shape = e.start, e.end - e.start, e.shape
        if index is not None:
            nbytes //= shape[0]
            start, shape = start + index * nbytes, shape[1:]
        data = os.pread(self._fh.fileno(), nbytes, start)
        if len(data) != nbytes:
            raise CheckpointError(f"{self.path}: short read of tensor '{name}'")
        return np.frombuffer(data, dtype=_DTYPES[e.dtype]).reshape(shape)

    def float32(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor (or its slice [index]) as float32; bf16/f16/f8 widened."""
        e = self.entries[name]
        raw = self.raw(name, index)
        if e.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if e.dtype == "F8_E4M3":
            return E4M3FN_TO_F32[raw]
        return raw.astype(np.float32)

    def close(self) -> None:
        self._fh.close()


class Checkpoint:
    """All safetensors files of a checkpoint directory, addressed by tensor name."""

    def __init__(self, directory: Path):
        self.directory = directory
        files = sorted(directory.glob("*.safetensors"))
        index_path = directory / "model.safetensors.index.json"
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path}: malformed index ({exc})") from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (directory / n).exists()]
            if missing:
                raise CheckpointError(f"{index_path}: names missing shard file {missing[0]}")
            files = [directory / n for n in names]
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files")
        self.files = [SafetensorsFile(f) for f in files]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.entries:
                self.where[name] = f

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].entries[name].shape

    def describe(self, name: str) -> str:
        return f"{self.where[name].path.name}:{name}"

    def dtype(self, name: str) -> str:
        return self.where[name].entries[name].dtype

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name` as stored (no conversion)."""
        return self.where[name].raw(name)

    def float32(self, name: str, block: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `name` as float32; fp8 weights with a scale_inv companion are dequantized."""
        f = self.where[name]
        value = f.float32(name)
        scale_name = name + "_scale_inv"
        if f.entries[name].dtype == "F8_E4M3" and scale_name in self.where:
            value = dequantize_fp8_blocks(
                value, self.where[scale_name].float32(scale_name), block or (128, 128), name
            )
        return value

    def close(self) -> None:
        for f in self.files:
            f.close()


def dequantize_fp8_blocks(
    w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str
) -> np.ndarray:
    """w [out, in] (fp8 values as float32) * scale_inv [ceil(out/B0), ceil(in/B1)] per block."""
    rows, cols = w.shape
    b0, b1 = block
    expected = (-(-rows // b0), -(-cols // b1))
    if scale_inv.shape != expected:
        raise CheckpointError(
            f"{name}_scale_inv: shape {list(scale_inv.shape)}, expected {list(expected)} "
            f"for weight {list(w.shape)} with {b0}x{b1} blocks"
        )
    scale = np.repeat(np.repeat(scale_inv, b0, axis=0)[:rows], b1, axis=1)[:, :cols]  # [out, in]
    return (w * scale).astype(np.float32)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """Write name -> (safetensors dtype, shape, raw little-endian bytes) as one .safetensors
    file (for checkpoints made here: `tools/make_big_checkpoint.py`, tests), through a
    temporary name renamed when complete."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, data in tensors.values():
            f.write(data)
    os.replace(tmp, path)
