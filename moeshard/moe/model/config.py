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

from moeshard.moe.errors import ConfigError
from moeshard.moe.kernels import quant

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


class SwigluExperts:
    """What every family but Kimi K3 says about its routed experts: they take and return
    hidden-size rows (`expert_hidden`; K3's are latent) through SwiGLU (`expert_glu`)."""

    @property
    def expert_glu(self) -> quant.Glu:
        return quant.SWIGLU

    @property
    def expert_hidden(self) -> int:
        return self.hidden_size

    @property
    def expert_biases(self) -> bool:
        """Whether the routed experts have biases (gpt-oss's do: `quant.BIAS`)."""
        return False


def decoder_shapes(c, layer_shapes) -> dict[str, tuple[int, ...]]:
    """A decoder's trunk tensors by canonical name: the embedding, the final norm, the head
    (unless tied), and per layer its two norms plus `layer_shapes(i, "model.layers.{i}.")`
    (attention and MLP, per family)."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes |= layer_shapes(i, p)
    return shapes


def require(raw: dict[str, Any], key: str, source: str) -> Any:
    """raw[key], or a ConfigError naming the file and the missing field.

    Every family's `Config.from_hf` reads config.json through this first (its model_type), so
    this is also where the whole config is checked (`check_fields`, idempotent and cheap):
    a family may then int()/float()/iterate any field it reads without a traceback."""
    check_fields(raw, source)
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{source}: missing required field '{key}'")
    return raw[key]


# -- what the fields of config.json may hold ----------------------------------------------------
# A wrong type, a value out of range or a non-finite number is a ConfigError naming the file and
# the field (exit 2), never a TypeError/ValueError from the family's int()/float() nor a model
# that loads and then fails (or allocates without bound) when it runs. The bounds are far beyond
# any published model; they keep a typo (10**12 layers) from becoming a hang.

MAX_WIDTH = 1 << 20  # hidden, intermediate, head and LoRA-rank sizes
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 30

# integer fields: name -> (least, most, may be null). A field the families read as
# `raw.get(name) or default` may be 0 or null (= the default); one they read as
# `raw.get(name, default)` may not be null. Required fields may be null here: `require` says
# they are missing.
INT_FIELDS: dict[str, tuple[int, int, bool]] = {
    "vocab_size": (1, MAX_VOCAB, True),
    "hidden_size": (1, MAX_WIDTH, True),
    "intermediate_size": (0, MAX_WIDTH, True),
    "moe_intermediate_size": (1, MAX_WIDTH, True),
    "shared_expert_intermediate_size": (0, MAX_WIDTH, True),
    "head_dim": (0, MAX_WIDTH, True),  # 0/null: hidden_size // num_attention_heads
    "num_hidden_layers": (1, MAX_LAYERS, True),
    "num_attention_heads": (1, MAX_HEADS, True),
    "num_key_value_heads": (0, MAX_HEADS, True),  # 0/null: num_attention_heads
    "num_experts": (1, MAX_EXPERTS, True),
    "num_local_experts": (1, MAX_EXPERTS, True),
    "n_routed_experts": (1, MAX_EXPERTS, True),
    "num_experts_per_tok": (1, MAX_EXPERTS, True),
    "n_shared_experts": (0, MAX_EXPERTS, True),
    "num_experts_per_token": (1, MAX_EXPERTS, True),  # Kimi Linear's names
    "num_shared_experts": (0, MAX_EXPERTS, True),
    "num_expert_group": (1, MAX_EXPERTS, True),
    "n_group": (0, MAX_EXPERTS, True),  # 0/null: 1
    "topk_group": (0, MAX_EXPERTS, True),  # 0/null: 1
    "decoder_sparse_step": (0, MAX_LAYERS, True),  # 0/null: 1
    "first_k_dense_replace": (0, MAX_LAYERS, True),
    "moe_layer_freq": (1, MAX_LAYERS, False),
    "kv_lora_rank": (1, MAX_WIDTH, True),
    "q_lora_rank": (0, MAX_WIDTH, True),  # 0/null: no q LoRA
    "qk_nope_head_dim": (1, MAX_WIDTH, True),
    "qk_rope_head_dim": (2, MAX_WIDTH, True),
    "v_head_dim": (1, MAX_WIDTH, True),
    "max_position_embeddings": (1, MAX_POSITIONS, False),
    "original_max_position_embeddings": (1, MAX_POSITIONS, True),
    "sliding_window": (0, MAX_POSITIONS, True),  # 0/null: no window
}
# float fields: name -> (bound, strictly above it, may be null); all must be finite
FLOAT_FIELDS: dict[str, tuple[float, bool, bool]] = {
    "rms_norm_eps": (0.0, False, False),
    "rope_theta": (1.0, True, False),  # a base wavelength
    "routed_scaling_factor": (0.0, True, False),
    "clip_qkv": (0.0, True, True),  # null: no clipping
    "partial_rotary_factor": (0.0, True, False),  # the share of a head rotated (GLM: 0.5)
    "swiglu_alpha": (0.0, True, False),  # gpt-oss's clamped SwiGLU
    "swiglu_limit": (0.0, True, False),
}
BOOL_FIELDS = (
    "tie_word_embeddings",
    "norm_topk_prob",
    "use_sliding_window",
    "qkv_bias",
    "attention_bias",
    "rope_interleave",
    "moe_renormalize",
    "use_qk_norm",
)
STR_FIELDS = ("model_type", "scoring_func")
DICT_FIELDS = (
    "rope_scaling",
    "rope_parameters",
    "quantization_config",
    "linear_attn_config",
    "text_config",
    "vision_config",
)


def _shown(value: Any) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        return False
    return True


def check_int(value: Any, key: str, source: str, least: int, most: int) -> int:
    """An integer field's value (an integral float is taken as the integer), or a ConfigError."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(
            f"{source}: '{key}' must be an integer from {least} to {most}, not {_shown(value)}"
        )
    return value


def check_float(value: Any, key: str, source: str, bound: float, strictly: bool) -> float:
    """A finite number above `bound` (or at it, unless `strictly`), or a ConfigError."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and (value > bound if strictly else value >= bound)
    if not ok:
        above = "" if bound == -math.inf else f" {'>' if strictly else '>='} {bound:g}"
        raise ConfigError(f"{source}: '{key}' must be a finite number{above}, not {_shown(value)}")
    return value


def check_fields(raw: dict[str, Any], source: str) -> None:
    """ConfigError naming the file and the first field whose value no family can use: wrong
    type, out of range, not finite, or inconsistent with another field (top-k above the number
    of experts, heads not a multiple of the key/value heads). Fields it does not know are left
    alone (configs carry many the runtime never reads)."""
    for key, (least, most, nullable) in INT_FIELDS.items():
        if key in raw and not (raw[key] is None and nullable):
            check_int(raw[key], key, source, least, most)
    for key, (bound, strictly, nullable) in FLOAT_FIELDS.items():
        if key in raw and not (raw[key] is None and nullable):
            check_float(raw[key], key, source, bound, strictly)
    for key in BOOL_FIELDS:
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise ConfigError(f"{source}: '{key}' must be true or false, not {_shown(raw[key])}")
    for key in STR_FIELDS:
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ConfigError(f"{source}: '{key}' must be a string, not {_shown(raw[key])}")
    for key in DICT_FIELDS:
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"{source}: '{key}' must be an object, not {_shown(raw[key])}")
    token_ids(raw.get("eos_token_id"), "eos_token_id", source)
    layers = raw.get("num_hidden_layers") or MAX_LAYERS
    dense = raw.get("mlp_only_layers")
    if dense is not None:
        if not isinstance(dense, list):
            raise ConfigError(f"{source}: 'mlp_only_layers' must be a list, not {_shown(dense)}")
        for i in dense:
            check_int(i, "mlp_only_layers", source, 0, int(layers) - 1)
    block = (raw.get("quantization_config") or {}).get("weight_block_size")
    if block is not None:
        if not isinstance(block, list) or len(block) != 2:
            raise ConfigError(
                f"{source}: 'quantization_config.weight_block_size' must be [rows, columns], "
                f"not {_shown(block)}"
            )
        for n in block:
            check_int(n, "quantization_config.weight_block_size", source, 1, MAX_WIDTH)
    _check_consistent(raw, source)


def _check_consistent(raw: dict[str, Any], source: str) -> None:
    experts = raw.get("n_routed_experts") or raw.get("num_experts") or raw.get("num_local_experts")
    top_k = raw.get("num_experts_per_tok")
    if experts and top_k and top_k > experts:
        raise ConfigError(
            f"{source}: 'num_experts_per_tok' {_shown(top_k)} is more than the {_shown(experts)} "
            "experts"
        )
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if "kv_lora_rank" not in raw and heads and kv_heads and heads % kv_heads:
        raise ConfigError(
            f"{source}: 'num_attention_heads' {_shown(heads)} is not a multiple of "
            f"'num_key_value_heads' {_shown(kv_heads)}"
        )
    for key in ("head_dim", "qk_rope_head_dim"):  # rotated in pairs of dimensions
        if raw.get(key) and raw[key] % 2:
            raise ConfigError(f"{source}: '{key}' must be even, not {_shown(raw[key])}")
    groups, top_groups = raw.get("n_group") or 1, raw.get("topk_group") or 1
    if top_groups > groups:
        raise ConfigError(
            f"{source}: 'topk_group' {_shown(top_groups)} is more than 'n_group' {_shown(groups)}"
        )


def token_ids(value: Any, key: str, source: str) -> list[int]:
    """A token id field (eos_token_id: an id or a list of them; null: none) as a list, or a
    ConfigError naming the file and the field."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [check_int(v, key, source, 0, MAX_VOCAB - 1) for v in values]


def parse_rope(raw: dict[str, Any], dim: int, source: str) -> RopeConfig:
    """Normalise both config.json dialects (rope_theta+rope_scaling, or rope_parameters)."""
    check_fields(raw, source)
    if dim < 2 or dim % 2:
        raise ConfigError(
            f"{source}: the rotary dimension {dim} (head_dim, or hidden_size / "
            "num_attention_heads) must be even and at least 2"
        )
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "rope_theta" not in raw:
            raise ConfigError(f"{source}: rope_parameters has no 'rope_theta'")
        theta = params.get("rope_theta", raw.get("rope_theta"))
        scaling = params
        where = "rope_parameters."
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
        where = "rope_scaling."
    theta = check_float(theta, "rope_theta", source, 1.0, True)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: unsupported rope type {_shown(rope_type)} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig("default", theta, dim)

    def number(key: str, default: float | None, bound: float, strictly: bool) -> float | None:
        value = scaling.get(key)
        if value is None:
            return default
        return check_float(value, where + key, source, bound, strictly)

    factor = number("factor", None, 0.0, True)
    original = scaling.get(
        "original_max_position_embeddings",
        raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
    )
    if original is not None:
        original = check_int(
            original, where + "original_max_position_embeddings", source, 1, MAX_POSITIONS
        )
    if factor is None and rope_type == "yarn" and original and raw.get("max_position_embeddings"):
        factor = raw["max_position_embeddings"] / original
    if factor is None:
        raise ConfigError(f"{source}: rope scaling '{rope_type}' has no 'factor'")
    if rope_type == "yarn" and not original:
        raise ConfigError(f"{source}: yarn rope scaling needs 'original_max_position_embeddings'")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{source}: '{where}truncate' must be true or false, not {truncate!r}")
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        dim=dim,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=number("beta_fast", None, 0.0, True) or 32.0,
        beta_slow=number("beta_slow", None, 0.0, True) or 1.0,
        mscale=number("mscale", None, -math.inf, False),
        mscale_all_dim=number("mscale_all_dim", None, -math.inf, False),
        attention_factor=number("attention_factor", None, 0.0, True),
        truncate=truncate,
    )


def eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> list[int]:
    """End-of-sequence ids: generation_config.json wins over config.json; int or list."""
    for source, name in ((generation or {}, "generation_config.json"), (raw, "config.json")):
        value = source.get("eos_token_id")
        if value is not None:
            return token_ids(value, "eos_token_id", name)
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
