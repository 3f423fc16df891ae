"""The coordinator's view of the expert nodes: who is up, what each holds, how fast it is.

`PeerSet` admits a node after an Info call (same model id, format and hidden size), bans a
node that fails with exponential backoff, and runs a prober thread that re-admits banned nodes
once their health check says SERVING and their Info still matches, refreshes the latency of
idle nodes.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from moeshard.coordinator.remote.config import RemoteConfig, RemoteError
from moeshard.coordinator.remote.reach import why_unreachable
from moeshard.coordinator.remote.reputation import rank_weight
from moeshard.coordinator.remote.transport import ForwardStream, PeerSpec, PinError, dial
from moeshard.moe.identity.signed import check_info
from moeshard.moe.identity.tls import TLSMaterial, client_tls
from moeshard.moe.kernels.build import ARITHMETIC
from moeshard.moe.storage.manifest import FORMAT_VERSION
from moeshard.moe.wire import health_pb2, health_pb2_grpc
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.moe.wire.names import safe_node_name

log = logging.getLogger(__name__)

REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
IDLE_REFRESH_S = 1.0  # a node unused this long gets its latency estimate refreshed by a ping
STREAM_IDLE_S = 20.0  # a stream unused this long is closed here, before a node's idle timeout
LATENCY_HISTORY = 4096  # round trips kept per node
BUSY_FIRST_S = 0.01  # the first wait after a node says "busy"; doubled while it repeats ...
BUSY_MAX_S = 0.5  # ... up to this
BUSY_LIMIT_S = 10.0  # busy without a break for this long: banned as a failing node
QUEUE_FRESH_S = 1.0  # a node's stated queue counts for this long after its reply
HEDGE_WINDOW = 64  # a node's recent round trips its hedge point is the p95 of
HEDGE_MIN_SAMPLES = 16  # ... once it has this many
LATE_PING_S = 0.5  # a reply abandoned for a hedge this late: its node is pinged
SWARM_WINDOW = 256  # the swarm's recent round trips (every node's) its p95 is taken over


@dataclass
class Peer:
    spec: PeerSpec  # the address and the pinned node id
    channel: grpc.Channel | None = None  # None until a TLS handshake has shown the node's key
    stub: pb_grpc.ExpertNodeStub | None = None
    health: health_pb2_grpc.HealthStub | None = None
    node_id: str = ""
    name: str = ""  # the node's display name (from Info)
    max_rows: int = 0  # rows one Forward may carry (from Info; 0: no limit stated)
    max_request_bytes: int = 0  # bytes one request may have (from Info; 0: no limit stated)
    record_rate: int = 0  # record bytes a second it lets one client fetch (Info; 0: not stated)
    record_streams: int = 0  # record streams it lets one client open at once (Info; 0: idem)
    kernels: str = ""  # "kernel build/cpu level" (from Info): equal ones give equal bits
    held: set = field(default_factory=set)  # (layer, expert) the node serves
    ewma_ms: float = 1.0  # smoothed round trip of a Forward call
    overhead_ms: float = 1.0  # smoothed round trip minus the node's compute time
    expert_ms: float = 0.0  # smoothed compute time per expert on the node
    up: bool = False
    retry_at: float = 0.0  # monotonic time of the next probe while banned
    backoff_s: float = 0.0
    calls: int = 0
    failures: int = 0
    latencies_ms: list = field(default_factory=list)  # recent round trips (bounded)
    stream: ForwardStream | None = None  # the persistent ForwardStream (transport "stream")
    last_used: float = 0.0  # monotonic time of the last Forward sent to it
    last_ping: float = 0.0  # monotonic time of the last idle-refresh ping
    disqualified: str = ""  # why this node is banned for good (caught lying), else ''
    weight: float = 1.0  # routing cost factor from its reputation (1: spotless)
    public_key: bytes = b""  # its raw Ed25519 key (from its signed Info): checks its receipts
    busy_until: float = 0.0  # monotonic time before which it said "busy" (RESOURCE_EXHAUSTED)
    busy_backoff_s: float = 0.0  # the wait after its last "busy" (doubles while it repeats)
    busy_since: float = 0.0  # monotonic time of the first "busy" in a row (0: none)
    busy: int = 0  # "busy" answers so far
    compute_ms: float = 0.0  # smoothed compute time of one of its calls
    queued: int = 0  # calls it said it was computing or holding at its last reply
    queued_at: float = 0.0  # monotonic time of that reply
    late: list = field(default_factory=list)  # send times of replies abandoned, still out
    hedge_ms: float = 0.0  # its recent p95 round trip (0: too few yet): `PeerSet.hedge_after_ms`

    def late_ms(self, now: float) -> float:
        """How late its oldest reply abandoned for a hedge is by now (0: none is out)."""
        return (now - min(self.late)) * 1e3 if self.late else 0.0

    def queue_ms(self, now: float) -> float:
        """The wait its stated queue implies (a stale statement counts for nothing). A node
        can only make itself look slower this way: its measured round trips set the rest."""
        if now - self.queued_at > QUEUE_FRESH_S:
            return 0.0
        return self.queued * self.compute_ms

    @property
    def addr(self) -> str:
        return self.spec.addr

    @property
    def label(self) -> str:
        """How logs name the node: its name (once known) or id, and its address."""
        return f"{self.name or self.node_id or '?'} ({self.addr})"

    def dial(self, tls: TLSMaterial | None, timeout: float) -> None:
        """(Re)open the channel: a fresh handshake checks the node's key against the pin (a
        restarted node has a new TLS certificate for the same key). PinError, OSError."""
        channel, node_id = dial(self.spec, tls, timeout)
        if self.channel is not None:
            self.channel.close()
        self.channel, self.node_id = channel, node_id or self.node_id
        self.stub = pb_grpc.ExpertNodeStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.channel is not None:
            self.channel.close()

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.held

    def ping_ms(self, timeout: float) -> float:
        t0 = time.perf_counter()
        self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return (time.perf_counter() - t0) * 1e3


class PeerSet:
    """The nodes of one generation; thread-safe (the prober shares the peers' state)."""

    def __init__(
        self, model_id: str, hidden_size: int, specs: list[PeerSpec], config: RemoteConfig
    ):
        self.model_id, self.hidden_size, self.config = model_id, hidden_size, config
        self.tls = None if config.identity is None else client_tls(config.identity)
        self.lock = threading.Lock()
        self.peers: list[Peer] = []
        self.recent_ms: collections.deque = collections.deque(maxlen=SWARM_WINDOW)  # every node's
        self.swarm_p95_ms = 0.0  # the p95 of the swarm's recent round trips (0: too few yet)
        self.ignored: dict[str, str] = {}  # addr -> why it is not used
        self.disqualified: dict[str, str] = {}  # node id -> why it is never used again
        for spec in dict.fromkeys(specs):
            self._connect(spec)
        if not any(p.up for p in self.peers):
            for peer in self.peers:
                why = why_unreachable(peer.addr, self.tls is not None, config.connect_timeout_s)
                self.ignored.setdefault(peer.addr, why)
                peer.close()
            reasons = "; ".join(f"{a}: {r}" for a, r in self.ignored.items()) or "none given"
            raise RemoteError(f"no usable expert nodes ({reasons})")
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="node-prober", daemon=True)
        self._prober.start()

    def _connect(self, spec: PeerSpec) -> None:
        peer = Peer(spec, node_id=spec.node_id)
        try:
            peer.dial(self.tls, self.config.connect_timeout_s)
            why = self.admit(peer, self.config.connect_timeout_s)
        except PinError as exc:
            log.warning("ignoring node %s: %s", spec.addr, exc)
            self.ignored[spec.addr] = str(exc)
            peer.close()
            return
        except (grpc.RpcError, OSError) as exc:
            if isinstance(exc, grpc.RpcError) and exc.code() in REFUSED:
                why = f"refused this client: {exc.code().name}: {exc.details()}"
                log.warning("node %s %s", spec, why)
                self.ignored[spec.addr] = why
                peer.close()
                return
            # Reachable later, perhaps: keep it banned and let the prober try.
            log.warning("node %s unreachable at start (%s); will retry", spec, _reason(exc))
            peer.backoff_s = self.config.backoff_s
            peer.retry_at = time.monotonic() + peer.backoff_s
            self.peers.append(peer)
            return
        if why:
            log.warning("ignoring node %s: %s", spec, why)
            self.ignored[spec.addr] = why
            peer.close()
            return
        self.peers.append(peer)

    def add(self, spec: PeerSpec) -> bool:
        """Admit a node that appeared after start-up (fed by zeroconf's `Watcher`); True if
        it is now used. A known address is skipped, and so is a node whose id is already up
        at another address (a node on all interfaces is announced under each)."""
        with self.lock:
            if spec.addr in self.ignored or any(p.addr == spec.addr for p in self.peers):
                return False
        peer = Peer(spec, node_id=spec.node_id)
        try:
            peer.dial(self.tls, self.config.connect_timeout_s)
            why = self.admit(peer, self.config.connect_timeout_s)
        except (grpc.RpcError, OSError, PinError) as exc:
            why = f"unreachable or not the announced key ({_reason(exc)})"
        with self.lock:
            if not why and any(p.up and p.node_id == peer.node_id for p in self.peers):
                why = f"node {peer.node_id} is already used at another address"
            elif not why:
                self.peers.append(peer)
        if why:
            log.info("discovered node %s not added: %s", spec, why)
            peer.close()
            return False
        log.warning("node %s joined: %d experts", peer.label, len(peer.held))
        return True

    def admit(self, peer: Peer, timeout: float) -> str:
        """Info call: '' and the peer marked up if it serves this model, else the reason."""
        nonce = os.urandom(16)
        info = _info(peer, nonce, timeout)  # also connects
        rtt_ms = min(peer.ping_ms(timeout) for _ in range(3))
        forged = check_info(info, nonce)
        if forged:
            return forged
        if peer.spec.node_id and info.node_id != peer.spec.node_id:
            return f"Info names node {info.node_id}, not the pinned {peer.spec.node_id}"
        rep = self.config.reputation
        if rep is not None and rep.is_disqualified(info.node_id):
            self.disqualified[info.node_id] = "failed audits in earlier runs (reputation)"
        if info.node_id in self.disqualified:
            return f"disqualified: {self.disqualified[info.node_id]}"
        if info.model_id != self.model_id:
            return f"model id {info.model_id[:16]} differs from ours {self.model_id[:16]}"
        if info.format_version != FORMAT_VERSION:
            return f"format version {info.format_version}, ours is {FORMAT_VERSION}"
        if info.hidden_size != self.hidden_size:
            return f"hidden size {info.hidden_size}, ours is {self.hidden_size}"
        if info.arithmetic != ARITHMETIC:
            return (
                f"its kernels compute arithmetic {info.arithmetic}, ours {ARITHMETIC} "
                "(another moeshard version: its replies would differ from ours)"
            )
        held = {(h.layer, e) for h in info.holdings for e in h.experts}
        name = safe_node_name(info.name)  # shown in logs and /metrics labels: no newlines
        if name != info.name and peer.name != name:
            log.warning("node %s calls itself %r; named %s here", info.node_id, info.name, name)
        with self.lock:
            peer.node_id, peer.name, peer.held = info.node_id, name, held
            peer.max_rows, peer.max_request_bytes = info.max_rows, info.max_request_bytes
            peer.record_rate, peer.record_streams = info.record_rate, info.per_client_records
            peer.kernels = f"{info.kernel_build}/{info.cpu_level}"
            peer.public_key = info.public_key
            peer.weight = rank_weight(rep.score(info.node_id)) if rep is not None else 1.0
            if not peer.latencies_ms:
                peer.ewma_ms = peer.overhead_ms = rtt_ms
            peer.up, peer.backoff_s = True, 0.0
        log.info("node %s: id %s, %d experts, %.2f ms", peer.label, peer.node_id, len(held), rtt_ms)
        return ""

    def refresh(self, peer: Peer) -> None:
        """The node said it no longer serves some records: re-read its holdings, or ban it."""
        try:
            why = self.admit(peer, self.config.connect_timeout_s)
        except grpc.RpcError as exc:
            why = f"Info failed: {exc.code().name}"
        if why:
            self.ban(peer, why)

    def ban(self, peer: Peer, reason: str) -> None:
        with self.lock:
            if peer.stream is not None:
                peer.stream.close()
                peer.stream = None
            if not peer.up:
                return
            peer.up = False
            peer.failures += 1
            peer.backoff_s = self.config.backoff_s
            peer.retry_at = time.monotonic() + peer.backoff_s
        log.warning("node %s banned for %.1f s: %s", peer.label, peer.backoff_s, reason)

    def busy(self, peer: Peer, why: str) -> bool:
        """`peer` answered RESOURCE_EXHAUSTED: it is up but loaded (or flooded by someone else),
        so it is not banned: work goes to a replica, or back to it after a short wait that
        doubles while the answers repeat (BUSY_FIRST_S .. BUSY_MAX_S). False once it has
        been busy without a break for BUSY_LIMIT_S: then it is banned as a node that fails."""
        now = time.monotonic()
        with self.lock:
            peer.busy += 1
            peer.busy_since = peer.busy_since or now
            peer.busy_backoff_s = min(BUSY_MAX_S, max(BUSY_FIRST_S, 2 * peer.busy_backoff_s))
            peer.busy_until = now + peer.busy_backoff_s
            too_long = now - peer.busy_since > BUSY_LIMIT_S
        log.info("node %s busy (waiting %.2f s): %s", peer.label, peer.busy_backoff_s, why)
        if too_long:
            self.ban(peer, f"busy for over {BUSY_LIMIT_S:g} s: {why}")
        return not too_long

    def not_busy(self, peer: Peer) -> None:
        """A reply came: its "busy" run is over."""
        if peer.busy_since:
            with self.lock:
                peer.busy_since, peer.busy_backoff_s = 0.0, 0.0

    def disqualify(self, peer: Peer, reason: str) -> None:
        """Ban `peer` for good (it was caught lying): never probed or admitted again, under
        any address, for as long as this PeerSet lives."""
        with self.lock:
            first = peer.node_id not in self.disqualified
            self.disqualified[peer.node_id] = reason
            was_up = peer.up
            # every address its key answers at (one key pinned at two addresses is one node)
            twins = [p for p in self.peers if p.node_id == peer.node_id and p is not peer]
            for p in [peer, *twins]:
                p.disqualified, p.up = reason, False
                if p.stream is not None:
                    p.stream.close()
                    p.stream = None
        if first:  # (also when it was banned at the time: a liar caught late is still named)
            down = "" if was_up else " (it was down at the time)"
            log.warning("node %s disqualified%s: %s", peer.label, down, reason)

    def live(self) -> list[Peer]:
        with self.lock:
            return [p for p in self.peers if p.up]

    def record_latency(
        self, peer: Peer, seconds: float, compute_ms: float, experts: int, queued: int = 0
    ) -> None:
        ms = seconds * 1e3
        a = self.config.ewma_alpha
        with self.lock:
            peer.ewma_ms = (1 - a) * peer.ewma_ms + a * ms
            peer.overhead_ms = (1 - a) * peer.overhead_ms + a * max(ms - compute_ms, 0.0)
            peer.expert_ms = (1 - a) * peer.expert_ms + a * compute_ms / max(experts, 1)
            peer.compute_ms = (1 - a) * peer.compute_ms + a * compute_ms
            peer.queued, peer.queued_at = queued, time.monotonic()
            peer.latencies_ms.append(ms)
            if len(peer.latencies_ms) > LATENCY_HISTORY:
                del peer.latencies_ms[: LATENCY_HISTORY // 2]
            self.recent_ms.append(ms)
            if len(self.recent_ms) >= HEDGE_MIN_SAMPLES and len(peer.latencies_ms) % 4 == 0:
                self.swarm_p95_ms = float(np.percentile(self.recent_ms, 95))
            recent = peer.latencies_ms[-HEDGE_WINDOW:]
            if len(recent) >= HEDGE_MIN_SAMPLES and len(peer.latencies_ms) % 4 == 0:
                peer.hedge_ms = float(np.percentile(recent, 95))

    def hedge_after_ms(self, peer: Peer) -> float:
        """How late a reply of `peer` may be before it is hedged: its own recent p95, or the
        swarm's if lower or if it has too few round trips of its own (a node that is often
        slow has a high p95 of its own); 0: not yet known."""
        own, swarm = peer.hedge_ms, self.swarm_p95_ms
        return min(own, swarm) if own and swarm else own or swarm

    # -- the prober ---------------------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.config.probe_interval_s):
            now = time.monotonic()
            self._expire_late()
            self._refresh_idle(now)
            self._reweigh()
            for peer in list(self.peers):
                if not peer.up and not peer.disqualified and now >= peer.retry_at:
                    self._probe(peer)

    def _expire_late(self) -> None:
        """A reply abandoned for a hedge that has still not come by its deadline: its node is
        failing, as if the call had been waited for (banned, its stream closed, which settles
        the abandoned calls). One still out after LATE_PING_S: its node is pinged (a node
        that died without closing its connections answers nothing) and banned if it fails."""
        clock, now = time.perf_counter(), time.monotonic()
        for peer in self.live():
            age = clock - min(peer.late, default=clock)
            if age > self.config.deadline_s:
                self.ban(peer, "a reply abandoned for a hedge missed its deadline")
            elif age > LATE_PING_S and now - peer.last_ping > LATE_PING_S:
                peer.last_ping = now
                try:
                    peer.ping_ms(LATE_PING_S)
                except grpc.RpcError as exc:
                    self.ban(peer, f"late, and its ping failed: {exc.code().name}")

    def _reweigh(self) -> None:
        """Routing weights from the reputations as evidence comes in; keep it on disk."""
        rep = self.config.reputation
        if rep is None:
            return
        for peer in list(self.peers):
            if peer.node_id:
                peer.weight = rank_weight(rep.score(peer.node_id))
        rep.flush_if_due()

    def _refresh_idle(self, now: float) -> None:
        """Nodes not chosen lately get their estimate refreshed by a ping, so one slow
        measurement does not starve a node forever (and a recovered node wins work back)."""
        for peer in self.live():
            if peer.stream is not None and now - peer.last_used > STREAM_IDLE_S:
                with self.lock:  # the node would end it (idle timeout); the next call reopens
                    stream, peer.stream = peer.stream, None
                if stream is not None:
                    stream.close()
            if now - peer.last_used < IDLE_REFRESH_S or now - peer.last_ping < IDLE_REFRESH_S:
                continue
            peer.last_ping = now
            try:
                ms = peer.ping_ms(1.0)
            except grpc.RpcError as exc:
                self.ban(peer, f"idle ping failed: {exc.code().name}")
                continue
            with self.lock:
                peer.overhead_ms = 0.5 * peer.overhead_ms + 0.5 * ms

    def _probe(self, peer: Peer) -> None:
        try:
            if peer.channel is None or self.tls is not None:  # a restarted node: new cert
                peer.dial(self.tls, 1.0)
            reply = peer.health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            why = self.admit(peer, 1.0) if serving else "not serving"
        except grpc.RpcError as exc:
            why = exc.code().name
        except (OSError, PinError) as exc:
            why = _reason(exc)
        if not why:
            log.warning("node %s re-admitted", peer.label)
            return
        with self.lock:
            peer.backoff_s = min(
                max(peer.backoff_s * 2, self.config.backoff_s), self.config.max_backoff_s
            )
            peer.retry_at = time.monotonic() + peer.backoff_s
        log.debug("node %s still down (%s); next probe in %.1f s", peer.addr, why, peer.backoff_s)

    def close(self) -> None:
        self._stop.set()
        self._prober.join(timeout=2)
        for peer in self.peers:
            peer.close()


def _info(peer: Peer, nonce: bytes, timeout: float) -> pb.NodeInfo:
    """The node's Info; "busy" (RESOURCE_EXHAUSTED: others are flooding it) is asked again
    after a wait that doubles, within `timeout` in all, before it counts as a failure."""
    deadline = time.monotonic() + timeout
    wait = BUSY_FIRST_S
    while True:
        left = deadline - time.monotonic()
        try:
            return peer.stub.Info(pb.InfoRequest(nonce=nonce), timeout=max(left, 0.01))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or left <= wait:
                raise
        time.sleep(wait)
        wait = min(BUSY_MAX_S, 2 * wait)


def _reason(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError):
        return exc.code().name
    return str(exc) or type(exc).__name__
