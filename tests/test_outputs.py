"""Writers never delete what they did not create (issue 16): `convert`, `shard` and `synth`
refuse an output that is, contains or lies inside an input, and `--force` replaces only an
earlier output of the same kind (or an empty directory), atomically."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from helpers import FIXTURES

from moeshard.cli import main


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `root` (what must not change)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def ckpt(tmp_path) -> Path:
    dst = tmp_path / "parent" / "ckpt"
    shutil.copytree(FIXTURES / "qwen3_moe", dst)
    (dst / "notes.txt").write_text("the user's own file\n")
    return dst


def cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    return code, err


def convert(capsys, src, out, *extra):
    return cli(capsys, "convert", src, out, "--quiet", "--experts", "f32", *extra)


@pytest.mark.parametrize("where", ["itself", "its parent", "inside it"])
def test_convert_refuses_an_output_that_is_contains_or_is_inside_its_input(capsys, ckpt, where):
    out = {"itself": ckpt, "its parent": ckpt.parent, "inside it": ckpt / "out"}[where]
    before = tree_digest(ckpt.parent)
    code, err = convert(capsys, ckpt, out, "--force")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and str(out) in err
    assert tree_digest(ckpt.parent) == before, "an input file changed"


def test_force_replaces_only_a_model_directory_or_an_empty_one(capsys, ckpt, tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8 not a model")
    code, err = convert(capsys, ckpt, foreign, "--force")
    assert code == 2 and "not a model directory" in err, err
    assert (foreign / "cat.jpg").read_bytes() == b"\xff\xd8 not a model"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert(capsys, ckpt, empty, "--force")[0] == 0
    assert (empty / "moeshard.json").is_file()

    code, err = convert(capsys, ckpt, empty)  # an earlier output: only with --force
    assert code == 2 and "--force" in err
    assert convert(capsys, ckpt, empty, "--force")[0] == 0
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".empty")]
    assert leftovers == [], "the old tree or the temporary one was left behind"


def test_shard_never_replaces_its_model_or_another_directory(capsys, ckpt, tmp_path):
    model = tmp_path / "model"
    assert convert(capsys, ckpt, model)[0] == 0
    before = tree_digest(model)
    code, err = cli(capsys, "shard", model, "--nodes", "2", "--out", model, "--force")
    assert code == 2 and "is the input" in err, err
    assert tree_digest(model) == before and (model / "trunk.gguf").is_file()

    # a model directory is not a shard set: --force does not replace it either
    other = tmp_path / "other-model"
    assert convert(capsys, ckpt, other)[0] == 0
    code, err = cli(capsys, "shard", model, "--nodes", "2", "--out", other, "--force")
    assert code == 2 and "not a shard set" in err, err
    assert (other / "trunk.gguf").is_file()

    shards = tmp_path / "shards"
    assert cli(capsys, "shard", model, "--nodes", "2", "--out", shards)[0] == 0
    assert cli(capsys, "shard", model, "--nodes", "3", "--out", shards, "--force")[0] == 0
    assert sorted(p.name for p in shards.iterdir() if p.is_dir()) == [
        "coordinator",
        "node-00",
        "node-01",
        "node-02",
    ]
    assert tree_digest(model) == before


def test_an_output_under_a_file_or_a_shard_set_of_empty_nodes_is_refused(tmp_path, capsys):
    from moeshard.cli import main

    (tmp_path / "file").write_text("x")
    model = tmp_path / "model"
    assert main(["convert", "models/demo-hf", str(model), "--quiet"]) in (0, None)
    capsys.readouterr()
    assert main(["convert", "models/demo-hf", str(tmp_path / "file" / "a" / "b")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["shard", str(model), "--nodes", "1000000", "--out", str(tmp_path / "s")]) == 2
    assert "more than the model's 192 expert records" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "model"]
