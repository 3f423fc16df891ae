"""ExpertStore: the one expert cache (single-node streaming and, later, each node daemon).

Records live in whole-expert slots of ONE preallocated, page-aligned arena (no allocation per
token); misses are read with O_DIRECT by `moe.io.ReaderPool` straight into their slots,
coalesced and several in flight. Eviction picks the slot with the lowest policy score:

  lru   score = last access tick
  lfu   score = access frequency with exponential decay (per layer call), kept per expert
        across evictions; decay is done by growing the increment instead of shrinking all
        counts (`boost` *= 1/decay, renormalised when large)
  pin   the N most frequent experts of a profile score +inf once loaded (never evicted);
        the rest is LRU (N leaves top_k + prefetch + 1 slots to LRU by default, so the misses
        of one layer are still read in parallel)
  none  no reuse: a slot is freed as soon as its expert has run (prefetched ones live until
        the layer they were predicted for has run)

Slots that hold experts the current layer still needs, and prefetched experts of the layer
about to run, are protected (never victims). `prefetch(layer, ids)` is deferred until the
current layer's misses are queued, so predicted reads never delay or evict the current
layer's experts.

Results are bit-identical to `moe.model.run_experts` whatever the policy or cache size: each
expert runs on exactly the rows routed to it, and partial sums are added in ascending expert
order at the end.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from moe import quant
from moe.errors import MoeshardError, StoreError
from moe.io import ReaderPool, ReadRequest, align_up, aligned_buffer
from moe.model import add_rows
from moe.trace import usage_counts

log = logging.getLogger(__name__)

POLICIES = ("lru", "lfu", "pin", "none")
FREE = -np.inf


@dataclass
class StoreStats:
    calls: int = 0  # layer calls
    accesses: int = 0  # (layer, expert) uses, one per distinct expert per call
    hits: int = 0  # already resident (or in flight) when the layer ran
    prefetch_hits: int = 0  # of the hits, brought in by prefetch
    misses: int = 0
    bytes_read: int = 0
    reads: int = 0  # read syscalls (coalesced runs)
    read_s: float = 0.0  # summed duration of the reads
    compute_s: float = 0.0  # expert kernels
    stall_s: float = 0.0  # waiting for reads the layer needed
    call_s: float = 0.0  # total time inside __call__
    evict_waits: int = 0  # evictions that had to wait for a mispredicted read to land
    predicted: int = 0  # experts predicted by prefetch hints (layers that then ran)
    predicted_used: int = 0  # of those, really used
    used_after_hint: int = 0  # experts used in layers that had a hint

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def recall(self) -> float:
        return self.predicted_used / self.used_after_hint if self.used_after_hint else 0.0

    @property
    def precision(self) -> float:
        return self.predicted_used / self.predicted if self.predicted else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            hit_rate=self.hit_rate, prefetch_recall=self.recall, prefetch_precision=self.precision
        )
        return d

    def with_reads(self, reads) -> StoreStats:
        """A copy, with the reader's counters (`moe.io.ReadStats`) brought up to date."""
        return replace(self, bytes_read=reads.bytes_read, reads=reads.reads, read_s=reads.read_s)

    def minus(self, other: StoreStats) -> StoreStats:
        return StoreStats(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


def write_profile(path: str | Path, model_id: str, counts: Counter) -> None:
    """Per-(layer, expert) routed-row counts as JSON, read back by `read_profile`."""
    rows = [[layer, expert, n] for (layer, expert), n in sorted(counts.items())]
    Path(path).write_text(json.dumps({"model_id": model_id, "counts": rows}) + "\n")


def read_profile(path: str | Path, model_id: str | None = None) -> Counter:
    """Usage counts for the `pin` policy: a profile from `write_profile` or a routing trace."""
    return usage_counts(path, model_id)


class ExpertStore:
    """Routed experts of one model directory under a fixed number of cache slots.

    Call it like `LocalExperts`: store(layer, hidden [T, H], ids [T, k], weights [T, k]) -> [T, H].
    """

    def __init__(
        self,
        model,  # moe.model.ModelDir
        slots: int,
        policy: str = "lru",
        prefetch: bool = True,
        prefetch_slots: int | None = None,
        prefetch_top: int | None = None,
        depth: int = 4,
        profile: Counter | None = None,
        pin_count: int | None = None,
        decay: float = 0.99,
        merge: bool = True,
        direct: bool = True,
        ffn=quant.expert_ffn,
        ffn_b1=quant.experts_ffn_b1,
    ):
        if policy not in POLICIES:
            raise MoeshardError(f"unknown cache policy {policy!r}; choose one of {POLICIES}")
        c = model.config
        self.model, self.policy = model, policy
        # (record, fmt, H, I, x [n, H]) -> [n, H]; `bench stream --io-only` swaps in a no-op
        self.ffn = ffn
        # (arena, offsets [m], fmt, H, I, x [m, H]) -> [m, H]: the landed experts of a decode
        # step in one call (None: one `ffn` call per expert)
        self.ffn_b1 = ffn_b1
        self.fmt, self.hidden, self.inter = (
            model.expert_format,
            c.hidden_size,
            c.expert_intermediate,
        )
        self.record_nbytes = quant.expert_record_nbytes(self.fmt, self.hidden, self.inter)
        self.slot_bytes = align_up(self.record_nbytes)
        self.prefetch_slots = c.top_k if prefetch_slots is None else prefetch_slots
        self.prefetch_enabled = prefetch and self.prefetch_slots > 0
        if prefetch_top is not None and not 1 <= prefetch_top <= c.top_k:
            raise MoeshardError(f"prefetch top must be 1..{c.top_k} (the router's top-k)")
        # read by `moe.layers.hint_next_layer`: predict only each token's `prefetch_top`
        # highest-scoring experts of the next layer (None: all top_k)
        self.prefetch_top = prefetch_top
        need = 1 + (self.prefetch_slots if self.prefetch_enabled else 0)
        if slots < need:
            raise MoeshardError(f"expert cache needs at least {need} slots, got {slots}")
        self.n_slots = slots
        self.arena = aligned_buffer(slots * self.slot_bytes)  # uint8 [slots * slot_bytes]
        self.slot_key: list[tuple[int, int] | None] = [None] * slots
        self.slot_future: list = [None] * slots
        self.slot_of: dict[tuple[int, int], int] = {}
        self.score = np.full(slots, FREE)  # [slots] eviction priority, lowest goes first
        self.protect = np.zeros(slots, dtype=bool)  # [slots]
        self.reader = ReaderPool(depth, direct=direct, merge=merge)
        self.stats = StoreStats()
        self.counts: Counter = Counter()  # routed rows per (layer, expert): the profile
        self.tick = 0
        self.decay, self.boost = decay, 1.0
        self.freq: dict[tuple[int, int], float] = {}
        self.pinned: set[tuple[int, int]] = set()
        if policy == "pin":
            if profile is None:
                raise MoeshardError("cache policy 'pin' needs a profile (--profile-in FILE)")
            # leave one layer's worth of LRU slots so a layer's misses are read in parallel
            room = max(slots - need - c.top_k, 0)
            n = room if pin_count is None else min(pin_count, slots - need)
            self.pinned = {k for k, _ in profile.most_common(max(n, 0))}
        self._hint: tuple[int, np.ndarray] | None = None
        self.prefetched: dict[int, list[int]] = {}  # layer -> protected slots predicted for it
        self.fetched: dict[int, set[int]] = {}  # layer -> slots read by its prefetch
        self.predicted: dict[int, set[tuple[int, int]]] = {}
        self.trace: list[tuple[int, tuple[int, ...]]] | None = None  # (layer, experts) if recording
        self.on_layer = None  # called with the layer after each layer call (progress lines)

    # ----------------------------------------------------------------------------------------
    # slots and policy

    def slot_view(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.arena[start : start + self.slot_bytes]  # uint8 [slot_bytes]

    def record(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.arena[start : start + self.record_nbytes]  # uint8 [record_nbytes]

    def _victim(self) -> int | None:
        score = np.where(self.protect, np.inf, self.score)  # [slots]
        slot = int(np.argmin(score))
        if score[slot] == np.inf:
            return None
        return slot

    def _free(self, slot: int) -> None:
        key = self.slot_key[slot]
        future = self.slot_future[slot]
        if future is not None and not future.done():
            t0 = time.perf_counter()
            try:  # a mispredicted read still in flight must land before the slot is reused
                future.result()
            except StoreError as exc:
                log.warning("unused prefetched record failed: %s", exc)
            self.stats.stall_s += time.perf_counter() - t0
            self.stats.evict_waits += 1
        if key is not None:
            del self.slot_of[key]
        self.slot_key[slot] = None
        self.slot_future[slot] = None
        self.score[slot] = FREE
        self.protect[slot] = False

    def _assign(self, slot: int, key: tuple[int, int]) -> ReadRequest:
        self._free(slot)
        self.slot_key[slot] = key
        self.slot_of[key] = slot
        self.protect[slot] = True
        self.score[slot] = self.tick  # provisional; set by _touch when used
        if key not in self.model.locations:
            raise StoreError(f"{self.model.path}: no shard holds expert {key[1]} of layer {key[0]}")
        shard, loc = self.model.locations[key]
        return ReadRequest(loc.path, loc.offset, loc.nbytes, self.slot_view(slot), key, loc.crc32)

    def _touch(self, slot: int, key: tuple[int, int]) -> None:
        self.tick += 1
        if self.policy == "lfu":
            self.freq[key] = self.freq.get(key, 0.0) + self.boost
            self.score[slot] = self.freq[key]
        elif self.policy == "pin" and key in self.pinned:
            self.score[slot] = np.inf
        else:
            self.score[slot] = self.tick

    def _advance_clock(self) -> None:
        if self.policy != "lfu":
            return
        self.boost /= self.decay
        if self.boost > 1e100:  # renormalise: same order, smaller numbers
            for k in self.freq:
                self.freq[k] /= self.boost
            live = self.score != FREE
            self.score[live] /= self.boost
            self.boost = 1.0

    def _submit(self, requests: list[ReadRequest]) -> None:
        if not requests:
            return
        for req, future in zip(requests, self.reader.submit(requests), strict=True):
            self.slot_future[self.slot_of[req.key]] = future

    def _wait(self, slot: int) -> None:
        future = self.slot_future[slot]
        if future is None:
            return
        if not future.done():
            t0 = time.perf_counter()
            try:
                future.result()
            finally:
                self.stats.stall_s += time.perf_counter() - t0
        try:
            future.result()
        except StoreError:
            self._free(slot)
            raise
        self.slot_future[slot] = None

    # ----------------------------------------------------------------------------------------
    # prefetch

    def prefetch(self, layer: int, ids) -> None:
        """Start reading layer `layer`'s predicted experts (issued after the current layer's
        own misses are queued, see the module docstring)."""
        if not self.prefetch_enabled:
            return
        self._hint = (layer, np.asarray(ids).ravel())

    def _issue_prefetch(self) -> None:
        layer, ids = self._hint
        self._hint = None
        self._release_prefetched(layer)
        predicted = {(layer, int(e)) for e in ids}
        self.predicted[layer] = predicted
        slots, requests = [], []
        self.fetched[layer] = set()
        for key in sorted(predicted, key=lambda k: self._offset(k)):
            if key in self.slot_of:
                slot = self.slot_of[key]
            else:
                if len(requests) >= self.prefetch_slots:
                    continue
                slot = self._victim()
                if slot is None:
                    break
                requests.append(self._assign(slot, key))
                self.fetched[layer].add(slot)
            self.protect[slot] = True
            slots.append(slot)
        self.prefetched[layer] = slots
        self._submit(requests)

    def _offset(self, key) -> tuple[str, int]:
        loc = self.model.locations.get(key)
        return (str(loc[1].path), loc[1].offset) if loc else ("", 0)

    def _release_prefetched(self, layer: int) -> None:
        self.fetched.pop(layer, None)
        for slot in self.prefetched.pop(layer, []):
            self.protect[slot] = False
            if self.policy == "none" and self.slot_key[slot] is not None:
                self._free(slot)

    # ----------------------------------------------------------------------------------------
    # the experts backend

    def __call__(
        self, layer: int, hidden: np.ndarray, ids: np.ndarray, weights: np.ndarray, dtype=np.float32
    ) -> np.ndarray:
        t_call = time.perf_counter()
        st = self.stats
        st.calls += 1
        self._advance_clock()
        if self._hint is not None and self._hint[0] == layer:
            self._hint = None  # a hint for the layer that is already running is useless
        needed = np.unique(ids)  # [n] ascending
        keys = [(layer, int(e)) for e in needed]
        if self.trace is not None:
            self.trace.append((layer, tuple(int(e) for e in needed)))
        for e, n in zip(*np.unique(ids, return_counts=True), strict=True):
            self.counts[(layer, int(e))] += int(n)
        predicted = self.predicted.pop(layer, None)
        if predicted is not None:
            st.predicted += len(predicted)
            st.predicted_used += len(predicted.intersection(keys))
            st.used_after_hint += len(keys)
        pf_slots = self.fetched.get(layer, set())
        st.accesses += len(keys)
        for key in keys:
            if key in self.slot_of:
                st.hits += 1
                st.prefetch_hits += self.slot_of[key] in pf_slots
            else:
                st.misses += 1

        partial: dict[tuple[int, int], np.ndarray] = {}
        remaining = keys
        first = True
        while remaining:
            resident = [k for k in remaining if k in self.slot_of]
            for key in resident:
                self.protect[self.slot_of[key]] = True
            requests = []
            for key in remaining:
                if key in self.slot_of:
                    continue
                slot = self._victim()
                if slot is None:
                    break
                requests.append(self._assign(slot, key))
            self._submit(requests)
            if first and self._hint is not None:
                self._issue_prefetch()
            first = False
            ready = [k for k in resident if self.slot_future[self.slot_of[k]] is None]
            wave = ready + [k for k in resident if k not in ready] + [r.key for r in requests]
            if not wave:
                raise StoreError("expert cache has no free slot (internal error: all protected)")
            while wave:  # store order; whatever has landed by then goes along in one call
                self._wait(self.slot_of[wave[0]])
                group = [wave[0]] + [k for k in wave[1:] if self._landed(self.slot_of[k])]
                for key in group[1:]:
                    self._wait(self.slot_of[key])  # does not block: raises a failed read
                self._compute(group, hidden, ids, weights, partial)
                wave = [k for k in wave if k not in partial]
            remaining = [k for k in remaining if k not in partial]
        self._release_prefetched(layer)

        out = np.zeros(hidden.shape, dtype=np.float64)  # [T, H]; exact sum, see run_experts
        for key in keys:
            rows, _ = np.nonzero(ids == key[1])  # [n]
            add_rows(out, rows, partial[key])
        st.call_s += time.perf_counter() - t_call
        if self.on_layer is not None:
            self.on_layer(layer)
        return out.astype(dtype, copy=False)

    def _landed(self, slot: int) -> bool:
        future = self.slot_future[slot]
        return future is None or future.done()

    def _compute(self, group, hidden, ids, weights, partial) -> None:
        """Run the experts of `group` (landed) on their routed rows into `partial`, weighted."""
        t0 = time.perf_counter()
        if self.ffn_b1 is not None and hidden.shape[0] == 1 and len(group) > 1:
            slots = [self.slot_of[key] for key in group]
            x = np.repeat(hidden, len(group), axis=0)  # [m, H]: one decode row per expert
            offsets = np.asarray(slots, dtype=np.int64) * self.slot_bytes  # [m]
            y = self.ffn_b1(self.arena, offsets, self.fmt, self.hidden, self.inter, x)  # [m, H]
            for e, key in enumerate(group):
                col = int(np.flatnonzero(ids[0] == key[1])[0])
                partial[key] = y[e : e + 1] * weights[0, col]  # [1, H]
        else:
            for key in group:
                rows, cols = np.nonzero(ids == key[1])  # [n], [n]
                record = self.record(self.slot_of[key])
                y = self.ffn(record, self.fmt, self.hidden, self.inter, hidden[rows])  # [n, H]
                partial[key] = y * weights[rows, cols][:, None]  # [n, H]
        self.stats.compute_s += time.perf_counter() - t0
        for key in group:
            slot = self.slot_of[key]
            self._touch(slot, key)
            self.protect[slot] = False
            if self.policy == "none":
                self._free(slot)

    def snapshot(self) -> StoreStats:
        """A copy of the stats, with the reader's counters brought up to date."""
        return self.stats.with_reads(self.reader.stats)

    def resident_keys(self) -> set[tuple[int, int]]:
        return set(self.slot_of)

    def close(self) -> None:
        for slot in range(self.n_slots):
            future = self.slot_future[slot]
            if future is not None:
                try:
                    future.result()
                except StoreError:
                    pass
        self.reader.close()
