"""`moeshard bench compare-llamacpp` (issue 17): what it reads from llama.cpp's tools, how it
turns per-round values into the table and the goal lines, and that bad options fail before
anything is built. The fixtures in tests/fixtures/llamacpp/ are real output of the tools,
captured on this machine from the build the bench makes (llama-cpp-python 0.3.36's vendored
llama.cpp, commit 0c1e57098); CI does not build llama.cpp (several minutes)."""

from __future__ import annotations

import platform
import re
import subprocess
import sys

import pytest

from moeshard.bench import llamacpp
from moeshard.bench.compare_batched import (
    PROMPT_TOKENS,
    Batched,
    batched_decode_tps,
    llama_batched_cmd,
    parse_batched_jsonl,
)
from moeshard.bench.compare_table import (
    GOALS,
    Goal,
    Row,
    cell,
    fmt_value,
    goal_line,
    spread,
    table,
)
from moeshard.moe.errors import MoeshardError
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "llamacpp"


def test_backend_ops_perf_output_parses_to_microseconds_per_run():
    text = (FIXTURES / "test-backend-ops-perf.txt").read_text()
    assert llamacpp.parse_backend_ops_perf(text) == {
        ("q4_0", 1): 7877.04,
        ("q8_0", 1): 7973.09,
        ("q4_0", 4): 26021.67,
        ("q8_0", 4): 23315.61,
    }


def test_the_filter_selects_exactly_the_cases_the_bench_reads():
    text = (FIXTURES / "test-backend-ops-perf.txt").read_text()
    regex = llamacpp.mul_mat_filter(("q4_0", "q8_0"), (1, 4), 4096, 14336)
    cases = re.findall(r"MUL_MAT\((.*)\):", text)
    assert len(cases) == 4 and all(re.search(regex, c) for c in cases)
    other = cases[0].replace("n=1,", "n=8,")
    assert not re.search(regex, other)
    assert not re.search(regex, cases[0].replace("type_a=q4_0", "type_a=q4_1"))


def test_llama_bench_json_gives_the_median_of_its_samples():
    results = llamacpp.parse_llama_bench_json((FIXTURES / "llama-bench.json").read_text())
    pp, tg = results
    assert (pp.n_prompt, pp.n_gen, tg.n_prompt, tg.n_gen) == (16, 0, 0, 16)
    assert pp.tokens_per_s == 3381.17  # samples 4528.5, 3381.17, 2927.53: not their mean
    assert tg.tokens_per_s == 1451.99  # samples 923.932, 1451.99, 1489.34
    assert tg.n_threads == 2 and tg.build_commit == "0c1e57098"
    assert tg.model_type.startswith("qwen3moe")


def test_a_backend_ops_line_without_timing_is_left_out():
    line = "  MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=1,k=14336,bs=[1,1]): not supported [CPU]"
    assert llamacpp.parse_backend_ops_perf(line) == {}


def test_packed_bytes_are_ggml_block_sizes():
    assert llamacpp.packed_bytes("q4_0", 4096, 14336) == 4096 * 14336 // 32 * 18
    assert llamacpp.packed_bytes("q8_0", 2, 64) == 2 * 2 * 34


def test_the_upstream_commit_comes_from_the_release_section_of_the_changelog():
    changelog = (
        "# Changelog\n\n## [0.3.37]\n\n- feat: Update llama.cpp to ggml-org/llama.cpp@aaaaaaa\n\n"
        "## [0.3.36]\n\n- feat: Update llama.cpp to ggml-org/llama.cpp@0c1e57098\n- fix: x\n\n"
        "## [0.3.35]\n\n- feat: Update llama.cpp to ggml-org/llama.cpp@bbbbbbb\n"
    )
    assert llamacpp.upstream_commit(changelog, "0.3.36") == "0c1e57098"
    assert llamacpp.upstream_commit(changelog, "0.3.99") == "unknown"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
def test_the_build_switches_amx_off_with_the_compiler_flags():
    args = llamacpp.cmake_args(ROOT / "src", ROOT / "build", "0c1e570")
    assert "-DGGML_NATIVE=ON" in args and "-DCMAKE_BUILD_TYPE=Release" in args
    for lang in ("C", "CXX"):
        assert f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in args


def test_batched_bench_json_lines_give_decode_speed_per_sequence_count():
    text = (FIXTURES / "llama-batched-bench.jsonl").read_text()
    speeds = parse_batched_jsonl("llama_context: a log line\n" + text)
    assert speeds == {1: pytest.approx(307.190155), 16: pytest.approx(552.039978)}


def test_the_batched_command_has_room_for_every_sequence(tmp_path):
    build = llamacpp.LlamaCpp(tmp_path)
    cmd = llama_batched_cmd(build, tmp_path / "m.gguf", 2, 16, 64)
    arg = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert cmd[0].endswith("/build/bin/llama-batched-bench")
    assert arg["-npl"] == "1,16" and arg["-ntg"] == "64" and arg["--output-format"] == "jsonl"
    assert int(arg["-c"]) >= 16 * (PROMPT_TOKENS + 64) and arg["-t"] == arg["-tb"] == "2"


def test_a_build_without_a_newer_target_is_made_again(tmp_path):
    build = llamacpp.LlamaCpp(tmp_path)
    (tmp_path / "build" / "bin").mkdir(parents=True)
    assert llamacpp.missing_targets(build) == list(llamacpp.TARGETS)
    for name in llamacpp.TARGETS[:-1]:
        build.bin(name).write_bytes(b"")
    assert llamacpp.missing_targets(build) == [llamacpp.TARGETS[-1]]


def test_the_scaling_line_divides_each_side_by_its_own_one_sequence_speed():
    suite = Batched.__new__(Batched)
    suite.sequences = 16
    suite.rows = {
        1: Row("batched 1", "one", moeshard=[100.0, 110.0], llama=[200.0, None]),
        16: Row("batched 16", "many", moeshard=[300.0, 220.0], llama=[300.0, 330.0]),
    }
    line = suite.scaling_line()
    assert "moeshard 2.50x [2.00x-3.00x]" in line and "llama.cpp 1.50x," not in line
    assert "llama.cpp 1.50x (" in line  # the round llama.cpp gave no 1-sequence value is left out


def test_moeshards_batched_side_decodes_every_sequence_its_own_way(demo):
    """The batched rows' moeshard side on the demo model: sequences of random tokens, each
    cache advanced by its prompt and every step's token."""
    from moeshard.coordinator.runtime import open_local

    rt = open_local(demo)
    model = rt.transformer
    made = []
    real = model.new_cache
    model.new_cache = lambda n: made.append(real(n)) or made[-1]
    tps = batched_decode_tps(model, rt.config.vocab_size, 3, 5, seed=0)
    assert tps > 0 and len(made) == 3
    assert [c.length for c in made] == [PROMPT_TOKENS + 5] * 3


def test_cells_ratios_and_the_table():
    assert [fmt_value(v) for v in (16431, 436.2, 43.27, 6.274)] == ["16431", "436", "43.3", "6.27"]
    assert spread([3.0, 1.0, 2.0]) == "2.00 [1.00-3.00]" and spread([5.0]) == "5.00"
    assert cell([None, None], ["OOM-killed", "OOM-killed"]) == "OOM-killed 2/2"
    assert cell([10.0, None], ["timed out"]) == "10.0 (timed out 1/2)"
    row = Row("k", "decode", moeshard=[40.0, 50.0, 45.0], llama=[80.0, 100.0, None])
    assert row.ratios() == [0.5, 0.5]  # a round where a side gave nothing has no ratio
    lines = table([row, Row("p", "prefill, longer name", [1.0], [2.0])])
    assert len({len(line) for line in lines[:2]}) == 1  # the rule is as wide as the head
    assert lines[2].startswith("decode ") and lines[2].endswith("0.50 [0.50-0.50]")
    assert lines[3].endswith("0.50")


def test_goal_lines_say_met_or_not_met():
    goal = Goal("big decode same", "big decode", 0.67, moonshot=1.0)
    assert goal_line(goal, None).endswith("not measured in this run (goal >= 0.67, moonshot 1)")
    met = Row("big decode same", "x", [70.0, 71.0, 69.0], [100.0, 100.0, 100.0])
    assert goal_line(goal, met) == "big decode: ratio 0.70 (goal >= 0.67, moonshot 1): MET"
    slow = Row("big decode same", "x", [50.0], [100.0])
    assert goal_line(goal, slow).endswith(": NOT MET")
    fast = Row("big decode same", "x", [120.0], [100.0])
    assert goal_line(goal, fast).endswith("MET (moonshot too)")
    killed = Row("capped mmap", "x", [28.0], [None], failures=["OOM-killed"])
    capped = Goal("capped mmap", "capped", 3.0)
    assert (
        goal_line(capped, killed) == "capped: llama.cpp OOM-killed, moeshard ran (goal >= 3): MET"
    )
    assert goal_line(capped, Row("capped mmap", "x", [None], [None])).endswith("NOT MET")
    assert {g.key.split()[0] for g in GOALS} == {"kernel", "big", "demo", "bandwidth", "capped"}


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--only", "kernels,bogus"],
            "--only: choose from kernels,bandwidth,demo,big,capped,kquants",
        ),
        (["--rounds", "0"], "at least 1"),
        (["--sequences", "1"], "--sequences: at least 2"),
        (["--cap", "100M"], "--cap must exceed"),
        (["--threads", "999"], "--threads"),
    ],
)
def test_bad_options_fail_before_anything_is_built(tmp_path, args, message):
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "compare-llamacpp",
         "--cache", str(cache), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not cache.exists()  # nothing downloaded, built or converted


def test_a_failing_tool_is_named_with_its_last_line_of_output():
    """`llamacpp.run_tool`: stdout back from a tool that succeeds; from one that fails, an
    error naming it, its exit status and its last line (stderr's, else stdout's)."""
    assert llamacpp.run_tool(["sh", "-c", "echo one; echo two"]) == "one\ntwo\n"
    with pytest.raises(MoeshardError, match=r"^sh failed \(exit 3\): the reason$"):
        llamacpp.run_tool(
            ["sh", "-c", "echo progress; echo noise >&2; echo the reason >&2; exit 3"]
        )
    with pytest.raises(MoeshardError, match=r"^sh failed \(exit 4\): only stdout$"):
        llamacpp.run_tool(["sh", "-c", "echo only stdout; exit 4"])
    with pytest.raises(MoeshardError, match=r"\(exit 5\): \(no output\)$"):
        llamacpp.run_tool(["sh", "-c", "exit 5"])
    with pytest.raises(MoeshardError, match=r"^sleep did not finish in 0.2 s \(stopped\)$"):
        llamacpp.run_tool(["sleep", "30"], timeout=0.2)


def test_the_bandwidth_round_reads_dram_between_the_calls(monkeypatch):
    """A round of the bandwidth rows times the DRAM read SLICES times, between slices of the
    products' calls (so both see the same moment of a shared host), and gives each row one
    value: GB/s of the products, the median DRAM read beside them."""
    from moeshard.bench import compare_bandwidth, kernels

    monkeypatch.setattr(kernels, "POOL_BYTES", 8 << 20)
    monkeypatch.setattr(compare_bandwidth, "CALLS", 8)
    monkeypatch.setattr(compare_bandwidth, "DRAM_BYTES", 16 << 20)
    sums = []
    real_sum = compare_bandwidth._parallel_sum
    monkeypatch.setattr(compare_bandwidth, "_parallel_sum", lambda a: sums.append(1) or real_sum(a))
    bw = compare_bandwidth.Bandwidth()
    bw.round()
    assert len(sums) == 1 + compare_bandwidth.SLICES  # a first touch, then one per slice
    for row in bw.rows.values():
        assert len(row.moeshard) == len(row.llama) == 1
        assert row.moeshard[0] > 0 and row.llama[0] > 0
