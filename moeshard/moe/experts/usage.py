"""Expert usage counts: how often each (layer, expert) was routed. One reader for every source.

Sources: a routing trace (.npz, `generate --trace`), a usage profile (JSON written by
`write_profile`, from `generate --ram ... --profile-out`: {"model_id": ..., "counts": [[layer,
expert, n], ...]}), or a plain JSON object {"layer:expert": n, ...}. Used by the `pin` cache
policy and by `moeshard shard --trace` to balance nodes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np

from moeshard.moe.errors import MoeshardError
from moeshard.moe.storage import traces


def write_profile(path: str | Path, model_id: str, counts: Counter) -> None:
    """Per-(layer, expert) routed-row counts as JSON (temporary name, then rename)."""
    path = Path(path)
    rows = [[layer, expert, n] for (layer, expert), n in sorted(counts.items())]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"model_id": model_id, "counts": rows}) + "\n")
    os.replace(tmp, path)


def read_usage(path: str | Path, model_id: str | None = None) -> Counter:
    """(layer, expert) -> count from any source (see the module docstring). Refuses a trace or
    profile written for another model, and anything malformed, naming the file."""
    path = Path(path)
    if path.suffix == ".npz":
        trace = traces.load(path)
        found = trace.meta.get("model_id")
        keys = np.stack(
            [np.repeat(trace.layer.astype(np.int64), trace.ids.shape[1]), trace.ids.reshape(-1)],
            axis=1,
        )  # [N * k, 2]
        unique, counts = np.unique(keys, axis=0, return_counts=True)
        usage = Counter(
            {(int(a), int(b)): int(n) for (a, b), n in zip(unique, counts, strict=True)}
        )
    else:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise MoeshardError(f"{path}: not a moeshard trace or usage profile ({exc})") from None
        if isinstance(data, dict) and "counts" in data:
            found = data.get("model_id")
            usage = _profile_counts(path, data["counts"])
        elif isinstance(data, dict):
            found = model_id  # a plain object names no model
            usage = _plain_counts(path, data)
        else:
            raise MoeshardError(f"{path}: not a moeshard trace or usage profile")
    if model_id is not None and found != model_id:
        raise MoeshardError(f"{path}: written for another model (id {str(found)[:16]})")
    return usage


def _profile_counts(path: Path, rows) -> Counter:
    try:
        return Counter({(int(a), int(b)): int(n) for a, b, n in rows})
    except (ValueError, TypeError) as exc:
        raise MoeshardError(f"{path}: malformed usage profile ({exc})") from None


def _plain_counts(path: Path, raw: dict) -> Counter:
    counts: Counter = Counter()
    for name, count in raw.items():
        try:
            layer, expert = (int(x) for x in str(name).split(":"))
            value = float(count)
        except (ValueError, TypeError):
            raise MoeshardError(f"{path}: bad usage entry {name!r}: {count!r}") from None
        if value < 0 or not np.isfinite(value):
            raise MoeshardError(f"{path}: bad count for {name}: {count!r}")
        counts[(layer, expert)] = value
    return counts
