"""Bad inputs the CLI property tests found ending in a traceback (exit 1): each must be refused
with one error line naming the file or option (exit 2), and lose nothing (issue 16).

  * trace files that are not traces: empty, text, not a zip, cut short, one byte flipped
    (merge-traces, simulate, pack and coact all read them through moe/storage/traces.py load);
  * trace outputs that cannot be written: a directory, a missing directory, one of the inputs;
  * simulate's numeric options out of range (0 GB/s divided by zero; nonsense was simulated);
  * a config.json whose model_type is a list or an object (unhashable in families.family_for).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

from moeshard.cli import main
from moeshard.moe.errors import MoeshardError
from moeshard.moe.storage import traces

DEMO = ROOT / "models" / "demo-hf"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """The demo converted once, and a real trace of it (both inputs: never written to)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    model, trace = root / "model", root / "trace.npz"
    assert main(["convert", str(DEMO), str(model), "--quiet"]) == 0
    argv = ["generate", str(model), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
    assert main([*argv, "--trace", str(trace)]) == 0
    return {"model": model, "trace": trace}


def refused(capsys, argv: list[str], *names) -> str:
    """Run `main(argv)` in process: exit 2, exactly one stderr line, the error line, naming
    every one of `names`, no traceback. Returns the line."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}\n{err}"
    assert "Traceback" not in err and "Traceback" not in out, err
    assert len(lines) == 1 and lines[0].startswith("moeshard: error: "), err
    for name in names:
        assert str(name) in lines[0], lines[0]
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- 1. a trace file that is not one ----------------------------------------------------------


def _flip_in_data(data: bytes) -> bytes:
    """One bit flipped in the middle of the largest compressed member's data."""
    import io

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len
    out = bytearray(data)
    out[start + info.compress_size // 2] ^= 0x10
    return bytes(out)


def _zip_without_meta(data: bytes) -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("notes.txt", "hello")
    return buf.getvalue()


GARBAGE = {
    "empty": (lambda d: b"", "empty"),
    "text": (lambda d: b"not a trace\n", "not a trace file"),
    "json": (lambda d: b"{}", "not a trace file"),
    "npy-header": (lambda d: b"\x93NUMPY\x01\x00", "not a trace file"),
    "truncated": (lambda d: d[: len(d) // 2], "truncated"),
    "cut-header": (lambda d: d[:2], "not a trace file"),
    "flipped-byte": (_flip_in_data, "corrupted trace file"),
    "foreign-zip": (_zip_without_meta, "not a trace file"),
}
TRACE_COMMANDS = ["merge-traces", "simulate", "pack", "coact"]


def _trace_argv(command: str, bad: Path, work: dict, out: Path) -> list:
    if command == "merge-traces":
        return ["merge-traces", out / "m.npz", work["trace"], bad]
    if command == "simulate":
        return ["simulate", bad, "--geometry", work["model"]]
    if command == "pack":
        return ["pack", work["model"], "--trace", bad, "--out", out / "packed"]
    return ["coact", "--out", out / "coact", bad]


@pytest.mark.parametrize("command", TRACE_COMMANDS)
@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_trace_that_is_not_one_is_one_line(work, tmp_path, capsys, command, kind):
    make, words = GARBAGE[kind]
    bad = tmp_path / f"{kind}.npz"
    bad.write_bytes(make(work["trace"].read_bytes()))
    before = digest(bad), digest(work["trace"])
    out = tmp_path / "out"
    out.mkdir()
    line = refused(capsys, _trace_argv(command, bad, work, out), bad)
    assert words in line
    assert "pickled" not in line  # a text file is not "pickled (object) data"
    assert (digest(bad), digest(work["trace"])) == before
    assert not (out / "m.npz").exists() and not (out / "packed").exists()


def test_flipped_byte_is_named_corrupted_in_load(work, tmp_path):
    bad = tmp_path / "flipped.npz"
    bad.write_bytes(_flip_in_data(work["trace"].read_bytes()))
    with pytest.raises(MoeshardError, match="corrupted trace file"):
        traces.load(bad)
    assert len(traces.load(work["trace"]).layer) > 0  # the real one still loads


# -- 2, 3. where a trace is written -----------------------------------------------------------


def _same_path(work, tmp):
    copy = tmp / "copy.npz"
    shutil.copyfile(work["trace"], copy)
    return copy, [copy]


def _dotted_path(work, tmp):
    copy = tmp / "copy.npz"
    shutil.copyfile(work["trace"], copy)
    (tmp / "sub").mkdir()
    return tmp / "sub" / ".." / "copy.npz", [copy]


def _symlink(work, tmp):
    copy = tmp / "copy.npz"
    shutil.copyfile(work["trace"], copy)
    (tmp / "link.npz").symlink_to(copy)
    return tmp / "link.npz", [copy]


def _hard_link(work, tmp):
    copy = tmp / "copy.npz"
    shutil.copyfile(work["trace"], copy)
    os.link(copy, tmp / "hard.npz")
    return tmp / "hard.npz", [copy]


def _second_input(work, tmp):
    copy = tmp / "copy.npz"
    shutil.copyfile(work["trace"], copy)
    return copy, [work["trace"], copy]


def _directory(work, tmp):
    (tmp / "dir").mkdir()
    return tmp / "dir", [work["trace"]]


def _missing_directory(work, tmp):
    return tmp / "none" / "m.npz", [work["trace"]]


def _parent_is_a_file(work, tmp):
    (tmp / "file").write_text("x")
    return tmp / "file" / "m.npz", [work["trace"]]


MERGE_OUTPUTS = {
    "same-path": (_same_path, "the output is one of the inputs"),
    "dotted-path": (_dotted_path, "the output is one of the inputs"),
    "symlink": (_symlink, "the output is one of the inputs"),
    "hard-link": (_hard_link, "the output is one of the inputs"),
    "second-input": (_second_input, "the output is one of the inputs"),
    "directory": (_directory, "is a directory"),
    "missing-directory": (_missing_directory, "no such directory"),
    "parent-is-a-file": (_parent_is_a_file, "not a directory"),
}


@pytest.mark.parametrize("case", sorted(MERGE_OUTPUTS))
def test_merge_traces_refuses_an_output_it_cannot_or_must_not_write(work, tmp_path, capsys, case):
    make, words = MERGE_OUTPUTS[case]
    out, inputs = make(work, tmp_path)
    before = {p: digest(p) for p in inputs} | {work["trace"]: digest(work["trace"])}
    listing = sorted(p.name for p in tmp_path.rglob("*"))
    line = refused(capsys, ["merge-traces", out, *inputs], out)
    assert words in line
    assert {p: digest(p) for p in before} == before  # every input byte-identical
    assert sorted(p.name for p in tmp_path.rglob("*")) == listing  # nothing written, no .tmp


@pytest.mark.parametrize("case", ["directory", "missing-directory", "parent-is-a-file"])
def test_generate_trace_output_it_cannot_write(work, tmp_path, capsys, case):
    make, _ = MERGE_OUTPUTS[case]
    out, _ = make(work, tmp_path)
    argv = ["generate", work["model"], "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json"]
    refused(capsys, [*argv, "--trace", out], out)


@pytest.mark.parametrize("case", ["directory", "missing-directory", "parent-is-a-file"])
def test_trace_save_names_a_path_it_cannot_write(work, tmp_path, case):
    make, words = MERGE_OUTPUTS[case]
    out, _ = make(work, tmp_path)
    listing = sorted(tmp_path.rglob("*"))
    with pytest.raises(MoeshardError, match=words) as exc:
        traces.load(work["trace"]).save(out)
    assert str(out) in str(exc.value) and "\n" not in str(exc.value)
    assert sorted(tmp_path.rglob("*")) == listing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory")
def test_trace_save_names_a_directory_it_may_not_write(work, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(MoeshardError, match="cannot write") as exc:
            traces.load(work["trace"]).save(locked / "t.npz")
        assert str(locked / "t.npz") in str(exc.value)
    finally:
        locked.chmod(0o755)


def test_merge_traces_still_writes_and_replaces_a_file(work, tmp_path, capsys):
    out = tmp_path / "m.npz"
    out.write_bytes(b"old")
    assert main(["merge-traces", str(out), str(work["trace"]), str(work["trace"])]) == 0
    capsys.readouterr()
    merged = traces.load(out)
    assert merged.meta["runs"] == 2
    assert len(merged.layer) == 2 * len(traces.load(work["trace"]).layer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz"]  # no temporary left


# -- 4. simulate's numeric options ------------------------------------------------------------

SIMULATE_BAD = [
    ("--memory-gbps", "0"),
    ("--memory-gbps", "-1"),
    ("--memory-gbps", "nan"),
    ("--memory-gbps", "inf"),
    ("--kernel-gbps", "0"),
    ("--kernel-gbps", "-1"),
    ("--kernel-gbps", "nan"),
    ("--kernel-gbps", "inf"),
    ("--prefetch-recall", "2"),
    ("--prefetch-recall", "-1"),
    ("--prefetch-recall", "1.5"),
    ("--prefetch-recall", "nan"),
    ("--depth", "0"),
    ("--depth", "-1"),
]


@pytest.mark.parametrize(("option", "value"), SIMULATE_BAD)
def test_simulate_refuses_an_option_out_of_range(work, capsys, option, value):
    argv = ["simulate", work["trace"], "--geometry", work["model"], option, value]
    refused(capsys, argv, option, value)


@pytest.mark.parametrize(
    ("option", "value"),
    [("--prefetch-recall", "0"), ("--prefetch-recall", "1"), ("--depth", "1")]
    + [("--kernel-gbps", "0.5"), ("--memory-gbps", "1e3")],
)
def test_simulate_accepts_the_edges(work, capsys, option, value):
    argv = ["simulate", str(work["trace"]), "--geometry", str(work["model"]), option, value]
    assert main(argv) == 0
    assert "s/token" in capsys.readouterr().out


def test_simulate_validate_refuses_a_prompt_that_is_not_ids(work, capsys):
    refused(capsys, ["simulate", "--validate", work["model"], "abc"], "abc")


# -- 5. model_type that is not a string -------------------------------------------------------

CHECKPOINT_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
]


def _set_model_type(config: Path, value) -> None:
    raw = json.loads(config.read_text())
    raw["model_type"] = value
    config.write_text(json.dumps(raw))


@pytest.mark.parametrize("value", [["qwen3_moe"], {"name": "qwen3_moe"}, [], 5, True])
def test_convert_refuses_a_model_type_that_is_not_a_string(tmp_path, capsys, value):
    src = tmp_path / "src"
    src.mkdir()
    for name in CHECKPOINT_FILES:
        if (DEMO / name).exists():
            shutil.copyfile(DEMO / name, src / name)
    _set_model_type(src / "config.json", value)
    out = tmp_path / "out"
    refused(capsys, ["convert", src, out, "--quiet"], src / "config.json", "model_type")
    assert not out.exists()


@pytest.mark.parametrize("value", [["qwen3_moe"], {"name": "qwen3_moe"}])
def test_a_model_directory_with_a_model_type_that_is_not_a_string(work, tmp_path, capsys, value):
    """A converted model's config.json is covered by its model id: an edit is refused as such
    (one line naming config.json), before model_type is looked at."""
    model = tmp_path / "model"
    shutil.copytree(work["model"], model)
    _set_model_type(model / "config.json", value)
    refused(capsys, ["inspect", model], model / "config.json")
