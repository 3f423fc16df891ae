"""The node attacks of `moeshard bench attack`: a real `moeshard node` process under
`--allow-any` holding the whole model (mutual TLS on loopback), an honest coordinator
generating through it, and an attacker process (`moeshard.bench.attacker`) playing many
strangers, each with a key of its own, against it. One node and no replica, so the honest
coordinator cannot route around the attack: what it keeps is what the node's fairness gives it.

Per attack: the honest tokens/s before (same run, no attack) and during, whether its tokens
are the unattacked ones, the attacked node's peak RSS against the bound it printed at start
(its idle RSS plus "requests and replies hold at most N MiB"), and how often the honest
coordinator banned that node. Goal: >= 50% of the tokens/s, identical tokens, RSS within the bound.

The machine's cores are split: the honest coordinator on the first half, the nodes and the
attackers on the rest (with one core, nothing is pinned), so the attackers' own CPU does not
count as the node's unfairness; every node computes with one thread.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from moeshard.bench.attack_rows import AttackRow
from moeshard.bench.rpc_nodes import Launched, NodeProcs, client_key
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.experts import RemoteExperts
from moeshard.coordinator.remote.transport import PeerSpec
from moeshard.moe.errors import MoeshardError
from moeshard.moe.model.model_dir import ModelDir

BOUND = re.compile(r"requests and replies hold at most (\d+) MiB")
GOAL = ">= 50% tok/s, same tokens, RSS within bound"


@dataclass(frozen=True)
class NodeAttack:
    name: str  # the table's words
    mode: str  # moeshard.bench.attacker's mode
    flags: tuple[str, ...]


ATTACKS = (
    NodeAttack("12 keys x 4 idle streams", "idle", ("--keys", "12", "--streams", "4")),
    NodeAttack(
        "16 Forwards of 7,800 rows from 8 keys",
        "big",
        ("--keys", "8", "--concurrency", "16", "--rows", "7800"),
    ),
    NodeAttack(
        "8 keys x 4 streams never reading replies",
        "unread",
        ("--keys", "8", "--streams", "4", "--rows", "2000"),
    ),
    NodeAttack(
        "self-signed Settles from 4 keys, 8 at a time",
        "settle",
        ("--keys", "4", "--concurrency", "8"),
    ),
)


def split_cores() -> tuple[set[int], set[int]]:
    """(the honest coordinator's cores, the nodes' and attackers' cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


class RssWatch:
    """The peak RSS of a process, sampled every `interval_s` until stop()."""

    def __init__(self, pid: int, interval_s: float = 0.1):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Honest:
    """The honest coordinator: a fresh RemoteExperts per run (a new session, as a new
    `generate` would be), greedy decoding of a fixed prompt."""

    def __init__(self, model: ModelDir, specs: list[PeerSpec], identity, tokens: int):
        self.model, self.specs, self.identity, self.tokens = model, specs, identity, tokens
        self.prompt = [1, 5, 9, 2, 7, 3, 11, 4]

    def run(self) -> tuple[float, list[int], dict]:
        """(tokens/s, the tokens, the node table of its stats)."""
        m = self.model
        config = RemoteConfig(identity=self.identity, challenge_interval_s=0)
        remote = RemoteExperts.for_model(m, self.specs, config)
        try:
            transformer = m.family.Transformer(m.config, m.load_trunk(), remote)
            opts = SamplingOptions(max_tokens=self.tokens)
            t0 = time.perf_counter()
            try:
                result = generate(transformer, self.prompt, opts, verifier=remote.verifier)
                tokens = list(result.tokens)
            except MoeshardError as exc:  # what `generate` would exit 3 with: no tokens
                print(f"   honest run failed: {exc}", file=sys.stderr)
                tokens = []
            elapsed = time.perf_counter() - t0
            nodes = {n["addr"]: n for n in remote.stats()["nodes"]}
        finally:
            remote.close()
        return len(tokens) / elapsed, tokens, nodes

    def median(self, rounds: int) -> tuple[float, list[int], list[dict]]:
        runs = [self.run() for _ in range(rounds)]
        return statistics.median(r[0] for r in runs), runs[-1][1], [r[2] for r in runs]


@dataclass
class PublicNode:
    """The attacked node (`moeshard node --allow-any` on the whole model, pinned to the
    nodes' cores), the bound it printed, and the honest coordinator on the other cores."""

    node: Launched
    spec: PeerSpec
    bound: int  # bytes its requests and replies may hold at most, as it printed
    honest: Honest
    pin: list[str]  # the command prefix that puts a process on the nodes' cores
    ledger: Path

    def attacker(self, attack: NodeAttack) -> subprocess.Popen:
        """An attacker process of `attack` against the node, once it says it is attacking."""
        cmd = [
            *self.pin, sys.executable, "-m", "moeshard.bench.attacker", attack.mode,
            "--target", f"{self.spec.node_id}@{self.spec.addr}", *attack.flags,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        started = proc.stdout.readline()
        if not started.startswith("attacking"):
            proc.terminate()
            raise RuntimeError(f"attacker {attack.mode} did not start: {started!r}")
        return proc


@contextmanager
def public_node(model_dir: Path, tmp: Path, tokens: int):
    """A PublicNode for the block (its process stopped after it)."""
    tmp.mkdir(parents=True, exist_ok=True)
    honest_cores, node_cores = split_cores()
    pin = ["taskset", "-c", ",".join(map(str, sorted(node_cores)))]
    procs = NodeProcs(tmp)
    ledger = tmp / "l.jsonl"
    flags = ("--threads", "1", "--key", str(tmp / "node-key.pem"), "--ledger", str(ledger))
    node = procs.launch(Path(model_dir), None, flags=flags, allow_any=True, prefix=pin)
    try:
        spec = node.spec()
        bound = _bound(node)
        os.sched_setaffinity(0, honest_cores)
        honest = Honest(ModelDir(model_dir), [spec], client_key(tmp), tokens)
        yield PublicNode(node, spec, bound, honest, pin, ledger)
    finally:
        procs.close()


def node_attack_rows(
    model_dir: Path, tmp: Path, tokens: int = 32, rounds: int = 3, modes: list[str] | None = None
):
    """Each of ATTACKS (those of `modes`, default all) against a real node (see the module
    docstring): a list of AttackRow."""
    attacks = [a for a in ATTACKS if modes is None or a.mode in modes]
    with public_node(model_dir, tmp, tokens) as target:
        target.honest.run()  # warm-up: kernels compiled, pages cached
        return [_one(attack, target, rounds) for attack in attacks]


def _bound(node: Launched) -> int:
    """The bytes node's requests may hold at most, as it printed at start."""
    while True:
        line = node.lines.get(timeout=30)
        match = BOUND.search(line)
        if match:
            return int(match[1]) << 20
        if not line:
            raise RuntimeError(f"node on {node.path} printed no limits")


def _one(attack: NodeAttack, target: PublicNode, rounds: int) -> AttackRow:
    honest, addr, pid = target.honest, target.spec.addr, target.node.proc.pid
    files = (target.ledger, target.node.log)
    before, tokens, _ = honest.median(rounds)
    sizes = [_size(f) for f in files]
    idle_rss = rss_bytes(pid)
    attacker = target.attacker(attack)
    watch = RssWatch(pid)
    try:
        time.sleep(2.0)  # let the attack build up
        during, attacked_tokens, tables = honest.median(rounds)
    finally:
        attacker.terminate()
        attacker.wait()
        peak = watch.stop()
    bound = idle_rss + target.bound
    same = attacked_tokens == tokens
    bans = sum(t[addr].get("failures", 0) for t in tables)
    used = sum(t[addr]["calls"] for t in tables)
    ledger, log = (_size(f) - n for f, n in zip(files, sizes, strict=True))
    passed = during >= 0.5 * before and same and peak <= bound
    return AttackRow(
        attack=attack.name,
        metric="tok/s",
        before=before,
        during=during,
        peak_rss_mb=peak / 2**20,
        rss_bound_mb=bound / 2**20,
        same_output=same,
        passed=passed,
        goal=GOAL,
        notes=[
            f"attacked node used for {used} honest calls, banned {bans} times; its ledger "
            f"+{ledger / 1e3:.0f} KB, log +{log / 1e3:.0f} KB (honest runs included)"
        ],
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def soak(model_dir: Path, tmp: Path, seconds: float, every: float, tokens: int) -> None:
    """Every attack of ATTACKS at once against one node for `seconds` while the honest
    coordinator keeps generating; prints the node's RSS, ledger and log and the honest
    tokens/s every `every` seconds (growth without bound shows as a climbing column)."""
    with public_node(model_dir, tmp, tokens) as target:
        honest, pid = target.honest, target.node.proc.pid
        reference = honest.run()[1]
        idle = rss_bytes(pid)
        bound = idle + target.bound
        attackers = []
        try:
            attackers += [target.attacker(attack) for attack in ATTACKS]
            print(
                f"== soak: {len(ATTACKS)} attacks at once for {seconds:.0f} s; node idle RSS "
                f"{idle / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
            )
            print(
                f"   {'t s':>6} {'RSS MiB':>8} {'peak':>6} {'ledger KB':>10} {'log KB':>8} "
                f"{'tok/s':>7}"
            )
            watch = RssWatch(pid)
            t0 = time.monotonic()
            next_at, rates, differed = t0 + every, [], 0
            while True:
                rate, got, _ = honest.run()
                rates.append(rate)
                differed += got != reference
                now = time.monotonic()
                if now >= next_at or now - t0 >= seconds:
                    print(
                        f"   {now - t0:>6.0f} {rss_bytes(pid) / 2**20:>8.0f} "
                        f"{watch.peak / 2**20:>6.0f} {_size(target.ledger) / 1e3:>10.0f} "
                        f"{_size(target.node.log) / 1e3:>8.0f} {statistics.median(rates):>7.1f}",
                        flush=True,
                    )
                    next_at, rates = now + every, []
                if now - t0 >= seconds:
                    break
            peak = watch.stop()
        finally:
            for a in attackers:
                a.terminate()
                a.wait()
    within = "within" if peak <= bound else "OVER"
    print(
        f"   peak RSS {peak / 2**20:.0f} MiB ({within} the bound); honest runs with other "
        f"tokens than unattacked: {differed}"
    )
