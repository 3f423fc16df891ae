"""Run the README's runnable blocks top to bottom, as a reader would paste them (`make readme`).

A block is runnable when its fence says so: ```` ```sh run ```` (bash) or ```` ```python run ````.
All of them run in one bash process from the repository's root, in order, so what one block
starts or sets (a server in the background, an activated venv) the next one sees; the first
command that fails stops the run with its exit code. Background jobs left at the end are
stopped (SIGTERM to the whole process group, then SIGKILL). `MOESHARD_HOME` points at a fresh
directory, so the run makes its own client key and leaves the user's alone.

    python3 tools/run_readme.py [README.md] [--timeout 1800] [--list]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\s+run\s*$")
LANGUAGES = ("sh", "bash", "python")


def runnable_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, language, body) of every block whose fence says `run`, in order."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, language, body = i + 1, m.group(1), []
        if language not in LANGUAGES:
            raise SystemExit(f"README line {start}: runnable block in {language!r}")
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise SystemExit(f"README line {start}: the block is never closed")
        blocks.append((start, language, "\n".join(body)))
        i += 1
    return blocks


def script(blocks: list[tuple[int, str, str]]) -> str:
    """One bash script: each block announced on stderr, python blocks through `python -`
    (the venv's, once a block has activated it)."""
    parts = ["set -euo pipefail"]
    for n, (line, language, body) in enumerate(blocks, 1):
        parts.append(f"echo '==> readme: block {n} of {len(blocks)} (line {line})' >&2")
        if language == "python":
            parts.append(f"python - <<'README_PYTHON_EOF'\n{body}\nREADME_PYTHON_EOF")
        else:
            parts.append(body)
    return "\n".join(parts) + "\n"


def stop_group(pgid: int) -> None:
    """What the blocks left running (servers, nodes): SIGTERM, 15 s, then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("readme", nargs="?", default=str(ROOT / "README.md"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    p.add_argument("--list", action="store_true", help="print the script, do not run it")
    args = p.parse_args()
    blocks = runnable_blocks(Path(args.readme).read_text())
    if not blocks:
        print(f"{args.readme}: no runnable blocks", file=sys.stderr)
        return 2
    text = script(blocks)
    if args.list:
        print(text, end="")
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="readme-home-") as home:
        env = {**os.environ, "MOESHARD_HOME": home}
        proc = subprocess.Popen(["bash", "-c", text], cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"readme: still running after {args.timeout:.0f} s", file=sys.stderr)
            code = 124
        except KeyboardInterrupt:
            code = 130
        finally:
            stop_group(proc.pid)
    took = time.monotonic() - started
    verdict = "all succeeded" if code == 0 else f"failed, exit {code}"
    print(f"readme: {len(blocks)} runnable blocks, {verdict}, {took:.0f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
