"""Checkpoints whose experts are published as compressed-tensors MXFP4 (Kimi K3's layout).

The checkpoint is made here from the committed Qwen3-MoE reference: its experts quantized to
MXFP4 by gguf (`gguf.quants`, an implementation nobody here wrote) and stored as
compressed-tensors stores them (`weight_packed` [out, in / 2] low nibble first,
`weight_scale` [out, in / 32] E8M0).  `convert` must keep those bits (default format mxfp4),
decode them exactly for the other formats, and refuse what it cannot read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from helpers import ROOT

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.convert import mxfp4
from moeshard.moe.convert.checkpoint import Checkpoint, write_safetensors
from moeshard.moe.convert.converter import convert, expert_shapes, plan_conversion
from moeshard.moe.errors import CheckpointError
from moeshard.moe.kernels import quant
from moeshard.moe.model.families import family_for, load_config

FIXTURE = ROOT / "tests" / "fixtures" / "qwen3_moe"
SCHEME = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group"},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
}
PROJS = ("gate_proj", "up_proj", "down_proj")


def make_mxfp4_checkpoint(out: Path, scheme: dict = SCHEME) -> dict:
    """The reference checkpoint with MXFP4 experts; returns {(layer, expert, proj): ggml
    MXFP4 bytes} of what was written."""
    config = load_config(FIXTURE)
    ckpt = Checkpoint(FIXTURE)
    plan = plan_conversion(config, family_for(config.model_type, "config"), ckpt, {})
    tensors, written = {}, {}
    for name in plan.trunk.values():
        raw = ckpt.raw(name)
        tensors[name] = (ckpt.dtype(name), ckpt.shape(name), raw.tobytes())
    for layer in config.moe_layers:
        for expert in range(config.n_experts):
            mats = expert_shapes(config, plan, ckpt, layer, expert)
            for proj, w in zip(PROJS, mats, strict=True):
                rows, cols = w.shape
                g = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType.MXFP4))
                g = g.view(np.uint8).reshape(rows, -1)  # [rows, cols / 32 * 17]
                written[(layer, expert, proj)] = g
                m = mxfp4.from_ggml_blocks(g, rows, cols)
                base = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                tensors[base + ".weight_packed"] = ("U8", m.packed.shape, m.packed.tobytes())
                tensors[base + ".weight_scale"] = ("U8", m.scale.shape, m.scale.tobytes())
    ckpt.close()
    out.mkdir(parents=True)
    write_safetensors(out / "model.safetensors", tensors)
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg["quantization_config"] = scheme
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, out / name)
    return written


@pytest.fixture(scope="module")
def mx_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("mxfp4") / "ckpt"
    return out, make_mxfp4_checkpoint(out)


def test_the_published_layout_round_trips_and_decodes_as_gguf():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 96)).astype(np.float32) * np.float32(3.0)
    w[1] *= np.float32(1e-30)  # tiny scales
    g = np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType.MXFP4)).view(np.uint8)
    m = mxfp4.from_ggml_blocks(g, 5, 96)
    assert m.packed.shape == (5, 48) and m.scale.shape == (5, 3)
    np.testing.assert_array_equal(m.ggml_blocks(), g.reshape(5, -1))
    want = quants.dequantize(g.reshape(5, -1), GGMLQuantizationType.MXFP4).reshape(5, 96)
    np.testing.assert_array_equal(m.float32(), want)
    # low nibble first: element 0 of row 0 is the low nibble of packed byte 0
    assert m.codes()[0, 0] == m.packed[0, 0] & 15 and m.codes()[0, 1] == m.packed[0, 0] >> 4


def test_mxfp4_experts_are_kept_bit_for_bit_by_default(mx_checkpoint, tmp_path):
    src, written = mx_checkpoint
    convert(src, tmp_path / "m", progress=False)
    manifest = json.loads((tmp_path / "m" / "moeshard.json").read_text())
    assert manifest["expert_format"] == "mxfp4"
    rt = open_local(tmp_path / "m")
    config = rt.config
    h, inter = config.hidden_size, config.expert_intermediate
    n_gu = quant.packed_nbytes("mxfp4", inter, h)
    for (layer, expert, proj), g in written.items():
        record = rt.experts.shards.read(layer, expert)
        start = {"gate_proj": 0, "up_proj": n_gu, "down_proj": 2 * n_gu}[proj]
        rows, cols = (inter, h) if proj != "down_proj" else (h, inter)
        part = record[start : start + quant.packed_nbytes("mxfp4", rows, cols)]
        np.testing.assert_array_equal(quant.unpack_to_ggml(part, "mxfp4", rows, cols), g)


def test_mxfp4_model_generates_like_its_exact_decode(mx_checkpoint, tmp_path):
    """The same MXFP4 experts kept as mxfp4 and decoded to f32: with float activations the
    two compute the same values (the decode is exact) up to summation order."""
    src, _ = mx_checkpoint
    convert(src, tmp_path / "mx", trunk_fmt="f32", progress=False)  # experts: mxfp4, the default
    convert(src, tmp_path / "f32", expert_format="f32", trunk_fmt="f32", progress=False)
    convert(src, tmp_path / "q8", expert_format="q8_0", trunk_fmt="f32", progress=False)
    prompt = [5, 17, 99, 200, 31]
    opts = SamplingOptions(max_tokens=8, keep_logits=True)
    quant.use_activations("f32")
    try:
        got = generate(open_local(tmp_path / "mx").transformer, prompt, opts)
    finally:
        quant.use_activations("q8")
    ref = generate(open_local(tmp_path / "f32").transformer, prompt, opts)
    assert got.tokens == ref.tokens
    spread = np.ptp(ref.logits)
    assert np.abs(np.asarray(got.logits) - np.asarray(ref.logits)).max() < 2e-6 * spread  # 1.8e-7
    # and the default 8-bit activations, and a re-quantized q8_0 copy, stay close (4.7e-3, 6e-3)
    q8 = generate(open_local(tmp_path / "mx").transformer, prompt, opts)
    assert np.abs(np.asarray(q8.logits) - np.asarray(ref.logits)).max() < 2e-2 * spread
    requant = generate(open_local(tmp_path / "q8").transformer, prompt, opts)
    assert np.abs(np.asarray(requant.logits) - np.asarray(ref.logits)).max() < 2e-2 * spread


@pytest.mark.parametrize(
    "fmt, message",
    [
        ("nvfp4-pack-quantized", "format nvfp4-pack-quantized; only compressed-tensors"),
        # INT4's format name, but float codes: the INT4 reader checks the weights' arguments
        ("pack-quantized", "weights 'type' 'float'; moeshard reads 'pack-quantized' INT4"),
    ],
)
def test_other_packed_schemes_are_refused(tmp_path, fmt, message):
    scheme = dict(SCHEME, format=fmt)
    scheme["config_groups"] = {"group_0": dict(SCHEME["config_groups"]["group_0"])}
    scheme["config_groups"]["group_0"]["format"] = fmt
    make_mxfp4_checkpoint(tmp_path / "other", scheme)
    with pytest.raises(CheckpointError, match=message):
        convert(tmp_path / "other", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_missing_or_misshapen_scale_is_named(mx_checkpoint, tmp_path):
    src, _ = mx_checkpoint
    ckpt = Checkpoint(src)
    tensors = {n: (ckpt.dtype(n), ckpt.shape(n), ckpt.raw(n).tobytes()) for n in ckpt.names()}
    ckpt.close()
    victim = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    dtype, shape, data = tensors[victim]
    cases = {
        "missing": None,
        "misshapen": (dtype, (shape[0] // 2, shape[1]), data[: len(data) // 2]),
    }
    for label, replacement in cases.items():
        bad = tmp_path / label
        shutil.copytree(src, bad)
        edited = dict(tensors)
        if replacement is None:
            del edited[victim]
        else:
            edited[victim] = replacement
        write_safetensors(bad / "model.safetensors", edited)
        match = "no .*weight_scale beside it" if replacement is None else "weight_scale: shape"
        with pytest.raises(CheckpointError, match=match):
            convert(bad, tmp_path / f"{label}-out", progress=False)
