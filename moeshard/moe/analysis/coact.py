"""`moeshard coact TRACE --out DIR`: what the router's decisions say about caching and layout.

Writes coact.json (for tools), PNG plots (for people) and prints a short summary:
  * per layer: activation frequency of every expert and its skew (share of activations that
    go to the top 1% / 10% of experts; entropy relative to uniform, 1 = perfectly balanced);
  * within-token co-activation: how often experts i and j of one layer fire for one token;
  * cross-layer transitions: expert i at layer L -> expert j at the next MoE layer, same token;
  * reuse distance: tokens until the same (layer, expert) fires again;
  * hit rates of LRU, LFU and the offline optimum (Belady) at a range of cache sizes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from moeshard.moe.analysis.cachesim import hit_rates
from moeshard.moe.storage.traces import Trace

log = logging.getLogger(__name__)


def frequencies(trace: Trace, layer: int) -> np.ndarray:
    """Activations per expert of one layer: int64 [E]."""
    ids = trace.ids[trace.layer == layer]  # [n, k]
    return np.bincount(ids.reshape(-1).astype(np.int64), minlength=trace.n_experts)


def skew(freq: np.ndarray) -> dict[str, float]:
    total = max(int(freq.sum()), 1)
    ordered = np.sort(freq)[::-1]  # [E]
    top = {
        f"top{p}pct_share": float(ordered[: max(1, round(len(freq) * p / 100))].sum() / total)
        for p in (1, 10)
    }
    probs = freq[freq > 0] / total
    entropy = float(-(probs * np.log(probs)).sum() / np.log(len(freq))) if len(freq) > 1 else 1.0
    return {**top, "entropy_vs_uniform": entropy}


def coactivation(trace: Trace, layer: int) -> np.ndarray:
    """Tokens in which experts i and j (i != j) of `layer` both fire: int64 [E, E]."""
    n = trace.n_experts
    ids = trace.ids[trace.layer == layer].astype(np.int64)  # [rows, k]
    onehot = np.zeros((len(ids), n), dtype=np.int64)  # [rows, E]
    np.put_along_axis(onehot, ids, 1, axis=1)
    matrix = onehot.T @ onehot  # [E, E]
    np.fill_diagonal(matrix, 0)
    return matrix


def transitions(trace: Trace, layer: int, next_layer: int) -> np.ndarray:
    """Same-token transitions from `layer`'s experts to `next_layer`'s: int64 [E, E]."""
    n = trace.n_experts
    key = trace.run.astype(np.int64) << 32 | trace.position.astype(np.int64)  # [N]
    src, dst = trace.layer == layer, trace.layer == next_layer
    common, i_src, i_dst = np.intersect1d(key[src], key[dst], return_indices=True)
    a = trace.ids[src][i_src].astype(np.int64)  # [tokens, k]
    b = trace.ids[dst][i_dst].astype(np.int64)  # [tokens, k]
    matrix = np.zeros((n, n), dtype=np.int64)
    for x in range(a.shape[1]):
        for y in range(b.shape[1]):
            np.add.at(matrix, (a[:, x], b[:, y]), 1)
    return matrix


def seriate(coact: np.ndarray, freq: np.ndarray) -> list[int]:
    """Order of experts: greedy nearest-neighbour chain on co-activation, hottest first."""
    n = len(freq)
    placed = np.zeros(n, dtype=bool)
    order = [int(np.argmax(freq))]
    placed[order[0]] = True
    for _ in range(n - 1):
        last = order[-1]
        # co-activation with the last placed expert first, frequency breaks ties
        score = coact[last].astype(np.float64) * (freq.max() + 1) + freq
        score[placed] = -1
        nxt = int(np.argmax(score))
        order.append(nxt)
        placed[nxt] = True
    return order


def reuse_distances(trace: Trace) -> np.ndarray:
    """For every activation after the first of its (layer, expert): tokens since its last one."""
    key = trace.run.astype(np.int64) << 32 | trace.position.astype(np.int64)
    _, token_index = np.unique(key, return_inverse=True)  # dense token number per row
    token_index = token_index.reshape(-1)
    last: dict[tuple[int, int], int] = {}
    out = []
    for row in np.argsort(token_index, kind="stable"):
        t, layer = int(token_index[row]), int(trace.layer[row])
        for expert in trace.ids[row].tolist():
            k = (layer, expert)
            if k in last:
                out.append(t - last[k])
            last[k] = t
    return np.asarray(out, dtype=np.int64)


def cache_sizes(trace: Trace) -> list[int]:
    """Cache sizes (records) from one layer's worth of active experts to half the model."""
    records = trace.n_experts * len(trace.moe_layers)
    k = trace.ids.shape[1]
    sizes = sorted({max(k, int(records * f)) for f in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)})
    return [s for s in sizes if s < records]


def analyse(trace: Trace, sizes: list[int] | None = None) -> dict:
    layers = trace.moe_layers
    per_layer = {}
    for layer in layers:
        freq = frequencies(trace, layer)
        per_layer[str(layer)] = {"frequency": freq.tolist(), **skew(freq)}
    pairs = list(zip(layers[:-1], layers[1:], strict=True))
    reuse = reuse_distances(trace)
    sizes = cache_sizes(trace) if sizes is None else sorted(set(sizes))
    return {
        "meta": trace.meta,
        "rows": int(len(trace.layer)),
        "tokens": len(trace.tokens()),
        "layers": per_layer,
        "coactivation": {str(layer): coactivation(trace, layer).tolist() for layer in layers},
        "transitions": {f"{a}->{b}": transitions(trace, a, b).tolist() for a, b in pairs},
        "reuse_distance": {
            "histogram": np.bincount(reuse).tolist() if len(reuse) else [],
            "median": float(np.median(reuse)) if len(reuse) else None,
        },
        "cache": {"sizes": sizes, "hit_rate": hit_rates(trace, sizes)},
    }


def summary(result: dict) -> str:
    lines = [
        f"{result['tokens']} tokens, {result['rows']} routing decisions, "
        f"{result['meta']['n_experts']} experts x {len(result['layers'])} MoE layers, "
        f"top-{result['meta']['top_k']}"
    ]
    for layer, s in result["layers"].items():
        lines.append(
            f"  layer {layer:>3}: top 1% of experts get {s['top1pct_share']:6.1%}, "
            f"top 10% get {s['top10pct_share']:6.1%}; entropy {s['entropy_vs_uniform']:.3f} "
            f"of uniform"
        )
    median = result["reuse_distance"]["median"]
    lines.append(f"  reuse distance: median {median} tokens")
    cache = result["cache"]
    lines.append(
        "  hit rate at cache size (records):  " + "  ".join(f"{s:>6}" for s in cache["sizes"])
    )
    for policy, rates in cache["hit_rate"].items():
        lines.append(f"  {policy:>32}:  " + "  ".join(f"{r:6.1%}" for r in rates))
    best = cache["hit_rate"].get("belady")
    if best:  # what a policy reads, relative to the least any policy could
        lines.append("  misses relative to Belady's:")
        for policy, rates in cache["hit_rate"].items():
            if policy != "belady":
                ratios = [
                    (1 - r) / (1 - b) if b < 1 else float("nan")
                    for r, b in zip(rates, best, strict=True)
                ]
                lines.append(f"  {policy:>32}:  " + "  ".join(f"{x:5.2f}x" for x in ratios))
    return "\n".join(lines)


def plot(result: dict, out: Path) -> list[Path]:
    """PNG heatmaps and curves; needs matplotlib (pip install 'moeshard[plots]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG plots (pip install 'moeshard[plots]')")
        return []
    written = []

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    layers = list(result["layers"])
    freq = np.array([result["layers"][layer]["frequency"] for layer in layers])  # [L, E]
    fig, ax = plt.subplots(figsize=(10, 1 + 0.4 * len(layers)))
    im = ax.imshow(freq, aspect="auto", cmap="viridis")
    ax.set(xlabel="expert", ylabel="MoE layer", title="activation frequency")
    ax.set_yticks(range(len(layers)), layers)
    fig.colorbar(im, ax=ax)
    save(fig, "frequency.png")

    for name, matrices, title in (
        ("coactivation", result["coactivation"], "within-token co-activation, layer {}"),
        ("transitions", result["transitions"], "transitions {}"),
    ):
        for key, matrix in list(matrices.items())[:4]:
            fig, ax = plt.subplots(figsize=(5.5, 5))
            im = ax.imshow(np.array(matrix), cmap="magma")
            ax.set(title=title.format(key), xlabel="expert", ylabel="expert")
            fig.colorbar(im, ax=ax)
            save(fig, f"{name}-{key.replace('->', '_to_')}.png")

    hist = np.array(result["reuse_distance"]["histogram"])
    if hist.size:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(np.arange(len(hist)), np.cumsum(hist) / hist.sum())
        ax.set(
            xscale="symlog",
            xlabel="reuse distance (tokens)",
            ylabel="cumulative share",
            title="reuse distance",
        )
        save(fig, "reuse_distance.png")

    cache = result["cache"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, rates in cache["hit_rate"].items():
        ax.plot(cache["sizes"], rates, marker="o", label=policy)
    ax.set(xlabel="cache size (expert records)", ylabel="hit rate", title="cache policies")
    ax.legend()
    save(fig, "hit_rate.png")
    return written


def run(trace: Trace, out: Path, sizes: list[int] | None = None) -> tuple[dict, list[Path]]:
    out.mkdir(parents=True, exist_ok=True)
    result = analyse(trace, sizes)
    tmp = out / "coact.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / "coact.json")
    return result, plot(result, out)
