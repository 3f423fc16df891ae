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
import random
import threading
import time
from collections import defaultdict
from functools import partial

import grpc
import numpy as np

from moeshard.coordinator.remote.audit import Auditor
from moeshard.coordinator.remote.config import RemoteConfig, RemoteError
from moeshard.coordinator.remote.degrade import drop, dropped_per_layer, missing_error
from moeshard.coordinator.remote.gather import Attempt, Round, Share, gather
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
# an abandoned call that ends so: its node failed (CANCELLED is our own cancel of it, or our
# closing of its stream when the node was banned or idle)
ABANDONED_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
LAYER_HISTORY = 100_000  # layer call times kept
FINISH_WAIT_S = 2.0  # at close, how long a node may take to end its stream
ENDED_STREAM_WAIT_S = 0.2  # a stream the node has ended holds only what it had sent
TRIAL_CALLS = 8  # a node with fewer calls this run may be given one expert of a layer on trial
_TRIAL_RANDOM = random.SystemRandom()


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
        self.hedges = 0  # shares whose reply came later than their node's p95: hedged
        self.hedge_wins = 0  # ... whose answer came from the hedge
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
                    raise missing_error(self.peers.peers, layer, miss.experts) from None
                ids, weights = drop(self.dropped, layer, ids, weights, miss.experts)
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
        at, clock = time.monotonic(), time.perf_counter()  # (call send times: perf_counter)

        def queue_ms(p: Peer) -> float:
            return p.queue_ms(at) if self.config.queue_aware else 0.0

        options: dict[int, list[Peer]] = {}
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
                # (calls run in parallel, so the layer ends with the slowest node): its
                # measured round trip beyond compute, the wait its stated queue implies (and
                # its lateness, while a reply abandoned for a hedge is still out), its experts'
                # time; involving one more node costs the coordinator `cost` of CPU.
                # Ties: fewer calls so far. A node with a poorer reputation costs more
                # (`reputation.rank_weight`).
                n = load[p.addr]
                wait = queue_ms(p) + p.late_ms(clock)
                finish = p.overhead_ms + wait + (n + 1) * p.expert_ms + (0.0 if n else cost)
                return finish * p.weight, p.calls

            best = min(cands, key=score)
            chosen[expert] = best
            load[best.addr] += 1
            options[expert] = cands
        _give_trial(chosen, options, self.config.trial_share)
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
            by_peer = _by_peer(chosen)
            for peer, _ in by_peer.values():  # the only holders left: their audits first
                self.trust.wait_backlog(peer.node_id)
                _wait_until(peer.busy_until)  # ... and their "busy" backoff
            shares = [
                Share(Attempt(*sent))
                for peer, mine in by_peer.values()
                for sent in self._requests(peer, layer, hidden, ids, weights, mine)
            ]
            if hint is not None:  # the next layer's reads start while this layer computes
                self.prefetch(hint.layer, hint.predicted)
                hint = None
            rnd = Round(layer, hidden, ids, weights, excluded)
            hedge = partial(self._hedge, rnd) if self.config.hedge else None
            judge = partial(self._judge, rnd)
            gather(shares, judge, hedge, self.peers.hedge_after_ms, self._late)
            answers = {id(s): s.answer() for s in shares}
            for share in shares:  # an answer resting on a peer that failed elsewhere: none
                if answers[id(share)] and any(a.peer.addr in rnd.bad for a in answers[id(share)]):
                    answers[id(share)] = None
            # an expert is done only when every share carrying it (row chunks) has its answer
            undone = {e for s in shares if answers[id(s)] is None for e in s.first.experts}
            done: list[int] = []
            for share in shares:
                answer = answers[id(share)]
                if answer is None or undone & set(share.first.experts):
                    continue  # its experts go to replicas in the next round
                self.hedge_wins += answer[0] is not share.first
                parts.extend((a.experts[0], a.rows, a.part) for a in answer)
                done.extend(share.first.experts)
            if rnd.fatals:
                raise rnd.fatals[-1]
            if len(done) < len(todo):
                self.retries += 1
            todo = [e for e in todo if e not in set(done)]
        ordered = sorted(parts, key=lambda p: p[0])
        return combine(hidden.shape, ((rows, part) for _, rows, part in ordered), dtype)

    def _judge(self, rnd: Round, a: Attempt) -> None:
        """Settle attempt `a`, whose call has completed (or is past its deadline): its
        verified part, or failed (its node banned, refused or caught lying)."""
        try:
            reply, rtt = a.call.result()
        except grpc.RpcError as exc:
            error = self._failed(a.peer, rnd.layer, a.experts, exc, rnd.excluded)
            rnd.fatals.extend([error] if error is not None else [])
            rnd.bad.add(a.peer.addr)
            a.failed = True
            return
        self.peers.record_latency(a.peer, rtt, reply.compute_ms, len(a.experts), reply.queued)
        self.peers.not_busy(a.peer)
        self.bytes_received += reply.ByteSize()
        part = self.trust.accept(a.peer, a.experts, len(a.rows), a.request, reply, rtt)
        if part is None:  # a lie, or its sender convicted while it was in flight
            _exclude(rnd.excluded, a.experts, a.peer)
            rnd.bad.add(a.peer.addr)
            a.failed = True
            return
        a.part = part

    def _late(self, a: Attempt) -> None:
        """An attempt abandoned for a hedge: until its reply comes, its node counts as late by
        the time since it was sent (`Peer.late_ms`), and then its round trip counts in its
        estimate, so a node that froze is not chosen again as if it had been quick (a
        cancelled unary call: its time so far)."""
        sent = a.call.sent_at
        with self.peers.lock:
            a.peer.late.append(sent)

        def record(_future) -> None:
            with self.peers.lock:
                a.peer.late.remove(sent)
            try:
                reply, rtt = a.call.result()
            except Exception as exc:  # noqa: BLE001 (cancelled or failed: its time so far)
                self.peers.record_latency(a.peer, time.perf_counter() - sent, 0.0, 1)
                code = exc.code() if isinstance(exc, grpc.RpcError) else None
                if code in ABANDONED_FAILURES:  # as if it had been waited for (not our cancel)
                    self.peers.ban(a.peer, f"a reply abandoned for a hedge failed: {code.name}")
                    self.trust.failed(a.peer)
                return
            self.peers.record_latency(a.peer, rtt, reply.compute_ms, len(a.experts), reply.queued)

        a.call.ready.add_done_callback(record)

    def _hedge(self, rnd: Round, share: Share) -> None:
        """The late `share`'s rows to other holders of its experts (none: nobody else)."""
        share.hedged = True
        first = share.first
        avoid = {e: rnd.excluded.get(e, set()) | {first.peer.addr} for e in first.experts}
        chosen, missing = self._assign(rnd.layer, first.experts, avoid)
        if missing:  # an expert no other live node holds: nothing to hedge with
            return
        for peer, mine in _by_peer(chosen).values():
            sends = self._requests(
                peer, rnd.layer, rnd.hidden, rnd.ids, rnd.weights, mine, first.rows
            )
            share.hedges.extend(Attempt(*sent) for sent in sends)
        self.hedges += 1

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

    def _requests(self, peer: Peer, layer, hidden, ids, weights, experts: list[int], among=None):
        """Send `peer` the rows that route to `experts` (of the rows `among`, if given), in as
        many Forward calls as its stated limits need; [(peer, experts, rows, request, call)]."""
        mine = np.isin(ids, experts)  # [T, k]
        rows = np.nonzero(mine.any(axis=1))[0]  # [n]
        if among is not None:
            rows = np.intersect1d(rows, among)  # [n'] (a hedge: the late share's rows only)
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
            future = peer.stub.Forward.future(request, timeout=self.config.deadline_s)
            return UnaryCall(future, self.config.deadline_s)
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

        def broken(stream: ForwardStream, peer=peer) -> None:
            with self.peers.lock:  # this stream is finished: the next call opens a new one
                if peer.stream is stream:
                    peer.stream = None

        return StreamCall(stream, request, self.config.deadline_s, broken)

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

    def stats(self) -> dict:
        return {
            "expert_bytes_read": 0,  # the nodes read the experts
            "layer_calls": self.layer_calls,
            "retries": self.retries,
            "hedges": self.hedges,
            "hedge_wins": self.hedge_wins,
            "own_calls": self.own_calls,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "dropped": {f"{a}:{b}": n for (a, b), n in self.dropped.items()},
            "dropped_per_layer": dropped_per_layer(self.dropped),
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


def _give_trial(chosen: dict[int, Peer], options: dict[int, list[Peer]], share: float) -> None:
    """Holder choice is greedy: a node never chosen keeps its estimate, so a new one may get
    no work at all, and with no work it earns no record (every call of a node still in its
    vetting is audited, `policy.rate_for`). So with probability `share` per layer call, drawn
    from `random.SystemRandom` (nothing a node sees sets it), one expert of the layer goes to
    a node that holds it and has had fewer than TRIAL_CALLS calls this run. A node gains
    little by being new: at most TRIAL_CALLS such calls per run and identity, and a node
    still in its vetting (a new identity) has every call audited (`policy.rate_for`)."""
    if share <= 0 or _TRIAL_RANDOM.random() >= share:
        return
    trials = [(e, p) for e, cands in options.items() for p in cands if p.calls < TRIAL_CALLS]
    trials = [(e, p) for e, p in trials if chosen[e] is not p]
    if trials:
        expert, peer = _TRIAL_RANDOM.choice(trials)
        chosen[expert] = peer


def _by_peer(chosen: dict[int, Peer]) -> dict[str, tuple[Peer, list[int]]]:
    """expert -> peer, as peer address -> (peer, its experts)."""
    by_peer: dict[str, tuple[Peer, list[int]]] = {}
    for expert, peer in chosen.items():
        by_peer.setdefault(peer.addr, (peer, []))[1].append(expert)
    return by_peer


def _exclude(excluded: dict[int, set[str]], experts: list[int], peer: Peer) -> None:
    for expert in experts:
        excluded[expert].add(peer.addr)
