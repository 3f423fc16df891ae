"""The coordinator's accounts of the nodes' work in one session: receipts kept in its ledger,
audit results, and the settlements it countersigns.

Every Forward carries `session`; each node signs a receipt into its reply
(moe/identity/receipts.py). `record` only enqueues the reply: the ledger's thread checks the
receipt (the node's signature, and that it describes this request and this reply's bytes),
appends it to the ledger and adds it to the node's totals, so the token path pays nothing for
it. A reply without a receipt, or with one that does not check, is counted, logged, and its
node put in `invalid`; it is not written to the ledger. `settle` signs each node's cumulative
totals and sends them with the Settle RPC, once per session (a node that is down is skipped,
and its settlement is in our ledger all the same; one whose reply is lost is sent the same
settlement again, which it answers ALREADY_EXISTS: delivered).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

from moeshard.moe.identity.keys import Identity, key_id
from moeshard.moe.identity.receipts import (
    SESSION_BYTES,
    Totals,
    check_receipt,
    make_settlement,
    receipt_mismatch,
)
from moeshard.moe.ledger import (
    LedgerError,
    LedgerWriter,
    audit_body,
    open_ledger,
    receipt_body,
    settlement_body,
)
from moeshard.moe.wire import moeshard_pb2 as pb

log = logging.getLogger(__name__)
SETTLE_TIMEOUT_S = 5.0
RETRIES = 2  # a Settle that failed on the way is sent again this many times (in the timeout)
RETRY_WAIT_S = 0.5  # ... after this many seconds times the attempt number
RETRY_CODES = (  # failures after which the node may or may not have the settlement, or busy
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
SIGNATURE_SHARE = 0.05  # receipts whose signature is checked as they come (all: ledger verify)


class Accounts:
    """One session's accounts; `record` and `audit` are safe to call from any thread."""

    def __init__(
        self,
        identity: Identity,
        model_id: str,
        ledger_path: str | Path | None = None,
        record_nbytes: int = 0,  # > 0: also check each receipt's expert_bytes against it
    ):
        self.identity, self.model_id, self.record_nbytes = identity, model_id, record_nbytes
        self.session = os.urandom(SESSION_BYTES)
        self.ledger = open_ledger(ledger_path, identity, "coordinator")
        self.path = self.ledger.path
        self.lock = threading.Lock()
        self.keys: dict[str, bytes] = {}  # node id -> its raw public key (from its signed Info)
        self.totals: dict[str, Totals] = defaultdict(Totals)  # node id -> checked work so far
        self.invalid: set[str] = set()  # nodes that sent a bad receipt (or none)
        self.missing = 0  # replies without a receipt
        self.bad = 0  # receipts that did not check
        self.seq: dict[str, int] = defaultdict(int)  # node id -> last settlement's seq
        self.rng = random.SystemRandom()  # which receipts' signatures are checked at once

    def learn(self, node_id: str, public_key: bytes) -> None:
        """The key of a node (its Info's public_key, checked by `check_info`)."""
        if key_id(public_key) == node_id:
            with self.lock:
                self.keys[node_id] = bytes(public_key)

    def record(
        self,
        node_id: str,
        request: pb.ForwardRequest,
        reply: pb.ForwardReply,
        public_key: bytes = b"",
    ) -> None:
        """Account for one reply the coordinator accepted from `node_id` (enqueue only)."""
        self.ledger.submit(lambda w: self._record(w, node_id, request, reply, public_key))

    def _record(self, writer: LedgerWriter, node_id, request, reply, public_key) -> None:
        if public_key:
            self.learn(node_id, public_key)
        with self.lock:
            key = self.keys.get(node_id, b"")
        receipt = reply.receipt
        if not reply.HasField("receipt"):
            why = "no receipt"
        elif not key:
            why = "no key known for the node"
        else:
            # The reply came over mutual TLS pinned to this node's key, so it is the node's:
            # the signature matters to third parties, and `moeshard ledger verify` checks every
            # one. Here a sample is checked (the first from each node, then SIGNATURE_SHARE),
            # which keeps about 0.2 ms of CPU per reply off a 2-core coordinator.
            with self.lock:
                seen = node_id in self.totals  # (a lookup that adds no entry)
            full = not seen or self.rng.random() < SIGNATURE_SHARE
            why = check_receipt(receipt, key, node_id, self.model_id, full) or receipt_mismatch(
                receipt, request, reply.out.data, self.record_nbytes
            )
        if why:
            with self.lock:
                self.missing += why == "no receipt"
                self.bad += why != "no receipt"
                first = node_id not in self.invalid
                self.invalid.add(node_id)
            if first:
                log.warning("node %s: reply to request %d: %s", node_id, request.request_id, why)
            return
        writer.append("receipt", receipt_body(receipt, key))
        with self.lock:
            self.totals[node_id].add(receipt)

    def audit(self, node_id: str, passed: bool, detail: str = "", layer: int = -1) -> None:
        """Log the result of an audit of `node_id` (counts in its settlement)."""

        def job(writer: LedgerWriter) -> None:
            writer.append("audit", audit_body(node_id, self.session, layer, passed, detail))
            with self.lock:
                self.totals[node_id].audit(passed)

        self.ledger.submit(job)

    def settle(
        self,
        stubs: Mapping[str, object] | Callable[[str], object],
        timeout: float = SETTLE_TIMEOUT_S,
    ) -> dict[str, str]:
        """Sign every node's cumulative totals, keep them in the ledger, and send each to its
        node (`stubs`: node id -> ExpertNodeStub, or a function giving one; None or missing:
        the node is down). node id -> '' if the node accepted, else why not."""
        self.ledger.flush()
        with self.lock:
            work = {n: Totals(**vars(t)) for n, t in self.totals.items()}
        results: dict[str, str] = {}
        for node_id, totals in sorted(work.items()):
            self.seq[node_id] += 1
            settlement = make_settlement(
                self.identity, self.session, node_id, self.model_id, self.seq[node_id], totals
            )
            try:
                self.ledger.append("settlement", settlement_body(settlement), sync=True).result()
            except (LedgerError, OSError) as exc:
                log.error("settlement for node %s not kept: %s", node_id, exc)
            stub = stubs.get(node_id) if isinstance(stubs, Mapping) else stubs(node_id)
            results[node_id] = self._send(node_id, stub, settlement, timeout)
        return results

    @staticmethod
    def _send(node_id: str, stub, settlement: pb.Settlement, timeout: float) -> str:
        """Deliver one settlement within `timeout` seconds in all: '' once the node has it,
        else why not. A node takes one settlement per session, so a call that failed on the
        way (RETRY_CODES: its reply may have been lost) is sent again, and ALREADY_EXISTS
        then means the first one got there (no other settlement of this session is ever sent
        from here: `settle` runs once, at the end)."""
        why, deadline = "node not reachable", time.monotonic() + timeout
        for attempt in range(1 + RETRIES if stub is not None else 0):
            if attempt:
                time.sleep(RETRY_WAIT_S * attempt)
            left = deadline - time.monotonic()
            if attempt and left < RETRY_WAIT_S:
                break
            try:
                reply = stub.Settle(settlement, timeout=left)
                why = "" if reply.accepted else f"refused: {reply.reason or '(no reason)'}"
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    log.info("settlement for node %s: %s", node_id, exc.details())
                    why = ""
                else:
                    why = f"{exc.code().name}: {exc.details()}"
                    if exc.code() in RETRY_CODES:
                        continue
            break
        if why:
            log.warning("settlement for node %s not delivered: %s", node_id, why)
        return why

    def stats(self) -> dict:
        with self.lock:
            return {
                "session": self.session.hex(),
                "ledger": str(self.path),
                "receipts": sum(t.calls for t in self.totals.values()),
                "missing": self.missing,
                "bad": self.bad,
                "invalid": sorted(self.invalid),
                "ledger_errors": self.ledger.errors,
            }

    def close(self) -> None:
        """Write what is queued, fsync and close the ledger."""
        self.ledger.close()
