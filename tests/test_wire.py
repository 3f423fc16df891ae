"""The wire contract: the tensor codec and the committed generated modules."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT

from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb


def test_f32_and_i32_round_trip_exactly():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7), dtype=np.float32)  # [5, 7]
    t = codec.encode(x, codec.F32)
    assert list(t.shape) == [5, 7] and len(t.data) == 5 * 7 * 4
    assert np.array_equal(codec.decode(t, "x", (codec.F32,), (5, 7)), x)
    ids = np.array([[3, -1], [0, 7]], dtype=np.int64)  # [2, 2]
    back = codec.decode(codec.encode(ids, codec.I32), "ids", (codec.I32,), (2, None))
    assert back.dtype == np.int32 and np.array_equal(back, ids)


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, -2.5, 3.14159, 1e-30, 65504.0, np.inf, -0.0], dtype=np.float32)
    t = codec.encode(x, codec.BF16)
    assert len(t.data) == x.size * 2
    back = codec.decode(t, "x", (codec.BF16,))
    # Reference: round the float64 value to 8 significant bits.
    m, e = np.frexp(x[:5].astype(np.float64))
    ref = np.ldexp(np.round(m * 256) / 256, e)
    assert np.array_equal(back[:5], ref.astype(np.float32))
    assert np.isinf(back[5]) and np.signbit(back[6])
    # Ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
    tie = np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)
    assert codec.decode(codec.encode(tie, codec.BF16), "t", (codec.BF16,)).tolist() == [
        1.0,
        1 + 2**-6,
    ]
    assert np.isnan(codec.decode(codec.encode(np.float32([np.nan]), codec.BF16), "n", (2,)))[0]


@pytest.mark.parametrize(
    "tensor, message",
    [
        (pb.Tensor(data=b"\0" * 8, shape=[2], dtype=pb.I32), "dtype i32, expected f32"),
        (pb.Tensor(data=b"\0" * 8, shape=[2, 1], dtype=pb.F32), "shape [2, 1], expected [2]"),
        (pb.Tensor(data=b"\0" * 7, shape=[2], dtype=pb.F32), "7 bytes"),
        (pb.Tensor(data=b"", shape=[-1], dtype=pb.F32), "invalid shape"),
        (pb.Tensor(), "dtype dtype 0"),
    ],
)
def test_decode_rejects_malformed(tensor, message):
    with pytest.raises(codec.CodecError, match=re.escape(message)):
        codec.decode(tensor, "x", (codec.F32,), (2,))


@pytest.mark.parametrize(
    "shape, message",
    [
        ([4, 2**62], "invalid shape"),  # int64 product 2**64 wraps to 0 = len(b"")
        ([2**62, 64], "invalid shape"),  # so does this one
        ([2**32, 2**32], "invalid shape"),
        ([2**31 - 1] * 3, "0 bytes for shape"),  # each dimension sane, their product is not
        ([1, 2, 3, 4, 5], "invalid shape"),
    ],
)
def test_decode_refuses_shapes_whose_size_overflows_before_reshaping(shape, message):
    """A peer's shape is multiplied exactly (Python ints) and each dimension is bounded, so a
    shape whose int64 element count wraps to the (empty) data's size is a CodecError, never a
    numpy error from the reshape."""
    tensor = pb.Tensor(data=b"", shape=shape, dtype=pb.F32)
    with pytest.raises(codec.CodecError, match=re.escape(message)):
        codec.decode(tensor, "hidden", (codec.F32,))
    empty = codec.decode(
        pb.Tensor(data=b"", shape=[0, codec.MAX_DIM], dtype=pb.F32), "x", (codec.F32,)
    )
    assert empty.shape == (0, codec.MAX_DIM)


def test_generated_code_is_current(tmp_path):
    """The Makefile's `proto` recipe, run with this interpreter's grpc_tools into a scratch
    directory, reproduces the committed modules byte for byte."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        pytest.skip("grpc_tools is not importable here (pip install grpcio-tools, or .[dev])")
    protoc = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto"]
    protoc += [f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    run = subprocess.run(
        [*protoc, "proto/moeshard.proto", "proto/health.proto"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"protoc failed: {run.stderr}"
    # The recipe's sed: the generated gRPC modules import their messages from the package.
    for stem in ("moeshard", "health"):
        grpc_module = tmp_path / f"{stem}_pb2_grpc.py"
        text = grpc_module.read_text()
        fixed = re.sub(
            r"^import (moeshard|health)_pb2 as",
            r"from moeshard.moe.wire import \1_pb2 as",
            text,
            flags=re.MULTILINE,
        )
        assert fixed != text, f"{grpc_module.name} does not import its messages as expected"
        grpc_module.write_text(fixed)
    names = ["moeshard_pb2.py", "moeshard_pb2_grpc.py", "health_pb2.py", "health_pb2_grpc.py"]
    committed = ROOT / "moeshard" / "moe" / "wire"
    stale = [
        n
        for n in names
        if _unstamped((tmp_path / n).read_text()) != _unstamped((committed / n).read_text())
    ]
    assert not stale, f"stale generated code: {stale}; run make proto"
    # what the committed gRPC modules demand of the runtime is what pyproject.toml asks for
    floor = re.search(r'"grpcio>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    for n in ("moeshard_pb2_grpc.py", "health_pb2_grpc.py"):
        stamp = re.search(
            r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", (committed / n).read_text(), re.M
        )
        assert stamp and stamp.group(1) == floor, (n, stamp, floor)


def _unstamped(text: str) -> str:
    """Generated code without the generator's version stamps: a newer grpcio-tools writes its
    own version into GRPC_GENERATED_VERSION (and a newer bundled protoc its own into the
    message modules) with nothing else changed (CI's fresh install got 1.85.4; 1.85.1 made
    the committed modules)."""
    text = re.sub(
        r"^GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = ''", text, flags=re.M
    )
    text = re.sub(
        r"^# Protobuf Python Version: .*$", "# Protobuf Python Version:", text, flags=re.M
    )
    return re.sub(
        r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,",
        r"\1",
        text,
    )
