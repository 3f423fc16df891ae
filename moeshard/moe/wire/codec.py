"""The one tensor <-> bytes codec of the wire contract (proto/moeshard.proto `Tensor`).

Every numpy array that crosses the wire goes through `encode` and comes back through `decode`;
nothing else touches `Tensor.data`. Activations travel as F32 or BF16 (bfloat16: the high 16
bits of a float32, rounded to nearest even), expert ids as I32, routing weights as F32.
`decode` checks dtype, shape and byte length against what the caller expects and raises
`CodecError` (a ValueError) with a message naming the tensor; the node turns it into
INVALID_ARGUMENT. Shapes come from the peer: their sizes are multiplied as Python ints (no
int64 wrap-around), each dimension is bounded, and the byte count is checked before any reshape.
"""

from __future__ import annotations

import math

import numpy as np

from moeshard.moe.wire import moeshard_pb2 as pb

F32, BF16, I32, F64 = pb.F32, pb.BF16, pb.I32, pb.F64
NAMES = {pb.F32: "f32", pb.BF16: "bf16", pb.I32: "i32", pb.F64: "f64"}
BY_NAME = {v: k for k, v in NAMES.items()}
ITEMSIZE = {pb.F32: 4, pb.BF16: 2, pb.I32: 4, pb.F64: 8}
MAX_DIMS = 4
MAX_DIM = (1 << 31) - 1  # largest size of one dimension (no tensor on the wire comes near it)


class CodecError(ValueError):
    """A tensor on the wire is malformed or not what the receiver expects."""


def dtype_name(dtype: int) -> str:
    return NAMES.get(dtype, f"dtype {dtype}")


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 [...] bfloat16 bits, round to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)  # [...]
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)  # [...]
    out = ((bits + rounding) >> 16).astype(np.uint16)  # [...]
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 [...] bfloat16 bits -> float32 [...] (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)  # [...]


def encode(array: np.ndarray, dtype: int = F32) -> pb.Tensor:
    """numpy array -> Tensor. Floats go out as F32 or BF16, integers as I32."""
    array = np.asarray(array)
    if dtype == pb.F32:
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
    elif dtype == pb.BF16:
        data = f32_to_bf16(array).astype("<u2", copy=False).tobytes()
    elif dtype == pb.I32:
        data = np.ascontiguousarray(array, dtype="<i4").tobytes()
    elif dtype == pb.F64:
        data = np.ascontiguousarray(array, dtype="<f8").tobytes()
    else:
        raise CodecError(f"cannot encode as {dtype_name(dtype)}")
    return pb.Tensor(data=data, shape=list(array.shape), dtype=dtype)


def decode(
    tensor: pb.Tensor,
    name: str,
    dtypes: tuple[int, ...],
    shape: tuple[int | None, ...] | None = None,
) -> np.ndarray:
    """Tensor -> numpy (float32 for F32/BF16, int32 for I32), checked.

    `dtypes` lists the accepted wire dtypes; `shape` the expected shape (None = any size on
    that axis). Raises CodecError naming `name` on any mismatch.
    """
    if tensor.dtype not in dtypes:
        wanted = " or ".join(dtype_name(d) for d in dtypes)
        raise CodecError(f"{name}: dtype {dtype_name(tensor.dtype)}, expected {wanted}")
    dims = tuple(int(d) for d in tensor.shape)
    if len(dims) > MAX_DIMS or any(not 0 <= d <= MAX_DIM for d in dims):
        raise CodecError(
            f"{name}: invalid shape {list(dims)} (at most {MAX_DIMS} dimensions of 0..{MAX_DIM})"
        )
    if shape is not None:
        if len(dims) != len(shape) or any(
            want is not None and got != want for got, want in zip(dims, shape, strict=True)
        ):
            want_text = ", ".join("*" if d is None else str(d) for d in shape)
            raise CodecError(f"{name}: shape {list(dims)}, expected [{want_text}]")
    expected = math.prod(dims) * ITEMSIZE[tensor.dtype]  # Python ints: exact, never wraps
    if len(tensor.data) != expected:
        raise CodecError(
            f"{name}: {len(tensor.data)} bytes for shape {list(dims)} "
            f"{dtype_name(tensor.dtype)}, expected {expected}"
        )
    if tensor.dtype == pb.F32:
        return np.frombuffer(tensor.data, dtype="<f4").astype(np.float32).reshape(dims)
    if tensor.dtype == pb.BF16:
        return bf16_to_f32(np.frombuffer(tensor.data, dtype="<u2")).reshape(dims)
    if tensor.dtype == pb.F64:
        return np.frombuffer(tensor.data, dtype="<f8").astype(np.float64).reshape(dims)
    return np.frombuffer(tensor.data, dtype="<i4").astype(np.int32).reshape(dims)
