"""TraceRecorder: an experts backend that records every routing decision passing through it.

It wraps the real backend (`generate --trace`); the generation loop calls `mark(position,
phase)` before each forward pass (its `on_forward` hook), and each MoE layer's call then
records one row per token of that pass. The rows become a `moeshard.moe.storage.traces.Trace`.
"""

from __future__ import annotations

import numpy as np

from moeshard.moe.experts.backend import ExpertsBackend, PrefetchHint
from moeshard.moe.storage.traces import FORMAT, PREFILL, Trace


class TraceRecorder:
    def __init__(self, inner: ExpertsBackend, meta: dict):
        self.inner = inner
        self.meta = dict(meta, format=FORMAT, runs=1)
        self.position, self.phase = 0, PREFILL
        self.rows: list[tuple] = []
        self.hints: dict[tuple[int, int], np.ndarray] = {}  # (position, layer) -> ids [k]
        self.hinted: list[np.ndarray | None] = []  # per row: what a hint predicted for it

    def mark(self, position: int, phase: int) -> None:
        self.position, self.phase = position, phase

    def __call__(
        self, layer, hidden, ids, weights, dtype=np.float32, hint: PrefetchHint | None = None
    ) -> np.ndarray:
        order = np.argsort(-weights, axis=-1, kind="stable")  # [T, k] highest weight first
        ids_sorted = np.take_along_axis(ids, order, axis=-1)  # [T, k]
        weights_sorted = np.take_along_axis(weights, order, axis=-1)  # [T, k]
        for t in range(ids.shape[0]):
            self.rows.append(
                (self.position + t, layer, self.phase, ids_sorted[t], weights_sorted[t])
            )
            self.hinted.append(self.hints.pop((self.position + t, layer), None))
        if hint is not None:  # the next layer's rows will say what was predicted for them
            for t, row in enumerate(np.asarray(hint.predicted)):
                self.hints[(self.position + t, hint.layer)] = row
        return self.inner(layer, hidden, ids, weights, dtype, hint)

    def prefetch(self, layer: int, predicted: np.ndarray) -> None:
        self.inner.prefetch(layer, predicted)

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def trace(self, end: int | None = None) -> Trace:
        """The rows recorded so far; with `end`, only positions below it (a generation stopped
        early keeps the passes whose tokens it kept, not the pass it was cut off in)."""
        keep = [i for i, r in enumerate(self.rows) if end is None or r[0] < end]
        rows = [self.rows[i] for i in keep]
        k = int(self.meta["top_k"])
        n = len(rows)
        hinted = None
        if any(self.hinted[i] is not None for i in keep):  # a backend that takes hints
            hinted = np.full((n, k), -1, np.int16)  # [N, k]
            for j, i in enumerate(keep):
                if self.hinted[i] is not None:
                    row = self.hinted[i][:k]
                    hinted[j, : len(row)] = row
        return Trace(
            np.array([r[0] for r in rows], np.int32),
            np.array([r[1] for r in rows], np.int16),
            np.array([r[2] for r in rows], np.uint8),
            np.zeros(n, np.uint16),
            np.array([r[3] for r in rows], np.int16).reshape(n, k),
            np.array([r[4] for r in rows], np.float16).reshape(n, k),
            self.meta,
            hinted,
        )
