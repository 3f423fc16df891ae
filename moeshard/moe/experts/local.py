"""LocalExperts: routed experts computed in-process, every record kept in RAM once read.

The unbounded backend: `moeshard generate` without `--ram`, and a node without `--ram`.
Records are read whole on first use (one pread per expert, checksum-verified) into one arena
per layer, page-aligned and committed only as records land, so a decode step runs its experts
through the fused batch-1 kernel (`moeshard.moe.experts.compute`) like the budgeted cache does.
"""

from __future__ import annotations

import numpy as np

from moeshard.moe.experts.backend import ExpertsBase, PrefetchHint, ResidentExperts
from moeshard.moe.experts.compute import (
    KERNELS,
    ExpertKernels,
    decode_weighted_sum,
    rows_weighted_sum,
    run_experts,
    weighted_sum,
)
from moeshard.moe.storage.io import align_up, aligned_buffer
from moeshard.moe.storage.shards import ShardSet


class LocalExperts(ExpertsBase):
    def __init__(self, shards: ShardSet, kernels: ExpertKernels = KERNELS):
        self.shards, self.kernels = shards, kernels
        self.slot_bytes = align_up(shards.record_nbytes)
        self.arenas: dict[int, np.ndarray] = {}  # layer -> uint8 [experts held * slot_bytes]
        self.readonly: dict[int, np.ndarray] = {}  # layer -> a read-only view of its arena
        self.slot: dict[tuple[int, int], int] = {}  # (layer, expert) -> its slot in the arena
        self.at: dict[int, dict[int, int]] = {}  # layer -> {expert read: its offset}
        self.tables: dict[int, np.ndarray] = {}  # layer -> int64 [max id + 1]: offset or -1
        self.held: dict[int, ResidentExperts] = {}  # layer -> `resident`'s answer, made once
        self.bytes_read = 0

    def _arena(self, layer: int) -> np.ndarray:
        if layer not in self.arenas:
            held = self.shards.keys_of_layer(layer)
            self.slot.update(((layer, e), i) for i, e in enumerate(held))
            self.arenas[layer] = aligned_buffer(max(len(held), 1) * self.slot_bytes, huge=True)
            view = self.readonly[layer] = self.arenas[layer].view()
            view.flags.writeable = False  # what the kernels take: made once, not per call
            self.tables[layer] = np.full(max(held, default=-1) + 1, -1, dtype=np.int64)
        return self.arenas[layer]

    def offset(self, layer: int, expert: int) -> int:
        """Byte offset of the record in its layer's arena, reading it on first use."""
        arena = self._arena(layer)
        key = (layer, expert)
        if expert not in self.at.get(layer, ()):
            self.shards.location(layer, expert)  # a clear error if no shard holds it
            record = self.shards.read(layer, expert)  # checksum-verified
            start = self.slot[key] * self.slot_bytes
            arena[start : start + record.size] = record
            self.at.setdefault(layer, {})[expert] = start
            self.tables[layer][expert] = start
            self.bytes_read += record.size
        return self.at[layer][expert]

    def _offsets(self, layer: int, experts: list[int]) -> list[int]:
        """The offsets of `experts`' records in the layer's arena (each read on first use),
        looked up in one dict (a call per expert cost a small model's decode layer 2-3 us)."""
        at = self.at.get(layer, {})
        out = [at.get(e, -1) for e in experts]
        if -1 in out:
            out = [self.offset(layer, e) for e in experts]
        return out

    def resident(self, layer: int) -> ResidentExperts | None:
        """Layer `layer`'s arena and offset table, for a decode row's experts computed in the
        same kernel call as its attention (`fused_layer.decode_layers`); records not read yet
        are -1 in the table, and a row routed to one comes back here through `__call__`."""
        held = self.held.get(layer)
        if held is None:
            self._arena(layer)
            s = self.shards
            held = self.held[layer] = ResidentExperts.of(
                self.readonly[layer], self.tables[layer], s.record_format(layer), s.hidden,
                s.inter, s.glu,
            )  # fmt: skip
        return held

    def preload(self) -> None:
        """Read every record held now instead of on first use (what llama.cpp does when it
        loads a model: a benchmark against it then times the same work)."""
        for layer, expert in sorted(self.shards.locations):
            self.offset(layer, expert)

    def __call__(
        self, layer, hidden, ids, weights, dtype=np.float32, hint: PrefetchHint | None = None
    ) -> np.ndarray:
        s = self.shards
        # a decode step: one kernel call, no Python between; several rows (a batched step,
        # a prefill): the experts on their rows in one call, summed in another
        self._arena(layer)
        fmt = s.record_format(layer)
        fused = decode_weighted_sum if hidden.shape[0] == 1 else rows_weighted_sum
        out = fused(
            self.readonly[layer], lambda experts: self._offsets(layer, experts), fmt,
            s.hidden, s.inter, hidden, ids, weights, dtype, self.kernels, s.glu,
        )  # fmt: skip
        if out is not None:
            return out
        offsets = {int(e): self.offset(layer, int(e)) for e in np.unique(ids[ids >= 0])}
        parts = run_experts(
            self.arenas[layer], offsets, fmt, s.hidden, s.inter, hidden, ids, weights,
            self.kernels, s.glu,
        )  # fmt: skip
        return weighted_sum(parts, hidden.shape, dtype)

    def stats(self) -> dict:
        loaded = sum(map(len, self.at.values()))
        return {"expert_bytes_read": self.bytes_read, "records_loaded": loaded}
