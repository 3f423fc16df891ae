"""GLM-4.7-Flash (model_type glm4_moe_lite): DeepSeek-V3's architecture under GLM's names.

transformers 5.25 builds it from DeepSeek-V3's parts (its attention is `DeepseekV3Attention`,
the router and MoE are GLM-4.5's, which are DeepSeek-V3's) so moeshard runs it with
`moeshard.moe.model.deepseek_v3` unchanged. What differs is the config:

* which layers are dense: `mlp_layer_types` ("dense" / "sparse" per layer) in what
  transformers 5 writes; the released config.json has `first_k_dense_replace` instead
  (transformers, given neither, makes layer 0 dense and the others sparse). A file with both
  must agree.
* `partial_rotary_factor` (released: 1.0): transformers' GLM rotary embedding turns
  qk_rope_head_dim * factor dims, but the MLA rope slice is qk_rope_head_dim wide, so only 1
  runs; anything else is refused.
* no `scoring_func`, `topk_method` or `rope_interleave` in the released file: the router is
  sigmoid, and the rotary pairs interleaved (transformers' default `rope_interleave: true`, as
  for Kimi-K2's config).

The released checkpoint has one multi-token-prediction layer after the last (model.layers.47.*);
convert lists it as skipped. Every other field the model reads is required.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeshard.moe.errors import ConfigError
from moeshard.moe.model import deepseek_v3
from moeshard.moe.model.config import check_float, check_int, parse_rope, require
from moeshard.moe.model.glm4_moe import require_flag, require_rope_theta, shared_fields

MODEL_TYPES = ("glm4_moe_lite",)
LAYER_TYPES = ("dense", "sparse")


def sparse_layers(raw: dict[str, Any], layers: int, source: str) -> tuple[int, ...]:
    """The MoE layers, from mlp_layer_types or first_k_dense_replace (see the docstring)."""
    dense = raw.get("first_k_dense_replace")
    if dense is not None:
        dense = check_int(dense, "first_k_dense_replace", source, 0, layers)
    types = raw.get("mlp_layer_types")
    if types is None:
        if dense is None:
            raise ConfigError(
                f"{source}: missing required field 'first_k_dense_replace' (or 'mlp_layer_types')"
            )
        return tuple(range(dense, layers))
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise ConfigError(
            f'{source}: \'mlp_layer_types\' must list "dense" or "sparse" for each of the '
            f"{layers} layers"
        )
    sparse = tuple(i for i, t in enumerate(types) if t == "sparse")
    if dense is not None and sparse != tuple(range(dense, layers)):
        raise ConfigError(
            f"{source}: 'mlp_layer_types' and 'first_k_dense_replace' {dense} disagree on "
            "which layers are dense"
        )
    return sparse


@dataclass(frozen=True, kw_only=True)
class Config(deepseek_v3.Config):
    """DeepSeek-V3's fields, with the MoE layers listed rather than counted."""

    sparse_layers: tuple[int, ...]  # the MoE layers (the others are dense)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.sparse_layers

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not GLM-4.7-Flash")
        layers = int(require(raw, "num_hidden_layers", source))
        sparse = sparse_layers(raw, layers, source)
        params = raw.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if check_float(factor, "partial_rotary_factor", source, 0.0, True) != 1.0:
            raise ConfigError(
                f"{source}: 'partial_rotary_factor' {factor!r} unsupported (GLM-4.7-Flash "
                "turns the whole qk_rope_head_dim: 1.0)"
            )
        require_rope_theta(raw, source)
        if "q_lora_rank" not in raw:
            raise ConfigError(f"{source}: missing required field 'q_lora_rank' (null: none)")
        q_lora = raw["q_lora_rank"]
        rope_dim = int(require(raw, "qk_rope_head_dim", source))
        interleave = raw.get("rope_interleave", True)  # absent from the released file
        return cls(
            model_type=model_type,
            num_hidden_layers=layers,
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(require(raw, "kv_lora_rank", source)),
            qk_nope_head_dim=int(require(raw, "qk_nope_head_dim", source)),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(require(raw, "v_head_dim", source)),
            rope_interleave=bool(interleave),
            rope=parse_rope(raw, rope_dim, source),
            attention_bias=require_flag(raw, "attention_bias", source),
            first_k_dense_replace=min(sparse, default=layers),
            sparse_layers=sparse,
            **shared_fields(raw, source),
        )


canonical_name = deepseek_v3.canonical_name
LatentCache = deepseek_v3.LatentCache
Transformer = deepseek_v3.Transformer
