"""`bench compare-llamacpp`'s bandwidth rows: how much of this machine's DRAM read bandwidth
moeshard's batch-1 products reach, the measure of a decode step on a model bigger than the
caches.  Weights come from pools of copies twice the last-level cache in size, visited in
turn (`moeshard.bench.kernels.POOL_BYTES`), so every call reads from DRAM, as a decode step
of a big model does; the DRAM figure is all numba threads summing a 1 GiB array, in the same
round and interleaved with the products' calls (`SLICES`): on a shared host the DRAM rate
moves within seconds (one run's rounds: 30-46 GB/s), and a round that read it before the
calls compared them with another moment's rate (a round's share then fell to 0.53-0.67 while
the next read 0.9)."""

from __future__ import annotations

import time

import numpy as np

from moeshard.bench.compare_table import Row
from moeshard.bench.kernels import _arena, _parallel_sum
from moeshard.moe.kernels import quant

# the 706 MB test model's shapes: the attention's q and o products (bf16 trunk) and its
# experts (q4_0, hidden 1024, inter 768, four routed per token)
TRUNK_SHAPE = (1024, 1024)
EXPERT_SHAPE = (1024, 768)
EXPERTS_PER_CALL = 4
CALLS = 400  # timed calls per round and row (the median is the round's value)
SLICES = 8  # a round: this many times a DRAM read, then CALLS / SLICES calls of each row
DRAM_BYTES = 1 << 30  # summed by all threads for the DRAM figure (the median of the round's)


class Bandwidth:
    """Two rows whose right-hand column is the DRAM read rate, not llama.cpp."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        rows, cols = TRUNK_SHAPE
        w = rng.standard_normal((rows, cols), dtype=np.float32)  # [rows, cols]
        self.trunk, self.trunk_at = _arena(quant.pack(w, "bf16"))
        n = quant.packed_nbytes("bf16", rows, cols)
        self.trunk_mats = [
            quant.PackedMatrix(self.trunk[o : o + n], "bf16", rows, cols) for o in self.trunk_at
        ]
        self.x = rng.standard_normal((1, cols), dtype=np.float32)  # [1, cols]
        hidden, inter = EXPERT_SHAPE
        gate, up = (rng.standard_normal((inter, hidden), dtype=np.float32) for _ in range(2))
        down = rng.standard_normal((hidden, inter), dtype=np.float32)
        self.experts, self.expert_at = _arena(
            quant.pack_expert(gate, up, down, "q4_0"), min_copies=EXPERTS_PER_CALL
        )
        self.expert_bytes = quant.expert_record_nbytes("q4_0", hidden, inter)
        self.h = rng.standard_normal((1, hidden), dtype=np.float32)  # [1, hidden]
        self.dram: np.ndarray | None = None  # uint64 [DRAM_BYTES / 8], made at the first round
        self.rows = {
            "trunk": Row(
                "bandwidth bf16 trunk",
                f"bf16 {rows}x{cols} product, batch 1, GB/s (right: DRAM read)",
            ),
            "experts": Row(
                "bandwidth q4_0 experts",
                f"{EXPERTS_PER_CALL} q4_0 experts h{hidden} i{inter}, batch 1, GB/s "
                f"(right: DRAM read)",
            ),
        }

    def round(self) -> None:
        if self.dram is None:  # (made and touched once: a fresh GiB costs its page faults)
            self.dram = np.ones(DRAM_BYTES // 8, dtype=np.uint64)
            _parallel_sum(self.dram)
        dram, trunk, experts = [], [], []
        per_slice = CALLS // SLICES
        for s in range(SLICES):
            t0 = time.perf_counter()
            _parallel_sum(self.dram)
            dram.append(DRAM_BYTES / (time.perf_counter() - t0) / 1e9)
            calls = range(s * per_slice, (s + 1) * per_slice)
            trunk += self._trunk_times(calls)
            experts += self._experts_times(calls)
        for row in self.rows.values():
            row.llama.append(float(np.median(dram)))
        nbytes = quant.packed_nbytes("bf16", *TRUNK_SHAPE)
        self.rows["trunk"].moeshard.append(nbytes / float(np.median(trunk)) / 1e9)
        nbytes = EXPERTS_PER_CALL * self.expert_bytes
        self.rows["experts"].moeshard.append(nbytes / float(np.median(experts)) / 1e9)

    def _trunk_times(self, calls: range) -> list[float]:
        times, n = [], len(self.trunk_mats)
        for i in calls:
            m = self.trunk_mats[i % n]
            t0 = time.perf_counter()
            m(self.x)
            times.append(time.perf_counter() - t0)
        return times

    def _experts_times(self, calls: range) -> list[float]:
        hidden, inter = EXPERT_SHAPE
        groups = len(self.expert_at) // EXPERTS_PER_CALL
        w = np.full(EXPERTS_PER_CALL, 1 / EXPERTS_PER_CALL, dtype=np.float32)  # [m]
        times = []
        for i in calls:
            g = i % groups
            offsets = self.expert_at[g * EXPERTS_PER_CALL : (g + 1) * EXPERTS_PER_CALL]
            t0 = time.perf_counter()
            quant.experts_ffn_b1_sum(self.experts, offsets, "q4_0", hidden, inter, self.h, w)
            times.append(time.perf_counter() - t0)
        return times
