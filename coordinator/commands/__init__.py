"""The `moeshard` subcommands, one module per area; `coordinator.cli` assembles the parser.

Each module has `add_<command>(subparsers)` functions that register a subcommand with its
`cmd_<command>(args) -> exit code` handler. Exit codes: 0 ok, 1 internal error (or a failed
health check, or a node failing `audit`), 2 bad input (any `MoeshardError`, printed as one
line; also a ledger that does not verify), 3 the cluster does not cover the model (`cluster`:
some expert has no live node; `generate`: a layer no live node can compute, the tokens so far
still printed), or a node cannot be audited (`audit`), 130 interrupted (SIGINT), 143
terminated (SIGTERM; `generate` prints the tokens so far in both cases).
"""

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_UNCOVERED = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
