"""Expert shard files (`experts-NNNNN.gguf`): one contiguous record per (layer, expert).

A record holds one expert's gate, up and down matrices back to back in the kernel layout of
`moeshard.moe.kernels.quant`, so one read of one byte range fetches the whole expert. The file's
metadata indexes them: (layer, expert) -> (offset, nbytes, crc32); records are stored as
opaque I8 tensors named `blk.L.expert.E`, each starting at a 4096-byte boundary.

`ShardSet` is what the experts backends see of a model directory: every record of its shard
files, by (layer, expert), with the experts' format and shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from moeshard.moe.errors import StoreError
from moeshard.moe.kernels import quant
from moeshard.moe.storage.gguf_file import StreamingGGUF, field, open_moeshard_gguf
from moeshard.moe.storage.io import align_up, crc32
from moeshard.moe.storage.manifest import PLACEHOLDER_ID

Key = tuple[int, int]  # (layer, expert)


def record_name(layer: int, expert: int) -> str:
    return f"blk.{layer}.expert.{expert}"


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

    def declare(self, layer: int, expert: int, nbytes: int | None = None) -> None:
        """The next record: `nbytes` stored (default: the record size; fewer for a layer
        whose format is smaller than the model's largest, `ShardSet.read`)."""
        nbytes = self.record_nbytes if nbytes is None else nbytes
        offset = self.file.declare(record_name(layer, expert), nbytes)
        self.index.layers.append(layer)
        self.index.experts.append(expert)
        self.index.offsets.append(offset)
        self.index.nbytes.append(nbytes)
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

    def planned_size(self) -> int:
        """The finished file's size in bytes (call after every declare)."""
        self._set_metadata(PLACEHOLDER_ID)
        return self.file.planned_size()

    def begin(self) -> None:
        self._set_metadata(PLACEHOLDER_ID)
        self.file.begin()

    def write(self, record: np.ndarray) -> int:
        """Write the next declared record; returns its crc32."""
        i = self.file.written
        self.index.crcs[i] = crc32(np.ascontiguousarray(record))
        self.file.write(record)
        return self.index.crcs[i]

    def finish(self, model_id: str) -> None:
        self._set_metadata(model_id)
        self.file.finish()

    def close(self) -> None:
        """Give up on an unfinished file (closes it; the caller removes it)."""
        self.file.close()


@dataclass(frozen=True)
class RecordLocation:
    path: Path
    offset: int  # absolute byte offset in the file (a multiple of 4096)
    nbytes: int
    crc32: int


class ShardFile:
    """One expert shard file, opened and validated: its index, reads of single records."""

    def __init__(self, path: Path, expected_model_id: str | None = None):
        self.path = Path(path)
        header = open_moeshard_gguf(self.path, "experts")
        self.model_id = field(header, "moeshard.model_id")
        if expected_model_id is not None and self.model_id != expected_model_id:
            raise StoreError(
                f"{self.path}: model id {self.model_id[:16]} does not match the directory's "
                f"{expected_model_id[:16]} (a shard from another model or conversion)"
            )
        self.fmt = field(header, "moeshard.experts.format")
        self.hidden = int(field(header, "moeshard.experts.hidden"))
        self.inter = int(field(header, "moeshard.experts.inter"))
        columns = [
            field(header, f"moeshard.experts.{k}")
            for k in ("layer", "expert", "offset", "nbytes", "crc32")
        ]
        if len({len(c) for c in columns}) != 1:
            raise StoreError(f"{self.path}: expert index columns have different lengths")
        self.records: dict[Key, RecordLocation] = {}
        for layer, expert, offset, nbytes, crc in zip(*columns, strict=True):
            start = header.data_offset + int(offset)
            self.records[(int(layer), int(expert))] = RecordLocation(
                self.path, start, int(nbytes), int(crc)
            )
        # one stat, before anything is read: a cut-off file is refused here, naming its size
        size = self.path.stat().st_size
        ends = [loc.offset + loc.nbytes for loc in self.records.values()]
        expected = align_up(max(ends, default=header.data_offset))
        for (layer, expert), loc in self.records.items():
            if loc.offset + loc.nbytes > size:
                raise StoreError(
                    f"{self.path}: truncated: expert {expert} of layer {layer} ends at byte "
                    f"{loc.offset + loc.nbytes}, the file has {size} bytes, expected {expected}"
                )
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

    def verify_all(self) -> list[Key]:
        """Recompute every record's checksum; returns the (layer, expert) keys that fail."""
        bad = []
        for key, loc in self.records.items():
            data = os.pread(self._fd, loc.nbytes, loc.offset)
            if len(data) != loc.nbytes or crc32(data) != loc.crc32:
                bad.append(key)
        return bad

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShardSet:
    """The expert shard files of one directory, checked to agree: every record by key.

    fmt, hidden, inter: the experts' format (`quant.record_format`: one for every record, or
    one per layer) and shape (all files must match them).
    """

    def __init__(
        self,
        paths: list[Path],
        model_id: str,
        fmt: str,
        hidden: int,
        inter: int,
        glu: quant.Glu = quant.SWIGLU,
    ):
        self.fmt, self.hidden, self.inter, self.glu = fmt, hidden, inter, glu
        try:
            self.record_nbytes = quant.expert_record_nbytes(fmt, hidden, inter)
        except ValueError as exc:
            raise StoreError(f"the model's experts: {exc}") from None
        self.files = [ShardFile(p, model_id) for p in paths]
        self.locations: dict[Key, tuple[ShardFile, RecordLocation]] = {}
        for shard in self.files:
            if (shard.fmt, shard.hidden, shard.inter) != (fmt, hidden, inter):
                raise StoreError(
                    f"{shard.path}: experts are {shard.fmt} {shard.hidden}x{shard.inter}, the "
                    f"model needs {fmt} {hidden}x{inter}"
                )
            for key, loc in shard.records.items():
                want = self.stored_nbytes(key[0])
                if loc.nbytes != want:
                    raise StoreError(
                        f"{shard.path}: expert {key[1]} of layer {key[0]} has {loc.nbytes} "
                        f"bytes; its format, {self.record_format(key[0])}, has {want}"
                    )
                self.locations.setdefault(key, (shard, loc))

    def stored_nbytes(self, layer: int) -> int:
        """Bytes a record of layer `layer` takes on disk: its format's size, which for a mix
        of formats (one per layer) may be less than `record_nbytes`."""
        try:
            return quant.expert_record_nbytes(self.record_format(layer), self.hidden, self.inter)
        except ValueError as exc:
            raise StoreError(f"the model's experts: {exc}") from None

    def record_format(self, layer: int) -> str:
        """The format of layer `layer`'s records (`quant.record_format`): fmt itself, or
        for a GGUF file's mix its entry for the layer, e.g. "q4_K/q6_K"."""
        return quant.record_format(self.fmt, layer)

    def location(self, layer: int, expert: int) -> RecordLocation:
        """Where record (layer, expert) is, or a StoreError saying no shard holds it."""
        found = self.locations.get((layer, expert))
        if found is None:
            raise StoreError(f"no shard file here holds expert {expert} of layer {layer}")
        return found[1]

    def read(self, layer: int, expert: int, verify: bool = True) -> np.ndarray:
        """Record (layer, expert), uint8 [record_nbytes]: the stored bytes (checksum-verified
        unless verify=False), then zeros where its layer's format is smaller than the
        model's largest. That whole record is what the proofs of possession and the audits'
        hand-overs cover; the kernels read only the stored part."""
        self.location(layer, expert)
        shard, _ = self.locations[(layer, expert)]
        data = shard.read(layer, expert, verify)
        if data.size < self.record_nbytes:
            data = np.concatenate([data, np.zeros(self.record_nbytes - data.size, np.uint8)])
        return data

    def keys_of_layer(self, layer: int) -> list[int]:
        """The experts of `layer` held here, ascending."""
        return sorted(e for lay, e in self.locations if lay == layer)

    def close(self) -> None:
        for shard in self.files:
            shard.close()
