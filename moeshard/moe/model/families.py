"""One module per model family: config dataclass (HF field names), forward pass, tensor names."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from moeshard.moe.errors import ConfigError
from moeshard.moe.model import (
    deepseek_v3,
    glm4_moe,
    glm4_moe_lite,
    gpt_oss,
    kimi_k3,
    kimi_k25,
    kimi_linear,
    qwen3_next,
    qwen_moe,
)
from moeshard.moe.model.config import read_json

FAMILIES: dict[str, ModuleType] = {
    **{t: deepseek_v3 for t in deepseek_v3.MODEL_TYPES},
    **{t: qwen_moe for t in qwen_moe.MODEL_TYPES},
    **{t: kimi_linear for t in kimi_linear.MODEL_TYPES},
    **{t: kimi_k3 for t in kimi_k3.MODEL_TYPES},
    **{t: glm4_moe for t in glm4_moe.MODEL_TYPES},
    **{t: glm4_moe_lite for t in glm4_moe_lite.MODEL_TYPES},
    **{t: gpt_oss for t in gpt_oss.MODEL_TYPES},
    **{t: qwen3_next for t in qwen3_next.MODEL_TYPES},
    **{t: kimi_k25 for t in kimi_k25.MODEL_TYPES},
}


def family_for(model_type: str, source: str) -> ModuleType:
    """The family module for a config's model_type, or a ConfigError naming the supported ones."""
    supported = ", ".join(sorted(FAMILIES))
    if not isinstance(model_type, str):  # a list or an object from config.json: unhashable
        shown = json.dumps(model_type, default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ConfigError(
            f"{source}: model_type must be a string naming the model family, got "
            f"{type(model_type).__name__} {shown} (supported: {supported})"
        )
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ConfigError(
            f"{source}: unsupported model_type {model_type!r} (supported: {supported})"
        ) from None


def load_config(model_dir: str | Path):
    """The family config for a checkpoint or model directory (dispatches on model_type)."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{path}: missing required field 'model_type'")
    return family_for(model_type, str(path)).Config.from_hf(raw, str(path))
