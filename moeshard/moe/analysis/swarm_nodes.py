"""The swarm simulator's nodes in time: each node's expert cache, its disk's queue and its
cores, as one layer's Forward call and the next layer's prefetch hint use them.

A node computes the experts it holds in RAM first (a prefetched one once its read has
landed), then each missed one as its read lands, as the store does
(`moeshard.moe.experts.store`); a read waits behind every read queued on the same disk before
it, and a kernel behind every kernel on the same cores. Nodes on one machine (`bench swarm`)
share one disk queue and one set of cores (`Timeline` objects shared between them).
"""

from __future__ import annotations

import bisect

import numpy as np

from moeshard.moe.analysis.cachesim import ReplayCache
from moeshard.moe.analysis.disk import Disk
from moeshard.moe.analysis.simulate import Geometry, _landing_times

MAX_DEPTH = 8  # reads a node keeps in flight


class Timeline:
    """A resource of `lanes` that each do one thing at a time: a disk's queue (1 lane; its
    depth is in the disk model), or a host's cores (a lane per core, or one lane for kernels
    that use every core at once).

    The simulator does not hand out work in time order: a call reaching a node half a round
    trip from now is booked before a kernel that runs now. So each lane keeps its busy
    intervals, and work goes into the first gap that fits it at or after its start, as a
    scheduler would run it, instead of after everything booked so far (which would make
    today's work wait behind work booked for later, more so the longer the round trips)."""

    def __init__(self, lanes: int = 1):
        self.starts: list[list[float]] = [[] for _ in range(max(1, lanes))]  # per lane, sorted
        self.ends: list[list[float]] = [[] for _ in range(max(1, lanes))]  # the same intervals

    def forget_before(self, t: float) -> None:
        """Drop the intervals over before `t` (nothing is booked earlier than the
        coordinator's clock, which only moves forward): keeps every search short."""
        for starts, ends in zip(self.starts, self.ends, strict=True):
            cut = bisect.bisect_right(ends, t)
            del starts[:cut], ends[:cut]

    def _fit(self, lane: int, start: float, seconds: float) -> tuple[float, int]:
        """The earliest time >= start at which `lane` is free for `seconds`, and where that
        interval goes in the lane's list."""
        starts, ends = self.starts[lane], self.ends[lane]
        i = bisect.bisect_right(ends, start)  # the first interval still busy after `start`
        t = start
        while i < len(starts) and starts[i] < t + seconds:
            t = max(t, ends[i])
            i += 1
        return t, i

    def _book(self, lane: int, t: float, seconds: float, i: int) -> None:
        starts, ends = self.starts[lane], self.ends[lane]
        end = t + seconds
        if i > 0 and ends[i - 1] >= t:  # touches the interval before: extend it
            i -= 1
            ends[i] = max(ends[i], end)
        else:
            starts.insert(i, t)
            ends.insert(i, end)
        while i + 1 < len(starts) and starts[i + 1] <= ends[i]:  # ... and the one after
            ends[i] = max(ends[i], ends.pop(i + 1))
            starts.pop(i + 1)

    def take(self, start: float, seconds: float) -> float:
        """Run `seconds` of work no earlier than `start` in the first gap of any lane that
        fits it; its end."""
        if seconds <= 0:
            return start
        fits = [self._fit(lane, start, seconds) for lane in range(len(self.starts))]
        lane = min(range(len(fits)), key=lambda j: fits[j][0])
        t, i = fits[lane]
        self._book(lane, t, seconds, i)
        return t + seconds

    def take_all(self, start: float, seconds: float) -> float:
        """Work that uses every lane for `seconds` (the coordinator's trunk on the nodes' host),
        sharing the cores with the work booked while it runs: it ends after its own time and
        its share of that work (`end = start + seconds + busy(start, end) / lanes`), and every
        lane is busy until then."""
        lanes = len(self.starts)
        end = start + seconds
        for _ in range(20):  # the fixed point: each round takes in the work the last one reached
            busy = sum(self._busy(lane, start, end) for lane in range(lanes))
            new_end = start + seconds + busy / lanes
            if new_end - end < 1e-9:
                break
            end = new_end
        for lane in range(lanes):
            starts, ends = self.starts[lane], self.ends[lane]
            i = bisect.bisect_right(ends, start)  # the first interval still busy at `start`
            t = min(start, starts[i]) if i < len(starts) else start  # one straddling it: joined
            self._book(lane, t, end - t, i)
        return end

    def _busy(self, lane: int, start: float, end: float) -> float:
        """Seconds of `lane` booked between `start` and `end`."""
        starts, ends = self.starts[lane], self.ends[lane]
        i = bisect.bisect_right(ends, start)
        total = 0.0
        while i < len(starts) and starts[i] < end:
            total += min(ends[i], end) - max(starts[i], start)
            i += 1
        return total


class SimNode:
    def __init__(
        self, g: Geometry, ram: int, disk: Disk, kernel_gbps: float, disk_line, cpu_line,
        read_cpu_s: float = 0.0, stall: tuple[float, float, float] = (0.0, 0.0, 0.0),
    ):  # fmt: skip
        self.g, self.disk = g, disk
        self.cache = ReplayCache(max(0, ram // g.record_bytes), "lru", set())
        self.ready: dict[int, float] = {}  # record -> when its read lands (if still ahead)
        self.disk_line: Timeline = disk_line
        self.cpu_line: Timeline = cpu_line
        self.expert_s = g.record_bytes / (kernel_gbps * 1e9)
        self.read_cpu_s = read_cpu_s  # a shared host's cores, per read (at submission)
        self.stall_s, self.stall_every_s, self.stall_phase = stall  # frozen now and then
        self.slot = np.arange(g.layers * g.n_experts)  # records in (layer, expert) order
        self.busy_s = 0.0  # seconds of reads and kernels, over the run
        self.read_bytes = 0

    def _read(self, keys: list[int], start: float) -> list[float]:
        """Queue reads of `keys` at `start` behind this disk's earlier reads; when each lands."""
        if not keys:
            return []
        depth = min(len(keys), MAX_DEPTH)
        at = _landing_times(keys, self.slot, self.g, self.disk, depth, 0.0)  # from its start
        seconds = max(at)
        begin = self.disk_line.take(start, seconds) - seconds  # in the disk's first free gap
        at = [begin + t for t in at]
        self.busy_s += seconds
        self.read_bytes += len(keys) * self.g.record_bytes
        for _ in keys if self.read_cpu_s else ():  # the cores the reads take meanwhile
            self.cpu_line.take(begin, self.read_cpu_s)
        return at

    def awake(self, t: float) -> float:
        """`t`, or the end of the freeze it falls in (a node that stalls now and then)."""
        if not self.stall_every_s:
            return t
        start = self.stall_phase + (t - self.stall_phase) // self.stall_every_s * self.stall_every_s
        return start + self.stall_s if t < start + self.stall_s else t

    def receive(self, keys: list[int], arrival: float, call_cpu_s: float = 0.0) -> tuple:
        """The call for `keys` reaching the node at `arrival`: its missed records are queued on
        the disk and, on a shared host, its own processing (`call_cpu_s`: parsing, TLS,
        replying) waits for a core. Returns (the call, for `compute`; how many of `keys` were
        in its cache or on their way)."""
        self.cache.begin_call()
        demand = [k for k in keys if k not in self.cache]
        for k, at in zip(demand, self._read(demand, arrival), strict=True):
            self.cache.insert(k, set(keys))
            self.ready[k] = at
        arrival = self.awake(arrival)
        t = self.cpu_line.take(arrival, call_cpu_s) if call_cpu_s else arrival
        return (keys, t), len(keys) - len(demand)

    def compute(self, call: tuple) -> tuple[float, float]:
        """The call's kernels, the resident experts first (a prefetched one once its read has
        landed), then each missed one as it lands: (when its partial sum is ready, seconds of
        kernels)."""
        keys, t = call
        for at in sorted(self.ready.pop(k, 0.0) for k in keys):
            t = self.cpu_line.take(self.awake(max(t, at)), self.expert_s)
        for k in keys:
            self.cache.touch(k)
        seconds = len(keys) * self.expert_s
        self.busy_s += seconds
        return t, seconds

    def warm(self, keys: list[int]) -> None:
        """The prompt's pass put `keys` in the cache (before the decode is timed)."""
        self.cache.begin_call()
        for k in keys:
            self.cache.insert(k, set(keys))
            self.cache.touch(k)

    def prefetch(self, keys: list[int], arrival: float, call_cpu_s: float = 0.0) -> None:
        """A hint for `keys` reaching the node at `arrival`: the ones not in its cache are read
        (on a shared host the call itself takes a core for `call_cpu_s`)."""
        if call_cpu_s:
            self.cpu_line.take(arrival, call_cpu_s)
        self.cache.begin_call()
        fetch = [k for k in keys if k not in self.cache]
        for k, at in zip(fetch, self._read(fetch, arrival), strict=True):
            self.cache.insert(k, set(keys))
            self.ready[k] = at
