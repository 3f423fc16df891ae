"""Kimi K2.5 presets for `moeshard synth`: the released wrapper config (model_type kimi_k25, the
DeepSeek-V3 language model under `text_config` as Kimi K2's) with random q4_0 experts, the
format K2.5's INT4 experts convert to without change (`moeshard.moe.convert.int4`), so the
records have the size a converted K2.5's have.  The vision tower is not written (convert
skips it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class K25Preset:
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
    trunk_fmt: str = "bf16"


K25_PRESETS = {
    # Kimi K2.5 / K2.6's language model as published (Kimi K2's shape): 61 layers, layer 0
    # dense, 384 experts of 2048, 8 active; 571 GB of q4_0 records, for the arithmetic.
    "kimi-k2.5": K25Preset(7168, 2048, 18432, 384, 8, 61, 64, 1536, 512, 128, 64, 128, 163840),
    # K2.5's router (384 experts, top-8) on a small trunk: 3 MoE layers of 216 KiB records.
    "kimi-k2.5-mini": K25Preset(512, 256, 1024, 384, 8, 4, 8, 128, 64, 32, 16, 32, 8192),
    # Tiny, for tests.
    "kimi-k2.5-tiny": K25Preset(64, 64, 128, 16, 4, 3, 4, 32, 32, 16, 8, 16, 256, "f32"),
}


def released_config(p: K25Preset) -> dict:
    """config.json as Kimi K2.5 publishes it (the fields moeshard reads, and a few others; the
    quantization_config of the INT4 checkpoint is left out: these experts are q4_0 already)."""
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
