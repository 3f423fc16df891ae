"""Expert-cache policies replayed on a routing trace: hit rates of LRU, LFU and Belady's optimum.

An access is one (layer, expert) record fetch; a trace row (token, layer) fetches its k experts.
The cache holds `capacity` whole expert records. These are the policies of the real cache
(node/expert_store.py) reduced to their decisions, so they can be replayed in milliseconds
on any trace and any cache size, and Belady's offline optimum (evict the record whose next use
is furthest away) gives the bound no online policy can beat.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

from moe.trace import Trace


def accesses(trace: Trace) -> np.ndarray:
    """Record keys in fetch order: int64 [N * k], key = layer * n_experts + expert."""
    keys = trace.layer.astype(np.int64)[:, None] * trace.n_experts + trace.ids.astype(np.int64)
    return keys.reshape(-1)  # [N * k]


def lru_hits(keys: np.ndarray, capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in keys.tolist():
        if key in cache:
            hits += 1
            cache.move_to_end(key)
            continue
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[key] = None
    return hits


def lfu_hits(keys: np.ndarray, capacity: int, decay: float = 0.999) -> int:
    """LFU with exponential decay: a record's score halves every ln(2)/(1-decay) accesses.

    Scores are kept in 'inflated' units (each access adds growth**t instead of decaying every
    score), so one access costs O(capacity) at eviction only.
    """
    growth = 1.0 / decay
    scores: dict[int, float] = {}  # frequency of every record seen (also evicted ones)
    cache: set[int] = set()
    hits, weight = 0, 1.0
    for key in keys.tolist():
        weight *= growth
        if weight > 1e200:  # renormalise before overflow
            scores = {k: v / weight for k, v in scores.items()}
            weight = 1.0
        scores[key] = scores.get(key, 0.0) + weight
        if key in cache:
            hits += 1
            continue
        if len(cache) >= capacity:
            cache.remove(min(cache, key=scores.__getitem__))
        cache.add(key)
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


POLICIES = {"lru": lru_hits, "lfu": lfu_hits, "arc": arc_hits, "belady": belady_hits}


def hit_rates(trace: Trace, capacities: list[int]) -> dict[str, list[float]]:
    """Hit rate of each policy at each cache size (in expert records)."""
    keys = accesses(trace)
    return {
        name: [fn(keys, c) / max(len(keys), 1) for c in capacities] for name, fn in POLICIES.items()
    }
