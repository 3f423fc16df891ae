"""The trace-replay simulator: disk model and the direction of every effect."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import parse_bench_disk, positive

from moeshard.moe.analysis import simulate
from moeshard.moe.analysis.disk import DISK_PROFILES, Disk
from moeshard.moe.errors import MoeshardError
from moeshard.moe.storage.traces import DECODE, FORMAT, Trace


def synthetic_trace(tokens=60, layers=(0, 1, 2), n_experts=64, k=4, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    popularity = rng.zipf(1.5, size=n_experts).astype(float)
    popularity /= popularity.sum()
    rows = [(t, layer) for t in range(tokens) for layer in layers]
    ids = np.array([rng.choice(n_experts, k, replace=False, p=popularity) for _ in rows])
    n = len(rows)
    return Trace(
        np.array([r[0] for r in rows], np.int32),
        np.array([r[1] for r in rows], np.int16),
        np.full(n, DECODE, np.uint8),
        np.zeros(n, np.uint16),
        ids.astype(np.int16),
        np.full((n, k), 0.25, np.float16),
        {
            "format": FORMAT,
            "n_experts": n_experts,
            "top_k": k,
            "moe_layers": list(layers),
            "model_id": "x",
        },
    )


def test_disk_profile_reproduces_its_measured_points():
    disk = Disk.load("this-machine")
    for size, depth, gbps in DISK_PROFILES["this-machine"]["points"]:
        if depth == 1:
            assert disk.gbps(size, depth) == pytest.approx(gbps)
    assert disk.gbps(256 << 10, 1) < disk.gbps(1 << 20, 1)


def test_projection_keeps_k_distinct_experts_per_layer():
    geometry = simulate.Geometry("g", 6, 256, 8, 1 << 20, 64 << 20, 1e9)
    tokens = simulate.project(synthetic_trace(), geometry)
    assert len(tokens) == 60
    for token in tokens:
        assert token.shape == (6, 8)
        for i, ids in enumerate(token):
            assert len(set(ids.tolist())) == 8
            assert ((ids >= i * 256) & (ids < (i + 1) * 256)).all()


def test_every_effect_points_the_right_way():
    trace = synthetic_trace()
    geometry = simulate.Geometry("g", 3, 64, 4, 4 << 20, 32 << 20, 1e9)
    tokens = simulate.project(trace, geometry)
    disk = Disk.load("this-machine")

    def run(ram_mb, policy="lru", prefetch=False, packed=False, recall=0.8):
        config = simulate.Config(policy, prefetch, packed)
        return simulate.simulate(
            tokens, geometry, ram_mb << 20, disk, config, prefetch_recall=recall
        )

    assert run(400, "none").hit_rate == 0
    small, large = run(120), run(600)
    assert large.hit_rate > small.hit_rate and large.s_per_token < small.s_per_token
    # a perfect prediction reads the same records earlier (during the previous layer's
    # compute); wrong guesses cost bytes
    perfect = run(120, prefetch=True, recall=1.0)
    assert perfect.s_per_token < small.s_per_token
    assert perfect.gb_per_token <= small.gb_per_token
    assert run(120, prefetch=True, recall=0.5).gb_per_token > perfect.gb_per_token
    assert run(120, "lfu").hit_rate > 0
    assert run(120, "lfu", packed=True).gb_per_token == pytest.approx(run(120, "lfu").gb_per_token)


def test_validation_replays_a_real_streaming_run(tmp_path):
    """The side-by-side command runs a real budgeted generation and its simulation."""
    from moeshard.bench import sim_validate
    from moeshard.moe.convert.synth import synth

    model = tmp_path / "tiny"
    synth(model, "tiny")
    runs, predictions, seen, disk = sim_validate.validate(
        model,
        int(48.5 * 2**20),
        "lru",
        False,
        8,
        [1, 2, 3],
        repeat=2,  # ~18 of 256 slots
    )
    assert len(runs) == len(predictions) == len(seen) == 2
    for measured, predicted in zip(runs, predictions, strict=True):
        assert measured["mean_s_per_token"] > 0 and predicted.s_per_token > 0
        assert 0 <= predicted.hit_rate <= 1 and 0 <= measured["hit_rate"] <= 1
        # the cache is replayed from the run's own trace, prompt included: same hits and bytes
        assert predicted.hit_rate == pytest.approx(measured["hit_rate"], abs=0.05)
    assert all(p[2] > 0 for p in disk.points)  # the disk really was measured
    for measured, replayed in zip(runs, seen, strict=True):
        # the run's own reads: it had some in flight, and they moved bytes
        assert measured["disk_reads"] > 0
        assert 0 < measured["disk_busy_share"] <= 1 and measured["disk_busy_gbps"] > 0
        assert 1 <= measured["disk_in_flight"] <= 4 + 1e-6
        assert replayed.hit_rate == predicted.hit_rate  # only the disk differs
    text = sim_validate.report(runs, predictions, seen)
    assert "measured" in text and "hit rate" in text and "while reading" in text


def simulate_table(out: str, disk: Path) -> dict[tuple[str, bool, bool], dict[str, float]]:
    """`moeshard simulate`'s rows by (policy, prefetch, packed); percentages in %."""
    lines = out.splitlines()
    assert lines[0].startswith("geometry ") and f"; disk {disk};" in lines[0], lines[0]
    columns = ["s/token", "GB/token", "hit rate", "stall"]
    assert lines[1].split() == "policy prefetch layout s/token GB/token hit rate stall".split()
    rows = {}
    for line in lines[2:]:
        policy, prefetch, layout, *values = line.split()
        assert prefetch in ("on", "off") and layout in ("file", "packed"), line
        figures = [float(v.rstrip("%")) for v in values]
        rows[(policy, prefetch == "on", layout == "packed")] = dict(
            zip(columns, figures, strict=True)
        )
    return rows


def test_bench_disk_writes_a_profile_that_simulate_reads(tmp_path, capsys):
    """`bench disk --profile-out` measures this disk and writes the points `simulate --disk`
    takes; a malformed profile is refused with exit code 2 and a message."""
    from moeshard.cli import main

    profile = tmp_path / "disk.json"
    argv = ["bench", "disk", "--dir", str(tmp_path), "--file-size", "32M", "--sizes", "1M"]
    argv += ["--depths", "1,2", "--seconds", "0.05", "--reps", "1", "--profile-out", str(profile)]
    assert main(argv) == 0
    printed = parse_bench_disk(capsys.readouterr().out)
    points = json.loads(profile.read_text())["points"]
    assert [p[:2] for p in points] == [[1 << 20, 1], [1 << 20, 2]]
    assert [r.size for r in printed] == ["1.00 MiB"]
    for _, depth, gbps in points:  # what the table printed (to its 3 decimals), measured > 0
        assert positive(gbps) and abs(gbps - printed[0].gbps[depth]) <= 0.0005 + 1e-9
    assert not (tmp_path / "moeshard-bench-disk.bin").exists()  # scratch file removed
    nowhere = argv[:-1] + [str(tmp_path / "missing" / "disk.json")]
    assert main(nowhere) == 2  # refused before measuring, nothing written
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()

    trace_path = tmp_path / "t.npz"
    synthetic_trace(tokens=15).save(trace_path)  # a short one: simulate runs it twice
    capsys.readouterr()
    assert main(["simulate", str(trace_path), "--geometry", "k2", "--disk", str(profile)]) == 0
    measured = simulate_table(capsys.readouterr().out, profile)
    half = tmp_path / "half.json"  # the same disk at half the bandwidth
    half.write_text(json.dumps({"points": [[size, d, g / 2] for size, d, g in points]}))
    assert main(["simulate", str(trace_path), "--geometry", "k2", "--disk", str(half)]) == 0
    slower = simulate_table(capsys.readouterr().out, half)
    configs = {(c.policy, c.prefetch, c.packed) for c in simulate.CONFIGS}
    assert set(measured) == set(slower) == configs  # a row for every configuration
    for config, row in measured.items():
        assert positive(row["s/token"]) and positive(row["GB/token"]), config
        assert 0 <= row["hit rate"] <= 100 and 0 <= row["stall"] <= 100, config
        # the disk's speed changes when records land, not which ones are read
        assert slower[config]["GB/token"] == row["GB/token"], config
        assert slower[config]["hit rate"] == row["hit rate"], config
        assert slower[config]["s/token"] >= row["s/token"], config
    every_use_read = ("none", False, False)
    assert measured[every_use_read]["hit rate"] == 0
    assert slower[every_use_read]["s/token"] > measured[every_use_read]["s/token"]

    for bad in ('{"points": []}', '{"points": [[1048576, 0, 1.0]]}', "[1, 2]", "not json"):
        profile.write_text(bad)
        assert main(["simulate", str(trace_path), "--geometry", "k2", "--disk", str(profile)]) == 2
        assert "disk profile" in capsys.readouterr().err


def test_k3_geometry_is_the_released_model():
    """2.78 T parameters like the original 8 GB setup's model; 92 LatentMoE layers of 896
    MXFP4 experts (3 x 3584 x 3072 weights at 17 bytes per 32) and a bf16 trunk."""
    g = simulate.GEOMETRIES["k3"]
    assert (g.layers, g.n_experts, g.top_k) == (92, 896, 16)
    assert g.record_bytes == 3 * 3584 * 3072 * 17 // 32 == 17_547_264
    assert round(g.params / 1e10) == 278
    routed = 92 * 896 * 3 * 3584 * 3072
    assert g.trunk_bytes == 2 * (g.params - routed)


def test_trunk_format_rescales_a_known_trunk():
    g = simulate.GEOMETRIES["k3"]
    q8 = simulate.with_trunk(g, "q8_0")
    assert q8.trunk_bytes == int(g.trunk_params * 34 / 32) and q8.record_bytes == g.record_bytes
    with pytest.raises(MoeshardError, match="parameter count of k2 is not known"):
        simulate.with_trunk(simulate.GEOMETRIES["k2"], "q8_0")
    with pytest.raises(MoeshardError, match="choose one of"):
        simulate.with_trunk(g, "q3_k")
