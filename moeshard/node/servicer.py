"""The node's gRPC servicer: a thin layer that admits, validates, calls the experts backend,
replies. `ExpertNodeServicer` implements moeshard.v1.ExpertNode (proto/moeshard.proto) on top of any
`moeshard.moe.experts.backend.ExpertsBackend` (LocalExperts, or the ExpertStore under `--ram`).
Every call is authorized (node/access.py) and admitted under the node's limits (node/limits.py)
before its message is read; every request is checked (node/checks.py) before the backend sees
it, and every result before it is sent. A bad request gets a status code and a message and the
node keeps serving. A Prefetch hint starts its reads at once. A Record stream sends one record's
bytes in chunks (node/records.py). grpc.health.v1 is in node/health.py.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from moeshard.moe.errors import StoreError
from moeshard.moe.experts.backend import ExpertsBackend
from moeshard.moe.experts.compute import partial_sum
from moeshard.moe.identity.keys import Identity
from moeshard.moe.identity.receipts import SESSION_BYTES, check_settlement, make_receipt
from moeshard.moe.identity.signed import sign_info
from moeshard.moe.kernels.build import ARITHMETIC, cpu_level, kernel_build
from moeshard.moe.ledger import BackgroundLedger, LedgerError, receipt_body, settlement_body
from moeshard.moe.storage.shards import ShardSet
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire.constants import WIRE_VERSION
from moeshard.node import failpoints
from moeshard.node.access import AccessDenied, AccessPolicy
from moeshard.node.checks import (
    NodeIdentity,
    RequestError,
    check_model,
    check_result,
    claimed_rows,
    parse_forward,
)
from moeshard.node.fairness import Flow, flow_of
from moeshard.node.guard import Guard
from moeshard.node.health import SERVICE
from moeshard.node.holdings import layer_experts
from moeshard.node.limits import CHUNK_ROWS, Limits, Refused
from moeshard.node.possession import Prover
from moeshard.node.priority import lower_priority
from moeshard.node.records import Records, chunks
from moeshard.node.settlements import Settlements

log = logging.getLogger(__name__)
RECORD_REQUEST_S = 2.0  # a Record stream's request must come this soon after it opens
BULK_NICE = 10  # the bulk thread's nice value above the node's (see `ExpertNodeServicer.bulk`)
NOT_FORWARD = (
    "duplicate",
    "forged_block",
    "forged_record",
    "late_proof",
    "busy",
)  # failpoints that leave replies be


class ExpertNodeServicer:
    """Admit -> validate -> experts backend -> check -> reply. Thread-safe; compute is serialised
    by a lock. `register` puts it on a grpc server."""

    def __init__(
        self,
        identity: NodeIdentity,
        held: set[tuple[int, int]],
        backend: ExpertsBackend,
        access: AccessPolicy | None = None,
        key: Identity | None = None,  # signs Info replies
        *,
        limits: Limits,  # resolved (Limits.resolve)
        shards: ShardSet | None = None,  # the records served: receipts' sizes, possession proofs
    ):
        self.access = access or AccessPolicy(tls=False)
        self.key = key
        self.lie = failpoints.from_environment()  # tests only: off unless MOESHARD_FAILPOINTS
        self.lie_rng = random.Random(0)
        self.identity = identity
        self.held = set(held)  # (layer, expert) records this node can compute
        self.bad: set[tuple[int, int]] = set()  # records that failed their checksum
        self.backend = backend
        self.limits = limits
        self.guard = Guard(limits)
        self.compute_lock = threading.Lock()
        # large requests are parsed, computed and encoded on threads of lower CPU priority (one
        # per request that may compute at once): on a busy node the threads that receive,
        # check and answer other clients' small requests go first
        self.bulk = ThreadPoolExecutor(
            limits.max_active, "bulk", initializer=lower_priority, initargs=(BULK_NICE,)
        )
        self.state_lock = threading.Lock()
        self.inflight = 0
        self.served = 0
        # receipts and settlements (issue 15; moe/identity/receipts.py, moe/ledger)
        self.ledger: BackgroundLedger | None = None  # set by the daemon: receipts, settlements
        self.record_nbytes = shards.record_nbytes if shards is not None else 0
        self.settle_lock = threading.Lock()
        self.settlements = Settlements()  # who may settle what (node/settlements.py)
        self.prover = Prover(  # possession challenges (node/possession.py)
            shards,
            key,
            identity.model_id,
            self.held,
            self.bad,
            self.state_lock,
        )
        self.records = Records(  # records for a coordinator that recomputes (node/records.py)
            shards, identity.model_id, self.held, self.bad, self.state_lock
        )

    def register(self, server: grpc.Server) -> None:
        """Serve moeshard.v1.ExpertNode on `server`. The unary methods are registered as
        client-streaming handlers (the same bytes on the wire): grpc then hands over the call
        before reading its message, so a call over the limits is refused unread, and a message
        that does not come within the idle timeout ends the call instead of holding a thread.
        Record (one request, a stream of replies) is registered as bidirectional for the same
        reason."""

        def unary(method, request, reply):
            return grpc.stream_unary_rpc_method_handler(
                self._unary(method), request.FromString, reply.SerializeToString
            )

        handlers = {
            "Info": unary(self.Info, pb.InfoRequest, pb.NodeInfo),
            # Forwards come as bytes, parsed only once they have a place in the compute queue:
            # a flood of large requests costs the node no parsing beyond its fair share
            "Forward": grpc.stream_unary_rpc_method_handler(
                self._unary(self.Forward), None, _reply_bytes
            ),
            "Prefetch": unary(self.Prefetch, pb.PrefetchRequest, pb.PrefetchReply),
            "Settle": unary(self.Settle, pb.Settlement, pb.SettleReply),
            "Challenge": unary(self.Challenge, pb.ChallengeRequest, pb.ChallengeReply),
            "ForwardStream": grpc.stream_stream_rpc_method_handler(
                self.ForwardStream, None, _reply_bytes
            ),
            "Record": grpc.stream_stream_rpc_method_handler(
                self.Record, pb.RecordRequest.FromString, pb.RecordChunk.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    def close(self) -> None:
        self.guard.close()
        self.bulk.shutdown(wait=False)
        if self.ledger is not None:
            self.ledger.close()

    # -- admission ---------------------------------------------------------------------------

    @contextmanager
    def _refusals(self, context):
        """Turn a refusal raised in the block into the call's status."""
        try:
            yield
        except (AccessDenied, Refused, RequestError) as exc:
            context.abort(exc.code, str(exc))

    def _caller(self, context) -> str:
        """The key the per-client limits count under: the client's id, or its address under
        --insecure (no identities). AccessDenied if it may not call this node."""
        return self.access.caller(context) or context.peer()

    def _unary(self, method):
        """A client-streaming handler for the unary `method(request, context)`: authorize and
        admit the call, then read its one message (under the idle timeout) and charge it."""

        kind = "call" if method == self.Forward else "control"  # (see Limits.max_controls)

        def call(requests, context):
            with self._refusals(context):
                client = self._caller(context)
                with self.guard.admit(client, kind, context.peer()) as handle:
                    if kind == "call":  # (a Forward: read once this client has no other waiting)
                        self.guard.before_reading(handle.flow, context.time_remaining(), handle)
                    request = self.guard.read(requests, handle=handle)
                    if request is None:
                        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
                    if isinstance(request, bytes):  # a Forward: charged once parsed
                        self.guard.charge(client)
                    else:
                        self.guard.charge(client, claimed_rows(request, self.limits.max_rows))
                    return method(request, context)

        return call

    # -- RPCs ------------------------------------------------------------------------------

    def Info(self, request, context):
        ident = self.identity
        with self.state_lock:
            good, bad = self.held - self.bad, set(self.bad)
            inflight, served = self.inflight, self.served
        with self.compute_lock:  # the backend's counters change under this lock
            stats = {k: float(v) for k, v in self.backend.stats().items() if _is_number(v)}
        info = pb.NodeInfo(
            node_id=ident.node_id,
            model_id=ident.model_id,
            format_version=ident.format_version,
            model_type=ident.model_type,
            expert_format=ident.expert_format,
            hidden_size=ident.hidden_size,
            holdings=layer_experts(good),
            bad=layer_experts(bad),
            ram_budget=ident.ram_budget,
            inflight=inflight,
            served=served,
            wire_version=WIRE_VERSION,
            stats=stats,
            name=ident.name,
            max_rows=self.limits.max_rows,
            max_request_bytes=self.limits.max_request_bytes,
            record_rate=int(self.limits.record_rate),
            per_client_records=self.limits.per_client_records,
            kernel_build=kernel_build(),
            cpu_level=cpu_level(),
            arithmetic=ARITHMETIC,
        )
        if self.key is not None:
            sign_info(self.key, info, request.nonce)
        return info

    def Forward(self, raw: bytes, context):
        client = self._caller(context)
        flow = flow_of(client, context.peer())
        rows = self._wire_rows(raw)
        with self.guard.computing(flow, rows, context.time_remaining()):
            reply, wire = self._answer(client, flow, raw, rows)
        self._credit(client, reply)
        return wire

    def _answer(self, client: str, flow: Flow, raw: bytes, rows: int):
        """The reply to the Forward in `raw` and what to send (the reply, or for a large one
        its bytes, serialized on the low-priority thread that parsed and computed it)."""
        if rows <= CHUNK_ROWS:
            reply = self._forward(self._parse_forward(client, raw), flow)
            return reply, reply

        def bulk() -> tuple[pb.ForwardReply, bytes]:
            reply = self._forward(self._parse_forward(client, raw), flow)
            return reply, reply.SerializeToString()

        return self.bulk.submit(bulk).result()

    def _wire_rows(self, raw: bytes) -> int:
        """About the rows a Forward message of these bytes carries (before parsing it)."""
        return max(1, len(raw) // (4 * self.identity.hidden_size))

    def _parse_forward(self, client: str, raw: bytes) -> pb.ForwardRequest:
        """The ForwardRequest in `raw`, its rows checked and charged to `client`."""
        if self.lie is not None and self.lie.mode == "busy" and self.lie.fires(self.lie_rng):
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "node busy (failpoint)")  # tests
        try:
            request = pb.ForwardRequest.FromString(raw)
        except DecodeError as exc:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a ForwardRequest: {exc}"
            ) from None
        self.guard.charge(client, claimed_rows(request, self.limits.max_rows), calls=0)
        return request

    def ForwardStream(self, requests, context):
        """Each message is a Forward, charged and queued for compute like a unary one; the
        stream ends when the client closes it or sends nothing for the idle timeout."""
        with self._refusals(context):
            client = self._caller(context)
            with self.guard.admit(client, "stream", context.peer()) as handle:
                while True:
                    self.guard.before_reading(handle.flow, handle=handle)  # (see its docstring)
                    raw = self.guard.read(requests, handle=handle)
                    if raw is None:
                        break
                    self.guard.charge(client)
                    rows = self._wire_rows(raw)
                    with self.guard.computing(handle.flow, rows):
                        reply, wire = self._answer(client, handle.flow, raw, rows)
                    self._credit(client, reply)
                    del raw, reply  # a reply the client does not take holds only itself
                    with self.guard.sending(lambda: self._stalled(client, context), handle):
                        yield wire
                    if self.lie is not None and self.lie.mode == "duplicate":
                        if self.lie.fires(self.lie_rng):
                            yield wire  # a failpoint: one request, two replies

    def _credit(self, client: str, reply: pb.ForwardReply) -> None:
        """The records this reply was computed with may be fetched by its client beyond its
        record rate (`Guard.credit_records`): what an audit of it needs. A receipt in it lets
        the client settle its session (`Settlements`)."""
        self.guard.credit_records(client, reply.experts_computed * self.record_nbytes)
        if reply.HasField("receipt"):
            self.settlements.issued(reply.receipt.session, client)

    def Prefetch(self, request, context):
        check_model(request.model_id, self.identity)
        with self.state_lock:
            wanted = [e for e in request.experts if (request.layer, e) in self.held - self.bad]
        if wanted:
            try:
                with self.compute_lock:  # the backend is not thread-safe; starting reads is cheap
                    self.backend.prefetch(int(request.layer), np.asarray(wanted, dtype=np.int64))
            except StoreError as exc:  # a hint must never fail the caller
                log.warning("prefetch of layer %d failed: %s", request.layer, exc)
        return pb.PrefetchReply(accepted=len(wanted))

    def Challenge(self, request, context):
        """Proof of possession: the challenged blocks with their Merkle paths, signed."""
        forge = self.lie is not None and self.lie.mode == "forged_block"  # tests only
        if self.lie is not None and self.lie.mode == "late_proof":  # tests only
            time.sleep(self.lie.arg)
        return self.prover.answer(request, context.time_remaining(), forge=forge)

    def Record(self, requests, context):
        """One record's bytes in chunks. Authorized and admitted (--max-records,
        --per-client-records) before the request is read, the request read within
        RECORD_REQUEST_S (a caller that opens the stream and sends nothing holds a record
        slot no longer than that: the slots are what a coordinator's audits need); the
        record's bytes are charged to the client's byte rate before the disk is read. Each
        chunk must be taken by the client within the idle timeout, or the stream is
        cancelled (a client that stops reading would hold the thread and the record)."""
        with self._refusals(context):
            client = self._caller(context)
            with self.guard.admit(client, "record", context.peer()) as handle:
                request = self.guard.read(
                    requests, min(RECORD_REQUEST_S, self.limits.idle_timeout_s), handle
                )
                if request is None:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
                self.guard.charge(client)
                self.records.check(request)
                self.guard.charge_bytes(client, self.records.record_nbytes)
                record = self.records.read(request.layer, request.expert)  # uint8 [nbytes]
                forge = self.lie is not None and self.lie.mode == "forged_record"  # tests only
                for chunk in chunks(record, forge=forge and self.lie.fires(self.lie_rng)):
                    with self.guard.sending(lambda: self._stalled(client, context)):
                        yield chunk

    @staticmethod
    def _stalled(client: str, context) -> None:
        """The end of a stream whose client stopped reading it (the watchdog's), or was
        evicted while its reply waited."""
        log.warning("client %s does not take its replies: stream ended", client or context.peer())
        context.cancel()

    # -- receipts and settlements (issue 15) -------------------------------------------------

    def _receipt(self, request, reply, ids, live) -> None:
        """Sign what this request made the node do into its reply, and keep it in the ledger
        (queued: the reply does not wait for the disk)."""
        if len(request.session) != SESSION_BYTES:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"session of {len(request.session)} bytes: need {SESSION_BYTES} (or none)",
            )
        if self.key is None:
            return
        experts = np.unique(ids[ids >= 0])  # ascending
        receipt = make_receipt(
            self.key,
            self.identity.model_id,
            request,
            reply.out.data,
            experts,
            int(live.sum()),
            len(experts) * self.record_nbytes,
            ARITHMETIC,
        )
        reply.receipt.CopyFrom(receipt)
        if self.ledger is not None:
            self.ledger.append("receipt", receipt_body(receipt, self.key.public_raw))

    def Settle(self, request, context):
        """A coordinator's signed totals for this node. Refused with a status unless the
        caller had receipts in the session and has not settled it, within its rate
        (node/settlements.py); then checked (signature, this node, this model, sent by the
        coordinator that signed it) and kept in the ledger before it is accepted."""
        ident = self.identity
        client = self._caller(context)
        self.settlements.charge(client)  # Refused: RESOURCE_EXHAUSTED
        data = request.SerializeToString(deterministic=True)
        with self.settle_lock:
            self.settlements.admit(request.session, client, data)  # Refused: a status
            why = check_settlement(request, ident.node_id, ident.model_id)
            caller = self.access.caller(context)  # '' without TLS
            if not why and caller and caller != request.coordinator_id:
                why = f"settlement signed by {request.coordinator_id}, sent by {caller}"
            if not why and self.ledger is not None:
                try:
                    self.ledger.append("settlement", settlement_body(request), sync=True).result()
                except (LedgerError, OSError) as exc:
                    why = f"cannot keep it in the ledger: {exc}"
            if why:
                log.info("settlement from %s refused: %s", request.coordinator_id, why)
                return pb.SettleReply(accepted=False, reason=why)
            self.settlements.accept(request.session, client, data)
        return pb.SettleReply(accepted=True)

    # -- validation and compute ------------------------------------------------------------

    def _forward(self, request, flow: Flow) -> pb.ForwardReply:
        layer, hidden, ids, weights, out_dtype = parse_forward(
            request, self.identity, self.limits.max_rows, self.held, self.bad, self.state_lock
        )
        # the unrounded partial sum [T, H], computed as whoever checks it recomputes it
        live = (ids >= 0).any(axis=1)  # [T]
        t0 = time.perf_counter()
        with self.state_lock:
            self.inflight += 1
        try:
            out = partial_sum(partial(self._compute, layer, flow), hidden, ids, weights)  # [T, H]
        finally:
            with self.state_lock:
                self.inflight -= 1
                self.served += 1
        compute_ms = (time.perf_counter() - t0) * 1e3
        check_result(layer, hidden, out)
        out = self._failpoint(layer, hidden, ids, weights, live, out)
        reply = pb.ForwardReply(
            out=codec.encode(out, out_dtype),
            experts_computed=int(np.unique(ids[ids >= 0]).size),
            compute_ms=compute_ms,
            request_id=request.request_id,
            queued=self.inflight + self.guard.waiting(),  # (a snapshot: no lock needed)
        )
        if request.session:
            self._receipt(request, reply, ids, live)
        return reply

    def _failpoint(self, layer, hidden, ids, weights, live, out) -> np.ndarray:
        """Tests only (MOESHARD_FAILPOINTS, node/failpoints.py): a lie instead of `out`."""
        lie = self.lie
        if lie is not None and lie.mode == "crash":
            if self.served > lie.arg:
                log.warning("FAILPOINT: crash after %d Forward calls", self.served - 1)
                os._exit(1)  # a node dying mid-generation: no reply, no clean-up
            return out
        if lie is None or lie.mode in NOT_FORWARD or not lie.fires(self.lie_rng):
            return out
        if lie.mode != "wrong_expert":
            return lie.alter(out, self.lie_rng)
        wrong = failpoints.swapped(
            sorted(e for lay, e in self.held - self.bad if lay == layer), ids
        )
        lied = np.zeros_like(out)  # [T, H]
        if live.any():
            with self.compute_lock:  # (a test's lie: no turn taken)
                lied[live] = self._backend(layer, hidden[live], wrong[live], weights[live])
        return lied

    def _compute(self, layer, flow: Flow, hidden, ids, weights) -> np.ndarray:
        """The partial sums of hidden [T, H], in turns of at most CHUNK_ROWS rows each, taken
        by fair tags against other clients' turns (a row's bits do not depend on its batch)."""
        out = np.empty(hidden.shape, dtype=np.float64)  # [T, H]
        try:
            for start in range(0, len(hidden), CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                args = (layer, hidden[rows], ids[rows], weights[rows])
                with self.guard.turn(flow, len(args[1])), self.compute_lock:
                    out[rows] = self._backend(*args)  # [chunk, H]
            return out
        except StoreError as exc:
            bad = self._find_bad(layer, hidden, np.unique(ids))
            with self.state_lock:
                self.bad.update((layer, e) for e in bad)
            log.error("layer %d: marked experts %s bad: %s", layer, bad, exc)
            raise RequestError(grpc.StatusCode.DATA_LOSS, str(exc)) from None

    def _backend(self, layer, hidden, ids, weights) -> np.ndarray:
        return self.backend(layer, hidden, ids, weights, dtype=np.float64)  # [T, H]

    def _find_bad(self, layer: int, hidden: np.ndarray, experts: np.ndarray) -> list[int]:
        """Which of `experts` fail to load: run each alone on one row."""
        bad = []
        one = np.ones((1, 1), dtype=np.float32)  # [1, 1]
        for expert in experts:
            try:
                with self.compute_lock:
                    self.backend(layer, hidden[:1], np.full((1, 1), expert), one)
            except StoreError:
                bad.append(int(expert))
        return bad


def _reply_bytes(reply: pb.ForwardReply | bytes) -> bytes:
    """A Forward's reply on the wire (a large one comes serialized already: `_answer`)."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
