"""moeshard's GGUF files: a streaming writer and the opener that checks a file is ours.

All .gguf files are laid out by the `gguf` package and written by `StreamingGGUF`, aligned to
4096 bytes (O_DIRECT reads need it), and read back with our own header reader
(`moeshard.moe.storage.gguf_header`), which never touches tensor data, so a truncated file still
opens far enough for the error to name the record that is cut off. Records and trunk tensors are
stored as opaque I8 tensors in the kernel layout of `moeshard.moe.kernels.quant`; the metadata
carries the format version, the file kind ("trunk" or "experts"), the model id and the index of what
is where.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from moeshard.moe.errors import StoreError
from moeshard.moe.storage.gguf_header import GGUFHeader, HeaderError, read_header
from moeshard.moe.storage.io import align_up, with_filename, write_all
from moeshard.moe.storage.manifest import FORMAT_VERSION

ALIGNMENT = 4096
ARCH = "moeshard"


class StreamingGGUF:
    """Write a GGUF file whose tensors are produced one at a time, in declaration order.

    GGUF puts metadata before the data, but checksums and the model id are known only after
    the data is written. So the header is first written with fixed-size placeholders, and
    `finish` rewrites it in place with the real values (same byte length, checked).

    The `gguf` package only lays out the header (in memory); every byte is written here,
    through `moeshard.moe.storage.io.write_all`, so a short write is continued and a full disk is an
    OSError naming this file. `bytes_written` counts the bytes the file has grown by (header,
    data, alignment padding); when finished it equals `planned_size()`, the file's size.
    """

    def __init__(self, path: Path, kind: str):
        self.path = path
        self.kind = kind
        self.kv: dict[str, tuple[object, GGUFValueType, GGUFValueType | None]] = {}
        self.tensors: list[tuple[str, int]] = []  # (name, nbytes) in write order
        self.header_len = 0
        self.fout: io.FileIO | None = None
        self.written = 0  # tensors written
        self.bytes_written = 0  # bytes the file has grown by

    def set(self, key: str, value, vtype: GGUFValueType, sub: GGUFValueType | None = None):
        self.kv[key] = (value, vtype, sub)

    def declare(self, name: str, nbytes: int) -> int:
        """Reserve a tensor; returns its offset relative to the data section."""
        offset = sum(align_up(n, ALIGNMENT) for _, n in self.tensors)
        self.tensors.append((name, nbytes))
        return offset

    def header(self) -> bytes:
        """The header (magic, metadata, tensor infos) for the current metadata values, unpadded."""
        w = GGUFWriter(None, ARCH)
        w.add_custom_alignment(ALIGNMENT)
        w.add_uint32("moeshard.format_version", FORMAT_VERSION)
        w.add_string("moeshard.kind", self.kind)
        for key, (value, vtype, sub) in self.kv.items():
            w.add_key_value(key, value, vtype, sub)
        for name, nbytes in self.tensors:
            w.add_tensor_info(name, [nbytes], np.dtype(np.int8), nbytes, GGMLQuantizationType.I8)
        buf = io.BytesIO()
        w.fout, w.state = [buf], WriterState.EMPTY  # lay out into memory, not a file
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        return buf.getvalue()

    def planned_size(self) -> int:
        """The finished file's size in bytes, from the current metadata and the declarations
        (the header keeps its length when the placeholders are replaced)."""
        return align_up(len(self.header()), ALIGNMENT) + sum(
            align_up(n, ALIGNMENT) for _, n in self.tensors
        )

    def _put(self, data) -> None:
        self.bytes_written += write_all(self.fout, data, self.path)

    def _pad(self, nbytes: int) -> None:
        pad = align_up(nbytes, ALIGNMENT) - nbytes
        if pad:
            self._put(bytes(pad))

    def begin(self) -> None:
        header = self.header()
        self.header_len = len(header)
        self.fout = open(self.path, "wb", buffering=0)  # noqa: SIM115 - closed by finish/close
        self._put(header)
        self._pad(len(header))

    def write(self, data: np.ndarray) -> None:
        name, nbytes = self.tensors[self.written]
        if data.nbytes != nbytes:
            raise StoreError(f"{self.path}: {name} has {data.nbytes} bytes, declared {nbytes}")
        self._put(np.ascontiguousarray(data).view(np.uint8))
        self._pad(nbytes)
        self.written += 1

    def finish(self) -> None:
        """Rewrite the header with the final metadata values, sync and close the file."""
        if self.written != len(self.tensors):
            raise StoreError(f"{self.path}: {self.written} of {len(self.tensors)} tensors written")
        header = self.header()
        if len(header) != self.header_len:
            raise StoreError(f"{self.path}: header size changed on rewrite (internal error)")
        try:
            write_all(self.fout, header, self.path, offset=0)
            os.fsync(self.fout.fileno())
        except OSError as exc:
            raise with_filename(exc, self.path) from None
        finally:
            self.close()

    def close(self) -> None:
        """Close the file (finish does; call it to give up on an unfinished one)."""
        if self.fout is not None:
            self.fout.close()
            self.fout = None


def open_moeshard_gguf(path: Path, kind: str) -> GGUFHeader:
    """The header of a moeshard GGUF file of `kind`, checked: magic, versions, kind.
    Errors are StoreErrors naming the file."""
    try:
        header = read_header(path)
    except HeaderError as exc:
        raise StoreError(str(exc)) from None
    except OSError as exc:
        raise StoreError(f"{path}: cannot open ({exc.strerror})") from None
    version = header.metadata.get("moeshard.format_version")
    if version is None:
        raise StoreError(f"{path}: GGUF file is not a moeshard file (no moeshard.format_version)")
    if int(version) != FORMAT_VERSION:
        raise StoreError(
            f"{path}: moeshard format version {version} is not supported "
            f"(this build reads version {FORMAT_VERSION})"
        )
    found = field(header, "moeshard.kind")
    if found != kind:
        raise StoreError(f"{path}: is a '{found}' file, expected '{kind}'")
    return header


def field(header: GGUFHeader, key: str):
    """A metadata value, or a StoreError naming the file and the missing key."""
    if key not in header.metadata:
        raise StoreError(f"{header.path}: missing metadata '{key}'")
    return header.metadata[key]
