"""`moeshard serve MODEL`: the OpenAI-compatible API over continuous batching
(`coordinator/serve`)."""

from __future__ import annotations

import logging
import sys

from moeshard.commands import EXIT_OK
from moeshard.commands.network import add_audit_options, add_peer_options
from moeshard.moe.errors import MoeshardError

log = logging.getLogger(__name__)


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("model", help="model directory (from `moeshard convert`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--name", help="the model's name in the API (default: the directory's)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together at most")
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting beyond that (then HTTP 429)"
    )
    p.add_argument(
        "--context", type=int, default=2048, help="prompt + max_tokens a request may use"
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="prompt tokens a step reads at most, so a long prompt does not stall the other "
        "streams for its whole prefill (0: whole prompts)",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every route but the chat page (which "
        "asks for the key): /v1, /health and /metrics",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="client connections open at most (~5 KiB each; default: as many as the descriptor "
        "limit allows, up to 65536, printed at start): over it, the oldest still sending its "
        "request is closed",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a connection has to send a request's headers (slowloris)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a request has to send its body once its headers are in",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        metavar="N",
        help="characters of a prompt (or a chat's messages), checked before tokenizing "
        "(default: 32 x --context)",
    )
    p.add_argument("--ram", help="RAM budget: stream experts from SSD (e.g. 8G)")
    p.add_argument(
        "--no-eos",
        action="store_true",
        help="ignore end-of-sequence tokens: every request makes max_tokens (benchmarks)",
    )
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the batching engine in the server's own process (by default it runs in a "
        "child process, so the HTTP event loop and the engine never wait for one "
        "interpreter lock)",
    )
    add_peer_options(p, required=False)
    add_audit_options(p)
    p.set_defaults(func=cmd_serve)


def open_runtime(args):
    """The runtime `serve` puts behind its engine (in the engine's process: a child one
    unless --engine-in-process)."""
    from moeshard.commands.network import split_list
    from moeshard.coordinator.runtime import open_serving_runtime
    from moeshard.moe.model.model_dir import ModelDir
    from moeshard.moe.units import parse_size

    remote = None
    if args.peers or args.discover or args.bootstrap:
        from moeshard.commands.network import audit_settings, client_config

        remote = client_config(args, **audit_settings(args))
    return open_serving_runtime(
        ModelDir(args.model), args.ram and parse_size(args.ram), args.context * args.max_batch,
        args.peers, args.discover, args.discover_timeout, remote, args.expect,
        bootstrap=split_list(args.bootstrap),
    )  # fmt: skip


def open_runtime_in_child(args):
    """`open_runtime` in the engine's child process, set up first as the CLI sets up its
    own (logging, --threads)."""
    from moeshard.commands import configure_process

    configure_process(args)
    return open_runtime(args)


def cmd_serve(args) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise MoeshardError("serve needs uvicorn and starlette (pip install moeshard)") from None
    from moeshard.coordinator.runtime import load_tokenizer
    from moeshard.coordinator.serve.app import ServerState, create_app
    from moeshard.coordinator.serve.connections import (
        interrupts_deferred,
        listening_socket,
        serve_http,
    )
    from moeshard.coordinator.serve.engine import Engine
    from moeshard.coordinator.serve.engine_process import EngineProcess
    from moeshard.moe.model.model_dir import ModelDir

    if args.max_batch < 1 or args.max_queue < 0 or args.context < 2 or args.prefill_chunk < 0:
        raise MoeshardError(
            "--max-batch must be >= 1, --max-queue >= 0, --context >= 2, --prefill-chunk >= 0"
        )
    if (args.max_connections is not None and args.max_connections < 1) or (
        args.max_prompt_chars or 0
    ) < 0:
        raise MoeshardError("--max-connections must be >= 1, --max-prompt-chars >= 0")
    if not (args.header_timeout > 0 and args.body_timeout > 0):
        raise MoeshardError("--header-timeout and --body-timeout must be > 0")
    if args.ram and (args.peers or args.discover or args.bootstrap):
        raise MoeshardError("--ram streams experts from this machine's SSD; not with nodes")
    model = ModelDir(args.model)
    guard = _connection_guard(args)
    sock = listening_socket(args.host, args.port)  # a busy port: one line, before loading
    if not (args.peers or args.discover or args.bootstrap):
        model.require_experts("serve with --peers or --discover, or use the full model directory")
    engine_kwargs = {"max_batch": args.max_batch, "max_queue": args.max_queue}
    engine_kwargs["prefill_chunk"] = args.prefill_chunk
    if args.engine_in_process:
        rt = open_runtime(args)
        engine = Engine(rt.transformer, verifier=rt.verifier, **engine_kwargs)
        tokenizer, eos, experts, close = rt.tokenizer, rt.eos_ids, rt.experts, rt.experts.close
    else:
        engine = EngineProcess(open_runtime_in_child, _child_args(args), engine_kwargs)
        tokenizer, eos, experts = load_tokenizer(model), engine.info["eos_ids"], engine.experts
        close = _nothing
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=args.name or model.path.name,
        model_dir=model.path,
        model_type=model.config.model_type,
        context=args.context,
        eos_ids=() if args.no_eos else tuple(eos),
        api_key=args.api_key,
        experts=experts,
        max_prompt_chars=args.max_prompt_chars or 0,
        guard=guard,
    )
    port = sock.getsockname()[1]  # (--port 0: the one given)
    try:
        with interrupts_deferred() as interrupted:
            print(
                f"serving {state.model_name} on http://{args.host}:{port} (OpenAI API at /v1; "
                f"max batch {args.max_batch}, queue {args.max_queue}; connections "
                f"{guard.max_connections}, header timeout {guard.header_timeout:g} s)",
                file=sys.stderr,
                flush=True,
            )
            serve_http(create_app(state), sock, guard, interrupted)
    finally:
        engine.close()
        close()
    return EXIT_OK


def _connection_guard(args):
    """The server's connection limits, its descriptor limit raised to fit them (or the cap
    lowered, with a warning, where the hard limit does not allow it)."""
    from moeshard.coordinator.serve.connections import (
        DEFAULT_MAX_CONNECTIONS,
        ConnectionGuard,
        descriptors_for,
    )

    asked = args.max_connections or DEFAULT_MAX_CONNECTIONS
    fits = descriptors_for(asked)
    if fits < asked and args.max_connections is not None:
        log.warning(
            "--max-connections %d: the descriptor limit allows %d; using that",
            args.max_connections, fits,
        )  # fmt: skip
    return ConnectionGuard(fits, args.header_timeout, args.body_timeout)


def _child_args(args):
    """The options the engine's process needs, without `func` and the like."""
    import argparse

    keep = {k: v for k, v in vars(args).items() if not callable(v)}
    return argparse.Namespace(**keep)


def _nothing() -> None:
    pass
