"""trunk.gguf: every dense tensor of the model (embeddings, attention, norms, routers, shared
experts, head), each stored in the kernel layout of `moeshard.moe.kernels.quant` and checksummed.

`TrunkLayout` is the file's index read from the header alone; `read_trunk_tensors` loads the
whole trunk into RAM through it; `moeshard.moe.model.streaming_trunk` streams layers through it.
Tensor names are sorted when written, so a decoder layer's tensors are contiguous and one
read fetches a whole layer.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from moeshard.moe.errors import StoreError
from moeshard.moe.kernels import quant
from moeshard.moe.storage.gguf_file import StreamingGGUF, field, open_moeshard_gguf
from moeshard.moe.storage.io import align_up, aligned_buffer, crc32
from moeshard.moe.storage.manifest import PLACEHOLDER_ID

LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# Routers stay resident even when the trunk is streamed: layer L+1's router is applied during
# layer L for next-layer prefetch, before layer L+1 is read.
ALWAYS_RESIDENT = tuple(
    f".{mlp}.gate.{x}"
    for mlp in ("mlp", "block_sparse_moe")  # (Kimi Linear and K3 name their MoE so)
    for x in ("weight", "bias", "e_score_correction_bias")  # (gpt-oss's router has a bias)
)


@dataclass
class TrunkTensor:
    """One trunk tensor as stored: format name, logical shape, packed bytes (kernel layout)."""

    fmt: str  # one of quant.FORMATS
    shape: tuple[int, ...]  # logical shape, HF order ([out, in] for linear weights)
    data: np.ndarray  # uint8 [packed_nbytes]

    def to_f32(self) -> np.ndarray:
        if self.fmt == "f32":  # packed f32 is row-major floats, zero-padded to 64 bytes
            return self.data.view(np.float32)[: int(np.prod(self.shape))].reshape(self.shape)
        rows, cols = as_matrix(self.shape)
        flat = quant.unpack_to_ggml(self.data, self.fmt, rows, cols)
        return quant.dequantize(flat, self.fmt, (rows, cols)).reshape(self.shape)


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) a tensor is packed as: vectors are one row."""
    if len(shape) == 1:
        return 1, shape[0]
    return int(np.prod(shape[:-1])), shape[-1]


class TrunkWriter:
    """Writes trunk.gguf: declare (name, fmt, shape) for every tensor, then write them in order."""

    def __init__(self, path: Path, model_type: str):
        self.file = StreamingGGUF(path, "trunk")
        self.entries: list[list] = []  # [name, fmt, shape]
        self.crcs: list[int] = []
        self.model_type = model_type

    def declare(self, name: str, fmt: str, shape: tuple[int, ...]) -> None:
        self.file.declare(name, quant.packed_nbytes(fmt, *as_matrix(shape)))
        self.entries.append([name, fmt, list(shape)])
        self.crcs.append(0)

    def _set_metadata(self, model_id: str) -> None:
        f = self.file
        f.set("moeshard.model_id", model_id, GGUFValueType.STRING)
        f.set("moeshard.model_type", self.model_type, GGUFValueType.STRING)
        f.set("moeshard.trunk.index", json.dumps(self.entries), GGUFValueType.STRING)
        f.set("moeshard.trunk.crc32", self.crcs, GGUFValueType.ARRAY, GGUFValueType.UINT32)

    def planned_size(self) -> int:
        """The finished file's size in bytes (call after every declare)."""
        self._set_metadata(PLACEHOLDER_ID)
        return self.file.planned_size()

    def begin(self) -> None:
        self._set_metadata(PLACEHOLDER_ID)
        self.file.begin()

    def write(self, data: np.ndarray) -> int:
        i = self.file.written
        self.crcs[i] = crc32(np.ascontiguousarray(data))
        self.file.write(data)
        return self.crcs[i]

    def finish(self, model_id: str) -> None:
        self._set_metadata(model_id)
        self.file.finish()

    def close(self) -> None:
        """Give up on an unfinished file (closes it; the caller removes it)."""
        self.file.close()


@dataclass(frozen=True)
class TrunkEntry:
    """Where one trunk tensor lives in trunk.gguf."""

    name: str
    fmt: str
    shape: tuple[int, ...]
    offset: int  # absolute, 4096-aligned
    nbytes: int
    crc: int


class TrunkLayout:
    """trunk.gguf's index, read from the header only (no tensor data is touched)."""

    def __init__(self, path: str | Path, expected_model_id: str | None = None):
        self.path = Path(path)
        header = open_moeshard_gguf(self.path, "trunk")
        model_id = field(header, "moeshard.model_id")
        if expected_model_id is not None and model_id != expected_model_id:
            raise StoreError(
                f"{self.path}: model id {model_id[:16]} does not match the directory's "
                f"{expected_model_id[:16]}"
            )
        try:
            index = json.loads(field(header, "moeshard.trunk.index"))
        except ValueError as exc:
            raise StoreError(f"{self.path}: malformed trunk index ({exc})") from None
        crcs = field(header, "moeshard.trunk.crc32")
        if len(index) != len(crcs):
            raise StoreError(f"{self.path}: trunk index and checksums differ in length")
        self.entries: dict[str, TrunkEntry] = {}
        for (name, fmt, shape), crc in zip(index, crcs, strict=True):
            info = header.tensors.get(name)
            if info is None:
                raise StoreError(f"{self.path}: tensor '{name}' listed in the index but absent")
            nbytes = quant.packed_nbytes(fmt, *as_matrix(tuple(shape)))
            self.entries[name] = TrunkEntry(name, fmt, tuple(shape), info.offset, nbytes, crc)
        # one stat, before anything is read: a cut-off file is refused here, naming its size
        size = self.path.stat().st_size
        expected = align_up(max((e.offset + e.nbytes for e in self.entries.values()), default=0))
        for e in self.entries.values():
            if e.offset + e.nbytes > size:
                raise StoreError(
                    f"{self.path}: truncated: trunk tensor '{e.name}' ends at byte "
                    f"{e.offset + e.nbytes}, the file has {size} bytes, expected {expected}"
                )
        self.layers: dict[int, list[str]] = {}
        self.fixed: list[str] = []  # always resident
        for name in self.entries:
            m = LAYER_NAME.match(name)
            if m is None or name.endswith(ALWAYS_RESIDENT):
                self.fixed.append(name)
            if m is not None:
                self.layers.setdefault(int(m.group(1)), []).append(name)
        self.n_layers = max(self.layers) + 1 if self.layers else 0

    def ram_bytes(self, name: str) -> int:
        """RAM a resident tensor costs: its bytes (an embedding lookup decodes only the rows
        it needs: `Trunk.embed`)."""
        return align_up(self.entries[name].nbytes)

    def span(self, layer: int) -> tuple[int, int]:
        """(offset, aligned length) of the one read that fetches all of a layer's tensors."""
        names = self.layers[layer]
        start = min(self.entries[n].offset for n in names)
        end = max(self.entries[n].offset + self.entries[n].nbytes for n in names)
        packed = sum(align_up(self.entries[n].nbytes) for n in names)
        if end - start > packed + 4096 * len(names):
            raise StoreError(f"{self.path}: layer {layer}'s tensors are not contiguous")
        return start, align_up(end - start)

    def fixed_bytes(self) -> int:
        return sum(self.ram_bytes(n) for n in self.fixed)

    def layer_bytes(self, layer: int) -> int:
        return sum(self.ram_bytes(n) for n in self.layers[layer] if n not in self.fixed)

    def total_bytes(self) -> int:
        return sum(self.ram_bytes(n) for n in self.entries)


def read_trunk_tensors(layout: TrunkLayout, verify: bool = True) -> dict[str, TrunkTensor]:
    """Every trunk tensor in RAM, each read into a page-aligned piece of one arena on huge
    pages (the kernels stream them: unaligned rows cost speed, 4 KiB pages TLB misses),
    checksums verified."""
    tensors: dict[str, TrunkTensor] = {}
    sizes = {name: align_up(e.nbytes) for name, e in layout.entries.items()}
    arena = aligned_buffer(sum(sizes.values()), huge=True)  # uint8 [sum of aligned sizes]
    at = 0
    fd = os.open(layout.path, os.O_RDONLY)
    try:
        for name, e in layout.entries.items():
            data = arena[at : at + e.nbytes]  # uint8 [nbytes]
            at += sizes[name]
            if os.preadv(fd, [memoryview(data)], e.offset) != e.nbytes:
                raise StoreError(f"{layout.path}: short read of trunk tensor '{name}'")
            if verify and crc32(data) != e.crc:
                raise StoreError(f"{layout.path}: checksum mismatch in trunk tensor '{name}'")
            tensors[name] = TrunkTensor(e.fmt, e.shape, data)
    finally:
        os.close(fd)
    return tensors
