"""The expert cache's counters (`ExpertStore.snapshot`), and what they mean."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


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
        """A copy, with the reader's counters (`moeshard.moe.storage.io.ReadStats`) brought up to
        date."""
        return replace(self, bytes_read=reads.bytes_read, reads=reads.reads, read_s=reads.read_s)

    def minus(self, other: StoreStats) -> StoreStats:
        return StoreStats(**{k: v - getattr(other, k) for k, v in asdict(self).items()})
