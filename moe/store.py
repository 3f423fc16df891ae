"""The model directory and its GGUF files: trunk file, expert shard files, manifest.

A model directory holds:
  moeshard.json          manifest: format version, model id, formats, file list, geometry
  config.json            the Hugging Face config it was converted from (and generation_config.json,
                         tokenizer.json when the checkpoint had them)
  trunk.gguf             every dense tensor (embeddings, attention, norms, routers, shared experts)
  experts-NNNNN.gguf     expert shard files: one record per (layer, expert)

All .gguf files are written and read with the `gguf` package, aligned to 4096 bytes. A record
holds one expert's gate, up and down matrices back to back in the kernel layout of
`moe.quant`, so one read of one byte range fetches the whole expert. GGUF metadata carries the
format version, the model id, and for shards the (layer, expert) -> (offset, nbytes, crc32)
index; records are stored as opaque I8 tensors named `blk.L.expert.E`.

The model id is the sha256 of the config and of every tensor's and record's checksum, so two
directories (or a node's shard directory and the coordinator's) agree on it only if they hold
the same model in the same formats.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from moe import quant
from moe.errors import StoreError
from moe.trunk import Trunk, TrunkTensor

FORMAT_VERSION = 1
ALIGNMENT = 4096
ARCH = "moeshard"
MANIFEST = "moeshard.json"
TRUNK_FILE = "trunk.gguf"
PLACEHOLDER_ID = "0" * 64
GGUF_MAGIC = b"GGUF"


def crc32(data: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(data)).cast("B")) & 0xFFFFFFFF


def record_name(layer: int, expert: int) -> str:
    return f"blk.{layer}.expert.{expert}"


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------------------------
# Writing


class StreamingGGUF:
    """Write a GGUF file whose tensors are produced one at a time, in declaration order.

    GGUF puts metadata before the data, but checksums and the model id are known only after
    the data is written. So the header is first written with fixed-size placeholders, and
    `finish` rewrites it in place with the real values (same byte length, checked).
    """

    def __init__(self, path: Path, kind: str):
        self.path = path
        self.kind = kind
        self.kv: dict[str, tuple[object, GGUFValueType, GGUFValueType | None]] = {}
        self.tensors: list[tuple[str, int]] = []  # (name, nbytes) in write order
        self.header_len = 0
        self.writer: GGUFWriter | None = None
        self.written = 0

    def set(self, key: str, value, vtype: GGUFValueType, sub: GGUFValueType | None = None):
        self.kv[key] = (value, vtype, sub)

    def declare(self, name: str, nbytes: int) -> int:
        """Reserve a tensor; returns its offset relative to the data section."""
        offset = sum(align_up(n) for _, n in self.tensors)
        self.tensors.append((name, nbytes))
        return offset

    def _make_writer(self, path: Path) -> GGUFWriter:
        w = GGUFWriter(path, ARCH)
        w.add_custom_alignment(ALIGNMENT)
        w.add_uint32("moeshard.format_version", FORMAT_VERSION)
        w.add_string("moeshard.kind", self.kind)
        for key, (value, vtype, sub) in self.kv.items():
            w.add_key_value(key, value, vtype, sub)
        for name, nbytes in self.tensors:
            w.add_tensor_info(name, [nbytes], np.dtype(np.int8), nbytes, GGMLQuantizationType.I8)
        return w

    def begin(self) -> None:
        self.writer = self._make_writer(self.path)
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()
        self.header_len = self.writer.fout[0].tell()

    def write(self, data: np.ndarray) -> None:
        name, nbytes = self.tensors[self.written]
        if data.nbytes != nbytes:
            raise StoreError(f"{self.path}: {name} has {data.nbytes} bytes, declared {nbytes}")
        self.writer.write_tensor_data(data.view(np.int8))
        self.written += 1

    def finish(self) -> None:
        """Close the file, then rewrite the header with the final metadata values."""
        if self.written != len(self.tensors):
            raise StoreError(f"{self.path}: {self.written} of {len(self.tensors)} tensors written")
        self.writer.close()
        scratch = self.path.with_suffix(".header")
        w = self._make_writer(scratch)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        header = scratch.read_bytes()
        scratch.unlink()
        if len(header) != self.header_len:
            raise StoreError(f"{self.path}: header size changed on rewrite (internal error)")
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, header, 0)
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass
class ExpertIndex:
    """Where each expert record of one shard file lives (offsets relative to the data start)."""

    layers: list[int]
    experts: list[int]
    offsets: list[int]
    nbytes: list[int]
    crcs: list[int]


class ShardWriter:
    """Writes one expert shard file: declare the records, then write them in that order."""

    def __init__(self, path: Path, fmt: str, hidden: int, inter: int, model_type: str):
        self.fmt, self.hidden, self.inter = fmt, hidden, inter
        self.record_nbytes = quant.expert_record_nbytes(fmt, hidden, inter)
        self.file = StreamingGGUF(path, "experts")
        self.index = ExpertIndex([], [], [], [], [])
        self.model_type = model_type

    def declare(self, layer: int, expert: int) -> None:
        offset = self.file.declare(record_name(layer, expert), self.record_nbytes)
        self.index.layers.append(layer)
        self.index.experts.append(expert)
        self.index.offsets.append(offset)
        self.index.nbytes.append(self.record_nbytes)
        self.index.crcs.append(0)

    def _set_metadata(self, model_id: str) -> None:
        u32, u64, arr = GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.ARRAY
        f = self.file
        f.set("moeshard.model_id", model_id, GGUFValueType.STRING)
        f.set("moeshard.model_type", self.model_type, GGUFValueType.STRING)
        f.set("moeshard.experts.format", self.fmt, GGUFValueType.STRING)
        f.set("moeshard.experts.hidden", self.hidden, u32)
        f.set("moeshard.experts.inter", self.inter, u32)
        f.set("moeshard.experts.layer", self.index.layers, arr, u32)
        f.set("moeshard.experts.expert", self.index.experts, arr, u32)
        f.set("moeshard.experts.offset", self.index.offsets, arr, u64)
        f.set("moeshard.experts.nbytes", self.index.nbytes, arr, u64)
        f.set("moeshard.experts.crc32", self.index.crcs, arr, u32)

    def begin(self) -> None:
        self._set_metadata(PLACEHOLDER_ID)
        self.file.begin()

    def write(self, record: np.ndarray) -> int:
        """Write the next declared record; returns its crc32."""
        i = self.file.written
        self.index.crcs[i] = crc32(record)
        self.file.write(record)
        return self.index.crcs[i]

    def finish(self, model_id: str) -> None:
        self._set_metadata(model_id)
        self.file.finish()


class TrunkWriter:
    """Writes trunk.gguf: declare (name, fmt, shape) for every tensor, then write them in order."""

    def __init__(self, path: Path, model_type: str):
        self.file = StreamingGGUF(path, "trunk")
        self.entries: list[list] = []  # [name, fmt, shape]
        self.crcs: list[int] = []
        self.model_type = model_type

    def declare(self, name: str, fmt: str, shape: tuple[int, ...]) -> None:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        self.file.declare(name, quant.packed_nbytes(fmt, rows, cols))
        self.entries.append([name, fmt, list(shape)])
        self.crcs.append(0)

    def _set_metadata(self, model_id: str) -> None:
        f = self.file
        f.set("moeshard.model_id", model_id, GGUFValueType.STRING)
        f.set("moeshard.model_type", self.model_type, GGUFValueType.STRING)
        f.set("moeshard.trunk.index", json.dumps(self.entries), GGUFValueType.STRING)
        f.set("moeshard.trunk.crc32", self.crcs, GGUFValueType.ARRAY, GGUFValueType.UINT32)

    def begin(self) -> None:
        self._set_metadata(PLACEHOLDER_ID)
        self.file.begin()

    def write(self, data: np.ndarray) -> int:
        i = self.file.written
        self.crcs[i] = crc32(data)
        self.file.write(data)
        return self.crcs[i]

    def finish(self, model_id: str) -> None:
        self._set_metadata(model_id)
        self.file.finish()


# ---------------------------------------------------------------------------------------------
# Reading


class _HeaderReader(GGUFReader):
    """GGUFReader that parses metadata and tensor infos but defers building tensor views, so a
    truncated file still opens far enough for the error to name the record that is cut off."""

    def _build_tensors(self, start_offs, fields) -> None:
        self._deferred_tensors = (start_offs, fields)

    def build_tensors(self) -> None:
        GGUFReader._build_tensors(self, *self._deferred_tensors)


def _field(reader: GGUFReader, key: str, path: Path):
    field = reader.get_field(key)
    if field is None:
        raise StoreError(f"{path}: missing metadata '{key}'")
    return field.contents()


def _open_gguf(path: Path, kind: str) -> _HeaderReader:
    """Open and check a moeshard GGUF file: magic, version, kind. Errors name the file."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise StoreError(f"{path}: cannot open ({exc.strerror})") from None
    if magic != GGUF_MAGIC:
        raise StoreError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _HeaderReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise StoreError(f"{path}: malformed or truncated GGUF header ({exc})") from None
    version = reader.get_field("moeshard.format_version")
    if version is None:
        raise StoreError(f"{path}: GGUF file is not a moeshard file (no moeshard.format_version)")
    if int(version.contents()) != FORMAT_VERSION:
        raise StoreError(
            f"{path}: moeshard format version {version.contents()} is not supported "
            f"(this build reads version {FORMAT_VERSION})"
        )
    found = _field(reader, "moeshard.kind", path)
    if found != kind:
        raise StoreError(f"{path}: is a '{found}' file, expected '{kind}'")
    return reader


@dataclass(frozen=True)
class RecordLocation:
    path: Path
    offset: int  # absolute byte offset in the file (a multiple of ALIGNMENT)
    nbytes: int
    crc32: int


class ShardFile:
    """One expert shard file, opened and validated: its index, reads of single records."""

    def __init__(self, path: Path, expected_model_id: str | None = None):
        self.path = Path(path)
        reader = _open_gguf(self.path, "experts")
        self.model_id = _field(reader, "moeshard.model_id", self.path)
        if expected_model_id is not None and self.model_id != expected_model_id:
            raise StoreError(
                f"{self.path}: model id {self.model_id[:16]} does not match the directory's "
                f"{expected_model_id[:16]} (a shard from another model or conversion)"
            )
        self.fmt = _field(reader, "moeshard.experts.format", self.path)
        self.hidden = int(_field(reader, "moeshard.experts.hidden", self.path))
        self.inter = int(_field(reader, "moeshard.experts.inter", self.path))
        columns = [
            _field(reader, f"moeshard.experts.{k}", self.path)
            for k in ("layer", "expert", "offset", "nbytes", "crc32")
        ]
        size = self.path.stat().st_size
        self.records: dict[tuple[int, int], RecordLocation] = {}
        for layer, expert, offset, nbytes, crc in zip(*columns, strict=True):
            start = int(reader.data_offset) + int(offset)
            if start + int(nbytes) > size:
                raise StoreError(
                    f"{self.path}: truncated: expert {expert} of layer {layer} ends at byte "
                    f"{start + int(nbytes)}, file has {size}"
                )
            self.records[(int(layer), int(expert))] = RecordLocation(
                self.path, start, int(nbytes), int(crc)
            )
        del reader  # drops the memory map; reads go through plain file descriptors
        self._fd = os.open(self.path, os.O_RDONLY)

    def read(self, layer: int, expert: int, verify: bool = True) -> np.ndarray:
        """One expert record as uint8 [nbytes]; checksum-verified unless verify=False."""
        loc = self.records[(layer, expert)]
        data = np.frombuffer(os.pread(self._fd, loc.nbytes, loc.offset), dtype=np.uint8)
        if len(data) != loc.nbytes:
            raise StoreError(f"{self.path}: short read of expert {expert} of layer {layer}")
        if verify and crc32(data) != loc.crc32:
            raise StoreError(
                f"{self.path}: checksum mismatch in expert {expert} of layer {layer} "
                f"(record corrupted)"
            )
        return data

    def verify_all(self) -> list[tuple[int, int]]:
        """Recompute every record's checksum; returns the (layer, expert) keys that fail."""
        bad = []
        for key, loc in self.records.items():
            data = os.pread(self._fd, loc.nbytes, loc.offset)
            if len(data) != loc.nbytes or zlib.crc32(data) & 0xFFFFFFFF != loc.crc32:
                bad.append(key)
        return bad

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def load_trunk(path: Path, expected_model_id: str | None, verify: bool = True) -> Trunk:
    """Read trunk.gguf into memory as a Trunk; each tensor checksum-verified."""
    reader = _open_gguf(path, "trunk")
    model_id = _field(reader, "moeshard.model_id", path)
    if expected_model_id is not None and model_id != expected_model_id:
        raise StoreError(
            f"{path}: model id {model_id[:16]} does not match the directory's "
            f"{expected_model_id[:16]}"
        )
    entries = json.loads(_field(reader, "moeshard.trunk.index", path))
    crcs = _field(reader, "moeshard.trunk.crc32", path)
    end, size = int(reader.data_offset), path.stat().st_size
    for name, fmt, shape in entries:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        nbytes = quant.packed_nbytes(fmt, rows, cols)
        if end + nbytes > size:
            raise StoreError(
                f"{path}: truncated: trunk tensor '{name}' ends at byte {end + nbytes}, "
                f"file has {size}"
            )
        end = align_up(end + nbytes)
    reader.build_tensors()
    by_name = {t.name: t for t in reader.tensors}
    tensors: dict[str, TrunkTensor] = {}
    for (name, fmt, shape), crc in zip(entries, crcs, strict=True):
        if name not in by_name:
            raise StoreError(f"{path}: tensor '{name}' listed in the index but not present")
        raw = by_name[name].data
        data = np.array(raw, dtype=np.int8, copy=True).view(np.uint8)  # own RAM, not the mmap
        if verify and crc32(data) != crc:
            raise StoreError(f"{path}: checksum mismatch in trunk tensor '{name}'")
        tensors[name] = TrunkTensor(fmt, tuple(shape), data)
    return Trunk(tensors)


def write_manifest(directory: Path, manifest: dict) -> None:
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise StoreError(f"{directory}: not a moeshard model directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable manifest ({exc})") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise StoreError(
            f"{path}: format version {version} not supported (this build reads {FORMAT_VERSION})"
        )
    for key in ("model_id", "expert_format", "expert_files"):
        if key not in manifest:
            raise StoreError(f"{path}: manifest lacks '{key}'")
    return manifest
