"""The `moeshard` command line. Exit codes: 0 ok, 1 internal error (or a failed check: health,
a node failing `audit`), 2 bad input (a ledger that does not verify too), 3 cluster incomplete
(`cluster`) or a node that cannot be audited (`audit`), 130 interrupted.

The subcommands live in `coordinator.commands` (one module per area); this module assembles
the parser and maps errors to exit codes."""

from __future__ import annotations

import argparse
import logging
import sys

from coordinator.commands import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    audit,
    generate,
    ledger,
    models,
    network,
    traces,
)
from moe.errors import MoeshardError


def _add_bench(sub) -> None:
    from coordinator.bench import audit as audit_bench
    from coordinator.bench import disk, kernels, modes, rpc, stream

    p = sub.add_parser("bench", help="benchmarks that print ratios against same-run baselines")
    benches = p.add_subparsers(dest="bench", required=True)
    for name, module, text in [
        ("kernels", kernels, "Q4_0/Q8_0 matmul GB/s vs DRAM bandwidth"),
        ("rpc", rpc, "gRPC round trips, per-layer fan-out, tok/s on 1..N nodes"),
        ("cluster", rpc, "the same as `bench rpc` (the issue's name for it)"),
        ("disk", disk, "O_DIRECT read GB/s by read size and queue depth"),
        ("stream", stream, "streaming s/token per cache policy vs the disk floor"),
        ("modes", modes, "in-RAM default vs --ram streaming, tok/s side by side"),
        ("audit", audit_bench, "spot checks: liar detection vs theory, false bans, cost in tok/s"),
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
    models.add_convert(sub)
    generate.add_generate(sub)
    models.add_inspect(sub)
    traces.add_coact(sub)
    traces.add_merge_traces(sub)
    traces.add_pack(sub)
    traces.add_simulate(sub)
    models.add_quality(sub)
    models.add_perplexity(sub)
    _add_bench(sub)
    models.add_synth(sub)
    network.add_node(sub)
    network.add_keys(sub)
    network.add_shard(sub)
    network.add_health(sub)
    network.add_cluster(sub)
    audit.add_audit(sub)
    ledger.add_ledger(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from moe.kernels.blas import limit_blas_threads

    limit_blas_threads(
        1
    )  # see moe/kernels/blas.py: small products stall on busy BLAS helper threads
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
