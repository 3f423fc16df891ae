"""Audits: the coordinator recomputes a secret random share of the nodes' calls itself.

When a node's reply is in (and before it is used) `submit` decides, secretly
(`random.SystemRandom`), whether to audit it, with probability `policy.rate_for` times the
budget's factor: nothing about the call itself enters the choice. An audit runs in one of
the auditor's threads (WORKERS), off the token path:

1. the records the call used come from the `RecordCache`: the coordinator's own model
   directory, its audit cache, or a node holding them, every byte checked against the
   record's Merkle root (merkle.bin, which the model id covers), so a node cannot hand over
   weights of its own making;
2. the node's partial sum is recomputed with the kernels every node runs
   (`moeshard.moe.experts.compute.recompute_partial_sum`: the same arithmetic, bit for bit, on every
   CPU level and kernel build of one `ARITHMETIC`), encoded in the dtype the request asked
   for, and compared with the reply's bytes;
3. equal: passed (the case is verified; a new node's vetting counts only completed audits).
   Different: proof. The node signed a reply to this request that the model's weights do
   not give. It is convicted (disqualified for good, its reputation and the ledger told), a
   fraud-proof file is written when its reply carried a signed receipt
   (`moeshard.moe.ledger.fraud`), and every step that used its unverified work is recomputed: the
   decode loop rolls back to the earliest such step (`rollback_step`).

Nobody else judges: no node recomputes another's call, no holder votes. The audited node
takes part only when a record the audit needs is held by nobody else: it is asked for it
after its reply is in, so the request can only tell it about a lie already committed. A node
that refuses a record it claims (NOT_FOUND, DATA_LOSS, forged bytes) is convicted as if the
recomputation had failed; one that stays busy or unreachable for RECORD_WAIT_S is not (a
stranger can keep an honest node busy) but its work cannot be verified: it is dropped for the
run and its unverified work recomputed, with no failed audit on its record. So is one that
hands records over only when asked again, SLOW_LIMIT times: stalling every audit is a way
to slow the coordinator, not to be checked less. A holder whose
bytes fail the Merkle root is disqualified for failing possession.

Picked calls wait in one queue per node, served round robin by WORKERS threads, so a node
that is slow to hand over records delays its own audits, not the others'; and a node with
MAX_BACKLOG audits not yet done gets no more work until they are (`wait_backlog`), so a slow
node slows only the work that must go to it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from functools import partial

import numpy as np

from moeshard.coordinator.remote.audit_cases import (
    REFUSALS,
    AuditStats,
    Case,
    Unverifiable,
    Withheld,
    first_wrong_row,
    same_bits,
)
from moeshard.coordinator.remote.config import RemoteError
from moeshard.coordinator.remote.fetch import FetchError, default_deadline_s, fetch_record
from moeshard.coordinator.remote.pace import Pace
from moeshard.coordinator.remote.peers import Peer, PeerSet
from moeshard.coordinator.remote.policy import AuditBudget, rate_for
from moeshard.coordinator.remote.records import Key, RecordCache
from moeshard.moe.experts.compute import recompute_partial_sum
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb

log = logging.getLogger(__name__)

STALL_S = 600.0  # longest wait for audits (drain, settled steps, a backlog): then AuditStall
RECORD_WAIT_S = 10.0  # how long the audited node has to hand over a record only it holds
WORKERS = 2  # audits at once: one stalled by a slow holder does not hold up the others
MAX_BACKLOG = 16  # audits of one node not yet done before it gets no more work
HOLDER_BACKOFF_S = 60.0  # a holder that failed to hand over a record is not asked for this long
SLOW_LIMIT = 3  # slow hand-overs by an audited node before it is dropped
SLOW_S = 2.0  # a hand-over that needed asking again and took longer than this is slow


class AuditStall(RemoteError):
    """Audits did not finish in STALL_S: the text cannot be called verified. Exit 3."""

    exit_code = 3


class Auditor:
    """Picks calls, recomputes them in its thread, convicts liars, and tells the decode loop
    which step to recompute from and which steps are settled (it is the loop's `Verifier`)."""

    def __init__(
        self,
        peers: PeerSet,
        records: RecordCache,
        roots,
        rate: float,
        vetting: int,
        budget: AuditBudget | None = None,
        reputation=None,
        accounts=None,
        evidence: Callable[[Case, int, np.ndarray, list[Key]], str] | None = None,
    ):
        self.peers, self.records, self.roots = peers, records, roots
        self.rate, self.vetting = rate, vetting
        self.budget = budget or AuditBudget()
        self.reputation, self.accounts, self.evidence = reputation, accounts, evidence
        self.rng = random.SystemRandom()  # secret: a node cannot predict which calls are audited
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a case queued or done; closing
        self.queues: dict[str, deque[Case]] = {}  # node id -> its picked cases waiting
        self.turn: deque[str] = deque()  # node ids with cases waiting, in round-robin order
        self.backlog: Counter = Counter()  # node id -> its picked cases not done yet
        self.closed = False
        self.holder_backoff: dict[str, float] = {}  # node id -> monotonic time it may be asked
        self.slow: Counter = Counter()  # node id -> its slow hand-overs
        self.paces: dict[str, Pace] = {}  # node id -> its record rate and streams, as stated
        self.pending: dict[int, int] = {}  # case id -> its step, for the audits not yet done
        self.stats = AuditStats()
        self.distrusted: set[str] = set()  # node ids disqualified by this auditor
        self.completed: Counter = Counter()  # node id -> audits it passed this run
        self.step = 0
        self.uses: list[tuple[str, int, int]] = []  # (node id, step, case id) still undoable
        self.verified: set[int] = set()  # case ids that passed an audit
        self._rollback: int | None = None
        self._next_case = 0
        self._fetched_seen = 0  # the cache's fetched bytes at the last `tokens` call
        # `bench audit` keeps (case, the recomputed tensor, whether it matched)
        self.observe: Callable[[Case, pb.Tensor, bool], None] | None = None
        self.workers = [
            threading.Thread(target=self._work, name=f"audit-{i}", daemon=True)
            for i in range(WORKERS)
        ]
        for worker in self.workers:
            worker.start()

    # -- the decode loop's Verifier -----------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """The next calls belong to forward pass `step` (numbers only grow)."""
        with self.lock:
            self.step = step

    def undo(self, step: int) -> None:
        """Steps from `step` on were undone (a rollback): their calls no longer matter."""
        with self.lock:
            self.verified.difference_update(u[2] for u in self.uses if u[1] >= step)
            self.uses = [u for u in self.uses if u[1] < step]

    def rollback_step(self) -> int | None:
        """The earliest step whose result used work now known to be wrong (then cleared)."""
        with self.lock:
            step, self._rollback = self._rollback, None
            return step

    def settled_step(self) -> int:
        """The last step whose every picked call has been audited and passed: its tokens may
        be shown. Never a step at or after one a conviction marked for recomputation and the
        decoder has not yet undone (the audit may end between its look at `rollback_step` and
        its look here)."""
        with self.lock:
            settled = min(self.pending.values(), default=self.step + 1) - 1
            return settled if self._rollback is None else min(settled, self._rollback - 1)

    def forget_before(self, step: int) -> None:
        """Steps before `step` will never be undone (their tokens were sent): keep no record
        of their calls, so memory stays bounded over an endless stream of requests."""
        with self.lock:
            gone = {u[2] for u in self.uses if u[1] < step}
            self.uses = [u for u in self.uses if u[1] >= step]
            self.verified.difference_update(gone)

    def tokens(self, n: int) -> None:
        """`n` tokens were generated: the budget weighs what audits fetched meanwhile."""
        if self.records is None:
            return
        fetched = self.records.stats.fetched_bytes
        for _ in range(n):
            self.budget.token((fetched - self._fetched_seen) / max(n, 1))
        self._fetched_seen = fetched

    def drain(self, timeout: float = STALL_S) -> None:
        """Wait for every audit picked so far; AuditStall after `timeout` s."""
        self._wait_for(lambda: not self.pending, timeout, "the audits of this generation")

    def wait_settled(self, step: int, timeout: float = STALL_S, stall: bool = True) -> bool:
        """Block until `settled_step() >= step` or a rollback is due (the caller must undo
        first: nothing after it settles): the decoder's bound on how far its tokens may run
        ahead of their audits. After `timeout` s: AuditStall, or False with `stall` False."""

        def done() -> bool:
            settled = min(self.pending.values(), default=self.step + 1) - 1
            return settled >= step or self._rollback is not None

        return self._wait_for(done, timeout, f"the audits of step {step}", stall)

    def wait_backlog(self, node_id: str, timeout: float = STALL_S) -> None:
        """Block while `node_id` has MAX_BACKLOG audits not done (it gets no more work)."""
        self._wait_for(
            lambda: self.backlog[node_id] < MAX_BACKLOG, timeout, f"node {node_id}'s audits"
        )

    def backlogged(self, node_id: str) -> bool:
        with self.lock:
            return self.backlog[node_id] >= MAX_BACKLOG

    def _wait_for(
        self, condition: Callable[[], bool], timeout: float, what: str, stall: bool = True
    ) -> bool:
        with self.changed:
            if self.changed.wait_for(condition, timeout):
                return True
            if not stall:
                return False
            raise AuditStall(
                f"waited {timeout:.0f} s for {what} ({len(self.pending)} unfinished): "
                "the work that rests on them cannot be called verified"
            )

    # -- picking ------------------------------------------------------------------------------

    def submit(self, peer: Peer, experts: list[int], request, reply) -> bool:
        """`peer`'s reply is in and about to be used: remember it, and perhaps audit it (in the
        background). False if `peer` was convicted meanwhile: the caller must not use it.
        Under the same lock as `distrust`, so a use is either refused or seen by the rollback
        a conviction computes."""
        with self.lock:
            if peer.node_id in self.distrusted:
                return False
            self._next_case += 1
            case = Case(self.step, peer, experts, request, reply, self._next_case)
            self.uses.append((peer.node_id, case.step, case.id))
            if not self._picked(peer.node_id):
                return True
            self.stats.picked += 1
            self.pending[case.id] = case.step
            self.backlog[peer.node_id] += 1
            if peer.node_id not in self.queues:
                self.queues[peer.node_id] = deque()
                self.turn.append(peer.node_id)
            self.queues[peer.node_id].append(case)
            self.changed.notify()
        return True

    def _picked(self, node_id: str) -> bool:
        record = self.reputation.record(node_id) if self.reputation else None
        suspect = record is not None and record.suspect  # failed an audit lately, any run
        history = record.audits_seen if record is not None else 0  # includes this run's
        completed = max(self.completed[node_id], history)
        rate = rate_for(self.rate, self.vetting, completed, suspect) * self.budget.factor
        return rate > 0 and self.rng.random() < rate

    def _work(self) -> None:
        """An audit thread: the next node's oldest case, round robin over the nodes."""
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.turn or self.closed)
                if self.closed:
                    return
                node = self.turn.popleft()
                queue = self.queues[node]
                case = queue.popleft()
                if queue:
                    self.turn.append(node)
                else:
                    del self.queues[node]
            try:
                self._audit(case)
            except Exception as exc:  # a bug, not a verdict: the work is dropped, not judged
                log.exception("audit of %s failed", case.peer.label)
                self._unverifiable(case, f"its audit could not be run ({exc!r})")
            finally:
                with self.changed:
                    self.pending.pop(case.id, None)
                    self.backlog[node] -= 1
                    if not self.backlog[node]:
                        del self.backlog[node]
                    self.changed.notify_all()

    # -- auditing -----------------------------------------------------------------------------

    def _audit(self, case: Case) -> None:
        t0 = time.thread_time()
        try:
            self._judge(case)
        finally:
            with self.lock:
                self.stats.cpu_s += time.thread_time() - t0

    def _judge(self, case: Case) -> None:
        request = case.request
        hidden = codec.decode(request.hidden, "hidden", (codec.F32, codec.BF16))  # [T, H]
        ids = codec.decode(request.ids, "ids", (codec.I32,))  # [T, k]
        weights = codec.decode(request.weights, "weights", (codec.F32,))  # [T, k]
        obtain = partial(self._obtain, case)
        try:
            expected = self._recompute(request.layer, hidden, ids, weights, obtain)  # [T, H]
        except Withheld as exc:
            with self.lock:
                self.stats.withheld += 1
            self._convict(case.peer, case, str(exc))
            return
        except Unverifiable as exc:
            self._unverifiable(case, str(exc))
            return
        want = codec.encode(expected, request.out_dtype or request.hidden.dtype)
        if self.observe is not None:
            self.observe(case, want, same_bits(want, case.reply.out))
        if same_bits(want, case.reply.out):
            self._passed(case)
            if self.slow[case.peer.node_id] >= SLOW_LIMIT:  # it stalls every audit it can
                why = f"it handed over records only when asked again, {SLOW_LIMIT} times"
                self._unverifiable(case, why)
            return
        with self.lock:
            self.stats.failed += 1
        row = first_wrong_row(want.data, case.reply.out.data, hidden.shape[0])
        why = f"its reply to layer {request.layer} is not what the model's experts give"
        self._convict(case.peer, case, why, (row, expected[row : row + 1], obtain))

    def _recompute(self, layer, hidden, ids, weights, obtain) -> np.ndarray:
        s = self.records.shards
        # each worker's waves take at most its share of the cache's slots
        waves = partial(
            self.records.waves, layer, obtain=obtain, most=self.records.slots // WORKERS
        )
        fmt = s.record_format(layer)
        return recompute_partial_sum(waves, fmt, s.hidden, s.inter, s.glu, hidden, ids, weights)

    def _obtain(self, case: Case, key: Key, out: np.ndarray) -> int:
        """Fill `out` with record `key`, checked against its root: from another holder (in
        random order), else from the audited node (Withheld if it will not hand it over)."""
        root = self.roots.root(*key)
        if root is None:
            raise RuntimeError(f"no Merkle root for expert {key[1]} of layer {key[0]}")
        others = [
            p
            for p in self.peers.live()
            if p.holds(*key) and p.node_id != case.peer.node_id and p.node_id not in self.distrusted
        ]
        self.rng.shuffle(others)
        now = time.monotonic()  # holders that failed lately last: a staller costs one deadline
        others.sort(key=lambda p: self.holder_backoff.get(p.node_id, 0.0) > now)
        for peer in others:
            try:
                return self._fetch(peer, key, root, out)
            except FetchError as exc:
                if exc.evidence:
                    self._possession_failed(peer, key, exc.why)
                else:
                    log.info("record %s from %s: %s", key, peer.label, exc.why)
                    self.holder_backoff[peer.node_id] = time.monotonic() + HOLDER_BACKOFF_S
                    if self.reputation:
                        self.reputation.record_call(peer.node_id, False)
        return self._fetch_from_audited(case.peer, key, root, out)

    def _fetch_from_audited(self, peer: Peer, key: Key, root: bytes, out: np.ndarray) -> int:
        """The audited node, the only holder left, has RECORD_WAIT_S to hand it over: a
        refusal is Withheld (convicted), a node busy or away so long Unverifiable; a hand-over
        that needed more than one try costs it availability."""
        t0 = time.monotonic()
        deadline, delay, tries = t0 + RECORD_WAIT_S, 0.2, 0
        where = f"expert {key[1]} of layer {key[0]}"
        while True:
            tries += 1
            try:
                got = self._fetch(peer, key, root, out)
                if tries > 1 and time.monotonic() - t0 > SLOW_S:
                    with self.lock:
                        self.slow[peer.node_id] += 1
                    if self.reputation:
                        self.reputation.record_call(peer.node_id, False)
                return got
            except FetchError as exc:
                if exc.evidence or exc.code in REFUSALS:
                    raise Withheld(f"it would not hand over {where}: {exc.why}") from None
                if time.monotonic() + delay > deadline:
                    raise Unverifiable(
                        f"it did not hand over {where} within {RECORD_WAIT_S:.0f} s ({exc.why})"
                    ) from None
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

    def earn(self, peer: Peer, experts: int) -> None:
        """`peer` computed a reply with `experts` records for us: the credit it gives us."""
        if self.records is not None:
            self._pace(peer).earn(experts * self.records.record_nbytes)

    def _pace(self, peer: Peer) -> Pace:
        with self.lock:
            pace = self.paces.get(peer.node_id)
            if pace is None:
                pace = self.paces[peer.node_id] = Pace(
                    peer.record_rate, peer.record_streams, WORKERS
                )
            return pace

    def _fetch(self, peer: Peer, key: Key, root: bytes, out: np.ndarray) -> int:
        """One fetch, within the record rate and streams the node states for one client, so
        an honest node never has to refuse these audits for going over its own limits."""
        if peer.stub is None:
            raise FetchError("not connected", code="UNAVAILABLE")
        nbytes = self.records.record_nbytes
        pace = self._pace(peer)
        timeout = default_deadline_s(nbytes, peer.overhead_ms / 1e3)
        with pace.turn(nbytes):
            return fetch_record(
                peer.stub, self.peers.model_id, key[0], key[1], root, nbytes, out, timeout
            )

    def _possession_failed(self, peer: Peer, key: Key, why: str) -> None:
        reason = f"handed over expert {key[1]} of layer {key[0]} not as the model has it: {why}"
        if self.distrust(peer, reason):
            if self.reputation:
                self.reputation.record_possession(peer.node_id, False)
            if self.accounts:
                self.accounts.audit(peer.node_id, False, reason, key[0])

    def _passed(self, case: Case) -> None:
        with self.lock:
            self.verified.add(case.id)
            self.completed[case.peer.node_id] += 1
            self.stats.passed += 1
        if self.reputation:
            self.reputation.record_audit(case.peer.node_id, True)
        if self.accounts:
            self.accounts.audit(case.peer.node_id, True, "", case.request.layer)

    def _unverifiable(self, case: Case, why: str) -> None:
        """No verdict on `case`: its node's unverified work is recomputed and the node not
        used again in this run, but nothing is held against it (a stranger may have kept an
        honest node busy): no failed audit, no ledger entry, one availability failure."""
        with self.lock:
            self.stats.unverifiable += 1
        if self.distrust(case.peer, f"its work cannot be verified: {why}") and self.reputation:
            self.reputation.record_call(case.peer.node_id, False)

    def convict(self, peer: Peer, why: str) -> None:
        """`peer` sent something no honest node sends (checked by the caller): disqualify it
        and recompute whatever used its unverified work."""
        self._convict(peer, None, why)

    def _convict(self, peer: Peer, case: Case | None, why: str, wrong=None) -> None:
        if not self.distrust(peer, why):
            return
        with self.lock:
            self.stats.convicted.append(peer.node_id)
        if self.reputation:
            self.reputation.record_audit(peer.node_id, False)
        if self.accounts:
            self.accounts.audit(peer.node_id, False, why, case.request.layer if case else -1)
        if wrong is not None and self.evidence is not None:
            self._write_proof(case, *wrong)

    def _write_proof(self, case: Case, row: int, expected: np.ndarray, obtain) -> None:
        """The fraud-proof file of a failed recomputation (when the reply had a receipt)."""
        try:
            path = self.evidence(case, row, expected, obtain)
        except (OSError, FetchError, Withheld) as exc:
            log.error("no fraud proof for %s: %s", case.peer.label, exc)
            return
        if path:
            with self.lock:
                self.stats.proofs.append(path)
            log.warning("fraud proof against %s written to %s", case.peer.label, path)

    def distrust(self, peer: Peer, why: str) -> bool:
        """Disqualify `peer` and mark the earliest step that used its unverified work for
        recomputation (also for a failed possession challenge); True the first time."""
        with self.lock:  # check and mark at once: a use is either refused or rolled back
            first = peer.node_id not in self.distrusted
            self.distrusted.add(peer.node_id)
            steps = [
                s for node, s, cid in self.uses if node == peer.node_id and cid not in self.verified
            ]
            if steps:
                earliest = min(steps)
                self._rollback = (
                    earliest if self._rollback is None else min(self._rollback, earliest)
                )
        self.peers.disqualify(peer, why)
        if first and steps:
            log.warning("node %s: %s: recomputing from step %d", peer.label, why, min(steps))
        return first

    def snapshot(self) -> dict:
        with self.lock:
            out = self.stats.as_dict() | {"pending": len(self.pending)}
            out["convicted"], out["proofs"] = list(out["convicted"]), list(out["proofs"])
        out["budget_factor"] = self.budget.factor
        out["records"] = self.records.snapshot()
        return out

    def close(self) -> None:
        """Stop the audit threads (an audit running finishes; the queued ones are dropped:
        `drain` first for a verdict on everything picked)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        for worker in self.workers:
            worker.join(timeout=RECORD_WAIT_S + 5)
