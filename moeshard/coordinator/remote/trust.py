"""Trust: everything the coordinator decides about its nodes' honesty, behind one object.

The runtime builds it from the model directory and the client's settings; `RemoteExperts`
calls it once per reply (`accept`) and once per failed call (`failed`). It holds:

* the reply checks every reply gets (the request's id echoed, a well-formed tensor of the
  dtype and shape asked for, finite values): a reply no honest node sends convicts its sender;
* the `Auditor` (coordinator/remote/audit.py): the coordinator recomputes a secret random
  share of the calls itself, from Merkle-verified records, and compares bits; it is the
  decode loop's `Verifier`;
* the `RecordCache` the audits recompute from (`--audit-cache`);
* the `Accounts` (signed receipts into the ledger, settlements) and the `Reputation`
  (evidence across runs), when the client has them;
* the `PossessionPatrol` (proofs that nodes hold what they claim), and the fraud-proof files
  a failed recomputation leaves (`moeshard.moe.ledger.fraud`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from moeshard.coordinator.remote.accounts import Accounts
from moeshard.coordinator.remote.audit import Auditor
from moeshard.coordinator.remote.audit_cases import Case
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.patrol import PossessionPatrol
from moeshard.coordinator.remote.peers import Peer, PeerSet
from moeshard.coordinator.remote.policy import AuditBudget
from moeshard.coordinator.remote.records import RecordCache, default_budget
from moeshard.moe.errors import MoeshardError, StoreError
from moeshard.moe.identity.keys import home
from moeshard.moe.identity.receipts import check_receipt, receipt_mismatch
from moeshard.moe.kernels.build import ARITHMETIC
from moeshard.moe.ledger.fraud import make_proof, write_proof
from moeshard.moe.wire import codec
from moeshard.moe.wire.constants import MAX_ACTIVATION

log = logging.getLogger(__name__)

EVIDENCE_DIR = "evidence"  # fraud proofs go here, in the moeshard home, unless told otherwise


class Trust:
    def __init__(self, model_id: str, hidden_size: int, config: RemoteConfig, model=None):
        """`model`: the opened ModelDir (its expert geometry, its own records if any, its
        Merkle roots); audits need it, so without one `config.audit` must be 0."""
        self.model_id, self.hidden_size, self.config = model_id, hidden_size, config
        self.reputation = config.reputation
        identity = config.identity  # receipts are signed and settled between keys
        self.accounts = Accounts(identity, model_id, config.ledger or None) if identity else None
        self.records = self.roots = None
        if model is not None:
            self.records, self.roots = _records(model, config)
        elif config.audit > 0:
            raise ValueError("audits recompute from the model directory: give Trust the model")
        self.auditor: Auditor | None = None
        self.patrol: PossessionPatrol | None = None
        self.evidence_dir = Path(config.evidence) if config.evidence else home() / EVIDENCE_DIR

    def start(self, peers: PeerSet) -> None:
        """The nodes are known: audits and possession challenges can begin."""
        self.peers = peers
        self.auditor = Auditor(
            peers,
            self.records,
            self.roots,
            self.config.audit if self.records is not None else 0.0,
            self.config.audit_new,
            AuditBudget(float(self.config.audit_bytes_per_token)),
            self.reputation,
            self.accounts,
            self._evidence if self.accounts is not None else None,
        )
        if self.roots is not None and self.config.challenge_interval_s > 0:
            self.patrol = PossessionPatrol(
                peers,
                self.roots,
                self.auditor,
                self.config.challenge_interval_s,
                self.config.challenge_first_s,
                self.config.challenge_blocks,
            )

    # -- RemoteExperts' calls -----------------------------------------------------------------

    def accept(
        self, peer: Peer, experts: list[int], rows: int, request, reply, rtt_s: float
    ) -> np.ndarray | None:
        """A reply is in: its partial sum [rows, H] to use, or None when it may not be used
        (it convicts its sender, or its sender was convicted while it was in flight)."""
        if self.reputation is not None:
            self.reputation.record_call(peer.node_id, True, rtt_s * 1e3)
        self.auditor.earn(peer, reply.experts_computed)  # as the node credits us for it
        part = self.check(reply, request, rows)
        if isinstance(part, str):
            # No honest node sends this: disqualify this node (not the one that gets its
            # work next) and recompute whatever used its earlier, unverified work.
            self.auditor.convict(peer, part)
            return None
        if not self.auditor.submit(peer, experts, request, reply):
            return None
        if self.accounts is not None:  # enqueued: checked and kept off this path
            self.accounts.record(peer.node_id, request, reply, peer.public_key)
        return part

    def failed(self, peer: Peer) -> None:
        """A call to `peer` failed (down, late, overloaded): availability evidence."""
        if self.reputation is not None:
            self.reputation.record_call(peer.node_id, False)

    def convict(self, peer: Peer, why: str) -> None:
        self.auditor.convict(peer, why)

    def backlogged(self, node_id: str) -> bool:
        """Whether `node_id` has so many audits not done that it should get no more work."""
        return self.auditor is not None and self.auditor.backlogged(node_id)

    def wait_backlog(self, node_id: str) -> None:
        """Wait until `node_id` may get more work (AuditStall if its audits never end)."""
        if self.auditor is not None:
            self.auditor.wait_backlog(node_id)

    def check(self, reply, request, rows: int) -> np.ndarray | str:
        """The reply's partial sum [rows, H], or why it is not one a node may send: the reply
        to another request (a duplicate or a lost one on the stream), a tensor of another
        dtype or shape than asked, or non-finite or absurd values (an honest node refuses
        those itself)."""
        if reply.request_id != request.request_id:
            return (
                f"reply to request {reply.request_id}, expected {request.request_id} (a duplicate?)"
            )
        out_dtype = request.out_dtype or request.hidden.dtype
        try:
            part = codec.decode(reply.out, "reply", (out_dtype,), (rows, self.hidden_size))
        except codec.CodecError as exc:
            return f"malformed reply: {exc}"
        if part.size and not np.abs(part).max() <= MAX_ACTIVATION:  # NaN fails it too
            return "non-finite or absurd values in its reply"
        return part  # [rows, H]

    @property
    def verifier(self) -> Auditor:
        return self.auditor

    # -- fraud proofs -------------------------------------------------------------------------

    def _evidence(self, case: Case, row: int, expected: np.ndarray, obtain) -> str:
        """Write the fraud proof of a failed recomputation; '' when the reply has no receipt
        that checks (then nobody else could verify it: the conviction stays this run's)."""
        reply, peer = case.reply, case.peer
        why = (
            "no receipt"
            if not reply.HasField("receipt")
            else check_receipt(reply.receipt, peer.public_key, peer.node_id, self.model_id)
            or receipt_mismatch(reply.receipt, case.request, reply.out.data, 0, ARITHMETIC)
        )
        if why:
            log.warning("no fraud proof against %s: %s", peer.label, why)
            return ""
        layer = int(case.request.layer)
        ids = codec.decode(case.request.ids, "ids", (codec.I32,))  # [T, k]
        records = []
        for expert in sorted({int(e) for e in ids[row] if e >= 0}):
            data = np.empty(self.records.record_nbytes, dtype=np.uint8)  # [record bytes]
            with self.records.lock:
                resident = (layer, expert) in self.records.slot_of
                if resident:
                    data[:] = self.records.record((layer, expert))
            if not resident:
                obtain((layer, expert), data)
            records.append((layer, expert, data))
        accuser = self.config.identity.id if self.config.identity is not None else ""
        proof = make_proof(
            self.model_id, peer.public_key, case.request, reply, row, records, expected, accuser
        )
        return str(write_proof(self.evidence_dir, proof))

    # -- the end ------------------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "audit": self.auditor.snapshot() if self.auditor is not None else None,
            "possession": self.patrol.stats.as_dict() if self.patrol is not None else None,
            "accounts": self.accounts.stats() if self.accounts is not None else None,
        }

    def close(self, live_stubs: dict) -> None:
        """Stop auditing and challenging; countersign each node's totals, seal the ledger."""
        if self.patrol is not None:
            self.patrol.close()
        if self.auditor is not None:
            self.auditor.close()
        if self.accounts is not None:
            self.accounts.settle(live_stubs)
            self.accounts.close()
        if self.reputation is not None:
            self.reputation.flush()


def _records(model, config: RemoteConfig):
    """The audit cache and the Merkle roots its fetched records are checked against."""
    shards = model.shard_set
    try:
        roots = config.roots if config.roots is not None else model.possession_roots()
    except StoreError as exc:
        if config.audit > 0:
            raise MoeshardError(f"cannot audit the nodes: {exc}") from None
        roots = None
    records = len(roots.keys()) if roots is not None else len(shards.locations)
    budget = config.audit_cache or default_budget(shards.record_nbytes, records, model.config.top_k)
    return RecordCache(shards, budget), roots
