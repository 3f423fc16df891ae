"""Single-node streaming: budgets from everything cached to the minimum, streamed trunk, synth."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from helpers import parse_bench_disk, positive

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local, open_streaming
from moeshard.moe.convert.synth import synth
from moeshard.moe.errors import MoeshardError
from moeshard.moe.experts.store import ExpertStore
from moeshard.moe.experts.usage import read_usage, write_profile
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.model.streaming_trunk import StreamingTrunk
from moeshard.moe.storage.budget import plan_budget
from moeshard.moe.storage.trunk_file import TrunkLayout
from moeshard.moe.units import parse_size

PROMPT = [1, 5, 9, 2, 7]
OPTS = SamplingOptions(max_tokens=8, temperature=1.0, seed=0, keep_logits=True)
CONTEXT = len(PROMPT) + OPTS.max_tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny synth preset, on the real disk (pytest's tmp dir is on ext4 here)."""
    out = tmp_path_factory.mktemp("synth") / "tiny"
    synth(out, "tiny")
    return out


@pytest.fixture(scope="module")
def reference(tiny):
    rt = open_local(tiny)
    return generate(rt.transformer, PROMPT, OPTS)


def run_streaming(path, budget, **options):
    rt = open_streaming(path, budget, CONTEXT, **options)
    result = generate(rt.transformer, PROMPT, OPTS)
    stats = rt.stats(result)
    rt.experts.close()
    rt.transformer.trunk.close()
    return result, stats, rt


def same(a, b) -> bool:
    return a.tokens == b.tokens and all(
        np.array_equal(x, y) for x, y in zip(a.logits, b.logits, strict=True)
    )


def test_parse_size():
    assert parse_size("8G") == 8 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5g") == 3 << 29
    with pytest.raises(MoeshardError):
        parse_size("lots")


def test_synth_is_a_valid_model(tiny):
    model = ModelDir(tiny)
    c = model.config
    assert (c.n_experts, c.top_k, len(c.moe_layers)) == (64, 4, 3)
    assert all(not shard.verify_all() for shard in model.shards)


def test_identical_tokens_from_everything_cached_to_minimum(tiny, reference):
    model = ModelDir(tiny)
    minimum = plan_budget(model, 1 << 40, CONTEXT).minimum
    budgets = [minimum + (64 << 20), minimum + (256 << 10), minimum + (8 << 10), minimum]
    for budget in budgets:
        for prefetch in (True, False):
            result, stats, rt = run_streaming(tiny, budget, policy="lru", prefetch=prefetch)
            assert same(result, reference), (budget, prefetch)
            assert stats["peak_rss_bytes"] > 0
    # at the minimum the trunk is streamed through the ring
    plan = plan_budget(model, minimum, CONTEXT)
    assert not plan.trunk_resident
    assert plan.expert_slots == 2 * model.config.top_k


def test_identical_tokens_across_policies(tiny, reference, tmp_path):
    model = ModelDir(tiny)
    store = ExpertStore(model.shard_set, 16, model.config.top_k, "lru", prefetch=False)
    rt = open_local(tiny)
    rt.transformer.experts = store
    generate(rt.transformer, PROMPT, OPTS)
    store.close()
    profile_path = tmp_path / "profile.json"
    write_profile(profile_path, model.model_id, store.counts)
    profile = read_usage(profile_path, model.model_id)
    budget = plan_budget(model, 1 << 40, CONTEXT).minimum + (128 << 10)
    for policy in ("lru", "lfu", "pin", "none"):
        for prefetch in (True, False):
            result, stats, _ = run_streaming(
                tiny, budget, policy=policy, prefetch=prefetch, profile=profile
            )
            assert same(result, reference), (policy, prefetch)
            if policy == "none":
                assert stats["store_hits"] == stats["store_prefetch_hits"]


def test_everything_cached_reads_each_expert_once(tiny):
    _, stats, rt = run_streaming(tiny, 1 << 30, policy="lru", prefetch=False)
    assert stats["store_misses"] * rt.experts.record_nbytes == stats["store_bytes_read"]
    assert stats["store_misses"] <= 64 * 3


def test_budget_too_small_names_the_minimum(tiny):
    model = ModelDir(tiny)
    minimum = plan_budget(model, 1 << 40, CONTEXT).minimum
    with pytest.raises(MoeshardError, match=r"below the minimum working set .*MiB"):
        plan_budget(model, minimum - 1, CONTEXT)


def test_streaming_trunk_matches_resident(tiny, reference):
    model = ModelDir(tiny)
    layout = TrunkLayout(tiny / "trunk.gguf", model.model_id)
    for prefix in (0, 1, 3):
        trunk = StreamingTrunk(layout, prefix, ring=2)
        rt = open_local(tiny)
        rt.transformer.trunk = trunk
        result = generate(rt.transformer, PROMPT, OPTS)
        trunk.close()
        assert same(result, reference), prefix
        if prefix < 3:
            assert trunk.bytes_read > layout.total_bytes() // 2


def test_cli_generate_ram_matches_unbudgeted(tiny, tmp_path, capsys):
    import json

    from moeshard.cli import main

    common = [str(tiny), "--prompt-ids", "1,5,9", "--max-tokens", "4", "--json"]
    assert main(["generate", *common]) == 0
    plain = json.loads(capsys.readouterr().out)
    stats_path, profile_path = tmp_path / "stats.jsonl", tmp_path / "profile.json"
    argv = ["generate", *common, "--ram", "64M", "--cache-policy", "lfu", "--read-depth", "2"]
    argv += ["--stats-json", str(stats_path), "--profile-out", str(profile_path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    streamed = json.loads(captured.out)
    assert streamed["tokens"] == plain["tokens"]
    assert "RAM budget 64.00 MiB" in captured.err and "peak RSS" in captured.err
    assert streamed["stats"]["peak_rss_bytes"] > 0
    lines = [json.loads(line) for line in stats_path.read_text().splitlines()]
    assert len(lines) == 5 and "summary" in lines[-1]
    assert (
        sum(line["bytes_read"] for line in lines[:-1]) == lines[-1]["summary"]["store_bytes_read"]
    )
    argv = ["generate", *common, "--ram", "64M", "--cache-policy", "pin"]
    assert main([*argv, "--profile-in", str(profile_path)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == plain["tokens"]
    assert main(["generate", *common, "--ram", "1M"]) == 2
    assert "below the minimum working set" in capsys.readouterr().err
    assert main(["generate", *common, "--ram", "64M", "--prefetch-top", "1"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == plain["tokens"]
    assert "prefetch top 1;" in captured.err
    assert main(["generate", *common, "--ram", "64M", "--prefetch-top", "99"]) == 2
    assert "prefetch top must be" in capsys.readouterr().err


COLUMNS = ["s/token", "GB/token", "hit rate", "Belady", "stall", "recall", "prec."]
COLUMNS += ["x I/O floor", "x bound", "reads/tok", "KiB/read"]
RATIOS = ("x I/O floor", "x bound")  # s/token over the floors


def bench_stream_table(out: str) -> tuple[dict, dict[str, dict[str, float | None]]]:
    """`moeshard bench stream`'s figures: the trace line's, and the table's by row name
    (percentages in %, None for '-')."""
    trace = re.search(
        r"^trace: (\d+) decode tokens after a (\d+)-token prefill, ([\d.]+) expert uses/token; "
        r"(\d+) cache slots; Belady hit rate ([\d.]+)%",
        out,
        re.MULTILINE,
    )
    assert trace, f"no trace line in:\n{out}"
    keys = ("decode_tokens", "prefill_tokens", "uses_per_token", "slots", "belady")
    figures = dict(zip(keys, map(float, trace.groups()), strict=True))
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("config "))
    assert lines[head].split()[1:] == " ".join(COLUMNS).split()
    assert set(lines[head + 1]) == {"-"}
    rows = {}
    for line in lines[head + 2 :]:
        if line.startswith("peak RSS"):
            break
        words = line.split()
        name, values = " ".join(words[: -len(COLUMNS)]), words[-len(COLUMNS) :]
        rows[name] = {
            column: None if v == "-" else float(v.rstrip("%"))
            for column, v in zip(COLUMNS, values, strict=True)
        }
    return figures, rows


def check_bench_stream(out: str, err: str, names: list[str], record_kib: float) -> dict:
    """The figures of one `bench stream` run are there for every row, and hang together."""
    assert "routing differs" not in out  # every row saw the same routing
    trace, rows = bench_stream_table(out)
    assert list(rows) == names
    uses = trace["uses_per_token"]
    assert trace["decode_tokens"] == 4 and positive(uses) and 0 <= trace["belady"] <= 100
    for name, row in rows.items():
        # the table reports the runs the progress lines (stderr) timed: one round, same value
        assert f"[{name}: {row['s/token']:.4f} s/token]" in err, name
        assert positive(row["s/token"]), row
        # ratios and means printed to 2-3 decimals: a slow disk may round them to 0
        assert all(math.isfinite(row[k]) and row[k] >= 0 for k in ("GB/token", *RATIOS)), row
        assert 0 <= row["hit rate"] <= 100 and 0 <= row["stall"] <= 100, row
        assert row["Belady"] == trace["belady"], row  # one trace, one Belady figure
        if "prefetch" in name:
            assert 0 < row["recall"] <= 100 and 0 < row["prec."] <= 100, row
        else:
            assert row["recall"] is None and row["prec."] is None, row
            # without prefetch only misses are read (adjacent ones may share a read)
            misses = uses * (1 - row["hit rate"] / 100)
            assert row["reads/tok"] <= misses + 0.1, row
        assert row["KiB/read"] >= round(record_kib), row  # whole records, perhaps merged
    naive = rows[names[0]]
    assert naive["hit rate"] == 0 and naive["reads/tok"] == uses  # every use is a read
    return rows


def test_bench_commands_run(tiny, tmp_path, capsys):
    from moeshard.cli import main

    record_kib = ModelDir(tiny).shard_set.record_nbytes / 1024
    argv = ["bench", "stream", str(tiny), "--ram", "49M", "--tokens", "4"]
    fast = ["--disk-seconds", "0.05", "--reps", "1", "--policies", "lru", "--prefetch-top", "1"]
    assert main([*argv, *fast]) == 0
    out, err = capsys.readouterr()
    names = ["naive", "lru", "lru +prefetch", "lru +prefetch top1"]
    rows = check_bench_stream(out, err, names, record_kib)
    assert rows["naive"]["KiB/read"] == round(record_kib)  # one record per read

    trace = tmp_path / "trace.npz"
    gen = ["generate", str(tiny), "--prompt-ids", "1,2,3", "--max-tokens", "6", "--json"]
    assert main([*gen, "--trace", str(trace)]) == 0
    assert main(["pack", str(tiny), "--trace", str(trace), "--out", str(tmp_path / "packed")]) == 0
    capsys.readouterr()
    packed = ["--packed", str(tmp_path / "packed"), "--policies", "lru"]
    assert main([*argv, "--disk-seconds", "0.05", "--reps", "1", *packed]) == 0
    out, err = capsys.readouterr()
    names = ["naive", "lru", "lru +prefetch"]
    rows = check_bench_stream(out, err, names + [f"{n} [packed]" for n in names], record_kib)
    for name in ("naive", "lru"):  # the same records are resident whatever the file order
        assert rows[f"{name} [packed]"]["hit rate"] == rows[name]["hit rate"]

    profile = tmp_path / "disk.json"  # the measured figures unrounded
    argv = ["bench", "disk", "--dir", str(tmp_path), "--file-size", "8M", "--sizes", "4K,1M"]
    argv += ["--depths", "1,2", "--seconds", "0.05", "--reps", "1", "--profile-out", str(profile)]
    assert main(argv) == 0
    rows = parse_bench_disk(capsys.readouterr().out)
    assert [r.size for r in rows] == ["4.00 KiB", "1.00 MiB"]
    points = json.loads(profile.read_text())["points"]
    assert [p[:2] for p in points] == [[4 << 10, 1], [4 << 10, 2], [1 << 20, 1], [1 << 20, 2]]
    printed = {}  # (read size, depth) -> GB/s as printed
    for size, r in zip((4 << 10, 1 << 20), rows, strict=True):
        assert list(r.gbps) == [1, 2], r
        assert all(math.isfinite(v) and v >= 0 for v in (r.raw, r.reader, r.ratio)), r
        printed.update({(size, depth): gbps for depth, gbps in r.gbps.items()})
    for size, depth, gbps in points:  # measured > 0; printed to 3 decimals (a slow disk: 0.000)
        assert positive(gbps) and abs(printed[size, depth] - gbps) <= 0.0005 + 1e-9, printed


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_streamed_trunk_and_minimum_budget_on_fixtures(family, converted):
    path = converted(family, experts="q4_0")
    rt = open_local(path)
    reference = generate(rt.transformer, PROMPT, OPTS)
    model = ModelDir(path)
    minimum = plan_budget(model, 1 << 40, CONTEXT).minimum
    result, stats, _ = run_streaming(path, minimum, policy="lru", prefetch=True)
    assert same(result, reference)
    plan = plan_budget(model, minimum, CONTEXT)
    assert not plan.trunk_resident
    assert stats["trunk_bytes_read"] > plan.trunk_total  # layers were read more than once


def test_bench_stream_io_only_runs_no_expert_kernel(tiny, monkeypatch, capsys):
    """--io-only measures the I/O path alone: neither the per-expert nor the batched decode
    kernel may run (records are still read and checksummed)."""
    from moeshard.cli import main
    from moeshard.moe.kernels import entry, quant

    def kernel_ran(*args, **kwargs):
        raise AssertionError("an expert kernel ran under --io-only")

    quant.warmup()  # compiled and loaded first: the start-up warm-up calls every kernel once
    monkeypatch.setattr(quant, "warmup", lambda: 0.0)
    monkeypatch.setattr(entry, "expert_ffn_kernel", kernel_ran)
    monkeypatch.setattr(entry, "experts_b1_kernel", kernel_ran)
    argv = ["bench", "stream", str(tiny), "--ram", "49M", "--tokens", "3", "--io-only"]
    assert main([*argv, "--disk-seconds", "0.05", "--reps", "1", "--policies", "lru"]) == 0
    assert "I/O path only" in capsys.readouterr().out
