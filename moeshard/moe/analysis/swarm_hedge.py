"""Hedged requests in the swarm model, by the runtime's rule (`coordinator/remote/gather.py`):
a node's reply later than its recent p95 (or the swarm's, if lower or if the node has too few
replies yet) is hedged, if it is a straggler (at most half the layer's replies, or one, still
out then), to the other holders of its experts; the layer takes whichever answer is complete
first. The abandoned work still takes its node's time, and its reply time still counts."""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW, SWARM_WINDOW, MIN_SAMPLES = 64, 256, 16  # as coordinator/remote/peers.py
MIN_HEDGE_S = 1e-3
STRAGGLERS = 0.5


class Latencies:
    """Recent reply times per node and over the swarm, and the p95s the runtime hedges by."""

    def __init__(self, nodes: int):
        self.own = [deque(maxlen=WINDOW) for _ in range(nodes)]
        self.swarm: deque = deque(maxlen=SWARM_WINDOW)
        self.p95 = [0.0] * nodes
        self.swarm_p95 = 0.0

    def record(self, n: int, seconds: float) -> None:
        self.own[n].append(seconds)
        self.swarm.append(seconds)
        if len(self.own[n]) >= MIN_SAMPLES and len(self.own[n]) % 4 == 0:
            self.p95[n] = float(np.percentile(self.own[n], 95))
        if len(self.swarm) >= MIN_SAMPLES and len(self.swarm) % 4 == 0:
            self.swarm_p95 = float(np.percentile(self.swarm, 95))

    def after(self, n: int) -> float:
        """How late node n's reply may be before it is hedged (0: not known yet)."""
        own, swarm = self.p95[n], self.swarm_p95
        return min(own, swarm) if own and swarm else own or swarm


def hedge_layer(replies: dict, now: float, lat: Latencies, hedge) -> int:
    """Hedge the stragglers among `replies` (node -> [reply time, ...], updated in place);
    `hedge(n, at)`: when an answer for node n's share sent elsewhere at `at` would be back
    (None: no other holder). Records every node's reply time; returns the hedges sent."""
    sent = 0
    for n in sorted(replies, key=lambda m: replies[m][0]):
        after = lat.after(n)
        lat.record(n, replies[n][0] - now)
        if not after:
            continue
        at = now + max(after, MIN_HEDGE_S)
        if replies[n][0] <= at:
            continue
        out = sum(1 for m in replies if replies[m][0] > at)
        if out > max(1.0, STRAGGLERS * len(replies)):
            continue
        back = hedge(n, at)
        sent += 1
        if back is not None and back < replies[n][0]:
            replies[n][0] = back
    return sent
