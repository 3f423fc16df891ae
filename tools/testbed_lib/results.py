"""Scenario outcomes: a generate process's result and the coordinator's stderr, parsed."""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass


@dataclass
class Result:
    scenario: str
    ok: bool
    detail: str
    tokens_per_s: float | None = None
    failovers: int | None = None
    call_ms: float | None = None  # mean of the nodes' smoothed Forward round trips


def finish(proc, timeout: float = 240.0) -> tuple[dict | None, str, float]:
    """(the JSON result or None, stderr, wall seconds) of a generate process."""
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += "\n[testbed: coordinator timed out]"
    wall = time.monotonic() - t0
    if log_path := getattr(proc, "log_path", None):
        with open(log_path, "a") as f:
            f.write(f"exit {proc.returncode} after {wall:.1f} s\n{err}")
    try:
        result = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (json.JSONDecodeError, IndexError):
        result = None
    return result, err, wall


def retries(stderr: str) -> int:
    m = re.search(r"(\d+) retried layer calls", stderr)
    return int(m.group(1)) if m else -1


def node_segments(stderr: str) -> list[str]:
    """The per-node parts of the coordinator's '[nodes: a N calls X ms, b ... DOWN; ...]'."""
    line = (lines_with(stderr, "[nodes:") or ["[nodes: ;"])[0]
    return [s.strip() for s in line.split("[nodes:", 1)[1].split(";", 1)[0].split(",")]


def node_calls(stderr: str, node_id: str) -> int:
    """Layer calls the coordinator's summary line credits to `node_id` (0 if not listed)."""
    seg = [s for s in node_segments(stderr) if s.startswith(f"{node_id} ")]
    calls = re.search(r" (\d+) calls", seg[0]) if seg else None
    return int(calls.group(1)) if calls else 0


def lines_with(stderr: str, *needles: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if all(n in ln for n in needles)]


def check(name, result, stderr, ref, extra_ok=True, extra="") -> Result:
    if result is None:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        return Result(name, False, f"coordinator failed: {tail}")
    same = result["tokens"] == ref["tokens"]
    n = retries(stderr)
    detail = ("identical output" if same else "OUTPUT DIFFERS from single-node") + (
        f"; {extra}" if extra else ""
    )
    tps = result["stats"]["tokens_per_s"]
    ms = [float(m) for m in re.findall(r"calls ([0-9.]+) ms", " ".join(node_segments(stderr)))]
    return Result(name, same and extra_ok, detail, tps, n, sum(ms) / len(ms) if ms else None)
