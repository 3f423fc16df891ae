"""Expert-cache policies replayed on a routing trace: hit rates of the store's policies, of ARC
and of Belady's optimum.

An access is one (layer, expert) record fetch; a trace row (token, layer) is one layer call
that fetches its k experts. The cache holds `capacity` whole expert records. `ReplayCache` is
the real cache (`moeshard.moe.experts.store`) reduced to its decisions, scored by the same
`moeshard.moe.experts.policy.Scores`, so the store's policies replay in milliseconds on any trace
and cache size with the store's hit rate; ARC (adaptive, not in the store) shows whether a smarter
online policy would help, and Belady's offline optimum (evict the record whose next use is
furthest away) gives the bound no online policy can beat.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

from moeshard.moe.experts.policy import Scores
from moeshard.moe.storage.traces import Trace


def accesses(trace: Trace) -> np.ndarray:
    """Record keys in fetch order: int64 [N * k], key = layer * n_experts + expert."""
    keys = trace.layer.astype(np.int64)[:, None] * trace.n_experts + trace.ids.astype(np.int64)
    return keys.reshape(-1)  # [N * k]


class ReplayCache:
    """`capacity` record slots under a store policy, chosen exactly as the store chooses them:
    free slots first, then the lowest score, ties to the lowest slot; the keys of the current
    layer call are protected (`policy_hits` replays the store's waves when a call needs more
    records than there are slots)."""

    def __init__(self, capacity: int, policy: str, pinned: set | frozenset = frozenset()):
        self.capacity, self.policy = max(capacity, 0), policy
        self.scores = Scores(policy, pinned)
        self.score = np.full(self.capacity, -np.inf)  # [slots], -inf = free
        self.key: list = [None] * self.capacity
        self.slot_of: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self.slot_of

    def begin_call(self) -> None:
        factor = self.scores.advance()
        if factor != 1.0:
            live = self.score != -np.inf
            self.score[live] /= factor

    def insert(self, key: int, protect: set | frozenset = frozenset()) -> bool:
        """Bring `key` in (a miss or a prefetch), evicting the lowest score not protected;
        False when every slot is protected (or the policy keeps nothing)."""
        if key in self.slot_of:
            return True
        if self.policy == "none" or self.capacity == 0:
            return False
        score = self.score.copy()  # [slots]
        for k in protect:
            if k in self.slot_of:
                score[self.slot_of[k]] = np.inf
        slot = int(np.argmin(score))
        if score[slot] == np.inf:
            return False
        if self.key[slot] is not None:
            del self.slot_of[self.key[slot]]
        self.key[slot], self.slot_of[key] = key, slot
        self.score[slot] = self.scores.fresh()
        return True

    def touch(self, key: int) -> None:
        """`key`'s expert ran (a use)."""
        score = self.scores.touch(key)
        if key in self.slot_of:
            self.score[self.slot_of[key]] = score


def calls(trace: Trace) -> list[list[int]]:
    """The trace's layer calls in order, each its distinct record keys (as the store sees)."""
    keys = accesses(trace).reshape(len(trace.layer), -1)  # [N, k]
    return [sorted(set(row)) for row in keys.tolist()]


def policy_hits(calls: list[list[int]], capacity: int, policy: str, pinned=frozenset()) -> int:
    """Hits of a store policy replayed on layer calls (lists of record keys, ascending), with
    the store's decisions: a call's misses take slots in key order while unprotected slots
    remain; what ran is then scored in key order; what found no slot runs in a next wave."""
    cache = ReplayCache(capacity, policy, pinned)
    hits = 0
    for keys in calls:
        cache.begin_call()
        hits += sum(key in cache for key in keys)
        remaining = list(keys)
        while remaining:
            wave = {key for key in remaining if key in cache}
            for key in remaining:
                if key not in cache:
                    if not cache.insert(key, wave):
                        break
                    wave.add(key)
            if not wave:  # no slot at all (capacity 0, or policy none): nothing is kept
                wave = set(remaining)
            for key in sorted(wave):
                cache.touch(key)
            remaining = [key for key in remaining if key not in wave]
    return hits


def belady_hits(keys, capacity: int, count_from: int = 0) -> int:
    """Offline optimum: on a miss with a full cache, evict the record used furthest ahead.

    Hits are counted from access `count_from` on (the accesses before it only warm the cache).
    """
    keys = list(keys.tolist() if isinstance(keys, np.ndarray) else keys)
    n = len(keys)
    next_use = [n] * n  # index of the next access to the same key
    last: dict = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(keys[i], n + i)  # never again: furthest, in order of last use
        last[keys[i]] = i
    cache: dict = {}  # key -> its next use
    heap: list = []  # (-next use, key), stale entries skipped
    hits = 0
    for i, key in enumerate(keys):
        if key in cache:
            hits += i >= count_from
        elif len(cache) >= capacity:
            while True:
                neg_next, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg_next:
                    del cache[victim]
                    break
        cache[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits


def arc_hits(keys: np.ndarray, capacity: int) -> int:
    """ARC (Megiddo and Modha, FAST 2003): a recency list T1 and a frequency list T2 share
    the cache; ghost lists B1, B2 of recently evicted keys move the target size p of T1 toward
    whichever list would have hit. Not used by the store; here to show whether an adaptive
    policy closes the gap to Belady on a trace (`moeshard coact`)."""
    if capacity < 1:
        return 0
    t1: OrderedDict = OrderedDict()
    t2: OrderedDict = OrderedDict()
    b1: OrderedDict = OrderedDict()
    b2: OrderedDict = OrderedDict()
    p, hits = 0.0, 0

    def replace(in_b2: bool) -> None:
        if t1 and (len(t1) > p or (in_b2 and len(t1) == p)):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    for key in keys.tolist():
        if key in t1 or key in t2:
            hits += 1
            (t1 if key in t1 else t2).pop(key)
            t2[key] = None
        elif key in b1:
            p = min(capacity, p + max(len(b2) / len(b1), 1))
            replace(False)
            del b1[key]
            t2[key] = None
        elif key in b2:
            p = max(0.0, p - max(len(b1) / len(b2), 1))
            replace(True)
            del b2[key]
            t2[key] = None
        else:
            if len(t1) + len(b1) == capacity:
                if len(t1) < capacity:
                    b1.popitem(last=False)
                    replace(False)
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= capacity:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * capacity:
                    b2.popitem(last=False)
                replace(False)
            t1[key] = None
    return hits


def hit_rates(trace: Trace, capacities: list[int]) -> dict[str, list[float]]:
    """Hit rate of LRU, LFU (the store's), ARC and Belady at each cache size (records)."""
    keys, by_call = accesses(trace), calls(trace)
    n = max(sum(len(c) for c in by_call), 1)
    flat = np.asarray([k for c in by_call for k in c], dtype=np.int64)  # distinct per call
    return (
        {
            "lru": [policy_hits(by_call, c, "lru") / n for c in capacities],
            "lfu": [policy_hits(by_call, c, "lfu") / n for c in capacities],
            "arc": [arc_hits(flat, c) / n for c in capacities],
            "belady": [belady_hits(flat, c) / n for c in capacities],
        }
        if len(keys)
        else {name: [0.0] * len(capacities) for name in ("lru", "lfu", "arc", "belady")}
    )
