"""The one compute path for a layer's routed experts, and the one combine of partial sums.

Every backend gets a layer's records into a uint8 arena (an in-RAM arena, the cache's slots,
a read buffer) and calls `run_experts`; whatever computed the parts, `combine` adds them.

Exactness: each expert's weighted output is float32 and they are added in float64, where a sum
of a handful of float32 values is exact, and rounded once at the end. So the result does not
depend on the order of the additions, or on how the experts are split between cache waves or
nodes that each return a float64 partial sum for the coordinator to add up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from moeshard.moe.kernels import quant


@dataclass(frozen=True)
class ExpertKernels:
    """The kernels an expert runs on (`bench stream --io-only` swaps in no-ops)."""

    # each also takes the gated unit (`quant.Glu`) last
    # (record uint8 [nbytes], fmt, H, I, x [n, H]) -> [n, H]: one expert on its rows
    one: Callable = quant.expert_ffn
    # (arena, offsets [m], fmt, H, I, x [m, H]) -> [m, H]: m experts on one row each, one call
    batch1: Callable | None = quant.experts_ffn_b1
    # (arena, offsets [m], fmt, H, I, x [1, H], w [m]) -> float64 [H]: their weighted sum
    batch1_sum: Callable | None = quant.experts_ffn_b1_sum
    # (arena, offsets [m], fmt, H, I, x [N, H], starts [m + 1]) -> [N, H]: each on its rows
    rows: Callable | None = quant.experts_ffn_rows


KERNELS = ExpertKernels()


def routed_rows(ids: np.ndarray, expert: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, slots) where `expert` is routed: ids[rows, slots] == expert; rows ascending."""
    return np.nonzero(ids == expert)


def run_experts(
    arena: np.ndarray,
    offsets: dict[int, int],
    fmt: str,
    hidden_size: int,
    inter: int,
    hidden: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    kernels: ExpertKernels = KERNELS,
    glu: quant.Glu = quant.SWIGLU,
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Run every expert in `offsets` (expert -> byte offset of its record in `arena`) on the
    rows routed to it: hidden [T, H], ids/weights [T, k] -> {expert: (rows [n], weighted
    output float32 [n, H])}.

    A decode step (one row) with several experts goes through the fused batch-1 kernel in one
    call (bit-identical to one call per expert, faster); otherwise one kernel call per expert.
    """
    experts = sorted(offsets)
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    nbytes = quant.expert_record_nbytes(fmt, hidden_size, inter)
    if kernels.batch1 is not None and hidden.shape[0] == 1 and len(experts) > 1:
        x = np.repeat(hidden, len(experts), axis=0)  # [m, H]: the decode row once per expert
        starts = np.asarray([offsets[e] for e in experts], dtype=np.int64)  # [m]
        y = kernels.batch1(arena, starts, fmt, hidden_size, inter, x, glu)  # [m, H]
        for i, e in enumerate(experts):
            rows, slots = routed_rows(ids, e)  # [1], [1]
            out[e] = (rows, y[i : i + 1] * weights[rows, slots][:, None])  # [1, H]
        return out
    routed = [routed_rows(ids, e) for e in experts]  # ([n], [n]) per expert
    if kernels.rows is not None and len(experts) > 1:  # several rows: one call for them all
        starts = np.cumsum([0] + [len(rows) for rows, _ in routed])  # [m + 1]
        x = hidden[np.concatenate([rows for rows, _ in routed])]  # [N, H]: expert by expert
        at = np.asarray([offsets[e] for e in experts], dtype=np.int64)  # [m]
        y = kernels.rows(arena, at, fmt, hidden_size, inter, x, starts, glu)  # [N, H]
        for i, (e, (rows, slots)) in enumerate(zip(experts, routed, strict=True)):
            part = y[starts[i] : starts[i + 1]]  # [n, H]
            out[e] = (rows, part * weights[rows, slots][:, None])  # [n, H]
        return out
    for e, (rows, slots) in zip(experts, routed, strict=True):
        record = arena[offsets[e] : offsets[e] + nbytes]  # uint8 [nbytes]
        y = kernels.one(record, fmt, hidden_size, inter, hidden[rows], glu)  # [n, H]
        out[e] = (rows, y * weights[rows, slots][:, None])  # [n, H]
    return out


def decode_weighted_sum(
    arena: np.ndarray,
    offsets_of: Callable[[list[int]], list[int]],
    fmt: str,
    hidden_size: int,
    inter: int,
    hidden: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    dtype,
    kernels: ExpertKernels = KERNELS,
    glu: quant.Glu = quant.SWIGLU,
) -> np.ndarray | None:
    """`weighted_sum(run_experts(...))` of one decode row in one kernel call, the same bits:
    hidden [1, H], ids/weights [1, k] -> [1, H] of `dtype`; `offsets_of(experts)` gives their
    records' offsets in `arena`.  None where it does not apply (several rows, an expert
    routed twice, no such kernel): use the general path then."""
    if hidden.shape[0] != 1 or kernels.batch1_sum is None:
        return None
    # k is a handful: Python lists beat a dozen small numpy calls here (a small model's
    # decode layer spent longer in them than in its experts)
    slots = zip(ids[0].tolist(), weights[0].tolist(), strict=True)
    pairs = sorted((e, w) for e, w in slots if e >= 0)
    experts = [e for e, _ in pairs]  # ascending, as `combine` adds them
    if len(experts) < 2 or len(set(experts)) < len(experts):
        return None
    starts = offsets_of(experts)  # [m]
    w = [v for _, v in pairs]  # [m], exact in float32: they were float32
    total = kernels.batch1_sum(arena, starts, fmt, hidden_size, inter, hidden, w, glu)  # [H]
    return total.astype(dtype, copy=False)[None]  # [1, H]


def rows_weighted_sum(
    arena: np.ndarray,
    offsets_of: Callable[[list[int]], list[int]],
    fmt: str,
    hidden_size: int,
    inter: int,
    hidden: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    dtype,
    kernels: ExpertKernels = KERNELS,
    glu: quant.Glu = quant.SWIGLU,
) -> np.ndarray | None:
    """`weighted_sum(run_experts(...))` of several rows (a batched decode step, a prefill)
    in two kernel calls, the same bits: hidden [T, H], ids/weights [T, k] -> [T, H];
    `offsets_of(experts)` gives their records' offsets in `arena`.

    The (row, slot) pairs are sorted by expert (rows ascending within one), every expert
    runs on its rows in one call (`kernels.rows`), and the weighted outputs are added into
    float64 in that order: each row's terms in ascending expert order, as `combine` adds
    them.  None where it does not apply (no such kernel): use the general path then."""
    if kernels.rows is None:
        return None
    # experts [m], starts [m + 1], rows [P], x [P, H] (each expert's rows together), w [P]
    experts, starts, rows, x, w = quant.group_by_expert(ids, weights, hidden)
    at = np.array(offsets_of(experts.tolist()), dtype=np.int64)  # [m]
    y = kernels.rows(arena, at, fmt, hidden_size, inter, x, starts, glu)  # [P, H]
    out = np.zeros((ids.shape[0], hidden_size), dtype=np.float64)  # [T, H]
    quant.accumulate_rows(out, rows, y, w)
    return out.astype(dtype, copy=False)


def combine(
    shape: tuple[int, int], parts: Iterable[tuple[np.ndarray, np.ndarray]], dtype=np.float32
) -> np.ndarray:
    """Sum partial outputs (rows [n], values [n, H]) into [T, H] in float64, rounded once to
    `dtype`. Give the parts in a fixed order (ascending expert) for a reproducible result."""
    out = np.zeros(shape, dtype=np.float64)  # [T, H]
    for rows, values in parts:
        add_rows(out, rows, values)
    return out.astype(dtype, copy=False)


def add_rows(out: np.ndarray, rows: np.ndarray, terms: np.ndarray) -> None:
    """out[rows] += terms, adding twice where a row repeats (as np.add.at does).

    rows come from np.nonzero(ids == expert), so they are sorted and repeat only if a row
    routed the same expert twice (top-k never does). Without repeats plain fancy-index += is
    the same sum, and ~20x faster than np.add.at (95 against 4 us per [1, 2048] decode row
    here: np.add.at took ~6 ms of a 45 ms k3-mini token)."""
    if rows.size < 2 or bool((rows[1:] != rows[:-1]).all()):
        out[rows] += terms
    else:
        np.add.at(out, rows, terms)


def weighted_sum(parts: dict[int, tuple[np.ndarray, np.ndarray]], shape, dtype) -> np.ndarray:
    """`combine` of `run_experts`' output in ascending expert order."""
    return combine(shape, (parts[e] for e in sorted(parts)), dtype)


def partial_sum(
    compute: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
    hidden: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
) -> np.ndarray:
    """What a node computes for one Forward call, before encoding its reply: hidden [T, H],
    ids/weights [T, k] (-1: an empty slot) -> float64 [T, H], the rows that name no expert
    left 0 and the others `compute(hidden[live], ids[live], weights[live])` (float64).

    One definition for the node and for whoever recomputes its reply (the coordinator's
    audits, `moeshard ledger check-fraud`), so the two agree bit for bit. Empty rows are left
    out rather than given some expert: an expert's kernel call must see exactly the rows
    routed to it (a row's bits never depend on its batch, but a row that is not there must
    not be computed either)."""
    live = (ids >= 0).any(axis=1)  # [T]
    out = np.zeros(hidden.shape, dtype=np.float64)  # [T, H]
    if live.any():
        out[live] = compute(hidden[live], ids[live], weights[live])  # [n, H]
    return out


Waves = Callable[[list[int]], Iterable[tuple[np.ndarray, dict[int, int]]]]


def recompute_partial_sum(
    waves: Waves,
    fmt: str,
    hidden_size: int,
    inter: int,
    glu: quant.Glu,
    hidden: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
) -> np.ndarray:
    """`partial_sum` of a node's call computed from the expert records themselves, a few at a
    time: `waves(experts)` yields (arena, {expert: byte offset}) groups that together hold
    every expert routed (ascending ids in, each exactly once out), so the records need not all
    be in memory at once.  Every expert runs on exactly its routed rows (`run_experts`) and the
    weighted outputs are added in ascending expert order (`weighted_sum`): the same bits as
    any backend gives for the same call (`LocalExperts`' fused kernels, the cache's waves)."""

    def compute(h, i, w):  # [n, H], [n, k], [n, k] -> float64 [n, H]
        parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for arena, offsets in waves(sorted(set(i[i >= 0].tolist()))):
            parts.update(run_experts(arena, offsets, fmt, hidden_size, inter, h, i, w, glu=glu))
        return weighted_sum(parts, h.shape, np.float64)

    return partial_sum(compute, hidden, ids, weights)
