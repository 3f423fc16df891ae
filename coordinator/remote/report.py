"""What `moeshard cluster` and `moeshard health` print: the nodes, their holdings and latency."""

from __future__ import annotations

import ssl
import statistics
import time
from collections import defaultdict

import grpc

from coordinator.remote.config import RemoteConfig
from coordinator.remote.experts import RemoteExperts
from coordinator.remote.transport import PeerSpec, dial
from moe.identity.tls import TLSMaterial
from moe.wire import health_pb2, health_pb2_grpc


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
    model, specs: list[PeerSpec], config: RemoteConfig, pings: int = 5
) -> tuple[str, int]:
    """Text report (live nodes, what they hold, coverage of the model's experts, latency),
    and how many of the model's experts no live node holds."""
    remote = RemoteExperts(model.model_id, model.config.hidden_size, specs, config)
    try:
        lines = [f"model {model.model_id[:16]}: {len(specs)} node address(es)"]
        for peer in remote.peers.peers:
            times = []
            for _ in range(pings if peer.up else 0):
                t0 = time.perf_counter()
                try:
                    peer.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                except grpc.RpcError:
                    break
                times.append((time.perf_counter() - t0) * 1e3)
            latency = f"{statistics.median(times):.2f} ms" if times else "-"
            layers = sorted({layer for layer, _ in peer.held})
            span = f"layers {layers[0]}-{layers[-1]}" if layers else "nothing"
            state = "up" if peer.up else "DOWN"
            lines.append(
                f"  {peer.addr:<22} {peer.node_id or '?':<24} {state:<5} "
                f"{len(peer.held):>6} experts ({span})  health rtt {latency}"
            )
        for addr, why in remote.peers.ignored.items():
            lines.append(f"  {addr:<22} ignored: {why}")
        counts = defaultdict(int)
        live = remote.live_peers()
        for key in model.locations:
            counts[min(sum(1 for p in live if key in p.held), 2)] += 1
        lines.append(
            f"coverage of {len(model.locations)} experts: {counts[0]} with 0 live replicas, "
            f"{counts[1]} with 1, {counts[2]} with >=2"
        )
        return "\n".join(lines), counts[0]
    finally:
        remote.close()
