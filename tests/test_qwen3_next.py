"""Qwen3-Next and Qwen3.5-MoE beyond the reference match (tests/test_reference.py): the layer
map and the fused projections' order, a config that leaves a field out is refused by name,
convert says what it skips (vision tower, MTP head), the Gated DeltaNet state rolls back to a
recent step (and does, past a lying node in an audited run), and the same tokens and logits
bits come through two nodes and under the smallest RAM budget."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import FIXTURES, reference

from moeshard.coordinator.runtime import open_local
from moeshard.moe.convert.converter import convert
from moeshard.moe.errors import ConfigError
from moeshard.moe.model.families import load_config
from moeshard.moe.model.qwen3_next import Config, fused_columns

FAMILIES = ("qwen3_next", "qwen3_5_moe")


def edited(tmp_path, name: str, edit):
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    edit(raw.get("text_config", raw))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_the_two_forms_read_the_same_model():
    nxt = load_config(FIXTURES / "qwen3_next")
    assert nxt.linear_layers == (0, 1, 2) and nxt.full_layers == (3,)  # full_attention_interval
    assert nxt.moe_layers == (0, 2, 3) and nxt.dense_intermediate == 64  # mlp_only_layers [1]
    assert nxt.rope.dim == 8 and nxt.fused_projections  # 32 * partial_rotary_factor 0.25
    wrapped = load_config(FIXTURES / "qwen3_5_moe")  # the published wrapper: text_config
    raw = json.loads((FIXTURES / "qwen3_5_moe" / "config.rope_parameters.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe_text"  # what transformers' text model saves
    text = Config.from_hf(raw, "text-only")
    assert wrapped.has_vision and not text.has_vision and not wrapped.fused_projections
    for field in ("linear_layers", "moe_layers", "rope", "norm_topk_prob", "head_dim"):
        assert getattr(wrapped, field) == getattr(text, field), field
    assert wrapped.moe_layers == (0, 1, 2, 3) and wrapped.norm_topk_prob


def test_fused_projection_columns_follow_transformers_grouping():
    """Per key head g, in_proj_qkvz holds [q_g, k_g, v of g's value heads, z of them]."""
    c = load_config(FIXTURES / "qwen3_next")  # hk 2, dk 16, hv 4 (2 per key head), dv 8
    qkv, z, b, a = fused_columns(c)
    width = 2 * 16 + 2 * 2 * 8  # one key head's block
    assert list(qkv[:16]) == list(range(16)) and list(qkv[16:32]) == list(range(width, width + 16))
    assert list(qkv[32:48]) == list(range(16, 32))  # k of key head 0
    assert list(qkv[64:80]) == list(range(32, 48))  # v of key head 0's two value heads
    assert list(z[:16]) == list(range(48, 64)) and len(qkv) == c.conv_channels
    assert list(b) == [0, 1, 4, 5] and list(a) == [2, 3, 6, 7]


@pytest.mark.parametrize(
    "name, field",
    [
        ("qwen3_next", "full_attention_interval"),
        ("qwen3_next", "linear_num_value_heads"),
        ("qwen3_next", "partial_rotary_factor"),
        ("qwen3_next", "norm_topk_prob"),
        ("qwen3_next", "decoder_sparse_step"),
        ("qwen3_5_moe", "shared_expert_intermediate_size"),
        ("qwen3_5_moe", "linear_conv_kernel_dim"),
        ("qwen3_5_moe", "attention_bias"),
    ],
)
def test_a_missing_field_is_named_never_defaulted(tmp_path, name, field):
    def drop(text):
        text.pop(field)
        text.get("rope_parameters", {}).pop(field, None)

    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(edited(tmp_path, name, drop))


def test_the_wrapper_needs_its_text_config(tmp_path):
    raw = json.loads((FIXTURES / "qwen3_5_moe" / "config.json").read_text())
    raw.pop("text_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="'text_config'"):
        load_config(tmp_path)


def test_a_bad_layer_map_is_refused(tmp_path):
    def bad(text):
        text["layer_types"] = ["linear_attention", "sliding_attention", "full_attention"] * 2

    with pytest.raises(ConfigError, match="layer_types"):
        load_config(edited(tmp_path, "qwen3_5_moe", bad))


def test_convert_says_it_skips_the_vision_tower_and_the_mtp_head(tmp_path):
    summary = convert(FIXTURES / "qwen3_5_moe", tmp_path / "out", "f32", "f32", progress=False)
    reasons = {}
    for tensor, why in summary.skipped.items():
        reasons.setdefault(why, []).append(tensor)
    vision = reasons["the vision tower (moeshard runs the text model)"]
    mtp = reasons["the multi-token prediction head (not run)"]
    assert vision and all(t.startswith("model.visual.") for t in vision)
    assert len(mtp) == 5 and all(t.startswith("mtp.") for t in mtp)


@pytest.mark.parametrize("name", FAMILIES)
def test_recurrent_state_rolls_back_to_a_recent_step(converted, name):
    from helpers import check_recurrent_rollback

    check_recurrent_rollback(open_local(converted(name)).transformer, reference(name)["prompt_ids"])


@pytest.mark.parametrize("name", FAMILIES)
def test_two_nodes_and_the_smallest_ram_budget_give_the_same_bits(converted, tmp_path, name):
    """The coordinator keeps the recurrent states and KV caches; nodes and the streamed store
    see expert rows: the same tokens and logits bits as one process with every expert in RAM."""
    from helpers import same_bits_everywhere

    prompt = [int(t) for t in reference(name)["prompt_ids"]]
    assert same_bits_everywhere(converted(name), prompt, tmp_path / "shards").trunk_streamed


def test_inspect_shows_the_layer_map(converted):
    from moeshard.moe.model.report import describe

    text, _ = describe(converted("qwen3_5_moe"))
    assert "Gated DeltaNet 0,1,2 (2 key and 4 value heads of 16/8" in text
    assert "gated attention 3 (4/2 heads of 32, rotary 8); vision tower not run" in text


def test_an_audited_run_rolls_the_recurrent_state_back_past_a_liar(converted, tmp_path):
    """A node that scales its replies by 1 + 5e-6 is caught by the audits; the steps that used
    its unchecked work are recomputed from the Gated DeltaNet states kept for rollback, and the
    tokens and logits are one machine's, bit for bit."""
    from helpers import NodeProcess, remote_runtime

    from moeshard.coordinator.generate import SamplingOptions, generate
    from moeshard.moe.convert.placement import shard_model
    from moeshard.node import failpoints

    model = converted("qwen3_5_moe")
    prompt = [int(t) for t in reference("qwen3_5_moe")["prompt_ids"]]
    opts = SamplingOptions(max_tokens=24, keep_logits=True)
    local = generate(open_local(model).transformer, prompt, opts)
    plan = shard_model(model, 2, 1, tmp_path / "shards")
    honest = [NodeProcess(n["dir"], advertise=False) for n in plan["nodes"]]
    liar = NodeProcess(model, advertise=False, env={failpoints.ENV: "lie=scale:1.000005"})
    try:
        for node in [*honest, liar]:
            node.wait_ready()
        specs = [n.spec for n in [*honest, liar]]
        transformer, remote = remote_runtime(model, specs, backoff_s=60.0, audit=0.5, audit_new=4)
        try:
            result = generate(transformer, prompt, opts, verifier=remote.verifier)
        finally:
            remote.close()
        bad = next(p for p in remote.peers.peers if p.node_id == liar.node_id)
    finally:
        for node in [*honest, liar]:
            node.stop()
    assert bad.disqualified and result.rollbacks > 0, (bad.calls, result.rollbacks)
    assert result.tokens == local.tokens
    assert all(np.array_equal(a, b) for a, b in zip(result.logits, local.logits, strict=True))
