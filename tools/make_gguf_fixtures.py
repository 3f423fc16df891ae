#!/usr/bin/env python
"""GGUF fixtures made by llama.cpp's own converter from the repository's test checkpoints
(issue 39): `moeshard convert FILE.gguf` must reproduce what the safetensors give.

    .venv/bin/python tools/make_gguf_fixtures.py [--out tests/fixtures/gguf]

llama.cpp comes from the llama-cpp-python sdist, as `moeshard bench compare-llamacpp` builds
it (cached under ~/.cache/moeshard); its convert_hf_to_gguf.py runs in the reference venv
(`make ref-venv`: torch + transformers, and sentencepiece, which the converter imports for
a `llama` model even when its tokenizer is BPE). For each fixture: NAME-f32.gguf, every tensor f32,
and llama-quantize's NAME-q8_0.gguf, NAME-q4_0.gguf, NAME-mxfp4_moe.gguf and NAME-q4_k_m.gguf
of qwen3_moe's; and qwen3_moe_wide-q4_k_m.gguf / -iq4_xs.gguf / -iq4_nl.gguf / -q2_k.gguf of
a random Qwen3-MoE whose expert widths are multiples of 256 (`WIDE`), so the K-quants are
really used.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moeshard.bench import llamacpp  # noqa: E402

# the test checkpoints whose llama.cpp architecture `moeshard convert` imports
FIXTURES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "deepseek_v3_fp8")
# llama-quantize types of qwen3_moe's f32 file, with its options: every 2-D tensor in the type
# (--pure: no Q6_K output layer), llama.cpp's MXFP4_MOE mix (experts MXFP4, the rest Q8_0),
# and its Q4_K_M mix (64 columns are too few for K-quants: its fallbacks, Q5_0 and Q8_0)
QUANTIZED = (("Q8_0", ["--pure"]), ("Q4_0", ["--pure"]), ("MXFP4_MOE", []), ("Q4_K_M", []))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "gguf"))
    p.add_argument("--python", default=str(REPO / ".venv-ref" / "bin" / "python"))
    p.add_argument(
        "--demo",
        metavar="DIR",
        help="instead: the embedded demo model's GGUFs into DIR (F32, then llama-quantize's "
        "Q4_K_M, IQ4_XS and Q4_0 mixes), for `moeshard quality models/demo-hf --gguf ...`",
    )
    p.add_argument("--wide-only", action="store_true", help="only the K-quant fixtures")
    args = p.parse_args()
    cache = llamacpp.cache_root(None)
    llama = llamacpp.ensure_built(cache, None)
    if args.demo:
        return demo_ggufs(llama, Path(args.python), Path(args.demo), cache)
    if args.wide_only:
        wide_ggufs(llama, Path(args.python), Path(args.out), cache)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FIXTURES:
        target = out / f"{name}-f32.gguf"
        log = cache / f"gguf-fixture-{name}.log"
        hf = REPO / "tests" / "fixtures" / name
        llamacpp.convert_hf(llama, Path(args.python), hf, target, log, outtype="f32")
        print(f"{hf} -> {target} ({target.stat().st_size / 1e6:.2f} MB)")
        for ftype, options in QUANTIZED if name == "qwen3_moe" else ():
            quantized = out / f"{name}-{ftype.lower()}.gguf"
            llamacpp.quantize(llama, target, quantized, options, 1, log, ftype)
            print(f"{target.name} -> {quantized} ({quantized.stat().st_size / 1e6:.2f} MB)")
    wide_ggufs(llama, Path(args.python), out, cache)
    (out / "convert_hf_to_gguf_wrapper.py").unlink(missing_ok=True)  # (convert_hf's helper)
    return 0


# A Qwen3-MoE whose expert widths are multiples of 256, so llama-quantize really writes
# K-quants (the test checkpoints' 64 and 32 columns get its fallbacks): random weights from
# transformers' own initialisation, the qwen3_moe fixture's tokenizer; only the quantized
# GGUFs are kept (the tests compare them with their own blocks decoded by gguf-py).
WIDE = dict(
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    vocab_size=384,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# (Q2_K: a type moeshard has no kernels for, re-packed at import with its cost printed)
WIDE_QUANTIZED = (("Q4_K_M", []), ("IQ4_XS", []), ("IQ4_NL", []), ("Q2_K", ["--pure"]))
WIDE_SCRIPT = """
import json, shutil, sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
out, tok, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.manual_seed(3900)
model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
with torch.no_grad():  # weights of a trained model's size, not the 0.02 of the initialiser
    for p in model.parameters():
        if p.dim() == 2:
            p.mul_(2.5)
model.save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{tok}/{name}", f"{out}/{name}")
"""


def wide_ggufs(llama, python: Path, out: Path, cache: Path) -> None:
    import json
    import subprocess
    import tempfile

    log = cache / "gguf-fixture-qwen3_moe_wide.log"
    with tempfile.TemporaryDirectory() as tmp:
        hf, f32 = Path(tmp) / "hf", Path(tmp) / "wide-f32.gguf"
        tok = REPO / "tests" / "fixtures" / "qwen3_moe"
        subprocess.run([python, "-c", WIDE_SCRIPT, hf, tok, json.dumps(WIDE)], check=True)
        llamacpp.convert_hf(llama, python, hf, f32, log, outtype="f32")
        (Path(tmp) / "convert_hf_to_gguf_wrapper.py").unlink(missing_ok=True)
        for ftype, options in WIDE_QUANTIZED:
            target = out / f"qwen3_moe_wide-{ftype.lower()}.gguf"
            llamacpp.quantize(llama, f32, target, options, 1, log, ftype)
            print(f"{hf} -> {target} ({target.stat().st_size / 1e6:.2f} MB)")


DEMO_MIXES = ("Q4_K_M", "IQ4_XS", "Q4_0")  # llama-quantize's own mixes (output layer, fallbacks)


def demo_ggufs(llama, python: Path, out: Path, cache: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    log = cache / "gguf-demo.log"
    f32 = out / "demo-f32.gguf"
    llamacpp.convert_hf(llama, python, REPO / "models" / "demo-hf", f32, log, outtype="f32")
    (out / "convert_hf_to_gguf_wrapper.py").unlink(missing_ok=True)
    for ftype in DEMO_MIXES:
        target = out / f"demo-{ftype.lower()}.gguf"
        llamacpp.quantize(llama, f32, target, [], 1, log, ftype)
        print(f"{target} ({target.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
