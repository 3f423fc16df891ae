"""INT4 expert weights as compressed-tensors publishes them (`pack-quantized`, Kimi K2 Thinking,
K2.5 and K2.6's routed experts), kept as q4_0 without decoding.

A Linear `X` [out, in] quantised symmetrically to 4 bits in groups of 32 inputs is stored as

* ``X.weight_packed`` int32 [out, in / 8]: eight codes per word, code i of a row at bits
  4i.. of the row's little-endian bit stream (so byte b holds code 2b in its low nibble and
  code 2b + 1 in its high one); a code is the signed value q in [-8, 7] plus 8
  (`compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32`);
* ``X.weight_scale`` [out, in / 32] in the checkpoint's float type (bf16 as published): the
  group's scale s, with no zero point (symmetric);
* ``X.weight_shape`` [2]: out and in.

The weight is s * q = s * (code - 8): exactly ggml's q4_0, whose 32-weight block is a float16
scale d and 16 bytes ``qs[j] = code[j] | code[j + 16] << 4`` with the value d * (code - 8).
So where every scale is a float16 value (`PackedInt4.inexact` is empty), `ggml_blocks`
reorders the codes and narrows the scales, and decoding either gives the same float32 bits.
A bf16 scale float16 cannot hold (above 65504, or below 2^-17, where float16's subnormal
step 2^-24 is coarser than bf16's 8 significant bits, unless its low bits are zero) would
change in q4_0 (tools/int4_scale_census.py: none of 2^20 groups of normal weights down to a
standard deviation of 2e-4, 30 times below Kimi K2's initializer_range): converting such a
matrix to q4_0 is refused (`InexactScales`), and the other formats decode it exactly
(`float32`) and pack it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeshard.moe.errors import CheckpointError

FORMAT = "pack-quantized"  # compressed-tensors' name for this scheme
QK = 32  # inputs per scale
PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
SCALE_DTYPES = ("BF16", "F16", "F32")
# the quantization args (config_groups.*.weights) this reading of the codes relies on
WEIGHT_ARGS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": QK}  # fmt: skip


class InexactScales(CheckpointError):
    """A matrix whose scales float16 cannot all hold: q4_0 would change its weights."""


@dataclass
class PackedInt4:
    """One INT4 matrix [rows, cols] as published: packed int32 [rows, cols / 8] and its scales
    widened to float32 [rows, cols / 32] (exactly: bf16, f16 and f32 all fit)."""

    packed: np.ndarray
    scale: np.ndarray
    fmt = "q4_0"  # the format its bits are kept in (`converter._kept_as`)
    type_name = "INT4"  # as the file has it, for the summary of what was decoded and re-packed

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def codes(self) -> np.ndarray:
        """The 4-bit codes (q + 8), uint8 [rows, cols], in column order."""
        rows, cols = self.shape
        data = np.ascontiguousarray(self.packed, dtype="<i4").view(np.uint8)  # [rows, cols / 2]
        codes = np.empty((rows, cols), dtype=np.uint8)  # [rows, cols]
        codes[:, 0::2] = data & 15
        codes[:, 1::2] = data >> 4
        return codes

    def inexact(self) -> np.ndarray:
        """The groups whose scale float16 cannot hold, bool [rows, cols / 32] (a nan is kept
        as a nan: `converter` refuses non-finite scales on their own)."""
        with np.errstate(over="ignore"):  # (above 65504: inf, so not equal)
            narrowed = self.scale.astype(np.float16).astype(np.float32)  # [rows, nb]
        return ~((narrowed == self.scale) | np.isnan(self.scale))

    def ggml_blocks(self) -> np.ndarray:
        """q4_0 ggml bytes [rows, cols / 32 * 18]: the same codes and scales, ggml's order."""
        bad = self.inexact()
        if bad.any():
            worst = self.scale[bad][np.argmin(np.abs(self.scale[bad]))]
            raise InexactScales(
                f"{int(bad.sum())} of {bad.size} INT4 groups have a scale float16 cannot hold "
                f"(e.g. {float(worst):.6g}), so q4_0 would change their weights; convert with "
                "--experts f32 (exact) or q8_0/bf16 (re-quantised, its error reported)"
            )
        rows, cols = self.shape
        codes = self.codes().reshape(rows, cols // QK, QK)  # [rows, nb, 32]
        qs = codes[:, :, :16] | (codes[:, :, 16:] << 4)  # [rows, nb, 16]
        d = self.scale.astype("<f2").view(np.uint8).reshape(rows, cols // QK, 2)  # [rows, nb, 2]
        return np.concatenate([d, qs], axis=2).reshape(rows, -1)

    def float32(self) -> np.ndarray:
        """The values s * (code - 8), float32 [rows, cols] (exact: an 8- or 11-bit scale
        significand times a 4-bit integer fits float32's 24 bits)."""
        q = self.codes().astype(np.float32) - np.float32(8)  # [rows, cols]
        return q * np.repeat(self.scale, QK, axis=1)  # [rows, cols]


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Codes uint8 [rows, cols] -> weight_packed int32 [rows, cols / 8] (inverse of
    `PackedInt4.codes`), for writing checkpoints (tests)."""
    c = np.asarray(codes, dtype=np.uint8)
    data = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)  # [rows, cols / 2]
    return np.ascontiguousarray(data).view("<i4")


def check_scheme(quantization: dict, where: str) -> None:
    """Every config group must be the scheme `PackedInt4` reads: 4-bit signed integers,
    symmetric, one scale per 32 inputs, no activation reordering."""
    groups = [g for g in (quantization.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        raise CheckpointError(f"{where}: quantization_config has no config_groups")
    for group in groups:
        weights = group.get("weights") or {}
        for key, want in WEIGHT_ARGS.items():
            if weights.get(key) != want:
                raise CheckpointError(
                    f"{where}: quantization_config weights {key!r} {weights.get(key)!r}; "
                    f"moeshard reads {FORMAT!r} INT4 experts with {key} {want!r}"
                )
        if weights.get("actorder") not in (None, False):
            raise CheckpointError(
                f"{where}: quantization_config weights actorder {weights['actorder']!r} "
                "(reordered groups) is not supported"
            )


def check_shapes(name: str, shapes: dict[str, tuple], dtypes: dict[str, str], shape) -> None:
    """The packed, scale and shape tensors of an [out, in] INT4 matrix `name` (its
    weight_packed name); `shapes` and `dtypes` by suffix."""
    rows, cols = shape
    base = name[: -len(PACKED)]
    if cols % QK:
        raise CheckpointError(f"{name}: {cols} inputs is not a multiple of {QK}")
    if dtypes[PACKED] != "I32" or dtypes[SCALE] not in SCALE_DTYPES:
        raise CheckpointError(
            f"{name}: dtypes {dtypes[PACKED]} and {dtypes[SCALE]} (scale); expected I32 codes "
            f"and {'/'.join(SCALE_DTYPES)} scales"
        )
    for suffix, want in ((PACKED, (rows, cols // 8)), (SCALE, (rows, cols // QK)), (SHAPE, (2,))):
        if tuple(shapes[suffix]) != want:
            raise CheckpointError(
                f"{base}{suffix}: shape {list(shapes[suffix])}, expected {list(want)} for "
                f"[{rows}, {cols}]"
            )
