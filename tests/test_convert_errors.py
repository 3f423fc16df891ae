"""Bad checkpoints: one clear line naming the file/tensor, exit code 2, nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import FIXTURES
from safetensors.numpy import load_file, save_file

from moeshard.cli import main

SRC = FIXTURES / "qwen3_moe"


def copy_checkpoint(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(SRC, dst)
    return dst


def run_convert(capsys, src: Path, out: Path, *extra: str) -> tuple[int, str]:
    code = main(["convert", str(src), str(out), "--quiet", "--experts", "f32", *extra])
    return code, capsys.readouterr().err


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    assert leftovers == []


def edit_config(src: Path, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))


def edit_weights(src: Path, edit) -> None:
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, src / "model.safetensors")


def test_missing_config_field(tmp_path, capsys):
    src, out = copy_checkpoint(tmp_path), tmp_path / "out"
    edit_config(src, num_attention_heads=None)
    code, err = run_convert(capsys, src, out)
    assert code == 2
    assert "config.json" in err and "missing required field 'num_attention_heads'" in err
    assert err.count("\n") == 1
    assert_nothing_left(out)


def test_unsupported_model_type(tmp_path, capsys):
    src, out = copy_checkpoint(tmp_path), tmp_path / "out"
    edit_config(src, model_type="llama")
    code, err = run_convert(capsys, src, out)
    assert code == 2
    assert "unsupported model_type 'llama'" in err and "qwen3_moe" in err and "deepseek_v3" in err
    assert_nothing_left(out)


def test_missing_tensor(tmp_path, capsys):
    src, out = copy_checkpoint(tmp_path), tmp_path / "out"
    edit_weights(src, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    code, err = run_convert(capsys, src, out)
    assert code == 2
    assert "missing tensor 'model.layers.1.self_attn.k_proj.weight'" in err
    assert_nothing_left(out)


def test_missing_expert(tmp_path, capsys):
    src, out = copy_checkpoint(tmp_path), tmp_path / "out"
    names = load_file(src / "model.safetensors").keys()
    stacked = [n for n in names if "layers.0.mlp.experts." in n]
    edit_weights(src, lambda t: t.pop(stacked[0]))
    code, err = run_convert(capsys, src, out)
    assert code == 2 and "layer 0" in err and "missing tensor" in err
    assert_nothing_left(out)


def test_misshaped_tensor(tmp_path, capsys):
    src, out = copy_checkpoint(tmp_path), tmp_path / "out"
    name = "model.layers.0.self_attn.o_proj.weight"

    def shrink(t):
        t[name] = np.ascontiguousarray(t[name][:, :-1])

    edit_weights(src, shrink)
    code, err = run_convert(capsys, src, out)
    assert code == 2
    assert f"model.safetensors:{name}: shape" in err and "expected" in err
    assert_nothing_left(out)


def test_truncated_shard(tmp_path, capsys):
    src, out = copy_checkpoint(tmp_path), tmp_path / "out"
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, err = run_convert(capsys, src, out)
    assert code == 2
    assert "model.safetensors" in err and "truncated" in err
    assert_nothing_left(out)


def test_garbage_shard(tmp_path, capsys):
    src, out = copy_checkpoint(tmp_path), tmp_path / "out"
    (src / "model.safetensors").write_bytes(b"\xff" * 64)
    code, err = run_convert(capsys, src, out)
    assert code == 2 and "model.safetensors" in err and "safetensors" in err
    assert_nothing_left(out)


def test_index_names_missing_file(tmp_path, capsys):
    src, out = tmp_path / "ds", tmp_path / "out"
    shutil.copytree(FIXTURES / "deepseek_v3", src)
    (src / "model-00002-of-00002.safetensors").unlink()
    code, err = run_convert(capsys, src, out)
    assert code == 2 and "model-00002-of-00002.safetensors" in err
    assert_nothing_left(out)


def test_existing_output_is_kept(tmp_path, capsys):
    src, out = SRC, tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_convert(capsys, src, out)
    assert code == 2 and "already exists" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_failure_midway_removes_temporary_directory(tmp_path, capsys, monkeypatch):
    """A crash while writing (here: an I/O error no real disk here can be made to give) leaves
    neither OUT nor the temporary dir. A real full disk: tests/test_convert_faults.py."""
    from moeshard.moe.storage import gguf_file

    def io_error(self, data):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(gguf_file.StreamingGGUF, "write", io_error)
    out = tmp_path / "out"
    with pytest.raises(OSError):
        main(["convert", str(SRC), str(out), "--quiet"])
    assert_nothing_left(out)
