"""RemoteExperts: the experts backend that fans each MoE layer out to the storage nodes.

Per layer, every routed expert is assigned to one live node holding it (fast nodes preferred
by an EWMA of their measured round trips, work spread over nodes), each involved node gets
ONE Forward call carrying only the rows that need it, all calls go out at once over persistent
channels (gRPC futures, so they overlap on the wire and on the nodes), and the weighted partial
sums are added up. A node that fails or misses its deadline is banned with exponential backoff;
its share of the layer is re-sent to replicas within the same call, so no token is lost and the
result is the same. A background prober re-admits banned nodes once their health check says
SERVING and their Info still matches the model. Prefetch hints go out without waiting.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
import numpy as np

from moe.errors import MoeshardError
from moe.store import FORMAT_VERSION
from moe.wire import codec, health_pb2, health_pb2_grpc
from moe.wire import moeshard_pb2 as pb
from moe.wire import moeshard_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]
IDLE_REFRESH_S = 1.0  # a node unused this long gets its latency estimate refreshed by a ping
# Failures that mean "this node, not this request": ban the node and use a replica.
NODE_FAILURES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
}


class RemoteError(MoeshardError):
    """The cluster cannot compute a layer: no live node holds a needed expert, or a bug."""


@dataclass
class RemoteConfig:
    deadline_s: float = 5.0  # deadline of one Forward call
    transport: str = "stream"  # "stream": one persistent bidi stream per node; "unary": futures
    connect_timeout_s: float = 3.0  # deadline of the start-up Info call to each peer
    wire_dtype: str = "f32"  # activations on the wire: f32 (exact) or bf16 (half the bytes)
    ewma_alpha: float = 0.2  # weight of the newest round trip in a node's latency estimate
    call_cost_ms: float = 0.3  # extra score for involving one more node in a layer
    backoff_s: float = 0.5  # first ban after a failure; doubles on each failed probe
    max_backoff_s: float = 30.0  # longest ban between probes
    probe_interval_s: float = 0.2  # how often the prober looks for banned nodes due a probe
    prefetch: bool = True  # forward next-layer prefetch hints to the nodes
    degrade: bool = False  # drop experts no live node holds (renormalising) instead of failing


@dataclass
class Peer:
    addr: str
    channel: grpc.Channel
    stub: pb_grpc.ExpertNodeStub
    health: health_pb2_grpc.HealthStub
    node_id: str = ""
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
    stream: _Stream | None = None  # the persistent ForwardStream (transport "stream")
    last_used: float = 0.0  # monotonic time of the last Forward sent to it
    last_ping: float = 0.0  # monotonic time of the last idle-refresh ping

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.held


def check_health(addr: str, timeout: float = 2.0) -> str:
    """grpc.health.v1 Check of `addr`: 'SERVING', 'NOT_SERVING', ... or 'UNREACHABLE (...)'."""
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            return f"UNREACHABLE ({exc.code().name}: {exc.details()})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class RemoteExperts:
    """Experts backend over gRPC nodes: `__call__(layer, hidden, ids, weights)` and `prefetch`."""

    def __init__(
        self,
        model_id: str,
        hidden_size: int,
        addrs: list[str],
        config: RemoteConfig | None = None,
    ):
        self.model_id = model_id
        self.hidden_size = hidden_size
        self.config = config or RemoteConfig()
        if self.config.wire_dtype not in ("f32", "bf16"):
            raise MoeshardError(f"wire dtype {self.config.wire_dtype}: use f32 or bf16")
        if self.config.transport not in ("stream", "unary"):
            raise MoeshardError(f"transport {self.config.transport}: use stream or unary")
        self._watched: dict[int, tuple[_Stream, float]] = {}  # stream deadlines (watchdog)
        self.wire_dtype = codec.BY_NAME[self.config.wire_dtype]
        self.lock = threading.Lock()  # guards peer state shared with the prober
        self.peers: list[Peer] = []
        self.ignored: dict[str, str] = {}  # addr -> why it is not used
        self.bytes_read = 0  # the Runtime's stats field (experts are not read here)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.layer_calls = 0
        self.retries = 0
        self.dropped: dict[tuple[int, int], int] = defaultdict(int)  # --degrade drops
        self.layer_ms: list[float] = []  # fan-out wall time of each layer call
        self._pending_hints: set = set()
        self.watcher = None  # a coordinator.discovery.Watcher feeding `add_peer`, closed with us
        for addr in dict.fromkeys(addrs):
            self._connect(addr)
        if not any(p.up for p in self.peers):
            for peer in self.peers:
                self.ignored[peer.addr] = "unreachable"
                peer.channel.close()
            reasons = "; ".join(f"{a}: {r}" for a, r in self.ignored.items()) or "none given"
            raise RemoteError(f"no usable expert nodes ({reasons})")
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="node-prober", daemon=True)
        self._prober.start()

    # -- membership ------------------------------------------------------------------------

    @staticmethod
    def _new_peer(addr: str) -> Peer:
        channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        return Peer(
            addr, channel, pb_grpc.ExpertNodeStub(channel), health_pb2_grpc.HealthStub(channel)
        )

    def _connect(self, addr: str) -> None:
        peer = self._new_peer(addr)
        try:
            why = self._admit(peer, self.config.connect_timeout_s)
        except grpc.RpcError as exc:
            # Reachable later, perhaps: keep it banned and let the prober try.
            log.warning("node %s unreachable at start (%s); will retry", addr, exc.code().name)
            peer.backoff_s = self.config.backoff_s
            peer.retry_at = time.monotonic() + peer.backoff_s
            self.peers.append(peer)
            return
        if why:
            log.warning("ignoring node %s: %s", addr, why)
            self.ignored[addr] = why
            peer.channel.close()
            return
        self.peers.append(peer)

    def add_peer(self, addr: str) -> bool:
        """Admit a node that appeared after start-up (fed by zeroconf's `Watcher`); True if
        it is now used. A known address is skipped, and so is a node whose id is already up
        at another address (a node on all interfaces is announced under each)."""
        with self.lock:
            if addr in self.ignored or any(p.addr == addr for p in self.peers):
                return False
        peer = self._new_peer(addr)
        try:
            why = self._admit(peer, self.config.connect_timeout_s)
        except grpc.RpcError as exc:
            why = f"unreachable ({exc.code().name})"  # announced but not answering: skip it
        with self.lock:
            if not why and any(p.up and p.node_id == peer.node_id for p in self.peers):
                why = f"node {peer.node_id} is already used at another address"
            elif not why:
                self.peers.append(peer)
        if why:
            log.info("discovered node %s not added: %s", addr, why)
            peer.channel.close()
            return False
        log.warning("node %s (%s) joined: %d experts", peer.node_id, addr, len(peer.held))
        return True

    def _admit(self, peer: Peer, timeout: float) -> str:
        """Info call: '' and the peer marked up if it serves this model, else the reason."""
        info = peer.stub.Info(pb.InfoRequest(), timeout=timeout)  # also sets up the connection
        rtt_ms = min(self._ping_ms(peer, timeout) for _ in range(3))
        if info.model_id != self.model_id:
            return f"model id {info.model_id[:16]} differs from ours {self.model_id[:16]}"
        if info.format_version != FORMAT_VERSION:
            return f"format version {info.format_version}, ours is {FORMAT_VERSION}"
        if info.hidden_size != self.hidden_size:
            return f"hidden size {info.hidden_size}, ours is {self.hidden_size}"
        held = {(h.layer, e) for h in info.holdings for e in h.experts}
        with self.lock:
            peer.node_id, peer.held = info.node_id, held
            if not peer.latencies_ms:
                peer.ewma_ms = peer.overhead_ms = rtt_ms
            peer.up, peer.backoff_s = True, 0.0
        log.info("node %s (%s): %d experts, %.2f ms", peer.node_id, peer.addr, len(held), rtt_ms)
        return ""

    def _ping_ms(self, peer: Peer, timeout: float) -> float:
        t0 = time.perf_counter()
        peer.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return (time.perf_counter() - t0) * 1e3

    def _refresh_idle(self, now: float) -> None:
        """Nodes not chosen lately get their estimate refreshed by a ping, so one slow
        measurement does not starve a node forever (and a recovered node wins work back)."""
        for peer in self.live_peers():
            if now - peer.last_used < IDLE_REFRESH_S or now - peer.last_ping < IDLE_REFRESH_S:
                continue
            peer.last_ping = now
            try:
                ms = self._ping_ms(peer, 1.0)
            except grpc.RpcError as exc:
                self._ban(peer, f"idle ping failed: {exc.code().name}")
                continue
            with self.lock:
                peer.overhead_ms = 0.5 * peer.overhead_ms + 0.5 * ms

    def _ban(self, peer: Peer, reason: str) -> None:
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
        log.warning(
            "node %s (%s) banned for %.1f s: %s", peer.node_id, peer.addr, peer.backoff_s, reason
        )

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.config.probe_interval_s):
            now = time.monotonic()
            for stream, deadline in list(self._watched.values()):
                if now > deadline:  # a stream reply is overdue: end the stream
                    stream.cancel()
            self._refresh_idle(now)
            for peer in list(self.peers):
                if peer.up or now < peer.retry_at:
                    continue
                self._probe(peer)

    def _probe(self, peer: Peer) -> None:
        try:
            reply = peer.health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            why = self._admit(peer, 1.0) if serving else "not serving"
        except grpc.RpcError as exc:
            why = exc.code().name
        if not why:
            log.warning("node %s (%s) re-admitted", peer.node_id, peer.addr)
            return
        with self.lock:
            peer.backoff_s = min(
                max(peer.backoff_s * 2, self.config.backoff_s), self.config.max_backoff_s
            )
            peer.retry_at = time.monotonic() + peer.backoff_s
        log.debug("node %s still down (%s); next probe in %.1f s", peer.addr, why, peer.backoff_s)

    def live_peers(self) -> list[Peer]:
        with self.lock:
            return [p for p in self.peers if p.up]

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self._stop.set()
        self._prober.join(timeout=2)
        for peer in self.peers:
            if peer.stream is not None:
                peer.stream.close()
            peer.channel.close()

    # -- assignment ------------------------------------------------------------------------

    def _assign(
        self, layer: int, experts, excluded: dict[int, set[str]]
    ) -> tuple[dict[int, Peer], list[int]]:
        """expert -> the live peer to compute it; also the experts no live peer can take."""
        live = self.live_peers()
        load: dict[str, int] = defaultdict(int)
        chosen: dict[int, Peer] = {}
        missing: list[int] = []
        for expert in experts:
            no = excluded.get(expert, ())
            cands = [p for p in live if p.holds(layer, expert) and p.addr not in no]
            if not cands:
                missing.append(expert)
                continue
            cost = self.config.call_cost_ms

            def score(p: Peer, cost=cost) -> tuple[float, int]:
                # When this node would finish its share of the layer if it also took `expert`
                # (calls run in parallel, so the layer ends with the slowest node); involving
                # one more node costs the coordinator `cost` of CPU. Ties: fewer calls so far.
                n = load[p.addr]
                finish = p.overhead_ms + (n + 1) * p.expert_ms + (0.0 if n else cost)
                return finish, p.calls

            best = min(cands, key=score)
            chosen[expert] = best
            load[best.addr] += 1
        return chosen, missing

    def _missing_error(self, layer: int, experts: list[int]) -> RemoteError:
        unknown = [p.addr for p in self.peers if not p.held]
        nobody = f"no node; {len(unknown)} never reached" if unknown else "no node"
        holders = {
            e: [f"{p.addr} (down)" for p in self.peers if p.holds(layer, e)] or [nobody]
            for e in experts
        }
        text = "; ".join(
            f"expert {e} of layer {layer} (held by {', '.join(h)})" for e, h in holders.items()
        )
        return RemoteError(f"no live node holds {text}")

    # -- the forward call ------------------------------------------------------------------

    def __call__(
        self, layer: int, hidden: np.ndarray, ids: np.ndarray, weights: np.ndarray
    ) -> np.ndarray:
        """hidden [T, H], ids/weights [T, k] -> [T, H] = sum_k weights * expert(hidden)."""
        t0 = time.perf_counter()
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)  # [T, H]
        ids = np.asarray(ids)  # [T, k]
        weights = np.asarray(weights, dtype=np.float32)  # [T, k]
        while True:
            try:
                out = self._fan_out(layer, hidden, ids, weights)  # [T, H]
                break
            except _Missing as miss:
                if not self.config.degrade:
                    raise self._missing_error(layer, miss.experts) from None
                ids, weights = self._drop(layer, ids, weights, miss.experts)
        self.layer_ms.append((time.perf_counter() - t0) * 1e3)
        if len(self.layer_ms) > 100_000:
            del self.layer_ms[:50_000]
        self.layer_calls += 1
        return out

    def _drop(self, layer, ids, weights, experts) -> tuple[np.ndarray, np.ndarray]:
        """--degrade: remove `experts` from the routing, rescale the rest to the same total."""
        gone = np.isin(ids, experts)  # [T, k]
        for expert in experts:
            self.dropped[(layer, int(expert))] += int((ids == expert).sum())
            log.warning("layer %d: dropped expert %d (no live node holds it)", layer, expert)
        total = weights.sum(axis=1, keepdims=True)  # [T, 1]
        kept = np.where(gone, np.float32(0), weights)  # [T, k]
        kept_sum = kept.sum(axis=1, keepdims=True)  # [T, 1]
        scale = np.divide(total, kept_sum, out=np.zeros_like(total), where=kept_sum > 0)  # [T, 1]
        return np.where(gone, -1, ids), (kept * scale).astype(np.float32)

    def _fan_out(self, layer, hidden, ids, weights) -> np.ndarray:
        todo = sorted(int(e) for e in np.unique(ids) if e >= 0)  # experts still to compute
        excluded: dict[int, set[str]] = defaultdict(set)
        partials: list[tuple[int, np.ndarray, np.ndarray]] = []  # (first expert, rows, [n, H])
        while todo:
            chosen, missing = self._assign(layer, todo, excluded)
            if missing:
                raise _Missing(missing)
            by_peer: dict[str, list[int]] = defaultdict(list)
            peers = {}
            for expert, peer in chosen.items():
                by_peer[peer.addr].append(expert)
                peers[peer.addr] = peer
            calls = []
            for addr, experts in by_peer.items():
                mine = np.isin(ids, experts)  # [T, k]
                rows = np.nonzero(mine.any(axis=1))[0]  # [n]
                request = pb.ForwardRequest(
                    model_id=self.model_id,
                    layer=layer,
                    hidden=codec.encode(hidden[rows], self.wire_dtype),
                    ids=codec.encode(np.where(mine[rows], ids[rows], -1), codec.I32),
                    weights=codec.encode(np.where(mine[rows], weights[rows], 0), codec.F32),
                    # f32 wire: partial sums come back unrounded (f64), so the total is the
                    # same bits as on one machine, however the experts are spread
                    out_dtype=codec.F64 if self.wire_dtype == codec.F32 else self.wire_dtype,
                )
                self.bytes_sent += request.ByteSize()
                calls.append((peers[addr], experts, rows, self._send(peers[addr], request)))
            done = []
            fatal: RemoteError | None = None
            for peer, experts, rows, call in calls:  # every reply is consumed (stream order)
                try:
                    reply, rtt = call.result()
                except grpc.RpcError as exc:
                    fatal = self._failed(peer, layer, experts, exc, excluded) or fatal
                    continue
                self._record_latency(peer, rtt, reply.compute_ms, len(experts))
                self.bytes_received += reply.ByteSize()
                try:
                    part = codec.decode(
                        reply.out,
                        "reply",
                        (codec.F64, codec.F32, codec.BF16),
                        (len(rows), self.hidden_size),
                    )  # [n, H]
                except codec.CodecError as exc:
                    self._ban(peer, f"malformed reply: {exc}")
                    excluded_for(excluded, experts, peer)
                    continue
                partials.append((experts[0], rows, part))
                done.extend(experts)
            if fatal is not None:
                raise fatal
            if len(done) < len(todo):
                self.retries += 1
            todo = [e for e in todo if e not in set(done)]
        out = np.zeros(hidden.shape, dtype=np.float64)  # [T, H]
        for _, rows, part in sorted(partials, key=lambda p: p[0]):
            out[rows] += part  # [n, H]
        return out.astype(np.float32)

    def _send(self, peer: Peer, request) -> _UnaryCall | _StreamCall:
        with self.lock:
            peer.calls += 1
            peer.last_used = time.monotonic()
        if self.config.transport == "unary":
            return _UnaryCall(peer.stub.Forward.future(request, timeout=self.config.deadline_s))
        with self.lock:
            if peer.stream is None:
                peer.stream = _Stream(peer.stub)
            stream = peer.stream
        stream.send(request)
        return _StreamCall(self, peer, stream, self.config.deadline_s)

    def _record_latency(self, peer: Peer, seconds: float, compute_ms: float, experts: int):
        ms = seconds * 1e3
        a = self.config.ewma_alpha
        with self.lock:
            peer.ewma_ms = (1 - a) * peer.ewma_ms + a * ms
            peer.overhead_ms = (1 - a) * peer.overhead_ms + a * max(ms - compute_ms, 0.0)
            peer.expert_ms = (1 - a) * peer.expert_ms + a * compute_ms / max(experts, 1)
            peer.latencies_ms.append(ms)
            if len(peer.latencies_ms) > 4096:
                del peer.latencies_ms[:2048]

    def _failed(self, peer, layer, experts, exc: grpc.RpcError, excluded) -> RemoteError | None:
        """Handle one failed call; returns the error to raise when retrying cannot help."""
        code = exc.code()
        excluded_for(excluded, experts, peer)
        if code in NODE_FAILURES:
            self._ban(peer, f"{code.name}: {exc.details()}")
        elif code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS):
            # The node no longer serves some of these records: refresh what it holds.
            log.warning("node %s layer %d: %s: %s", peer.addr, layer, code.name, exc.details())
            try:
                why = self._admit(peer, self.config.connect_timeout_s)
            except grpc.RpcError as info_exc:
                why = f"Info failed: {info_exc.code().name}"
            if why:
                self._ban(peer, why)
        else:
            return RemoteError(
                f"node {peer.addr} refused layer {layer}: {code.name}: {exc.details()}"
            )
        return None

    # -- prefetch --------------------------------------------------------------------------

    def prefetch(self, layer: int, experts) -> None:
        """Fire-and-forget: hint each chosen replica which experts of `layer` come next."""
        if not self.config.prefetch:
            return
        chosen, _ = self._assign(layer, sorted(int(e) for e in experts), {})
        by_peer: dict[str, tuple[Peer, list[int]]] = {}
        for expert, peer in chosen.items():
            by_peer.setdefault(peer.addr, (peer, []))[1].append(expert)
        for peer, mine in by_peer.values():
            request = pb.PrefetchRequest(model_id=self.model_id, layer=layer, experts=mine)
            future = peer.stub.Prefetch.future(request, timeout=self.config.deadline_s)
            self._pending_hints.add(future)
            future.add_done_callback(self._hint_done)

    def _hint_done(self, future) -> None:
        self._pending_hints.discard(future)
        if future.exception() is not None:
            log.debug("prefetch hint failed: %s", future.exception())

    # -- reporting -------------------------------------------------------------------------

    def summary(self) -> dict:
        return {
            "layer_calls": self.layer_calls,
            "retries": self.retries,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "dropped": {f"{a}:{b}": n for (a, b), n in self.dropped.items()},
            "nodes": [
                {
                    "addr": p.addr,
                    "node_id": p.node_id,
                    "up": p.up,
                    "calls": p.calls,
                    "failures": p.failures,
                    "ewma_ms": round(p.ewma_ms, 3),
                }
                for p in self.peers
            ],
        }


class _UnaryCall:
    """One Forward future; result() -> (reply, seconds from send to completion)."""

    def __init__(self, future):
        self.sent_at = time.perf_counter()
        self.finished = 0.0
        self.future = future
        future.add_done_callback(self._done)

    def _done(self, _future) -> None:
        self.finished = time.perf_counter()

    def result(self):
        reply = self.future.result()
        return reply, max(self.finished, self.sent_at) - self.sent_at


class _StreamError(grpc.RpcError):
    """A ForwardStream that ended without a usable status: closed by the node, or a reply
    that missed its deadline (the watchdog cancelled the stream)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Stream:
    """A persistent ForwardStream: requests go in through a queue, replies come back in order."""

    def __init__(self, stub: pb_grpc.ExpertNodeStub):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stub.ForwardStream(iter(self.outbox.get, None))
        self.timed_out = False

    def send(self, request) -> None:
        self.outbox.put(request)

    def receive(self):
        try:
            return next(self.replies)
        except StopIteration:
            raise _StreamError(grpc.StatusCode.UNAVAILABLE, "stream closed by the node") from None
        except grpc.RpcError:
            if self.timed_out:
                raise _StreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no reply by the deadline"
                ) from None
            raise

    def cancel(self) -> None:
        """Called by the watchdog when a reply is overdue."""
        self.timed_out = True
        self.replies.cancel()

    def close(self) -> None:
        self.outbox.put(None)
        self.replies.cancel()


class _StreamCall:
    """One request on a peer's stream; result() waits for its reply under the deadline."""

    def __init__(self, remote: RemoteExperts, peer: Peer, stream: _Stream, deadline_s: float):
        self.remote, self.peer, self.stream = remote, peer, stream
        self.sent_at = time.perf_counter()
        self.deadline = time.monotonic() + deadline_s

    def result(self):
        key = id(self)
        self.remote._watched[key] = (self.stream, self.deadline)
        try:
            reply = self.stream.receive()
        except grpc.RpcError:
            with self.remote.lock:  # this stream is finished: the next call opens a new one
                if self.peer.stream is self.stream:
                    self.peer.stream = None
            self.stream.close()
            raise
        finally:
            self.remote._watched.pop(key, None)
        return reply, time.perf_counter() - self.sent_at


class _Missing(Exception):
    def __init__(self, experts: list[int]):
        super().__init__(experts)
        self.experts = experts


def excluded_for(excluded: dict[int, set[str]], experts: list[int], peer: Peer) -> None:
    for expert in experts:
        excluded[expert].add(peer.addr)


def describe_cluster(model, addrs: list[str], pings: int = 5) -> str:
    """Text report: live nodes, what they hold, coverage of the model's experts, latency."""
    remote = RemoteExperts(model.model_id, model.config.hidden_size, addrs)
    try:
        lines = [f"model {model.model_id[:16]}: {len(addrs)} node address(es)"]
        for peer in remote.peers:
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
        for addr, why in remote.ignored.items():
            lines.append(f"  {addr:<22} ignored: {why}")
        counts = defaultdict(int)
        live = remote.live_peers()
        for key in model.locations:
            counts[min(sum(1 for p in live if key in p.held), 2)] += 1
        lines.append(
            f"coverage of {len(model.locations)} experts: {counts[0]} with 0 live replicas, "
            f"{counts[1]} with 1, {counts[2]} with >=2"
        )
        return "\n".join(lines)
    finally:
        remote.close()
