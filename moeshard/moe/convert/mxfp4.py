"""MXFP4 expert weights as compressed-tensors publishes them (`mxfp4-pack-quantized`).

A Linear `X` quantised this way is stored as two uint8 tensors (Kimi K3's routed experts):

* ``X.weight_packed`` [out, in / 2]: the 4-bit E2M1 codes, two per byte, the even column in
  the low nibble (code = sign bit 3, magnitude index 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6);
* ``X.weight_scale`` [out, in / 32]: one E8M0 byte s per 32 inputs, the scale 2^(s - 127).

That is the OCP MX format ggml calls MXFP4, with another byte order: ggml's block is
``[s, qs[16]]`` with ``qs[j] = code[j] | code[j + 16] << 4``.  `PackedMxfp4.ggml_blocks`
reorders the bytes and changes no code or scale, so a conversion to moeshard's ``mxfp4``
format keeps the published bits (`moeshard.moe.kernels.quant` then interleaves rows for the
kernels); `PackedMxfp4.float32` decodes them for the other formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeshard.moe.errors import CheckpointError

FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' name for this scheme
QK = 32  # inputs per scale
PACKED, SCALE = ".weight_packed", ".weight_scale"
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


@dataclass
class PackedMxfp4:
    """One MXFP4 matrix [rows, cols] as published: packed uint8 [rows, cols / 2], scale uint8
    [rows, cols / 32]."""

    packed: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def codes(self) -> np.ndarray:
        """The 4-bit codes, uint8 [rows, cols], in column order."""
        rows, cols = self.shape
        codes = np.empty((rows, cols), dtype=np.uint8)  # [rows, cols]
        codes[:, 0::2] = self.packed & 15
        codes[:, 1::2] = self.packed >> 4
        return codes

    def ggml_blocks(self) -> np.ndarray:
        """ggml MXFP4 bytes [rows, cols / 32 * 17]: the same codes and scales, ggml's order."""
        rows, cols = self.shape
        codes = self.codes().reshape(rows, cols // QK, QK)  # [rows, nb, 32]
        qs = codes[:, :, :16] | (codes[:, :, 16:] << 4)  # [rows, nb, 16]
        return np.concatenate([self.scale[:, :, None], qs], axis=2).reshape(rows, -1)

    def float32(self) -> np.ndarray:
        """The values, float32 [rows, cols]: sign * E2M1 magnitude * 2^(s - 127)."""
        rows, cols = self.shape
        codes = self.codes()
        magnitude = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)  # [rows, cols]
        exponent = np.repeat(self.scale.astype(np.int64) - 127, QK, axis=1)  # [rows, cols]
        return np.ldexp(magnitude, exponent).astype(np.float32)


def from_ggml_blocks(blocks: np.ndarray, rows: int, cols: int) -> PackedMxfp4:
    """ggml MXFP4 bytes [rows, cols / 32 * 17] -> the published layout (inverse of
    `PackedMxfp4.ggml_blocks`), for writing checkpoints (`synth`, tests)."""
    b = np.asarray(blocks, dtype=np.uint8).reshape(rows, cols // QK, 17)  # [rows, nb, 17]
    codes = np.concatenate([b[:, :, 1:] & 15, b[:, :, 1:] >> 4], axis=2).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # [rows, cols / 2]
    return PackedMxfp4(np.ascontiguousarray(packed), np.ascontiguousarray(b[:, :, 0]))


def check_shapes(name: str, packed_shape, scale_shape, shape: tuple[int, int], dtypes) -> None:
    """The packed and scale tensors of an [out, in] MXFP4 matrix `name` (its weight_packed)."""
    rows, cols = shape
    if cols % QK:
        raise CheckpointError(f"{name}: {cols} inputs is not a multiple of {QK}")
    if tuple(dtypes) != ("U8", "U8"):
        raise CheckpointError(f"{name}: dtypes {list(dtypes)}, expected U8 packed and scale")
    if tuple(packed_shape) != (rows, cols // 2):
        raise CheckpointError(
            f"{name}: shape {list(packed_shape)}, expected {[rows, cols // 2]} for [{rows}, {cols}]"
        )
    if tuple(scale_shape) != (rows, cols // QK):
        raise CheckpointError(
            f"{name[: -len(PACKED)]}{SCALE}: shape {list(scale_shape)}, expected "
            f"{[rows, cols // QK]}"
        )
