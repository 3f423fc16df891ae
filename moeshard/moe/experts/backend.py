"""The one experts interface: where a MoE layer's routed experts run.

Every backend (in-RAM `LocalExperts`, the budgeted cache `ExpertStore`, the node network's
`RemoteExperts`, the `TraceRecorder` wrapper) implements `ExpertsBackend`; the model's forward
pass and the node servicer call nothing else. `ExpertsBase` is the no-op base for the optional
parts (a backend without prefetch, stats or resources to free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moeshard.moe.kernels import quant


@dataclass(frozen=True)
class PrefetchHint:
    """The experts the next MoE layer's router is predicted to pick (its router applied to the
    current hidden state): `predicted` [T, k] expert ids, each row highest score first."""

    layer: int
    predicted: np.ndarray  # [T, k]


@dataclass(frozen=True)
class ResidentExperts:
    """A layer's records held in one arena, as a kernel call takes them: `table[e]` is expert
    e's byte offset in `arena`, -1 while it is not there (the table is the backend's own, so
    it sees records as they land), and the rest the expert kernels' constants."""

    arena: np.ndarray  # uint8 [bytes], read-only
    table: np.ndarray  # int64 [max expert id + 1]
    kernel_args: tuple  # `quant.experts_args` (code, record bytes, layout, glu), and inter
    weights_per_expert: int  # hidden x inter: what decides the thread count

    @staticmethod
    def of(arena, table, fmt: str, hidden: int, inter: int, glu) -> ResidentExperts:
        kernel_args = (*quant.experts_args(fmt, hidden, inter, glu), inter)
        return ResidentExperts(arena, table, kernel_args, hidden * inter)


class ExpertsBackend(Protocol):
    def __call__(
        self,
        layer: int,
        hidden: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray,
        dtype=np.float32,
        hint: PrefetchHint | None = None,
    ) -> np.ndarray:
        """sum_k weights[t, k] * expert_{ids[t, k]}(hidden[t]): hidden [T, H], ids/weights
        [T, k] -> [T, H] in `dtype` (float64 returns the unrounded sum, for partial sums that
        are added up elsewhere). An id of -1 is an empty slot: skipped (a node gets only the
        slots it holds). `hint`: once this layer's own reads are under way, start
        fetching the next layer's predicted experts."""
        ...

    def prefetch(self, layer: int, predicted: np.ndarray) -> None:
        """Start fetching these experts of `layer` now (predicted: [T, k] or [n] ids)."""
        ...

    def resident(self, layer: int) -> ResidentExperts | None:
        """Optional (`ExpertsBase` gives None): the layer's in-RAM records, for a decode row
        whose experts run in the same kernel call as its attention. A backend that must see
        every call (a recorder, a cache that counts hits) gives None."""
        ...

    def stats(self) -> dict:
        """Counters since start (JSON-able; keys depend on the backend)."""
        ...

    def close(self) -> None:
        """Release threads, files and connections."""
        ...


class ExpertsBase:
    """No-op `prefetch`, empty `stats`, nothing to `close`: subclasses override what they have."""

    def prefetch(self, layer: int, predicted: np.ndarray) -> None:
        return None

    def resident(self, layer: int) -> ResidentExperts | None:
        return None

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        return None
