"""What `moeshard bench swarm` measures before each run, to give the simulator: a node's round
trip beyond its compute and its kernel for one expert (one-row Forwards straight to it), and
the CPU this machine spends on one node's share of a layer call and on one prefetch hint
(through the coordinator's real path, timed by /proc/stat); after the run, the nodes' cache
and read counters (Info)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb

BURST = 3  # hints sent to a node at once (it admits 4 calls open per client, the stream one)
NODE_COUNTERS = ("hits", "accesses", "bytes_read", "predicted_used", "used_after_hint")


@dataclass
class Probed:
    call_ms: list[float]  # per node (plan order): a one-row Forward's round trip beyond compute
    expert_ms: float  # a node's kernel for one expert in its cache (median over nodes)
    call_cpu_ms: float  # this machine's CPU per node call of a layer, beyond its kernels
    hint_cpu_ms: float  # ... per prefetch hint

    @staticmethod
    def mean(a: Probed, b: Probed) -> Probed:
        """The two probes averaged (one before a run, one after: a shared machine drifts)."""
        return Probed(
            [(x + y) / 2 for x, y in zip(a.call_ms, b.call_ms, strict=True)],
            (a.expert_ms + b.expert_ms) / 2,
            (a.call_cpu_ms + b.call_cpu_ms) / 2,
            (a.hint_cpu_ms + b.hint_cpu_ms) / 2,
        )


def busy_cpu_s() -> float:
    """CPU seconds this machine has been busy (all cores, every process: /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def probe_all(experts, plan: dict) -> Probed:
    peers = experts.peers.peers  # in the plan's order
    direct = [direct_ms(experts, peer, plan["nodes"][i]) for i, peer in enumerate(peers)]
    expert_ms = statistics.median(d[1] for d in direct)
    call, hint = path_cpu_ms(experts, plan, expert_ms, idle_cores())
    return Probed([d[0] for d in direct], expert_ms, call, hint)


def idle_cores(seconds: float = 1.0) -> float:
    """The cores this machine keeps busy while nothing is asked of it (the daemons' timers
    and pollers, other tenants): not charged to what a probe measures."""
    t0, c0 = time.perf_counter(), busy_cpu_s()
    time.sleep(seconds)
    return (busy_cpu_s() - c0) / (time.perf_counter() - t0)


class CpuSpent:
    """CPU seconds the machine spent beyond its idle load over a `with` block."""

    def __init__(self, idle: float):
        self.idle, self.seconds = idle, 0.0

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), busy_cpu_s()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        self.seconds = busy_cpu_s() - self.c0 - self.idle * wall


def direct_ms(experts, peer, node: dict, calls: int = 7) -> tuple[float, float]:
    """(ms of a one-row Forward beyond the node's compute, ms of its compute) to `peer`,
    medians of `calls` calls for one expert it holds (read once first, then cached)."""
    layer, expert = node["experts"][0]
    request = pb.ForwardRequest(
        model_id=experts.model_id,
        layer=layer,
        hidden=codec.encode(np.ones((1, experts.hidden_size), np.float32)),  # [1, H]
        ids=codec.encode(np.full((1, 1), expert, np.int32), codec.I32),  # [1, 1]
        weights=codec.encode(np.ones((1, 1), np.float32)),  # [1, 1]
        out_dtype=codec.F64,
    )
    beyond, compute = [], []
    for i in range(calls + 1):
        t0 = time.perf_counter()
        reply = peer.stub.Forward(request, timeout=10.0)
        if i:  # the first call read the record
            beyond.append((time.perf_counter() - t0) * 1e3 - reply.compute_ms)
            compute.append(reply.compute_ms)

    return statistics.median(beyond), statistics.median(compute)


def path_cpu_ms(
    experts, plan: dict, expert_ms: float, idle: float, calls: int = 100
) -> tuple[float, float]:
    """Milliseconds of this machine's CPU (coordinator, relays and nodes together) that one
    node's share of a layer call costs beyond its kernel, and one prefetch hint: (call,
    hint). The calls through the coordinator's real path, on a layer call that fans out to
    every node at once (a row routed to one expert each holds, in their caches), so the cost
    of many calls in flight together is in it; the hints straight to every node at once, a
    few each (one after another, a long round trip made the probe's wall time, and the idle
    load's error with it, large beside the hints' own CPU: 0.9 -> 2.4 ms at +10 ms). The
    machine's `idle` load is not charged to them."""
    layer = plan["nodes"][0]["experts"][0][0]
    mine = sorted({next(e for lay, e in n["experts"] if lay == layer) for n in plan["nodes"]})
    hidden = np.ones((1, experts.hidden_size), np.float32)  # [1, H]
    ids = np.array([mine])  # [1, k]
    weights = np.full((1, len(mine)), 1 / len(mine), np.float32)  # [1, k]
    for _ in range(3):  # read once, then in the nodes' caches
        experts(layer, hidden, ids, weights)
    before = sum(p.calls for p in experts.peers.peers)
    with CpuSpent(idle) as fanned:
        for _ in range(calls):
            experts(layer, hidden, ids, weights)
    node_calls = sum(p.calls for p in experts.peers.peers) - before
    call = (fanned.seconds * 1e3 - calls * len(mine) * expert_ms) / node_calls
    peers = experts.peers.peers  # in the plan's order
    own = [next(e for lay, e in n["experts"] if lay == layer) for n in plan["nodes"]]
    hints = [pb.PrefetchRequest(model_id=experts.model_id, layer=layer, experts=[e]) for e in own]
    with CpuSpent(idle) as hinted:  # every node's hint at once, BURST at a time to each: the
        for _ in range(0, calls, BURST):  # idle load's error grows with the probe's wall time
            sent = [p.stub.Prefetch.future(h, timeout=10.0) for _ in range(BURST)
                    for p, h in zip(peers, hints, strict=True)]  # fmt: skip
            for hint in sent:  # blocking waits: no polling on the CPU
                hint.result()
    hinted.seconds /= len(peers) * BURST * len(range(0, calls, BURST))
    return max(call, 0.0), max(hinted.seconds * 1e3, 0.0)


def node_counters(experts) -> dict:
    """The nodes' cache and read counters summed, and the coordinator's wire bytes."""
    out = dict.fromkeys(NODE_COUNTERS, 0.0)
    for p in experts.live_peers():
        info = p.stub.Info(pb.InfoRequest(nonce=os.urandom(16)), timeout=5.0)
        for k in out:
            out[k] += info.stats.get(k, 0.0)
    out["wire"] = experts.bytes_sent + experts.bytes_received
    return out
