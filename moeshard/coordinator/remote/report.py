"""What `moeshard cluster` and `moeshard health` print: the nodes, their holdings, latency and
reputation (`moeshard.coordinator.remote.reputation`)."""

from __future__ import annotations

import ssl
import statistics
import time
from collections import defaultdict
from dataclasses import replace

import grpc

from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.experts import RemoteExperts
from moeshard.coordinator.remote.reputation import Reputation
from moeshard.coordinator.remote.transport import PeerSpec, dial
from moeshard.moe.identity.tls import TLSMaterial
from moeshard.moe.wire import health_pb2, health_pb2_grpc


def check_health(addr: str, tls: TLSMaterial | None, timeout: float = 2.0) -> tuple[str, str]:
    """grpc.health.v1 Check of `addr` ('[ID@]HOST:PORT'): ('SERVING', 'NOT_SERVING', ... or
    'UNREACHABLE (...)', the node's id). Over TLS the handshake shows the node's key (and
    refuses a pinned id it does not match); `tls` None is plaintext (loopback only)."""
    node_id, _, hostport = addr.rpartition("@")
    try:
        channel, seen = dial(PeerSpec(hostport, node_id), tls, timeout)
    except (OSError, ssl.SSLError) as exc:
        return f"UNREACHABLE ({exc})", ""
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            return f"UNREACHABLE ({exc.code().name}: {exc.details()})", seen
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), seen


def describe_cluster(
    model,
    specs: list[PeerSpec],
    config: RemoteConfig,
    pings: int = 5,
    reputation: Reputation | None = None,
) -> tuple[str, int]:
    """Text report (live nodes, what they hold, coverage of the model's experts, latency,
    reputation), and how many of the model's experts no live node holds."""
    report = cluster_report(model, specs, config, pings, reputation)
    return format_cluster(report), report["coverage"]["0"]


def cluster_report(
    model,
    specs: list[PeerSpec],
    config: RemoteConfig,
    pings: int = 5,
    reputation: Reputation | None = None,
) -> dict:
    """What `moeshard cluster --json` prints: the nodes (with what `reputation` knows of each
    id), the ignored addresses, the coverage (experts with 0, 1, >=2 live replicas)."""
    # no generation here, so no audits: connecting and asking each node is all it does
    config = replace(config, audit=0.0)
    remote = RemoteExperts(model.model_id, model.config.expert_hidden, specs, config)
    try:
        nodes = []
        for peer in remote.peers.peers:
            times = []
            for _ in range(pings if peer.up else 0):
                t0 = time.perf_counter()
                try:
                    peer.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                except grpc.RpcError:
                    break
                times.append((time.perf_counter() - t0) * 1e3)
            layers = sorted({layer for layer, _ in peer.held})
            known = reputation is not None and peer.node_id
            nodes.append(
                {
                    "addr": peer.addr,
                    "node_id": peer.node_id,
                    "name": peer.name,
                    "up": peer.up,
                    "experts": len(peer.held),
                    "layers": [layers[0], layers[-1]] if layers else [],
                    "health_rtt_ms": statistics.median(times) if times else None,
                    "reputation": reputation.row(peer.node_id) if known else None,
                }
            )
        counts = defaultdict(int)
        live = remote.live_peers()
        keys = model.expert_keys()  # the model's records, held here or not (a coordinator's)
        for key in keys:
            counts[min(sum(1 for p in live if key in p.held), 2)] += 1
        return {
            "model_id": model.model_id,
            "addresses": len(specs),
            "nodes": nodes,
            "ignored": dict(remote.peers.ignored),
            "coverage": {"experts": len(keys), **{k: counts[i] for i, k in COVER}},
        }
    finally:
        remote.close()


COVER = ((0, "0"), (1, "1"), (2, ">=2"))  # live replicas of an expert -> coverage key


def format_cluster(report: dict) -> str:
    lines = [f"model {report['model_id'][:16]}: {report['addresses']} node address(es)"]
    for node in report["nodes"]:
        first, last = node["layers"] or (None, None)
        span = f"layers {first}-{last}" if node["layers"] else "nothing"
        rtt = node["health_rtt_ms"]
        latency = f"{rtt:.2f} ms" if rtt is not None else "-"
        lines.append(
            f"  {node['addr']:<22} {node['node_id'] or '?':<24} "
            f"{'up' if node['up'] else 'DOWN':<5} {node['experts']:>6} experts ({span})  "
            f"health rtt {latency}{_reputation(node['reputation'])}"
        )
    for addr, why in report["ignored"].items():
        lines.append(f"  {addr:<22} ignored: {why}")
    c = report["coverage"]
    lines.append(
        f"coverage of {c['experts']} experts: {c['0']} with 0 live replicas, "
        f"{c['1']} with 1, {c['>=2']} with >=2"
    )
    return "\n".join(lines)


def _reputation(row: dict | None) -> str:
    """'  rep 0.97 audits 120/0 avail 99.8%' (audits passed/failed; proofs of possession
    too if any), '  rep new' for an id with no record, '' without a reputation database."""
    if row is None:
        return ""
    if not any(row[k] for k in EVENTS):
        return "  rep new"
    text = (
        f"  rep {row['score']:.2f} audits {row['audits_passed']}/{row['audits_failed']} "
        f"avail {row['availability']:.1%}"
    )
    if row["possession_passed"] + row["possession_failed"]:
        text += f" proofs {row['possession_passed']}/{row['possession_failed']}"
    return text + (" DISQUALIFIED" if row["disqualified"] else " suspect" if row["suspect"] else "")


EVENTS = (  # the counts of a node's record: all 0 for an id never seen
    "audits_passed",
    "audits_failed",
    "possession_passed",
    "possession_failed",
    "calls_ok",
    "calls_failed",
)
