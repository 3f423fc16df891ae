"""Several new rows of one sequence (a prefill, and a second chunk after it) through
`fused_prefill.prefill_layers`, a run of layers in one kernel call, give the step-by-step
bits: every row's logits and the KV cache, for every GQA family and format, on one thread
and split across the pool, with the records read as they are first routed to (a layer
handed back to the backend) or all read before."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from helpers import FUSED_CASES

from moeshard.coordinator.runtime import open_local
from moeshard.moe.kernels import quant
from moeshard.moe.model import fused_prefill, qwen_moe

PROMPT = 23  # rows of the first call: odd, so the threads' parts differ in size
CHUNK = 7  # rows of the second, after the first's in the cache


def _prefill(transformer):
    """Two multi-row calls on one cache: (every row's logits [PROMPT + CHUNK, V], the cache)."""
    rng = np.random.default_rng(7)
    vocab = transformer.config.vocab_size
    cache = transformer.new_cache(64)
    first = transformer.forward(rng.integers(1, vocab, PROMPT), cache)
    second = transformer.forward(rng.integers(1, vocab, CHUNK), cache)
    return np.concatenate([first, second]), cache


def _same(a, b) -> None:
    (logits_a, cache_a), (logits_b, cache_b) = a, b
    assert logits_a.tobytes() == logits_b.tobytes()
    assert cache_a.length == cache_b.length == PROMPT + CHUNK
    n = cache_a.length
    for ka, kb, va, vb in zip(cache_a.k, cache_b.k, cache_a.v, cache_b.v, strict=True):
        assert ka[:n].tobytes() == kb[:n].tobytes() and va[:n].tobytes() == vb[:n].tobytes()


def _counting(monkeypatch) -> dict[str, int]:
    """`prefill_layers`, counting its calls, the layers it ran to the end, the layers it
    handed back, and the calls it ran on more than one thread."""
    counts = {"calls": 0, "in call": 0, "handed back": 0, "pool": 0}
    real = fused_prefill.prefill_layers

    def counting(*args):
        out = real(*args)
        first, last, stop = args[3], args[4], out[0]
        counts["calls"] += 1
        counts["in call"] += stop - first
        counts["handed back"] += stop < last
        counts["pool"] += numba.get_num_threads() > 1  # (as `quant._launch` set it)
        return out

    monkeypatch.setattr(qwen_moe, "prefill_layers", counting)
    return counts


@pytest.mark.parametrize("family, experts, trunk", FUSED_CASES)
@pytest.mark.parametrize("mode", ["serial", "pool"])
def test_a_prefill_in_one_call_gives_the_step_by_step_bits(
    converted, monkeypatch, family, experts, trunk, mode
):
    rt = open_local(converted(family, experts=experts, trunk=trunk))
    try:
        layers = len(rt.transformer.config.moe_layers)
        # "serial": the call below the pool's threshold (one part); "pool": every part split
        monkeypatch.setattr(quant, "PARALLEL_MIN_WORK", 1 if mode == "pool" else 1 << 62)
        counts = _counting(monkeypatch)
        handing_back = _prefill(rt.transformer)  # records read as they are first routed to
        assert counts["handed back"] > 0 and counts["in call"] > 0
        rt.experts.preload()
        counts.update({key: 0 for key in counts})
        in_call = _prefill(rt.transformer)
        # every record read: each call runs every layer (one run: one format throughout)
        assert counts == {
            "calls": 2,
            "in call": 2 * layers,
            "handed back": 0,
            "pool": 2 if mode == "pool" and quant.threads() > 1 else 0,
        }
        monkeypatch.setattr(rt.transformer, "fused_decode", False)
        steps = _prefill(rt.transformer)
        assert counts["calls"] == 2  # (the steps did not call it)
        _same(handing_back, steps)
        _same(in_call, steps)
    finally:
        rt.close()


def test_rows_of_several_sequences_keep_the_steps(converted, monkeypatch):
    """A batch of two sequences (continuous batching) goes step by step, as before: the
    one-call form is for one sequence's rows."""
    rt = open_local(converted("qwen3_moe", experts="q4_0", trunk="bf16"))
    try:
        rt.experts.preload()
        counts = _counting(monkeypatch)
        tf = rt.transformer
        caches = [tf.new_cache(16), tf.new_cache(16)]
        batch = [(np.array([3, 4, 5]), caches[0]), (np.array([6, 7]), caches[1])]
        together = tf.forward_batch(batch)
        assert counts["calls"] == 0
        alone = [tf.forward(np.array(ids), tf.new_cache(16)) for ids, _ in batch]
        assert counts["calls"] == 2
        for a, b in zip(together, alone, strict=True):
            assert a.tobytes() == b.tobytes()
    finally:
        rt.close()
