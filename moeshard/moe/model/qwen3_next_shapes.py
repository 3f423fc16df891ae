"""Qwen3.6-35B-A3B and Qwen3-Next-80B-A3B at their published shapes (`moeshard.moe.model.
qwen3_next`): the configs `moeshard synth --preset qwen3.6-35b-a3b | qwen3-next-80b-a3b`
writes (random weights, for streaming benchmarks) and the geometries `moeshard simulate
--geometry` projects.  Offline tools only: nothing on a token's path reads this.

The config is the published one in its published form: Qwen3.6-35B-A3B as the vision-language
wrapper (model_type qwen3_5_moe, the text model under `text_config`; no vision tower is
written: moeshard runs the text model), Qwen3-Next-80B-A3B flat (qwen3_next, layers from
`full_attention_interval`).  Shapes from the published config.json files (Qwen/Qwen3.6-35B-A3B,
Qwen/Qwen3-Next-80B-A3B-Instruct): 40 and 48 layers, three Gated DeltaNet layers to one
gated-attention layer, hidden 2048, 256 experts top-8 and 512 experts top-10 of 512, one
shared expert of 512.  Records and trunk values are `synth`'s (random q4_0 codes, skewed
router).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeshard.moe.errors import MoeshardError


@dataclass(frozen=True)
class QwenNextPreset:
    model_type: str  # qwen3_5_moe (the published wrapper) or qwen3_next
    hidden: int
    layers: int
    vocab: int
    heads: int  # full attention: query heads
    kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    inter: int  # moe_intermediate_size
    shared_inter: int  # shared_expert_intermediate_size
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int  # key and value heads' width (128 in both published models)
    eos: int
    theta: float = 10_000_000.0
    interval: int = 4  # full_attention_interval
    dense_inter: int = 5120  # qwen3_next's intermediate_size (no dense layer is used)
    experts_fmt: str = "q4_0"
    trunk_fmt: str = "q8_0"


QWEN_PRESETS = {
    # Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B's shape): 40 layers, 256 experts, 8 active
    "qwen3.6-35b-a3b": QwenNextPreset(
        "qwen3_5_moe", 2048, 40, 248320, 16, 2, 256, 256, 8, 512, 512, 16, 32, 128, 248044
    ),
    # Qwen3-Next-80B-A3B: 48 layers, 512 experts, 10 active
    "qwen3-next-80b-a3b": QwenNextPreset(
        "qwen3_next", 2048, 48, 151936, 16, 2, 256, 512, 10, 512, 512, 16, 32, 128, 151645
    ),
}


def preset(name: str) -> QwenNextPreset:
    if name not in QWEN_PRESETS:
        raise MoeshardError(f"unknown Qwen3-Next preset {name!r}")
    return QWEN_PRESETS[name]


def text_config(p: QwenNextPreset) -> dict:
    """The text model's fields as the published configs have them."""
    kinds = ["linear_attention"] * p.layers
    for i in range(p.interval - 1, p.layers, p.interval):
        kinds[i] = "full_attention"
    text = {
        "attention_bias": False,
        "eos_token_id": p.eos,
        "full_attention_interval": p.interval,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": p.linear_head_dim,
        "linear_num_key_heads": p.linear_key_heads,
        "linear_num_value_heads": p.linear_value_heads,
        "linear_value_head_dim": p.linear_head_dim,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": p.inter,
        "num_attention_heads": p.heads,
        "num_experts": p.n_experts,
        "num_experts_per_tok": p.top_k,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "rms_norm_eps": 1e-6,
        "shared_expert_intermediate_size": p.shared_inter,
        "tie_word_embeddings": False,
        "vocab_size": p.vocab,
    }
    if p.model_type == "qwen3_next":
        return text | {
            "decoder_sparse_step": 1,
            "intermediate_size": p.dense_inter,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "partial_rotary_factor": 0.25,
            "rope_scaling": None,
            "rope_theta": p.theta,
        }
    return text | {
        "layer_types": kinds,
        "mtp_num_hidden_layers": 1,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": p.theta,
            "rope_type": "default",
        },
    }


def released_config(p: QwenNextPreset) -> dict:
    """config.json: the wrapper around `text_config` (qwen3_5_moe) or the flat text model."""
    marks = {"torch_dtype": "bfloat16", "moeshard_synthetic": True}
    if p.model_type == "qwen3_next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"} | (
            text_config(p) | marks
        )
    text = text_config(p) | {"model_type": "qwen3_5_moe_text"}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
    } | marks
