"""A tiny Kimi Linear checkpoint written by transformers' `save_pretrained`, with its reference
outputs, and its config.json in both dialects.

    .venv-ref/bin/python tools/make_kimi_linear_fixture.py --out tests/fixtures/kimi_linear

`KimiLinearForCausalLM` (transformers 5.25, float32, eager attention) with 4 layers: KDA,
KDA, MLA, KDA; layer 0 a dense MLP, the others MoE (8 experts, top-2, one shared expert,
sigmoid router with a correction bias).  The config is built from transformers' own names, as
a model made or fine-tuned with transformers is (`layer_types`, `linear_num_heads`,
`linear_head_dim`, `linear_conv_kernel_dim`, `mlp_layer_types`, no `linear_attn_config` nor
`first_k_dense_replace`): the config.json `save_pretrained` writes is committed as
config.rope_parameters.json (the transformers dialect), and config.json is the same model in
the released dialect (`released_config`: `linear_attn_config` one-based, kda_layers [1, 2, 4]
and full_attn_layers [3], `first_k_dense_replace` 1), which transformers is made to load and
must give the same logits.  `save_pretrained` writes the released tensor layout
(`block_sparse_moe`, per-expert w1/w2/w3, separate q/k/v_conv1d; checked here), so one
model.safetensors serves both configs.  Weights are drawn with fan-in-scaled normals (A_log
and dt_bias as transformers initialises them) so that the logits are not flat.  The tokenizer
is the other fixtures' (vocabulary 384).  `reference.npz`: `prompt_ids` [7],
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
from fixtures_lib.reference import cached_greedy
from safetensors import safe_open
from transformers import KimiLinearConfig, KimiLinearForCausalLM

TOKENIZER_FROM = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_moe"
PROMPT = [52, 289, 109, 65, 118, 279, 98]
GREEDY = 12


LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
MLP_LAYER_TYPES = ["dense", "sparse", "sparse", "sparse"]
# fields only transformers writes; `released_config` replaces them by the released ones
TRANSFORMERS_ONLY = ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                     "linear_conv_kernel_dim", "head_dim", "qk_head_dim", "dtype",
                     "output_router_logits", "pretraining_tp", "transformers_version")  # fmt: skip
RELEASED_TENSORS = ("block_sparse_moe.experts.0.w1.weight", "self_attn.q_conv1d.weight",
                    "self_attn.f_a_proj.weight", "self_attn.A_log")  # fmt: skip


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
        layer_types=LAYER_TYPES,
        mlp_layer_types=MLP_LAYER_TYPES,
        linear_num_heads=2,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )


def released_config(hf: dict) -> dict:
    """The config save_pretrained wrote, in the released dialect: transformers' own names
    replaced by `linear_attn_config` (one-based layers) and `first_k_dense_replace`, plus the
    released fields transformers does not keep (always these values in Kimi Linear)."""
    assert hf["layer_types"] == LAYER_TYPES and hf["mlp_layer_types"] == MLP_LAYER_TYPES
    out = {k: v for k, v in hf.items() if k not in TRANSFORMERS_ONLY}
    out["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "full_attention"],
        "head_dim": hf["linear_head_dim"],
        "kda_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "linear_attention"],
        "num_heads": hf["linear_num_heads"],
        "short_conv_kernel_size": hf["linear_conv_kernel_dim"],
    }
    out["first_k_dense_replace"] = MLP_LAYER_TYPES.count("dense")
    out |= {"moe_layer_freq": 1, "moe_router_activation_func": "sigmoid", "mla_use_nope": True}
    out |= {"use_grouped_topk": True, "num_nextn_predict_layers": 0, "torch_dtype": "float32"}
    return dict(sorted(out.items()))


def check_released_dialect(out: Path, prefill: torch.Tensor) -> float:
    """Load the checkpoint with the released config.json into transformers: the same model
    (the largest logit difference, which must be 0)."""
    model = KimiLinearForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.layer_types == LAYER_TYPES
    assert model.config.mlp_layer_types == MLP_LAYER_TYPES
    with torch.no_grad():
        again = model(torch.tensor([PROMPT])).logits[0]
    return float((again - prefill).abs().max())


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    for seed in range(args.seed, args.seed + 50):
        torch.manual_seed(seed)
        model = KimiLinearForCausalLM(config()).eval()
        randomise(model, seed)
        prefill, greedy, rows = cached_greedy(model, PROMPT, GREEDY)
        top2 = torch.topk(rows, 2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        if gap > 1e-3:
            break
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    names = set(safe_open(out / "model.safetensors", "np").keys())
    for suffix in RELEASED_TENSORS:  # the released layout, not transformers' module names
        assert f"model.layers.1.{suffix}" in names, suffix
    hf = json.loads((out / "config.json").read_text())
    assert "linear_attn_config" not in hf and "first_k_dense_replace" not in hf
    (out / "config.rope_parameters.json").write_text(json.dumps(hf, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(released_config(hf), indent=2) + "\n")
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
        "max |logits with the released config.json - prefill|": check_released_dialect(
            out, prefill
        ),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
