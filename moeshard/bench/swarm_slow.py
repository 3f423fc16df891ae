"""`moeshard bench swarm --slow delay|cpu`: one slow node among 16, and what replica choice
and hedged requests do for the step latency's tail.

The nodes start once in their namespaces (each behind a relay adding `--rtt-ms`, the first
value) and one of them is slowed: `delay`, its relay adds ten times the others' round trip;
`cpu`, its process is held to a 5% CPU quota (a CFS quota in a cgroup); `stall`, it is
stopped for 150 ms every second (SIGSTOP/SIGCONT: fast most of the time, frozen now and then,
as a box whose owner's other work takes it). Then rounds
alternate between two routings, each a fresh coordinator (its latency estimates start anew)
greedy-decoding the same prompt:

- `previous`: replicas chosen by measured round trip and expert time alone, no hedging (the
  routing before queue reports and hedges);
- `hedged`: the default: the node's stated queue in the expected finish time, and a reply
  later than its node's recent p95 round trip hedged to another holder.

Prints p50 / p99 / max step latency per routing, hedges sent and won, and whether every round
made the same tokens.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from moeshard.bench.netbed import NetBed
from moeshard.bench.rpc_nodes import NodeProcs
from moeshard.bench.swarm import start_nodes
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.runtime import open_remote
from moeshard.moe.errors import MoeshardError

PROMPT = [1, 2, 3, 4]
ROUTINGS = {"previous": {"hedge": False, "queue_aware": False}, "hedged": {}}
CPU_QUOTA = (5000, 100000)  # the slow node's CFS quota: 5 ms of CPU per 100 ms
STALL = (0.15, 1.0)  # the stalling node is stopped this long (s) every this long (s)


class Staller:
    """Stops a process (SIGSTOP) for STALL[0] s every STALL[1] s, until stop(): a node that is
    fast most of the time and freezes now and then (a box whose owner's other work takes it,
    swapping, a stop-the-world pause)."""

    def __init__(self, pid: int):
        self.pid, self.done = pid, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(STALL[1] - STALL[0]):
            os.kill(self.pid, signal.SIGSTOP)
            time.sleep(STALL[0])
            os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        os.kill(self.pid, signal.SIGCONT)


class CpuCap:
    """A cgroup (v1 cpu hierarchy, or v2) holding processes to a CPU quota."""

    def __init__(self, name: str):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        self.v2 = v2.exists()
        root = Path("/sys/fs/cgroup") if self.v2 else Path("/sys/fs/cgroup/cpu")
        if not (root / "cgroup.procs").exists():
            raise MoeshardError("--slow cpu: no cgroup cpu controller here")
        self.path = root / name

    def hold(self, pid: int, quota_us: int, period_us: int) -> None:
        self.path.mkdir(exist_ok=True)
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota_us} {period_us}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if not self.path.exists():
            return
        parent = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                parent.write_text(pid)
            except OSError:
                pass  # already gone
        self.path.rmdir()


def run_slow(args, work: Path, key, shard) -> int:
    """The comparison (see the module docstring); `shard(n)` -> (shards dir, plan)."""
    n, rtt = 16, [float(v) for v in args.rtt_ms.split(",")][0]
    shards, plan = shard(n)
    slow = n // 2  # an arbitrary node in the middle of the plan
    bed = NetBed(n, args.prefix, args.subnet, work)
    cap = CpuCap(f"{args.prefix}-slow")
    procs = NodeProcs(work)
    staller = None
    try:
        bed.create()
        for i in range(n):
            bed.set_delay(i, (10 if args.slow == "delay" and i == slow else 1) * rtt / 2)
        bed.wait_relays()
        peers = start_nodes(bed, procs, plan, key)
        if args.slow == "cpu":
            cap.hold(procs.procs[slow].pid, *CPU_QUOTA)
        if args.slow == "stall":
            staller = Staller(procs.procs[slow].pid)
        what = {
            "delay": f"+{10 * rtt:g} ms round trip",
            "cpu": "a 5% CPU quota",
            "stall": f"stalls of {STALL[0] * 1e3:.0f} ms every {STALL[1]:g} s",
        }[args.slow]
        print(
            f"16 nodes in namespaces, +{rtt:g} ms each; node {slow} slowed by {what}; "
            f"{args.rounds} alternated rounds of {args.tokens} tokens per routing"
        )
        steps: dict[str, list[float]] = {r: [] for r in ROUTINGS}
        tokens: dict[str, list] = {r: [] for r in ROUTINGS}
        hedges = {r: [0, 0] for r in ROUTINGS}
        slow_calls = dict.fromkeys(ROUTINGS, 0)
        for i in range(args.rounds):
            order = list(ROUTINGS) if i % 2 == 0 else list(reversed(ROUTINGS))
            for routing in order:
                config = RemoteConfig(
                    identity=key, audit=0.0, challenge_interval_s=0.0, **ROUTINGS[routing]
                )
                rt = open_remote(shards / "coordinator", peers=peers, remote_config=config)
                try:
                    opts = SamplingOptions(max_tokens=args.tokens + 1)
                    r = generate(rt.transformer, PROMPT, opts)
                    stats = rt.transformer.experts.stats()
                finally:
                    rt.close()
                steps[routing] += r.decode_s
                tokens[routing].append(r.tokens)
                slow_calls[routing] += stats["nodes"][slow]["calls"]
                hedges[routing][0] += stats["hedges"]
                hedges[routing][1] += stats["hedge_wins"]
        same = all(t == tokens["previous"][0] for ts in tokens.values() for t in ts)
        p99 = {}
        for routing, s in steps.items():
            ms = np.array(s) * 1e3
            p99[routing] = float(np.percentile(ms, 99))
            print(
                f"  {routing:<9} step p50 {statistics.median(ms):7.1f} ms, p99 "
                f"{p99[routing]:7.1f} ms, max {ms.max():7.1f} ms over {len(ms)} steps; "
                f"hedges {hedges[routing][0]}, answered by the hedge {hedges[routing][1]}; "
                f"the slowed node got {slow_calls[routing]} calls"
            )
        ratio = p99["previous"] / p99["hedged"]
        print(
            f"p99 previous / hedged: {ratio:.2f}x; tokens "
            f"{'identical in every round' if same else 'DIFFER between rounds'}"
        )
        return 0 if same else 1
    finally:
        if staller is not None:
            staller.stop()
        procs.close()
        cap.close()
        bed.close()
