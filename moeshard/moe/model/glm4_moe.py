"""GLM-4.5, GLM-4.6 and GLM-4.7 (model_type glm4_moe): grouped-query attention with DeepSeek-V3's
sigmoid-routed MoE.

Attention is the Qwen-MoE family's (`moeshard.moe.model.qwen_moe`, on the same fused kernels):
q/k/v projections with a bias (`attention_bias`), optional per-head q/k RMSNorm over head_dim
(`use_qk_norm`), then partial RoPE: only the first head_dim * partial_rotary_factor dims of each
head are rotated, pairs (i, i + rot/2) as transformers' rotate_half (GPT-NeoX layout), the rest
pass; scale head_dim^-1/2; o_proj without a bias. head_dim is given explicitly (GLM-4.5-Air's
4096 / 96 heads is not a whole number).

The MLP is DeepSeek-V3's (`moeshard.moe.model.deepseek_v3`): the first `first_k_dense_replace`
layers are dense; the others route with sigmoid scores, `e_score_correction_bias` for selection
only, n_group / topk_group expert groups, renormalised weights times routed_scaling_factor, and
add n_shared_experts shared experts (one SwiGLU of n_shared * moe_intermediate_size, no gate).

The released checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the
last one (GLM-4.5: model.layers.92.*); inference does not use them and convert lists them as
skipped. Every field the model reads is required: a missing one is a ConfigError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moeshard.moe.errors import ConfigError
from moeshard.moe.model import deepseek_v3, qwen_moe
from moeshard.moe.model.config import (
    check_float,
    check_int,
    parse_rope,
    require,
    token_ids,
)
from moeshard.moe.model.trunk import Trunk

MODEL_TYPES = ("glm4_moe",)


def rotary_factor(raw: dict[str, Any], source: str) -> float:
    """partial_rotary_factor: top level in the released config.json, inside rope_parameters in
    what transformers 5 writes; a share of the head in (0, 1]."""
    params = raw.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if value is None:
        raise ConfigError(f"{source}: missing required field 'partial_rotary_factor'")
    value = check_float(value, "partial_rotary_factor", source, 0.0, True)
    if value > 1.0:
        raise ConfigError(f"{source}: 'partial_rotary_factor' must be at most 1, not {value:g}")
    return value


def require_rope_theta(raw: dict[str, Any], source: str) -> None:
    """rope_theta at top level (released) or in rope_parameters (transformers 5): never the
    10000 `parse_rope` would take for a file that has neither."""
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        raise ConfigError(f"{source}: missing required field 'rope_theta'")


def require_flag(raw: dict[str, Any], key: str, source: str) -> bool:
    value = require(raw, key, source)
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: '{key}' must be true or false, not {value!r}")
    return value


def shared_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields both GLM families read alike, each required (GLM-4.5 and GLM-4.7-Flash publish
    every one), named as their Config dataclasses (and `deepseek_v3.Config`) name them: the
    decoder's sizes, and DeepSeek-V3's router, experts and shared experts."""
    n_experts = int(require(raw, "n_routed_experts", source))
    n_group = check_int(require(raw, "n_group", source), "n_group", source, 1, n_experts)
    if n_experts % n_group:
        raise ConfigError(f"{source}: n_routed_experts {n_experts} not divisible by n_group")
    return dict(
        vocab_size=int(require(raw, "vocab_size", source)),
        hidden_size=int(require(raw, "hidden_size", source)),
        num_attention_heads=int(require(raw, "num_attention_heads", source)),
        rms_norm_eps=float(require(raw, "rms_norm_eps", source)),
        tie_word_embeddings=require_flag(raw, "tie_word_embeddings", source),
        max_position_embeddings=int(require(raw, "max_position_embeddings", source)),
        eos_token_id=tuple(token_ids(raw.get("eos_token_id"), "eos_token_id", source)),
        n_experts=n_experts,
        top_k=int(require(raw, "num_experts_per_tok", source)),
        expert_intermediate=int(require(raw, "moe_intermediate_size", source)),
        dense_intermediate=int(require(raw, "intermediate_size", source)),
        n_shared_experts=int(require(raw, "n_shared_experts", source)),
        n_group=n_group,
        topk_group=check_int(require(raw, "topk_group", source), "topk_group", source, 1, n_group),
        norm_topk_prob=require_flag(raw, "norm_topk_prob", source),
        routed_scaling_factor=float(require(raw, "routed_scaling_factor", source)),
    )


@dataclass(frozen=True, kw_only=True)
class Config(qwen_moe.Config):
    """The Qwen-MoE family's fields (its attention, with qkv_bias from attention_bias, qk_norm
    "head" or "none" from use_qk_norm, head_dim explicit, the rope over head_dim *
    partial_rotary_factor dims), and DeepSeek-V3's router and shared experts."""

    partial_rotary_factor: float
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int  # the leading dense layers (moe_layers: the others)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not GLM-4.5 style")
        layers = int(require(raw, "num_hidden_layers", source))
        head_dim = check_int(require(raw, "head_dim", source), "head_dim", source, 2, 1 << 20)
        factor = rotary_factor(raw, source)
        require_rope_theta(raw, source)
        dense = int(require(raw, "first_k_dense_replace", source))
        check_int(dense, "first_k_dense_replace", source, 0, layers)
        return cls(
            model_type=model_type,
            num_hidden_layers=layers,
            num_key_value_heads=check_int(
                require(raw, "num_key_value_heads", source), "num_key_value_heads", source, 1, 4096
            ),
            head_dim=head_dim,
            rope=parse_rope(raw, int(head_dim * factor), source),
            partial_rotary_factor=factor,
            qkv_bias=require_flag(raw, "attention_bias", source),
            qk_norm="head" if require_flag(raw, "use_qk_norm", source) else "none",
            first_k_dense_replace=dense,
            moe_layers=tuple(range(dense, layers)),
            **shared_fields(raw, source),
        )

    def _layer_shapes(self, i: int, p: str) -> dict[str, tuple[int, ...]]:
        """Layer i's tensors (`trunk_shapes`): the Qwen-MoE attention, DeepSeek-V3's MLP."""
        return qwen_moe.gqa_shapes(self, p + "self_attn.") | deepseek_v3.mlp_shapes(
            self, p + "mlp.", i in self.moe_layers
        )


def canonical_name(name: str) -> str:
    return name


KVCache = qwen_moe.KVCache


class _Layer(qwen_moe._Layer):
    """Layer i's weights as the Qwen-MoE family looks them up, with DeepSeek-V3's MoE parts."""

    __slots__ = ()

    def moe_parts(self, c: Config, w: Trunk, m: str) -> None:
        """The shared experts (no gate). The fused decode plan stays off: its router is softmax
        top-k (`fused_layer.attention_route`), not this grouped sigmoid one."""
        if c.n_shared_experts:
            s = m + "shared_experts."
            self.shared = tuple(w.linear(s + n) for n in ("gate_proj", "up_proj", "down_proj"))


class Transformer(qwen_moe.Transformer):
    """The Qwen-MoE trunk (fused GQA attention, per-sequence KV caches, batching) with
    DeepSeek-V3's router and shared experts; routed experts go to `experts`."""

    LAYER = _Layer

    def route(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Grouped sigmoid router of layer i: h [T, H] -> expert ids [T, k], weights [T, k]."""
        gate = f"model.layers.{i}.mlp.gate"
        return deepseek_v3.grouped_sigmoid_route(self.config, self.trunk, gate, h)
