"""`moeshard generate`: local, single-node streaming (--ram) and remote (--peers/--discover)."""

from __future__ import annotations

import json
import math
import sys

from moeshard.commands import EXIT_OK
from moeshard.commands.network import add_audit_options, add_peer_options
from moeshard.coordinator.chat import chat_prompt
from moeshard.coordinator.tokenizer import TOKENIZER_FILES
from moeshard.moe.errors import MoeshardError


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("model", help="model directory (from `moeshard convert`)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    p.add_argument(
        "--chat",
        action="store_true",
        help="--prompt is a user's message: format it with the checkpoint's chat template "
        "(tokenizer_config.json's chat_template; Kimi K3's own turn format)",
    )
    p.add_argument("--system", help="with --chat: a system message before the user's")
    p.add_argument(
        "--no-thinking",
        action="store_true",
        help="with --chat: ask for the answer without a thinking section (Kimi K3; templates "
        "that read enable_thinking)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate, fewer if one ends the text"
    )
    p.add_argument(
        "--beyond-context",
        action="store_true",
        help="allow prompt + --max-tokens past the model's context (max_position_embeddings)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the likeliest tokens whose probabilities add up to p (1: all)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a new one)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--profile",
        action="store_true",
        help="time where a decode token goes (trunk, routing, experts, overhead): a table on "
        "stderr, and 'profile' in --json's stats",
    )
    p.add_argument(
        "--activations",
        choices=("q8", "f32"),
        default="q8",
        help="how q4_0/q8_0 weights meet activations: q8 quantises them to 8 bits per block "
        "and uses integer dot products, as llama.cpp does; f32 keeps them float (slower, a "
        "little closer to the f32 model: `moeshard quality` measures both). Local and --ram "
        "only: nodes compute with q8",
    )
    p.add_argument(
        "--wait",
        choices=("spin", "passive"),
        default="spin",
        help="how the kernels' idle threads wait between products: spin about 0.3 ms before "
        "sleeping (this one user's decode waits for every product: 1.5x tok/s on a 2-core "
        "VM), or sleep at once (kinder to other processes on the cores; servers and nodes "
        "always do). An OMP_WAIT_POLICY or GOMP_SPINCOUNT you set wins",
    )
    p.add_argument("--dump-logits", metavar="FILE.npy", help="save float32 [tokens, vocab]")
    p.add_argument(
        "--trace",
        metavar="FILE.npz",
        help="record every routing decision (see moe/storage/traces.py)",
    )
    add_peer_options(p, required=False)
    p.add_argument("--degrade", action="store_true", help="drop experts no live node holds")
    p.add_argument(
        "--own-experts",
        action="store_true",
        help="compute the experts no live node holds here, from this model directory's own "
        "records (a full model directory), instead of failing",
    )
    p.add_argument(
        "--wire-dtype", choices=("f32", "bf16"), default="f32", help="activations on the wire"
    )
    p.add_argument("--deadline", type=float, default=5.0, help="seconds per node call")
    add_audit_options(p)
    p.add_argument(
        "--ledger",
        metavar="FILE",
        help="hash-chained ledger of the nodes' signed receipts, audits and settlements "
        "(default: $MOESHARD_HOME/ledger/coordinator-<key id>.jsonl)",
    )
    p.add_argument(
        "--reputation",
        metavar="FILE",
        help="the nodes' reputations, kept across runs (default: $MOESHARD_HOME/reputation.sqlite)",
    )
    add_streaming_options(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from moeshard.coordinator.generate import (
        SamplingOptions,
        format_profile,
        generate,
        stop_between_steps,
    )
    from moeshard.coordinator.runtime import load_tokenizer
    from moeshard.moe.kernels import quant
    from moeshard.moe.model.model_dir import ModelDir
    from moeshard.moe.storage.budget import check_context, check_memory

    _check_sampling(args)
    if args.activations != "q8" and (args.peers or args.discover or args.bootstrap):
        raise MoeshardError(
            "--activations f32: nodes compute with 8-bit activations (q8), and the audits "
            "of their work must compute as they do; use it without --peers/--discover"
        )
    quant.use_activations(args.activations)
    if args.wait == "spin":
        quant.spin_while_waiting()
    prompt_ids = _parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    # every check that needs only the model directory runs before anything is loaded,
    # allocated or connected
    model = ModelDir(args.model)
    if not (
        args.peers or args.discover or args.bootstrap
    ):  # local or --ram: the experts are computed here
        model.require_experts()
    if (args.chat or args.system or args.no_thinking) and args.prompt is None:
        raise MoeshardError("--chat, --system and --no-thinking format a --prompt text")
    if (args.system or args.no_thinking) and not args.chat:
        raise MoeshardError("--system and --no-thinking go with --chat")
    if prompt_ids is None:
        text = args.prompt
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            text = chat_prompt(
                model.path, model.config.model_type, messages, thinking=not args.no_thinking
            )
        prompt_ids = _encode_prompt(load_tokenizer(model), text, model.path)
    bad = [t for t in prompt_ids if not 0 <= t < model.config.vocab_size]
    if bad:
        raise MoeshardError(f"--prompt-ids: {bad[0]} is outside the vocabulary")
    context = len(prompt_ids) + args.max_tokens
    check_context(model.config, len(prompt_ids), args.max_tokens, args.beyond_context)
    if args.ram and args.context is not None and args.context < context:
        raise MoeshardError(
            f"--context {args.context} is less than the prompt ({len(prompt_ids)} tokens) "
            f"+ --max-tokens {args.max_tokens}"
        )
    if not args.ram:
        check_memory(model, context, len(prompt_ids), args.peers or args.discover or args.bootstrap)
    rt, monitor, reputation = _open_runtime(args, model, len(prompt_ids), context)
    try:
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
            from moeshard.moe.experts.recorder import TraceRecorder

            recorder = TraceRecorder(rt.transformer.experts, rt.trace_meta())
            rt.transformer.experts = recorder
        stream = None if args.json else rt.text_streamer(sys.stdout)
        if monitor:
            print(rt.plan.describe(), file=sys.stderr)
            monitor.start(rt.store, stream, len(prompt_ids))
        on_forward = recorder.mark if recorder else None
        on_rollback = stream.rollback if stream else None
        with stop_between_steps():
            result = generate(
                rt.transformer,
                prompt_ids,
                opts,
                monitor or stream,
                on_forward,
                rt.verifier,
                on_rollback,
                keep_partial=True,
                profile=args.profile,
            )
        # what was made before a stop (Ctrl-C, SIGTERM, a node failure) is still written
        if recorder:
            recorder.trace(end=result.positions_done).save(args.trace)
        if stream:
            stream.finish()
        stats = rt.stats(result)
        if result.profile is not None:
            stats["profile"] = result.profile
            print(format_profile(result.profile), file=sys.stderr)
        if monitor:
            monitor.finish(stats)
            _report_streaming(args, rt, stats)
        if args.dump_logits and result.logits:
            import numpy as np

            np.save(args.dump_logits, np.stack(result.logits).astype(np.float32))
        _print_result(args, rt, result, stats)
    finally:
        rt.close()
        if reputation is not None:
            reputation.close()
    if result.error is not None:
        raise result.error  # the CLI prints it and exits with its code (130, 143, 3, 2)
    return EXIT_OK


def _check_sampling(args) -> None:
    if args.max_tokens < 1:
        raise MoeshardError("--max-tokens must be at least 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise MoeshardError(f"--temperature {args.temperature}: need a finite number >= 0")
    if not 0 < args.top_p <= 1 or args.top_k < 0:  # (NaN fails the comparison)
        raise MoeshardError("need 0 < --top-p <= 1 and --top-k >= 0")
    if (args.peers or args.discover or args.bootstrap) and args.ram:
        raise MoeshardError("--ram is for single-node mode; give each node its own --ram")
    if args.context is not None and args.context < 1:
        raise MoeshardError("--context must be at least 1")
    if args.seed is not None and args.seed < 0:
        raise MoeshardError(f"--seed {args.seed}: need a number >= 0")
    from moeshard.moe.storage.io import check_output_file

    for option in ("trace", "dump_logits", "profile_out", "stats_json"):
        if path := getattr(args, option, None):  # a bad path found at the end loses the run
            check_output_file(path, "--" + option.replace("_", "-") + " ")


def _parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MoeshardError(f"--prompt-ids: not a comma-separated list: {text}") from None
    if not ids:
        raise MoeshardError("--prompt-ids: no token ids given")
    return ids


def _encode_prompt(tokenizer, prompt: str, path) -> list[int]:
    if tokenizer is None:
        raise MoeshardError(f"{path}: no {TOKENIZER_FILES}; use --prompt-ids")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise MoeshardError("--prompt: the prompt is empty (it encodes to no tokens)")
    return ids


def _open_runtime(args, model, prompt_tokens: int, context: int):
    """The runtime of the mode the options ask for; (runtime, stream monitor, reputation)."""
    from moeshard.coordinator.runtime import open_local

    if args.peers or args.discover or args.bootstrap:
        from moeshard.commands.network import audit_settings, client_config, split_list
        from moeshard.coordinator.remote.reputation import Reputation
        from moeshard.coordinator.runtime import open_remote

        reputation = Reputation(args.reputation)
        remote = client_config(
            args,
            deadline_s=args.deadline,
            wire_dtype=args.wire_dtype,
            degrade=args.degrade,
            own_experts=args.own_experts,
            **audit_settings(args),
            ledger=args.ledger or "",
            reputation=reputation,
        )
        if args.ledger and remote.identity is None:
            reputation.close()
            raise MoeshardError(
                "--ledger needs this client's key: receipts are signed between keys"
            )
        try:
            rt = open_remote(
                model, args.peers, args.discover, args.discover_timeout, remote, args.expect,
                bootstrap=split_list(args.bootstrap),
            )  # fmt: skip
        except BaseException:
            reputation.close()
            raise
        return rt, None, reputation
    if args.ram:
        from moeshard.coordinator.stream_monitor import StreamMonitor

        monitor = StreamMonitor(args.stats_json)
        rt = _open_streaming(args, model, prompt_tokens, context, monitor.layer_done)
        return rt, monitor, None
    return open_local(model), None, None


def _error_text(error: BaseException | None) -> str | None:
    """What stopped a generation early, for --json (None when nothing did)."""
    if error is None:
        return None
    return str(error) or type(error).__name__  # (a KeyboardInterrupt has no message)


def _print_result(args, rt, result, stats: dict) -> None:
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_ids": result.prompt_ids,
                    "tokens": result.tokens,
                    "text": rt.decode(result.tokens),
                    "stopped_by": result.stopped_by,
                    "error": _error_text(result.error),
                    "degraded": stats.get("degraded", False),
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
    if args.peers or args.discover or args.bootstrap:
        _report_remote(rt.experts.stats(), len(result.tokens))


def _report_remote(summary: dict, tokens: int) -> None:
    nodes = ", ".join(
        f"{n['name'] or n['node_id'] or n['addr']} {n['calls']} calls {n['ewma_ms']:.2f} ms"
        + ("" if n["up"] else " DOWN")
        for n in summary["nodes"]
    )
    wire = (summary["bytes_sent"] + summary["bytes_received"]) / max(tokens, 1)
    print(
        f"[nodes: {nodes}; {summary['retries']} retried layer calls; "
        f"{wire / 1e3:.1f} KB on the wire per token]",
        file=sys.stderr,
    )
    accounts = summary["accounts"]
    if accounts is not None:
        flaws = (
            f", {accounts['missing']} missing, {accounts['bad']} bad" if accounts["invalid"] else ""
        )
        print(
            f"[ledger: {accounts['ledger']}: {accounts['receipts']} receipts{flaws}]",
            file=sys.stderr,
        )
    audit = summary["audit"]
    if audit is not None and (audit["picked"] or audit["convicted"]):
        print(format_audits(audit), file=sys.stderr)
    per_layer = summary["dropped_per_layer"]
    if per_layer:
        counts = ", ".join(f"layer {layer}: {n}" for layer, n in per_layer.items())
        print(
            f"[--degrade: the output is degraded: {sum(per_layer.values())} expert slots "
            f"dropped ({counts}) because no live node held them]",
            file=sys.stderr,
        )


def format_audits(audit: dict) -> str:
    """The audit line of a run with nodes: what was recomputed, where its records came from."""
    rec = audit["records"]
    caught = f"; caught lying: {', '.join(audit['convicted'])}" if audit["convicted"] else ""
    withheld = f", {audit['withheld']} withheld a record" if audit["withheld"] else ""
    pending = f", {audit['pending']} unfinished" if audit["pending"] else ""
    proofs = f"; fraud proofs: {', '.join(audit['proofs'])}" if audit["proofs"] else ""
    return (
        f"[audits: {audit['picked']} calls recomputed here, {audit['passed']} equal, "
        f"{audit['failed']} differed{withheld}{pending}; records: {rec['local']} local, "
        f"{rec['fetched']} fetched ({rec['fetched_bytes'] / 1e6:.1f} MB), {rec['hits']} "
        f"cached; {audit['cpu_s'] * 1e3:.0f} ms CPU{caught}{proofs}]"
    )


def add_streaming_options(p) -> None:
    from moeshard.moe.experts.policy import POLICIES

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


def _open_streaming(args, model, prompt_tokens: int, context: int, on_layer):
    from moeshard.coordinator.runtime import open_streaming
    from moeshard.moe.experts.usage import read_usage
    from moeshard.moe.units import parse_size

    if args.read_depth < 1:
        raise MoeshardError("--read-depth must be at least 1")
    budget = parse_size(args.ram)
    profile = read_usage(args.profile_in, model.model_id) if args.profile_in else None
    return open_streaming(
        model,
        budget,
        args.context or context,
        policy=args.cache_policy,
        prefetch=not args.no_prefetch,
        prefetch_top=args.prefetch_top,
        depth=args.read_depth,
        profile=profile,
        prefill_tokens=prompt_tokens,
        on_layer=on_layer,
    )


def _prefetch_mode(args) -> str:
    if args.no_prefetch:
        return "off"
    return f"top {args.prefetch_top}" if args.prefetch_top else "on"


def _report_streaming(args, rt, stats: dict) -> None:
    from moeshard.moe.experts.usage import write_profile
    from moeshard.moe.units import fmt_bytes

    if args.profile_out:
        write_profile(args.profile_out, rt.model.model_id, rt.store.counts)
    n = max(stats["generated_tokens"], 1)
    print(
        f"[streaming: {args.cache_policy}, prefetch {_prefetch_mode(args)}; "
        f"{stats['store_bytes_read'] / 1e9 / n:.3f} GB read/token, "
        f"hit rate {stats['store_hit_rate']:.1%}, stall {stats['store_stall_s']:.2f} s, "
        f"read {stats['store_read_s']:.2f} s, compute {stats['store_compute_s']:.2f} s, "
        f"prefetch recall {stats['store_prefetch_recall']:.1%} "
        f"precision {stats['store_prefetch_precision']:.1%}; peak RSS "
        f"{fmt_bytes(stats['peak_rss_bytes'])} (budget {fmt_bytes(stats['ram_budget_bytes'])} "
        f"+ interpreter {fmt_bytes(stats['interpreter_overhead_bytes'])})]",
        file=sys.stderr,
    )
