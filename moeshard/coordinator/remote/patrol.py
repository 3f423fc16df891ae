"""The coordinator's possession patrol: each node it uses is challenged for proof that it holds
the experts it claims (`moeshard.coordinator.remote.possession`, docs/security.md), soon after it is
admitted and then every `interval_s` (jittered, so nodes cannot tell when), in a thread of its
own off the token path.

A node that answers wrongly is disqualified for good, its failure goes to the reputation
database and the ledger, and any step that used its unaudited work is recomputed
(`Auditor.distrust`). A late answer is not proof on its own (an honest node can be paused,
swapping or flooded at that moment): the node is challenged again soon, and the third late
answer in a run is taken as a failure (LATE_LIMIT). A node that is down, busy, or reports the
record as rotted (DATA_LOSS: an honest node with a bad disk marks it bad and stops serving it)
is not accused: the call path's bans and the next challenge deal with it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from moeshard.coordinator.remote.peers import Peer, PeerSet
from moeshard.coordinator.remote.possession import challenge

log = logging.getLogger(__name__)

NOT_EVIDENCE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DATA_LOSS", "CANCELLED", "UNKNOWN")
LATE = ("DEADLINE_EXCEEDED", "answered in")  # the answer missed its deadline
LATE_LIMIT = 3  # late answers in a run before a node counts as failing to show possession
TICK_S = 0.25


@dataclass
class PatrolStats:
    challenges: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0  # the node was down or busy: no verdict
    late: int = 0  # answers past the deadline (LATE_LIMIT of them are a failure)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class PossessionPatrol:
    def __init__(
        self,
        peers: PeerSet,
        roots,
        auditor,
        interval_s: float,
        first_s: float,
        blocks: int,
    ):
        self.peers, self.roots, self.auditor = peers, roots, auditor
        self.interval_s, self.first_s, self.blocks = interval_s, first_s, blocks
        self.rng = random.SystemRandom()
        self.due: dict[str, float] = {}  # node id -> monotonic time of its next challenge
        self.late: dict[str, int] = {}  # node id -> late answers in this run
        self.stats = PatrolStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="possession", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            for peer in self.peers.live():
                due = self.due.setdefault(peer.node_id, now + self.rng.uniform(0, self.first_s))
                if now >= due and not self._stop.is_set():
                    self.due[peer.node_id] = now + self.interval_s * self.rng.uniform(0.5, 1.5)
                    self._challenge(peer)

    def _challenge(self, peer: Peer) -> None:
        rtt_s = peer.overhead_ms / 1e3
        result = challenge(
            peer.stub, peer.public_key, self.peers.model_id, self.roots, peer.held, self.blocks,
            self.rng, rtt_s=rtt_s,
        )  # fmt: skip
        self.stats.challenges += 1
        if result.passed:
            self.stats.passed += 1
            self._record(peer, True, "")
            return
        if result.why.split(":")[0] in NOT_EVIDENCE:
            self.stats.skipped += 1
            log.info("possession challenge of %s: no verdict (%s)", peer.label, result.why)
            return
        if result.why.startswith(LATE):
            self.stats.late += 1
            late = self.late[peer.node_id] = self.late.get(peer.node_id, 0) + 1
            if late < LATE_LIMIT:
                # soon again, once it is up: a node without the bytes gets no breathing space
                self.due[peer.node_id] = time.monotonic() + self.rng.uniform(0, self.first_s)
                log.info("possession challenge of %s: late (%s)", peer.label, result.why)
                return
            result.why = f"late {late} times in this run, the last: {result.why}"
        self.stats.failed += 1
        self._record(peer, False, result.why)
        self.auditor.distrust(peer, f"failed a possession challenge: {result.why}")

    def _record(self, peer: Peer, passed: bool, why: str) -> None:
        reputation, accounts = self.auditor.reputation, self.auditor.accounts
        if reputation is not None:
            reputation.record_possession(peer.node_id, passed)
        if accounts is not None:
            accounts.audit(peer.node_id, passed, f"possession {why}".strip())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
