"""GLM-4.5/4.6/4.7 (glm4_moe) and GLM-4.7-Flash (glm4_moe_lite) beyond their transformers
fixtures (tests/test_reference.py): converted from the released layout (MTP layer skipped and
said so), the same tokens and logits bits in RAM, under the smallest `--ram` budget and through
two nodes, and every config field they read required and checked."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import FIXTURES, generate_on_nodes, reference

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local, open_streaming
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.errors import ConfigError
from moeshard.moe.model.families import load_config
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.budget import plan_budget

FAMILIES = ("glm4_moe", "glm4_moe_lite")
CONTEXT = 64


@pytest.mark.parametrize("name", FAMILIES)
def test_convert_skips_the_mtp_layer_and_says_so(name, converted):
    model = converted(name, experts="q4_0", trunk="bf16")
    manifest = json.loads((model / "moeshard.json").read_text())
    skipped = manifest["skipped_tensors"]
    mtp = [n for n in skipped if n.startswith("model.layers.3.")]  # the layer after the last
    assert mtp and all("multi-token prediction" in skipped[n] for n in mtp)
    assert "model.layers.3.eh_proj.weight" in mtp
    assert manifest["moe_layers"] == [1, 2]  # layer 0 dense (first_k_dense_replace 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_two_nodes_and_a_ram_budget_give_the_same_tokens(name, converted, tmp_path):
    """The same tokens and logits bits through two nodes and streaming under the smallest
    budget (the trunk's layers through the ring) and one that caches some records."""
    model = converted(name, experts="q4_0", trunk="bf16")
    prompt = [int(t) for t in reference(name)["prompt_ids"]]
    opts = SamplingOptions(max_tokens=8, keep_logits=True)
    local = generate(open_local(model).transformer, prompt, opts)
    plan = shard_model(model, 2, 1, tmp_path / "shards")
    remote, calls = generate_on_nodes(model, plan, prompt, opts)
    assert remote.tokens == local.tokens
    assert all(np.array_equal(a, b) for a, b in zip(remote.logits, local.logits, strict=True))
    assert all(c > 0 for c in calls)
    plan = plan_budget(ModelDir(model), 1 << 40, CONTEXT)
    minimum = plan.minimum
    for budget in (minimum, minimum + 4 * plan.slot_bytes):  # 4 of the 16 records cached
        rt = open_streaming(model, budget, CONTEXT)
        try:
            streamed = generate(rt.transformer, prompt, opts)
            assert rt.experts.stats()["misses"] > 0
            if budget == minimum:
                assert rt.transformer.trunk.streamed and rt.transformer.trunk.bytes_read > 0
        finally:
            rt.close()
        assert streamed.tokens == local.tokens
        assert all(np.array_equal(a, b) for a, b in zip(streamed.logits, local.logits, strict=True))


def config_with(name: str, tmp_path, dialect: str = "config.json", **changes):
    """The fixture's config (released dialect, or transformers') with fields changed (None:
    removed), loaded from a directory of its own."""
    raw = json.loads((FIXTURES / name / dialect).read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_config(tmp_path)


GLM_FIELDS = [
    "head_dim", "partial_rotary_factor", "rope_theta", "use_qk_norm", "attention_bias",
    "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "norm_topk_prob",
    "first_k_dense_replace", "n_routed_experts", "num_key_value_heads", "rms_norm_eps",
    "tie_word_embeddings", "max_position_embeddings", "intermediate_size",
]  # fmt: skip
LITE_FIELDS = [
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "rope_theta", "n_group", "topk_group",
    "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace", "attention_bias",
]  # fmt: skip


@pytest.mark.parametrize(
    "name, key", [("glm4_moe", k) for k in GLM_FIELDS] + [("glm4_moe_lite", k) for k in LITE_FIELDS]
)
def test_a_missing_field_is_named_never_defaulted(name, key, tmp_path):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        config_with(name, tmp_path, **{key: None})


def test_partial_rope_in_either_dialect(tmp_path):
    old = config_with("glm4_moe", tmp_path)
    new = config_with("glm4_moe", tmp_path, "config.rope_parameters.json")
    assert old.rope == new.rope and old.rope.dim == 8  # half of head_dim 16 turns
    assert old.partial_rotary_factor == new.partial_rotary_factor == 0.5
    with pytest.raises(ConfigError, match="'partial_rotary_factor' must be at most 1"):
        config_with("glm4_moe", tmp_path, partial_rotary_factor=1.5)
    with pytest.raises(ConfigError, match="'use_qk_norm' must be true or false"):
        config_with("glm4_moe", tmp_path, use_qk_norm="yes")
    with pytest.raises(ConfigError, match="not divisible by n_group"):
        config_with("glm4_moe", tmp_path, n_group=3, topk_group=1)


def test_lite_dense_layers_from_either_field(tmp_path):
    released = config_with("glm4_moe_lite", tmp_path)
    assert released.moe_layers == (1, 2) and released.rope_interleave
    saved = config_with("glm4_moe_lite", tmp_path, "config.rope_parameters.json")
    assert saved.moe_layers == (1, 2)
    only_types = config_with(
        "glm4_moe_lite", tmp_path, "config.rope_parameters.json", first_k_dense_replace=None,
        mlp_layer_types=["sparse", "dense", "sparse"],
    )  # fmt: skip
    assert only_types.moe_layers == (0, 2)
    assert set(only_types.trunk_shapes()) >= {"model.layers.1.mlp.gate_proj.weight"}
    with pytest.raises(ConfigError, match="disagree"):
        config_with("glm4_moe_lite", tmp_path, mlp_layer_types=["dense", "dense", "sparse"])
    with pytest.raises(ConfigError, match="'mlp_layer_types' must list"):
        config_with("glm4_moe_lite", tmp_path, mlp_layer_types=["dense", "moe", "sparse"])
    with pytest.raises(ConfigError, match="'partial_rotary_factor' 0.5 unsupported"):
        config_with("glm4_moe_lite", tmp_path, partial_rotary_factor=0.5)


def test_a_checkpoint_missing_a_glm_tensor_is_refused(tmp_path):
    """The shared expert and the selection bias are part of the model: convert names them."""
    from moeshard.moe.convert.converter import convert
    from moeshard.moe.errors import CheckpointError

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "glm4_moe", src)
    config = json.loads((src / "config.json").read_text())
    config["use_qk_norm"] = False  # the checkpoint has q_norm/k_norm: skipped, not an error
    (src / "config.json").write_text(json.dumps(config))
    summary = convert(src, tmp_path / "out", "f32", "f32", progress=False)
    assert "model.layers.0.self_attn.q_norm.weight" in summary.skipped
    config["n_shared_experts"] = 2  # shared experts twice as wide as the checkpoint's
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="shared_experts.gate_proj.weight"):
        convert(src, tmp_path / "out2", "f32", "f32", progress=False)


def test_synth_writes_a_glm_that_runs_and_simulate_sizes_presets_unwritten(tmp_path):
    """`synth --preset glm-tiny` writes a glm4_moe model directory that generates; the sizes
    `simulate --geometry glm-4.6` takes without writing (`preset_sizes`) are the ones that
    writing gives: the trunk's tensor bytes, the records, the parameters."""
    from moeshard.moe.analysis import simulate
    from moeshard.moe.convert.synth import preset_sizes, synth

    out = tmp_path / "glm"
    synth(out, "glm-tiny")
    model = ModelDir(out)
    assert model.config.model_type == "glm4_moe" and model.config.moe_layers == (1, 2)
    raw, fmt, trunk = preset_sizes("glm-tiny")
    assert trunk == sum(e.nbytes for e in model.trunk_layout().entries.values())
    written, unwritten = (
        simulate.geometry_of(str(out)),
        simulate.config_geometry("t", raw, fmt, trunk),
    )
    for field in ("layers", "n_experts", "top_k", "record_bytes", "params", "trunk_params"):
        assert getattr(written, field) == getattr(unwritten, field), field
    result = generate(open_local(out).transformer, [1, 2, 3], SamplingOptions(max_tokens=4))
    assert len(result.tokens) == 4
    full = simulate.config_geometry("glm-4.6", *preset_sizes("glm-4.6"))
    assert (full.layers, full.n_experts, full.top_k) == (89, 160, 8)
    assert 352e9 < full.params < 354e9  # GLM-4.6: 355 G with its MTP layer
