"""`moeshard simulate --validate MODEL --ram SIZE`: the simulator against a real run, side by side.

Runs a real single-node streaming generation (ExpertStore, O_DIRECT reads) while recording its
routing trace, measures this disk at the model's record size in the same run, then replays
the trace through `moe.simulate` with the run's own cache size and policy. The simulator is
given the run's measured non-I/O time per token (its compute model is calibrated, not
predicted); the cache hit rate, the bytes read and the I/O stall are predicted from the trace
and the disk model alone.
"""

from __future__ import annotations

import statistics

from coordinator.generate import SamplingOptions, generate
from coordinator.runtime import open_streaming
from moe import simulate
from moe.bench_disk import raw_read_gbps
from moe.trace import TraceRecorder


def measure_disk(model, record_bytes: int, seconds: float = 0.5) -> simulate.Disk:
    """O_DIRECT random reads over the model's own records: GB/s at depths 1, 2, 4, 8, for the
    record size and for 4 records at a time (merged adjacent reads)."""
    targets = [(loc.path, loc.offset) for _, loc in model.locations.values()]
    points = []
    for size in (record_bytes, 4 * record_bytes):
        for depth in (1, 2, 4, 8):
            points.append([size, depth, raw_read_gbps(targets, size, depth, seconds)])
    return simulate.Disk(points)


def validate(model_path, ram: int, policy: str, prefetch: bool, tokens: int, prompt: list[int]):
    rt = open_streaming(
        model_path,
        ram,
        len(prompt) + tokens,
        policy=policy,
        prefetch=prefetch,
        depth=4,
        prefill_tokens=len(prompt),
    )
    store, c = rt.experts, rt.config
    meta = {
        "model_id": rt.model.model_id,
        "n_experts": c.n_experts,
        "top_k": c.top_k,
        "moe_layers": list(c.moe_layers),
        "model_type": c.model_type,
    }
    recorder = TraceRecorder(store, meta)
    rt.transformer.experts = recorder
    marks = []
    result = generate(
        rt.transformer,
        prompt,
        SamplingOptions(max_tokens=tokens),
        lambda _t: marks.append(store.snapshot()) if not marks else None,
    )
    start, end = marks[0], store.snapshot()
    n = len(result.decode_s)
    measured = {
        "s_per_token": statistics.median(result.decode_s),
        "mean_s_per_token": sum(result.decode_s) / n,
        "hit_rate": (end.hits - start.hits) / max(end.accesses - start.accesses, 1),
        "gb_per_token": (end.bytes_read - start.bytes_read) / n / 1e9,
        "stall_s_per_token": (end.stall_s - start.stall_s) / n,
    }
    geometry = simulate.geometry_of(str(model_path))
    disk = measure_disk(rt.model, geometry.record_bytes)
    layer_compute = (measured["mean_s_per_token"] - measured["stall_s_per_token"]) / len(
        c.moe_layers
    )
    trace = recorder.trace()
    predicted = simulate.simulate(
        simulate.project(trace, geometry),
        geometry,
        ram,
        disk,
        simulate.Config(policy, prefetch, False),
        depth=4,
        prefetch_recall=end.recall or 0.0,
        trunk_resident_share=1.0,
        capacity=store.plan.expert_slots - store.plan.prefetch_slots,
        layer_compute_s=layer_compute,
    )
    return measured, predicted, disk


def report(measured: dict, predicted: simulate.Result) -> str:
    rows = [
        ("s/token", measured["mean_s_per_token"], predicted.s_per_token),
        ("hit rate", measured["hit_rate"], predicted.hit_rate),
        ("GB/token", measured["gb_per_token"], predicted.gb_per_token),
    ]
    lines = [f"{'':>9} {'measured':>9} {'simulated':>9} {'error':>7}"]
    for name, real, sim in rows:
        error = (sim - real) / real if real else float("nan")
        lines.append(f"{name:>9} {real:>9.4f} {sim:>9.4f} {error:>+7.1%}")
    return "\n".join(lines)
