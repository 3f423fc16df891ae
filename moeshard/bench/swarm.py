"""`moeshard bench swarm`: real node daemons in their own network namespaces, with added
round trips, against what `moeshard simulate --swarm` predicts for the same swarm.

For each node count (`--nodes 4,8,16`) the model (a K3-shaped one written by `synth --preset
k3-mini`, scaled to fit: `--experts`, `--inter`) is split by `moeshard shard` with 2 replicas;
for each added round trip (`--rtt-ms 0.2,2,10`) the nodes start afresh (cold caches) in their
namespaces (`moeshard.bench.netbed`) with `--ram` caps of `--ram-share` of the records each
holds, so they read from their disks, and this process, the coordinator, greedy-decodes
`--tokens` tokens through them with mutual TLS. Then the simulator is given what was measured
around that run, not assumed (`moeshard.bench.swarm_probes`):

- the placement `shard` wrote, and each node's cache (its `--ram` over the record size);
- each node's round trip beyond its compute and its kernel for one expert (one-row Forwards
  straight to it), and this machine's CPU per node call and per prefetch hint (through the
  coordinator's real path), probed before and after the run and averaged;
- the coordinator's trunk per token, from a profiled decode of the model in RAM;
- this machine's disk (O_DIRECT reads of the model's records at record size) and the CPU one
  read through the store's reader costs;
- the run's trace, replayed: its routing and the prefetch hints it sent;

and prints, per configuration, the node caches' hit rate and bytes on the wire per token, both
measured and simulated, ending `measured A s/token, simulated B s/token (error C%)`; exit 1
unless every configuration is within 15%. Every node runs on this one machine: `shared_host`
in the swarm tells the simulator so (the nodes' reads, kernels and calls share these cores and
this disk). `--slow` runs the slow-node comparison instead (`moeshard.bench.swarm_slow`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from moeshard.bench.netbed import NODE_PORT, NetBed, check_tools
from moeshard.bench.rpc_nodes import NodeProcs
from moeshard.bench.swarm_probes import (
    CpuSpent,
    Probed,
    busy_cpu_s,
    idle_cores,
    node_counters,
    probe_all,
)
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.runtime import open_local, open_remote
from moeshard.moe.analysis import simulate as sim
from moeshard.moe.analysis import swarm
from moeshard.moe.analysis.disk import Disk
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.errors import MoeshardError
from moeshard.moe.experts.recorder import TraceRecorder
from moeshard.moe.identity.keys import load_or_make
from moeshard.moe.storage.traces import DECODE
from moeshard.moe.units import fmt_bytes

PROMPT = [1, 2, 3, 4]
PINGS = 20
GOAL = 0.15  # the simulated s/token within this of the measured one


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", default="4,8,16", help="node counts, comma-separated")
    p.add_argument("--rtt-ms", default="0.2,2,10", help="added round trips (ms), comma-separated")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per configuration")
    p.add_argument("--ram-share", type=float, default=0.25, help="node cache / records it holds")
    p.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    p.add_argument("--inter", type=int, default=512, help="expert intermediate size")
    p.add_argument("--work", default="/var/tmp/moeshard-bench-swarm", help="model and shards")
    p.add_argument("--prefix", default="msw", help="namespace and bridge name prefix")
    p.add_argument("--subnet", default="10.213.7", help="the bridge's /24 (three octets)")
    p.add_argument(
        "--slow",
        choices=("delay", "cpu", "stall"),
        help="instead: 16 nodes, one slowed (10x round trip, a 5%% CPU quota, or stopped 150 ms "
        "every second), and the step latency's tail with the previous routing against queue "
        "reports + hedged requests",
    )
    p.add_argument("--rounds", type=int, default=3, help="--slow: alternated rounds per routing")


@dataclass
class Measured:
    s_per_token: float  # mean over the decode steps
    hit_rate: float  # the nodes' caches, during the decode
    wire_bytes_per_token: float  # the coordinator's messages both ways, during the decode
    read_bytes_per_token: float  # the nodes' disk reads, during the decode
    recall: float  # the prefetch hints' recall over the nodes (predicted and used / used)
    ping_ms: list[float]  # per node, median health ping through its relay
    cpu_ms_per_token: float  # this machine's CPU, all processes, during the decode


def _numbers(text: str, what: str, kind=float) -> list:
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        raise MoeshardError(f"{what} {text!r}: comma-separated numbers") from None


def model_dir(work: Path, experts: int, inter: int) -> Path:
    """The K3-shaped model (synth k3-mini scaled), made once per size in `work`."""
    from moeshard.moe.convert.synth import synth

    path = work / f"k3mini-e{experts}-i{inter}"
    if not (path / "moeshard.json").exists():
        s = synth(path, "k3-mini", force=True, n_experts=experts, inter=inter)
        print(f"synth k3-mini --experts {experts} --inter {inter}: {s['bytes'] / 1e9:.2f} GB")
    return path


def trunk_ms_per_token(path: Path, tokens: int) -> float:
    """The coordinator's trunk per decode token, from a profiled decode with all in RAM."""
    rt = open_local(path)
    try:
        generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=4))  # warm
        r = generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=tokens + 1), profile=True)
        return r.profile["total_ms"] - r.profile["experts_ms"]
    finally:
        rt.close()


def disk_profile(path: Path, record_bytes: int) -> tuple[Disk, float]:
    """This machine's O_DIRECT reads of the model's record file at record size, depth 1-8;
    and the CPU one read through the store's reader costs (ms; /proc/stat, less the idle
    load), which the nodes' reads take from the cores they share."""
    from moeshard.bench.disk import raw_read_gbps, reader_gbps

    targets = [
        (f, off)
        for f in sorted(path.glob("experts-*.gguf"))
        for off in range(0, f.stat().st_size - record_bytes, 1 << 18)
    ]
    points = []
    for depth in (1, 2, 4, 8):
        runs = [raw_read_gbps(targets, record_bytes, depth, 0.4, seed=r) for r in range(3)]
        points.append([record_bytes, depth, statistics.median(runs)])
    seconds = 1.0
    with CpuSpent(idle_cores()) as spent:
        gbps = reader_gbps(targets, record_bytes, 4, seconds)
    return Disk(points), spent.seconds * 1e3 / (gbps * 1e9 * seconds / record_bytes)


def start_nodes(bed: NetBed, procs: NodeProcs, plan: dict, key, flags=()) -> str:
    """A node daemon per plan directory, node i in namespace i (one compute thread each:
    the simulator gives each a core); their --peers list once all serve."""
    launched = [
        procs.launch(
            Path(node["dir"]),
            key,
            prefix=bed.prefix_cmd(i),
            flags=(
                "--host",
                bed.addr(i),
                "--port",
                str(NODE_PORT),
                "--threads",
                "1",
                "--no-verify",
                *flags,
            ),  # fmt: skip
        )
        for i, node in enumerate(plan["nodes"])
    ]
    return ",".join(str(node.spec()) for node in launched)


def run_config(bed: NetBed, shards: Path, plan: dict, rtt_ms: float, ram: int, tokens: int, key):
    """Nodes started afresh (cold caches) behind relays adding `rtt_ms`; probes; one traced
    greedy decode. (Measured, Probed, the routing trace)."""
    for i in range(bed.nodes):
        bed.set_delay(i, rtt_ms / 2)
    bed.wait_relays()
    procs = NodeProcs(bed.work)
    try:
        peers = start_nodes(bed, procs, plan, key, ("--ram", str(ram)))
        config = RemoteConfig(identity=key, audit=0.0, challenge_interval_s=0.0)
        rt = open_remote(shards / "coordinator", peers=peers, remote_config=config)
        experts = rt.transformer.experts
        try:
            probed = probe_all(experts, plan)
            pings = [
                statistics.median(p.ping_ms(5.0) for _ in range(PINGS)) for p in experts.peers.peers
            ]
            recorder = TraceRecorder(experts, rt.trace_meta())
            rt.transformer.experts = recorder
            start: dict = {}  # the counters when the first decode pass begins

            def mark(position: int, phase: int) -> None:
                if phase == DECODE and not start:
                    start.update(node_counters(experts), cpu=busy_cpu_s())
                recorder.mark(position, phase)

            opts = SamplingOptions(max_tokens=tokens + 1)
            r = generate(rt.transformer, PROMPT, opts, on_forward=mark)
            end = dict(node_counters(experts), cpu=busy_cpu_s())
            rt.transformer.experts = experts
            probed = Probed.mean(probed, probe_all(experts, plan))  # before and after the run
            d = {k: end[k] - start[k] for k in end}
            steps = len(r.decode_s)
            measured = Measured(
                s_per_token=statistics.fmean(r.decode_s),
                hit_rate=d["hits"] / max(d["accesses"], 1),
                wire_bytes_per_token=d["wire"] / steps,
                read_bytes_per_token=d["bytes_read"] / steps,
                recall=d["predicted_used"] / max(d["used_after_hint"], 1),
                ping_ms=pings,
                cpu_ms_per_token=d["cpu"] * 1e3 / steps,
            )
            return measured, probed, recorder.trace(end=r.positions_done)
        finally:
            rt.transformer.experts = experts
            rt.close()
    finally:
        procs.close()


def simulated(trace, g, plan: dict, probed: Probed, recall: float, ram: int, disk: Disk,
              trunk_ms: float, read_cpu_ms: float = 0.0) -> swarm.SwarmResult:  # fmt: skip
    """The simulator's figure for one configuration, from what was measured: every node on
    this machine (its cores and disk shared), each with its probed round trip and kernel."""
    kernel_gbps = g.record_bytes / (probed.expert_ms / 1e3) / 1e9
    nodes = tuple(
        swarm.NodeClass(
            count=1,
            ram=ram,
            disk=disk,
            kernel_gbps=kernel_gbps,
            rtt_ms=(ms, ms),
            link_gbit=10.0,
            call_overhead_ms=0.0,
        )  # fmt: skip
        for ms in probed.call_ms  # the whole round trip beyond compute
    )
    coordinator = swarm.Coordinator(
        ram=1 << 40, trunk=None, disk=disk, memory_gbps=20.0, trunk_ms=trunk_ms
    )
    spec = swarm.Swarm(
        coordinator,
        nodes,
        replicas=2,
        prefetch_recall=recall,
        shared_host=True,
        host_call_cpu_ms=probed.call_cpu_ms,
        host_hint_cpu_ms=probed.hint_cpu_ms,
        host_read_cpu_ms=read_cpu_ms,
        host_cores=os.cpu_count() or 1,  # each node computes on one thread (--threads 1)
    )
    moe = list(trace.moe_layers)  # the model's layer numbers -> the geometry's MoE layers
    placed = [[(moe.index(layer), e) for layer, e in node["experts"]] for node in plan["nodes"]]
    tokens, warm, hints = (
        sim.project(trace, g),
        sim.prefill_sets(trace, g),
        sim.project_hints(trace, g),
    )
    return swarm.simulate_swarm(tokens, g, spec, placed=placed, warm=warm, hints=hints)


def run(args) -> int:
    check_tools()
    counts = _numbers(args.nodes, "--nodes", int)
    rtts = _numbers(args.rtt_ms, "--rtt-ms")
    if min(counts) < 2 or args.tokens < 2 or not 0 < args.ram_share <= 1 or min(rtts) < 0:
        raise MoeshardError("--nodes >= 2 each, --tokens >= 2, 0 < --ram-share <= 1, --rtt-ms >= 0")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = model_dir(work, args.experts, args.inter)
    key, _ = load_or_make(work / "bench-client-key.pem")

    def shard(n: int) -> tuple[Path, dict]:
        return work / f"shards-{n}", shard_model(path, n, 2, work / f"shards-{n}", force=True)

    if args.slow:
        from moeshard.bench.swarm_slow import run_slow

        return run_slow(args, work, key, shard)
    g = sim.geometry_of(str(path))
    trunk_ms = trunk_ms_per_token(path, args.tokens)
    disk, read_cpu_ms = disk_profile(path, g.record_bytes)
    print(
        f"model {path.name}: {g.layers} MoE layers, {g.n_experts} experts of "
        f"{fmt_bytes(g.record_bytes)}, top-{g.top_k}; measured here: trunk {trunk_ms:.1f} "
        "ms/token, disk at record size "
        + ", ".join(f"QD{int(d)} {gb:.2f}" for _, d, gb in disk.points)
        + f" GB/s, {read_cpu_ms:.2f} ms of CPU per read; nodes: one compute thread each, all "
        f"on this machine's {os.cpu_count()} cores and disk"
    )
    errors = []
    for n in counts:
        shards, plan = shard(n)
        per_node = statistics.median(len(node["experts"]) for node in plan["nodes"])
        ram = max(int(per_node * args.ram_share), 2 * g.top_k) * g.record_bytes
        bed = NetBed(n, args.prefix, args.subnet, work)
        bed.create()
        try:
            for rtt in rtts:
                m, probed, trace = run_config(bed, shards, plan, rtt, ram, args.tokens, key)
                s = simulated(trace, g, plan, probed, m.recall, ram, disk, trunk_ms, read_cpu_ms)
                tag = f"{n}-{rtt:g}"
                trace.save(work / f"trace-{tag}.npz")  # what `simulated` replays, kept
                inputs = {"measured": asdict(m), "probed": asdict(probed), "ram": ram,
                          "trunk_ms": trunk_ms, "disk": disk.points, "read_cpu_ms": read_cpu_ms,
                          "plan": str(shards / "plan.json")}  # fmt: skip
                (work / f"measured-{tag}.json").write_text(json.dumps(inputs, indent=1))
                errors.append((s.s_per_token - m.s_per_token) / m.s_per_token)
                print(
                    f"   probed: ping {statistics.median(m.ping_ms):.2f} ms, Forward beyond "
                    f"compute {statistics.median(probed.call_ms):.2f} ms, expert "
                    f"{probed.expert_ms:.3f} ms, CPU {probed.call_cpu_ms:.2f} ms per node call "
                    f"and {probed.hint_cpu_ms:.2f} per hint; prefetch recall {m.recall:.0%}; "
                    f"disk reads {m.read_bytes_per_token / 1e6:.1f} / "
                    f"{s.read_bytes_per_token / 1e6:.1f} MB/token; machine CPU "
                    f"{m.cpu_ms_per_token:.0f} ms/token"
                )
                print(
                    f"{n:>2} nodes, +{rtt:g} ms, node cache {fmt_bytes(ram)}: hit rate "
                    f"{m.hit_rate:.0%} measured / {s.hit_rate:.0%} simulated, wire "
                    f"{m.wire_bytes_per_token / 1e3:.0f} / {s.wire_bytes_per_token / 1e3:.0f} "
                    f"KB/token; measured {m.s_per_token:.3f} s/token, simulated "
                    f"{s.s_per_token:.3f} s/token (error {errors[-1]:+.0%})",
                    flush=True,
                )
        finally:
            bed.close()
    worst = max(abs(e) for e in errors)
    within = sum(abs(e) <= GOAL for e in errors)
    print(
        f"{within} of {len(errors)} configurations within {GOAL:.0%}; worst error {worst:.0%}, "
        f"mean {statistics.fmean(errors):+.0%}"
    )
    return 0 if within == len(errors) else 1
