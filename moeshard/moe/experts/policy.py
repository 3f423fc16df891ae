"""Expert-cache policies: the one definition of how cached records are scored for eviction.

The store (`moeshard.moe.experts.store`) and every replay of a routing trace
(`moeshard.moe.analysis.cachesim`,
`moeshard.moe.analysis.simulate`) use these scores, so a replay's hit rate is the store's.

  lru   score = the clock at the record's last use
  lfu   score = uses with exponential decay: x DECAY at every layer call (a record used once
        per token in every layer keeps its score; one unused for ln 2 / (1 - DECAY) ~ 69
        layer calls halves). Decay is done by growing the increment instead of shrinking all
        scores; when the increment gets huge every score is divided down (`advance` says by
        how much, so a holder of scores can rescale its copies)
  pin   the `pin_count` most used records of a profile never leave once loaded; the rest LRU
  none  no reuse: a record is dropped as soon as its expert has run
The lowest score is evicted first.
"""

from __future__ import annotations

from collections import Counter

POLICIES = ("lru", "lfu", "pin", "none")
DECAY = 0.99  # LFU decay per layer call
PINNED = float("inf")


class Scores:
    """Eviction scores under one policy. Call `advance` once per layer call and `touch` for
    every record a layer uses; compare `touch`'s return values (lowest goes first)."""

    def __init__(self, policy: str, pinned: set | frozenset = frozenset(), decay: float = DECAY):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose one of {POLICIES}")
        self.policy, self.decay = policy, decay
        self.pinned = set(pinned) if policy == "pin" else set()
        self.tick = 0
        self.boost = 1.0  # LFU: the current value of one use
        self.freq: dict = {}  # LFU: decayed use count of every record seen (evicted ones too)

    def advance(self) -> float:
        """A layer call begins. Returns the factor every held LFU score must be divided by
        (1.0 unless the scores were just renormalised)."""
        if self.policy != "lfu":
            return 1.0
        self.boost /= self.decay
        if self.boost <= 1e100:
            return 1.0
        factor = self.boost
        for key in self.freq:  # same order, smaller numbers
            self.freq[key] /= factor
        self.boost = 1.0
        return factor

    def touch(self, key) -> float:
        """Record a use of `key`; returns its new score."""
        self.tick += 1
        if self.policy == "lfu":
            self.freq[key] = self.freq.get(key, 0.0) + self.boost
            return self.freq[key]
        if key in self.pinned:
            return PINNED
        return float(self.tick)

    def fresh(self) -> float:
        """The score of a record just read, before its first use."""
        return float(self.tick)


def pin_count(slots: int, top_k: int, prefetch_slots: int) -> int:
    """How many records `pin` keeps: all slots but a layer's worth of LRU slots (top_k), the
    prefetch slots and one, so one layer's misses are still read in parallel."""
    return max(slots - 1 - prefetch_slots - top_k, 0)


def pinned_keys(profile: Counter, count: int) -> set:
    """The `count` most used records of a usage profile."""
    return {key for key, _ in profile.most_common(max(count, 0))}
