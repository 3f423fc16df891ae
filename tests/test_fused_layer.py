"""A decode row's layer through `fused_layer.attention_route` (one kernel call up to the
experts) gives the same bits as the step-by-step calls: logits, tokens and the KV cache, for
every GQA family, each format, a sliding window, and a streamed trunk under --ram."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.coordinator.runtime import open_local, open_streaming
from moeshard.moe.model import fused_layer
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.budget import plan_budget

STEPS = 12


def _decode(transformer, steps: int = STEPS):
    """Greedy decode from a fixed prompt: (logits [1 + steps, V], the cache)."""
    cache = transformer.new_cache(64)
    logits = [transformer.forward(np.array([3, 17, 5, 9, 1]), cache, last_only=True)]
    for _ in range(steps):
        token = int(np.argmax(logits[-1]))
        logits.append(transformer.forward(np.array([token]), cache, last_only=True))
    return np.concatenate(logits), cache


def _both(transformer, monkeypatch):
    """(fused logits, cache), (step-by-step logits, cache), and how many layers ran fused."""
    ran = []
    real = fused_layer.FusedPlan.applies

    def counting(self):
        ok = real(self)
        ran.append(ok)
        return ok

    monkeypatch.setattr(fused_layer.FusedPlan, "applies", counting)
    fused = _decode(transformer)
    monkeypatch.setattr(fused_layer.FusedPlan, "applies", lambda self: False)
    steps = _decode(transformer)
    monkeypatch.setattr(fused_layer.FusedPlan, "applies", real)
    return fused, steps, sum(ran)


def _same(a, b) -> None:
    (logits_a, cache_a), (logits_b, cache_b) = a, b
    assert logits_a.tobytes() == logits_b.tobytes()
    assert cache_a.length == cache_b.length
    n = cache_a.length
    for ka, kb, va, vb in zip(cache_a.k, cache_b.k, cache_a.v, cache_b.v, strict=True):
        assert ka[:n].tobytes() == kb[:n].tobytes() and va[:n].tobytes() == vb[:n].tobytes()


@pytest.mark.parametrize(
    "family, experts, trunk",
    [
        ("qwen3_moe", "q4_0", "bf16"),
        ("qwen3_moe", "q8_0", "q8_0"),
        ("olmoe", "f32", "f32"),
        ("mixtral", "q4_0", "f32"),
    ],
)
def test_fused_decode_layer_gives_the_step_by_step_bits(
    converted, monkeypatch, family, experts, trunk
):
    rt = open_local(converted(family, experts=experts, trunk=trunk))
    try:
        fused, steps, ran = _both(rt.transformer, monkeypatch)
        assert ran >= STEPS * len(rt.transformer.config.moe_layers)  # the fused path ran
        _same(fused, steps)
    finally:
        rt.close()


def test_a_layer_with_a_shared_expert_or_biases_keeps_the_steps(converted, monkeypatch):
    """qwen2_moe (q/k/v biases, a shared expert): no plan, the step-by-step path, unchanged."""
    rt = open_local(converted("qwen2_moe"))
    try:
        layers = [rt.transformer._layer(i) for i in range(rt.transformer.config.num_hidden_layers)]
        assert all(ly.fused is None for ly in layers)
        fused, steps, ran = _both(rt.transformer, monkeypatch)
        assert ran == 0
        _same(fused, steps)
    finally:
        rt.close()


def test_fused_decode_under_a_ram_budget_streams_the_same_bits(converted, monkeypatch):
    """At the smallest budget the trunk's layers come through the streaming ring and the
    experts through the budgeted cache: fused or not, the same bits, and those of RAM."""
    path = converted("qwen3_moe", experts="q4_0", trunk="bf16")
    local = open_local(path)
    try:
        want, _ = _decode(local.transformer)
    finally:
        local.close()
    minimum = plan_budget(ModelDir(path), 1 << 40, 64).minimum
    rt = open_streaming(path, minimum, 64)
    try:
        fused, steps, ran = _both(rt.transformer, monkeypatch)
        assert ran > 0
        _same(fused, steps)
        assert fused[0].tobytes() == want.tobytes()
    finally:
        rt.close()
