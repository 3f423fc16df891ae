"""The swarm simulator's nodes in time: each node's expert cache, its disk's queue and its
cores, as one layer's Forward call and the next layer's prefetch hint use them.

A node computes the experts it holds in RAM first (a prefetched one once its read has
landed), then each missed one as its read lands, as the store does
(`moeshard.moe.experts.store`); a read waits behind every read queued on the same disk before
it, and a kernel behind every kernel on the same cores. Nodes on one machine (`bench swarm`)
share one disk queue and one set of cores (`Timeline` objects shared between them).
"""

from __future__ import annotations

import numpy as np

from moeshard.moe.analysis.cachesim import ReplayCache
from moeshard.moe.analysis.disk import Disk
from moeshard.moe.analysis.simulate import Geometry, _landing_times

MAX_DEPTH = 8  # reads a node keeps in flight


class Timeline:
    """A resource of `lanes` that each do one thing after another: a disk's queue (1 lane;
    its depth is in the disk model), or a host's cores (a lane per core, or one lane for
    kernels that use every core at once)."""

    def __init__(self, lanes: int = 1):
        self.lanes = [0.0] * max(1, lanes)  # when each lane is done with what it was given

    @property
    def free(self) -> float:
        return max(self.lanes)

    def take_all(self, start: float, seconds: float) -> float:
        """Work that uses every lane for `seconds` (the coordinator's trunk on the nodes' host),
        shared with what is already queued: it ends after its own time and that backlog's
        share, and every lane is free then."""
        backlog = sum(max(0.0, lane - start) for lane in self.lanes)
        end = start + seconds + backlog / len(self.lanes)
        self.lanes = [end] * len(self.lanes)
        return end

    def take(self, start: float, seconds: float) -> float:
        """Run `seconds` of work no earlier than `start` on the first lane free; its end."""
        lane = min(range(len(self.lanes)), key=self.lanes.__getitem__)
        self.lanes[lane] = max(start, self.lanes[lane]) + seconds
        return self.lanes[lane]


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
        begin = max(self.disk_line.free, start)
        at = _landing_times(keys, self.slot, self.g, self.disk, min(len(keys), MAX_DEPTH), begin)
        self.disk_line.take(begin, max(at) - begin)
        self.busy_s += max(at) - begin
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
