"""When no live node holds an expert a layer needs: the error that says so, or (`--degrade`)
the routing without it, rescaled to the same total weight."""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np

from moeshard.coordinator.remote.config import UncoveredError

log = logging.getLogger(__name__)


def missing_error(peers, layer: int, experts: list[int]) -> UncoveredError:
    """Which experts of `layer` no live node holds, and who held them."""
    unknown = [p.addr for p in peers if not p.held]
    nobody = f"no node; {len(unknown)} never reached" if unknown else "no node"
    holders = {
        e: [f"{p.addr} (down)" for p in peers if p.holds(layer, e)] or [nobody] for e in experts
    }
    text = "; ".join(
        f"expert {e} of layer {layer} (held by {', '.join(h)})" for e, h in holders.items()
    )
    return UncoveredError(f"no live node holds {text}")


def drop(dropped: dict, layer, ids, weights, experts) -> tuple[np.ndarray, np.ndarray]:
    """--degrade: remove `experts` from the routing, rescale the rest to the same total;
    `dropped` ((layer, expert) -> slots) counts what was dropped."""
    gone = np.isin(ids, experts)  # [T, k]
    if not dropped:  # one warning per run; the counts per layer come at the end
        log.warning("--degrade: dropping experts no live node holds; the output is degraded")
    for expert in experts:
        dropped[(layer, int(expert))] += int((ids == expert).sum())
        log.debug("layer %d: dropped expert %d (no live node holds it)", layer, expert)
    total = weights.sum(axis=1, keepdims=True)  # [T, 1]
    kept = np.where(gone, np.float32(0), weights)  # [T, k]
    kept_sum = kept.sum(axis=1, keepdims=True)  # [T, 1]
    scale = np.divide(total, kept_sum, out=np.zeros_like(total), where=kept_sum > 0)  # [T, 1]
    return np.where(gone, -1, ids), (kept * scale).astype(np.float32)


def dropped_per_layer(dropped: dict) -> dict[int, int]:
    """--degrade: expert slots dropped per layer (token x slot pairs), layers in order."""
    per_layer: dict[int, int] = defaultdict(int)
    for (layer, _), n in dropped.items():
        per_layer[layer] += n
    return dict(sorted(per_layer.items()))
