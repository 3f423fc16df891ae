"""`moeshard bench attack [MODEL]`: strangers attack real processes while an honest user works,
and the table says what the honest user kept (docs/security.md, "Staying up under strangers").

Node attacks (`attack_nodes`): one `moeshard node --allow-any` holding the whole model, an
honest coordinator generating through it, an attacker process with many keys of its own. Per
attack: the honest tokens/s before and during (medians of --rounds runs), identical tokens,
the node's peak RSS against the bound it printed. Goal: >= 50% of the tokens/s, the same
tokens, RSS within the bound.

HTTP attacks (`attack_http`): a `moeshard serve` on the model and attackers against it. Per
attack: a normal request's p99 before and during, the server's peak RSS, the same output and
an answer afterwards. Goal: p99 < 1 s.

--soak S: every node attack at once for S seconds (the issue's 5 minutes: 300) while the
honest coordinator keeps generating; the node's RSS, ledger and log sampled every --every s,
so growth without bound shows as a column that keeps climbing.  Then (with the http section)
every HTTP attack at once against a server for S seconds, sampled the same way.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeshard.bench.attack_rows import AttackRow

SECTIONS = ("node", "http")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="out/demo", help="model directory")
    p.add_argument("--tokens", type=int, default=32, help="tokens per honest run")
    p.add_argument("--rounds", type=int, default=3, help="honest runs per median")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"which, comma-separated: {SECTIONS}"
    )
    p.add_argument(
        "--node-attacks",
        default="idle,big,unread,settle",
        help="which node attacks, comma-separated (the attacker's modes)",
    )
    p.add_argument("--http-seconds", type=float, default=10.0, help="each HTTP attack's length")
    p.add_argument(
        "--soak",
        type=float,
        default=0.0,
        help="seconds of all node attacks at once, then of all HTTP attacks (with --sections "
        "'': both soaks only)",
    )
    p.add_argument("--every", type=float, default=30.0, help="soak sampling interval (s)")


def run(args) -> int:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        print(
            f"moeshard bench attack: unknown section {', '.join(sorted(unknown))}", file=sys.stderr
        )
        return 2
    from moeshard.bench.attack_nodes import ATTACKS

    modes = [m.strip() for m in args.node_attacks.split(",") if m.strip()]
    wrong = set(modes) - {a.mode for a in ATTACKS}
    if wrong or not modes:
        known = ", ".join(a.mode for a in ATTACKS)
        print(f"moeshard bench attack: --node-attacks: choose from {known}", file=sys.stderr)
        return 2
    model = Path(args.model)
    print(f"bench attack on {model} ({_cpu()}); goals: node rows >= 50% tok/s, same tokens, ")
    print("RSS within the node's stated bound; HTTP rows p99 < 1 s and an answer afterwards")
    rows: list[AttackRow] = []
    with tempfile.TemporaryDirectory(prefix="bench-attack-") as tmp:
        if "node" in sections:
            from moeshard.bench.attack_nodes import node_attack_rows

            rows += node_attack_rows(model, Path(tmp) / "nodes", args.tokens, args.rounds, modes)
        if "http" in sections:
            from moeshard.bench.attack_http import http_attack_rows

            rows += http_attack_rows(model, args.http_seconds)
        soaked = True
        if args.soak > 0:
            from moeshard.bench.attack_http import http_soak
            from moeshard.bench.attack_nodes import soak

            soak(model, Path(tmp) / "soak", args.soak, args.every, args.tokens)
            soaked = http_soak(model, args.soak, args.every)
    print_table(rows)
    return 0 if soaked and all(r.passed for r in rows) else 1


def print_table(rows: list[AttackRow]) -> None:
    if not rows:
        return
    print(
        f"\n{'attack':<46} {'metric':<6} {'before':>8} {'during':>8} {'ratio':>6} "
        f"{'peak RSS':>9} {'bound':>7} {'output':>9}  result"
    )
    for r in rows:
        bound = f"{r.rss_bound_mb:.0f}" if r.rss_bound_mb else "-"
        print(
            f"{r.attack:<46} {r.metric:<6} {r.before:>8.3g} {r.during:>8.3g} {r.ratio():>5.2f}x "
            f"{r.peak_rss_mb:>7.0f}MB {bound:>7} {'same' if r.same_output else 'DIFFERENT':>9}  "
            f"{'PASS' if r.passed else 'FAIL'}"
        )
        for note in r.notes:
            print(f"    {note}")
    passed = sum(r.passed for r in rows)
    print(f"{passed} of {len(rows)} attacks within their goals")


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        name = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration, subprocess.SubprocessError):
        name = platform.processor() or "unknown CPU"
    from moeshard.moe.kernels.build import cpu_level

    return f"{name}, {cpu_level()}, {time.strftime('%Y-%m-%d')}"
