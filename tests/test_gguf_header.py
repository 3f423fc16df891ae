"""moeshard.moe.storage.gguf_header: our own GGUF header reader, checked against gguf.GGUFReader."""

from __future__ import annotations

import dataclasses
import random
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from moeshard.moe.storage.gguf_header import HeaderError, TensorInfo, read_header

U32, U64, ARR, STR = (
    GGUFValueType.UINT32,
    GGUFValueType.UINT64,
    GGUFValueType.ARRAY,
    GGUFValueType.STRING,
)

# name -> (array as written, ggml type the writer records); numpy order, C-contiguous
TENSORS = {
    "tok_embd.weight": (np.arange(15, dtype=np.float32).reshape(3, 5), GGMLQuantizationType.F32),
    "blk.0.attn_q.weight": (
        np.linspace(-1, 1, 24, dtype=np.float16).reshape(2, 3, 4),
        GGMLQuantizationType.F16,
    ),
    "blk.0.ids": (np.arange(7, dtype=np.int32), GGMLQuantizationType.I32),
    # Q8_0 written as raw bytes: 4 rows of one 34-byte block = 4 x 32 quantized values
    "blk.0.ffn_q8.weight": (
        np.arange(4 * 34, dtype=np.uint8).reshape(4, 34),
        GGMLQuantizationType.Q8_0,
    ),
}
RECORD = np.arange(-50, 50, dtype=np.int8)  # an expert record, the way moeshard stores it


def write_sample(path, alignment=None):
    """A GGUF file with many metadata types and tensors, written by gguf.GGUFWriter."""
    w = GGUFWriter(path, "moeshard")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("test.string", "naïve ✓ text")
    w.add_uint8("test.u8", 250)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 65000)
    w.add_int16("test.i16", -32000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float32("test.f32", 0.1)
    w.add_float64("test.f64", 1e-300)
    w.add_bool("test.true", True)
    w.add_bool("test.false", False)
    w.add_key_value("test.arr_u32", [1, 2, 4_000_000_000], ARR, U32)
    w.add_key_value("test.arr_u64", [0, 2**40, 2**64 - 1], ARR, U64)
    w.add_key_value("test.arr_str", ["a", "", "ünïcode", "x" * 300], ARR, STR)
    for name, (array, qtype) in TENSORS.items():
        raw = qtype if qtype == GGMLQuantizationType.Q8_0 else None
        w.add_tensor(name, array, raw_dtype=raw)
    w.add_tensor_info("blk.0.expert.0", [RECORD.nbytes], RECORD.dtype, RECORD.nbytes,
                      GGMLQuantizationType.I8)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for array, _ in TENSORS.values():
        w.write_tensor_data(array)
    w.write_tensor_data(RECORD)
    w.close()
    return path


@pytest.fixture(params=[None, 4096], ids=["default-alignment", "alignment-4096"])
def sample(request, tmp_path):
    return write_sample(tmp_path / "sample.gguf", request.param)


def test_matches_gguf_reader(sample):
    header = read_header(sample)
    reference = GGUFReader(sample)

    expected_meta = {
        name: field.contents()
        for name, field in reference.fields.items()
        if not name.startswith("GGUF.")  # the reader's pseudo-fields for version and counts
    }
    assert header.metadata == expected_meta
    assert list(header.metadata) == list(expected_meta)  # file order
    assert header.version == 3
    assert header.alignment == reference.alignment
    assert header.data_offset == reference.data_offset
    assert header.data_offset % header.alignment == 0

    assert list(header.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        info = header.tensors[t.name]
        assert info.name == t.name
        assert info.shape == tuple(int(d) for d in t.shape)  # both as stored: innermost first
        assert info.ggml_type == int(t.tensor_type)
        assert info.offset == t.data_offset


def test_values_and_tensors_as_written(sample):
    header = read_header(sample)
    meta = header.metadata
    assert meta["test.string"] == "naïve ✓ text"
    assert meta["test.u64"] == 2**63 + 5 and meta["test.i64"] == -(2**62)
    assert meta["test.f32"] == float(np.float32(0.1)) and meta["test.f64"] == 1e-300
    assert meta["test.true"] is True and meta["test.false"] is False
    assert meta["test.arr_u32"] == [1, 2, 4_000_000_000]
    assert meta["test.arr_u64"] == [0, 2**40, 2**64 - 1]
    assert meta["test.arr_str"] == ["a", "", "ünïcode", "x" * 300]
    assert header.require("general.architecture") == "moeshard"

    raw = sample.read_bytes()
    for name, (array, qtype) in TENSORS.items():
        info = header.tensors[name]
        assert info.ggml_type == qtype
        assert info.offset % header.alignment == 0
        assert raw[info.offset : info.offset + array.nbytes] == array.tobytes()
        if qtype != GGMLQuantizationType.Q8_0:
            assert tuple(reversed(info.shape)) == array.shape  # file order is numpy's reversed
    assert header.tensors["blk.0.ffn_q8.weight"].shape == (32, 4)
    record = header.tensors["blk.0.expert.0"]
    assert (record.shape, record.ggml_type) == ((100,), GGMLQuantizationType.I8)
    assert raw[record.offset : record.offset + 100] == RECORD.tobytes()


def test_custom_alignment(tmp_path):
    header = read_header(write_sample(tmp_path / "a.gguf", 4096))
    assert header.alignment == 4096 and header.metadata["general.alignment"] == 4096
    assert header.data_offset == 4096
    assert [t.offset % 4096 for t in header.tensors.values()] == [0] * len(header.tensors)


def test_require_names_file_and_key(sample):
    header = read_header(sample)
    assert header.require("test.u32") == 4_000_000_000
    with pytest.raises(HeaderError, match=f"{sample}: missing metadata 'no.such.key'"):
        header.require("no.such.key")


def test_truncated_data_section_still_reads(sample, tmp_path):
    full = read_header(sample)
    raw = sample.read_bytes()
    for cut in (full.data_offset + 10, full.data_offset, full.data_offset - 1):
        short = tmp_path / f"short-{cut}.gguf"
        short.write_bytes(raw[:cut])
        header = read_header(short)
        assert header == dataclasses.replace(full, path=short)
        # the caller can see what is cut off: the last record ends past the end of the file
        assert header.tensors["blk.0.expert.0"].offset + RECORD.nbytes > cut


def header_end(path) -> int:
    """Where the tensor infos end (before the padding): the first byte a cut leaves unharmed."""
    reader = GGUFReader(path)
    last = reader.tensors[-1].field
    return last.offset + sum(int(part.nbytes) for part in last.parts)


def test_cut_inside_header_names_the_file(sample, tmp_path):
    raw = sample.read_bytes()
    short = tmp_path / "cut.gguf"
    for cut in range(header_end(sample)):
        short.write_bytes(raw[:cut])
        with pytest.raises(HeaderError) as exc:
            read_header(short)
        message = str(exc.value)
        assert message.startswith(f"{short}: ") and "\n" not in message
        assert "truncated header" in message or "cannot fit in the file" in message, message


def test_truncated_message_gives_sizes(tmp_path):
    path = tmp_path / "t.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQ", 3, 0))  # kv count missing
    with pytest.raises(
        HeaderError, match=r"truncated header: needs 8 bytes at offset 16, file has 16"
    ):
        read_header(path)


def raw_header(*kvs: bytes, tensors=(), n_tensors=None, version=3, magic=b"GGUF") -> bytes:
    """Hand-made header bytes: kv pairs and tensor infos, already encoded."""
    n_tensors = len(tensors) if n_tensors is None else n_tensors
    counts = struct.pack("<IQQ", version, n_tensors, len(kvs))
    return magic + counts + b"".join(kvs) + b"".join(tensors)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str, fmt: str, *values) -> bytes:
    return gstr(key) + struct.pack("<" + fmt, *values)


TENSOR_T = gstr("t") + struct.pack("<IQIQ", 1, 4, 0, 0)  # "t": 1 dim of 4, F32, offset 0
BAD_HEADERS = [
    ("empty", b"", "truncated header: needs 4 bytes at offset 0, file has 0"),
    ("magic", b"GGML" + bytes(40), r"not a GGUF file \(magic b'GGML', expected b'GGUF'\)"),
    ("version-7", raw_header(version=7), "GGUF version 7 is not supported"),
    ("version-1", raw_header(version=1), "GGUF version 1 is not supported"),
    ("tensor-count", raw_header(n_tensors=2**50), "tensor count 1125899906842624 at offset 8"),
    ("key-length", raw_header(struct.pack("<Q", 2**63)), "metadata key length 9223372036854775808"),
    ("string-length", raw_header(kv("x", "IQ", 8, 2**64 - 1)), "value of 'x' length 1844"),
    ("value-type", raw_header(kv("x", "I", 99)), "unknown metadata value type 99 for key 'x'"),
    ("array-count", raw_header(kv("x", "IIQ", 9, 4, 2**40)), "array count of 'x' 1099511627776"),
    ("string-array-count", raw_header(kv("x", "IIQ", 9, 8, 2**40)), "array count of 'x'"),
    ("array-type", raw_header(kv("x", "IIQ", 9, 42, 1)), "unknown metadata value type 42 in"),
    ("deep-array", raw_header(kv("x", "I", 9) + struct.pack("<IQ", 9, 1) * 8), "nested more"),
    ("utf-8", raw_header(gstr(b"\xff\xfe") + struct.pack("<IB", 0, 1)), "not valid utf-8"),
    ("dup-key", raw_header(kv("k", "IB", 0, 1), kv("k", "IB", 0, 1)), "duplicate metadata key"),
    (
        "alignment-type",
        raw_header(kv("general.alignment", "IQ", 10, 64)),
        "general.alignment has value type 10, expected uint32",
    ),
    (
        "alignment-value",
        raw_header(kv("general.alignment", "II", 4, 48)),
        "general.alignment 48 is not a power of two",
    ),
    ("n-dims", raw_header(tensors=[kv("t", "I", 2**31)]), "tensor 't' has 2147483648 dims"),
    ("dup-tensor", raw_header(tensors=[TENSOR_T] * 2), "duplicate tensor name 't' at offset 57"),
    (
        "cut-tensor-info",  # cut inside the dims of the second tensor info
        raw_header(tensors=[TENSOR_T, kv("u", "IQIQ", 1, 4, 0, 16)])[:-20],
        "truncated header: needs 8 bytes at offset 70, file has 70",
    ),
]


@pytest.mark.parametrize(
    ("data", "message"), [c[1:] for c in BAD_HEADERS], ids=[c[0] for c in BAD_HEADERS]
)
def test_bad_headers(tmp_path, data, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(HeaderError, match=message) as exc:
        read_header(path)
    assert str(exc.value).startswith(f"{path}: ") and "\n" not in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_hand_made_header(tmp_path):
    """What GGUFWriter will not write: empty string and array, nested arrays, version 2."""
    empty_array = gstr("empty") + struct.pack("<IIQ", 9, 4, 0)
    empty_string = gstr("none") + struct.pack("<IQ", 8, 0)
    nested = gstr("nested") + struct.pack("<IIQ", 9, 9, 2)
    nested += struct.pack("<IQ2H", 2, 2, 1, 2) + struct.pack("<IQ", 8, 1) + gstr("s")
    info = gstr("w") + struct.pack("<I2QIQ", 2, 3, 2, 0, 64)  # dims (3, 2), F32, offset 64
    data = raw_header(empty_array, empty_string, nested, tensors=[info], version=2)
    path = tmp_path / "hand.gguf"
    path.write_bytes(data)
    header = read_header(path)
    assert header.version == 2
    assert header.metadata == {"empty": [], "none": "", "nested": [[1, 2], ["s"]]}
    assert len(data) == 185 and header.alignment == 32 and header.data_offset == 192
    assert header.tensors == {"w": TensorInfo("w", (3, 2), 0, 192 + 64)}


def test_garbage_raises_only_header_error(sample, tmp_path):
    """Random bytes, and a real header with random bytes overwritten: read or HeaderError."""
    rng = random.Random(1234)
    raw = sample.read_bytes()
    end = header_end(sample)
    path = tmp_path / "garbage.gguf"
    for i in range(600):
        if i % 3 == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
            if i % 2:
                data = b"GGUF" + struct.pack("<I", rng.choice((2, 3))) + data
        else:
            data = bytearray(raw[: rng.randrange(end - 64, len(raw) + 1)])
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(8, min(end, len(data)))] = rng.getrandbits(8)
        path.write_bytes(bytes(data))
        try:
            header = read_header(path)
        except HeaderError as exc:
            assert str(exc).startswith(f"{path}: ")
        else:
            assert header.data_offset % header.alignment == 0
