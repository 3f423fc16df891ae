"""Kimi K3: a random K3 in the released layout (`synth --preset k3 --checkpoint`) converts,
matches a plain float64 forward pass written from the definitions (tests/k3_reference.py),
decodes from its recurrent state as it recomputes, runs the same through nodes and under a
RAM budget, and its parts each match their definitions."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from k3_reference import Reference

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local, open_streaming
from moeshard.moe.convert import mxfp4
from moeshard.moe.convert.checkpoint import Checkpoint
from moeshard.moe.convert.converter import convert
from moeshard.moe.convert.synth import synth
from moeshard.moe.errors import ConfigError
from moeshard.moe.kernels import quant
from moeshard.moe.model.families import load_config
from moeshard.moe.model.kda import KdaState, KdaWeights, kda_forward
from moeshard.moe.model.kimi_k3 import attention_residual

PROMPT = [72, 101, 108, 108, 111, 32, 75, 51, 33, 10, 84, 104]  # "Hello K3!\nTh"


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The tiny K3 checkpoint, and a function converting it (cached per format pair)."""
    root = tmp_path_factory.mktemp("k3")
    synth(root / "ckpt", "k3", checkpoint=True)
    made = {}

    def converted(experts=None, trunk="bf16"):
        key = (experts, trunk)
        if key not in made:
            out = root / f"model-{experts}-{trunk}"
            convert(root / "ckpt", out, expert_format=experts, trunk_fmt=trunk, progress=False)
            made[key] = out
        return made[key]

    return root / "ckpt", converted


def reference_weights(src) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in float64, the MXFP4 experts decoded (as `name` without
    its .weight_packed / .weight_scale suffix)."""
    ckpt = Checkpoint(src)
    out = {}
    for name in ckpt.names():
        if name.endswith(mxfp4.SCALE):
            continue
        if name.endswith(mxfp4.PACKED):
            scale = name[: -len(mxfp4.PACKED)] + mxfp4.SCALE
            m = mxfp4.PackedMxfp4(ckpt.raw(name), ckpt.raw(scale))
            out[name[: -len(mxfp4.PACKED)]] = m.float32().astype(np.float64)
        else:
            out[name] = ckpt.float32(name).astype(np.float64)
    ckpt.close()
    return out


def test_the_whole_model_matches_the_reference(k3):
    """f32 trunk and f32 experts (decoded exactly from MXFP4): logits within 1e-4 of their
    range of the float64 reference, and the same greedy tokens."""
    src, converted = k3
    ref = Reference(
        reference_weights(src), json.loads((src / "config.json").read_text())["text_config"]
    )
    want = ref.logits(np.array(PROMPT))  # [T, V]
    model = open_local(converted("f32", "f32")).transformer
    got = model.forward(np.array(PROMPT), model.new_cache(len(PROMPT)))  # [T, V]
    span = float(np.ptp(want))
    assert np.abs(got - want).max() <= 1e-4 * span, np.abs(got - want).max() / span
    opts = SamplingOptions(max_tokens=6)
    tokens = generate(model, PROMPT, opts).tokens
    ids = list(PROMPT)
    for _ in range(6):  # the reference's greedy continuation, recomputed from scratch each step
        ids.append(int(np.argmax(ref.logits(np.array(ids))[-1])))
    assert tokens == ids[len(PROMPT) :]


def test_decoding_from_the_state_equals_recomputation(k3):
    """Token by token through the KDA states and MLA caches = the whole sequence at once."""
    _, converted = k3
    model = open_local(converted("f32", "f32")).transformer
    whole = model.forward(np.array(PROMPT), model.new_cache(len(PROMPT)))  # [T, V]
    cache = model.new_cache(len(PROMPT))
    steps = np.concatenate([model.forward(np.array([t]), cache) for t in PROMPT])  # [T, V]
    span = float(np.ptp(whole))
    assert np.abs(steps - whole).max() <= 1e-5 * span


def test_mxfp4_and_bf16_versions_agree_closely(k3):
    """The default conversion (the published MXFP4 bits) against the same experts decoded to
    bf16 (exact: every MXFP4 value is a bf16 value).  With float activations the two are the
    same model to rounding; with the 8-bit activations generate uses, close (this random
    model's next-token distributions are nearly flat, span ~1.2, so only closeness in
    distribution is asked)."""
    _, converted = k3
    kept = open_local(converted()).transformer
    decoded = open_local(converted("bf16")).transformer

    def logits(model):
        return model.forward(np.array(PROMPT), model.new_cache(len(PROMPT)))  # [T, V]

    b = logits(decoded)
    span = float(np.ptp(b))
    quant.use_activations("f32")
    try:
        exact = logits(kept)
    finally:
        quant.use_activations("q8")
    assert np.abs(exact - b).max() <= 1e-5 * span
    a = logits(kept)

    def log_probs(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    kl = (np.exp(log_probs(b)) * (log_probs(b) - log_probs(a))).sum(-1)  # [T]
    assert np.median(np.abs(a - b).max(-1)) <= 0.03 * span  # measured 0.0127 / 1.45
    assert kl.mean() <= 1e-3  # measured
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75  # measured 11 of 12


def test_released_layout_converts_to_what_synth_writes_directly(k3, tmp_path):
    """The checkpoint's conversion and `synth --preset k3` (a model directory) are the same
    model: the same id, so the same config, trunk values and expert records."""
    from moeshard.moe.model.model_dir import ModelDir

    _, converted = k3
    synth(tmp_path / "direct", "k3")
    assert ModelDir(tmp_path / "direct").model_id == ModelDir(converted()).model_id


def test_convert_skips_the_vision_tower_and_says_so(k3):
    from moeshard.moe.storage.manifest import read_manifest

    _, converted = k3
    skipped = read_manifest(converted())["skipped_tensors"]
    assert skipped["vision_tower.patch_embed.proj.weight"].startswith("the vision tower")
    assert "language_model.model.layers.0.self_attention_res_proj.weight" in skipped


def test_inspect_describes_k3(k3):
    from moeshard.moe.model.report import describe

    _, converted = k3
    text, ok = describe(converted())
    assert ok
    assert "family     kimi_k3: 5 layers, hidden 128, vocab 512" in text
    assert "KDA 0,1,2 (4 heads of 32" in text and "MLA 3,4" in text
    assert "latent 64" in text and "SiTU" in text and "blocks of 2" in text
    assert "formats    experts mxfp4" in text


def test_three_nodes_and_a_ram_budget_give_the_same_tokens(k3, tmp_path):
    """Latent rows on the wire: the same tokens and logits bits through 3 nodes (2 replicas),
    and the same tokens streaming under a budget that holds a fraction of the experts."""
    from helpers import generate_on_nodes

    from moeshard.moe.convert.placement import shard_model

    _, converted = k3
    model = converted()
    opts = SamplingOptions(max_tokens=8, keep_logits=True)
    local = generate(open_local(model).transformer, PROMPT, opts)
    plan = shard_model(model, 3, 2, tmp_path / "shards")
    remote, calls = generate_on_nodes(model, plan, PROMPT, opts)
    assert remote.tokens == local.tokens
    assert all(np.array_equal(a, b) for a, b in zip(remote.logits, local.logits, strict=True))
    assert all(c > 0 for c in calls)
    from moeshard.moe.model.model_dir import ModelDir
    from moeshard.moe.storage.budget import plan_budget

    minimum = plan_budget(ModelDir(model), 1 << 40, 64).minimum  # 8 slots: a streamed trunk
    for budget in (minimum, minimum + (64 << 10)):  # 16 of the 64 records cached
        rt = open_streaming(model, budget, 64)
        try:
            streamed = generate(rt.transformer, PROMPT, opts)
            assert rt.experts.stats()["misses"] > 0
            if budget == minimum:  # the trunk's layers came through the ring
                assert rt.transformer.trunk.streamed and rt.transformer.trunk.bytes_read > 0
        finally:
            rt.close()
        assert streamed.tokens == local.tokens
        assert all(np.array_equal(a, b) for a, b in zip(streamed.logits, local.logits, strict=True))


@pytest.mark.parametrize(
    "path, key",
    [
        ((), "text_config"),
        (("text_config",), "activation_situ_beta"),
        (("text_config",), "routed_expert_hidden_size"),
        (("text_config",), "attn_res_block_size"),
        (("text_config", "linear_attn_config"), "gate_lower_bound"),
        (("text_config", "linear_attn_config"), "kda_layers"),
    ],
)
def test_a_missing_field_is_named_never_defaulted(k3, tmp_path, path, key):
    src, _ = k3
    raw = json.loads((src / "config.json").read_text())
    node = raw
    for step in path:
        node = node[step]
    node.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(tmp_path)


def test_a_config_that_is_not_k3_is_refused(k3, tmp_path):
    src, _ = k3
    raw = json.loads((src / "config.json").read_text())
    raw["text_config"]["mla_use_output_gate"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="mla_use_output_gate"):
        load_config(tmp_path)


# -- the parts, each against its definition -------------------------------------------------


def test_situ_glu_kernel_matches_its_definition():
    rng = np.random.default_rng(3)
    hidden, inter = 64, 96
    gate = rng.standard_normal((inter, hidden)).astype(np.float32)
    up = rng.standard_normal((inter, hidden)).astype(np.float32)
    down = rng.standard_normal((hidden, inter)).astype(np.float32) * 0.1
    x = rng.standard_normal((3, hidden)).astype(np.float32) * 2
    record = quant.pack_expert(gate, up, down, "f32")
    got = quant.expert_ffn(record, "f32", hidden, inter, x, quant.situ(4.0, 25.0))
    g, u = x.astype(np.float64) @ gate.T, x.astype(np.float64) @ up.T
    h = 4.0 * np.tanh(g / 4.0) / (1 + np.exp(-g)) * (25.0 * np.tanh(u / 25.0))  # the definition
    want = h @ down.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    plain = quant.expert_ffn(record, "f32", hidden, inter, x)  # SwiGLU is still the default
    assert not np.allclose(plain, got)


def test_bounded_kda_gate_matches_its_definition():
    """K3's KDA (bounded decay, full-rank output gate) against a float64 loop written from
    FLA's naive recurrence, prefill and token-by-token decoding alike."""
    rng = np.random.default_rng(5)
    heads, d, hid, kernel, t_n = 3, 8, 24, 4, 9

    def mat(rows, cols):
        return rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)

    wq, wk, wv, wb, wg, wo = (
        mat(heads * d, hid),
        mat(heads * d, hid),
        mat(heads * d, hid),
        mat(heads, hid),
        mat(heads * d, hid),
        mat(hid, heads * d),
    )
    wfa, wfb = mat(d, hid), mat(heads * d, d)
    conv = rng.normal(0, 0.5, (3 * heads * d, kernel)).astype(np.float32)
    dt_bias = rng.normal(0, 0.3, heads * d).astype(np.float32)
    a_log = np.log(rng.uniform(1, 16, heads)).astype(np.float32)
    o_norm = rng.uniform(0.5, 1.5, d).astype(np.float32)
    m = KdaWeights.matrix
    w = KdaWeights(
        q=m(wq), k=m(wk), v=m(wv), f=KdaWeights.chain(m(wfa), m(wfb)), b=m(wb), g=m(wg),
        o=m(wo), conv=conv, dt_bias=dt_bias, a_log=a_log, o_norm=o_norm, heads=heads,
        eps=1e-5, lower_bound=-5.0,
    )  # fmt: skip
    x = rng.standard_normal((t_n, hid)).astype(np.float32)

    def silu(v):
        return v / (1 + np.exp(-v))

    x64 = x.astype(np.float64)
    proj = np.concatenate([x64 @ wq.T, x64 @ wk.T, x64 @ wv.T], axis=1)  # [T, 3hd]
    padded = np.concatenate([np.zeros((kernel - 1, proj.shape[1])), proj])
    mixed = silu(np.stack([(padded[t : t + kernel] * conv.T).sum(0) for t in range(t_n)]))
    q, k, v = (
        mixed[:, i * heads * d : (i + 1) * heads * d].reshape(t_n, heads, d) for i in range(3)
    )
    q = q / np.sqrt((q**2).sum(-1, keepdims=True) + 1e-6) / np.sqrt(d)
    k = k / np.sqrt((k**2).sum(-1, keepdims=True) + 1e-6)
    raw = ((x64 @ wfa.T) @ wfb.T + dt_bias).reshape(t_n, heads, d)
    g = -5.0 / (1 + np.exp(-np.exp(a_log)[None, :, None] * raw))  # log-decay in (-5, 0)
    beta = 1 / (1 + np.exp(-(x64 @ wb.T)))
    want = np.zeros((t_n, heads, d))
    for h in range(heads):
        s = np.zeros((d, d))
        for t in range(t_n):
            s = np.diag(np.exp(g[t, h])) @ s
            s = s + np.outer(k[t, h], beta[t, h] * (v[t, h] - s.T @ k[t, h]))
            want[t, h] = s.T @ q[t, h]
    want = want / np.sqrt((want**2).mean(-1, keepdims=True) + 1e-5) * o_norm
    want = want / (1 + np.exp(-(x64 @ wg.T).reshape(t_n, heads, d)))
    want = want.reshape(t_n, heads * d) @ wo.T.astype(np.float64)

    got = kda_forward(w, x, KdaState.empty(heads, d, kernel))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    state = KdaState.empty(heads, d, kernel)
    stepped = np.concatenate([kda_forward(w, x[t : t + 1], state) for t in range(t_n)])
    np.testing.assert_allclose(stepped, got, rtol=0, atol=1e-6 * np.abs(want).max())
    assert (g > -5).all() and (g < 0).all()


def test_attention_residual_matches_its_definition():
    """torchtitan's _apply_attention_residual: softmax over the entries of the projection of
    their RMS-normalised values, then the values (not normalised) mixed."""
    rng = np.random.default_rng(7)
    t_n, hid, n_blocks = 4, 16, 3
    blocks = [rng.standard_normal((t_n, hid)).astype(np.float32) * (b + 1) for b in range(n_blocks)]
    partial = rng.standard_normal((t_n, hid)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, hid).astype(np.float32)
    proj = rng.standard_normal(hid).astype(np.float32)
    got = attention_residual(partial, blocks, norm, proj, 1e-5)
    for t in range(t_n):
        values = [b[t].astype(np.float64) for b in blocks] + [partial[t].astype(np.float64)]
        scores = [(v / np.sqrt((v**2).mean() + 1e-5) * norm) @ proj for v in values]
        p = np.exp(np.array(scores) - max(scores))
        p /= p.sum()
        np.testing.assert_allclose(
            got[t], sum(pi * v for pi, v in zip(p, values, strict=True)), rtol=1e-5, atol=1e-5
        )
    alone = attention_residual(partial, [], norm, proj, 1e-5)  # one entry: itself
    np.testing.assert_allclose(alone, partial, rtol=1e-6)


def test_a_vision_only_change_does_not_break_loading(k3, tmp_path):
    """The vision tower is not run: its config may say anything."""
    src, _ = k3
    shutil.copytree(src, tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    raw["vision_config"] = {"model_type": "something-else", "patch_size": 28}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(raw))
    config = load_config(tmp_path / "ckpt")
    assert config.has_vision and config.expert_hidden == 64 and config.hidden_size == 128
