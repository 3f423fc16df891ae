"""RemoteExperts: the experts backend that fans each MoE layer out to the storage nodes.

Per layer, every routed expert is assigned to one live node holding it (fast nodes preferred
by an EWMA of their measured round trips, work spread over nodes), each involved node gets
ONE Forward call carrying only the rows that need it, all calls go out at once over persistent
channels (so they overlap on the wire and on the nodes), and the weighted partial sums are
added up (`moeshard.moe.experts.compute.combine`). A node that fails or misses its deadline is
banned
(`moeshard.coordinator.remote.peers`); its share of the layer is re-sent to replicas within the same
call, so no token is lost and the result is the same. The next layer's prefetch hints go out
right after this layer's Forward calls, without waiting.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict
from functools import partial

import grpc
import numpy as np

from moeshard.coordinator.remote.audit import Auditor
from moeshard.coordinator.remote.config import RemoteConfig, RemoteError, UncoveredError
from moeshard.coordinator.remote.peers import Peer, PeerSet
from moeshard.coordinator.remote.transport import ForwardStream, PeerSpec, StreamCall, UnaryCall
from moeshard.coordinator.remote.trust import Trust
from moeshard.moe.experts.backend import ExpertsBackend, ExpertsBase, PrefetchHint
from moeshard.moe.experts.compute import combine, partial_sum
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb

log = logging.getLogger(__name__)

# Failures that mean "this node, not this request": ban the node and use a replica.
# (RESOURCE_EXHAUSTED is not one: a busy node is waited for, `PeerSet.busy`.)
NODE_FAILURES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
}
LAYER_HISTORY = 100_000  # layer call times kept
FINISH_WAIT_S = 2.0  # at close, how long a node may take to end its stream
ENDED_STREAM_WAIT_S = 0.2  # a stream the node has ended holds only what it had sent


class _Missing(Exception):
    def __init__(self, experts: list[int]):
        super().__init__(experts)
        self.experts = experts


class RemoteExperts(ExpertsBase):
    def __init__(
        self,
        model_id: str,
        hidden_size: int,
        specs: list[PeerSpec],
        config: RemoteConfig | None = None,
        trust: Trust | None = None,
        own: ExpertsBackend | None = None,
    ):
        """`trust`: what judges the nodes (`Trust`, built by the runtime from the model
        directory); without one, a Trust that cannot audit (then `config.audit` must be 0).
        `own`: the coordinator's own records (a full model directory's `LocalExperts`): it
        computes the experts no live node holds itself rather than fail or drop them."""
        self.model_id, self.hidden_size = model_id, hidden_size
        self.config = config or RemoteConfig()
        self.config.check()
        self.wire_dtype = codec.BY_NAME[self.config.wire_dtype]
        self.trust = trust or Trust(model_id, hidden_size, self.config)
        self.own = own
        self.own_calls = 0  # layer calls some of whose experts the coordinator computed
        self.peers = PeerSet(model_id, hidden_size, specs, self.config)
        self.trust.start(self.peers)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.layer_calls = 0
        self.retries = 0
        self.dropped: dict[tuple[int, int], int] = defaultdict(int)  # --degrade drops
        self.layer_ms: list[float] = []  # fan-out wall time of each layer call
        self._pending_hints: set = set()
        self._request_ids = itertools.count(1)  # a reply must echo its request's id

    @classmethod
    def for_model(cls, model, specs: list[PeerSpec], config: RemoteConfig) -> RemoteExperts:
        """The experts of `model` (an opened ModelDir) computed by the nodes of `specs`,
        judged by a Trust built from the directory; with `config.own_experts`, the
        directory's own records compute what no live node holds."""
        hidden = model.config.expert_hidden
        trust = Trust(model.model_id, hidden, config, model)
        own = None
        if config.own_experts and model.shard_set.locations:
            own = LocalExperts(model.shard_set)
        return cls(model.model_id, hidden, specs, config, trust, own)

    def add_peer(self, spec: PeerSpec) -> bool:
        """A node found after start-up (zeroconf): admitted if it serves this model."""
        return self.peers.add(spec)

    def live_peers(self) -> list[Peer]:
        return self.peers.live()

    # -- the forward call ---------------------------------------------------------------------

    def __call__(
        self, layer, hidden, ids, weights, dtype=np.float32, hint: PrefetchHint | None = None
    ) -> np.ndarray:
        t0 = time.perf_counter()
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)  # [T, H]
        ids = np.asarray(ids)  # [T, k]
        weights = np.asarray(weights, dtype=np.float32)  # [T, k]
        while True:
            try:
                out = self._fan_out(layer, hidden, ids, weights, dtype, hint)  # [T, H]
                break
            except _Missing as miss:
                if not self.config.degrade:
                    raise self._missing_error(layer, miss.experts) from None
                ids, weights = self._drop(layer, ids, weights, miss.experts)
        self.layer_ms.append((time.perf_counter() - t0) * 1e3)
        if len(self.layer_ms) > LAYER_HISTORY:
            del self.layer_ms[: LAYER_HISTORY // 2]
        self.layer_calls += 1
        return out

    def _assign(self, layer: int, experts, excluded) -> tuple[dict[int, Peer], list[int]]:
        """expert -> the live peer to compute it; also the experts no live peer can take."""
        live = self.peers.live()
        load: dict[str, int] = defaultdict(int)
        chosen: dict[int, Peer] = {}
        missing: list[int] = []
        cost = self.config.call_cost_ms
        for expert in experts:
            no = excluded.get(expert, ())
            cands = [p for p in live if p.holds(layer, expert) and p.addr not in no]
            if not cands:
                missing.append(expert)
                continue
            # a node with MAX_BACKLOG audits not done gets work only if nobody else can
            cands = [p for p in cands if not self.trust.backlogged(p.node_id)] or cands
            now = time.monotonic()  # ... and so does one that said "busy" a moment ago
            cands = [p for p in cands if p.busy_until <= now] or cands

            def score(p: Peer) -> tuple[float, int]:
                # When this node would finish its share of the layer if it also took `expert`
                # (calls run in parallel, so the layer ends with the slowest node); involving
                # one more node costs the coordinator `cost` of CPU. Ties: fewer calls so far.
                # A node with a poorer reputation costs more (`reputation.rank_weight`).
                n = load[p.addr]
                finish = p.overhead_ms + (n + 1) * p.expert_ms + (0.0 if n else cost)
                return finish * p.weight, p.calls

            best = min(cands, key=score)
            chosen[expert] = best
            load[best.addr] += 1
        return chosen, missing

    def _fan_out(self, layer, hidden, ids, weights, dtype, hint) -> np.ndarray:
        todo = sorted(int(e) for e in np.unique(ids) if e >= 0)  # experts still to compute
        excluded: dict[int, set[str]] = defaultdict(set)
        parts: list[tuple[int, np.ndarray, np.ndarray]] = []  # (first expert, rows, [n, H])
        while todo:
            chosen, missing = self._assign(layer, todo, excluded)
            mine = [e for e in missing if self._own_holds(layer, e)]
            if mine:  # no live node holds them: the coordinator has them, computes them
                parts.append(self._compute_own(layer, hidden, ids, weights, mine))
                todo = [e for e in todo if e not in mine]
                missing = [e for e in missing if e not in mine]
            if missing:
                raise _Missing(missing)
            if not todo:
                break
            by_peer: dict[str, tuple[Peer, list[int]]] = {}
            for expert, peer in chosen.items():
                by_peer.setdefault(peer.addr, (peer, []))[1].append(expert)
            for peer, _ in by_peer.values():  # the only holders left: their audits first
                self.trust.wait_backlog(peer.node_id)
                _wait_until(peer.busy_until)  # ... and their "busy" backoff
            calls = [
                call
                for peer, mine in by_peer.values()
                for call in self._requests(peer, layer, hidden, ids, weights, mine)
            ]
            if hint is not None:  # the next layer's reads start while this layer computes
                self.prefetch(hint.layer, hint.predicted)
                hint = None
            done: list[int] = []
            fatal: RemoteError | None = None
            got: dict[str, list] = defaultdict(list)  # peer addr -> its parts this round
            bad: set[str] = set()  # peers with a failed or refused reply: none of theirs count
            for peer, experts, rows, request, call in calls:  # every reply is consumed
                try:
                    reply, rtt = call.result()
                except grpc.RpcError as exc:
                    fatal = self._failed(peer, layer, experts, exc, excluded) or fatal
                    bad.add(peer.addr)
                    continue
                self.peers.record_latency(peer, rtt, reply.compute_ms, len(experts))
                self.peers.not_busy(peer)
                self.bytes_received += reply.ByteSize()
                part = self.trust.accept(peer, experts, len(rows), request, reply, rtt)
                if part is None:  # a lie, or its sender convicted while it was in flight
                    _exclude(excluded, experts, peer)
                    bad.add(peer.addr)
                    continue
                got[peer.addr].append((experts, rows, part))
            for addr, results in got.items():
                if addr in bad:  # its experts go to replicas in the next round
                    continue
                for experts, rows, part in results:
                    parts.append((experts[0], rows, part))
                    done.extend(experts)
            if fatal is not None:
                raise fatal
            if len(done) < len(todo):
                self.retries += 1
            todo = [e for e in todo if e not in set(done)]
        ordered = sorted(parts, key=lambda p: p[0])
        return combine(hidden.shape, ((rows, part) for _, rows, part in ordered), dtype)

    def _own_holds(self, layer: int, expert: int) -> bool:
        return self.own is not None and (layer, expert) in self.own.shards.locations

    def _compute_own(self, layer, hidden, ids, weights, experts: list[int]):
        """The coordinator's own partial sum for `experts`, as a node would compute it:
        (first expert, rows [n], float64 [n, H])."""
        mine = np.isin(ids, experts)  # [T, k]
        rows = np.nonzero(mine.any(axis=1))[0]  # [n]
        my_ids = np.where(mine[rows], ids[rows], -1)  # [n, k]
        my_weights = np.where(mine[rows], weights[rows], 0)  # [n, k]
        compute = partial(self.own, layer, dtype=np.float64)
        part = partial_sum(compute, hidden[rows], my_ids, my_weights)  # [n, H]
        self.own_calls += 1
        return experts[0], rows, part

    def _requests(self, peer: Peer, layer, hidden, ids, weights, experts: list[int]):
        """Send `peer` the rows that route to `experts`, in as many Forward calls as its
        stated limits need; [(peer, experts, rows, request, call)]."""
        mine = np.isin(ids, experts)  # [T, k]
        rows = np.nonzero(mine.any(axis=1))[0]  # [n]
        per_call = rows_per_call(peer, hidden.shape[1], ids.shape[1], self.wire_dtype)
        calls = []
        for chunk in np.array_split(rows, -(-len(rows) // per_call)):  # [<= per_call] each
            request = self._request(layer, hidden, ids, weights, mine, chunk)
            calls.append((peer, experts, chunk, request, self._send(peer, request)))
        return calls

    def _request(self, layer, hidden, ids, weights, mine, rows) -> pb.ForwardRequest:
        request = pb.ForwardRequest(
            model_id=self.model_id,
            request_id=next(self._request_ids),
            layer=layer,
            hidden=codec.encode(hidden[rows], self.wire_dtype),
            ids=codec.encode(np.where(mine[rows], ids[rows], -1), codec.I32),
            weights=codec.encode(np.where(mine[rows], weights[rows], 0), codec.F32),
            # f32 wire: partial sums come back unrounded (f64), so the total is the same bits
            # as on one machine, however the experts are spread
            out_dtype=codec.F64 if self.wire_dtype == codec.F32 else self.wire_dtype,
            session=self.trust.accounts.session if self.trust.accounts is not None else b"",
        )
        self.bytes_sent += request.ByteSize()
        return request

    def _send(self, peer: Peer, request) -> UnaryCall | StreamCall:
        with self.peers.lock:
            peer.calls += 1
            peer.last_used = time.monotonic()
        if self.config.transport == "unary":
            return UnaryCall(peer.stub.Forward.future(request, timeout=self.config.deadline_s))
        ended = None
        with self.peers.lock:
            if peer.stream is not None and peer.stream.ended():
                # ended by the node (e.g. its idle timeout): open another
                ended, peer.stream = peer.stream, None
            if peer.stream is None:
                peer.stream = ForwardStream(peer.stub)
            stream = peer.stream
        if ended is not None:
            self._check_finished(peer, ended, ENDED_STREAM_WAIT_S)
        stream.send(request)

        def broken(stream: ForwardStream, peer=peer) -> None:
            with self.peers.lock:  # this stream is finished: the next call opens a new one
                if peer.stream is stream:
                    peer.stream = None

        return StreamCall(stream, self.peers.watchdog, self.config.deadline_s, broken)

    def _failed(self, peer, layer, experts, exc: grpc.RpcError, excluded) -> RemoteError | None:
        """Handle one failed call; returns the error to raise when retrying cannot help."""
        code = exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.peers.busy(peer, exc.details()):
            return None  # not excluded: another holder if one is free, else it after a wait
        _exclude(excluded, experts, peer)
        if code in NODE_FAILURES or code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.peers.ban(peer, f"{code.name}: {exc.details()}")
            self.trust.failed(peer)
        elif code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS):
            log.warning("node %s layer %d: %s: %s", peer.addr, layer, code.name, exc.details())
            self.peers.refresh(peer)
        else:
            return RemoteError(
                f"node {peer.addr} refused layer {layer}: {code.name}: {exc.details()}"
            )
        return None

    def _missing_error(self, layer: int, experts: list[int]) -> UncoveredError:
        peers = self.peers.peers
        unknown = [p.addr for p in peers if not p.held]
        nobody = f"no node; {len(unknown)} never reached" if unknown else "no node"
        holders = {
            e: [f"{p.addr} (down)" for p in peers if p.holds(layer, e)] or [nobody] for e in experts
        }
        text = "; ".join(
            f"expert {e} of layer {layer} (held by {', '.join(h)})" for e, h in holders.items()
        )
        return UncoveredError(f"no live node holds {text}")

    def _drop(self, layer, ids, weights, experts) -> tuple[np.ndarray, np.ndarray]:
        """--degrade: remove `experts` from the routing, rescale the rest to the same total."""
        gone = np.isin(ids, experts)  # [T, k]
        if not self.dropped:  # one warning per run; the counts per layer come at the end
            log.warning("--degrade: dropping experts no live node holds; the output is degraded")
        for expert in experts:
            self.dropped[(layer, int(expert))] += int((ids == expert).sum())
            log.debug("layer %d: dropped expert %d (no live node holds it)", layer, expert)
        total = weights.sum(axis=1, keepdims=True)  # [T, 1]
        kept = np.where(gone, np.float32(0), weights)  # [T, k]
        kept_sum = kept.sum(axis=1, keepdims=True)  # [T, 1]
        scale = np.divide(total, kept_sum, out=np.zeros_like(total), where=kept_sum > 0)  # [T, 1]
        return np.where(gone, -1, ids), (kept * scale).astype(np.float32)

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, layer: int, predicted) -> None:
        """Fire-and-forget: hint each chosen replica which experts of `layer` come next."""
        if not self.config.prefetch:
            return
        experts = sorted(int(e) for e in np.unique(predicted) if e >= 0)
        chosen, _ = self._assign(layer, experts, {})
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

    # -- reporting ----------------------------------------------------------------------------

    def _dropped_per_layer(self) -> dict[int, int]:
        """--degrade: expert slots dropped per layer (token x slot pairs), layers in order."""
        per_layer: dict[int, int] = defaultdict(int)
        for (layer, _), n in self.dropped.items():
            per_layer[layer] += n
        return dict(sorted(per_layer.items()))

    def stats(self) -> dict:
        return {
            "expert_bytes_read": 0,  # the nodes read the experts
            "layer_calls": self.layer_calls,
            "retries": self.retries,
            "own_calls": self.own_calls,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "dropped": {f"{a}:{b}": n for (a, b), n in self.dropped.items()},
            "dropped_per_layer": self._dropped_per_layer(),
            **self.trust.stats(),
            "nodes": [
                {
                    "addr": p.addr,
                    "node_id": p.node_id,
                    "name": p.name,
                    "up": p.up,
                    "calls": p.calls,
                    "failures": p.failures,
                    "ewma_ms": round(p.ewma_ms, 3),
                }
                for p in self.peers.peers
            ],
        }

    @property
    def verifier(self) -> Auditor:
        """The decode loop's `Verifier`: audits roll a generation back past a liar's work."""
        return self.trust.verifier

    def _check_finished(self, peer: Peer, stream: ForwardStream, wait_s: float) -> None:
        """Read `stream` to its end; a reply no request asked for convicts its sender."""
        extra = stream.finish(wait_s)
        if extra:
            self.trust.convict(peer, f"{extra} reply(ies) to no request (a duplicate?)")

    def _finish_streams(self) -> None:
        """At the end, every stream is read to its end, in parallel, so a reply sent twice
        is noticed even if its sender got no more work."""
        with self.peers.lock:
            open_ = [(p, p.stream) for p in self.peers.peers if p.stream is not None]
            for peer, _ in open_:
                peer.stream = None
        threads = [
            threading.Thread(target=self._check_finished, args=(p, s, FINISH_WAIT_S), daemon=True)
            for p, s in open_
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def close(self) -> None:
        self._finish_streams()
        self.trust.close({p.node_id: p.stub for p in self.peers.peers if p.up and p.stub})
        self.peers.close()


def rows_per_call(peer: Peer, hidden_size: int, k: int, wire_dtype: int) -> int:
    """Rows one Forward to `peer` may carry: its stated row limit, and its byte limit over the
    bytes a row takes on the wire (hidden state, ids and weights, with some framing)."""
    limit = peer.max_rows or 1 << 30
    if peer.max_request_bytes:
        row_bytes = hidden_size * codec.ITEMSIZE[wire_dtype] + k * 8 + 16
        limit = min(limit, max(1, (peer.max_request_bytes - 4096) // row_bytes))
    return max(1, limit)


def _wait_until(at: float) -> None:
    left = at - time.monotonic()
    if left > 0:
        time.sleep(left)


def _exclude(excluded: dict[int, set[str]], experts: list[int], peer: Peer) -> None:
    for expert in experts:
        excluded[expert].add(peer.addr)
