"""Commands on one model directory: convert, inspect, synth, quality, perplexity."""

from __future__ import annotations

import sys
from pathlib import Path

from moeshard.commands import EXIT_BAD_INPUT, EXIT_OK
from moeshard.moe.errors import MoeshardError


def add_convert(sub) -> None:
    help = "Hugging Face checkpoint directory -> model directory"
    sub.add_parser("convert", help=help, fill=_convert_arguments)


def _convert_arguments(p) -> None:
    """(Filled when `convert` is used: the formats come from the converter, which imports the
    kernels.)"""
    from moeshard.moe.convert.converter import (
        DEFAULT_EXPERT_FORMAT,
        DEFAULT_TRUNK_FORMAT,
        EXPERT_FORMATS,
        KEPT_ONLY_FORMATS,
        TRUNK_FORMATS,
    )

    p.add_argument(
        "src",
        help="checkpoint directory (config.json + *.safetensors), or a llama.cpp GGUF file "
        "(a split model: any of its -0000N-of-0000M.gguf parts)",
    )
    p.add_argument("out", help="model directory to create")
    p.add_argument(
        "--experts",
        choices=EXPERT_FORMATS + KEPT_ONLY_FORMATS,
        help=f"weight format of the experts (default: mxfp4 for a checkpoint that publishes "
        f"its experts in MXFP4, their bits kept, and a GGUF file's own type where it is one of "
        f"these, a mix per layer kept too; else {DEFAULT_EXPERT_FORMAT}). "
        f"{', '.join(KEPT_ONLY_FORMATS)}: only a GGUF file's own blocks",
    )
    p.add_argument(
        "--trunk",
        choices=TRUNK_FORMATS,
        help=f"weight format of the trunk (everything but the experts; default: "
        f"{DEFAULT_TRUNK_FORMAT}, or a GGUF file's own where it is one of these, its bits kept)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it is an earlier model directory or empty, never anything else",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--tokenizer",
        metavar="TOKENIZER_JSON",
        help="GGUF source: this tokenizer.json (and the tokenizer_config.json beside it) "
        "instead of the tokenizer rebuilt from the file",
    )
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    from moeshard.moe.convert.converter import convert
    from moeshard.moe.convert.gguf_import import convert_gguf, is_gguf

    if Path(args.src).is_file() and is_gguf(Path(args.src)):
        s = convert_gguf(
            args.src, args.out, args.experts, args.trunk, args.force, not args.quiet,
            args.tokenizer,
        )  # fmt: skip
    elif args.tokenizer:
        raise MoeshardError("--tokenizer applies to a GGUF source only")
    else:
        s = convert(args.src, args.out, args.experts, args.trunk, args.force, not args.quiet)
    print(
        f"converted {args.src} -> {args.out}: {s.params / 1e6:.2f} M params "
        f"(trunk {s.trunk_params / 1e6:.2f} M, experts {s.expert_params / 1e6:.2f} M), "
        f"{s.bytes_written / 1e6:.1f} MB written in {s.seconds:.2f} s; model id {s.model_id[:16]}"
    )
    for line in s.requantized:
        print(line)
    if s.skipped:
        print(f"skipped {len(s.skipped)} checkpoint tensors not used by inference:")
        reasons: dict[str, list[str]] = {}
        for name, reason in s.skipped.items():
            reasons.setdefault(reason, []).append(name)
        for reason, names in reasons.items():
            shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
            print(f"  {len(names)} x {reason}: {shown}")
    return EXIT_OK


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="geometry, formats, sizes and shard files of a model")
    p.add_argument("model", help="model directory")
    p.add_argument("--verify", action="store_true", help="recompute every checksum")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args) -> int:
    from moeshard.moe.model.report import describe

    text, ok = describe(args.model, args.verify)
    print(text)
    if not ok:
        print("moeshard: error: checksum verification failed", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def add_synth(sub) -> None:
    help = "write a large random-weight model (streaming benchmarks)"
    sub.add_parser("synth", help=help, fill=_synth_arguments)


def _synth_arguments(p) -> None:
    """(Filled when `synth` is used: its presets come from moe.convert.synth.)"""
    from moeshard.moe.convert.synth import ALL_PRESETS

    p.add_argument("out", help="model directory to create")
    p.add_argument(
        "--preset",
        choices=ALL_PRESETS,
        default="k3-mini",
        help="geometry (moe/convert/synth.py, synth_k3.py, synth_gpt_oss.py, "
        "model/qwen3_next_shapes.py): k3, k3-mini and k3-full are Kimi K3 (LatentMoE, MXFP4 "
        "experts); gpt-oss-20b and gpt-oss-120b are OpenAI's (MXFP4 experts with biases; "
        "--layers scales them); glm-4.6, glm-4.5-air are GLM's; qwen3.6-35b-a3b and "
        "qwen3-next-80b-a3b are those models at their published shapes; k3-shaped and tiny "
        "are Qwen3-MoE",
    )
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="K3 presets: write a checkpoint in Kimi K3's released layout (safetensors, "
        "nested config, MXFP4 experts, tiktoken) for `moeshard convert`, not a model directory",
    )
    for flag, what in (
        ("--layers", "layers (gpt-oss presets too)"),
        ("--experts", "routed experts per layer"),
        ("--top-k", "experts per token"),
        ("--hidden", "hidden size"),
        ("--latent", "latent (routed expert) width, a multiple of 32"),
        ("--inter", "expert intermediate size, a multiple of 32"),
    ):
        p.add_argument(flag, type=int, metavar="N", help=f"K3 presets: {what}")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it is an earlier model directory or empty, never anything else",
    )
    p.set_defaults(func=cmd_synth)


def cmd_synth(args) -> int:
    from moeshard.moe.convert.synth import synth

    sizes = {"layers": args.layers, "n_experts": args.experts, "top_k": args.top_k}
    sizes |= {"hidden": args.hidden, "latent": args.latent, "inter": args.inter}
    s = synth(args.out, args.preset, args.force, args.seed, args.checkpoint, **sizes)
    made = "checkpoint (convert it)" if s["id"] is None else f"model id {s['id'][:16]}"
    print(
        f"synth {args.preset} -> {args.out}: {s['bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s "
        f"({s['gb_per_s']:.2f} GB/s); {made}"
    )
    return EXIT_OK


def add_quality(sub) -> None:
    p = sub.add_parser(
        "quality", help="top-1 agreement and KL of quantised formats against f32 (on a checkpoint)"
    )
    p.add_argument("src", help="Hugging Face checkpoint directory")
    p.add_argument("--experts", default="q4_0,q8_0,bf16", help="expert formats to compare")
    p.add_argument("--trunk", default="f32", help="trunk formats to compare (comma-separated)")
    p.add_argument("--prompt-ids", action="append", help="a prompt as ids (repeatable)")
    p.add_argument("--prompt", action="append", help="a prompt as text (repeatable)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument(
        "--activations",
        default="q8,f32",
        help="how q4_0/q8_0 kernels take activations, compared (q8: 8-bit, what generate uses; "
        "f32: float)",
    )
    p.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="FILE",
        help="also the same model as this llama.cpp GGUF file holds it (repeatable): experts "
        "of a type moeshard has run in it, others and the trunk decoded exactly to f32",
    )
    p.set_defaults(func=cmd_quality)


def _checkpoint_dir(src: str, command: str) -> None:
    """`quality` and `perplexity` convert a Hugging Face checkpoint themselves: a moeshard
    directory given instead is refused in one line that names the checkpoint to give (a
    coordinator directory's line also says it holds no expert records)."""
    from moeshard.moe.model.model_dir import ModelDir
    from moeshard.moe.storage.manifest import MANIFEST

    if not (Path(src) / MANIFEST).is_file():
        return
    model = ModelDir(src)
    try:
        source = model.manifest.get("converted_from") or "the checkpoint it was converted from"
        remedy = f"{command} reads a Hugging Face checkpoint: give {source}"
        model.require_experts(remedy)
        raise MoeshardError(f"{src}: a moeshard model directory; {remedy}")
    finally:
        model.close()


def cmd_quality(args) -> int:
    from moeshard.coordinator import tokenizer
    from moeshard.coordinator.quality import compare_formats
    from moeshard.moe.kernels import quant

    _checkpoint_dir(args.src, "quality")
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids or []]
    if args.prompt:
        tok = tokenizer.load(Path(args.src))
        if tok is None:
            raise MoeshardError(f"{args.src}: no {tokenizer.TOKENIZER_FILES} for --prompt")
        prompts += [tok.encode(p) for p in args.prompt]
    if not prompts:
        raise MoeshardError("give at least one --prompt or --prompt-ids")
    modes = tuple(args.activations.split(","))
    unknown = [m for m in modes if m not in quant.ACTIVATIONS]
    if unknown:
        raise MoeshardError(f"--activations: unknown {unknown}; expected {quant.ACTIVATIONS}")
    for path in args.gguf:
        if not Path(path).is_file():
            raise MoeshardError(f"--gguf {path}: no such file")
    rows = compare_formats(
        args.src, prompts, args.tokens, args.experts.split(","), args.trunk.split(","), modes,
        tuple(Path(p) for p in args.gguf),
    )  # fmt: skip
    print(f"reference: f32 experts and trunk, {len(prompts)} prompts x {args.tokens} greedy tokens")
    wide = max([8] + [len(r.experts) for r in rows])
    trunk = max([6] + [len(r.trunk) for r in rows])
    print(
        f"{'experts':>{wide}} {'trunk':>{trunk}} {'activations':>11} {'positions':>9} "
        f"{'top-1 agree':>11} {'mean KL':>10} {'max KL':>10}"
    )
    for r in rows:
        print(
            f"{r.experts:>{wide}} {r.trunk:>{trunk}} {r.activations:>11} {r.positions:>9} "
            f"{r.top1_agreement:>11.2%} {r.mean_kl:>10.2e} {r.max_kl:>10.2e}"
        )
    return EXIT_OK


def add_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text under each expert format")
    p.add_argument("src", help="Hugging Face checkpoint directory (with tokenizer.json)")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--experts", default="f32,q4_0", help="expert formats (comma-separated)")
    p.add_argument("--trunk", default="f32", help="trunk format")
    p.add_argument("--window", type=int, default=256, help="tokens per evaluation window")
    p.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many (0: all)")
    p.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args) -> int:
    from moeshard.coordinator.quality import perplexity_by_format

    _checkpoint_dir(args.src, "perplexity")
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MoeshardError(f"{args.text}: cannot read text ({exc})") from None
    n, results = perplexity_by_format(
        args.src, text, args.experts.split(","), args.trunk, args.window, args.max_tokens
    )
    print(f"{n} tokens of {args.text}, windows of {args.window}, trunk {args.trunk}")
    for fmt, ppl in results.items():
        print(f"  experts {fmt:>5}: perplexity {ppl:.3f}")
    return EXIT_OK
