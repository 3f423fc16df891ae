"""Latency histograms for /metrics, in Prometheus' cumulative-bucket form.

An operator reads a server's latency from these, not from its means: time to first token,
the gap between a stream's tokens (what a reader sees stall while another request's prompt is
read), and a request's whole time, as vLLM and llama.cpp's server export them. The engine
thread observes; the /metrics handler reads a consistent copy under the lock.
"""

from __future__ import annotations

import bisect
import threading

# upper bounds in seconds (+Inf is implied): first token and whole requests span milliseconds
# (one short prompt, in RAM) to minutes (a long answer streamed from SSD or through nodes)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts of observations at or below each bound (`bounds` increasing), their sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"histogram bounds must increase: {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)  # the first bound >= seconds
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def __getstate__(self) -> dict:
        """Pickled (for the server process, `engine_process`): the counts, not the lock."""
        with self._lock:
            return {"bounds": self.bounds, "_counts": list(self._counts), "_sum": self._sum}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def snapshot(self) -> tuple[list[int], float, int]:
        """(cumulative counts per bound then +Inf, sum, count), taken together."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for n in counts:
            running += n
            cumulative.append(running)
        return cumulative, total, running

    def prometheus(self, name: str, help_text: str) -> list[str]:
        """The histogram's lines in Prometheus' text format (`name`_bucket, _sum, _count)."""
        cumulative, total, count = self.snapshot()
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, n in zip([*map(repr, self.bounds), "+Inf"], cumulative, strict=True):
            lines.append(f'{name}_bucket{{le="{bound}"}} {n}')
        return [*lines, f"{name}_sum {total:.9g}", f"{name}_count {count}"]
