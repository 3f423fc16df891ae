"""The `moeshard` console script: Ctrl-C is one line and exit 130 from the first moment, even
while the command line's modules are still being imported (`moeshard.cli.main` hands
SIGINT back to Python once the command line is read)."""

import sys

from moeshard.moe import sigint  # first: it reads the SIGINT disposition the process got


def main() -> int:
    def interrupted(signum, frame) -> None:
        print("moeshard: interrupted", file=sys.stderr)
        raise SystemExit(130)

    sigint.install(interrupted)
    from moeshard import cli

    sigint.install(cli.quiet_interrupt)  # (main() recognises it and hands back)
    return cli.main()
