"""Model configuration read from a Hugging Face config.json.

Two dialects of config.json exist in the wild:
  * the older one (every published DeepSeek-V3 / Kimi-K2 / Qwen / Mixtral checkpoint):
    ``rope_theta`` at top level plus an optional ``rope_scaling`` dict whose kind is named by
    ``"type"`` or ``"rope_type"``;
  * the one written by transformers 5: a ``rope_parameters`` dict holding ``rope_type``,
    ``rope_theta`` and the scaling fields.
Both are normalised here into one :class:`RopeConfig`. Each model family then builds its own
flat config dataclass (``moe/model/<family>.py``) with Hugging Face field names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, dialect-independent (names follow transformers' yarn code)."""

    rope_type: str  # "default" | "linear" | "yarn"
    theta: float  # base wavelength
    dim: int  # number of rotated dims per head
    factor: float = 1.0  # context extension factor (linear, yarn)
    original_max_position_embeddings: int | None = None  # pretraining context (yarn)
    beta_fast: float = 32.0  # yarn ramp bound (extrapolation)
    beta_slow: float = 1.0  # yarn ramp bound (interpolation)
    mscale: float | None = None  # yarn: numerator of the cos/sin attention factor
    mscale_all_dim: float | None = None  # yarn: denominator; DeepSeek also scales softmax by it
    attention_factor: float | None = None  # yarn: explicit cos/sin scale, overrides mscale
    truncate: bool = True  # yarn: floor/ceil the correction range

    def inv_freq_and_scale(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies [dim/2] and the factor cos/sin are multiplied by (yarn's mscale)."""
        exponents = np.arange(0, self.dim, 2, dtype=np.float32) / np.float32(self.dim)  # [dim/2]
        pos_freqs = np.power(np.float32(self.theta), exponents, dtype=np.float32)  # [dim/2]
        inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)  # [dim/2]
        if self.rope_type == "default":
            return inv_freq, 1.0
        if self.rope_type == "linear":
            return (inv_freq / np.float32(self.factor)).astype(np.float32), 1.0
        return self._yarn(pos_freqs)

    def _yarn(self, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
        factor = self.factor
        if self.attention_factor is not None:
            attention_factor = float(self.attention_factor)
        elif self.mscale and self.mscale_all_dim:
            attention_factor = yarn_mscale(factor, self.mscale) / yarn_mscale(
                factor, self.mscale_all_dim
            )
        else:
            attention_factor = yarn_mscale(factor)
        original = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (self.dim * math.log(original / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001  # as transformers: avoid a zero-width ramp
        ramp = (np.arange(self.dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(
            high - low
        )  # [dim/2]
        extrapolation_share = np.float32(1.0) - np.clip(ramp, 0, 1).astype(np.float32)  # [dim/2]
        inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)  # [dim/2]
        inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv_freq = inv_inter * (1 - extrapolation_share) + inv_extra * extrapolation_share
        return inv_freq.astype(np.float32), attention_factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def require(raw: dict[str, Any], key: str, source: str) -> Any:
    """raw[key], or a ConfigError naming the file and the missing field."""
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{source}: missing required field '{key}'")
    return raw[key]


def parse_rope(raw: dict[str, Any], dim: int, source: str) -> RopeConfig:
    """Normalise both config.json dialects (rope_theta+rope_scaling, or rope_parameters)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "rope_theta" not in raw:
            raise ConfigError(f"{source}: rope_parameters has no 'rope_theta'")
        theta = params.get("rope_theta", raw.get("rope_theta"))
        scaling = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: unsupported rope type '{rope_type}' "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig("default", float(theta), dim)
    factor = scaling.get("factor")
    original = scaling.get(
        "original_max_position_embeddings",
        raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
    )
    if factor is None and rope_type == "yarn" and original:
        factor = raw["max_position_embeddings"] / original
    if factor is None:
        raise ConfigError(f"{source}: rope scaling '{rope_type}' has no 'factor'")
    if rope_type == "yarn" and not original:
        raise ConfigError(f"{source}: yarn rope scaling needs 'original_max_position_embeddings'")
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        dim=dim,
        factor=float(factor),
        original_max_position_embeddings=int(original) if original else None,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"),
        attention_factor=scaling.get("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


def eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> list[int]:
    """End-of-sequence ids: generation_config.json wins over config.json; int or list."""
    for source in (generation or {}, raw):
        value = source.get("eos_token_id")
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    return data
