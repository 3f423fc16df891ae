"""Waiting for one layer's replies, with hedged requests.

A layer's work is split into shares (a node's experts x the rows that route to them, one
Forward each). All are sent at once; then this waits for whichever reply comes next. A share
whose reply is later than its node's recent p95 round trip, or the swarm's if lower
(`PeerSet.hedge_after_ms`), is hedged once if it is a straggler (most of the layer has its
answers): the same rows go to other holders of its experts (grouped by holder), and the share
takes whichever answer is complete and verified first: the first node's, or every hedge's.
The other is abandoned (a unary call cancelled; a stream message left to arrive and be
dropped; either way its node's round trip still counts in its latency estimate).
Replies are judged (`Trust.accept`) as they come, so a hedge never takes an unverified answer.

A node cannot use hedging to win work: a late reply only sends its work elsewhere, and a node
that is always slow has a high p95 (its replies are not hedged) and is chosen less often.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import numpy as np

from moeshard.coordinator.remote.peers import Peer

MIN_HEDGE_MS = 1.0  # never hedge a reply sooner than this after its request
STRAGGLERS = 0.5  # shares are hedged only once at most this share of the layer (or one) is out


@dataclass
class Round:
    """One round of a layer's fan-out: what it computes, and what its replies told so far."""

    layer: int
    hidden: np.ndarray  # [T, H]
    ids: np.ndarray  # [T, k]
    weights: np.ndarray  # [T, k]
    excluded: dict  # expert -> addresses not to ask for it again in this layer
    bad: set = field(default_factory=set)  # peers with a failed or refused reply this round
    fatals: list = field(default_factory=list)  # errors retrying cannot help


@dataclass(eq=False)
class Attempt:
    peer: Peer
    experts: list[int]
    rows: np.ndarray  # [n] rows of the layer it carries
    request: object  # pb.ForwardRequest
    call: object  # transport.UnaryCall | StreamCall
    part: np.ndarray | None = None  # its verified partial sum [n, H], once accepted
    failed: bool = False

    @property
    def settled(self) -> bool:
        return self.part is not None or self.failed


@dataclass(eq=False)
class Share:
    first: Attempt
    hedges: list[Attempt] = field(default_factory=list)
    hedged: bool = False

    def answer(self) -> list[Attempt] | None:
        """The attempts whose parts make this share's answer, once there is one."""
        if self.first.part is not None:
            return [self.first]
        if self.hedges and all(h.part is not None for h in self.hedges):
            return self.hedges
        return None

    def hopeless(self) -> bool:
        """No attempt left that could still complete it."""
        hedges_out = not self.hedges or any(h.failed for h in self.hedges)
        return self.first.failed and hedges_out

    def attempts(self) -> list[Attempt]:
        return [self.first, *self.hedges]


def hedge_due(share: Share, after_ms) -> float | None:
    """perf_counter time at which `share` is hedged (None: it is not); `after_ms(peer)`: how
    late its node's reply may be (0: not known yet)."""
    if share.hedged:
        return None
    ms = after_ms(share.first.peer)
    return share.first.call.sent_at + max(ms, MIN_HEDGE_MS) / 1e3 if ms else None


def gather(shares: list[Share], judge, hedge=None, after_ms=None, abandoned=None) -> None:
    """Until every share has an answer or cannot get one: `judge(attempt)` settles an attempt
    whose call has completed or is past its deadline (its verified part, or failed);
    `hedge(share)` sends the share's hedges (maybe none: no other live holder) and marks it
    hedged (None: no hedging) once its reply is `after_ms(peer)` late. What is still out once
    a share has its answer is abandoned, and handed to `abandoned(attempt)` (its node's late
    reply still counts in its latency estimate)."""
    while True:
        open_ = [s for s in shares if s.answer() is None and not s.hopeless()]
        if not open_:
            break
        now = time.perf_counter()
        # only stragglers are hedged: while most of the layer is still out, lateness is the
        # coordinator's or everyone's (a busy machine), and a hedge would only add work
        stragglers = len(open_) <= max(1.0, STRAGGLERS * len(shares))
        if hedge is not None and stragglers:
            for share in open_:
                due = hedge_due(share, after_ms)
                if due is not None and due <= now:
                    hedge(share)
        waiting = [a for s in open_ for a in s.attempts() if not a.settled]
        ready = [a for a in waiting if a.call.done() or a.call.deadline_left() <= 0]
        if ready:  # a call past its deadline raises in judge's result(): it fails
            for a in ready:
                judge(a)
            continue
        dues = [hedge_due(s, after_ms) for s in open_] if hedge and stragglers else []
        dues = [d for d in dues if d is not None]
        timeout = min([a.call.deadline_left() for a in waiting] + [d - now for d in dues])
        wait([a.call.ready for a in waiting], max(timeout, 0.0), FIRST_COMPLETED)
    for share in shares:
        answer = share.answer() or []
        for a in share.attempts():
            if a not in answer and not a.settled:
                a.call.abandon()
                if abandoned is not None:
                    abandoned(a)
