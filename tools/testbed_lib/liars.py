"""Liars across the bridge (issue 15): beside the 3 honest nodes (replicas 2), a fourth node on
host x serves every expert of the model and lies (MOESHARD_FAILPOINTS) in one way per scenario.
Each liar must be caught and disqualified, the tokens must equal the single-node run, and the
run's ledger must verify, and fail to once one byte of it is flipped."""

from __future__ import annotations

import random
import subprocess

from .bed import MOESHARD, REPO, Bed, run
from .results import Result, check, finish, lines_with

LIES = ("zero", "scale:1.01", "noise:0.001", "nan", "wrong_expert", "duplicate")


def liars(bed: Bed, model, args, ref) -> list[Result]:
    results = []
    for lie in LIES:
        name = "tb-liar"
        key = bed.work / f"liar-{lie.split(':')[0]}.pem"  # a stranger never seen before
        key.unlink(missing_ok=True)
        run([*MOESHARD, "keygen", str(key)])
        bed.start_node("x", model, name, ["--key", str(key)], {"MOESHARD_FAILPOINTS": f"lie={lie}"})
        bed.wait_healthy("x")
        ledger = bed.work / f"ledger-{lie.split(':')[0]}.jsonl"
        ledger.unlink(missing_ok=True)
        proc = bed.generate(model, args.prompt_ids, args.tokens, extra=["--ledger", str(ledger)])
        result, err, _ = finish(proc)
        bed.stop(name)
        caught = lines_with(err, name, "disqualified")
        verified, tampered = _ledger_checks(ledger)
        ok = bool(caught) and verified and tampered
        detail = ("liar disqualified" if caught else "liar NOT caught") + (
            "; ledger verifies" if verified else "; ledger does NOT verify"
        )
        detail += "; flipped byte detected" if tampered else "; flipped byte NOT detected"
        results.append(check(f"liar: {lie}", result, err, ref(args.tokens), ok, detail))
    return results


def _ledger_checks(path) -> tuple[bool, bool]:
    """(the ledger verifies, a copy with one byte flipped does not)."""
    if not path.exists():
        return False, False
    good = _verify(path).returncode == 0
    data = bytearray(path.read_bytes())
    spot = random.Random(len(data)).randrange(len(data))
    data[spot] ^= 0x01
    flipped = path.with_suffix(".flipped")
    flipped.write_bytes(bytes(data))
    bad = _verify(flipped)
    return good, bad.returncode == 2


def _verify(path) -> subprocess.CompletedProcess:
    cmd = [*MOESHARD, "ledger", "verify", str(path)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
