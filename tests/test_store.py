"""The model directory's GGUF files: what they hold, and refusal of bad or foreign files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGUFReader
from helpers import flip_byte

from moeshard.cli import main
from moeshard.moe.errors import StoreError
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.kernels import quant
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.gguf_file import ALIGNMENT
from moeshard.moe.storage.manifest import FORMAT_VERSION


@pytest.fixture
def model(converted, tmp_path):
    """A private copy of a q4_0 conversion, safe to damage."""
    dst = tmp_path / "model"
    shutil.copytree(converted("qwen3_moe", experts="q4_0", trunk="bf16"), dst)
    return dst


def shard_path(model):
    return model / json.loads((model / "moeshard.json").read_text())["expert_files"][0]


def test_files_are_gguf_with_aligned_records_and_index(model):
    reader = GGUFReader(shard_path(model))
    assert reader.get_field("general.alignment").contents() == ALIGNMENT
    assert reader.get_field("moeshard.format_version").contents() == FORMAT_VERSION
    layers = reader.get_field("moeshard.experts.layer").contents()
    experts = reader.get_field("moeshard.experts.expert").contents()
    offsets = reader.get_field("moeshard.experts.offset").contents()
    by_name = {t.name: t for t in reader.tensors}
    for layer, expert, offset in zip(layers, experts, offsets, strict=True):
        tensor = by_name[f"blk.{layer}.expert.{expert}"]
        assert tensor.data_offset == reader.data_offset + offset
        assert (reader.data_offset + offset) % ALIGNMENT == 0
    opened = ModelDir(model)
    record = opened.shard_set.read(0, 0)
    assert record.nbytes == quant.expert_record_nbytes("q4_0", 64, 32)


def test_inspect_reports_geometry_and_verifies(model, capsys):
    assert main(["inspect", str(model), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "8 per MoE layer" in out and "2 active" in out
    assert "checksums ok" in out and "experts q4_0" in out


def test_wrong_magic(model):
    path = shard_path(model)
    data = bytearray(path.read_bytes())
    data[:4] = b"XXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"{path.name}: not a GGUF file"):
        ModelDir(model)


def test_unknown_version(model):
    path = shard_path(model)
    reader = GGUFReader(path, "r+")
    reader.get_field("moeshard.format_version").parts[-1][0] = 99
    reader.data.flush()
    del reader
    with pytest.raises(StoreError, match=f"{path.name}: moeshard format version 99"):
        ModelDir(model)


def test_truncated_record(model):
    path = shard_path(model)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 5000)
    with pytest.raises(StoreError, match=rf"{path.name}: truncated: expert \d+ of layer \d+"):
        ModelDir(model)


def test_checksum_mismatch_names_the_expert(model, capsys):
    path = shard_path(model)
    opened = ModelDir(model)
    loc = opened.shards[0].records[(1, 5)]
    opened.close()
    flip_byte(path, loc.offset + 100)
    experts = LocalExperts(ModelDir(model).shard_set)
    experts.offset(1, 4)  # the neighbour is fine
    with pytest.raises(StoreError, match=f"{path.name}: checksum mismatch in expert 5 of layer 1"):
        experts.offset(1, 5)
    assert main(["inspect", str(model), "--verify"]) == 2
    assert "BAD checksums: layer 1 expert 5" in capsys.readouterr().out


def test_model_id_mismatch(model, converted):
    """A shard from another conversion (same geometry, other weights) is refused."""
    other = converted("qwen3_moe", experts="q4_0", trunk="f32")  # other trunk -> other id
    shutil.copyfile(shard_path(other), shard_path(model))
    with pytest.raises(StoreError, match="does not match the directory"):
        ModelDir(model)


def test_missing_manifest(model):
    (model / "moeshard.json").unlink()
    with pytest.raises(StoreError, match="not a moeshard model directory"):
        ModelDir(model)


@pytest.mark.parametrize("experts", ["q4_0", "q8_0", "bf16"])
def test_quantised_experts_track_f32(converted, experts):
    """Each expert format runs end to end; its logits stay close to the f32 conversion's."""
    from moeshard.coordinator.runtime import open_local

    ids = np.array([294, 221, 81, 85, 288, 75, 263])
    logits = {}
    for fmt in ("f32", experts):
        rt = open_local(converted("qwen3_moe", experts=fmt))
        logits[fmt] = rt.transformer.forward(ids, rt.transformer.new_cache(8))
    error = np.abs(logits[experts] - logits["f32"]).max()
    bound = {"q4_0": 2.0, "q8_0": 0.2, "bf16": 0.05}[experts]  # logit range is ~25
    assert 0 < error < bound


def test_truncated_trunk(model):
    from moeshard.coordinator.runtime import open_local

    path = model / "trunk.gguf"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10000)
    with pytest.raises(StoreError, match="trunk.gguf: truncated: trunk tensor"):
        open_local(model)


def test_add_rows_matches_np_add_at_with_and_without_repeats():
    from moeshard.moe.experts.compute import add_rows

    rng = np.random.default_rng(0)
    for rows in (np.array([0, 2, 3]), np.array([1, 1, 3]), np.array([2])):
        terms = rng.standard_normal((rows.size, 5)).astype(np.float32)
        want = np.zeros((4, 5))
        np.add.at(want, rows, terms)
        got = np.zeros((4, 5))
        add_rows(got, rows, terms)
        np.testing.assert_array_equal(got, want)
