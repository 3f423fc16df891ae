"""Re-run the commands of docs/results.md's generated blocks and write their output in place
(`make results`).

A block is generated when the line before its fence is `<!-- results: generated -->`. Its lines
starting with `$ ` are the commands; everything else in it is their output, replaced by what
they print now (stdout and stderr, as a terminal shows them), under a first line naming the
CPU, its ISA level and the date. `moeshard` in a command is the venv's. The file is written to
a temporary name and renamed, once every block has run; a command that fails stops the run
and leaves the file as it was.

    python3 tools/update_results.py [docs/results.md] [--only TEXT] [--list]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- results: generated -->"


def generated_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line index of each generated block's body (inside the fences)."""
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise SystemExit(f"line {i + 1}: {MARK} must come right before a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise SystemExit(f"line {i + 2}: the block is never closed")
        blocks.append((i + 2, end))
    return blocks


def block_commands(body: list[str]) -> list[str]:
    """The `$ ` commands of a block, each with its continuation lines (ending in a backslash)."""
    commands, i = [], 0
    while i < len(body):
        if body[i].startswith("$ "):
            command = body[i][2:]
            while command.endswith("\\") and i + 1 < len(body):
                i += 1
                command += "\n" + body[i]
            commands.append(command)
        i += 1
    return commands


def machine() -> str:
    """The CPU's name and the kernels' ISA level, as every speed figure must say."""
    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from moeshard.moe.kernels.build import cpu_level

    return f"{name}, {os.cpu_count()} CPUs, kernels {cpu_level()}"


def run(command: str, venv_bin: Path) -> str:
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True
    )
    out = (done.stdout + done.stderr).rstrip("\n")
    if done.returncode != 0:
        raise SystemExit(f"`{command}` exited {done.returncode}:\n{out}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", nargs="?", default=str(ROOT / "docs" / "results.md"))
    p.add_argument("--only", help="only the blocks whose commands contain TEXT")
    p.add_argument("--list", action="store_true", help="print the commands, run nothing")
    args = p.parse_args()
    path = Path(args.file)
    lines = path.read_text().split("\n")
    venv_bin = Path(sys.executable).parent
    header = f"# {machine()}, {datetime.date.today().isoformat()}"
    # from the last block up, so the earlier blocks' line numbers stay right
    for first, last in reversed(generated_blocks(lines)):
        commands = block_commands(lines[first:last])
        if not commands:
            raise SystemExit(f"line {first + 1}: a generated block with no `$ ` command")
        if args.only and not any(args.only in c for c in commands):
            continue
        if args.list:
            print("\n".join(commands))
            continue
        body = [header]
        for command in commands:
            print(f"results: $ {command.splitlines()[0]}", file=sys.stderr)
            body += [f"$ {command}", run(command, venv_bin)]
        lines[first:last] = "\n".join(body).split("\n")
    if args.list:
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)
    print(f"results: {path} updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
