"""Routing traces, the co-activation analysis, and the cache-policy replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeshard.cli import main
from moeshard.moe.analysis import cachesim, coact
from moeshard.moe.errors import MoeshardError
from moeshard.moe.storage import traces as trace


@pytest.fixture(scope="module")
def traces(converted, tmp_path_factory):
    model = converted("deepseek_v3")
    tmp = tmp_path_factory.mktemp("traces")
    paths = []
    for i, prompt in enumerate(("5,6,7,8", "9,10,11")):
        path = tmp / f"t{i}.npz"
        args = ["generate", str(model), "--prompt-ids", prompt, "--max-tokens", "20"]
        assert main(args + ["--json", "--trace", str(path)]) == 0
        paths.append(path)
    return paths


def test_trace_records_every_decision(traces):
    t = trace.load(traces[0])
    layers = t.moe_layers  # deepseek_v3 fixture: layer 0 dense, layers 1 and 2 MoE
    assert layers == [1, 2]
    prefill, decode = t.phase == trace.PREFILL, t.phase == trace.DECODE
    assert prefill.sum() == 4 * len(layers)  # 4 prompt tokens
    assert decode.sum() == 19 * len(layers)  # the last generated token is never fed back
    assert sorted(set(t.position[decode].tolist())) == list(range(4, 23))
    assert t.ids.shape[1] == 2 and t.ids.max() < 8
    assert np.all(np.diff(t.weights.astype(np.float32), axis=1) <= 0)  # highest weight first
    assert len({tuple(sorted(r)) for r in t.ids.tolist()}) > 1


def test_trace_records_the_prefetch_hints_sent(traces, tmp_path):
    """Each row says what the previous MoE layer's hint predicted for it (-1: no hint, the
    first MoE layer); the hints are the next router's guesses, so most are right."""
    t = trace.load(traces[0])
    assert t.hinted is not None and t.hinted.shape == t.ids.shape
    first, second = t.layer == 1, t.layer == 2
    assert np.all(t.hinted[first] == -1)
    assert np.all(t.hinted[second] >= 0)
    hit = [len(set(h) & set(r)) for h, r in zip(t.hinted[second], t.ids[second], strict=True)]
    assert 0 < sum(hit) < t.ids[second].size  # a guess: mostly right, not a copy
    # a trace without the column (older files) still loads, and merging keeps the column
    bare = tmp_path / "bare.npz"
    trace.Trace(t.position, t.layer, t.phase, t.run, t.ids, t.weights, t.meta).save(bare)
    assert trace.load(bare).hinted is None
    assert trace.merge([t, t]).hinted.shape[0] == 2 * len(t.layer)
    assert trace.merge([t, trace.load(bare)]).hinted is None


def test_a_corrupted_hint_column_is_refused(traces, tmp_path):
    t = trace.load(traces[0])
    bad = tmp_path / "bad.npz"
    trace.Trace(*trace_columns(t), t.meta, t.hinted[:-1]).save(bad)
    with pytest.raises(MoeshardError, match="columns of different lengths"):
        trace.load(bad)
    hinted = t.hinted.copy()
    hinted[0, 0] = 99  # the fixture has 8 experts
    trace.Trace(*trace_columns(t), t.meta, hinted).save(bad)
    with pytest.raises(MoeshardError, match="hinted expert ids out of range"):
        trace.load(bad)


def trace_columns(t):
    return t.position, t.layer, t.phase, t.run, t.ids, t.weights


def test_merge_renumbers_runs(traces, tmp_path, capsys):
    out = tmp_path / "merged.npz"
    assert main(["merge-traces", str(out), *map(str, traces)]) == 0
    merged = trace.load(out)
    parts = [trace.load(p) for p in traces]
    assert len(merged.layer) == sum(len(p.layer) for p in parts)
    assert sorted(set(merged.run.tolist())) == [0, 1]
    assert len(merged.tokens()) == 23 + 22


def test_coact_outputs(traces, tmp_path, capsys):
    out = tmp_path / "coact"
    assert main(["coact", *map(str, traces), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "entropy" in text and "belady" in text
    result = json.loads((out / "coact.json").read_text())
    merged = trace.merge([trace.load(p) for p in traces])
    for layer in ("1", "2"):
        freq = np.array(result["layers"][layer]["frequency"])
        assert freq.sum() == (merged.layer == int(layer)).sum() * 2
        matrix = np.array(result["coactivation"][layer])
        assert (matrix == matrix.T).all() and np.trace(matrix) == 0
        assert matrix.sum() == (merged.layer == int(layer)).sum() * 2  # k(k-1) ordered pairs
    transitions = np.array(result["transitions"]["1->2"])
    assert transitions.sum() == len(merged.tokens()) * 2 * 2
    assert (out / "hit_rate.png").stat().st_size > 1000
    assert (out / "coactivation-1.png").exists()


def test_cache_policies_on_a_known_sequence():
    keys = np.array([1, 2, 3, 1, 4, 1, 2, 5, 1, 2])
    one_per_call = [[k] for k in keys.tolist()]
    # LRU, 3 slots: 1 2 3 | 1 hit | 4 evicts 2 | 1 hit | 2 evicts 3 | 5 evicts 4 | 1, 2 hit
    assert cachesim.policy_hits(one_per_call, 3, "lru") == 4
    # Belady, 3 slots: 1 2 3 | 1 hit | 4 evicts 3 | 1 hit | 2 hit | 5 evicts 4 | 1 hit | 2 hit
    assert cachesim.belady_hits(keys, 3) == 5
    # LFU, 3 slots: 1 2 3 | 1 hit (1 is used most) | 4 evicts 2 (oldest of the once-used)
    # | 1 hit | 2 evicts 3 | 5 evicts 4 | 1, 2 hit
    assert cachesim.policy_hits(one_per_call, 3, "lfu") == 4
    assert cachesim.policy_hits(one_per_call, 100, "lfu") == len(keys) - len(set(keys.tolist()))
    assert cachesim.policy_hits(one_per_call, 100, "none") == 0
    assert cachesim.arc_hits(keys, 100) == len(keys) - len(set(keys.tolist()))


def test_arc_keeps_a_hot_set_through_scans_and_never_beats_belady():
    """A hot set (used twice in a row, so ARC files it as frequent) re-used between scans of
    new keys: LRU loses it to every scan and hits only the immediate re-use, ARC keeps it.
    On random traces no policy beats the offline optimum."""
    hot = list(range(4))
    keys, fresh = [], 1000
    for _ in range(30):
        keys += hot + hot + list(range(fresh, fresh + 8))
        fresh += 8
    keys = np.array(keys)
    assert cachesim.policy_hits([[k] for k in keys.tolist()], 8, "lru") == 30 * len(hot)
    assert cachesim.arc_hits(keys, 8) >= 30 * len(hot) + 0.8 * 29 * len(hot)
    rng = np.random.default_rng(0)
    for cap in (1, 3, 10):
        for _ in range(20):
            keys = rng.zipf(1.3, size=300) % 50
            assert cachesim.arc_hits(keys, cap) <= cachesim.belady_hits(keys, cap)


def test_belady_bounds_online_policies():
    rng = np.random.default_rng(0)
    keys = rng.zipf(1.3, size=3000) % 200
    for capacity in (4, 16, 64):
        best = cachesim.belady_hits(keys, capacity)
        for policy in ("lru", "lfu"):
            assert best >= cachesim.policy_hits([[k] for k in keys.tolist()], capacity, policy)


def test_skew_of_uniform_and_concentrated_usage():
    uniform = coact.skew(np.full(100, 10))
    assert uniform["entropy_vs_uniform"] == pytest.approx(1.0)
    assert uniform["top10pct_share"] == pytest.approx(0.10)
    concentrated = coact.skew(np.array([1000] + [0] * 99))
    assert concentrated["top1pct_share"] == 1.0 and concentrated["entropy_vs_uniform"] == 0.0


def test_pack_moves_records_and_keeps_output(traces, converted, tmp_path, capsys):
    from moeshard.coordinator.generate import SamplingOptions, generate
    from moeshard.coordinator.runtime import open_local
    from moeshard.moe.model.model_dir import ModelDir

    src = converted("deepseek_v3")
    out = tmp_path / "packed"
    assert main(["pack", str(src), "--trace", *map(str, traces), "--out", str(out)]) == 0
    assert "packed" in capsys.readouterr().out
    a, b = ModelDir(src), ModelDir(out)
    assert a.model_id == b.model_id and set(a.locations) == set(b.locations)
    for key, (shard, _) in a.locations.items():
        assert np.array_equal(shard.read(*key), b.locations[key][0].read(*key))
    order = json.loads((out / "moeshard.json").read_text())["layout"]["order"]
    offsets = [b.locations[(1, e)][1].offset for e in order["1"]]
    assert offsets == sorted(offsets) and order["1"] != list(range(8))  # really reordered
    outputs = []
    for model in (src, out):
        rt = open_local(model)
        outputs.append(
            generate(rt.transformer, [5, 6, 7, 8], SamplingOptions(max_tokens=20)).tokens
        )
    assert outputs[0] == outputs[1]


def test_seriation_puts_coactivated_experts_next_to_each_other():
    from moeshard.moe.analysis.coact import seriate

    coact_matrix = np.zeros((6, 6), dtype=np.int64)
    for i, j in ((0, 4), (4, 2), (2, 5), (5, 1), (1, 3)):
        coact_matrix[i, j] = coact_matrix[j, i] = 10
    freq = np.array([50, 1, 1, 1, 1, 1])
    assert seriate(coact_matrix, freq) == [0, 4, 2, 5, 1, 3]


def test_pack_in_place(traces, converted, tmp_path):
    import shutil

    from moeshard.moe.model.model_dir import ModelDir

    model = tmp_path / "model"
    shutil.copytree(converted("deepseek_v3"), model)
    before = {k: s.read(*k) for k, (s, _) in ModelDir(model).locations.items()}
    assert main(["pack", str(model), "--trace", str(traces[0])]) == 0
    after = ModelDir(model)
    assert [p.name for p in model.iterdir() if p.name.endswith(".gguf")] != []
    assert all(np.array_equal(after.locations[k][0].read(*k), v) for k, v in before.items())
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary leftovers


def test_shard_placement_balances_by_a_real_trace(traces, converted, tmp_path):
    from moeshard.moe.convert.placement import shard_model
    from moeshard.moe.experts.usage import read_usage

    model = converted("deepseek_v3")
    usage = read_usage(traces[0])
    assert sum(usage.values()) == trace.load(traces[0]).ids.size
    plan = shard_model(model, 2, 1, tmp_path / "shards", traces[0])
    assert plan["balanced_by"] == "trace"
    loads = [n["load"] for n in plan["nodes"]]
    assert max(loads) <= 1.5 * min(loads)  # hot experts spread over both nodes
