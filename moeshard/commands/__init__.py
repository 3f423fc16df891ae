"""The `moeshard` subcommands, one module per area; `moeshard.cli` assembles the parser.

Each module has `add_<command>(subparsers)` functions that register a subcommand with its
`cmd_<command>(args) -> exit code` handler. Exit codes: 0 ok, 1 internal error (or a failed
health check, or a node failing `audit`), 2 bad input (any `MoeshardError`, printed as one
line; also a ledger that does not verify, or a fraud proof that proves nothing), 3 the cluster
does not cover the model (`cluster`: some expert has no live node; `generate`: a layer no live
node can compute, audits that did not finish, or a caught lie further back than a recurrent
state can be undone, the tokens so far still printed), or a node cannot be audited (`audit`),
130 interrupted (SIGINT), 143
terminated (SIGTERM; `generate` prints the tokens so far in both cases).
"""

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_UNCOVERED = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


def configure_process(args) -> None:
    """What a moeshard process sets up before its command runs (also the engine process
    `serve` starts): logging, BLAS's helper threads, the kernels' threads (--threads)."""
    import logging
    import os
    import sys

    from moeshard.moe.errors import MoeshardError

    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # see moe/kernels/blas.py: small products stall on busy BLAS helpers.  Before numpy is
    # imported the variable does it (and a command that needs no numpy does not import it)
    if "numpy" in sys.modules:
        from moeshard.moe.kernels.blas import limit_blas_threads

        limit_blas_threads(1)
    else:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    threads = getattr(args, "threads", None)
    if threads is not None:
        from moeshard.moe.kernels import quant

        try:
            quant.set_threads(threads)
        except ValueError as exc:
            raise MoeshardError(f"--threads: {exc}") from None
