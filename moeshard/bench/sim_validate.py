"""`moeshard simulate --validate MODEL --ram SIZE`: the simulator against a real run, side by side.

Runs a real single-node streaming generation (ExpertStore, O_DIRECT reads) while recording its
routing trace, measures this disk through the same reader before and after the run, then
replays the trace (prompt included, so the cache starts decoding as warm as the real one)
through `moeshard.moe.simulate` with the run's own cache size and policy. The simulator is given the
run's measured compute (non-expert time per layer, kernel time per expert: calibrated, not
predicted); the cache hit rate, the bytes read, the I/O stall and so the s/token are predicted
from the trace and the disk model alone.

The disk is replayed twice. First as measured in windows between the runs: that is the
simulator as a user would run it, but on a shared disk that drifts by tens of percent from
one second to the next the windows miss the disk the run itself met. Second as the run saw it
(`moeshard.moe.io.busy_throughput`: bytes over the time the run had reads in flight), which leaves
only the simulator's own model (cache, timeline, overlap) to be tested.
"""

from __future__ import annotations

import os
import statistics
import time

from moeshard.bench.disk import reader_gbps
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_streaming
from moeshard.moe.analysis import simulate
from moeshard.moe.analysis.disk import Disk
from moeshard.moe.experts.recorder import TraceRecorder
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.io import busy_throughput

DEPTH = 4  # reads in flight, in the real run and its replay


def measure_disk(model, record_bytes: int, seconds: float = 0.25, seed: int = 0) -> Disk:
    """Random reads over the model's own records through the expert cache's reader
    (`moeshard.moe.io.ReaderPool`: O_DIRECT, checksums verified), GB/s at depths 1, 2, 4, 8, for the
    record size and for 4 records at a time (merged adjacent reads). The reader, not the bare
    device, is what the real run waits on, so its per-read cost belongs in the disk model."""
    records = [(loc.path, loc.offset, loc.nbytes, loc.crc32) for _, loc in model.locations.values()]
    ends = {p: os.path.getsize(p) for p, *_ in records}
    points = []
    merged = 4 * record_bytes  # any 4 records in a row that end inside their file
    runs = [(p, off) for p, off, *_ in records if off + merged <= ends[p]]
    for size, targets in ((record_bytes, records), (merged, runs)):
        if not targets:  # no file holds 4 records: the model uses the record size alone
            continue
        for depth in (1, 2, 4, 8):
            points.append([size, depth, reader_gbps(targets, size, depth, seconds, seed)])
    return Disk(points)


def median_disk(disks: list[Disk]) -> Disk:
    """Point by point median of several measurements of the same (size, depth) grid."""
    points = [
        [size, depth, statistics.median(d.points[i][2] for d in disks)]
        for i, (size, depth, _) in enumerate(disks[0].points)
    ]
    return Disk(points)


def run_once(model_path, ram: int, policy: str, prefetch: bool, tokens: int, prompt: list[int]):
    """One real budgeted generation: (measured figures, routing trace)."""
    rt = open_streaming(
        model_path,
        ram,
        len(prompt) + tokens,
        policy=policy,
        prefetch=prefetch,
        depth=DEPTH,
        prefill_tokens=len(prompt),
    )
    store, c = rt.store, rt.config
    meta = {
        "model_id": rt.model.model_id,
        "n_experts": c.n_experts,
        "top_k": c.top_k,
        "moe_layers": list(c.moe_layers),
        "model_type": c.model_type,
    }
    recorder = TraceRecorder(store, meta)
    rt.transformer.experts = recorder
    store.reader.record_timeline()
    marks = []  # (stats, clock) when the first token is out: decode starts
    result = generate(
        rt.transformer,
        prompt,
        SamplingOptions(max_tokens=tokens),
        lambda _t: marks.append((store.snapshot(), time.perf_counter())) if not marks else None,
        recorder.mark,
    )
    (start, t_decode), end = marks[0], store.snapshot()
    busy = busy_throughput(store.reader.timeline, t_decode, time.perf_counter())
    n = len(result.decode_s)
    measured = {
        "mean_s_per_token": sum(result.decode_s) / n,
        "hit_rate": (end.hits - start.hits) / max(end.accesses - start.accesses, 1),
        "gb_per_token": (end.bytes_read - start.bytes_read) / n / 1e9,
        "stall_s_per_token": (end.stall_s - start.stall_s) / n,
        "compute_s_per_token": (end.compute_s - start.compute_s) / n,
        "uses_per_token": (end.accesses - start.accesses) / n,
        "recall": end.recall,
        "capacity": rt.plan.expert_slots - rt.plan.prefetch_slots,
        "disk_busy_share": busy.share,
        "disk_busy_gbps": busy.gbps,
        "disk_in_flight": busy.in_flight,
        "disk_reads": busy.reads,
    }
    trace = recorder.trace()
    rt.close()
    return measured, trace


def validate(
    model_path,
    ram: int,
    policy: str,
    prefetch: bool,
    tokens: int,
    prompt: list[int],
    repeat: int = 3,
):
    """`repeat` real runs, each between two disk measurements (disk, run, disk, run, ..., disk).
    Each run is replayed twice with its own non-I/O time per layer: with the mean of the disk
    windows on either side of it, and with that disk curve scaled to what the run itself saw
    at its queue depth (`moeshard.moe.io.busy_throughput`). Returns (runs, predictions, predictions
    with the disk as seen in the run, median disk); `report` prints medians over the runs."""
    model = ModelDir(model_path)
    model.require_experts("--validate runs the model here: use the full model directory")
    geometry = simulate.geometry_of(str(model_path))
    disks = [measure_disk(model, geometry.record_bytes, seed=0)]
    runs, predictions, seen = [], [], []
    layers = len(model.config.moe_layers)
    for _ in range(repeat):
        measured, trace = run_once(model_path, ram, policy, prefetch, tokens, prompt)
        disks.append(measure_disk(model, geometry.record_bytes, seed=len(disks)))
        windows = median_disk(disks[-2:])
        in_run = windows  # a run that read nothing while decoding saw no disk
        if measured["disk_reads"]:  # the whole curve, scaled to match at the run's read size
            in_run = windows.scaled(
                measured["disk_busy_gbps"] / windows.gbps(geometry.record_bytes, DEPTH)
            )
        measured["disk_window_gbps"] = windows.gbps(geometry.record_bytes, DEPTH)
        runs.append(measured)
        predictions.append(
            _replay(trace, geometry, ram, windows, measured, layers, policy, prefetch)
        )
        seen.append(_replay(trace, geometry, ram, in_run, measured, layers, policy, prefetch))
    return runs, predictions, seen, median_disk(disks)


def _replay(trace, geometry, ram, disk, measured, layers, policy, prefetch) -> simulate.Result:
    """The run's trace through the simulator with its compute calibrated from the run (per
    layer: non-expert time; per expert: kernel time): hits, bytes, stalls and s/token are
    predicted."""
    non_io = measured["mean_s_per_token"] - measured["stall_s_per_token"]
    expert_s = measured["compute_s_per_token"] / measured["uses_per_token"]
    trunk_s = (non_io - measured["compute_s_per_token"]) / layers
    return simulate.simulate(
        simulate.project(trace, geometry),
        geometry,
        ram,
        disk,
        simulate.Config(policy, prefetch, False),
        depth=DEPTH,
        prefetch_recall=measured["recall"] or 0.0,
        trunk_resident_share=1.0,
        capacity=int(measured["capacity"]),
        trunk_s=trunk_s,
        expert_s=expert_s,
        warm=simulate.prefill_sets(trace, geometry),
    )


def report(runs: list[dict], predictions: list[simulate.Result], seen=None) -> str:
    """Medians over the runs, side by side; the error columns are medians of per-run errors.
    `seen`: the replays with the disk as the run saw it (an extra s/token row)."""

    def row(name: str, real: list[float], sim: list[float]) -> str:
        errors = [(p - r) / r if r else float("nan") for r, p in zip(real, sim, strict=True)]
        m = statistics.median
        return f"{name:>9} {m(real):>9.4f} {m(sim):>9.4f} {m(errors):>+7.1%}"

    real_s = [r["mean_s_per_token"] for r in runs]
    lines = [f"{'':>9} {'measured':>9} {'simulated':>9} {'error':>7}"]
    lines.append(row("s/token", real_s, [p.s_per_token for p in predictions]))
    lines.append(row("hit rate", [r["hit_rate"] for r in runs], [p.hit_rate for p in predictions]))
    lines.append(
        row("GB/token", [r["gb_per_token"] for r in runs], [p.gb_per_token for p in predictions])
    )
    pairs = ", ".join(
        f"{r['mean_s_per_token']:.4f}/{p.s_per_token:.4f}"
        for r, p in zip(runs, predictions, strict=True)
    )
    lines.append(f"(median of {len(runs)} runs; measured/simulated s/token per run: {pairs})")
    if seen:
        m = statistics.median
        lines.append(
            f"disk: windows between runs {m(r['disk_window_gbps'] for r in runs):.2f} GB/s; "
            f"in the runs {m(r['disk_busy_gbps'] for r in runs):.2f} GB/s while reading "
            f"({m(r['disk_busy_share'] for r in runs):.0%} of decode, "
            f"{m(r['disk_in_flight'] for r in runs):.1f} reads in flight)"
        )
        lines.append(row("s/token*", real_s, [p.s_per_token for p in seen]))
        lines.append("(* replayed with the disk as the run saw it: the model alone is tested)")
    return "\n".join(lines)
