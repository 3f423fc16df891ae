"""Reference outputs of one Kimi Delta Attention (KDA) layer from transformers' kimi_linear.

    .venv-ref/bin/python tools/make_kda_fixture.py --out tests/fixtures/kda/kimi_linear_kda.npz

A tiny `KimiLinearDeltaAttention` (hidden 64, 2 heads of 16, short convolution 4) with seeded
random weights (A_log and dt_bias drawn as transformers initialises them), run in float32:

* ``prefill_y`` [T, H]: one call over the whole sequence (transformers' chunked form);
* ``step_y`` [T, H]: the same tokens one at a time with a cache (its recurrent form), and the
  cache afterwards: ``conv_state`` [3 * 32, 4] and ``recurrent_state`` [2, 16, 16].

`tests/test_kda.py` checks `moeshard.moe.model.kda` against these.  Needs torch 2.13.0 and
transformers 5.24.0 (`make ref-venv`); the test suite itself does not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers.models.kimi_linear import modeling_kimi_linear as kl
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

HIDDEN, HEADS, HEAD_DIM, KERNEL, TOKENS = 64, 2, 16, 4, 9


def build(seed: int):
    config = KimiLinearConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=32,
        linear_attn_config={
            "head_dim": HEAD_DIM,
            "num_heads": HEADS,
            "short_conv_kernel_size": KERNEL,
            "kda_layers": [1, 2],
            "full_attn_layers": [],
        },
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    layer = kl.KimiLinearDeltaAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(np.log(1e-3), np.log(1e-1)).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith("o_norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return config, layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    config, layer = build(args.seed)
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        prefill = layer(x)  # [1, T, H], no cache: the chunked form
        cache = transformers.DynamicCache(config=config)
        steps = [layer(x[:, t : t + 1], cache=cache) for t in range(TOKENS)]
    step_y = torch.cat(steps, dim=1)
    conv_state = cache.get_conv_state(0, state_idx=0)  # [1, 3 * qkv, K]
    recurrent = cache.get_recurrent_state(0, state_idx=0)  # [1, heads, dk, dv]
    weights = {name: p.detach().numpy().astype(np.float32) for name, p in layer.named_parameters()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out,
        x=x[0].numpy(),
        prefill_y=prefill[0].numpy(),
        step_y=step_y[0].numpy(),
        conv_state=conv_state[0].numpy(),
        recurrent_state=recurrent[0].numpy(),
        **{f"w.{k}": v for k, v in weights.items()},
    )
    meta = {
        "seed": args.seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shapes": {"hidden": HIDDEN, "heads": HEADS, "head_dim": HEAD_DIM, "kernel": KERNEL},
        "max |prefill - step|": float((prefill - step_y).abs().max()),
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
