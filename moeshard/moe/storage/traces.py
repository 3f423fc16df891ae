"""Routing traces: every routing decision of a generation run, in a compact columnar file.

Format (``moeshard-trace/1``): a NumPy ``.npz`` archive (zip, deflate-compressed) holding one
row per (token, MoE layer):

    position  int32  [N]     token position in its sequence (0 = first prompt token)
    layer     int16  [N]     layer index
    phase     uint8  [N]     0 = prefill (prompt), 1 = decode (generated)
    run       uint16 [N]     which run the row came from (traces of several runs can be merged)
    ids       int16  [N, k]  the routed expert ids, highest weight first
    weights   float16[N, k]  their routing weights (after normalisation / scaling)
    hinted    int16  [N, k]  optional: the ids the previous MoE layer's prefetch hint predicted
                             for this row, best first (-1 where no hint was sent)
    meta      a JSON string: format, model id, model type, n_experts, top_k, moe_layers, runs

Why this format: analysis wants whole columns as arrays (frequencies, co-activation, reuse
distances are numpy one-liners over them), `np.load` reads it with no extra dependency, and
rows are small (9 + 4k bytes before compression: 73 bytes per token and layer for k = 16).
Rows are in the order the decisions were made, which is the order a cache sees the accesses.
"""

from __future__ import annotations

import contextlib
import json
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeshard.moe.errors import MoeshardError
from moeshard.moe.storage.io import check_output_file

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
    hinted: np.ndarray | None = None  # int16 [N, k], -1 where no hint predicted the row

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
        """Write the trace to a temporary name beside `path`, then rename it over `path` (a
        failed write never leaves half a trace). A path that cannot be written (a directory, a
        missing or non-directory parent, no permission, a full disk) is a MoeshardError."""
        path = Path(path)
        check_output_file(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        try:
            np.savez_compressed(
                tmp,
                position=self.position,
                layer=self.layer,
                phase=self.phase,
                run=self.run,
                ids=self.ids,
                weights=self.weights,
                meta=np.array(json.dumps(self.meta)),
                **({} if self.hinted is None else {"hinted": self.hinted}),
            )
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise MoeshardError(f"{path}: cannot write the trace ({_reason(exc)})") from None


ZIP_MAGIC = b"PK\x03\x04"  # an .npz archive is a zip file
ARRAYS = ("position", "layer", "phase", "run", "ids", "weights")


def load(path: str | Path) -> Trace:
    """Read a trace written by `Trace.save`; anything else (a missing, empty, foreign, cut or
    corrupted file) is a one-line MoeshardError naming the file."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError as exc:
        raise MoeshardError(f"{path}: unreadable trace ({_reason(exc)})") from None
    if not head:
        raise MoeshardError(f"{path}: not a trace file (it is empty)")
    if head != ZIP_MAGIC:
        raise MoeshardError(f"{path}: not a trace file (not a {FORMAT} .npz archive)")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z.files:
                raise MoeshardError(f"{path}: not a trace file (no trace metadata in the archive)")
            meta = json.loads(str(z["meta"][()]))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                found = meta.get("format") if isinstance(meta, dict) else None
                raise MoeshardError(f"{path}: not a {FORMAT} trace (format {found!r})")
            missing = [name for name in ARRAYS if name not in z.files]
            if missing:
                raise MoeshardError(f"{path}: corrupted trace file (no {', '.join(missing)})")
            hinted = z["hinted"] if "hinted" in z.files else None
            trace = Trace(*(z[name] for name in ARRAYS), meta, hinted)
    except MoeshardError:
        raise
    except zipfile.BadZipFile as exc:
        if str(exc) == "File is not a zip file":  # no zip directory at the end: cut short
            raise MoeshardError(f"{path}: truncated or corrupted trace file") from None
        raise MoeshardError(f"{path}: corrupted trace file ({_reason(exc)})") from None
    except (OSError, EOFError, zlib.error, RuntimeError, NotImplementedError) as exc:
        raise MoeshardError(f"{path}: corrupted trace file ({_reason(exc)})") from None
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise MoeshardError(f"{path}: corrupted trace file ({_reason(exc)})") from None
    _check_shapes(path, trace)
    return trace


def _check_shapes(path: str | Path, t: Trace) -> None:
    """The columns must describe the same rows: [N] each, ids and weights [N, k]; and the
    metadata the analyses read must be there."""
    n = t.position.shape[0] if t.position.ndim == 1 else -1
    columns = (t.position, t.layer, t.phase, t.run)
    ok = n >= 0 and all(c.ndim == 1 and c.shape[0] == n for c in columns)
    ok = ok and t.ids.ndim == 2 and t.ids.shape[0] == n and t.weights.shape == t.ids.shape
    ok = ok and all(np.issubdtype(c.dtype, np.integer) for c in (*columns, t.ids))
    if t.hinted is not None:
        ok = ok and t.hinted.shape == t.ids.shape and np.issubdtype(t.hinted.dtype, np.integer)
    if not ok:
        raise MoeshardError(f"{path}: corrupted trace file (columns of different lengths)")
    try:
        n_experts, layers = int(t.meta["n_experts"]), [int(x) for x in t.meta["moe_layers"]]
    except (KeyError, TypeError, ValueError):
        raise MoeshardError(f"{path}: corrupted trace file (bad n_experts or moe_layers)") from None
    if n_experts < 1 or (n and not layers):
        raise MoeshardError(f"{path}: corrupted trace file (bad n_experts or moe_layers)")
    if n and (t.ids.min() < 0 or t.ids.max() >= n_experts):
        raise MoeshardError(f"{path}: corrupted trace file (expert ids out of range)")
    if n and t.hinted is not None and (t.hinted.min() < -1 or t.hinted.max() >= n_experts):
        raise MoeshardError(f"{path}: corrupted trace file (hinted expert ids out of range)")


def _reason(exc: BaseException) -> str:
    """An exception's message on one line (an OSError's without its errno and file name)."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())


def merge(traces: list[Trace]) -> Trace:
    """One trace from several runs of the same model; run numbers are renumbered in order."""
    if not traces:
        raise MoeshardError("no traces to merge")
    first = traces[0].meta
    for t in traces[1:]:
        if t.meta.get("model_id") != first.get("model_id"):
            raise MoeshardError("cannot merge traces of different models (model ids differ)")
        same_k = t.ids.shape[1:] == traces[0].ids.shape[1:]
        if not same_k or t.meta.get("n_experts") != first.get("n_experts"):
            raise MoeshardError("cannot merge traces of different shapes (top-k or experts differ)")
    runs, offset = [], 0
    for t in traces:
        runs.append(t.run.astype(np.int64) + offset)
        offset += int(t.run.max()) + 1 if len(t.run) else 0
    meta = dict(first, runs=offset)
    hinted = [t.hinted for t in traces]
    return Trace(
        np.concatenate([t.position for t in traces]),
        np.concatenate([t.layer for t in traces]),
        np.concatenate([t.phase for t in traces]),
        np.concatenate(runs).astype(np.uint16),
        np.concatenate([t.ids for t in traces]),
        np.concatenate([t.weights for t in traces]),
        meta,
        None if any(h is None for h in hinted) else np.concatenate(hinted),
    )
