"""Kimi Linear beyond the reference match (tests/test_reference.py): a config that leaves a
field out is refused by name, the recurrent state rolls back to a recent step, and the
default formats run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import FIXTURES, reference

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.errors import ConfigError
from moeshard.moe.model.families import load_config

SRC = FIXTURES / "kimi_linear"


def with_config(tmp_path, edit) -> object:
    raw = json.loads((SRC / "config.json").read_text())
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    "field",
    ["linear_attn_config", "num_experts_per_token", "routed_scaling_factor", "q_lora_rank"],
)
def test_a_missing_field_is_named_never_defaulted(tmp_path, field):
    def drop(raw):
        raw.pop(field)
        raw.pop("num_experts_per_tok", None)  # nor its other spelling

    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(with_config(tmp_path, drop))


def transformers_config(tmp_path, edit=lambda raw: None) -> object:
    """The fixture's config as transformers' save_pretrained wrote it, edited."""
    raw = json.loads((SRC / "config.rope_parameters.json").read_text())
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_both_dialects_are_the_same_model(tmp_path):
    raw = json.loads((SRC / "config.rope_parameters.json").read_text())
    assert "linear_attn_config" not in raw and "first_k_dense_replace" not in raw
    released = load_config(SRC)
    assert load_config(transformers_config(tmp_path)) == released
    both = transformers_config(tmp_path, lambda raw: raw.update(json.loads(
        (SRC / "config.json").read_text())))  # fmt: skip
    assert load_config(both) == released  # both forms, agreeing


@pytest.mark.parametrize(
    "field",
    ["layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
     "mlp_layer_types"],
)  # fmt: skip
def test_transformers_dialect_fields_are_required(tmp_path, field):
    """Without linear_attn_config and first_k_dense_replace, transformers' names are
    required, each of them: a missing one is named."""
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(transformers_config(tmp_path, lambda raw: raw.pop(field)))


def test_no_layer_map_in_either_dialect_names_both(tmp_path):
    def drop(raw):
        for key in ("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
            raw.pop(key)

    with pytest.raises(ConfigError, match="'linear_attn_config' .or transformers' 'layer_types'"):
        load_config(transformers_config(tmp_path, drop))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw: raw["layer_types"].reverse(), "describe different models"),
        (lambda raw: raw.update(linear_num_heads=4), "describe different models"),
        (lambda raw: raw.update(first_k_dense_replace=2), "disagree"),
        (lambda raw: raw.update(num_experts_per_tok=4), "different values"),
        (lambda raw: raw.update(norm_topk_prob=False), "different values"),
    ],
)
def test_inconsistent_dialects_are_refused(tmp_path, edit, message):
    """Both forms present (a released model loaded and saved by transformers keeps both), but
    saying different things."""

    def both(raw):
        raw.update(json.loads((SRC / "config.json").read_text()))
        edit(raw)

    with pytest.raises(ConfigError, match=message):
        load_config(transformers_config(tmp_path, both))


@pytest.mark.parametrize(
    "kinds, message",
    [
        (["dense", "sparse", "dense", "sparse"], "only before the MoE layers"),
        (["dense", "sparse", "sparse"], "each of the 4 layers"),
        (["dense", "moe", "sparse", "sparse"], "each of the 4 layers"),
    ],
)
def test_bad_layer_type_lists_are_refused(tmp_path, kinds, message):
    with pytest.raises(ConfigError, match=message):
        load_config(transformers_config(tmp_path, lambda raw: raw.update(mlp_layer_types=kinds)))
    attention = [k.replace("dense", "linear_attention").replace("sparse", "full_attention")
                 for k in kinds]  # fmt: skip
    if message != "only before the MoE layers":
        with pytest.raises(ConfigError, match=message):
            load_config(
                transformers_config(tmp_path, lambda raw: raw.update(layer_types=attention))
            )


def test_the_layer_map_must_cover_every_layer_once(tmp_path):
    def bad(raw):
        raw["linear_attn_config"]["kda_layers"] = [1, 2]  # layer 4 in neither list

    with pytest.raises(ConfigError, match="each of the 4 layers"):
        load_config(with_config(tmp_path, bad))
    cfg = load_config(SRC)
    assert cfg.kda_layers == (0, 1, 3) and cfg.mla_layers == (2,)  # one-based in the file


def test_recurrent_state_rolls_back_to_a_recent_step(converted):
    from helpers import check_recurrent_rollback

    rt = open_local(converted("kimi_linear"))
    check_recurrent_rollback(rt.transformer, reference("kimi_linear")["prompt_ids"])


def test_default_formats_generate_close_to_f32(converted):
    ref = reference("kimi_linear")
    prompt = [int(t) for t in ref["prompt_ids"]]
    opts = SamplingOptions(max_tokens=len(ref["greedy_ids"]), keep_logits=True)
    q4 = generate(open_local(converted("kimi_linear", experts="q4_0", trunk="bf16")).transformer,
                  prompt, opts)  # fmt: skip
    span = float(np.ptp(ref["greedy_logits"]))
    first = np.abs(q4.logits[0] - ref["greedy_logits"][0]).max()
    assert first < 0.1 * span  # the 4-bit experts' error on the first step
    assert q4.tokens[0] == int(ref["greedy_ids"][0])


def test_convert_refuses_a_checkpoint_missing_a_kda_tensor(tmp_path):
    from moeshard.moe.convert.checkpoint import Checkpoint, write_safetensors
    from moeshard.moe.convert.converter import convert
    from moeshard.moe.errors import CheckpointError

    src = tmp_path / "ckpt"
    shutil.copytree(SRC, src)
    ckpt = Checkpoint(src)
    tensors = {n: (ckpt.dtype(n), ckpt.shape(n), ckpt.raw(n).tobytes()) for n in ckpt.names()}
    ckpt.close()
    del tensors["model.layers.1.self_attn.k_conv1d.weight"]
    write_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_conv1d.weight"):
        convert(src, tmp_path / "out", progress=False)


def test_inspect_shows_the_layer_map(converted):
    from moeshard.moe.model.report import describe

    text, _ = describe(converted("kimi_linear"))
    assert "attention  (layers from 0) KDA 0,1,3 (2 heads of 16, state 9.38 KiB); MLA 2" in text


def test_through_two_nodes_equals_one_machine(converted, tmp_path):
    """The experts of a Kimi Linear model on nodes: the same tokens and logits bits as one
    process (the coordinator keeps the KDA states and MLA caches; nodes see expert rows)."""
    from helpers import generate_on_nodes

    from moeshard.moe.convert.placement import shard_model

    model = converted("kimi_linear")
    plan = shard_model(model, 2, 1, tmp_path / "shards")
    prompt = [int(t) for t in reference("kimi_linear")["prompt_ids"]]
    opts = SamplingOptions(max_tokens=8, keep_logits=True)
    local = generate(open_local(model).transformer, prompt, opts)
    result, calls = generate_on_nodes(model, plan, prompt, opts)
    assert result.tokens == local.tokens
    assert all(np.array_equal(a, b) for a, b in zip(result.logits, local.logits, strict=True))
    assert all(c > 0 for c in calls)
