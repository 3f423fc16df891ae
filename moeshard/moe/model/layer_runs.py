"""Runs of decode layers that `fused_layer.decode_layers` takes in one kernel call: consecutive
layers with a fused plan and their routed experts resident, as a numba typed list of
`layer_entry`s, with the KV caches of the sequence being decoded in typed lists of their own.

Typing an entry costs numba about 0.2 ms, so the entries are made again only when a layer's
handles or a backend's arena change (`LayerRuns.of` compares them by identity each token);
the caches' lists are made for each new sequence (64 us for 8 layers)."""

from __future__ import annotations

from typing import NamedTuple

import numba
from numba.typed import List

from moeshard.moe.model.fused_layer import layer_entry


class Run(NamedTuple):
    """Consecutive layers `base`, `base` + 1, ... of one call."""

    entries: List  # their `layer_entry`s, one numba type
    base: int  # the first one's layer number
    layers: list  # their `_Layer`s (each has a fused plan)
    helds: list  # their `ResidentExperts`
    kcs: List  # the decoded sequence's KV cache keys, one array a layer
    vcs: List  # ... and values


class LayerRuns:
    """Layer -> its `Run`, for the layers of a model and the sequence being decoded."""

    def __init__(self):
        self._key: tuple | None = None  # the layers and experts `_static` was made of
        self._static: list[tuple] = []  # (entries, base, layers, helds) of each run
        self._cache = None  # the KV cache whose lists `_by_layer` holds
        self._by_layer: dict[int, Run] = {}

    def of(self, layers: tuple, helds: tuple, cache) -> dict[int, Run]:
        """The runs of `layers` (`_Layer`s, each with `.fused` or not) whose resident experts
        are `helds` (None where a layer's are not, or it has no fused plan), with `cache`'s
        (k[i], v[i] per layer i) arrays."""
        key = layers + helds
        if self._key is None or not all(a is b for a, b in zip(self._key, key, strict=True)):
            self._key, self._static = key, _static_runs(layers, helds)
            self._cache = None
        if self._cache is not cache:  # another sequence: its caches' lists
            self._by_layer = {}
            for entries, base, run_layers, run_helds in self._static:
                span = range(base, base + len(run_layers))
                kcs, vcs = List([cache.k[i] for i in span]), List([cache.v[i] for i in span])
                run = Run(entries, base, run_layers, run_helds, kcs, vcs)
                self._by_layer.update((i, run) for i in span)
            self._cache = cache
        return self._by_layer

    def forget_cache(self) -> None:
        """Let go of the last sequence's KV cache (its lists keep it alive)."""
        self._cache, self._by_layer = None, {}


def _static_runs(layers: tuple, helds: tuple) -> list[tuple]:
    """(typed list of entries, first layer, `_Layer`s, `ResidentExperts`) of each run: the
    layers with resident experts, split where the numba type of their entry changes (a layer
    in other formats)."""
    runs: list[tuple] = []
    group: list[tuple[int, tuple]] = []  # (layer, its entry) of the run being gathered
    kind = None  # their numba type
    for i in range(len(layers) + 1):
        entry = None
        if i < len(layers) and helds[i] is not None:
            ly = layers[i]
            entry = layer_entry(
                helds[i], ly.input_norm, ly.post_norm, ly.fused, ly.q_norm, ly.k_norm, ly.window
            )
        this = numba.typeof(entry) if entry is not None else None
        if group and (entry is None or this != kind):  # the group so far is a run
            span = [j for j, _ in group]
            entries = List([e for _, e in group])
            runs.append((entries, span[0], [layers[j] for j in span], [helds[j] for j in span]))
            group = []
        if entry is not None:
            group.append((i, entry))
            kind = this
    return runs
