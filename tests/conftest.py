"""Shared fixtures: the committed Hugging Face reference checkpoints and their conversions."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from moe.convert.converter import convert

FIXTURES = Path(__file__).parent / "fixtures"
FAMILY_FIXTURES = (
    sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").exists())
    if FIXTURES.exists()
    else []
)
DIALECTS = ("rope_theta", "rope_parameters")


def checkpoint_in_dialect(name: str, dialect: str, tmp: Path) -> Path:
    """The fixture checkpoint with config.json in the requested dialect.

    The committed config.json is the older dialect (rope_theta + rope_scaling, as published
    checkpoints have it); config.rope_parameters.json is the same model as transformers 5
    writes it. For the latter, a copy of the checkpoint gets it as its config.json.
    """
    src = FIXTURES / name
    if dialect == "rope_theta":
        return src
    dst = tmp / f"{name}-{dialect}"
    if not dst.exists():
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in ("config.json", "config.rope_parameters.json", "reference.npz"):
                (dst / f.name).symlink_to(f.resolve())
        shutil.copyfile(src / "config.rope_parameters.json", dst / "config.json")
    return dst


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(fixture, dialect, experts, trunk) -> model directory (converted once)."""
    root = tmp_path_factory.mktemp("converted")
    done: dict[tuple, Path] = {}

    def get(name: str, dialect: str = "rope_theta", experts: str = "f32", trunk: str = "f32"):
        key = (name, dialect, experts, trunk)
        if key not in done:
            src = checkpoint_in_dialect(name, dialect, root)
            out = root / "-".join(key)
            convert(src, out, experts, trunk, progress=False)
            done[key] = out
        return done[key]

    return get


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as ref:
        return {k: ref[k] for k in ref.files}
