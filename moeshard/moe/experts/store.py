"""ExpertStore: the expert cache under a RAM budget (single-node `--ram` and `node --ram`).

Records live in whole-expert slots of ONE preallocated, page-aligned arena (no allocation per
token); misses are read with O_DIRECT by `moeshard.moe.storage.io.ReaderPool` straight into their
slots, coalesced and several in flight. Eviction picks the slot with the lowest score under the
policy (`moeshard.moe.experts.policy`: lru, lfu, pin, none). Slots that hold experts the current
layer still needs, and prefetched experts of a layer about to run, are protected (never victims).

Prefetch: `prefetch(layer, predicted)` starts the reads at once (a node's Prefetch RPC); a
`hint` given with a layer call starts them once that layer's own misses are queued, so
predicted reads never delay or evict the current layer's experts (the in-process forward
pass). Either way at most `prefetch_slots` records are read per prediction.

Results are bit-identical to `LocalExperts` whatever the policy or cache size: the experts run
through the one compute path (`moeshard.moe.experts.compute`) on exactly the rows routed to them,
and the partial sums are combined in ascending expert order.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from moeshard.moe.errors import MoeshardError, StoreError
from moeshard.moe.experts.backend import ExpertsBase, PrefetchHint
from moeshard.moe.experts.compute import KERNELS, ExpertKernels, run_experts, weighted_sum
from moeshard.moe.experts.policy import DECAY, Scores, pin_count, pinned_keys
from moeshard.moe.experts.store_stats import StoreStats
from moeshard.moe.storage.io import ReaderPool, ReadRequest, align_up, aligned_buffer
from moeshard.moe.storage.shards import ShardSet

log = logging.getLogger(__name__)

FREE = -np.inf
Key = tuple[int, int]


class ExpertStore(ExpertsBase):
    """Routed experts of a shard set under a fixed number of cache slots."""

    def __init__(
        self,
        shards: ShardSet,
        slots: int,
        top_k: int,
        policy: str = "lru",
        prefetch: bool = True,
        prefetch_slots: int | None = None,
        prefetch_top: int | None = None,  # prefetch only each token's N best predictions
        depth: int = 4,  # O_DIRECT reads in flight
        profile: Counter | None = None,  # usage counts for `pin`
        pin: int | None = None,  # records `pin` keeps (default `policy.pin_count`)
        decay: float = DECAY,
        merge: bool = True,  # coalesce adjacent records into one read
        direct: bool = True,  # O_DIRECT (False: buffered, for tests on tmpfs-like files)
        kernels: ExpertKernels = KERNELS,
        record_accesses: bool = False,  # keep (layer, experts) of every call in `accesses`
        on_layer: Callable[[int], None] | None = None,  # called after each layer call
    ):
        self.shards, self.kernels, self.on_layer = shards, kernels, on_layer
        self.fmt, self.hidden, self.inter = shards.fmt, shards.hidden, shards.inter
        self.glu = shards.glu
        self.record_nbytes = shards.record_nbytes
        self.slot_bytes = align_up(self.record_nbytes)
        self.prefetch_slots = top_k if prefetch_slots is None else prefetch_slots
        self.prefetch_enabled = prefetch and self.prefetch_slots > 0
        if prefetch_top is not None and not 1 <= prefetch_top <= top_k:
            raise MoeshardError(f"prefetch top must be 1..{top_k} (the router's top-k)")
        self.prefetch_top = prefetch_top
        need = 1 + (self.prefetch_slots if self.prefetch_enabled else 0)
        if slots < need:
            raise MoeshardError(f"expert cache needs at least {need} slots, got {slots}")
        pinned: set = set()
        if policy == "pin":
            if profile is None:
                raise MoeshardError("cache policy 'pin' needs a profile (--profile-in FILE)")
            room = pin_count(slots, top_k, self.prefetch_slots if self.prefetch_enabled else 0)
            pinned = pinned_keys(profile, room if pin is None else min(pin, slots - need))
        try:
            self.scores = Scores(policy, pinned, decay)
        except ValueError as exc:
            raise MoeshardError(str(exc)) from None
        self.policy, self.n_slots = policy, slots
        self.arena = aligned_buffer(slots * self.slot_bytes)  # uint8 [slots * slot_bytes]
        self.slot_key: list[Key | None] = [None] * slots
        self.slot_future: list = [None] * slots
        self.slot_of: dict[Key, int] = {}
        self.score = np.full(slots, FREE)  # [slots] eviction priority, lowest goes first
        self.protect = np.zeros(slots, dtype=bool)  # [slots]
        self.reader = ReaderPool(depth, direct=direct, merge=merge)
        self.stats_ = StoreStats()
        self.counts: Counter = Counter()  # routed rows per (layer, expert): the profile
        self.prefetched: dict[int, list[int]] = {}  # layer -> protected slots predicted for it
        self.fetched: dict[int, set[int]] = {}  # layer -> slots read by its prefetch
        self.predicted: dict[int, set[Key]] = {}
        self.accesses: list[tuple[int, tuple[int, ...]]] | None = [] if record_accesses else None

    # -- slots --------------------------------------------------------------------------------

    def record(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.arena[start : start + self.record_nbytes]  # uint8 [record_nbytes]

    def _victim(self) -> int | None:
        score = np.where(self.protect, np.inf, self.score)  # [slots]
        slot = int(np.argmin(score))
        return None if score[slot] == np.inf else slot

    def _free(self, slot: int) -> None:
        key, future = self.slot_key[slot], self.slot_future[slot]
        if future is not None and not future.done():
            t0 = time.perf_counter()
            try:  # a mispredicted read still in flight must land before the slot is reused
                future.result()
            except StoreError as exc:
                log.warning("unused prefetched record failed: %s", exc)
            self.stats_.stall_s += time.perf_counter() - t0
            self.stats_.evict_waits += 1
        if key is not None:
            del self.slot_of[key]
        self.slot_key[slot] = self.slot_future[slot] = None
        self.score[slot] = FREE
        self.protect[slot] = False

    def _assign(self, slot: int, key: Key) -> ReadRequest:
        loc = self.shards.location(*key)  # a clear error if no shard holds it
        self._free(slot)
        self.slot_key[slot] = key
        self.slot_of[key] = slot
        self.protect[slot] = True
        self.score[slot] = self.scores.fresh()  # provisional; set by the first use
        start = slot * self.slot_bytes
        dest = self.arena[start : start + self.slot_bytes]  # uint8 [slot_bytes]
        return ReadRequest(loc.path, loc.offset, loc.nbytes, dest, key, loc.crc32)

    def _submit(self, requests: list[ReadRequest]) -> None:
        if requests:
            for req, future in zip(requests, self.reader.submit(requests), strict=True):
                self.slot_future[self.slot_of[req.key]] = future

    def _landed(self, slot: int) -> bool:
        future = self.slot_future[slot]
        return future is None or future.done()

    def _wait(self, slot: int) -> None:
        future = self.slot_future[slot]
        if future is None:
            return
        t0 = time.perf_counter()
        try:
            future.result()
        except StoreError:
            self._free(slot)
            raise
        finally:
            self.stats_.stall_s += time.perf_counter() - t0
        self.slot_future[slot] = None

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, layer: int, predicted) -> None:
        """Start reading `layer`'s predicted experts now ([T, k] best first, or [n] ids)."""
        if not self.prefetch_enabled:
            return
        predicted = np.asarray(predicted)
        if predicted.ndim == 2:
            predicted = predicted[:, : self.prefetch_top]  # each token's best N
        self._release_prefetched(layer)
        wanted = {(layer, int(e)) for e in np.unique(predicted)}
        self.predicted[layer] = wanted
        slots, requests = [], []
        self.fetched[layer] = set()
        for key in sorted(wanted, key=self._file_order):
            if key in self.slot_of:
                slot = self.slot_of[key]
            elif key not in self.shards.locations or len(requests) >= self.prefetch_slots:
                continue
            else:
                slot = self._victim()
                if slot is None:
                    break
                requests.append(self._assign(slot, key))
                self.fetched[layer].add(slot)
            self.protect[slot] = True
            slots.append(slot)
        self.prefetched[layer] = slots
        self._submit(requests)

    def _file_order(self, key: Key) -> tuple[str, int]:
        found = self.shards.locations.get(key)
        return (str(found[1].path), found[1].offset) if found else ("", 0)

    def _release_prefetched(self, layer: int) -> None:
        self.fetched.pop(layer, None)
        for slot in self.prefetched.pop(layer, []):
            self.protect[slot] = False
            if self.policy == "none" and self.slot_key[slot] is not None:
                self._free(slot)

    # -- the experts backend ------------------------------------------------------------------

    def __call__(
        self, layer, hidden, ids, weights, dtype=np.float32, hint: PrefetchHint | None = None
    ) -> np.ndarray:
        t_call = time.perf_counter()
        factor = self.scores.advance()
        if factor != 1.0:
            live = self.score != FREE
            self.score[live] /= factor
        keys = self._account(layer, ids)
        partial: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        remaining, first = keys, True
        while remaining:
            resident = [k for k in remaining if k in self.slot_of]
            for key in resident:
                self.protect[self.slot_of[key]] = True
            requests = []
            for key in remaining:
                if key not in self.slot_of:
                    slot = self._victim()
                    if slot is None:
                        break
                    requests.append(self._assign(slot, key))
            self._submit(requests)
            if first and hint is not None:
                self.prefetch(hint.layer, hint.predicted)  # behind this layer's own reads
            first = False
            ready = [k for k in resident if self.slot_future[self.slot_of[k]] is None]
            wave = ready + [k for k in resident if k not in ready] + [r.key for r in requests]
            if not wave:
                raise StoreError("expert cache has no free slot (internal error: all protected)")
            todo = wave
            while todo:  # store order; whatever has landed by then goes along in one call
                self._wait(self.slot_of[todo[0]])
                group = [todo[0]] + [k for k in todo[1:] if self._landed(self.slot_of[k])]
                for key in group[1:]:
                    self._wait(self.slot_of[key])  # does not block: raises a failed read
                self._compute(group, hidden, ids, weights, partial)
                todo = [k for k in todo if k[1] not in partial]
            self._used(wave)
            remaining = [k for k in remaining if k[1] not in partial]
        self._release_prefetched(layer)
        out = weighted_sum(partial, hidden.shape, dtype)  # [T, H]
        self.stats_.call_s += time.perf_counter() - t_call
        if self.on_layer is not None:
            self.on_layer(layer)
        return out

    def _account(self, layer: int, ids: np.ndarray) -> list[Key]:
        """The layer's distinct experts (ascending) as keys; hit, miss and prediction counts."""
        st = self.stats_
        st.calls += 1
        experts, rows = np.unique(ids[ids >= 0], return_counts=True)  # [n] ascending, [n]
        keys = [(layer, int(e)) for e in experts]
        if self.accesses is not None:
            self.accesses.append((layer, tuple(int(e) for e in experts)))
        for (_, e), n in zip(keys, rows, strict=True):
            self.counts[(layer, e)] += int(n)
        predicted = self.predicted.pop(layer, None)
        if predicted is not None:
            st.predicted += len(predicted)
            st.predicted_used += len(predicted.intersection(keys))
            st.used_after_hint += len(keys)
        prefetched = self.fetched.get(layer, set())
        st.accesses += len(keys)
        for key in keys:
            if key in self.slot_of:
                st.hits += 1
                st.prefetch_hits += self.slot_of[key] in prefetched
            else:
                st.misses += 1
        return keys

    def _compute(self, group: list[Key], hidden, ids, weights, partial) -> None:
        """Run the landed experts of `group` on their routed rows into `partial`."""
        t0 = time.perf_counter()
        layer = group[0][0]  # (a group is one layer's experts)
        offsets = {e: self.slot_of[(layer, e)] * self.slot_bytes for _, e in group}
        partial.update(
            run_experts(
                self.arena,
                offsets,
                self.shards.record_format(layer),
                self.hidden,
                self.inter,
                hidden,
                ids,
                weights,
                self.kernels,
                self.glu,
            )
        )
        self.stats_.compute_s += time.perf_counter() - t0

    def _used(self, wave: list[Key]) -> None:
        """A wave of experts has run: score the uses in key order (not in the order the reads
        happened to land, so the cache's decisions do not depend on I/O timing, and a replay
        of the routing makes the same ones) and let the slots go."""
        for key in sorted(wave):
            slot = self.slot_of[key]
            self.score[slot] = self.scores.touch(key)
            self.protect[slot] = False
            if self.policy == "none":
                self._free(slot)

    # -- reporting ----------------------------------------------------------------------------

    def snapshot(self) -> StoreStats:
        """A copy of the counters, with the reader's brought up to date."""
        return self.stats_.with_reads(self.reader.stats)

    def stats(self) -> dict:
        d = self.snapshot().as_dict()
        d["expert_bytes_read"] = d["bytes_read"]
        return d

    def resident_keys(self) -> set[Key]:
        return set(self.slot_of)

    def close(self) -> None:
        for future in self.slot_future:
            if future is not None:
                try:
                    future.result()
                except StoreError:
                    pass
        self.reader.close()
