"""Writers on a real full disk, models with cut-off files, and convert's progress (issue 16).

A full disk is a real, small tmpfs (mounting needs root: CI runs the suite as root); a file
size limit is a real RLIMIT_FSIZE in a child process, which also makes the kernel return a
short write first. Every failure is one line naming the file, exit 2, and leaves nothing.
"""

from __future__ import annotations

import io
import os
import re
import resource
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from moeshard.cli import main
from moeshard.moe.convert.converter import Progress, convert

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo-hf"  # converts to ~10.6 MB: trunk 4.8 MB, experts 5.5 MB


@contextmanager
def tmpfs(where: Path, size: str):
    """A real tmpfs of `size` mounted at `where` (unmounted on the way out)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root; CI runs as root")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def assert_empty(mnt: Path) -> None:
    """Nothing left on the filesystem: no names, and no space held by unlinked open files."""
    assert sorted(p.name for p in mnt.iterdir()) == []
    st = os.statvfs(mnt)
    assert st.f_bfree == st.f_blocks


def assert_one_line(err: str, *parts: str) -> None:
    assert err.count("\n") == 1 and err.startswith("moeshard: error: "), err
    assert "Traceback" not in err
    for part in parts:
        assert part in err, (part, err)


@pytest.fixture(scope="module")
def demo_model(demo) -> Path:
    """models/demo-hf converted (q4_0 experts, bf16 trunk): the session's (tests copy it
    before they change anything)."""
    return demo


# -- 1. a disk that fills up ------------------------------------------------------------------


@pytest.mark.parametrize(("size", "cut"), [("2M", "trunk.gguf"), ("8M", "experts-00000.gguf")])
def test_convert_on_a_full_disk(tmp_path, capsys, size, cut):
    with tmpfs(tmp_path / "mnt", size) as mnt:
        out = mnt / "out"
        rc = main(["convert", str(DEMO), str(out), "--quiet"])
        captured = capsys.readouterr()
        assert rc == 2
        assert captured.out == ""
        writing = f"no space left on device writing {mnt / '.out.tmp-convert' / cut};"
        assert_one_line(captured.err, writing, f"{out} not written")
        assert_empty(mnt)


def test_convert_force_on_a_full_disk_keeps_the_old_output(tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", "16M") as mnt:  # room for one conversion, not two
        out = mnt / "out"
        assert main(["convert", str(DEMO), str(out), "--quiet"]) in (0, None)
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        free = os.statvfs(mnt).f_bfree
        capsys.readouterr()
        rc = main(["convert", str(DEMO), str(out), "--quiet", "--force"])
        err = capsys.readouterr().err
        assert rc == 2
        assert_one_line(err, "no space left on device writing ", f"{out} left as it was")
        assert sorted(p.name for p in mnt.iterdir()) == ["out"]
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert os.statvfs(mnt).f_bfree == free  # the partial new tree is gone, space and all


def test_convert_on_a_full_disk_in_a_subprocess(tmp_path):
    with tmpfs(tmp_path / "mnt", "8M") as mnt:
        out = mnt / "out"
        done = subprocess.run(
            [sys.executable, "-m", "moeshard", "convert", str(DEMO), str(out)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        path = mnt / ".out.tmp-convert" / "experts-00000.gguf"
        assert_one_line(done.stderr, f"no space left on device writing {path};")
        assert_empty(mnt)


def test_shard_on_a_full_disk(tmp_path, capsys, demo_model):
    with tmpfs(tmp_path / "mnt", "2M") as mnt:
        out = mnt / "shards"
        rc = main(["shard", str(demo_model), "--nodes", "2", "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2
        assert_one_line(err, "no space left on device writing ", f"{out} not written")
        written = re.search(r"writing (\S+);", err).group(1)
        assert written.startswith(f"{mnt / 'shards.partial'}/node-0")
        assert_empty(mnt)


def test_synth_on_a_full_disk(tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", "1M") as mnt:  # tiny is ~1.9 MB
        out = mnt / "synth"
        rc = main(["synth", str(out), "--preset", "tiny"])
        err = capsys.readouterr().err
        assert rc == 2
        assert_one_line(err, "no space left on device writing ", f"{out} not written")
        assert re.search(r"writing (\S+);", err).group(1).startswith(str(mnt / "synth.partial"))
        assert_empty(mnt)


def test_pack_on_a_full_disk_keeps_the_model(tmp_path, capsys, demo_model):
    """`pack` in place on a disk with no room for the packed copy: the model stays as it was."""
    trace = tmp_path / "trace.npz"
    argv = ["generate", str(demo_model), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
    assert main([*argv, "--trace", str(trace)]) == 0
    with tmpfs(tmp_path / "mnt", "16M") as mnt:  # the model (10.6 MB) fits, a copy does not
        model = mnt / "model"
        shutil.copytree(demo_model, model)
        before = {p.name: p.read_bytes() for p in model.iterdir()}
        free = os.statvfs(mnt).f_bfree
        capsys.readouterr()
        assert main(["pack", str(model), "--trace", str(trace)]) == 2
        assert_one_line(capsys.readouterr().err, "no space left on device writing ", "left as")
        assert sorted(p.name for p in mnt.iterdir()) == ["model"]
        assert {p.name: p.read_bytes() for p in model.iterdir()} == before
        assert os.statvfs(mnt).f_bfree == free
        assert main(["pack", str(model), "--trace", str(trace), "--out", str(model)]) == 2
        assert "the output is the input" in capsys.readouterr().err


def _limit_file_size(nbytes: int):
    def apply() -> None:  # in the child: Python ignores SIGXFSZ, so writes fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def test_file_size_limit_is_one_line(tmp_path):
    """RLIMIT_FSIZE (no root needed): the write that crosses the limit is cut short by the
    kernel, the rest is retried, and that write fails with EFBIG."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "moeshard", "convert", str(DEMO), str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=_limit_file_size(3 << 20),  # trunk.gguf is 4.8 MB
    )
    assert done.returncode == 2, done.stderr
    path = tmp_path / ".out.tmp-convert" / "trunk.gguf"
    assert_one_line(done.stderr, f"file too large writing {path};", f"{out} not written")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_write_all_continues_a_short_write(tmp_path):
    """The kernel writes up to the limit and returns a short count; write_all goes on, and the
    next write's EFBIG comes back naming the file."""
    path = tmp_path / "f"
    code = (
        "import errno, sys\n"
        "from moeshard.moe.storage.io import write_file\n"
        "try:\n"
        f"    write_file({str(path)!r}, bytes(20000))\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno], e.filename)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=_limit_file_size(12345),
        check=True,
    )
    assert done.stdout.split() == ["EFBIG", str(path)]
    assert path.stat().st_size == 12345  # the short write landed; the rest was refused


# -- 2. cut-off model files -------------------------------------------------------------------


@pytest.mark.parametrize("ram", [False, True], ids=["in-ram", "ram-60M"])
@pytest.mark.parametrize("name", ["trunk.gguf", "experts-00000.gguf"])
def test_truncated_file_refused_before_generating(tmp_path, capsys, demo_model, name, ram):
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    size = (model / name).stat().st_size
    os.truncate(model / name, size // 2)
    argv = ["generate", str(model), "--prompt", "hi", "--max-tokens", "2"]
    rc = main(argv + (["--ram", "60M"] if ram else []))
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""  # nothing generated
    assert_one_line(
        captured.err,
        f"{model / name}: truncated: ",
        f"the file has {size // 2} bytes, expected {size}",
    )


# -- 3. convert's progress --------------------------------------------------------------------


class Terminal(io.StringIO):
    """A text stream that says it is a terminal (what Progress draws on)."""

    def isatty(self) -> bool:
        return True


LINE = re.compile(
    r"^convert \[#*\s*\]\s+([\d.]+)%  ([\d.]+)/([\d.]+) MB  ([\d.]+) MB/s  ETA (\S+)\x1b\[K$"
)


def gguf_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.gguf"))


def test_progress_counts_the_bytes_written(tmp_path):
    """The bar's total is planned before writing and equals, byte for byte, the .gguf files
    written (headers, packed tensors, records, alignment padding); it is redrawn in place."""
    term = Terminal()
    bar = Progress("convert", term)
    convert(DEMO, tmp_path / "out", progress=bar)
    written = gguf_bytes(tmp_path / "out")
    assert bar.done == bar.total == written
    text = term.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    draws = text[:-1].split("\r")[1:]
    assert len(draws) >= 2  # the first (0%) and the last
    shown = [LINE.match(d) for d in draws]
    assert all(shown), draws
    share, done, total, rate, eta = shown[-1].groups()
    assert (share, eta) == ("100.0", "0:00")
    assert done == total == f"{written / 1e6:.1f}"
    assert float(rate) > 0
    assert shown[0].group(1) == "0.0" and shown[0].group(3) == total
    dones = [float(m.group(2)) for m in shown]
    assert dones == sorted(dones)


def test_progress_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    # piped (pytest's capture is not a terminal): the summary on stdout, nothing on stderr
    assert main(["convert", str(DEMO), str(tmp_path / "a")]) in (0, None)
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith(f"converted {DEMO} -> {tmp_path / 'a'}: ")
    # a terminal: the bar; with --quiet: nothing
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["convert", str(DEMO), str(tmp_path / "b")]) in (0, None)
    last = term.getvalue()[:-1].split("\r")[-1]
    written = f"{gguf_bytes(tmp_path / 'b') / 1e6:.1f}"
    assert LINE.match(last).group(2, 3) == (written, written)
    term.seek(0)
    term.truncate()
    assert main(["convert", str(DEMO), str(tmp_path / "c"), "--quiet"]) in (0, None)
    assert term.getvalue() == ""
