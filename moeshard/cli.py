"""The `moeshard` command line. Exit codes: 0 ok, 1 internal error (or a failed check: health,
a node failing `audit`), 2 bad input (a ledger that does not verify too), 3 cluster incomplete
(`cluster`), a node that cannot be audited (`audit`) or a generation the nodes cannot finish
(`generate`: no live node holds an expert), 130 interrupted (SIGINT), 143 terminated (SIGTERM).

The subcommands live in `moeshard.commands` (one module per area); this module assembles
the parser and maps errors to exit codes."""

from __future__ import annotations

import signal
import sys


def quiet_interrupt(signum, frame) -> None:
    """Ctrl-C while the program's modules are imported: one line and 130, no traceback
    (`main` gives SIGINT back to Python once the command line is read)."""
    print("moeshard: interrupted", file=sys.stderr)
    raise SystemExit(130)


_interrupt = {"swallowed": False, "handled": False}


def redeliver_interrupt(unraisable) -> None:
    """`sys.unraisablehook` for the commands: a Ctrl-C that lands in a finalizer or a ctypes
    callback (llvmlite's, while numba compiles at start-up) cannot leave it, so Python prints
    "Exception ignored ... Traceback" and carries on as if no key was pressed. It is raised
    again in the main thread instead, where `main` turns it into one line and 130; anything
    else goes to Python's own hook.  From a helper thread, a few milliseconds later: raised
    from here it would land in the hook itself (should it land in a finalizer again, this
    hook sends it once more).  Once the interrupt is reported, what finalizers still raise
    is its debris (llvmlite freeing an object whose constructor it cut short) and is not
    printed."""
    if _interrupt["handled"]:
        return
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        import threading

        _interrupt["swallowed"] = True
        later = threading.Timer(0.01, _interrupt_main)
        later.daemon = True  # (never what keeps the process alive)
        later.start()
        return
    sys.__unraisablehook__(unraisable)


def _interrupt_main() -> None:
    import _thread

    if not _interrupt["handled"]:
        _thread.interrupt_main()


def _interrupted(exc: BaseException) -> int:
    _interrupt["handled"] = True
    print("moeshard: interrupted", file=sys.stderr)
    _never_free(exc)
    return EXIT_INTERRUPTED


def _never_free(exc: BaseException) -> None:
    """Keep an interrupt's traceback, and so every local of the frames it cut short, alive to
    the process's end. A Ctrl-C inside numba's compile can stop llvmlite between handing a
    module to LLVM and recording that it did: freeing that Python object then frees LLVM's
    memory twice, a segmentation fault as `main` returns (make test, about 1 run in 5:
    "moeshard: interrupted", then exit -11). The process is ending; the leak is its price."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(exc))


if __name__ == "__main__":  # `python -m moeshard.cli` (the `moeshard` script: entry.py)
    from moeshard.moe import sigint

    sigint.install(quiet_interrupt)

import argparse  # noqa: E402
import importlib  # noqa: E402
import textwrap  # noqa: E402
from functools import partial  # noqa: E402

from moeshard.commands import (  # noqa: E402
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    audit,
    configure_process,
    generate,
    ledger,
    models,
    network,
    serve,
    traces,
)
from moeshard.moe.errors import MoeshardError, Terminated  # noqa: E402


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, except where X says nothing: flags (nargs 0:
    store_true, help), and None or "" defaults, whose help says what no value means. A help
    that places %(default)s itself is left as it is. Lines break at spaces only, never inside
    an option's name (--max-request-mb) or a value, nor between "(default:" and its value."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split()).replace("(default: ", "(default:\xa0")  # textwrap keeps it
        lines = textwrap.wrap(text, width, break_on_hyphens=False)
        return [line.replace("\xa0", " ") for line in lines]

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()),
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not _says_something(action):
            return text
        return text + " (default: %(default)s)"


def _says_something(action: argparse.Action) -> bool:
    """Whether an action's default is worth showing: not a flag's, nor None, "" or SUPPRESS (a
    positional's only if it may be left out)."""
    default = action.default
    if action.nargs == 0 or default is None or default is argparse.SUPPRESS or default == "":
        return False
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)


class _Commands(argparse._SubParsersAction):
    """Subcommands whose --help opens with the one-line help they have in their parent's list."""

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if "help" in kwargs:
            kwargs.setdefault("description", kwargs["help"])
        return super().add_parser(name, **kwargs)


class Parser(argparse.ArgumentParser):
    """The parser of `moeshard` and of every subcommand: `add_subparsers` makes its subcommands
    of the parser's own class (argparse's default), so all of them, nested ones too (`bench`,
    `ledger`), show their options' defaults without each call site asking for it.

    `fill`: a function that adds the parser's arguments, called only when the parser is used
    (parses its command's arguments, or prints its help): a benchmark's options are built by
    importing its module, which imports what it measures, and `moeshard --help` or
    `moeshard id` should not pay for that."""

    def __init__(self, *args, fill=None, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)
        self._fill = fill

    def _filled(self) -> None:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill(self)

    def parse_known_args(self, args=None, namespace=None):
        self._filled()
        if self._subparsers is None:  # a command's own options: which given ones are not
            given = sys.argv[1:] if args is None else args
            known = list(self._option_string_actions)  # (argparse takes unique prefixes too)
            self._unknown = [
                a for a in given
                if a.startswith("--") and not any(k.startswith(a.split("=")[0]) for k in known)
            ]  # fmt: skip
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        """An option the command does not have is named first (argparse would complain of a
        required option missing before it names a misspelled one: `--promt`), with the
        nearest one it has."""
        unknown = getattr(self, "_unknown", [])
        if unknown:
            import difflib

            name = unknown[0].split("=")[0]
            near = difflib.get_close_matches(name, list(self._option_string_actions), 1)
            message = f"unknown option {name}" + (f" (did you mean {near[0]}?)" if near else "")
        super().error(message)

    def format_help(self) -> str:
        self._filled()
        return super().format_help()

    def format_usage(self) -> str:
        self._filled()
        return super().format_usage()


BENCHES = [  # name, module in coordinator.bench, what it measures
    ("kernels", "kernels", "Q4_0/Q8_0 matmul GB/s vs DRAM bandwidth"),
    ("rpc", "rpc", "gRPC round trips, per-layer fan-out, tok/s on 1..N nodes"),
    ("cluster", "rpc", "the same as `bench rpc` (the issue's name for it)"),
    ("disk", "disk", "O_DIRECT read GB/s by read size and queue depth"),
    ("stream", "stream", "streaming s/token per cache policy vs the disk floor"),
    ("modes", "modes", "in-RAM default vs --ram streaming, tok/s side by side"),
    ("audit", "audit", "audits: liar detection vs theory, false convictions, cost"),
    ("attack", "attack", "strangers attack nodes and the server: what honest users keep"),
    ("compare-llamacpp", "compare_llamacpp", "moeshard vs llama.cpp built here, side by side"),
    ("serve", "serve", "the API under 1..N concurrent clients: tok/s, first token, expert cost"),
    ("swarm", "swarm", "4-16 nodes in namespaces with latency: measured vs simulated s/token"),
    ("p2p", "p2p", "an expert call through the p2p daemons (direct, relayed) vs TLS over TCP"),
]


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print ratios against same-run baselines")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH", help="what to measure")
    for name, module, text in BENCHES:
        benches.add_parser(name, help=text, fill=partial(_fill_bench, module))


def _fill_bench(module_name: str, parser: argparse.ArgumentParser) -> None:
    module = importlib.import_module(f"moeshard.bench.{module_name}")
    module.add_arguments(parser)
    add_threads(parser)
    parser.set_defaults(func=module.run)


def add_threads(p: argparse.ArgumentParser) -> None:
    """--threads N: the threads compute kernels use (0: all cores), unless p has its own."""
    if "--threads" not in p._option_string_actions:
        p.add_argument(
            "--threads", type=int, default=0, metavar="N", help="compute threads (0: all cores)"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moeshard", description="Run mixture-of-experts models larger than RAM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"moeshard {_version()}")
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="run `moeshard COMMAND -h` for its options",
    )
    models.add_convert(sub)
    generate.add_generate(sub)
    add_threads(sub.choices["generate"])
    serve.add_serve(sub)
    add_threads(sub.choices["serve"])
    models.add_inspect(sub)
    traces.add_coact(sub)
    traces.add_merge_traces(sub)
    traces.add_pack(sub)
    traces.add_simulate(sub)
    models.add_quality(sub)
    models.add_perplexity(sub)
    add_threads(sub.choices["quality"])
    add_threads(sub.choices["perplexity"])
    _add_bench(sub)
    models.add_synth(sub)
    network.add_node(sub)
    network.add_bootstrap(sub)
    add_threads(sub.choices["node"])
    network.add_keys(sub)
    network.add_shard(sub)
    network.add_health(sub)
    network.add_cluster(sub)
    audit.add_audit(sub)
    ledger.add_ledger(sub)
    return parser


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a tree not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moeshard")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("moeshard: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if signal.getsignal(signal.SIGINT) is quiet_interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the command's own handling
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = redeliver_interrupt
    _interrupt.update(swallowed=False, handled=False)  # (main may run more than once)
    try:
        configure_process(args)
        network.check_peer_options(args)
        return args.func(args)
    except MoeshardError as exc:
        print(f"moeshard: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_BAD_INPUT)
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except Terminated:
        print("moeshard: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:
        if _interrupt["swallowed"]:  # what a swallowed Ctrl-C broke (numba: "no compiled
            return _interrupted(exc)  # object yet" when it landed in llvmlite's callback)
        raise


if __name__ == "__main__":
    sys.exit(main())
