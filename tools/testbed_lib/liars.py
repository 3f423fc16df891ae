"""Liars across the bridge (issue 15): beside the 3 honest nodes (replicas 2), a fourth node on
host x serves every expert of the model and lies (MOESHARD_FAILPOINTS) in one way per scenario.
Each liar must be caught and disqualified, the tokens must equal the single-node run, and the
run's ledger must verify, and fail to once one byte of it is flipped."""

from __future__ import annotations

import random
import subprocess

from .bed import MOESHARD, REPO, Bed, log, run
from .results import Result, check, finish, lines_with, node_calls

LIES = ("zero", "scale:1.01", "noise:0.001", "nan", "wrong_expert", "duplicate")


ATTEMPTS = 3  # generations per lie while the liar is neither caught nor given work


def liars(bed: Bed, model, args, ref) -> list[Result]:
    results = []
    for lie in LIES:
        name, tag = "tb-liar", lie.split(":")[0]
        key = bed.work / f"liar-{tag}.pem"  # a stranger never seen before
        key.unlink(missing_ok=True)
        run([*MOESHARD, "keygen", str(key)])
        bed.start_node("x", model, name, ["--key", str(key)], {"MOESHARD_FAILPOINTS": f"lie={lie}"})
        bed.wait_healthy("x")
        for attempt in range(1, ATTEMPTS + 1):
            result, err, caught, calls, ledger = _generate(bed, model, args, name, tag, attempt)
            # A liar given no work and asked no audit told no lie (the duplicate lies only on
            # a work stream, and a stranger costs more than the honest nodes in holder choice):
            # that run proves nothing either way, so the generation is run again. Nor does a
            # single call that escaped the sampled audits (CI: 1 call of 149 and 138 audited;
            # a stranger's calls are sampled, not all checked): run again too.
            if caught or calls > 1:
                break
            log(f"liar {lie}: {calls} call(s) and not caught in generation {attempt}; again")
        bed.stop(name)
        verified, tampered = _ledger_checks(ledger)
        ok = bool(caught) and verified and tampered
        detail = ("liar disqualified" if caught else "liar NOT caught") + f" ({calls} calls)"
        detail += "; ledger verifies" if verified else "; ledger does NOT verify"
        detail += "; flipped byte detected" if tampered else "; flipped byte NOT detected"
        results.append(check(f"liar: {lie}", result, err, ref(args.tokens), ok, detail))
    return results


def _generate(bed: Bed, model, args, name: str, tag: str, attempt: int):
    """One generation beside the liar, with a reputation database of its own: a new network,
    where no node has a record yet, so the stranger is not priced out of holder choice by the
    honest nodes' records from earlier scenarios. (result, stderr, lines convicting the liar,
    its work calls, the run's ledger)."""
    ledger = bed.work / f"ledger-{tag}.jsonl"
    ledger.unlink(missing_ok=True)
    extra = ["--ledger", str(ledger), "--reputation", str(bed.work / f"rep-{tag}-{attempt}.db")]
    result, err, _ = finish(bed.generate(model, args.prompt_ids, args.tokens, extra=extra))
    return result, err, lines_with(err, name, "disqualified"), node_calls(err, name), ledger


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
