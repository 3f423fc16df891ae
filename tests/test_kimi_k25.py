"""Kimi K2.5 beyond the reference match (tests/test_reference.py): its INT4 experts become q4_0
with the very bits compressed-tensors decodes them to, the model runs the same through RAM,
a RAM budget and two nodes, transformers' save_pretrained names convert to the same model,
and what moeshard cannot keep exactly is refused by name.

The fixture (tools/make_kimi_k25_fixture.py) packed its experts with compressed-tensors'
own `PackedQuantizationCompressor` and stored what its `decompress` gives back
(int4_decoded.npz): with float32 scales, and with the published bf16 scales (the package
then rounds each product to bf16)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import FIXTURES, reference

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.convert import int4
from moeshard.moe.convert.checkpoint import Checkpoint, write_safetensors
from moeshard.moe.convert.converter import convert
from moeshard.moe.errors import CheckpointError, ConfigError
from moeshard.moe.kernels import quant
from moeshard.moe.model.families import load_config

SRC = FIXTURES / "kimi_k25"
PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """The fixture converted with the default formats (q4_0 experts, bf16 trunk)."""
    out = tmp_path_factory.mktemp("k25") / "q4"
    convert(SRC, out, progress=False)
    return out


def tensors_of(src) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    ckpt = Checkpoint(src)
    try:
        return {n: (ckpt.dtype(n), ckpt.shape(n), ckpt.raw(n).tobytes()) for n in ckpt.names()}
    finally:
        ckpt.close()


def copy_with(tmp_path, tensors=None, config=None, name="ckpt"):
    """A copy of the fixture with other tensors and/or another config.json."""
    out = tmp_path / name
    out.mkdir()
    for f in SRC.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    write_safetensors(out / "model.safetensors", tensors or tensors_of(SRC))
    raw = config or json.loads((SRC / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(raw))
    return out


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even (as torch rounds)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_int4_experts_become_q4_0_with_compressed_tensors_bits(q4):
    """Each matrix compressed-tensors decoded: moeshard's q4_0 record decodes to the same
    float32 bits (its decode with float32 scales), and to the package's own bf16 output once
    rounded to bf16; the spec's arithmetic in numpy (`PackedInt4.float32`) agrees."""
    decoded = np.load(SRC / "int4_decoded.npz")
    rt = open_local(q4)
    c = rt.config
    h, inter = c.hidden_size, c.expert_intermediate
    n_gu = quant.packed_nbytes("q4_0", inter, h)
    ckpt = Checkpoint(SRC)
    names = [n for n in decoded.files if not n.endswith(":bf16")]
    assert len(names) == 6
    for name in names:
        layer, expert, proj = int(name.split(".")[3]), int(name.split(".")[6]), name.split(".")[7]
        record = rt.experts.shards.read(layer, expert)
        start = {"gate_proj": 0, "up_proj": n_gu, "down_proj": 2 * n_gu}[proj]
        rows, cols = (inter, h) if proj != "down_proj" else (h, inter)
        part = record[start : start + quant.packed_nbytes("q4_0", rows, cols)]
        ours = quant.dequantize(
            quant.unpack_to_ggml(part, "q4_0", rows, cols), "q4_0", (rows, cols)
        )
        theirs = decoded[name]
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
        np.testing.assert_array_equal(bf16_bits(ours), decoded[name + ":bf16"].view(np.uint16))
        assert (bf16_bits(ours) != bf16_bits(theirs)).sum() == 0
        spec = int4.PackedInt4(
            ckpt.raw(name + int4.PACKED), ckpt.float32(name + int4.SCALE)
        ).float32()
        np.testing.assert_array_equal(spec.view(np.uint32), theirs.view(np.uint32))
    ckpt.close()
    manifest = json.loads((q4 / "moeshard.json").read_text())
    assert manifest["expert_format"] == "q4_0"
    vision = [n for n, why in manifest["skipped_tensors"].items() if "vision tower" in why]
    assert any(n.startswith("vision_tower.") for n in vision)
    assert any(n.startswith("mm_projector.") for n in vision)


def test_the_package_rounds_its_bf16_products():
    """Why the comparison above is against the float32 decode: with the bf16 scales it
    publishes, compressed-tensors' own decode rounds scale * q to bf16 for many weights."""
    decoded = np.load(SRC / "int4_decoded.npz")
    name = "language_model.model.layers.1.mlp.experts.0.gate_proj"
    exact = decoded[name]
    shipped = (decoded[name + ":bf16"].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert (shipped != exact).mean() > 0.05


def test_the_packing_is_compressed_tensors_order():
    """Code i of a row sits at bits 4i of the row's little-endian int32 words; value =
    scale * (code - 8); the q4_0 block is d, then code j | code j + 16 << 4."""
    codes = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16  # [1, 64]
    packed = int4.pack_codes(codes)
    assert packed.dtype == np.dtype("<i4") and packed.shape == (1, 8)
    assert int(packed.view(np.uint32)[0, 0]) == 0x76543210
    m = int4.PackedInt4(packed, np.array([[0.5, -2.0]], dtype=np.float32))
    np.testing.assert_array_equal(m.codes(), codes)
    np.testing.assert_array_equal(m.float32()[0, :3], [-4.0, -3.5, -3.0])
    blocks = m.ggml_blocks().reshape(2, 18)
    assert blocks[0, :2].view("<f2")[0] == 0.5 and blocks[1, :2].view("<f2")[0] == -2.0
    assert blocks[0, 2] == codes[0, 0] | codes[0, 16] << 4
    g = quant.dequantize(m.ggml_blocks(), "q4_0", (1, 64))
    np.testing.assert_array_equal(g, m.float32())


def test_scales_float16_cannot_hold_are_found():
    """bf16 keeps 8 significant bits at any exponent, float16 10 bits from 2^-14 to 65504 and
    multiples of 2^-24 below: a scale below 2^-17 with low bits, or above 65504, is not
    kept; those float16 holds (its subnormals included) are, and decode the same."""
    scales = np.array([[2.0**-14, 3 * 2.0**-24, 1e-3, 65504.0, 1.5 * 2.0**-24, 70000.0]],
                      dtype=np.float32)  # fmt: skip
    scales = (bf16_bits(scales).astype(np.uint32) << 16).view(np.float32)  # bf16 values
    rng = np.random.default_rng(0)
    m = int4.PackedInt4(int4.pack_codes(rng.integers(0, 16, (1, 192), dtype=np.uint8)), scales)
    assert m.inexact().tolist() == [[False, False, False, True, True, True]]
    with pytest.raises(int4.InexactScales, match="3 of 6 INT4 groups"):
        m.ggml_blocks()
    exact = int4.PackedInt4(m.packed[:, :12], scales[:, :3])
    g = quant.dequantize(exact.ggml_blocks(), "q4_0", (1, 96))
    np.testing.assert_array_equal(g.view(np.uint32), exact.float32().view(np.uint32))


def test_ram_a_budget_and_two_nodes_give_the_same_bits(q4, tmp_path):
    from helpers import same_bits_everywhere

    prompt = [int(t) for t in reference("kimi_k25")["prompt_ids"]]
    same_bits_everywhere(q4, prompt, tmp_path / "shards", 2, 1)


def test_q4_0_generates_the_reference_tokens(q4):
    """The kept INT4 bits, with the default 8-bit activations and bf16 trunk (as published):
    transformers' greedy tokens, logits close."""
    ref = reference("kimi_k25")
    prompt = [int(t) for t in ref["prompt_ids"]]
    opts = SamplingOptions(max_tokens=len(ref["greedy_ids"]), keep_logits=True)
    got = generate(open_local(q4).transformer, prompt, opts)
    assert got.tokens == [int(t) for t in ref["greedy_ids"]]
    span = float(np.ptp(ref["prefill_logits"]))
    assert np.abs(np.stack(got.logits) - ref["greedy_logits"]).max() < 2e-2 * span


def test_save_pretrained_names_convert_to_the_same_model(q4, tmp_path):
    """The names transformers 5.25's save_pretrained writes (``language_model.model.blocks.N``,
    ``model.mm_projector.``: recorded by the fixture script from its output) with the config it
    writes: the same trunk and experts, the same logits bits."""
    renamed = json.loads((SRC / "meta.json").read_text())["save_pretrained_names"]
    assert any(".blocks." in v for v in renamed.values())

    def saved(name: str) -> str:  # (the INT4 parts are named after their .weight)
        for suffix in (int4.PACKED, int4.SCALE, int4.SHAPE):
            weight = name[: -len(suffix)] + ".weight"
            if name.endswith(suffix) and weight in renamed:
                return renamed[weight][: -len(".weight")] + suffix
        return renamed.get(name, name)

    tensors = {saved(name): value for name, value in tensors_of(SRC).items()}
    assert sum(".blocks." in n for n in tensors) > 60
    hf = json.loads((SRC / "config.rope_parameters.json").read_text())
    src = copy_with(tmp_path, tensors, hf)
    convert(src, tmp_path / "out", progress=False)
    prompt = [int(t) for t in reference("kimi_k25")["prompt_ids"]]
    want = open_local(q4).transformer
    got = open_local(tmp_path / "out").transformer
    a = want.forward(np.array(prompt), want.new_cache(16))
    b = got.forward(np.array(prompt), got.new_cache(16))
    np.testing.assert_array_equal(a, b)


def test_an_inexact_scale_is_refused_for_q4_0_and_decoded_exactly_for_f32(tmp_path):
    tensors = tensors_of(SRC)
    victim = "language_model.model.layers.2.mlp.experts.5.up_proj.weight_scale"
    dtype, shape, data = tensors[victim]
    scales = np.frombuffer(data, np.uint16).copy()
    tiny = np.array([1.2345e-6], np.float32)  # below 2^-14 with bits float16 has not
    scales[3] = bf16_bits(tiny)[0]
    tensors[victim] = (dtype, shape, scales.tobytes())
    src = copy_with(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"expert 5 of layer 2: 1 of \d+ INT4 groups .*f32"):
        convert(src, tmp_path / "q4", progress=False)
    assert not (tmp_path / "q4").exists()
    summary = convert(src, tmp_path / "f32", expert_format="f32", progress=False)
    assert any("INT4" in line for line in summary.requantized)
    rt = open_local(tmp_path / "f32")
    record = rt.experts.shards.read(2, 5)
    c = rt.config
    n = quant.packed_nbytes("f32", c.expert_intermediate, c.hidden_size)
    up = record[n : 2 * n].view(np.float32).reshape(c.expert_intermediate, c.hidden_size)
    ckpt = Checkpoint(src)
    base = victim[: -len(int4.SCALE)]
    m = int4.PackedInt4(ckpt.raw(base + int4.PACKED), ckpt.float32(base + int4.SCALE))
    ckpt.close()
    np.testing.assert_array_equal(up, m.float32())
    assert m.scale.reshape(-1)[3] != np.float16(m.scale.reshape(-1)[3])


def scheme_edit(edit):
    raw = json.loads((SRC / "config.json").read_text())
    edit(raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"])
    return raw


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda w: w.update(symmetric=False), "'symmetric' False"),
        (lambda w: w.update(group_size=128), "'group_size' 128"),
        (lambda w: w.update(num_bits=8), "'num_bits' 8"),
        (lambda w: w.update(actorder="group"), "actorder 'group'"),
    ],
)
def test_other_int4_schemes_are_refused(tmp_path, edit, message):
    src = copy_with(tmp_path, config=scheme_edit(edit))
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "out", progress=False)


@pytest.mark.parametrize("part", [".weight_shape", ".weight_scale"])
def test_a_missing_or_wrong_part_is_named(tmp_path, part):
    tensors = tensors_of(SRC)
    victim = "language_model.model.layers.1.mlp.experts.2.down_proj" + part
    tensors.pop(victim)
    with pytest.raises(CheckpointError, match=f"no {victim.replace('.', '[.]')} beside it"):
        convert(copy_with(tmp_path, tensors), tmp_path / "out", progress=False)
    tensors = tensors_of(SRC)
    if part == ".weight_shape":
        tensors[victim] = ("I64", (2,), np.array([32, 64], np.int64).tobytes())  # swapped
        match = r"weight_shape: \[32, 64\], expected \[64, 32\]"
    else:
        dtype, shape, data = tensors[victim]
        tensors[victim] = (dtype, (shape[0] // 2, shape[1]), data[: len(data) // 2])
        match = "weight_scale: shape"
    with pytest.raises(CheckpointError, match=match):
        convert(copy_with(tmp_path, tensors, name="again"), tmp_path / "out", progress=False)


def test_the_wrapper_config_is_checked(tmp_path):
    raw = json.loads((SRC / "config.json").read_text())
    assert load_config(SRC).model_type == "kimi_k25" and load_config(SRC).has_vision
    for edit, message in (
        (lambda r: r.pop("text_config"), "'text_config'"),
        (lambda r: r.update(tie_word_embeddings=True), "tie_word_embeddings True and text"),
        (lambda r: r["text_config"].update(model_type="qwen3_moe"), "not DeepSeek-V3"),
        (lambda r: r["text_config"].pop("tie_word_embeddings"), "'tie_word_embeddings'"),
    ):
        bad = json.loads(json.dumps(raw))
        edit(bad)
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=message):
            load_config(tmp_path)


def test_synth_presets(tmp_path):
    """`synth --preset kimi-k2.5-tiny` writes a K2.5 model directory that runs; the
    `kimi-k2.5` preset is the published language model: 1.03 T parameters, 60 MoE layers of
    384 experts whose q4_0 records are those of a converted K2.5 (24.8 MB)."""
    from moeshard.moe.convert import synth_k25
    from moeshard.moe.convert.synth import synth

    synth(tmp_path / "tiny", "kimi-k2.5-tiny")
    rt = open_local(tmp_path / "tiny")
    assert rt.config.model_type == "kimi_k25" and rt.config.n_experts == 16
    assert len(generate(rt.transformer, [1, 2, 3], SamplingOptions(max_tokens=4)).tokens) == 4
    (tmp_path / "full").mkdir()
    full = synth_k25.released_config(synth_k25.K25_PRESETS["kimi-k2.5"])
    (tmp_path / "full" / "config.json").write_text(json.dumps(full))
    c = load_config(tmp_path / "full")
    trunk = sum(int(np.prod(s)) for s in c.trunk_shapes().values())
    experts = len(c.moe_layers) * c.n_experts * 3 * c.hidden_size * c.expert_intermediate
    assert len(c.moe_layers) == 60 and (c.n_experts, c.top_k) == (384, 8)
    assert 1.02e12 < trunk + experts < 1.04e12
    record = quant.expert_record_nbytes("q4_0", c.hidden_size, c.expert_intermediate)
    assert record == 3 * 7168 * 2048 * 18 // 32


def test_kimi_k2_thinking_layout_converts_the_same(q4, tmp_path):
    """Kimi K2 Thinking publishes the same INT4 experts without the wrapper (model_type
    kimi_k2, quantization_config at the top, no ``language_model.`` prefix): the same model."""
    prefix = "language_model."
    tensors = {n[len(prefix) :]: v for n, v in tensors_of(SRC).items() if n.startswith(prefix)}
    text = json.loads((SRC / "config.json").read_text())["text_config"]
    assert text["model_type"] == "kimi_k2" and "quantization_config" in text
    src = copy_with(tmp_path, tensors, text)
    convert(src, tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / "moeshard.json").read_text())["expert_format"] == "q4_0"
    prompt = np.array([int(t) for t in reference("kimi_k25")["prompt_ids"]])
    want, got = open_local(q4).transformer, open_local(tmp_path / "out").transformer
    a = want.forward(prompt, want.new_cache(16))  # [T, V]
    np.testing.assert_array_equal(got.forward(prompt, got.new_cache(16)), a)
