"""The `moeshard` command line. Exit codes: 0 ok, 1 internal error, 2 bad input, 130 interrupted."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from moe.errors import MoeshardError

log = logging.getLogger("moeshard")

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def _add_convert(sub) -> None:
    from moe.convert import (
        DEFAULT_EXPERT_FORMAT,
        DEFAULT_TRUNK_FORMAT,
        EXPERT_FORMATS,
        TRUNK_FORMATS,
    )

    p = sub.add_parser("convert", help="Hugging Face checkpoint directory -> model directory")
    p.add_argument("src", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("out", help="model directory to create")
    p.add_argument("--experts", choices=EXPERT_FORMATS, default=DEFAULT_EXPERT_FORMAT)
    p.add_argument("--trunk", choices=TRUNK_FORMATS, default=DEFAULT_TRUNK_FORMAT)
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    from moe.convert import convert

    s = convert(args.src, args.out, args.experts, args.trunk, args.force, not args.quiet)
    print(
        f"converted {args.src} -> {args.out}: {s.params / 1e6:.2f} M params "
        f"(trunk {s.trunk_params / 1e6:.2f} M, experts {s.expert_params / 1e6:.2f} M), "
        f"{s.bytes_written / 1e6:.1f} MB written in {s.seconds:.2f} s; model id {s.model_id[:16]}"
    )
    if s.skipped:
        print(f"skipped {len(s.skipped)} checkpoint tensors not used by inference:")
        reasons: dict[str, list[str]] = {}
        for name, reason in s.skipped.items():
            reasons.setdefault(reason, []).append(name)
        for reason, names in reasons.items():
            shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
            print(f"  {len(names)} x {reason}: {shown}")
    return EXIT_OK


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("model", help="model directory (from `moeshard convert`)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--dump-logits", metavar="FILE.npy", help="save float32 [tokens, vocab]")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from coordinator.generate import SamplingOptions, generate
    from coordinator.runtime import open_local

    if args.max_tokens < 1:
        raise MoeshardError("--max-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise MoeshardError("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    rt = open_local(args.model)
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise MoeshardError(
                f"--prompt-ids: not a comma-separated list: {args.prompt_ids}"
            ) from None
        bad = [t for t in prompt_ids if not 0 <= t < rt.config.vocab_size]
        if bad:
            raise MoeshardError(f"--prompt-ids: {bad[0]} is outside the vocabulary")
    else:
        prompt_ids = rt.encode(args.prompt)
    opts = SamplingOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_ids=tuple(rt.eos_ids),
        keep_logits=bool(args.dump_logits),
    )
    stream = None if args.json else rt.text_streamer(sys.stdout)
    result = generate(rt.transformer, prompt_ids, opts, stream)
    if stream:
        stream.finish()
    stats = rt.stats(result)
    if args.dump_logits:
        np.save(args.dump_logits, np.stack(result.logits).astype(np.float32))
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_ids": result.prompt_ids,
                    "tokens": result.tokens,
                    "text": rt.decode(result.tokens),
                    "stats": stats,
                }
            )
        )
    else:
        print(
            f"[{len(result.prompt_ids)} prompt tokens, prefill {stats['prefill_s']:.3f} s; "
            f"{len(result.tokens)} tokens at {stats['decode_s_per_token']:.4f} s/token "
            f"({stats['tokens_per_s']:.1f} tok/s); experts read "
            f"{stats['expert_bytes_read'] / 1e6:.1f} MB; start-up {stats['startup_s']:.2f} s "
            f"(JIT warm-up {stats['jit_warmup_s']:.2f} s); stop: {result.stopped_by}]",
            file=sys.stderr,
        )
    return EXIT_OK


def _add_node(sub) -> None:
    p = sub.add_parser("node", help="serve a model or shard directory's experts over gRPC")
    p.add_argument("path", help="model directory or shard directory (from `moeshard shard`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=0, help="port (0: any free port, printed)")
    p.add_argument("--ram", default="0", help="expert cache budget, e.g. 8G (0: unbounded)")
    p.add_argument("--node-id", default="", help="node name (default hostname-port)")
    p.add_argument("--no-advertise", action="store_true", help="do not announce via zeroconf")
    p.add_argument("--no-verify", action="store_true", help="skip the start-up checksum pass")
    p.set_defaults(func=cmd_node)


def cmd_node(args) -> int:
    from node.daemon import NodeConfig, parse_size, run

    config = NodeConfig(
        path=args.path,
        host=args.host,
        port=args.port,
        ram=parse_size(args.ram),
        advertise=not args.no_advertise,
        node_id=args.node_id,
        verify=not args.no_verify,
    )
    return run(config, sys.stdout)


def _add_shard(sub) -> None:
    p = sub.add_parser("shard", help="split a model's experts into per-node shard directories")
    p.add_argument("model", help="model directory")
    p.add_argument("--nodes", type=int, required=True, help="number of node directories")
    p.add_argument("--replicas", type=int, default=2, help="copies of every expert")
    p.add_argument("--trace", help='activation counts, JSON {"layer:expert": count}')
    p.add_argument("--out", required=True, help="directory to create (node-00, node-01, ...)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=cmd_shard)


def cmd_shard(args) -> int:
    from coordinator.placement import shard_model

    plan = shard_model(args.model, args.nodes, args.replicas, args.out, args.trace, args.force)
    for node in plan["nodes"]:
        print(
            f"{node['dir']}: {len(node['experts'])} experts, expected load "
            f"{node['load']:.3f}, {node['bytes'] / 1e6:.1f} MB"
        )
    print(f"plan written to {plan['plan_file']}")
    return EXIT_OK


def _add_health(sub) -> None:
    p = sub.add_parser("health", help="grpc.health.v1 check of a node (exit 0 if SERVING)")
    p.add_argument("addr", help="HOST:PORT")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    p.set_defaults(func=cmd_health)


def cmd_health(args) -> int:
    from coordinator.remote import check_health

    status = check_health(args.addr, args.timeout)
    print(f"{args.addr}: {status}")
    return EXIT_OK if status == "SERVING" else EXIT_INTERNAL


def _add_cluster(sub) -> None:
    p = sub.add_parser("cluster", help="live nodes, what they hold, coverage, latency")
    p.add_argument("model", help="the coordinator's model directory")
    _add_peer_options(p, required=True)
    p.set_defaults(func=cmd_cluster)


def _add_peer_options(p, required: bool) -> None:
    peers = p.add_mutually_exclusive_group(required=required)
    peers.add_argument("--peers", help="experts on remote nodes: HOST:PORT,HOST:PORT,...")
    peers.add_argument("--discover", action="store_true", help="find nodes with zeroconf")
    p.add_argument("--discover-timeout", type=float, default=2.0, help="seconds to browse")


def cmd_cluster(args) -> int:
    from coordinator.remote import describe_cluster
    from coordinator.runtime import resolve_peers
    from moe.model import ModelDir

    model = ModelDir(args.model)
    peers = resolve_peers(model.model_id, args.peers, args.discover, args.discover_timeout)
    print(describe_cluster(model, peers))
    return EXIT_OK


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="geometry, formats, sizes and shard files of a model")
    p.add_argument("model", help="model directory")
    p.add_argument("--verify", action="store_true", help="recompute every checksum")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args) -> int:
    from moe.inspect import describe

    text, ok = describe(args.model, args.verify)
    print(text)
    if not ok:
        print("moeshard: error: checksum verification failed", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def _add_quality(sub) -> None:
    p = sub.add_parser(
        "quality", help="top-1 agreement and KL of quantised formats against f32 (on a checkpoint)"
    )
    p.add_argument("src", help="Hugging Face checkpoint directory")
    p.add_argument("--experts", default="q4_0,q8_0,bf16", help="expert formats to compare")
    p.add_argument("--trunk", default="f32", help="trunk formats to compare (comma-separated)")
    p.add_argument("--prompt-ids", action="append", help="a prompt as ids (repeatable)")
    p.add_argument("--prompt", action="append", help="a prompt as text (repeatable)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.set_defaults(func=cmd_quality)


def cmd_quality(args) -> int:
    from tokenizers import Tokenizer

    from moe.quality import compare_formats

    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids or []]
    if args.prompt:
        tokenizer = Tokenizer.from_file(str(Path(args.src) / "tokenizer.json"))
        prompts += [tokenizer.encode(p).ids for p in args.prompt]
    if not prompts:
        raise MoeshardError("give at least one --prompt or --prompt-ids")
    rows = compare_formats(
        args.src, prompts, args.tokens, args.experts.split(","), args.trunk.split(",")
    )
    print(f"reference: f32 experts and trunk, {len(prompts)} prompts x {args.tokens} greedy tokens")
    print(
        f"{'experts':>8} {'trunk':>6} {'positions':>9} {'top-1 agree':>11} {'mean KL':>10} "
        f"{'max KL':>10}"
    )
    for r in rows:
        print(
            f"{r.experts:>8} {r.trunk:>6} {r.positions:>9} {r.top1_agreement:>11.2%} "
            f"{r.mean_kl:>10.2e} {r.max_kl:>10.2e}"
        )
    return EXIT_OK


def _add_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text under each expert format")
    p.add_argument("src", help="Hugging Face checkpoint directory (with tokenizer.json)")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--experts", default="f32,q4_0", help="expert formats (comma-separated)")
    p.add_argument("--trunk", default="f32", help="trunk format")
    p.add_argument("--window", type=int, default=256, help="tokens per evaluation window")
    p.add_argument("--max-tokens", type=int, default=20000, help="evaluate at most this many")
    p.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args) -> int:
    from moe.quality import perplexity_by_format

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


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print ratios against same-run baselines")
    benches = p.add_subparsers(dest="bench", required=True)
    k = benches.add_parser("kernels", help="Q4_0/Q8_0 matmul GB/s vs DRAM bandwidth")
    k.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    k.set_defaults(func=lambda a: _run_module_main("moe.bench_kernels", a.rest))


def _run_module_main(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeshard", description="Run mixture-of-experts models larger than RAM."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_convert(sub)
    _add_generate(sub)
    _add_inspect(sub)
    _add_quality(sub)
    _add_perplexity(sub)
    _add_bench(sub)
    _add_node(sub)
    _add_shard(sub)
    _add_health(sub)
    _add_cluster(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except MoeshardError as exc:
        print(f"moeshard: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("moeshard: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
