"""Routing traces: every routing decision of a generation run, in a compact columnar file.

Format (``moeshard-trace/1``): a NumPy ``.npz`` archive (zip, deflate-compressed) holding one
row per (token, MoE layer):

    position  int32  [N]     token position in its sequence (0 = first prompt token)
    layer     int16  [N]     layer index
    phase     uint8  [N]     0 = prefill (prompt), 1 = decode (generated)
    run       uint16 [N]     which run the row came from (traces of several runs can be merged)
    ids       int16  [N, k]  the routed expert ids, highest weight first
    weights   float16[N, k]  their routing weights (after normalisation / scaling)
    meta      a JSON string: format, model id, model type, n_experts, top_k, moe_layers, runs

Why this format: analysis wants whole columns as arrays (frequencies, co-activation, reuse
distances are numpy one-liners over them), `np.load` reads it with no extra dependency, and
rows are small (9 + 4k bytes before compression: 73 bytes per token and layer for k = 16).
Rows are in the order the decisions were made, which is the order a cache sees the accesses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe.errors import MoeshardError

FORMAT = "moeshard-trace/1"
PREFILL, DECODE = 0, 1


@dataclass
class Trace:
    position: np.ndarray  # int32 [N]
    layer: np.ndarray  # int16 [N]
    phase: np.ndarray  # uint8 [N]
    run: np.ndarray  # uint16 [N]
    ids: np.ndarray  # int16 [N, k]
    weights: np.ndarray  # float16 [N, k]
    meta: dict = field(default_factory=dict)

    @property
    def n_experts(self) -> int:
        return int(self.meta["n_experts"])

    @property
    def moe_layers(self) -> list[int]:
        return list(self.meta["moe_layers"])

    def tokens(self) -> list[tuple[int, int]]:
        """(run, position) of every token, in order of first appearance."""
        keys = np.stack([self.run.astype(np.int64), self.position.astype(np.int64)], axis=1)
        _, first = np.unique(keys, axis=0, return_index=True)
        return [tuple(map(int, keys[i])) for i in sorted(first)]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(
            tmp,
            position=self.position,
            layer=self.layer,
            phase=self.phase,
            run=self.run,
            ids=self.ids,
            weights=self.weights,
            meta=np.array(json.dumps(self.meta)),
        )
        os.replace(tmp, path)


def load(path: str | Path) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != FORMAT:
                raise MoeshardError(f"{path}: not a {FORMAT} trace (format {meta.get('format')})")
            return Trace(
                z["position"], z["layer"], z["phase"], z["run"], z["ids"], z["weights"], meta
            )
    except (OSError, KeyError, ValueError) as exc:
        raise MoeshardError(f"{path}: unreadable trace ({exc})") from None


def merge(traces: list[Trace]) -> Trace:
    """One trace from several runs of the same model; run numbers are renumbered in order."""
    if not traces:
        raise MoeshardError("no traces to merge")
    first = traces[0].meta
    for t in traces[1:]:
        if t.meta.get("model_id") != first.get("model_id"):
            raise MoeshardError("cannot merge traces of different models (model ids differ)")
    runs, offset = [], 0
    for t in traces:
        runs.append(t.run.astype(np.int64) + offset)
        offset += int(t.run.max()) + 1 if len(t.run) else 0
    meta = dict(first, runs=offset)
    return Trace(
        np.concatenate([t.position for t in traces]),
        np.concatenate([t.layer for t in traces]),
        np.concatenate([t.phase for t in traces]),
        np.concatenate(runs).astype(np.uint16),
        np.concatenate([t.ids for t in traces]),
        np.concatenate([t.weights for t in traces]),
        meta,
    )
