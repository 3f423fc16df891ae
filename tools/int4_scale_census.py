#!/usr/bin/env python
"""How often an INT4 group's bf16 scale is one float16 cannot hold (so q4_0 cannot keep it).

    .venv-ref/bin/python tools/int4_scale_census.py [--groups 1048576]

Scales are made as compressed-tensors makes them for Kimi K2.5's scheme (`calculate_qparams`
on bf16 weights: 4-bit int, symmetric, groups of 32; the scale is absmax / 7.5 in bf16), from
(a) groups of normal weights at standard deviations around DeepSeek-V3 / Kimi K2's
`initializer_range` 0.006, and (b) the routed experts of the committed demo model
(models/demo-hf, trained bf16 weights).  A bf16 scale is exact in float16 when it is 0, or
at most 65504 and a multiple of 2^-24 (float16's smallest step), which every bf16 value from
2^-17 up is (8 significant bits); so trouble needs a whole group under 7.5 * 2^-17 = 5.7e-5
in absolute value.  Prints one line per source.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file

ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
DEMO = Path(__file__).resolve().parents[1] / "models" / "demo-hf" / "model.safetensors"


def census(name: str, w: torch.Tensor) -> None:
    groups = w.bfloat16().reshape(-1, ARGS.group_size)  # [groups, 32]
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)  # bf16 [groups]
    s = scale.float()
    inexact = s.half().float() != s
    print(
        f"{name:34s} {s.numel():>9d} groups  scale {s.min().item():.3e} .. {s.max().item():.3e}"
        f"  median {s.median().item():.3e}  not float16-exact: {int(inexact.sum())}"
        f" ({inexact.float().mean().item():.2e})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=1 << 20)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    for std in (2e-2, 6e-3, 2e-3, 6e-4, 2e-4, 6e-5):
        census(f"normal weights, std {std:g}", torch.randn(args.groups * 32, generator=gen) * std)
    experts = [t for n, t in load_file(DEMO).items() if ".mlp.experts." in n]
    census(
        f"models/demo-hf experts ({len(experts)} tensors)",
        torch.cat([t.reshape(-1) for t in experts]),
    )


if __name__ == "__main__":
    main()
