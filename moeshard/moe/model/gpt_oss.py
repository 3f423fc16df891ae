"""gpt-oss (model_type gpt_oss): OpenAI's open-weight MoE models (gpt-oss-20b, -120b).

The trunk is the GQA one of `moeshard.moe.model.qwen_moe` with these switches on:

* attention sinks: one learned logit per head joins each softmax's denominator and is then
  dropped (`fused.attend_cache`'s `sinks`);
* `layer_types`: sliding-window attention (`sliding_window`, 128 as published) and full
  attention alternate;
* biases on q, k, v and o, and on the router; routing is softmax over the top-k router logits
  (the same as softmax over all of them renormalised over the top k: `norm_topk_prob`);
* YaRN with ``truncate: false``.

The routed experts carry biases and apply a clamped SwiGLU: `quant.clamped_swiglu` (alpha,
limit) and record formats ending in `quant.BIAS`, so they go through the one experts
interface (local, `--ram`, nodes, audits) like every other family's.  The checkpoint's
gate_up projection interleaves gate and up columns (gate 2j, up 2j + 1); the converter
splits them (`EXPERTS_LAYOUT`).  OpenAI publishes the experts as MXFP4 (`*_blocks`,
`*_scales`), which are kept bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeshard.moe.errors import ConfigError
from moeshard.moe.kernels import quant
from moeshard.moe.model import qwen_moe
from moeshard.moe.model.config import check_float, check_int, parse_rope, require

MODEL_TYPES = ("gpt_oss",)
# transformers' GptOssConfig default for swiglu_alpha; OpenAI's released config.json has no
# such field (its reference code, gpt_oss/torch/model.py `swiglu`, hard-codes alpha=1.702)
SWIGLU_ALPHA = 1.702
LAYER_KINDS = ("sliding_attention", "full_attention")
# How the checkpoint stacks its experts, for the converter: [experts, in, out] (transposed),
# gate and up interleaved by column in gate_up_proj, biases beside the weights
EXPERTS_LAYOUT = "gpt_oss"

# OpenAI's published models: (layers, routed experts); the rest of their config.json is one
PUBLISHED = {"gpt-oss-20b": (24, 32), "gpt-oss-120b": (36, 128)}

Transformer = qwen_moe.Transformer
KVCache = qwen_moe.KVCache


@dataclass(frozen=True, kw_only=True)
class Config(qwen_moe.Config):
    swiglu_alpha: float  # the clamped SwiGLU's sigmoid gain
    swiglu_limit: float  # its clamp

    @property
    def expert_glu(self) -> quant.Glu:
        return quant.clamped_swiglu(self.swiglu_alpha, self.swiglu_limit)

    @property
    def expert_biases(self) -> bool:
        """The routed experts have biases: their records carry them (`quant.BIAS`)."""
        return True

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not gpt-oss")
        layers = int(require(raw, "num_hidden_layers", source))
        heads = int(require(raw, "num_attention_heads", source))
        head_dim = int(require(raw, "head_dim", source))
        experts = raw.get("num_local_experts") or raw.get("num_experts")
        if experts is None:
            require(raw, "num_local_experts", source)
        if require(raw, "attention_bias", source) is not True:
            raise ConfigError(f"{source}: gpt-oss has biases on q, k, v and o (attention_bias)")
        alpha = raw.get("swiglu_alpha", SWIGLU_ALPHA)
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(require(raw, "vocab_size", source)),
            hidden_size=int(require(raw, "hidden_size", source)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(require(raw, "num_key_value_heads", source)),
            head_dim=head_dim,
            rms_norm_eps=float(require(raw, "rms_norm_eps", source)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=parse_rope(raw, head_dim, source),
            n_experts=int(experts),
            top_k=int(require(raw, "num_experts_per_tok", source)),
            expert_intermediate=int(require(raw, "intermediate_size", source)),
            dense_intermediate=0,
            norm_topk_prob=True,  # softmax over the top-k logits
            moe_layers=tuple(range(layers)),
            qkv_bias=True,
            max_position_embeddings=int(require(raw, "max_position_embeddings", source)),
            eos_token_id=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            layer_windows=_layer_windows(raw, layers, source),
            attention_sinks=True,
            o_bias=True,
            router_bias=True,
            swiglu_alpha=check_float(alpha, "swiglu_alpha", source, 0.0, True),
            swiglu_limit=check_float(
                require(raw, "swiglu_limit", source), "swiglu_limit", source, 0.0, True
            ),
        )


def _layer_windows(raw: dict[str, Any], layers: int, source: str) -> tuple[int, ...]:
    """Each layer's attention window from `layer_types` (0: full attention)."""
    kinds = require(raw, "layer_types", source)
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ConfigError(f"{source}: 'layer_types' must list the kind of each of {layers} layers")
    unknown = sorted({str(k) for k in kinds} - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(
            f"{source}: 'layer_types' has {unknown[0]!r} (known: {', '.join(LAYER_KINDS)})"
        )
    window = 0
    if "sliding_attention" in kinds:
        window = check_int(
            require(raw, "sliding_window", source), "sliding_window", source, 1, 1 << 30
        )
    return tuple(window if k == "sliding_attention" else 0 for k in kinds)


def canonical_name(name: str) -> str:
    """The router is `mlp.router` in gpt-oss checkpoints; the trunk stores it as `mlp.gate`."""
    return name.replace(".mlp.router.", ".mlp.gate.")


def published_config(name: str, layers: int | None = None) -> dict:
    """config.json as OpenAI publishes it for `name` in `PUBLISHED` (hidden and expert width
    2880, 64 query and 8 key/value heads of 64, vocabulary 201088, a 128 window on every other
    layer, YaRN x32 from 4096, top-4, MXFP4 experts), with `layers` instead if given."""
    n_layers, n_experts = PUBLISHED[name]
    n_layers = layers or n_layers
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": n_layers,
        "num_local_experts": n_experts,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "layer_types": kinds,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": rope,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "vocab_size": 201088,
        "eos_token_id": 200002,
        "quantization_config": {"quant_method": "mxfp4"},
    }
