"""Kimi K2.5 and K2.6 (model_type kimi_k25): Kimi K2's DeepSeek-V3 language model inside a
multimodal wrapper.

The released config.json nests the language model under `text_config` (model_type kimi_k2, or
deepseek_v3 as transformers' `Kimi_K25Config` rewrites it) beside a `vision_config`; moeshard
runs the text model (`moeshard.moe.model.deepseek_v3`, unchanged) and leaves the vision tower
and its projector out (convert lists their tensors as skipped).  Tensor names carry a
``language_model.`` prefix, dropped here as for Kimi K3.  transformers 5.25's
`save_pretrained` writes the language model's layers as ``language_model.model.blocks.N.``
(its rename of the vision tower's ``blocks`` to ``layers``, undone on every name on the way
out) and the projector's norm as ``model.mm_projector.``: both are read too.

The routed experts ship as compressed-tensors INT4 (`moeshard.moe.convert.int4`, kept as q4_0
bit for bit); quantization_config sits in text_config as released, or at the top level where
transformers writes it (`converter.quantization_config`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from moeshard.moe.errors import ConfigError
from moeshard.moe.model import deepseek_v3, kimi_k3
from moeshard.moe.model.config import require, token_ids

MODEL_TYPES = ("kimi_k25",)
# the vision tower and projector: released names, and those transformers' save_pretrained writes
VISION_PREFIXES = (*kimi_k3.VISION_PREFIXES, "model.vision_tower.", "model.mm_projector.")
_SAVED_LAYER = re.compile(r"^model\.blocks\.(\d+)\.")  # transformers 5.25's save_pretrained


@dataclass(frozen=True, kw_only=True)
class Config(deepseek_v3.Config):
    """DeepSeek-V3's fields, read from text_config; `has_vision` says a vision tower is there
    (not run)."""

    has_vision: bool = False

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not Kimi K2.5")
        text, where = kimi_k3.text_config(raw, source)
        body = deepseek_v3.Config.from_hf(text, where)  # (its model_type: kimi_k2, deepseek_v3)
        tied = require(text, "tie_word_embeddings", where)
        outer = raw.get("tie_word_embeddings")
        if outer is not None and outer != tied:  # (transformers ties by the outer one)
            raise ConfigError(
                f"{source}: tie_word_embeddings {outer!r} and text_config's {tied!r} disagree"
            )
        eos = raw.get("eos_token_id")
        values = {f.name: getattr(body, f.name) for f in fields(body)}
        values |= {"model_type": model_type, "has_vision": raw.get("vision_config") is not None}
        if eos is not None:  # the wrapper's, where it has one (the released config does)
            values["eos_token_id"] = tuple(token_ids(eos, "eos_token_id", source))
        return cls(**values)


def canonical_name(name: str) -> str:
    """The released name without ``language_model.``, transformers' saved ``blocks.N`` as
    ``layers.N`` (the vision tower's names are skipped)."""
    return _SAVED_LAYER.sub(r"model.layers.\1.", kimi_k3.canonical_name(name))


def skip_reason(name: str) -> str | None:
    """Why convert leaves a checkpoint tensor out, where it is not the generic reason."""
    if name.startswith(VISION_PREFIXES):
        return "the vision tower (moeshard runs the text model)"
    return None


@dataclass(frozen=True)
class K25Shape:
    """The sizes of a Kimi K2.5 language model (`released_config`: its config.json)."""

    hidden: int
    inter: int  # routed (and shared) expert intermediate size
    dense_inter: int  # layer 0's MLP
    n_experts: int
    top_k: int
    layers: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_head: int
    vocab: int
    trunk_fmt: str = "bf16"  # the trunk format `synth` writes (published: bf16)


# Kimi K2.5 / K2.6's language model as published (Kimi K2's shape): 61 layers, layer 0 dense,
# 384 experts of 2048, 8 active (`synth --preset kimi-k2.5`, `simulate --geometry k2.5`)
PUBLISHED = K25Shape(7168, 2048, 18432, 384, 8, 61, 64, 1536, 512, 128, 64, 128, 163840)


def released_config(p: K25Shape) -> dict:
    """config.json as Kimi K2.5 publishes it for a model of these sizes (the fields moeshard
    reads, and a few others; without the INT4 checkpoint's quantization_config and the vision
    tower: `synth` writes q4_0 experts and no vision tower)."""
    text = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": p.vocab,
        "hidden_size": p.hidden,
        "intermediate_size": p.dense_inter,
        "moe_intermediate_size": p.inter,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.heads,
        "q_lora_rank": p.q_lora,
        "kv_lora_rank": p.kv_lora,
        "qk_nope_head_dim": p.nope,
        "qk_rope_head_dim": p.rope,
        "v_head_dim": p.v_head,
        "n_routed_experts": p.n_experts,
        "num_experts_per_tok": p.top_k,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },  # fmt: skip
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "bos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "text_config": text,
        "moeshard_synthetic": True,
    }


Transformer = deepseek_v3.Transformer
LatentCache = deepseek_v3.LatentCache
