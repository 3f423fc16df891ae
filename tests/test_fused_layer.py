"""A decode row's layer through `fused_layer.attention_route` (one kernel call up to the
experts) gives the same bits as the step-by-step calls: logits, tokens and the KV cache, for
every GQA family, each format, a sliding window, and a streamed trunk under --ram."""

from __future__ import annotations

import sys

import numba
import numpy as np
import pytest
from helpers import FUSED_CASES

from moeshard.coordinator.runtime import open_local, open_streaming
from moeshard.moe.kernels import quant
from moeshard.moe.model import fused_layer, qwen_moe
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
    """Greedy decodes three ways: fused as the model chooses, fused with every product split
    across the pool (`FusedPlan.products_serial` False: `decode_layers`' split where
    the experts are resident, else the steps), and step by step (`fused_decode` off) ->
    ((logits, cache) of each, how many layers' plans put their products on this thread)."""
    ran = []
    real = fused_layer.FusedPlan.products_serial
    _count_decode_layers(monkeypatch)

    def counting(self):
        ok = real(self)
        ran.append(ok)
        return ok

    monkeypatch.setattr(fused_layer.FusedPlan, "products_serial", counting)
    fused = _decode(transformer)
    monkeypatch.setattr(fused_layer.FusedPlan, "products_serial", lambda self: False)
    split = _decode(transformer)
    monkeypatch.setattr(fused_layer.FusedPlan, "products_serial", real)
    monkeypatch.setattr(transformer, "fused_decode", False)
    steps = _decode(transformer)
    monkeypatch.setattr(transformer, "fused_decode", True)
    return fused, split, steps, sum(ran)


def _count_decode_layers(monkeypatch) -> None:
    """`decode_layers`, counting in EXPERTS_IN_CALL for how many layers the experts ran in
    its call and how many were handed back (an expert not read yet), and, for the layers it
    ran on more than one thread, how many of those it split (its `splits`: products,
    attention)."""
    counts = {"in call": 0, "handed back": 0, "pool": 0, "split products": 0, "split heads": 0}
    monkeypatch.setattr(sys.modules[__name__], "EXPERTS_IN_CALL", counts)
    real = fused_layer.decode_layers

    def counting(*args):
        out = real(*args)
        first, last, splits, stop = args[3], args[4], args[5], out[0]
        ran = stop - first + (stop < last)  # (a handed-back layer ran up to its router)
        counts["in call"] += stop - first
        counts["handed back"] += stop < last
        if numba.get_num_threads() > 1:  # (as `quant._launch` set it for this call)
            counts["pool"] += ran
            counts["split products"] += int(splits[first : first + ran, 0].sum())
            counts["split heads"] += int(splits[first : first + ran, 1].sum())
        return out

    monkeypatch.setattr(qwen_moe, "decode_layers", counting)


EXPERTS_IN_CALL: dict[str, int] = {}


def _same(a, b) -> None:
    (logits_a, cache_a), (logits_b, cache_b) = a, b
    assert logits_a.tobytes() == logits_b.tobytes()
    assert cache_a.length == cache_b.length
    n = cache_a.length
    for ka, kb, va, vb in zip(cache_a.k, cache_b.k, cache_a.v, cache_b.v, strict=True):
        assert ka[:n].tobytes() == kb[:n].tobytes() and va[:n].tobytes() == vb[:n].tobytes()


@pytest.mark.parametrize("family, experts, trunk", FUSED_CASES)
def test_fused_decode_layer_gives_the_step_by_step_bits(
    converted, monkeypatch, family, experts, trunk
):
    rt = open_local(converted(family, experts=experts, trunk=trunk))
    try:
        fused, split, steps, ran = _both(rt.transformer, monkeypatch)
        assert ran >= STEPS * len(rt.transformer.config.moe_layers)  # the fused path ran
        # the in-RAM experts ran in decode_layers' call, and (records read on first use) some
        # came back to LocalExperts to be read: both ways give the step-by-step bits
        assert EXPERTS_IN_CALL["in call"] > 0 and EXPERTS_IN_CALL["handed back"] > 0
        _same(fused, steps)
        _same(split, steps)
    finally:
        rt.close()


@pytest.mark.parametrize("mode", ["serial", "pool", "split"])
def test_experts_in_the_layers_call_give_the_backends_bits(converted, monkeypatch, mode):
    """Every record read: each decode layer's experts run inside `decode_layers`' call (on
    one thread, or split across the pool's threads; "split": with its products' rows and its
    attention's heads split too, as a big model's are); the tokens, logits and cache are
    those of the same model whose experts go through `LocalExperts`' own call (`resident`
    None), step by step."""
    path = converted("qwen3_moe", experts="q4_0", trunk="bf16")
    rt = open_local(path)
    try:
        rt.experts.preload()
        if mode != "serial":  # experts in the pool (as where its threads spin:
            # `quant.spin_while_waiting`, `quant.calibrate_matmul`); the trunk's products
            # on this thread, or ("split") in the pool too, and the attention's heads
            monkeypatch.setattr(quant, "PARALLEL_MIN_WEIGHTS", 1)
            monkeypatch.setattr(quant, "MATMUL_PARALLEL_FACTOR", 1 << 40 if mode == "pool" else 1)
        if mode == "split":
            monkeypatch.setattr(quant, "PARALLEL_MIN_WORK", 1)
        pool = mode != "serial" and quant.threads() > 1
        assert quant._threads_for(1) > 1 or not pool
        _count_decode_layers(monkeypatch)
        inside = _decode(rt.transformer)
        layers = len(rt.transformer.config.moe_layers)
        pooled = STEPS * layers if pool else 0
        split = pooled if mode == "split" else 0
        assert EXPERTS_IN_CALL == {
            "in call": STEPS * layers,
            "handed back": 0,
            "pool": pooled,
            "split products": split,
            "split heads": split,
        }
        monkeypatch.setattr(type(rt.experts), "resident", lambda self, layer: None)
        _same(inside, _decode(rt.transformer))
    finally:
        rt.close()


def test_a_layer_with_a_shared_expert_or_biases_keeps_the_steps(converted, monkeypatch):
    """qwen2_moe (q/k/v biases, a shared expert): no plan, the step-by-step path, unchanged."""
    rt = open_local(converted("qwen2_moe"))
    try:
        layers = [rt.transformer._layer(i) for i in range(rt.transformer.config.num_hidden_layers)]
        assert all(ly.fused is None for ly in layers)
        fused, split, steps, ran = _both(rt.transformer, monkeypatch)
        assert ran == 0
        _same(fused, steps)
        _same(split, steps)
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
        fused, split, steps, ran = _both(rt.transformer, monkeypatch)
        assert ran > 0
        _same(fused, steps)
        _same(split, steps)
        assert fused[0].tobytes() == want.tobytes()
    finally:
        rt.close()
