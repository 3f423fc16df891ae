#!/usr/bin/env python
"""GGUF fixtures made by llama.cpp's own converter from the repository's test checkpoints
(issue 39): `moeshard convert FILE.gguf` must reproduce what the safetensors give.

    .venv/bin/python tools/make_gguf_fixtures.py [--out tests/fixtures/gguf]

llama.cpp comes from the llama-cpp-python sdist, as `moeshard bench compare-llamacpp` builds
it (cached under ~/.cache/moeshard); its convert_hf_to_gguf.py runs in the reference venv
(`make ref-venv`: torch + transformers, and sentencepiece, which the converter imports for
a `llama` model even when its tokenizer is BPE). For each fixture: NAME-f32.gguf, every tensor f32,
and llama-quantize's NAME-q8_0.gguf, NAME-q4_0.gguf, NAME-mxfp4_moe.gguf and NAME-q4_k_m.gguf
of qwen3_moe's.
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
    args = p.parse_args()
    cache = llamacpp.cache_root(None)
    llama = llamacpp.ensure_built(cache, None)
    if args.demo:
        return demo_ggufs(llama, Path(args.python), Path(args.demo), cache)
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
    (out / "convert_hf_to_gguf_wrapper.py").unlink(missing_ok=True)  # (convert_hf's helper)
    return 0


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
