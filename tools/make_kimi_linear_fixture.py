"""A tiny Kimi Linear checkpoint in the released layout, with transformers' reference outputs.

    .venv-ref/bin/python tools/make_kimi_linear_fixture.py --out tests/fixtures/kimi_linear

`KimiLinearForCausalLM` (transformers 5.24.0, float32, eager attention) with 4 layers: KDA,
KDA, MLA, KDA (`linear_attn_config`: kda_layers [1, 2, 4], full_attn_layers [3], one-based);
layer 0 a dense MLP, the others MoE (8 experts, top-2, one shared expert, sigmoid router with
a correction bias).  Weights are drawn with fan-in-scaled normals (A_log and dt_bias as
transformers initialises them) so that the logits are not flat, and `save_pretrained` writes
the released layout (`block_sparse_moe`, per-expert w1/w2/w3, separate q/k/v_conv1d).  The
tokenizer is the other fixtures' (vocabulary 384).  `reference.npz`: `prompt_ids` [7],
`prefill_logits` [7, V] from one forward, `greedy_ids` [12] and `greedy_logits` [12, V] from
a token-by-token loop with the cache (row i: the logits greedy_ids[i] was chosen from).
The seed is the first from --seed whose greedy steps all have a top-1/top-2 gap above 1e-3.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM

TOKENIZER_FROM = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_moe"
PROMPT = [52, 289, 109, 65, 118, 279, 98]
GREEDY = 12


def config() -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        num_expert_group=1,
        topk_group=1,
        moe_renormalize=True,
        routed_scaling_factor=2.0,
        first_k_dense_replace=1,
        linear_attn_config={
            "head_dim": 16,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4],
            "full_attn_layers": [3],
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )


def randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape).uniform_(np.log(1e-3), np.log(1e-1), generator=gen).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif p.ndim == 1:  # norms
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def run(model):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        prefill = model(ids).logits[0]  # [T, V]
        cache = transformers.DynamicCache(config=model.config)
        out = model(ids, cache=cache, use_cache=True)
        logits, greedy, rows = out.logits[0, -1], [], []
        for _ in range(GREEDY):
            rows.append(logits)
            token = int(torch.argmax(logits))
            greedy.append(token)
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            logits = out.logits[0, -1]
    return prefill, greedy, torch.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    for seed in range(args.seed, args.seed + 50):
        torch.manual_seed(seed)
        model = KimiLinearForCausalLM(config()).eval()
        randomise(model, seed)
        prefill, greedy, rows = run(model)
        top2 = torch.topk(rows, 2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        if gap > 1e-3:
            break
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / name, out / name)
    np.savez_compressed(
        out / "reference.npz",
        prompt_ids=np.array(PROMPT, dtype=np.int64),
        prefill_logits=prefill.numpy(),
        greedy_ids=np.array(greedy, dtype=np.int64),
        greedy_logits=rows.numpy(),
    )
    meta = {
        "seed": seed,
        "min greedy top1-top2 gap": gap,
        "max |prefill[-1] - greedy_logits[0]|": float((prefill[-1] - rows[0]).abs().max()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
