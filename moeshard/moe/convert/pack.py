"""`moeshard pack MODEL --trace TRACE [--out NEW]`: lay experts out on disk by co-activation.

Experts that fire for the same token are placed next to each other in the shard file, so the
reader can fetch the experts one token needs with fewer, larger reads (it merges adjacent
records into one read). Per layer, the order is a seriation of the co-activation graph:
a chain that starts at the most used expert and repeatedly appends the unplaced expert most
often co-activated with the one just placed (ties and isolated experts by frequency). Hot
experts end up grouped at the front of their layer, co-firing experts next to each other.

Weights are moved, never changed: every record is copied byte for byte, its checksum checked
on the way, and the model id is unchanged (it names the weights, not their layout).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeshard.moe.analysis.coact import coactivation, frequencies, seriate
from moeshard.moe.convert.outdir import check_output, staged
from moeshard.moe.errors import MoeshardError
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.io import copy_file
from moeshard.moe.storage.manifest import MANIFEST, read_manifest, write_manifest
from moeshard.moe.storage.shards import ShardWriter
from moeshard.moe.storage.traces import Trace

PACKED_SHARD = "experts-packed-00000.gguf"


def layout(trace: Trace, model: ModelDir) -> dict[int, list[int]]:
    """Expert order per MoE layer from a trace of this model."""
    if trace.meta.get("model_id") != model.model_id:
        raise MoeshardError(
            f"trace is of model {str(trace.meta.get('model_id'))[:16]}, "
            f"{model.path} is {model.model_id[:16]}"
        )
    return {
        layer: seriate(coactivation(trace, layer), frequencies(trace, layer))
        for layer in model.config.moe_layers
    }


def pack(model_path: str | Path, trace: Trace, out: str | Path | None = None) -> Path:
    """Write the packed model to `out` (or rewrite `model_path` in place); returns its path."""
    src = Path(model_path)
    if out is not None:  # a new directory: never the model itself, inside it, or around it
        check_output(out, [src], False, "model")
    model = ModelDir(src)
    model.require_experts("pack the full model directory")
    dst = Path(out) if out is not None else src
    try:
        order = layout(trace, model)
        with staged(dst, dst.parent / f".{dst.name}.tmp-pack") as tmp:
            _write_packed(src, model, order, trace, tmp)
    finally:
        model.close()
    return dst


def _write_packed(src: Path, model: ModelDir, order, trace: Trace, dst: Path) -> None:
    """The packed copy of `model` in `dst`: one shard in `order`, the other files as they are."""
    manifest = read_manifest(src)
    c = model.config
    writer = ShardWriter(
        dst / PACKED_SHARD,
        model.expert_format,
        c.expert_hidden,
        c.expert_intermediate,
        c.model_type,
    )
    try:
        keys = [(layer, e) for layer in c.moe_layers for e in order[layer]]
        missing = [k for k in keys if k not in model.locations]
        if missing:
            raise MoeshardError(f"{src}: holds no expert {missing[0][1]} of layer {missing[0][0]}")
        for layer, expert in keys:
            writer.declare(layer, expert, model.locations[(layer, expert)][1].nbytes)
        writer.begin()
        for layer, expert in keys:
            shard, loc = model.locations[(layer, expert)]
            record = shard.read(layer, expert, verify=True)  # checksum checked on the way
            if writer.write(record) != loc.crc32:
                raise MoeshardError(f"expert {expert} of layer {layer} changed while copying")
        writer.finish(model.model_id)
    finally:
        writer.close()
    for f in src.iterdir():
        if f.is_file() and f.name != MANIFEST and f.name not in manifest["expert_files"]:
            copy_file(f, dst / f.name)
    manifest["expert_files"] = [PACKED_SHARD]
    manifest["layout"] = {
        "kind": "coactivation",
        "trace_rows": int(len(trace.layer)),
        "order": {str(k): v for k, v in order.items()},
    }
    write_manifest(dst, manifest)
    ModelDir(dst).close()  # the result opens and validates


def adjacency_gain(trace: Trace, order: dict[int, list[int]]) -> dict[str, float]:
    """Mean number of contiguous runs per (token, layer) in file order vs packed order."""

    def runs(rows_ids: np.ndarray, position: np.ndarray) -> float:
        slots = np.sort(position[rows_ids], axis=1)  # [rows, k]
        return float((1 + (np.diff(slots, axis=1) > 1).sum(axis=1)).mean())

    file_runs, packed_runs = [], []
    for layer, expert_order in order.items():
        ids = trace.ids[trace.layer == layer].astype(np.int64)
        if not len(ids):
            continue
        identity = np.arange(len(expert_order))
        packed = np.empty_like(identity)
        packed[np.asarray(expert_order)] = identity
        file_runs.append(runs(ids, identity))
        packed_runs.append(runs(ids, packed))
    return {
        "reads_per_layer_file_order": float(np.mean(file_runs)),
        "reads_per_layer_packed": float(np.mean(packed_runs)),
    }
