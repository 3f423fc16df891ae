"""The expert records the coordinator recomputes audited calls with (`--audit-cache SIZE`).

An audit needs the records the call used; the coordinator need not store them. Each record
comes from the first of:

* this process's audit cache: an arena of record slots, least recently used first out;
* the coordinator's own model directory, when it holds the record (a full model directory is
  its own audit cache: the records are read checksum-verified, as a node reads them);
* a node that holds it (`obtain`, the auditor's: `fetch_record` over the wire, every byte
  checked against the record's Merkle root in merkle.bin, which the model id covers).

`waves(layer, experts, obtain)` hands the records to `moe.experts.compute.recompute_partial_sum`
a few at a time (as many as the arena has slots), each wave's slots pinned while it runs, so a
call routed to more experts than fit still recomputes, in several waves. One auditor thread
uses the cache; the lock keeps the counters and a `stats` reader consistent.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from moe.storage.io import align_up, aligned_buffer
from moe.storage.shards import ShardSet

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
        self.pinned: set[int] = set()
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
        self, layer: int, experts: list[int], obtain: Callable[[Key, np.ndarray], int]
    ) -> Iterator[tuple[np.ndarray, dict[int, int]]]:
        """(arena, {expert: offset}) groups covering `experts`, each at most `slots` records,
        resident ones first. `obtain(key, out)` fills `out` (uint8 [record_nbytes]) with a
        verified record and returns the bytes it fetched (0 for none); whatever it raises
        ends the waves (the slot it was filling is freed)."""
        todo = list(experts)
        while todo:
            wave, todo = self._wave(layer, todo, obtain)
            try:
                yield self.arena, {e: self.slot_of[(layer, e)] * self.slot_bytes for e in wave}
            finally:
                with self.lock:
                    self.pinned.difference_update(self.slot_of[(layer, e)] for e in wave)

    def _wave(self, layer: int, todo: list[int], obtain) -> tuple[list[int], list[int]]:
        """Pin up to `slots` records of `todo` (resident first, then loaded); (wave, rest)."""
        with self.lock:
            resident = [e for e in todo if (layer, e) in self.slot_of][: self.slots]
            for e in resident:
                self.slot_of.move_to_end((layer, e))
                self.pinned.add(self.slot_of[(layer, e)])
            self.stats.hits += len(resident)
        wave = list(resident)
        for e in todo:
            if len(wave) == self.slots:
                break
            if e not in wave:
                self._load((layer, e), obtain)
                wave.append(e)
        rest = [e for e in todo if e not in wave]
        return sorted(wave), rest

    def _load(self, key: Key, obtain) -> None:
        """Fill a free (or the least recently used unpinned) slot with `key`, pinned."""
        with self.lock:
            slot = self._take_slot()
            self.pinned.add(slot)
        out = self.arena[slot * self.slot_bytes : slot * self.slot_bytes + self.record_nbytes]
        try:
            if key in self.shards.locations:
                out[:] = self.shards.read(*key)  # checksum-verified
                fetched = 0
            else:
                fetched = obtain(key, out)
        except BaseException:
            with self.lock:
                self.pinned.discard(slot)
                self.free.append(slot)
            raise
        with self.lock:
            self.slot_of[key] = slot
            if fetched:
                self.stats.fetched += 1
                self.stats.fetched_bytes += fetched
            else:
                self.stats.local += 1

    def _take_slot(self) -> int:
        if self.free:
            return self.free.pop()
        for key, slot in self.slot_of.items():  # least recently used first
            if slot not in self.pinned:
                del self.slot_of[key]
                self.stats.evicted += 1
                return slot
        raise RuntimeError("audit cache: every slot is pinned (a wave larger than the arena)")

    def snapshot(self) -> dict:
        with self.lock:
            return self.stats.as_dict() | {"slots": self.slots, "resident": len(self.slot_of)}
