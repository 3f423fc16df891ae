"""The expert records the coordinator recomputes audited calls with (`--audit-cache SIZE`).

An audit needs the records the call used; the coordinator need not store them. Each record
comes from the first of:

* this process's audit cache: an arena of record slots, least recently used first out;
* the coordinator's own model directory, when it holds the record (a full model directory is
  its own audit cache: the records are read checksum-verified, as a node reads them);
* a node that holds it (`obtain`, the auditor's: `fetch_record` over the wire, every byte
  checked against the record's Merkle root in merkle.bin, which the model id covers).

`waves(layer, experts, obtain)` hands the records to
`moeshard.moe.experts.compute.recompute_partial_sum`
a few at a time (as many as the caller's share of the slots), each wave's slots pinned while
it runs, so a call routed to more experts than fit still recomputes, in several waves. Auditor
threads use the cache at once: the lock guards its slots and counters, and each takes waves
of at most its share of the slots, so pinned records never fill the arena.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from moeshard.moe.storage.io import align_up, aligned_buffer
from moeshard.moe.storage.shards import ShardSet

Key = tuple[int, int]  # (layer, expert)
MIN_SLOTS = 4  # the smallest arena: a wave of at least this many records
DEFAULT_BYTES = 256 << 20  # the default budget's floor; at least two calls' worth of top-k


def default_budget(record_nbytes: int, records: int, top_k: int) -> int:
    """`--audit-cache`'s default: the whole model's records when they fit in DEFAULT_BYTES
    (a small model is fetched once and then never again), else DEFAULT_BYTES or two calls'
    worth of top-k records, whichever is more."""
    slot = align_up(record_nbytes)
    return min(records * slot, max(DEFAULT_BYTES, 2 * top_k * slot))


@dataclass
class CacheStats:
    hits: int = 0  # records found in the arena
    local: int = 0  # records read from the coordinator's own model directory
    fetched: int = 0  # records fetched from nodes
    fetched_bytes: int = 0
    evicted: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class RecordCache:
    def __init__(self, shards: ShardSet, budget_bytes: int):
        self.shards = shards  # the geometry, and the records this directory holds (maybe none)
        self.record_nbytes = shards.record_nbytes
        self.slot_bytes = align_up(self.record_nbytes)
        self.slots = max(MIN_SLOTS, budget_bytes // self.slot_bytes)
        self.arena = aligned_buffer(self.slots * self.slot_bytes)  # committed as slots fill
        self.slot_of: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self.free = list(range(self.slots - 1, -1, -1))
        self.pinned: Counter = Counter()  # slot -> the waves using it now
        self.loading: dict[Key, threading.Event] = {}  # records a thread is loading now
        self.lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def budget_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def record(self, key: Key) -> np.ndarray:
        """The bytes of a resident record: uint8 [record_nbytes] (a view into the arena)."""
        start = self.slot_of[key] * self.slot_bytes
        return self.arena[start : start + self.record_nbytes]

    def waves(
        self,
        layer: int,
        experts: list[int],
        obtain: Callable[[Key, np.ndarray], int],
        most: int = 0,
    ) -> Iterator[tuple[np.ndarray, dict[int, int]]]:
        """(arena, {expert: offset}) groups covering `experts`, each at most `most` records
        (0: `slots`; callers running at once take a share each, so their pins never fill the
        arena), resident ones first. `obtain(key, out)` fills `out` (uint8 [record_nbytes])
        with a verified record and returns the bytes it fetched (0 for none); whatever it
        raises ends the waves (the slot it was filling is freed)."""
        most = max(1, min(most or self.slots, self.slots))
        with self.lock:  # resident first: they cost nothing
            todo = sorted(experts, key=lambda e: (layer, e) not in self.slot_of)
        while todo:
            wave: dict[int, int] = {}  # expert -> its pinned slot
            try:
                for e in todo[:most]:
                    wave[e] = self._pin((layer, e), obtain)
                yield self.arena, {e: slot * self.slot_bytes for e, slot in sorted(wave.items())}
            finally:
                with self.lock:
                    for slot in wave.values():
                        self.pinned[slot] -= 1
                        if not self.pinned[slot]:
                            del self.pinned[slot]
            todo = todo[most:]

    def _pin(self, key: Key, obtain) -> int:
        """The slot holding `key`, pinned: resident, loaded by another thread (waited for), or
        loaded here into a free (or the least recently used unpinned) slot."""
        while True:
            with self.lock:
                if key in self.slot_of:
                    slot = self.slot_of[key]
                    self.slot_of.move_to_end(key)
                    self.pinned[slot] += 1
                    self.stats.hits += 1
                    return slot
                loading = self.loading.get(key)
                if loading is None:
                    loading = self.loading[key] = threading.Event()
                    slot = self._take_slot()
                    self.pinned[slot] += 1
                    break
            loading.wait()  # another thread loads it: then it is resident (or failed: retry)
        out = self.arena[slot * self.slot_bytes : slot * self.slot_bytes + self.record_nbytes]
        try:
            if key in self.shards.locations:
                out[:] = self.shards.read(*key)  # checksum-verified
                fetched = 0
            else:
                fetched = obtain(key, out)
        except BaseException:
            with self.lock:
                self.pinned[slot] -= 1
                if not self.pinned[slot]:
                    del self.pinned[slot]
                self.free.append(slot)
                del self.loading[key]
            loading.set()
            raise
        with self.lock:
            self.slot_of[key] = slot
            del self.loading[key]
            if fetched:
                self.stats.fetched += 1
                self.stats.fetched_bytes += fetched
            else:
                self.stats.local += 1
        loading.set()
        return slot

    def _take_slot(self) -> int:
        if self.free:
            return self.free.pop()
        for key, slot in self.slot_of.items():  # least recently used first
            if slot not in self.pinned:
                del self.slot_of[key]
                self.stats.evicted += 1
                return slot
        raise RuntimeError("audit cache: every slot is pinned (waves larger than the arena)")

    def snapshot(self) -> dict:
        with self.lock:
            return self.stats.as_dict() | {"slots": self.slots, "resident": len(self.slot_of)}
