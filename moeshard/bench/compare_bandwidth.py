"""`bench compare-llamacpp`'s bandwidth rows: how much of this machine's DRAM read bandwidth
moeshard's batch-1 products reach, the measure of a decode step on a model bigger than the
caches.  Weights come from pools of copies twice the last-level cache in size, visited in
turn (`moeshard.bench.kernels.POOL_BYTES`), so every call reads from DRAM, as a decode step
of a big model does; the DRAM figure is all numba threads summing a 1 GiB array, measured in
the same round."""

from __future__ import annotations

import time

import numpy as np

from moeshard.bench.compare_table import Row
from moeshard.bench.kernels import _arena, dram_read_gbs_threads
from moeshard.moe.kernels import quant

# the 706 MB test model's shapes: the attention's q and o products (bf16 trunk) and its
# experts (q4_0, hidden 1024, inter 768, four routed per token)
TRUNK_SHAPE = (1024, 1024)
EXPERT_SHAPE = (1024, 768)
EXPERTS_PER_CALL = 4
CALLS = 400  # timed calls per round and row (the median is the round's value)


class Bandwidth:
    """Two rows whose right-hand column is the DRAM read rate, not llama.cpp."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        rows, cols = TRUNK_SHAPE
        w = rng.standard_normal((rows, cols), dtype=np.float32)  # [rows, cols]
        self.trunk, self.trunk_at = _arena(quant.pack(w, "bf16"))
        self.trunk_mats = [
            quant.PackedMatrix(self.trunk[o : o + rows * cols * 2], "bf16", rows, cols)
            for o in self.trunk_at
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
        dram = dram_read_gbs_threads(1.0, 5)
        for row in self.rows.values():
            row.llama.append(dram)
        self.rows["trunk"].moeshard.append(self._trunk_gbs())
        self.rows["experts"].moeshard.append(self._experts_gbs())

    def _trunk_gbs(self) -> float:
        times, n = [], len(self.trunk_mats)
        for i in range(CALLS):
            m = self.trunk_mats[i % n]
            t0 = time.perf_counter()
            m(self.x)
            times.append(time.perf_counter() - t0)
        nbytes = TRUNK_SHAPE[0] * TRUNK_SHAPE[1] * 2
        return nbytes / float(np.median(times)) / 1e9

    def _experts_gbs(self) -> float:
        hidden, inter = EXPERT_SHAPE
        groups = len(self.expert_at) // EXPERTS_PER_CALL
        w = np.full(EXPERTS_PER_CALL, 1 / EXPERTS_PER_CALL, dtype=np.float32)  # [m]
        times = []
        for i in range(CALLS):
            g = i % groups
            offsets = self.expert_at[g * EXPERTS_PER_CALL : (g + 1) * EXPERTS_PER_CALL]
            t0 = time.perf_counter()
            quant.experts_ffn_b1_sum(self.experts, offsets, "q4_0", hidden, inter, self.h, w)
            times.append(time.perf_counter() - t0)
        return EXPERTS_PER_CALL * self.expert_bytes / float(np.median(times)) / 1e9
