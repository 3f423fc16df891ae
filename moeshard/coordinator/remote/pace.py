"""The audits' share of one node's record limits (`Pace`): the coordinator fetches records
for its audits within the rate and streams the node states, so an honest node never has to
refuse an audit for going over its own limits."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from moeshard.moe.wire.constants import CREDIT_CAP

PACE = 0.8  # share of a node's stated record rate the audits use (its clock is not ours)


class Pace:
    """The audits' share of one node's record limits, as the node counts them for this client:
    at most `streams` fetches at once, each paid from the credit its computing earned (the
    records its replies used, `earn`) or else from PACE x `rate` bytes a second (a bucket of
    one second's worth; a record larger than it goes once the bucket is full, leaving it in
    debt). A rate of 0 is not stated: no pacing."""

    def __init__(self, rate: float, streams: int, default_streams: int):
        self.rate = PACE * rate
        self.capacity = self.tokens = self.rate
        self.credit = 0
        self.stamp = time.monotonic()
        self.slots = threading.Semaphore(max(streams, 1) if streams else default_streams)
        self.lock = threading.Lock()

    def earn(self, nbytes: int) -> None:
        with self.lock:
            self.credit = min(CREDIT_CAP, self.credit + nbytes)

    @contextmanager
    def turn(self, nbytes: int):
        with self.slots:
            with self.lock:
                paid = self.credit >= nbytes
                if paid:
                    self.credit -= nbytes
            while self.rate > 0 and not paid:
                with self.lock:
                    now = time.monotonic()
                    self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
                    self.stamp = now
                    short = min(nbytes, self.capacity) - self.tokens
                    if short <= 0:
                        self.tokens -= nbytes
                        break
                time.sleep(short / self.rate)
            yield
