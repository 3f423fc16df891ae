"""Fixture specs: one tiny model per family, with its seed, checkpoint layout and config."""

from __future__ import annotations

# DeepSeek-V3 style (published: factor 40, original 4096, beta_fast 32, beta_slow 1, mscale 1/1)
YARN_DS = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)
# Kimi-K2 style (published: theta 50000, factor 32, original 4096, beta_fast 1, beta_slow 1)
YARN_KIMI = dict(
    rope_type="yarn",
    rope_theta=50000.0,
    factor=32.0,
    original_max_position_embeddings=16,
    beta_fast=1.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

# the text model both Qwen3-Next and Qwen3.5-MoE fixtures share
QWEN3_NEXT_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=32,  # (q4_0 experts need rows of whole 32-weight blocks)
    shared_expert_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)

SPECS: dict[str, dict] = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        arch="Qwen3MoeForCausalLM",
        seed=1000,
        layout="stacked",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,  # != hidden/heads on purpose (like Qwen3-30B-A3B)
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            use_sliding_window=False,
            sliding_window=None,
        ),
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        arch="DeepseekV3ForCausalLM",
        seed=2000,
        layout="sharded_mtp",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_interleave=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,  # = factor * original_max_position_embeddings
            rope_parameters=YARN_DS,
            num_nextn_predict_layers=1,
        ),
        old_extra=dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1),
    ),
    "deepseek_v3_fp8": dict(
        model_type="deepseek_v3",
        arch="DeepseekV3ForCausalLM",
        seed=3000,
        layout="sharded_fp8",
        cfg=dict(
            hidden_size=64,
            intermediate_size=80,  # 2.5 blocks of 32 -> partial edge block
            moe_intermediate_size=48,  # 1.5 blocks -> partial edge block
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,  # Kimi-K2: q_proj directly
            kv_lora_rank=32,  # kv_a_proj_with_mqa out = 32 + 8 = 40 -> partial block
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_interleave=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=512,  # = factor * original_max_position_embeddings
            rope_parameters=YARN_KIMI,
            num_nextn_predict_layers=0,
        ),
        old_extra=dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1),
        # Kimi-K2's published config.json has no rope_interleave key (transformers default: True)
        old_drop=("rope_interleave",),
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        arch="Qwen2MoeForCausalLM",
        seed=4000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            qkv_bias=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=3,
        ),
        # published Qwen1.5/Qwen2-MoE configs have no qkv_bias key (transformers default: True)
        old_drop=("qkv_bias",),
    ),
    "mixtral": dict(
        model_type="mixtral",
        arch="MixtralForCausalLM",
        seed=5000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            sliding_window=None,
        ),
    ),
    "olmoe": dict(
        model_type="olmoe",
        arch="OlmoeForCausalLM",
        seed=6000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            clip_qkv=None,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            pad_token_id=None,
        ),
    ),
    "qwen3_moe_yarn": dict(
        model_type="qwen3_moe",
        arch="Qwen3MoeForCausalLM",
        seed=7000,
        layout="per_expert",
        cfg=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            # Qwen3 cards: {"rope_type": "yarn", "factor": 4.0,
            #               "original_max_position_embeddings": 32768}
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000000.0,
                factor=4.0,
                original_max_position_embeddings=16,
            ),
            use_sliding_window=False,
            sliding_window=None,
        ),
    ),
    # GLM-4.5/4.6/4.7: GQA with q/k/v bias, per-head q/k norm, partial RoPE (half of each head),
    # DeepSeek-V3's grouped sigmoid router (2 groups here; published: 1), a shared expert, a
    # dense first layer and an MTP layer after the last (published: model.layers.92.*)
    "glm4_moe": dict(
        model_type="glm4_moe",
        arch="Glm4MoeForCausalLM",
        seed=8000,
        layout="sharded_mtp",
        cfg=dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=32,  # whole q4_0 blocks
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,  # explicit, as published (GLM-4.5-Air: 128, not 4096 / 96)
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5
            ),
            num_nextn_predict_layers=1,
        ),
    ),
    # GLM-4.7-Flash: DeepSeek-V3's MLA; the published config.json has first_k_dense_replace (no
    # mlp_layer_types), partial_rotary_factor 1.0 and no rope_interleave key
    "glm4_moe_lite": dict(
        model_type="glm4_moe_lite",
        arch="Glm4MoeLiteForCausalLM",
        seed=9000,
        layout="sharded_mtp",
        cfg=dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=32,  # whole q4_0 blocks
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=1.8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            mlp_layer_types=["dense", "sparse", "sparse"],
            rope_interleave=True,
            attention_bias=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="default", rope_theta=1000000.0, partial_rotary_factor=1.0
            ),
            num_nextn_predict_layers=1,
        ),
        old_extra=dict(topk_method="noaux_tc"),
        old_drop=("mlp_layer_types", "rope_interleave", "qk_head_dim"),
    ),
    # Qwen3-Next: Gated DeltaNet layers 0-2 (GVA: 4 value heads over 2 key heads, dk 16 != dv 8),
    # gated full attention at layer 3 (full_attention_interval 4), partial rotary (8 of 32
    # dims), (1 + w) norms, a shared expert, layer 1 a dense MLP (mlp_only_layers); the
    # published fused in_proj_qkvz / in_proj_ba and per-expert tensors, plus an mtp.* head
    "qwen3_next": dict(
        model_type="qwen3_next",
        arch="Qwen3NextForCausalLM",
        seed=8000,
        layout="per_expert_mtp",
        offset_norms=True,
        prompt_len=12,  # > 2 * the convolution's width: the conv state and recurrence matter
        cfg=QWEN3_NEXT_TEXT | dict(mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True),
        old_extra=dict(full_attention_interval=4),
    ),
    # Qwen3.5 / 3.6 MoE as published: the vision-language wrapper (a tiny vision tower, skipped
    # at convert), text model under text_config, model.language_model.* names, stacked experts
    # (gate_up_proj), an mtp.* head; config.rope_parameters.json is the text-only
    # qwen3_5_moe_text config transformers' Qwen3_5MoeForCausalLM saves
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        arch="Qwen3_5MoeForConditionalGeneration",
        text_arch="Qwen3_5MoeForCausalLM",
        seed=9000,
        layout="stacked_mtp",
        offset_norms=True,
        prompt_len=12,
        cfg=QWEN3_NEXT_TEXT
        | dict(
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            )
        ),
        vision_cfg=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=32,
            num_position_embeddings=16,
            patch_size=4,
            spatial_merge_size=1,
        ),
        # the published text_config carries full_attention_interval beside layer_types
        text_extra=dict(full_attention_interval=4, mtp_num_hidden_layers=1),
    ),
}
ORDER = [
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v3_fp8",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_moe_yarn",
    "glm4_moe",
    "glm4_moe_lite",
    "qwen3_next",
    "qwen3_5_moe",
]
