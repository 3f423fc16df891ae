"""Conversion streams tensor by tensor: peak memory does not grow with the checkpoint."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT

PEAK_RSS = (
    "import resource, sys\n"
    "from moeshard.moe.kernels import quant\n"
    "from moeshard.moe.convert.converter import convert\n"
    "quant.warmup()\n"
    "if len(sys.argv) > 1: convert(sys.argv[1], sys.argv[2], 'q4_0', 'bf16', progress=False)\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
)


def peak_rss(*args: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *args],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_peak_memory_is_bounded_by_one_tensor_not_the_checkpoint(tmp_path):
    src = tmp_path / "big-hf"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/make_big_checkpoint.py"), str(src), "--layers", "3"]
        + ["--experts", "16", "--hidden", "512", "--inter", "512", "--vocab", "2048"],
        check=True,
        capture_output=True,
    )
    checkpoint_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert checkpoint_bytes > 70e6
    baseline = peak_rss()  # first: a cold numba cache is compiled (and its memory spent) here
    growth = peak_rss(str(src), str(tmp_path / "out")) - baseline
    # The largest tensor is 4 MB (bf16 embeddings, 8 MB as float32); allow packing scratch.
    assert growth < 40e6, (
        f"peak RSS grew {growth / 1e6:.0f} MB for a {checkpoint_bytes / 1e6:.0f} MB checkpoint"
    )
    assert (tmp_path / "out" / "moeshard.json").exists()
