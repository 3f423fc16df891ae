"""One module per model family: config dataclass (HF field names), forward pass, tensor names."""

from __future__ import annotations

from types import ModuleType

from moe.errors import ConfigError
from moe.families import deepseek_v3, qwen_moe

FAMILIES: dict[str, ModuleType] = {
    **{t: deepseek_v3 for t in deepseek_v3.MODEL_TYPES},
    **{t: qwen_moe for t in qwen_moe.MODEL_TYPES},
}


def family_for(model_type: str, source: str) -> ModuleType:
    """The family module for a config's model_type, or a ConfigError naming the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise ConfigError(
            f"{source}: unsupported model_type '{model_type}' (supported: {supported})"
        ) from None
