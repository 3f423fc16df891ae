"""`moeshard simulate TRACE --swarm FILE`: what a network of nodes does for a model.

The swarm file (TOML) describes the coordinator, the node classes and how they are used:

    replicas = 2            # copies of every expert (`moeshard shard --replicas`)
    batch = 1               # sequences each coordinator decodes together
    coordinators = 1        # coordinators sharing the same nodes
    wire = "f32"            # activations sent (f32 or bf16); partial sums come back in f64
    placement = "equal"     # equal, or "ram": each node weighted by its RAM (`shard --capacity`)
    hedge = true            # hedged requests, as the runtime sends them
    replica_choice = "finish"  # finish: the holder that would finish its share of the layer
                            # first, as the runtime chooses (RemoteExperts._assign); rank:
                            # the first holder, as placed; least-busy: the fewest experts
    [coordinator]
    ram = "64G"             # the trunk is resident when it fits in 90% of this, else streamed
    trunk = "q8_0"          # the trunk's format (default: as the geometry has it)
    disk = "pcie4-nvme"     # a disk profile name or file (`moeshard bench disk`)
    memory_gbps = 20        # trunk compute: its bytes over this
    trunk_hosts = 1         # a model of the trunk split over this many hosts tensor-parallel
                            # (each reads 1/n of every layer; two exchanges per layer)
    trunk_rtt_ms = 0.3      # the round trip between those hosts
    layer_overhead_ms = 0.1 # per layer beyond the trunk's bytes: router, glue, the fan-out
    [[nodes]]               # a class of nodes; several classes may be listed
    count = 16
    ram = "8G"              # expert cache (records beyond it are read from the node's disk)
    disk = "pcie4-nvme"
    kernel_gbps = 7         # expert kernel throughput: a record's bytes over this
    rtt_ms = [0.2, 0.5]     # each node's round trip to the coordinator, drawn in this range
    link_gbit = 1           # each node's link, each way
    call_overhead_ms = 1.0  # per request beyond the wire: gRPC, encoding, both ends' Python
    stall_ms = 0            # nodes of this class freeze this long every stall_every_s
    stall_every_s = 0       # (0: never; e.g. 150 and 1.0 for a box its owner also uses)

Placement is `moeshard shard`'s own plan (`placement.plan_placement`, balanced by the trace's
usage), or a real plan's (`bench swarm`). Each node is simulated in time
(`swarm_nodes.SimNode`): its LRU cache, its disk's queue, its cores. Per decode step and MoE
layer, the coordinator computes the layer's trunk, then sends one request to every node holding
a routed expert (the replica chosen by `replica_choice`), all at once, and the next layer's
prefetch hint right after them (the hints the real run sent, when the trace recorded them at
the trace's own geometry; else a guess of `prefetch_recall` of the next layer's experts, the
rest wrong; every hinted record not cached is read); the layer waits for the slowest reply:

    reply = RTT + call overhead + (rows out + partial sums back) / link + queueing
            + waiting for the node's disk (its missed records, behind the reads already
              queued there: earlier misses and prefetches) and cores + its experts' compute

and the coordinator's per-call cost for every node beyond the first. A prefetched record still
in flight counts as a hit, as the store counts it. With `shared_host` every node runs on one
machine (`moeshard bench swarm`): one disk queue, `host_cores` cores that the nodes' kernels and
each call's and hint's processing (`host_call_cpu_ms`, `host_hint_cpu_ms`) share, and the
trunk shares them too.

The two overheads' defaults were measured on this project's 2-core AMD EPYC: a layer's call to
one node on loopback took 1.02-1.07 ms at p50 (`moeshard bench rpc out/demo --nodes 3`,
"RemoteExperts, 1 node(s), stream"), and the demo decoded in RAM at 0.7 ms a token over its
6 layers, of which its trunk's bytes explain about a third. `moeshard bench swarm` checks the
whole model against real node daemons in network namespaces (docs/results.md).

With M coordinators the nodes share their time: the queueing is an M/D/1 wait on each node's
load, and the swarm's tokens/s is capped by its busiest node (`SwarmResult.bound`).
A trace's tokens come from `simulate.project` (its layers reused cyclically and its expert ids
scaled at another geometry), as in the single-box simulation, and the prompt's experts
(`simulate.prefill_sets`) are put in the caches first.

Hedged requests are sent as the runtime sends them (`swarm_hedge`; `hedge = false` turns
them off); a node class may stall (`stall_ms` every `stall_every_s`, each node at a phase of
its own), and the result's `p99_step_s` shows what hedging does to the tail.
"""

from __future__ import annotations

import math
import tomllib
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np

from moeshard.moe.analysis.disk import Disk
from moeshard.moe.analysis.placement import plan_placement
from moeshard.moe.analysis.simulate import Geometry, _predict, with_trunk
from moeshard.moe.analysis.swarm_hedge import Latencies, hedge_layer
from moeshard.moe.analysis.swarm_nodes import SimNode, Timeline
from moeshard.moe.errors import MoeshardError
from moeshard.moe.units import parse_size

WIRE_BYTES = {"f32": 4, "bf16": 2}  # per activation sent; partial sums come back as float64
RESULT_BYTES = 8
REPLICA_CHOICES = ("finish", "rank", "least-busy")
CALL_COST_S = 0.3e-3  # one more node in a layer, as the runtime scores it (call_cost_ms)
TRUNK_RAM_SHARE = 0.9  # the trunk is resident when it fits in this share of the coordinator's RAM


@dataclass(frozen=True)
class NodeClass:
    count: int
    ram: int  # bytes of expert cache
    disk: Disk
    kernel_gbps: float
    rtt_ms: tuple[float, float]  # each node's round trip, drawn uniformly in [low, high]
    link_gbit: float
    call_overhead_ms: float = 1.0
    stall_ms: float = 0.0  # a node that freezes this long ...
    stall_every_s: float = 0.0  # ... this often (0: never), at a phase of its own


@dataclass(frozen=True)
class Coordinator:
    ram: int
    trunk: str | None
    disk: Disk
    memory_gbps: float
    trunk_hosts: int = 1  # tensor-parallel hosts the trunk is split over (a model: not built)
    trunk_rtt_ms: float = 0.3
    layer_overhead_ms: float = 0.1
    trunk_ms: float = 0.0  # measured trunk time per token (replaces the bytes model above)


@dataclass(frozen=True)
class Swarm:
    coordinator: Coordinator
    nodes: tuple[NodeClass, ...]
    replicas: int = 2
    batch: int = 1
    coordinators: int = 1
    wire: str = "f32"
    replica_choice: str = "finish"
    prefetch_recall: float = 0.8
    placement: str = "equal"
    hedge: bool = True  # hedged requests, as the runtime sends them (`swarm_hedge`)
    shared_host: bool = False  # every node on one machine (`bench swarm`): their disk reads
    # and expert compute share its disk and cores, so a layer's node work adds up
    host_call_cpu_ms: float = 0.0  # shared host: the CPU time one call costs (both ends)
    host_hint_cpu_ms: float = 0.0  # ... and one prefetch hint
    host_read_cpu_ms: float = 0.0  # ... and one record read (syscall, pinning, checksum)
    host_cores: int = 1  # shared host: its cores; each node's kernels run on one of them

    @property
    def node_count(self) -> int:
        return sum(c.count for c in self.nodes)

    def with_nodes(self, count: int) -> Swarm:
        """The swarm with `count` nodes of its (one) node class: for sweeps."""
        if len(self.nodes) != 1:
            raise MoeshardError("--nodes scales a swarm of one node class; this file has more")
        return replace(self, nodes=(replace(self.nodes[0], count=count),))


def load_swarm(path: str | Path) -> Swarm:
    """The swarm in a TOML file, every field checked (one line naming the file and field)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MoeshardError(f"{path}: not a readable swarm file ({exc})") from None
    where = str(path)
    c = _table(raw, "coordinator", where)
    coordinator = Coordinator(
        ram=_size(c, "ram", where),
        trunk=c.get("trunk"),
        disk=Disk.load(str(c.get("disk", "pcie4-nvme"))),
        memory_gbps=_positive(c, "memory_gbps", where, 20.0),
        trunk_hosts=int(c.get("trunk_hosts", 1)),
        trunk_rtt_ms=float(c.get("trunk_rtt_ms", 0.3)),
        layer_overhead_ms=_non_negative(c, "layer_overhead_ms", where, 0.1),
    )
    if coordinator.trunk_hosts < 1 or coordinator.trunk_rtt_ms < 0:
        raise MoeshardError(f"{where}: trunk_hosts must be at least 1, trunk_rtt_ms >= 0")
    classes = raw.get("nodes")
    if not isinstance(classes, list) or not classes:
        raise MoeshardError(f"{where}: needs at least one [[nodes]] class")
    nodes = []
    for i, n in enumerate(classes):
        at = f"{where} [[nodes]] #{i + 1}"
        rtt = n.get("rtt_ms", [0.3, 0.3])
        rtt = (rtt, rtt) if isinstance(rtt, int | float) else tuple(rtt)
        if len(rtt) != 2 or not all(isinstance(v, int | float) and v >= 0 for v in rtt):
            raise MoeshardError(f"{at}: rtt_ms must be a number or [low, high] in ms")
        count = n.get("count")
        if not isinstance(count, int) or count < 1:
            raise MoeshardError(f"{at}: count must be a positive integer")
        nodes.append(
            NodeClass(
                count=count,
                ram=_size(n, "ram", at),
                disk=Disk.load(str(n.get("disk", "pcie4-nvme"))),
                kernel_gbps=_positive(n, "kernel_gbps", at, 7.0),
                rtt_ms=(float(min(rtt)), float(max(rtt))),
                link_gbit=_positive(n, "link_gbit", at, 1.0),
                call_overhead_ms=_non_negative(n, "call_overhead_ms", at, 1.0),
                stall_ms=_non_negative(n, "stall_ms", at, 0.0),
                stall_every_s=_non_negative(n, "stall_every_s", at, 0.0),
            )
        )
    swarm = Swarm(
        coordinator,
        tuple(nodes),
        replicas=int(raw.get("replicas", 2)),
        batch=int(raw.get("batch", 1)),
        coordinators=int(raw.get("coordinators", 1)),
        wire=str(raw.get("wire", "f32")),
        replica_choice=str(raw.get("replica_choice", "finish")),
        prefetch_recall=float(raw.get("prefetch_recall", 0.8)),
        placement=str(raw.get("placement", "equal")),
        hedge=_flag(raw, "hedge", where, True),
    )
    check(swarm, where)
    return swarm


def check(swarm: Swarm, where: str) -> None:
    if not 1 <= swarm.replicas <= swarm.node_count:
        raise MoeshardError(f"{where}: replicas {swarm.replicas} for {swarm.node_count} nodes")
    if swarm.batch < 1 or swarm.coordinators < 1:
        raise MoeshardError(f"{where}: batch and coordinators must be at least 1")
    if swarm.wire not in WIRE_BYTES:
        raise MoeshardError(f"{where}: wire {swarm.wire!r}: f32 or bf16")
    if swarm.replica_choice not in REPLICA_CHOICES:
        choices = ", ".join(REPLICA_CHOICES)
        raise MoeshardError(f"{where}: replica_choice {swarm.replica_choice!r}: one of {choices}")
    if swarm.placement not in ("equal", "ram"):
        raise MoeshardError(f"{where}: placement {swarm.placement!r}: equal or ram")
    if not 0 <= swarm.prefetch_recall <= 1:
        raise MoeshardError(f"{where}: prefetch_recall must be between 0 and 1")


def _table(raw: dict, name: str, where: str) -> dict:
    value = raw.get(name)
    if not isinstance(value, dict):
        raise MoeshardError(f"{where}: needs a [{name}] table")
    return value


def _size(raw: dict, key: str, where: str) -> int:
    if key not in raw:
        raise MoeshardError(f"{where}: missing {key}")
    return parse_size(str(raw[key]))


def _flag(raw: dict, key: str, where: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise MoeshardError(f"{where}: {key} must be true or false")
    return value


def _non_negative(raw: dict, key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise MoeshardError(f"{where}: {key} must be a number >= 0")
    return float(value)


def _positive(raw: dict, key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise MoeshardError(f"{where}: {key} must be a positive number")
    return float(value)


def trunk_layer_s(g: Geometry, coord: Coordinator) -> float:
    """Seconds of one layer's trunk on the coordinator: its share of the trunk's bytes over the
    memory bandwidth when the share fits in RAM, else over its disk's (streamed; compute
    overlaps the read). Split over `trunk_hosts` hosts, each reads 1/n of the layer at once and
    the layer costs two exchanges between them (after attention and after the MLP)."""
    if coord.trunk_ms:
        return coord.trunk_ms / 1e3 / g.layers
    hosts = coord.trunk_hosts
    share = g.trunk_bytes / g.layers / hosts  # bytes of one layer on one host
    if g.trunk_bytes / hosts <= TRUNK_RAM_SHARE * coord.ram:
        s = share / (coord.memory_gbps * 1e9)
    else:
        s = max(share / (coord.disk.gbps(8 << 20, 4) * 1e9), share / (coord.memory_gbps * 1e9))
    s += coord.layer_overhead_ms / 1e3
    return s + (2 * coord.trunk_rtt_ms / 1e3 if hosts > 1 else 0.0)


@dataclass
class SwarmResult:
    nodes: int
    s_per_token: float  # one sequence's seconds per token
    tokens_per_s: float  # the swarm's, over every coordinator and sequence
    bound: str  # what limits tokens_per_s: "latency" or "node <i> busy"
    hit_rate: float  # the nodes' expert caches
    wire_bytes_per_token: float  # one coordinator's, both ways
    read_bytes_per_token: float = 0.0  # the nodes' disk reads (misses and prefetches)
    p99_step_s: float = 0.0  # the 99th percentile of one step's time
    hedges_per_token: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # seconds per step on the critical path


def simulate_swarm(
    tokens: list[np.ndarray],
    g: Geometry,
    swarm: Swarm,
    seed: int = 0,
    placed: list[list[tuple[int, int]]] | None = None,
    warm: list[np.ndarray] | None = None,
    hints: list[list[np.ndarray]] | None = None,
) -> SwarmResult:
    """Predicted decode of `tokens` (per token: [layers, k] expert keys, `simulate.project`);
    `hints` (per token, per layer: the keys the runtime's hint predicted, `simulate.project_hints`)
    replays the hints a real run sent instead of guessing them at `prefetch_recall`;
    `placed`: the (MoE layer index, expert) keys each node holds, when a real shard plan is
    replayed (default: `plan_placement` on the trace's usage); `warm` (per layer, the prompt's
    experts: `simulate.prefill_sets`) is put in the chosen holders' caches first, uncounted."""
    if not g.row_width:
        raise MoeshardError(f"geometry {g.name}: the experts' row width is not known")
    if swarm.coordinator.trunk:
        g = with_trunk(g, swarm.coordinator.trunk)
    rng = np.random.default_rng(seed)
    nodes = [c for c in swarm.nodes for _ in range(c.count)]  # one NodeClass per node
    rtt = [rng.uniform(*c.rtt_ms) / 1e3 for c in nodes]  # seconds
    usage = Counter(int(k) for t in tokens for k in t.reshape(-1))
    keys = range(g.layers * g.n_experts)
    mean = sum(usage.values()) / len(keys)
    loads = {(k // g.n_experts, k % g.n_experts): usage.get(k, 0) + 1e-3 * mean for k in keys}
    capacity = [float(c.ram) for c in nodes] if swarm.placement == "ram" else None
    if placed is None:
        placed = plan_placement(loads, g.record_bytes, len(nodes), swarm.replicas, capacity)
    holders: dict[int, list[int]] = {}
    for n, held in enumerate(placed):
        for layer, expert in held:
            holders.setdefault(layer * g.n_experts + expert, []).append(n)
    shared_disk, shared_cpu = Timeline(), Timeline(swarm.host_cores)
    sim_nodes = [
        SimNode(
            g,
            c.ram,
            c.disk,
            c.kernel_gbps,
            shared_disk if swarm.shared_host else Timeline(),
            shared_cpu if swarm.shared_host else Timeline(),
            swarm.host_read_cpu_ms / 1e3 if swarm.shared_host else 0.0,
            (c.stall_ms / 1e3, c.stall_every_s, float(rng.uniform(0, c.stall_every_s or 1))),
        )
        for c in nodes
    ]
    trunk_s = trunk_layer_s(g, swarm.coordinator)
    expert_s = [node.expert_s for node in sim_nodes]

    def finish_s(n: int, taken: int) -> float:
        """When node n would finish its share of the layer with one expert more: the runtime's
        score (its round trip and overhead, its experts' time; a node not yet in the layer
        costs the coordinator one more call)."""
        fixed = rtt[n] + nodes[n].call_overhead_ms / 1e3
        return fixed + (taken + 1) * expert_s[n] + (0.0 if taken else CALL_COST_S)

    def assign(keys) -> dict[int, list[int]]:
        """node -> the keys it computes, chosen by `replica_choice`."""
        work: dict[int, list[int]] = {}
        for key in sorted(keys):
            options = holders[key]
            if swarm.replica_choice == "finish":
                n = min(options, key=lambda n: finish_s(n, len(work.get(n, ()))))
            elif swarm.replica_choice == "least-busy":
                n = min(options, key=lambda n: (len(work.get(n, ())), sim_nodes[n].busy_s, n))
            else:
                n = options[0]
            work.setdefault(n, []).append(key)
        return work

    for layer_keys in warm or []:
        for n, mine in assign(int(k) for k in layer_keys).items():
            sim_nodes[n].warm(mine)
    latencies, hedges, step_s = Latencies(len(nodes)), 0, []

    def mdl_wait(n: int, work_s: float, prev_layer_s: float) -> float:
        """M coordinators: node n's share of their work, as an M/D/1 wait on `work_s`."""
        rho = min(0.95, (swarm.coordinators - 1) * work_s / max(
            prev_layer_s or (rtt[n] + work_s), 1e-9))  # fmt: skip
        return rho / (2 * (1 - rho)) * work_s

    def hedged(work: dict, sent: float, prev: float, n: int, at: float) -> float | None:
        """When node n's share, sent at `at` to the other holders of its experts, is back
        (each waiting its own M/D/1 queue too)."""
        alt: dict[int, list[int]] = {}
        for key in work[n]:
            others = [m for m in holders[key] if m != n]
            if not others:
                return None
            m = min(others, key=lambda m: finish_s(m, len(alt.get(m, ()))))
            alt.setdefault(m, []).append(key)
        back = at
        for m, mine in alt.items():
            network = (
                rtt[m] + nodes[m].call_overhead_ms / 1e3 + sent / (nodes[m].link_gbit * 1e9 / 8)
            )
            call, _ = sim_nodes[m].receive(mine, at + network / 2, swarm.host_call_cpu_ms / 1e3)
            ready = sim_nodes[m].compute(call)[0]
            wait = mdl_wait(m, ready - at - network / 2, prev)
            back = max(back, ready + network / 2 + wait)
        return back

    if hints is not None and len(hints) != len(tokens):
        raise MoeshardError(f"{len(hints)} tokens of hints for {len(tokens)} tokens of routing")
    starts = range(0, len(tokens), swarm.batch)
    steps = [range(i, min(i + swarm.batch, len(tokens))) for i in starts]
    steps = [s for s in steps if len(s) == swarm.batch] or [range(min(swarm.batch, len(tokens)))]
    parts = Counter()
    now = 0.0
    hits = accesses = 0
    wire = 0.0
    prev_layer_s = 0.0
    timelines = {id(t): t for node in sim_nodes for t in (node.disk_line, node.cpu_line)}
    for step in steps:
        step_start = now
        for timeline in timelines.values():  # nothing is booked before the coordinator's now
            timeline.forget_before(now)
        for i in range(g.layers):
            keys = {int(k) for t in step for k in tokens[t][i]}
            work = assign(keys)
            if swarm.shared_host:  # the trunk shares the cores with the nodes' leftover work
                now = shared_cpu.take_all(now, trunk_s)
            else:
                now += trunk_s  # the router has run: the calls go out
            rows = len(step)  # every row of the step goes to a node with any of its experts
            sent = rows * g.row_width * (WIRE_BYTES[swarm.wire] + RESULT_BYTES)
            call_cpu = swarm.host_call_cpu_ms / 1e3
            received, network_of = {}, {}
            for n, mine in sorted(work.items(), key=lambda item: rtt[item[0]]):
                c = nodes[n]
                network_of[n] = rtt[n] + c.call_overhead_ms / 1e3 + sent / (c.link_gbit * 1e9 / 8)
                wire += sent
                received[n], got = sim_nodes[n].receive(mine, now + network_of[n] / 2, call_cpu)
                hits += got
                accesses += len(mine)
            # the next layer's hint goes out right after the calls, before their replies
            if hints is not None and i + 1 < g.layers:
                guess = {int(k) for t in step for k in hints[t][i + 1]}
            elif swarm.prefetch_recall > 0 and i + 1 < g.layers:
                guess = {k for t in step for k in _predict(
                    tokens[t][i + 1], g, swarm.prefetch_recall, rng)}  # fmt: skip
            else:
                guess = set()
            if guess:
                for n, mine in assign(guess).items():
                    sim_nodes[n].prefetch(mine, now + rtt[n] / 2, swarm.host_hint_cpu_ms / 1e3)
            replies, compute_of = {}, {}  # node -> [reply time, network, queueing]
            for n, call in received.items():
                ready, compute_of[n] = sim_nodes[n].compute(call)
                network = network_of[n]
                queue = mdl_wait(n, ready - now - network / 2, prev_layer_s)
                replies[n] = [ready + network / 2 + queue, network, queue]
            if swarm.hedge:
                hedges += hedge_layer(
                    replies, now, latencies, partial(hedged, work, sent, prev_layer_s)
                )
            last = max(replies, key=lambda n: replies[n][0])
            done, network, queue = replies[last]
            end = done + CALL_COST_S * (len(work) - 1)  # the coordinator reads every reply
            wait = end - now - network - queue - compute_of[last]
            parts.update({"trunk": trunk_s, "network": network, "queueing": queue,
                          "disk": max(0.0, wait), "compute": compute_of[last]})  # fmt: skip
            prev_layer_s = end - now + trunk_s
            now = end
        step_s.append(now - step_start)
    total = now
    busy = np.array([node.busy_s for node in sim_nodes])
    n_steps = len(steps)
    s_token = total / n_steps
    per_token_busy = busy / (n_steps * swarm.batch)  # [nodes] seconds of work per token
    by_latency = swarm.coordinators * swarm.batch / s_token
    worst = int(np.argmax(per_token_busy))
    by_nodes = 1 / per_token_busy[worst] if per_token_busy[worst] > 0 else math.inf
    tokens_per_s, bound = min((by_latency, "latency"), (by_nodes, f"node {worst} busy"))
    if bound != "latency":  # saturated: each user gets its share of the busiest node
        s_token = swarm.coordinators * swarm.batch / tokens_per_s
    return SwarmResult(
        nodes=len(nodes),
        s_per_token=s_token,
        tokens_per_s=tokens_per_s,
        bound=bound,
        hit_rate=hits / max(accesses, 1),
        wire_bytes_per_token=wire / (n_steps * swarm.batch),
        read_bytes_per_token=sum(n.read_bytes for n in sim_nodes) / (n_steps * swarm.batch),
        p99_step_s=float(np.percentile(step_s, 99)),
        hedges_per_token=hedges / (n_steps * swarm.batch),
        parts={k: v / n_steps for k, v in parts.items()},
    )


def table(results: list[SwarmResult], g: Geometry, swarm: Swarm, label: str) -> str:
    """One line per result: s/token, the swarm's tokens/s, and where a step's time goes."""
    lines = [
        f"{label}: geometry {g.name} ({g.layers} MoE layers, {g.n_experts} experts of "
        f"{g.record_bytes / 1e6:.1f} MB, top-{g.top_k}); replicas {swarm.replicas}, batch "
        f"{swarm.batch}, {swarm.coordinators} coordinator(s), replica choice "
        f"{swarm.replica_choice}, placement {swarm.placement}, wire {swarm.wire}, hedging "
        f"{'on' if swarm.hedge else 'off'}",
        f"{'nodes':>6} {'s/token':>9} {'p99 step':>9} {'swarm tok/s':>12} {'bound':>14} "
        f"{'hit':>6} {'wire KB/tok':>11}  per step: trunk / network / queueing / disk / "
        "compute (s)",
    ]
    for r in results:
        p = r.parts
        lines.append(
            f"{r.nodes:>6} {r.s_per_token:>9.3f} {r.p99_step_s:>9.3f} {r.tokens_per_s:>12.2f} "
            f"{r.bound:>14} "
            f"{r.hit_rate:>6.1%} {r.wire_bytes_per_token / 1e3:>11.1f}  "
            f"{p.get('trunk', 0):.3f} / {p.get('network', 0):.3f} / {p.get('queueing', 0):.3f} / "
            f"{p.get('disk', 0):.3f} / {p.get('compute', 0):.3f}"
        )
    return "\n".join(lines)
