"""`moeshard bench audit MODEL`: how fast spot checks catch a liar, whether they ever convict an
honest node, and what they cost (issue 15).

Starts N honest `moeshard node` processes on shard splits of MODEL (2 replicas of every
expert, loopback, plaintext), then:

1. Honest comparisons, real: generations at audit rate 1 until at least --honest-calls audits
   have compared a node's reply with a second holder's answer to the same request (the real
   `Auditor`, its real tolerance). Every mismatch there would be a false ban: the goal is none.
2. Detection, simulated over the real audit code: a node lies on a fraction f of its calls
   (failpoints' `Lie.alter` applied to recorded honest replies); the real `Auditor._picked`
   (SystemRandom, rate p) decides which calls are audited and the real `agree` whether an
   audited lie is seen. Printed: the share of --trials runs that caught the liar within n
   calls, against 1 - (1 - p f)^n (goal: 99% within 10,000 calls at f = 1%, p = 5%).
3. A real liar: a node started with MOESHARD_FAILPOINTS=lie=scale:1.01:F joins; the calls it
   served until it was caught, per run, against the median that formula predicts.
4. Cost: decode tokens/s at audit rate p against no audit on the same nodes, alternated
   rounds, medians (goal: at most 5% slower).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from coordinator.bench.rpc_nodes import NodeProcs, layouts_for
from coordinator.generate import SamplingOptions, generate
from coordinator.remote.audit import Auditor, agree
from coordinator.remote.config import RemoteConfig
from coordinator.remote.experts import RemoteExperts
from moe.model.model_dir import ModelDir
from node.failpoints import ENV, Lie

CHECKPOINTS = (100, 500, 1000, 2000, 5000, 10000)
LIES = (Lie("scale", 1.01), Lie("zero"), Lie("noise", 1e-3))
KEPT = 4000  # honest comparisons kept for the simulation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (with trunk and experts)")
    p.add_argument("--nodes", type=int, default=3, help="honest nodes")
    p.add_argument("--audit", type=float, default=0.05, help="audit rate p")
    p.add_argument(
        "--lie-rate", type=float, default=0.01, help="share f of its calls the liar lies on"
    )
    p.add_argument("--calls", type=int, default=10_000, help="calls per simulated run")
    p.add_argument("--trials", type=int, default=1000, help="simulated runs")
    p.add_argument(
        "--honest-calls", type=int, default=100_000, help="honest audits to compare (real)"
    )
    p.add_argument("--real-lie-rate", type=float, default=0.05, help="f of the real liar")
    p.add_argument("--real-runs", type=int, default=3, help="runs with the real liar")
    p.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of the cost test")
    p.add_argument("--quick", action="store_true", help="small counts (a smoke run)")


def run(args) -> int:
    if args.quick:
        args.trials, args.honest_calls, args.real_runs, args.rounds = 200, 2000, 1, 2
    model = ModelDir(args.model)
    model.require_experts(
        "bench audit starts its nodes from the records: use the full model directory"
    )
    with tempfile.TemporaryDirectory(prefix="moeshard-bench-audit-") as tmp:
        dirs = layouts_for(Path(args.model), args.nodes, Path(tmp))[args.nodes]
        procs = NodeProcs(Path(tmp))
        try:
            specs = [procs.launch(d, None).spec() for d in dirs]
            kept = _honest(model, specs, args)
            _detection(kept, args)
            _real_liar(model, specs, procs, args)
            _cost(model, specs, args)
        finally:
            procs.close()
    return 0


def _remote(model: ModelDir, specs, **config) -> RemoteExperts:
    return RemoteExperts(
        model.model_id, model.config.expert_hidden, specs, RemoteConfig(prefetch=False, **config)
    )


def _prompts(model: ModelDir, count: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(model.config.vocab_size) for _ in range(8)] for _ in range(count)]


def _honest(model: ModelDir, specs, args) -> list:
    """Section 1: honest comparisons at audit rate 1; returns a sample of them."""
    remote = _remote(model, specs, audit=1.0)
    kept, seen = [], [0]

    def observe(case, second, exact, tol):
        seen[0] += 1
        if len(kept) < KEPT:
            kept.append((case.part.copy(), second.copy(), exact, tol))

    remote.auditor.observe = observe
    transformer = model.family.Transformer(model.config, model.load_trunk(), remote)
    rng = random.Random(1)
    t0 = time.perf_counter()
    tokens = 0
    try:
        while seen[0] < args.honest_calls:
            prompt = _prompts(model, 1, rng)[0]
            opts = SamplingOptions(max_tokens=args.tokens)
            tokens += len(generate(transformer, prompt, opts, verifier=remote.verifier).tokens)
            remote.auditor.drain()
        stats = remote.auditor.stats
    finally:
        remote.close()
    exact = sum(k[2] for k in kept) / max(len(kept), 1)
    print("== 1. honest audits (real cluster, audit rate 1)")
    print(
        f"   {stats.audits} audits over {tokens} tokens in {time.perf_counter() - t0:.0f} s "
        f"({exact:.0%} of the kept sample bit-exact, the rest within tolerance)"
    )
    false = len(stats.convicted)
    print(
        f"   mismatches {stats.mismatches}, nodes convicted {false}, unauditable "
        f"{stats.unauditable}, inconclusive {stats.inconclusive}   "
        f"[goal: 0 false bans in >= {args.honest_calls}: {'met' if not false else 'MISSED'}]"
    )
    return kept


def _detection(kept: list, args) -> None:
    """Section 2: calls until an audited lie is seen, simulated over the real audit code."""
    p, f = args.audit, args.lie_rate
    print(
        f"== 2. detection, simulated (p = {p}, f = {f}, {args.trials} runs of up to "
        f"{args.calls} calls; real picking and comparison)"
    )
    marks = [n for n in CHECKPOINTS if n <= args.calls]
    print("   lie            " + "".join(f"{f'n={n}':>11}" for n in marks))
    theory = [1 - (1 - p * f) ** n for n in marks]
    print("   1-(1-pf)^n     " + "".join(f"{t:>11.4f}" for t in theory))
    rng = random.Random(7)
    for lie in LIES:
        auditor = Auditor(None, p, 0, None, None, 1.0, "")
        caught_at = []
        for _ in range(args.trials):
            caught_at.append(_one_run(auditor, lie, kept, f, args.calls, rng))
        auditor.close()
        shares = [sum(c is not None and c <= n for c in caught_at) / args.trials for n in marks]
        name = f"{lie.mode}" + (f":{lie.arg:g}" if lie.mode in ("scale", "noise") else "")
        print(f"   {name:<15}" + "".join(f"{s:>11.4f}" for s in shares))
    at = 10_000
    want = 1 - (1 - p * f) ** at
    print(f"   [goal: >= 0.99 within {at} calls at f = 1%, p = 5%; the formula gives {want:.4f}]")


def _one_run(auditor: Auditor, lie: Lie, kept: list, f: float, calls: int, rng) -> int | None:
    """The call at which the liar is caught (1-based), or None within `calls`."""
    for n in range(1, calls + 1):
        picked = auditor._picked("liar")  # the real, secret choice (not told about lies)
        if rng.random() >= f or not picked:
            continue
        part, second, exact, tol = kept[rng.randrange(len(kept))]
        if not agree(lie.alter(part, rng), second, exact, tol):
            return n
    return None


def _real_liar(model: ModelDir, specs, procs: NodeProcs, args) -> None:
    """Section 3: a real lying node; calls it served before it was caught."""
    f, p = args.real_lie_rate, args.audit
    median = math.log(0.5) / math.log(1 - p * f)
    print(f"== 3. a real liar (lie=scale:1.01:{f}, p = {p}, no rate-1 start)")
    for run in range(args.real_runs):
        liar = procs.launch(Path(args.model), None, {ENV: f"lie=scale:1.01:{f}"})
        liar_spec = liar.spec()
        remote = _remote(model, [*specs, liar_spec], audit=p, audit_new=0)
        transformer = model.family.Transformer(model.config, model.load_trunk(), remote)
        rng = random.Random(100 + run)
        try:
            bad = next(x for x in remote.peers.peers if x.addr == liar_spec.addr)
            t0 = time.perf_counter()
            while not bad.disqualified and time.perf_counter() - t0 < 600:
                opts = SamplingOptions(max_tokens=args.tokens)
                generate(transformer, _prompts(model, 1, rng)[0], opts, verifier=remote.verifier)
                remote.auditor.drain()
            caught = "caught" if bad.disqualified else "NOT caught in 600 s"
            print(
                f"   run {run + 1}: {caught} after serving {bad.calls} calls "
                f"(median predicted {median:.0f}); rollbacks recompute its unaudited work"
            )
        finally:
            remote.close()
            liar.proc.terminate()
            liar.proc.wait()


def _cost(model: ModelDir, specs, args) -> None:
    """Section 4: tok/s with audits at rate p against none, alternated rounds, medians."""
    print(f"== 4. cost of auditing at p = {args.audit} ({args.rounds} alternated rounds)")
    runs = {}
    for name, rate in (("no audit", 0.0), (f"audit {args.audit}", args.audit)):
        remote = _remote(model, specs, audit=rate, audit_new=0)
        transformer = model.family.Transformer(model.config, model.load_trunk(), remote)
        runs[name] = (remote, transformer, [])
    prompt = _prompts(model, 1, random.Random(3))[0]
    opts = SamplingOptions(max_tokens=args.tokens)
    try:
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                remote, transformer, rates = runs[name]
                result = generate(transformer, prompt, opts, verifier=remote.verifier)
                rates.append(len(result.decode_s) / sum(result.decode_s))
                remote.auditor.drain()
    finally:
        for remote, _, _ in runs.values():
            remote.close()
    medians = {name: statistics.median(r[2]) for name, r in runs.items()}
    base = medians["no audit"]
    for name, tps in medians.items():
        print(f"   {name:<12} {tps:8.1f} tok/s   {tps / base:6.3f}x")
    slower = 1 - min(medians.values()) / base
    print(f"   [goal: at most 5% slower: {slower:.1%} ({'met' if slower <= 0.05 else 'MISSED'})]")
