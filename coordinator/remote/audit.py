"""Spot checks of the nodes' work: a secret random share of Forward calls is re-run elsewhere.

After a node's reply has been used, the `Auditor` may (secretly, with `random.SystemRandom`, so
a node cannot tell an audited call from another) send the same request to other holders of the
same experts, off the critical path in a worker thread, and compare the answers:

* equal bits when one node with the same kernel build and CPU level recomputes the whole call
  (kernels are deterministic per row, `docs/kernels.md`, and a node adds its experts in a fixed
  order);
* otherwise within a tolerance: `REGROUP_TOL` when the experts are split over several auditors
  (their float64 partial sums are added in another grouping), `KERNEL_TOL` across kernel builds.

A mismatch makes the audited node and its auditors suspects (audited at rate 1) and a referee
settles it at once: the coordinator's own copy of the experts when it has one (trusted), else
holders outside the dispute (a majority). The liar is disqualified for good (`PeerSet.disqualify`)
and every step of the generation that used its unaudited work is marked for recomputation: the
decode loop rolls back to the earliest such step (`coordinator.generate.Verifier`). Nodes new to
this coordinator are audited at rate 1 until `audit_new` of their calls have been (this run's
audits and, with a reputation database, earlier runs').
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from coordinator.remote.peers import Peer, PeerSet
from moe.experts.local import LocalExperts
from moe.wire import codec
from moe.wire import moeshard_pb2 as pb

log = logging.getLogger(__name__)

REGROUP_TOL = 1e-12  # relative: the same float32 terms summed in float64 in another grouping
# relative to the call's largest |value|, across kernel builds or CPU levels: 10x the largest
# difference measured between kernel variants (9.3e-7, docs/kernels.md)
KERNEL_TOL = 1e-5
BF16_TOL = 2.0**-6  # relative: partial sums each rounded to bfloat16 (8 significant bits)
DRAIN_S = 30.0  # longest wait for the audits in flight at the end of a generation


class LocalReferee:
    """The coordinator's own copy of (some of) the experts, as the judge of disputes."""

    def __init__(self, backend, held: set[tuple[int, int]]):
        self.backend, self.held = backend, held  # an ExpertsBackend; (layer, expert) it has
        self.lock = threading.Lock()

    @classmethod
    def of(cls, model) -> LocalReferee | None:
        """The referee made of a ModelDir's own experts (read only when a dispute needs one),
        or None when the directory holds none."""
        if not model.shard_set.locations:
            return None
        return cls(LocalExperts(model.shard_set), set(model.shard_set.locations))

    def holds(self, layer: int, experts: list[int]) -> bool:
        return all((layer, e) in self.held for e in experts)

    def __call__(self, layer, hidden, ids, weights) -> np.ndarray:
        """hidden [n, H] f32, ids/weights [n, k] (-1: empty) -> float64 [n, H]."""
        with self.lock:
            return self.backend(layer, hidden, ids, weights, dtype=np.float64)


@dataclass
class Case:
    """One Forward call whose reply went into a layer's result."""

    step: int
    peer: Peer
    experts: list[int]
    request: pb.ForwardRequest
    part: np.ndarray  # [n, H] the reply as decoded
    id: int = 0


@dataclass
class AuditStats:
    audits: int = 0  # calls re-run
    passed: int = 0
    mismatches: int = 0
    convicted: list[str] = field(default_factory=list)  # node ids caught lying
    unresolved: int = 0  # mismatches no referee could settle
    inconclusive: int = 0  # an auditor failed to answer
    unauditable: int = 0  # no other holder (and no referee) for a picked call

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Auditor:
    """Picks calls to audit, runs the audits in a worker thread, convicts liars and tells the
    decode loop which step to recompute from (it is the loop's `Verifier`)."""

    def __init__(
        self,
        peers: PeerSet,
        rate: float,
        new_calls: int,
        check: Callable[[pb.ForwardReply, int, int], np.ndarray | str],
        next_id: Callable[[], int],
        deadline_s: float,
        own_kernels: str,
        referee: LocalReferee | None = None,
        reputation=None,
        accounts=None,
    ):
        self.peers, self.rate, self.new_calls = peers, rate, new_calls
        self.check, self.next_id, self.deadline_s = check, next_id, deadline_s
        self.own_kernels, self.referee = own_kernels, referee
        self.reputation, self.accounts = reputation, accounts
        self.rng = random.SystemRandom()  # secret: a node cannot predict which calls are audited
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="audit")
        self.pending: set[Future] = set()
        self.stats = AuditStats()
        self.suspects: set[str] = set()
        self.distrusted: set[str] = set()  # node ids disqualified by this auditor
        self.audited: Counter = Counter()  # node id -> audits this run
        self.step = 0
        self.uses: list[tuple[str, int, int]] = []  # (node id, step, case id) this generation
        self.verified: set[int] = set()  # case ids that passed an audit
        self._rollback: int | None = None
        # (case, second answer, exact, tol) of every comparison: `bench audit` records them
        self.observe: Callable | None = None
        self._next_case = 0

    # -- the decode loop's Verifier -----------------------------------------------------------

    def begin_step(self, step: int) -> None:
        with self.lock:
            if step == 0:  # a new generation, or its prefill again after a rollback
                self.uses, self.verified = [], set()
            elif step <= self.step:  # a rollback: the uses of the undone steps are gone
                self.uses = [u for u in self.uses if u[1] < step]
            self.step = step

    def rollback_step(self) -> int | None:
        with self.lock:
            step, self._rollback = self._rollback, None
            return step

    def drain(self) -> None:
        with self.lock:
            pending = list(self.pending)
        for future in pending:
            try:
                future.result(timeout=DRAIN_S)
            except Exception as exc:  # an audit that crashed is logged, not fatal
                log.error("audit failed: %r", exc)

    # -- picking ------------------------------------------------------------------------------

    def submit(self, peer: Peer, experts: list[int], request, part: np.ndarray) -> bool:
        """A reply of `peer` is about to be used: remember it, and maybe audit it (in the
        background). False if `peer` was caught lying meanwhile (its reply was in flight): the
        caller must not use it. Under the same lock as `distrust`, so a use is either refused
        or seen by the rollback that a conviction computes."""
        with self.lock:
            if peer.node_id in self.distrusted:
                return False
            self._next_case += 1
            case = Case(self.step, peer, experts, request, part, self._next_case)
            self.uses.append((peer.node_id, case.step, case.id))
            if not self._picked(peer.node_id):
                return True
            self.audited[peer.node_id] += 1
            future = self.pool.submit(self._audit, case)
            self.pending.add(future)
        future.add_done_callback(self._done)
        return True

    def _picked(self, node_id: str) -> bool:
        if self.rate <= 0:
            return False
        if node_id in self.suspects:
            return True
        record = self.reputation.record(node_id) if self.reputation else None
        if record is not None and record.suspect:  # failed an audit lately, in any run
            return True
        history = record.audits_seen if record is not None else 0
        if max(self.audited[node_id], history) < self.new_calls:  # history counts this run's
            return True
        return self.rng.random() < self.rate

    def _done(self, future: Future) -> None:
        with self.lock:
            self.pending.discard(future)
        if future.exception() is not None:
            log.error("audit failed: %r", future.exception())

    # -- auditing -----------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self.lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _audit(self, case: Case) -> None:
        self._count("audits")
        plan = self._cover(case, case.experts, {case.peer.node_id})
        judge = self.referee is not None and self.referee.holds(case.request.layer, case.experts)
        if plan is None and not judge:
            self._count("unauditable")
            return
        if plan is None:  # nobody else holds them: the coordinator's own copy decides
            self._referee_verdict(case, [])
            return
        answers = self._run(case, plan)
        if answers is None:
            self._count("inconclusive")
            return
        second = _total(answers)
        auditors = [p for p, _ in plan]
        exact = len(plan) == 1 and auditors[0].kernels == case.peer.kernels
        tol = self._tol(case, [case.peer, *auditors])
        if self.observe is not None:
            self.observe(case, second, exact, tol)
        if agree(case.part, second, exact, tol):
            self._passed(case)
            return
        self._count("mismatches")
        with self.lock:
            self.suspects.update(p.node_id for p in [case.peer, *auditors])
        log.warning(
            "audit of node %s, layer %d: its reply differs from %s's; settling",
            case.peer.label, case.request.layer, ", ".join(p.label for p in auditors),
        )  # fmt: skip
        if judge:
            self._referee_verdict(case, plan, answers)
        else:
            self._third_party_verdict(case, plan, second)

    def _referee_verdict(self, case: Case, plan, answers=None) -> None:
        """The coordinator's own computation is the truth: whoever disagrees with it lied."""
        ref = self._as_sent(case, self._local(case, case.experts))
        exact = case.peer.kernels == self.own_kernels
        if not agree(case.part, ref, exact, self._tol(case, [case.peer], local=True)):
            self._convict(case.peer, case, "its reply differs from the coordinator's own result")
        else:
            self._passed(case)
        auditors = [p for p, _ in plan]
        if not answers or agree(_total(answers), ref, False, self._tol(case, auditors, local=True)):
            self._clear(auditors)
            return
        # each auditor's own answer, as it gave it (asking again would let a part-time liar
        # answer honestly the second time)
        for (auditor, subset), values in zip(plan, answers, strict=True):
            mine = self._as_sent(case, self._local(case, subset))
            exact = auditor.kernels == self.own_kernels
            if agree(values, mine, exact, self._tol(case, [auditor], local=True)):
                self._clear([auditor])
            else:
                self._convict(auditor, case, "its audit answer differs from the coordinator's")

    def _third_party_verdict(self, case: Case, plan, second) -> None:
        """No copy here: holders outside the dispute recompute the call; the side they agree
        with is honest. Unsettled (nobody else holds it, or they agree with neither side):
        both sides stay suspects, audited on every call."""
        disputed = {case.peer.node_id, *(p.node_id for p, _ in plan)}
        third_plan = self._cover(case, case.experts, disputed)
        answers = self._run(case, third_plan) if third_plan else None
        third = _total(answers) if answers else None
        if third is None:
            self._count("unresolved")
            log.warning("audit of %s: no third holder to settle it", case.peer.label)
            return
        nodes = [case.peer, *(p for p, _ in plan), *(p for p, _ in third_plan)]
        p_ok = agree(case.part, third, False, self._tol(case, nodes))
        q_ok = agree(second, third, False, self._tol(case, nodes))
        if q_ok and not p_ok:
            self._convict(case.peer, case, "its reply differs from two other holders'")
            self._clear([p for p, _ in plan])
        elif p_ok and not q_ok and len(plan) == 1:
            self._passed(case)
            self._convict(plan[0][0], case, "its audit answer differs from two other holders'")
        else:
            self._count("unresolved")
            log.warning("audit of %s: the third holder sides with neither", case.peer.label)

    # -- helpers ------------------------------------------------------------------------------

    def _cover(self, case: Case, experts: list[int], exclude: set[str]):
        """[(peer, experts)] covering `experts` with live nodes outside `exclude`, fewest nodes
        first (greedy), picked at random among equals; None if some expert has no such holder."""
        layer = case.request.layer
        live = [p for p in self.peers.live() if p.node_id not in exclude]
        self.rng.shuffle(live)
        todo, plan = set(experts), []
        while todo:
            best = max(live, key=lambda p: sum(p.holds(layer, e) for e in todo), default=None)
            mine = sorted(e for e in todo if best is not None and best.holds(layer, e))
            if not mine:
                return None
            plan.append((best, mine))
            todo -= set(mine)
        return plan

    def _run(self, case: Case, plan) -> list[np.ndarray] | None:
        """Each of `plan`'s nodes' answer for its share of the call, float64 [n, H] as the
        wire gave it; None if one of them failed to answer (that is not evidence of lying)."""
        answers = []
        for peer, subset in plan:
            request = self._subrequest(case, subset)
            try:
                reply = peer.stub.Forward(request, timeout=self.deadline_s)
            except grpc.RpcError as exc:
                log.info("audit call to %s failed: %s", peer.label, exc.code().name)
                return None
            values = self.check(reply, request.request_id, case.part.shape[0])
            if isinstance(values, str):
                self._convict(peer, case, f"invalid audit answer: {values}")
                return None
            if self.accounts is not None:  # an audit is work too: its receipt is kept
                self.accounts.record(peer.node_id, request, reply, peer.public_key)
            answers.append(values.astype(np.float64))  # [n, H]
        return answers

    def _subrequest(self, case: Case, experts: list[int]) -> pb.ForwardRequest:
        request = pb.ForwardRequest()
        request.CopyFrom(case.request)
        request.request_id = self.next_id()
        if experts != case.experts:
            ids = codec.decode(request.ids, "ids", (codec.I32,))  # [n, k]
            keep = np.isin(ids, experts)  # [n, k]
            request.ids.CopyFrom(codec.encode(np.where(keep, ids, -1), codec.I32))
        return request

    def _local(self, case: Case, experts: list[int]) -> np.ndarray:
        """The referee's float64 result for `experts` of the case's call."""
        r = case.request
        hidden = codec.decode(r.hidden, "hidden", (codec.F32, codec.BF16))  # [n, H]
        ids = codec.decode(r.ids, "ids", (codec.I32,))  # [n, k]
        weights = codec.decode(r.weights, "weights", (codec.F32,))  # [n, k]
        ids = np.where(np.isin(ids, experts), ids, -1)  # [n, k]
        return self.referee(r.layer, hidden, ids, weights)  # [n, H]

    @staticmethod
    def _as_sent(case: Case, values: np.ndarray) -> np.ndarray:
        """`values` rounded as the node's reply was (bf16 or f32 out dtype), for equal bits."""
        dtype = case.request.out_dtype or case.request.hidden.dtype
        if dtype == codec.F64:
            return values
        return codec.decode(codec.encode(values, dtype), "out", (dtype,))

    def _passed(self, case: Case) -> None:
        with self.lock:
            self.verified.add(case.id)
        self._count("passed")
        if self.reputation:
            self.reputation.record_audit(case.peer.node_id, True)
        if self.accounts:
            self.accounts.audit(case.peer.node_id, True, "", case.request.layer)

    def _clear(self, peers: list[Peer]) -> None:
        with self.lock:
            self.suspects.difference_update(p.node_id for p in peers)

    def convict(self, peer: Peer, why: str) -> None:
        """`peer` sent something no honest node sends (checked by the caller): disqualify it
        and recompute whatever used its unaudited work."""
        self._convict(peer, None, why)

    def _convict(self, peer: Peer, case: Case | None, why: str) -> None:
        if not self.distrust(peer, why):
            return
        with self.lock:
            self.stats.convicted.append(peer.node_id)
        if self.reputation:
            self.reputation.record_audit(peer.node_id, False)
        if self.accounts:
            self.accounts.audit(peer.node_id, False, why, case.request.layer if case else -1)

    def distrust(self, peer: Peer, why: str) -> bool:
        """Disqualify `peer` and mark the earliest step that used its unaudited work for
        recomputation (also for a failed possession challenge); True the first time."""
        with self.lock:  # check and mark at once: two audit threads may catch it together
            first = peer.node_id not in self.distrusted
            self.distrusted.add(peer.node_id)
            self.suspects.discard(peer.node_id)
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

    def _tol(self, case: Case, nodes: list[Peer], local: bool = False) -> float:
        """Tolerance for a comparison that is not bit-exact: REGROUP_TOL when every party
        runs the same kernels (`local`: the coordinator is one), else KERNEL_TOL; a bf16 wire
        rounds each partial sum to 8 bits, so sums of bf16 parts get bf16's tolerance."""
        kernels = {p.kernels for p in nodes} | ({self.own_kernels} if local else set())
        tol = REGROUP_TOL if len(kernels) == 1 else KERNEL_TOL
        if (case.request.out_dtype or case.request.hidden.dtype) == codec.BF16:
            tol = max(tol, BF16_TOL)
        return tol

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _total(answers: list[np.ndarray]) -> np.ndarray:
    """The auditors' float64 partial sums added up, in plan order: [n, H]."""
    total = answers[0]
    for values in answers[1:]:
        total = total + values
    return total


def agree(a: np.ndarray, b: np.ndarray, exact: bool, tol: float) -> bool:
    """Equal bits, or |a - b| <= tol * max|b| elementwise (NaN never agrees)."""
    if a.shape != b.shape:
        return False
    if exact:
        return bool(np.array_equal(a, b))
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-30)
    return bool(np.abs(a.astype(np.float64) - b).max(initial=0.0) <= tol * scale)
