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
    p.add_argument(
        "--trace", metavar="FILE.npz", help="record every routing decision (see moe/trace.py)"
    )
    _add_peer_options(p, required=False)
    p.add_argument("--degrade", action="store_true", help="drop experts no live node holds")
    p.add_argument("--wire-dtype", choices=("f32", "bf16"), default="f32", help="activations")
    p.add_argument("--deadline", type=float, default=5.0, help="seconds per node call")
    _add_streaming_options(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from coordinator.generate import SamplingOptions, generate
    from coordinator.runtime import open_local

    if args.max_tokens < 1:
        raise MoeshardError("--max-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise MoeshardError("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    if args.peers or args.discover:
        from coordinator.remote import RemoteConfig

        if args.ram:
            raise MoeshardError("--ram is for single-node mode; give each node its own --ram")
        from coordinator.runtime import open_remote

        remote = RemoteConfig(
            deadline_s=args.deadline, wire_dtype=args.wire_dtype, degrade=args.degrade
        )
        rt = open_remote(args.model, args.peers, args.discover, args.discover_timeout, remote)
    else:
        rt = _open_streaming(args) if args.ram else open_local(args.model)
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
    recorder = None
    if args.trace:
        from moe.trace import TraceRecorder

        recorder = TraceRecorder(rt.transformer.experts, trace_meta(rt))
        rt.transformer.experts = recorder
    stream = None if args.json else rt.text_streamer(sys.stdout)
    monitor = None
    if args.ram:
        from coordinator.stream_monitor import StreamMonitor

        print(rt.experts.plan.describe(), file=sys.stderr)
        monitor = StreamMonitor(rt.experts, stream, args.stats_json)
        monitor.start(len(prompt_ids))
    result = generate(rt.transformer, prompt_ids, opts, monitor or stream)
    if recorder:
        recorder.trace().save(args.trace)
    if stream:
        stream.finish()
    stats = rt.stats(result)
    if monitor:
        monitor.finish(stats)
        _report_streaming(args, rt, stats)
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
    if hasattr(rt.experts, "summary"):
        _report_remote(rt.experts.summary(), len(result.tokens))
        rt.experts.close()
    return EXIT_OK


def _report_remote(summary: dict, tokens: int) -> None:
    nodes = ", ".join(
        f"{n['node_id'] or n['addr']} {n['calls']} calls {n['ewma_ms']:.2f} ms"
        + ("" if n["up"] else " DOWN")
        for n in summary["nodes"]
    )
    wire = (summary["bytes_sent"] + summary["bytes_received"]) / max(tokens, 1)
    print(
        f"[nodes: {nodes}; {summary['retries']} retried layer calls; "
        f"{wire / 1e3:.1f} KB on the wire per token]",
        file=sys.stderr,
    )
    if summary["dropped"]:
        total = sum(summary["dropped"].values())
        print(f"[--degrade: dropped {total} expert slots: {summary['dropped']}]", file=sys.stderr)


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
    from moe.budget import parse_size
    from node.daemon import NodeConfig, run

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
    p.add_argument(
        "--trace", help="usage to balance by: a trace (.npz), a --profile-out JSON, or {'L:E': n}"
    )
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


def trace_meta(rt) -> dict:
    c = rt.config
    return {
        "model_id": rt.model.model_id,
        "model_type": c.model_type,
        "n_experts": c.n_experts,
        "top_k": c.top_k,
        "moe_layers": list(c.moe_layers),
        "hidden_size": c.hidden_size,
        "expert_intermediate": c.expert_intermediate,
    }


def _add_coact(sub) -> None:
    p = sub.add_parser("coact", help="expert frequencies, co-activation, reuse, cache hit rates")
    p.add_argument("traces", nargs="+", help="trace files from `generate --trace` (merged)")
    p.add_argument("--out", required=True, help="directory for coact.json and PNG plots")
    p.add_argument(
        "--cache-sizes",
        metavar="N,N,...",
        help="cache sizes in expert records for the hit-rate table (default: 2%%-50%% of all)",
    )
    p.set_defaults(func=cmd_coact)
    m = sub.add_parser("merge-traces", help="merge traces of several runs into one file")
    m.add_argument("out", help="merged trace file (.npz)")
    m.add_argument("traces", nargs="+", help="trace files")
    m.set_defaults(func=cmd_merge_traces)


def _add_pack(sub) -> None:
    p = sub.add_parser("pack", help="rewrite the expert layout so co-firing experts are adjacent")
    p.add_argument("model", help="model directory")
    p.add_argument("--trace", nargs="+", required=True, help="trace file(s) of this model")
    p.add_argument("--out", help="write a new directory instead of rewriting MODEL in place")
    p.set_defaults(func=cmd_pack)


def cmd_pack(args) -> int:
    from moe import pack, trace

    merged = trace.merge([trace.load(p) for p in args.trace])
    out = pack.pack(args.model, merged, args.out)
    manifest = json.loads((out / "moeshard.json").read_text())
    order = {int(k): v for k, v in manifest["layout"]["order"].items()}
    gain = pack.adjacency_gain(merged, order)
    print(
        f"packed {out}: reads per (token, layer) on the trace: "
        f"{gain['reads_per_layer_file_order']:.2f} in file order -> "
        f"{gain['reads_per_layer_packed']:.2f} packed (adjacent records merged)"
    )
    return EXIT_OK


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="replay a trace against policies and a disk model")
    p.add_argument("traces", nargs="+", help="trace file(s) (with --validate: the prompt ids)")
    p.add_argument("--geometry", default="k3", help="k3, k2, or a model directory")
    p.add_argument("--ram", default="8G", help="RAM budget, e.g. 8G")
    p.add_argument("--disk", default="this-machine", help="this-machine, pcie4-nvme or a JSON file")
    p.add_argument("--depth", type=int, default=8, help="reads in flight")
    p.add_argument("--kernel-gbps", type=float, default=7.0, help="expert kernel throughput")
    p.add_argument("--memory-gbps", type=float, default=20.0, help="trunk compute bandwidth")
    p.add_argument("--prefetch-recall", type=float, default=0.8, help="share of misses predicted")
    p.add_argument(
        "--validate", metavar="MODEL", help="run MODEL for real and print measured vs simulated"
    )
    p.add_argument("--policy", default="lru", help="with --validate: cache policy")
    p.add_argument("--prefetch", action="store_true", help="with --validate: prefetch on")
    p.add_argument("--tokens", type=int, default=48, help="with --validate: decode tokens")
    p.add_argument(
        "--repeat", type=int, default=3, help="with --validate: real runs (median), disk between"
    )
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> int:
    from moe import simulate, trace
    from moe.budget import parse_size

    if args.validate:
        from coordinator import sim_validate

        if args.repeat < 1:
            raise MoeshardError("--repeat must be at least 1")

        prompt = [int(t) for t in args.traces[0].split(",")]
        runs, predictions, seen, _ = sim_validate.validate(
            args.validate,
            parse_size(args.ram),
            args.policy,
            args.prefetch,
            args.tokens,
            prompt,
            args.repeat,
        )
        print(
            f"{args.validate}, --ram {args.ram}, policy {args.policy}, prefetch "
            f"{'on' if args.prefetch else 'off'}, {args.tokens} tokens after prompt {prompt}"
        )
        print(sim_validate.report(runs, predictions, seen))
        return EXIT_OK

    merged = trace.merge([trace.load(p) for p in args.traces])
    geometry = simulate.geometry_of(args.geometry)
    ram = parse_size(args.ram)
    disk = simulate.Disk.load(args.disk)
    results = simulate.run_all(
        merged,
        geometry,
        ram,
        disk,
        depth=args.depth,
        kernel_gbps=args.kernel_gbps,
        memory_gbps=args.memory_gbps,
        prefetch_recall=args.prefetch_recall,
    )
    print(simulate.table(results, geometry, ram, args.disk))
    return EXIT_OK


def cmd_coact(args) -> int:
    from moe import coact, trace

    sizes = None
    if args.cache_sizes:
        try:
            sizes = [int(v) for v in args.cache_sizes.split(",")]
        except ValueError:
            sizes = [0]
        if min(sizes) < 1:
            raise MoeshardError(f"--cache-sizes wants positive integers, got {args.cache_sizes!r}")
    merged = trace.merge([trace.load(p) for p in args.traces])
    result, plots = coact.run(merged, Path(args.out), sizes)
    print(coact.summary(result))
    print(f"wrote {Path(args.out) / 'coact.json'} and {len(plots)} plots")
    return EXIT_OK


def cmd_merge_traces(args) -> int:
    from moe import trace

    merged = trace.merge([trace.load(p) for p in args.traces])
    merged.save(args.out)
    print(f"{args.out}: {len(merged.layer)} rows from {merged.meta['runs']} runs")
    return EXIT_OK


def _add_streaming_options(p) -> None:
    from node.expert_store import POLICIES

    g = p.add_argument_group("single-node streaming (a hard RAM budget)")
    g.add_argument("--ram", metavar="SIZE", help="RAM budget, e.g. 8G or 512M (enables streaming)")
    g.add_argument("--cache-policy", choices=POLICIES, default="lru", help="expert cache policy")
    g.add_argument("--no-prefetch", action="store_true", help="no next-layer expert prefetch")
    g.add_argument(
        "--prefetch-top",
        type=int,
        metavar="N",
        help="prefetch only each token's N highest-scoring predicted experts (default: all k)",
    )
    g.add_argument("--read-depth", type=int, default=4, help="O_DIRECT reads in flight")
    g.add_argument("--context", type=int, help="KV tokens to plan for (default: prompt + max)")
    g.add_argument("--profile-out", metavar="FILE", help="write expert usage counts (JSON)")
    g.add_argument("--profile-in", metavar="FILE", help="usage counts for --cache-policy pin")
    g.add_argument("--stats-json", metavar="FILE", help="one JSON line of stats per token")


def _open_streaming(args):
    from coordinator.runtime import open_streaming
    from moe.budget import parse_size
    from moe.model import ModelDir
    from node.expert_store import read_profile

    if args.read_depth < 1:
        raise MoeshardError("--read-depth must be at least 1")
    prompt = len(args.prompt_ids.split(",")) if args.prompt_ids else len(args.prompt.encode())
    context = args.context or prompt + args.max_tokens
    profile = None
    if args.profile_in:
        profile = read_profile(args.profile_in, ModelDir(args.model).model_id)
    return open_streaming(
        args.model,
        parse_size(args.ram),
        context,
        policy=args.cache_policy,
        prefetch=not args.no_prefetch,
        prefetch_top=args.prefetch_top,
        depth=args.read_depth,
        profile=profile,
        prefill_tokens=prompt,
    )


def _report_streaming(args, rt, stats: dict) -> None:
    from moe.budget import fmt_bytes
    from node.expert_store import write_profile

    if args.profile_out:
        write_profile(args.profile_out, rt.model.model_id, rt.experts.counts)
    n = max(stats["generated_tokens"], 1)
    print(
        f"[streaming: {args.cache_policy}, prefetch {'off' if args.no_prefetch else 'on'}; "
        f"{stats['store_bytes_read'] / 1e9 / n:.3f} GB read/token, "
        f"hit rate {stats['store_hit_rate']:.1%}, stall {stats['store_stall_s']:.2f} s, "
        f"read {stats['store_read_s']:.2f} s, compute {stats['store_compute_s']:.2f} s, "
        f"prefetch recall {stats['store_prefetch_recall']:.1%} "
        f"precision {stats['store_prefetch_precision']:.1%}; peak RSS "
        f"{fmt_bytes(stats['peak_rss_bytes'])} (budget {fmt_bytes(stats['ram_budget_bytes'])} "
        f"+ interpreter {fmt_bytes(stats['interpreter_overhead_bytes'])})]",
        file=sys.stderr,
    )


def _add_synth(sub) -> None:
    from moe.synth import PRESETS

    p = sub.add_parser("synth", help="write a large random-weight model (streaming benchmarks)")
    p.add_argument("out", help="model directory to create")
    p.add_argument("--preset", choices=sorted(PRESETS), default="k3-mini")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=cmd_synth)


def cmd_synth(args) -> int:
    from moe.synth import synth

    s = synth(args.out, args.preset, args.force, args.seed)
    print(
        f"synth {args.preset} -> {args.out}: {s['bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s "
        f"({s['gb_per_s']:.2f} GB/s); model id {s['id'][:16]}"
    )
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
    p.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many (0: all)")
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
    from coordinator import bench_rpc, bench_stream
    from moe import bench_disk, bench_kernels

    p = sub.add_parser("bench", help="benchmarks that print ratios against same-run baselines")
    benches = p.add_subparsers(dest="bench", required=True)
    for name, module, text in [
        ("kernels", bench_kernels, "Q4_0/Q8_0 matmul GB/s vs DRAM bandwidth"),
        ("rpc", bench_rpc, "gRPC round trips, per-layer fan-out, tok/s on 1..N nodes"),
        ("cluster", bench_rpc, "the same as `bench rpc` (the issue's name for it)"),
        ("disk", bench_disk, "O_DIRECT read GB/s by read size and queue depth"),
        ("stream", bench_stream, "streaming s/token per cache policy vs the disk floor"),
    ]:
        b = benches.add_parser(name, help=text)
        module.add_arguments(b)
        b.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeshard", description="Run mixture-of-experts models larger than RAM."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_convert(sub)
    _add_generate(sub)
    _add_inspect(sub)
    _add_coact(sub)
    _add_pack(sub)
    _add_simulate(sub)
    _add_quality(sub)
    _add_perplexity(sub)
    _add_bench(sub)
    _add_synth(sub)
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
    from moe.blas import limit_blas_threads

    limit_blas_threads(1)  # see moe/blas.py: small products stall on busy BLAS helper threads
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
