"""Write a large random Qwen3-MoE checkpoint (no torch) to measure conversion memory.

    python tools/make_big_checkpoint.py OUT --layers 8 --experts 64 --hidden 1024 --inter 768

Each layer's tensors go to their own safetensors file (with model.safetensors.index.json), so
writing it needs memory for one layer only. Values are bf16 (stored as uint16 bit patterns).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from moeshard.moe.convert.checkpoint import write_safetensors


def bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> bytes:
    values = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
    return (values >> 16).astype(np.uint16).tobytes()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--vocab", type=int, default=4096)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h, inter, heads, kv, d = args.hidden, args.inter, 8, 2, args.hidden // 8
    config = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": args.vocab,
        "hidden_size": h,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "num_experts": args.experts,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": inter,
        "intermediate_size": 4 * h,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(0)
    weight_map = {}

    def emit(fname: str, tensors: dict) -> None:
        write_safetensors(out / fname, tensors)
        weight_map.update({name: fname for name in tensors})

    emit(
        "embed.safetensors",
        {
            "model.embed_tokens.weight": (
                "BF16",
                (args.vocab, h),
                bf16(rng, (args.vocab, h), 0.02),
            ),
            "lm_head.weight": ("BF16", (args.vocab, h), bf16(rng, (args.vocab, h), 0.02)),
            "model.norm.weight": ("BF16", (h,), bf16(rng, (h,), 1.0)),
        },
    )
    for layer in range(args.layers):
        p_ = f"model.layers.{layer}."
        t = {
            p_ + "input_layernorm.weight": ("BF16", (h,), bf16(rng, (h,), 1.0)),
            p_ + "post_attention_layernorm.weight": ("BF16", (h,), bf16(rng, (h,), 1.0)),
            p_ + "self_attn.q_proj.weight": (
                "BF16",
                (heads * d, h),
                bf16(rng, (heads * d, h), 0.02),
            ),
            p_ + "self_attn.k_proj.weight": ("BF16", (kv * d, h), bf16(rng, (kv * d, h), 0.02)),
            p_ + "self_attn.v_proj.weight": ("BF16", (kv * d, h), bf16(rng, (kv * d, h), 0.02)),
            p_ + "self_attn.o_proj.weight": (
                "BF16",
                (h, heads * d),
                bf16(rng, (h, heads * d), 0.02),
            ),
            p_ + "self_attn.q_norm.weight": ("BF16", (d,), bf16(rng, (d,), 1.0)),
            p_ + "self_attn.k_norm.weight": ("BF16", (d,), bf16(rng, (d,), 1.0)),
            p_ + "mlp.gate.weight": ("BF16", (args.experts, h), bf16(rng, (args.experts, h), 0.02)),
        }
        for e in range(args.experts):
            q = f"{p_}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = ("BF16", (inter, h), bf16(rng, (inter, h), 0.02))
            t[q + "up_proj.weight"] = ("BF16", (inter, h), bf16(rng, (inter, h), 0.02))
            t[q + "down_proj.weight"] = ("BF16", (h, inter), bf16(rng, (h, inter), 0.02))
        emit(f"layer-{layer:03d}.safetensors", t)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
