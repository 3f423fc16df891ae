"""gpt-oss beyond the reference match (tests/test_reference.py runs both fixtures, f32): the
published MXFP4 experts kept bit for bit and matching transformers' own dequantised reading,
the experts' biases and clamped SwiGLU in the kernels, the same bits in RAM, under the
smallest --ram and on 2 nodes, and a config that leaves a field out refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import FIXTURES, reference

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.convert import mxfp4
from moeshard.moe.convert.checkpoint import Checkpoint
from moeshard.moe.convert.converter import convert
from moeshard.moe.errors import ConfigError, MoeshardError
from moeshard.moe.kernels import quant
from moeshard.moe.model.families import load_config
from moeshard.moe.model.model_dir import ModelDir

SRC = FIXTURES / "gpt_oss"
TOLERANCE = 1e-4  # of the reference logit range


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """The released fixture converted with its defaults: MXFP4 experts kept, bf16 trunk."""
    out = tmp_path_factory.mktemp("gpt_oss") / "model"
    convert(SRC, out, trunk_fmt="f32", progress=False)
    return out


def test_the_prompt_is_longer_than_the_window_and_layers_alternate():
    cfg = load_config(SRC)
    assert cfg.layer_windows == (4, 0, 4)
    assert len(reference("gpt_oss")["prompt_ids"]) > 4


def test_published_mxfp4_experts_are_kept_bit_for_bit(kept):
    """Each record's gate, up and down are the published codes and scales (gate_up's rows
    split even/odd), and its biases the published bf16 values."""
    model = ModelDir(kept)
    assert model.expert_format == "mxfp4+bias"
    ckpt = Checkpoint(SRC)
    cfg = model.config
    h, inter = cfg.hidden_size, cfg.expert_intermediate
    n_gu = quant.packed_nbytes("mxfp4", inter, h)
    n_d = quant.packed_nbytes("mxfp4", h, inter)
    for layer, expert in ((0, 0), (1, 3), (2, 1)):
        record = model.shard_set.read(layer, expert)
        e = f"model.layers.{layer}.mlp.experts."
        blocks = ckpt.raw(e + "gate_up_proj_blocks")[expert].reshape(2 * inter, h // 2)
        scales = ckpt.raw(e + "gate_up_proj_scales")[expert]
        for i, part in enumerate((slice(0, None, 2), slice(1, None, 2))):  # gate, up
            want = mxfp4.PackedMxfp4(blocks[part], scales[part]).ggml_blocks()
            got = quant.unpack_to_ggml(record[i * n_gu : (i + 1) * n_gu], "mxfp4", inter, h)
            np.testing.assert_array_equal(got.reshape(want.shape), want)
        down = mxfp4.PackedMxfp4(
            ckpt.raw(e + "down_proj_blocks")[expert].reshape(h, inter // 2),
            ckpt.raw(e + "down_proj_scales")[expert],
        ).ggml_blocks()
        got = quant.unpack_to_ggml(record[2 * n_gu : 2 * n_gu + n_d], "mxfp4", h, inter)
        np.testing.assert_array_equal(got.reshape(down.shape), down)
        gate_up_bias = ckpt.float32(e + "gate_up_proj_bias")[expert]
        tail = record[-4 * (2 * inter + h) :].view(np.float32)
        np.testing.assert_array_equal(tail[:inter], gate_up_bias[0::2])
        np.testing.assert_array_equal(tail[inter : 2 * inter], gate_up_bias[1::2])
        np.testing.assert_array_equal(tail[2 * inter :], ckpt.float32(e + "down_proj_bias")[expert])
    ckpt.close()


def test_kept_mxfp4_matches_transformers_dequantised_reading(kept):
    """With float activations the kept MXFP4 model gives transformers' logits (loaded from
    these files with Mxfp4Config(dequantize=True)) within 1e-4 of the range."""
    ref = reference("gpt_oss")
    span = float(ref["prefill_logits"].max() - ref["prefill_logits"].min())
    before = quant.activation_mode()
    quant.use_activations("f32")
    try:
        model = open_local(kept).transformer
        logits = model.forward(ref["prompt_ids"], model.new_cache(64))  # [T, V]
        result = generate(
            model,
            [int(t) for t in ref["prompt_ids"]],
            SamplingOptions(max_tokens=len(ref["greedy_ids"]), keep_logits=True),
        )
    finally:
        quant.use_activations(before)
    assert float(np.abs(logits - ref["prefill_logits"]).max()) <= TOLERANCE * span
    assert result.tokens == [int(t) for t in ref["greedy_ids"]]
    assert float(np.abs(np.stack(result.logits) - ref["greedy_logits"]).max()) <= TOLERANCE * span


def test_two_nodes_and_the_smallest_budget_give_the_same_bits(kept, tmp_path):
    """Records with biases on the wire and through the streaming store: the same tokens and
    logits bits through 2 nodes and under the smallest --ram as in RAM (8-bit activations)."""
    from helpers import same_bits_everywhere

    prompt = [int(t) for t in reference("gpt_oss")["prompt_ids"]]
    assert same_bits_everywhere(kept, prompt, tmp_path / "shards").trunk_streamed


def test_biased_records_and_the_clamped_swiglu_in_every_kernel():
    """Every expert entry point adds the record's biases and applies gpt-oss's gated unit as
    the float64 twin does, and gives a row the same bits alone or with others."""
    rng = np.random.default_rng(5)
    h, inter = 64, 96
    glu = quant.clamped_swiglu(1.702, 7.0)
    for fmt in ("f32+bias", "mxfp4+bias", "q4_0+bias", "q8_0/q4_0+bias"):
        records = []
        for _ in range(3):
            gate, up = (rng.standard_normal((inter, h)).astype(np.float32) for _ in range(2))
            down = rng.standard_normal((h, inter)).astype(np.float32) * 0.1
            biases = tuple(rng.standard_normal(n).astype(np.float32) for n in (inter, inter, h))
            records.append(quant.pack_expert(gate, up, down, fmt, biases))
        x = rng.standard_normal((3, h)).astype(np.float32) * 2  # [3, H]: some gates clamped
        y = quant.expert_ffn(records[0], fmt, h, inter, x, glu)
        want = quant.expert_ffn_reference(records[0], fmt, h, inter, x, glu)
        assert float(np.abs(y - want).max()) <= 1e-6 * float(np.abs(want).max())
        arena, n = np.concatenate(records), records[0].size
        alone = np.stack(
            [quant.expert_ffn(records[e], fmt, h, inter, x[e : e + 1], glu)[0] for e in range(3)]
        )
        np.testing.assert_array_equal(
            quant.experts_ffn_b1(arena, [0, n, 2 * n], fmt, h, inter, x, glu), alone
        )
        rows = quant.experts_ffn_rows(arena, [0, n], fmt, h, inter, x, [0, 1, 3], glu)
        np.testing.assert_array_equal(rows[0], alone[0])
        np.testing.assert_array_equal(
            rows[1:], quant.expert_ffn(records[1], fmt, h, inter, x[1:], glu)
        )


def test_the_gated_unit_is_gpt_oss_definition():
    """(clip(up, -limit, limit) + 1) * g sigmoid(alpha g), g = min(gate, limit); a nan stays."""
    g = np.array([[-9.0, -1.0, 0.0, 0.5, 6.9, 7.0, 20.0, np.nan]], np.float32)
    u = np.array([[-20.0, -7.0, 0.0, 1.0, 3.0, 7.5, -0.5, 1.0]], np.float32)
    got = quant.gated_unit(g, u, quant.clamped_swiglu(1.702, 7.0))
    gc, uc = np.minimum(g.astype(np.float64), 7.0), np.clip(u.astype(np.float64), -7.0, 7.0)
    want = (uc + 1) * gc / (1 + np.exp(-1.702 * gc))
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6, equal_nan=True)


def test_a_record_format_without_biases_is_refused(kept, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(kept, model)
    manifest = json.loads((model / "moeshard.json").read_text())
    manifest["expert_format"] = "mxfp4"
    (model / "moeshard.json").write_text(json.dumps(manifest))
    with pytest.raises(MoeshardError, match=r"have biases.*\+bias"):
        ModelDir(model)


def with_config(tmp_path, edit):
    raw = json.loads((SRC / "config.json").read_text())
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    "field", ["swiglu_limit", "layer_types", "sliding_window", "head_dim", "attention_bias"]
)
def test_a_missing_field_is_named(tmp_path, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(with_config(tmp_path, lambda raw: raw.pop(field)))


def test_layer_types_are_checked_and_alpha_defaults_as_transformers(tmp_path):
    def bad(raw):
        raw["layer_types"][1] = "linear_attention"

    with pytest.raises(ConfigError, match="'linear_attention'"):
        load_config(with_config(tmp_path, bad))
    assert "swiglu_alpha" not in json.loads((SRC / "config.json").read_text())  # as released
    assert load_config(SRC).expert_glu == quant.clamped_swiglu(1.702, 7.0)


def test_inspect_describes_gpt_oss(kept):
    from moeshard.moe.model.report import describe

    text, _ = describe(kept)
    assert "window 4 on 0,2, full on 1 (4/2 heads of 16, a sink per head)" in text
    assert "clamped SwiGLU (alpha 1.702, limit 7)" in text and "mxfp4+bias" in text
