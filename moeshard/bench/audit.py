"""`moeshard bench audit MODEL`: how fast the coordinator's recomputations catch a liar, that
they never convict an honest node, and what they cost it (CPU, record bytes fetched).

Shards MODEL over N `moeshard node` processes (2 replicas of every expert, loopback, mutual
TLS) and runs the coordinator on the coordinator directory `shard` writes: no expert records
here, so every audit fetches the records it needs from the nodes (checked against merkle.bin)
into the audit cache. Then:

1. Honest audits, real: generations at audit rate 1 until --honest-calls audits have
   recomputed a node's reply. Every difference would convict an honest node: the goal is none.
2. Detection, simulated over the real audit code: a node lies on a fraction f of its calls
   (failpoints' `Lie.alter` applied to recorded honest replies); the real `Auditor._picked`
   (SystemRandom, rate p, after vetting) decides which calls are recomputed, and the real
   comparison (`same_bits`, against the recorded recomputation) whether a lie is seen. Printed:
   the share of --trials runs that caught the liar within n calls, against 1 - (1 - p f)^n
   (goal: 99% within 10,000 calls at f = 1%, p = 5%).
3. A real liar: a node started with MOESHARD_FAILPOINTS=lie=scale:1.000005:F joins; the calls
   it served until it was caught, per run, against the median the formula predicts, and the
   fraud proof it left checked by `moeshard.moe.ledger.fraud.check`.
4. Cost at rate p (vetting skipped): decode tokens/s against no audits on the same nodes
   (alternated rounds, medians); the audit thread's CPU time as a share of the decode time
   (goal: at most 10%); record bytes fetched per token, from a cold audit cache.
5. Serving: --clients requests at once through the batching engine, which sends a token only
   once the audits it rests on are done: tokens/s without audits, at rate p and at rate 1 (a
   new node's vetting), and how long a token waited to be sent (the lag, bounded by the
   engine's MAX_LAG steps).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from moeshard.bench.rpc_nodes import NodeProcs, client_key
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.audit import Auditor
from moeshard.coordinator.remote.audit_cases import same_bits
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.experts import RemoteExperts
from moeshard.coordinator.remote.policy import AUDIT_RATE
from moeshard.coordinator.remote.records import RecordCache
from moeshard.coordinator.remote.trust import Trust
from moeshard.coordinator.serve.engine import HELD_BUCKETS, Engine
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.ledger import fraud
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.units import parse_size
from moeshard.moe.wire import codec
from moeshard.node.failpoints import ENV, Lie

CHECKPOINTS = (100, 500, 1000, 2000, 5000, 10000)
LIES = (Lie("scale", 1.01), Lie("scale", 1 + 5e-6), Lie("zero"), Lie("noise", 1e-3), Lie("ulp"))
KEPT = 2000  # honest recomputations kept for the simulation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (with trunk and experts)")
    p.add_argument("--nodes", type=int, default=3, help="honest nodes")
    p.add_argument("--audit", type=float, default=AUDIT_RATE, help="audit rate p")
    p.add_argument(
        "--lie-rate", type=float, default=0.01, help="share f of its calls the liar lies on"
    )
    p.add_argument("--calls", type=int, default=10_000, help="calls per simulated run")
    p.add_argument("--trials", type=int, default=10_000, help="simulated runs")
    p.add_argument("--honest-calls", type=int, default=100_000, help="honest audits to run (real)")
    p.add_argument("--real-lie-rate", type=float, default=0.05, help="f of the real liar")
    p.add_argument("--real-runs", type=int, default=3, help="runs with the real liar")
    p.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of the cost test")
    p.add_argument("--clients", type=int, default=8, help="requests at once in the serving test")
    p.add_argument("--audit-cache", metavar="SIZE", help="the coordinator's audit cache")
    p.add_argument(
        "--audit-bytes",
        metavar="SIZE",
        help="sections 4 and 5: cap on the record bytes audits fetch per token (scales p down)",
    )
    p.add_argument(
        "--sections", default="1,2,3,4,5", help="which sections to run (2 needs 1's sample)"
    )
    p.add_argument("--quick", action="store_true", help="small counts (a smoke run)")


def run(args) -> int:
    if args.quick:
        args.trials, args.honest_calls, args.real_runs, args.rounds = 500, 500, 1, 2
    ModelDir(args.model).require_experts(
        "bench audit starts its nodes from the records: use the full model directory"
    )
    cache = parse_size(args.audit_cache) if args.audit_cache else 0
    args.audit_bytes = parse_size(args.audit_bytes) if args.audit_bytes else 0
    with tempfile.TemporaryDirectory(prefix="moeshard-bench-audit-") as tmp:
        tmp = Path(tmp)
        plan = shard_model(args.model, args.nodes, min(2, args.nodes), tmp / "shards")
        coordinator = ModelDir(plan["coordinator"]["dir"])
        me = client_key(tmp)
        procs = NodeProcs(tmp)
        bench = _Bench(coordinator, me, cache, tmp / "evidence", args)
        try:
            specs = [procs.launch(Path(n["dir"]), me).spec() for n in plan["nodes"]]
            print(_header(coordinator, specs, bench))
            sections = {int(x) for x in args.sections.split(",")}
            kept = _honest(bench, specs) if sections & {1, 2} else []
            if 2 in sections:
                _detection(kept, args)
            if 3 in sections:
                _real_liar(bench, specs, procs, plan, args)
            if 4 in sections:
                _cost(bench, specs, args)
            if 5 in sections:
                _serving(bench, specs, args)
        finally:
            procs.close()
    return 0


class _Bench:
    """The coordinator side: remote runtimes on the coordinator directory."""

    def __init__(self, model: ModelDir, identity, cache: int, evidence: Path, args):
        self.model, self.identity, self.cache, self.evidence = model, identity, cache, evidence
        self.args = args

    def remote(self, specs, **config) -> tuple[object, RemoteExperts]:
        m = self.model
        config = RemoteConfig(
            identity=self.identity,
            prefetch=False,
            audit_cache=self.cache,
            evidence=str(self.evidence),
            challenge_interval_s=0,  # possession challenges are timed by `moeshard audit`
            **config,
        )
        trust = Trust(m.model_id, m.config.expert_hidden, config, m)
        remote = RemoteExperts(m.model_id, m.config.expert_hidden, specs, config, trust)
        return m.family.Transformer(m.config, m.load_trunk(), remote), remote

    def prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(self.model.config.vocab_size) for _ in range(8)]

    def opts(self) -> SamplingOptions:
        return SamplingOptions(max_tokens=self.args.tokens)


def _header(model: ModelDir, specs, bench: _Bench) -> str:
    shards = model.shard_set
    probe = RecordCache(shards, bench.cache or 0) if bench.cache else None
    cache = f"{probe.budget_bytes / 1e6:.0f} MB" if probe else "default"
    return (
        f"model {model.path.name}: {shards.fmt} experts {shards.hidden}x{shards.inter}, "
        f"records of {shards.record_nbytes / 1e6:.2f} MB, top-{model.config.top_k}; "
        f"{len(specs)} nodes; the coordinator holds no records (audit cache {cache})"
    )


def _honest(bench: _Bench, specs) -> list:
    """Section 1: honest recomputations at audit rate 1; returns a sample of them."""
    transformer, remote = bench.remote(specs, audit=1.0)
    auditor = remote.verifier
    kept, seen = [], [0]

    def observe(case, want, passed):
        seen[0] += 1
        if len(kept) < KEPT:
            kept.append((case.request.out_dtype, case.reply.out, want))

    auditor.observe = observe
    rng = random.Random(1)
    t0 = time.perf_counter()
    tokens = 0
    try:
        while seen[0] < bench.args.honest_calls:
            result = generate(transformer, bench.prompt(rng), bench.opts(), verifier=auditor)
            tokens += len(result.tokens)
            auditor.drain()
        stats = auditor.snapshot()
    finally:
        remote.close()
    rec = stats["records"]
    print("== 1. honest audits (real cluster, audit rate 1, records fetched from the nodes)")
    print(
        f"   {stats['picked']} calls recomputed over {tokens} tokens in "
        f"{time.perf_counter() - t0:.0f} s: {stats['passed']} equal bit for bit, "
        f"{stats['failed']} differed; records fetched {rec['fetched']} "
        f"({rec['fetched_bytes'] / 1e6:.1f} MB), cache hits {rec['hits']}"
    )
    false = len(stats["convicted"])
    goal = "met" if not false and stats["passed"] >= bench.args.honest_calls else "MISSED"
    print(
        f"   honest nodes convicted: {false}   "
        f"[goal: 0 in >= {bench.args.honest_calls} audited calls: {goal}]"
    )
    return kept


def _detection(kept: list, args) -> None:
    """Section 2: calls until an audited lie is seen, simulated over the real audit code."""
    p, f = args.audit, args.lie_rate
    print(
        f"== 2. detection, simulated (p = {p}, f = {f}, {args.trials} runs of up to "
        f"{args.calls} calls; the real picking and comparison)"
    )
    marks = [n for n in CHECKPOINTS if n <= args.calls]
    print("   lie               " + "".join(f"{f'n={n}':>10}" for n in marks))
    theory = [1 - (1 - p * f) ** n for n in marks]
    print("   1-(1-pf)^n        " + "".join(f"{t:>10.4f}" for t in theory))
    rng = random.Random(7)
    picker = Auditor(None, None, None, p, 0)  # vetted: the base rate from the first call
    for lie in LIES:
        caught_at = [_one_run(picker, lie, kept, f, args.calls, rng) for _ in range(args.trials)]
        shares = [sum(c is not None and c <= n for c in caught_at) / args.trials for n in marks]
        print(f"   {lie.name():<18}" + "".join(f"{s:>10.4f}" for s in shares))
    picker.close()
    want = 1 - (1 - p * f) ** 10_000
    noise = 2 * math.sqrt(want * (1 - want) / args.trials)  # two standard errors of a share
    print(
        f"   [goal: >= 0.99 within 10000 calls at f = 1%, p = 5%; the formula gives {want:.4f},"
        f" and {args.trials} runs measure a share to +-{noise:.4f}]"
    )


def _one_run(picker: Auditor, lie: Lie, kept: list, f: float, calls: int, rng) -> int | None:
    """The call at which the liar is caught (1-based), or None within `calls`. Which calls it
    lies on is drawn first (numpy, seeded); each of those is then picked or not by the real,
    secret choice, which knows nothing of lies (the calls it tells the truth on would be
    picked just as often, and pass): the same distribution as asking on every call."""
    lies = np.flatnonzero(np.random.default_rng(rng.getrandbits(64)).random(calls) < f) + 1
    for n in lies.tolist():
        if not picker._picked("liar"):
            continue
        out_dtype, reply, want = kept[rng.randrange(len(kept))]
        honest = codec.decode(reply, "reply", (reply.dtype,)).astype("float64")  # [T, H]
        lied = codec.encode(lie.alter(honest, rng), reply.dtype)
        if not same_bits(want, lied):
            return n
    return None


def _real_liar(bench: _Bench, specs, procs: NodeProcs, plan, args) -> None:
    """Section 3: a real lying node; calls it served before it was caught."""
    f, p = args.real_lie_rate, args.audit
    median = math.log(0.5) / math.log(1 - p * f)
    lie = f"lie=scale:1.000005:{f}"
    print(f"== 3. a real liar ({lie}, p = {p}, no vetting at rate 1)")
    for run in range(args.real_runs):
        key = ("--key", str(bench.evidence.parent / f"liar-{run}.pem"))  # a stranger's key
        liar = procs.launch(Path(plan["nodes"][0]["dir"]), bench.identity, {ENV: lie}, key)
        liar_spec = liar.spec()
        transformer, remote = bench.remote([*specs, liar_spec], audit=p, audit_new=0)
        rng = random.Random(100 + run)
        try:
            bad = next(x for x in remote.peers.peers if x.addr == liar_spec.addr)
            t0 = time.perf_counter()
            while not bad.disqualified and time.perf_counter() - t0 < 600:
                generate(transformer, bench.prompt(rng), bench.opts(), verifier=remote.verifier)
                remote.verifier.drain()
            stats = remote.verifier.snapshot()
        finally:
            remote.close()
            liar.proc.terminate()
            liar.proc.wait()
        caught = "caught" if bad.disqualified else "NOT caught in 600 s"
        proofs, honest = stats["proofs"], [c for c in stats["convicted"] if c != bad.node_id]
        checked = fraud.check(proofs[0], bench.model).describe()[:48] if proofs else "none"
        print(
            f"   run {run + 1}: {caught} after serving {bad.calls} calls (median predicted "
            f"{median:.0f}); honest nodes convicted {len(honest)}; its fraud proof: {checked}..."
        )


def _cost(bench: _Bench, specs, args) -> None:
    """Section 4: tok/s with audits at rate p against none, alternated rounds, medians; the
    audit thread's CPU share of the decode time; record bytes fetched per token."""
    print(f"== 4. cost of auditing at p = {args.audit} ({args.rounds} alternated rounds)")
    runs = {}
    cap = {"audit_bytes_per_token": args.audit_bytes}
    for name, rate in (("no audit", 0.0), (f"audit {args.audit}", args.audit)):
        transformer, remote = bench.remote(specs, audit=rate, audit_new=0, **cap)
        runs[name] = (remote, transformer, [], [])
    prompt = bench.prompt(random.Random(3))
    audited = runs[f"audit {args.audit}"][0].verifier
    decode_s = tokens = 0.0
    try:
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                remote, transformer, rates, _ = runs[name]
                result = generate(transformer, prompt, bench.opts(), verifier=remote.verifier)
                remote.verifier.drain()
                rates.append(len(result.decode_s) / sum(result.decode_s))
                if remote.verifier is audited:
                    decode_s += result.prefill_s + sum(result.decode_s)
                    tokens += len(result.tokens)
        stats = audited.snapshot()
    finally:
        for remote, *_ in runs.values():
            remote.close()
    medians = {name: statistics.median(r[2]) for name, r in runs.items()}
    base = medians["no audit"]
    for name, tps in medians.items():
        print(f"   {name:<12} {tps:8.1f} tok/s   {tps / base:6.3f}x")
    share = stats["cpu_s"] / max(decode_s, 1e-9)
    rec = stats["records"]
    print(
        f"   audits: {stats['picked']} calls recomputed in {tokens:.0f} tokens; audit CPU "
        f"{stats['cpu_s']:.2f} s of {decode_s:.2f} s decoding = {share:.1%} "
        f"[goal: <= 10%: {'met' if share <= 0.10 else 'MISSED'}]"
    )
    print(
        f"   records fetched: {rec['fetched']} ({rec['fetched_bytes'] / 1e6:.1f} MB) = "
        f"{rec['fetched_bytes'] / max(tokens, 1) / 1e3:.1f} KB per token from a cold cache; "
        f"cache hits {rec['hits']}, evictions {rec['evicted']}; the byte cap's factor on p "
        f"{stats['budget_factor']:.3f}"
    )


def _serving(bench: _Bench, specs, args) -> None:
    """Section 5: the batching engine with and without audits; the wait audits add."""
    print(f"== 5. serving {args.clients} requests at once of {args.tokens} tokens")
    rng = random.Random(5)
    prompts = [bench.prompt(rng) for _ in range(args.clients)]
    base = None
    cap = {"audit_bytes_per_token": args.audit_bytes}
    for name, rate in (("no audit", 0.0), (f"audit {args.audit}", args.audit), ("audit 1", 1.0)):
        transformer, remote = bench.remote(specs, audit=rate, audit_new=0, **cap)
        verifier = remote.verifier if rate > 0 else None
        engine = Engine(transformer, max_batch=args.clients, verifier=verifier)
        try:
            t0 = time.perf_counter()
            requests = [engine.submit(p, bench.opts()) for p in prompts]
            tokens = sum(
                len([e for e in r.stream(timeout=600) if e.kind == "token"]) for r in requests
            )
            elapsed = time.perf_counter() - t0
            stats = engine.stats
        finally:
            engine.close()
            remote.close()
        tps = tokens / elapsed
        base = base or tps
        line = f"   {name:<11} {tps:8.1f} tok/s {tps / base:6.3f}x"
        if verifier is not None:
            _, held_s, count = stats.held.snapshot()
            steps, _, _ = stats.held_steps.snapshot()
            most = next((b for b, n in zip(HELD_BUCKETS, steps, strict=False) if n == count), "")
            most = most if most != "" else f"more than {HELD_BUCKETS[-1]}"
            line += (
                f"   a token waited {held_s / max(count, 1) * 1e3:.2f} ms on average to be "
                f"sent, at most {most} steps; waits for audits {stats.verify_wait_s:.2f} s; "
                f"rollbacks {stats.rollbacks}"
            )
        print(line)
