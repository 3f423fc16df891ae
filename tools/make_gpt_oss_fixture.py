"""Tiny gpt-oss checkpoints in OpenAI's released layout and in transformers' own, with
transformers' reference outputs.

    .venv-ref/bin/python tools/make_gpt_oss_fixture.py --out tests/fixtures

writes two fixture directories of one model (`GptOssForCausalLM`, transformers 5.25, float32,
eager attention; 3 layers: sliding (window 4), full, sliding; 4 experts, top-2; attention
sinks, biases everywhere; YaRN with truncate false):

* ``gpt_oss``: the released layout. Experts as MXFP4 ``*_blocks`` [experts, out, in / 32, 16]
  and ``*_scales`` [experts, out, in / 32] (random codes and E8M0 scales), biases in bf16,
  gate_up's rows interleaving gate and up; config.json as OpenAI publishes it (rope_scaling,
  `quantization_config` quant_method mxfp4, no swiglu_alpha) and config.rope_parameters.json
  in transformers' dialect. The reference model is **loaded from these files by transformers**
  with ``Mxfp4Config(dequantize=True)``: its own reading of the layout.
* ``gpt_oss_saved``: that model as transformers' ``save_pretrained`` writes it (float32
  ``gate_up_proj`` [experts, hidden, 2 inter], its config.json): a fine-tune's form.

`reference.npz` (the same in both): `prompt_ids` [7] (longer than the window),
`prefill_logits` [7, V], `greedy_ids` [24] and `greedy_logits` [24, V] from a token-by-token
loop with the cache. The seed is the first from --seed whose routing (gap between the k-th
and next router logit) and greedy steps (top-1/top-2 gap) all clear 1e-3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from fixtures_lib.reference import cached_greedy
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

TOKENIZER_FROM = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_moe"
PROMPT = [52, 289, 109, 65, 118, 279, 98]
GREEDY = 24
MARGIN = 1e-3
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}


def config() -> GptOssConfig:
    return GptOssConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(ROPE),
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        swiglu_limit=7.0,
        attention_bias=True,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )


def mxfp4(n: int, rows: int, cols: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks uint8 [n, rows, cols / 32, 16] (two codes a byte, the even column
    low) and scales uint8 [n, rows, cols / 32] (E8M0: 2^(s - 127)), values about 1/sqrt(cols)."""
    codes = torch.randint(0, 16, (n, rows, cols), generator=gen, dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [n, rows, cols / 2]
    blocks = packed.reshape(n, rows, cols // 32, 16).contiguous()
    centre = 127 - 2 - int(np.log2(np.sqrt(cols)))
    scales = torch.randint(centre - 1, centre + 2, (n, rows, cols // 32), generator=gen)
    return blocks, scales.to(torch.uint8).contiguous()


def released_state(seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the released layout: random trunk (fan-in scaled), MXFP4 experts."""
    cfg = config()
    gen = torch.Generator().manual_seed(seed)
    model = GptOssForCausalLM(cfg)
    state = {}
    for name, p in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("norm.weight"):
            v = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
        elif name.endswith("sinks"):
            v = torch.randn(p.shape, generator=gen)  # some heads lean on their sink
        elif p.ndim == 1:  # biases
            v = 0.3 * torch.randn(p.shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(p.shape, generator=gen)
        else:
            gain = 3.0 if name == "lm_head.weight" else 2.0 if "router" in name else 1.0
            v = torch.randn(p.shape, generator=gen) * (gain / np.sqrt(p.shape[-1]))
        state[name] = v.float().contiguous()
    h, inter, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    for i in range(cfg.num_hidden_layers):
        e = f"model.layers.{i}.mlp.experts."
        state[e + "gate_up_proj_blocks"], state[e + "gate_up_proj_scales"] = mxfp4(
            n, 2 * inter, h, gen
        )
        state[e + "down_proj_blocks"], state[e + "down_proj_scales"] = mxfp4(n, h, inter, gen)
        state[e + "gate_up_proj_bias"] = (0.3 * torch.randn(n, 2 * inter, generator=gen)).bfloat16()
        state[e + "down_proj_bias"] = (0.3 * torch.randn(n, h, generator=gen)).bfloat16()
    return state


def released_configs(cfg: GptOssConfig) -> tuple[dict, dict]:
    """(config.json as OpenAI publishes it, the same in transformers' dialect)."""
    quantization = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    new = cfg.to_dict()
    new["quantization_config"] = quantization
    new["architectures"] = ["GptOssForCausalLM"]
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "swiglu_alpha")}
    rope = dict(new["rope_parameters"])
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = rope
    old["experts_per_token"] = old["num_experts_per_tok"]  # (both are in the released file)
    old["initial_context_length"] = rope["original_max_position_embeddings"]
    return old, new


class RouterGaps:
    """The gap between the k-th and (k+1)-th router logit of every routing decision."""

    def __init__(self, model):
        self.gaps: list[float] = []
        for mod in model.modules():
            if type(mod).__name__ == "GptOssTopKRouter":
                mod.register_forward_hook(self._hook)

    def _hook(self, mod, args, out):
        logits = out[0].double()  # [T, E], bias included
        top = torch.topk(logits, mod.top_k + 1, dim=-1).values
        self.gaps += (top[:, -2] - top[:, -1]).tolist()


def write(directory: Path, state: dict, configs: dict[str, dict]) -> None:
    directory.mkdir(parents=True)
    save_file(state, directory / "model.safetensors")
    for name, cfg in configs.items():
        (directory / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the fixtures directory")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    old, new = released_configs(config())
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seed, args.seed + 50):
            state = released_state(seed)
            staged = Path(tmp) / f"seed{seed}"
            write(staged, state, {"config.json": new})
            model = GptOssForCausalLM.from_pretrained(
                staged,
                quantization_config=Mxfp4Config(dequantize=True),
                dtype=torch.float32,
                attn_implementation="eager",
            ).eval()
            probe = RouterGaps(model)
            prefill, greedy, rows = cached_greedy(model, PROMPT, GREEDY)
            top2 = torch.topk(rows, 2, dim=-1).values
            gap = float((top2[:, 0] - top2[:, 1]).min())
            route_gap = min(probe.gaps)
            print(f"seed {seed}: router gap {route_gap:.2e}, greedy gap {gap:.2e}", flush=True)
            if gap > MARGIN and route_gap > MARGIN and 0 not in greedy:
                break
        else:
            raise SystemExit("no seed with sufficient margins")
        root = Path(args.out)
        released, saved = root / "gpt_oss", root / "gpt_oss_saved"
        for d in (released, saved):
            if d.exists():
                shutil.rmtree(d)
        write(released, state, {"config.json": old, "config.rope_parameters.json": new})
        model.save_pretrained(saved)
        for d in (released, saved):
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(TOKENIZER_FROM / name, d / name)
            np.savez_compressed(
                d / "reference.npz",
                prompt_ids=np.array(PROMPT, dtype=np.int64),
                prefill_logits=prefill.float().numpy(),
                greedy_ids=np.array(greedy, dtype=np.int64),
                greedy_logits=rows.float().numpy(),
            )
            meta = {
                "seed": seed,
                "min router k-th/next gap": route_gap,
                "min greedy top1-top2 gap": gap,
                "reference": "transformers GptOssForCausalLM from the released layout, "
                "Mxfp4Config(dequantize=True), float32, eager",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
            (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
