"""The continuous-batching engine (`coordinator/serve/engine.py`) on the embedded model:
requests join and leave at token boundaries, greedy tokens are the same alone or together,
one experts call per layer serves every running sequence, a cancelled request frees its
slot, and a full queue refuses (but not for requests whose clients have left)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.coordinator.serve.engine import Engine, QueueFull

PROMPTS = [[1, 5, 9, 2, 7], [42], [100, 200, 300], [7] * 8, [3, 1, 4, 1, 5, 9, 2, 6], [77, 88]]


@pytest.fixture(scope="module")
def demo(demo):
    """The session's demo model, open (this module's own: its tests run it)."""
    return open_local(demo).transformer


class CountingExperts:
    """The model's experts backend, counting calls and rows per MoE layer."""

    def __init__(self, inner):
        self.inner, self.calls, self.rows = inner, 0, 0

    def __call__(self, layer, hidden, ids, weights, dtype=np.float32, hint=None):
        self.calls += 1
        self.rows += hidden.shape[0]
        return self.inner(layer, hidden, ids, weights, dtype, hint)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_greedy_tokens_are_the_same_alone_or_together(demo):
    opts = [SamplingOptions(max_tokens=6 + 3 * i) for i in range(len(PROMPTS))]
    alone = [generate(demo, p, o).tokens for p, o in zip(PROMPTS, opts, strict=True)]
    engine = Engine(demo, max_batch=4, max_queue=8)  # 6 requests: some wait, join later
    try:
        requests = [engine.submit(p, o) for p, o in zip(PROMPTS, opts, strict=True)]
        for r in requests:
            events = list(r.stream(timeout=60))
            assert events[-1].finish == "length"
        assert [r.tokens for r in requests] == alone
        assert engine.stats.batch_rows > engine.stats.steps  # steps ran several sequences
    finally:
        engine.close()


def test_one_experts_call_per_layer_serves_every_sequence(demo):
    counting = CountingExperts(demo.experts)
    demo.experts = counting
    try:
        engine = Engine(demo, max_batch=4)
        requests = [engine.submit(p, SamplingOptions(max_tokens=5)) for p in PROMPTS[:4]]
        for r in requests:
            list(r.stream(timeout=60))
        engine.close()
    finally:
        demo.experts = counting.inner
    moe_layers = len(demo.config.moe_layers)
    assert counting.calls == engine.stats.steps * moe_layers
    assert counting.calls < 4 * 5 * moe_layers  # fewer than one call per sequence and step


def test_a_cancelled_request_frees_its_slot(demo):
    engine = Engine(demo, max_batch=1, max_queue=4)
    try:
        long = engine.submit(PROMPTS[0], SamplingOptions(max_tokens=200))
        short = engine.submit(PROMPTS[1], SamplingOptions(max_tokens=3))
        first = next(long.stream(timeout=60))
        assert first.kind == "token" and short.tokens == []  # waiting: the slot is taken
        long.cancel()
        assert list(long.stream(timeout=60))[-1].finish == "cancelled"
        assert list(short.stream(timeout=60))[-1].finish == "length"
        assert len(long.tokens) < 200
    finally:
        engine.close()


def test_a_full_queue_refuses(demo):
    gate = threading.Event()
    engine = Engine(demo, max_batch=1, max_queue=1)
    original = engine.decoder._forward
    engine.decoder._forward = lambda batch: (gate.wait(30), original(batch))[1]
    try:
        engine.submit(PROMPTS[0], SamplingOptions(max_tokens=2))  # admitted, held at its step
        for _ in range(100):  # until the scheduler has taken it
            if engine.running():
                break
            threading.Event().wait(0.01)
        waiting = engine.submit(PROMPTS[1], SamplingOptions(max_tokens=2))  # the queue's one
        with pytest.raises(QueueFull):
            engine.submit(PROMPTS[2], SamplingOptions(max_tokens=2))
        assert engine.stats.rejected == 1
        waiting.cancel()  # its client left: it holds no room, and ends at once
        assert engine.queue_depth() == 0
        assert list(waiting.stream(timeout=5))[-1].finish == "cancelled"
        engine.submit(PROMPTS[2], SamplingOptions(max_tokens=2))  # queued in its place
        assert engine.queue_depth() == 1 and engine.stats.prompt_tokens == len(PROMPTS[0])
    finally:
        gate.set()
        engine.close()


@pytest.mark.parametrize("n", [1, 4])
def test_finished_sequences_leave_no_cache_behind(demo, n):
    """Once the batch empties, no finished sequence's KV cache is still referenced (the
    model's kept typed lists of the last batch are dropped too, and those of a sequence
    decoded alone: `Transformer._runs`)."""
    import gc
    import weakref

    made = []
    new_cache = demo.new_cache

    def recording(n):
        cache = new_cache(n)
        made.append(weakref.ref(cache))
        return cache

    demo.new_cache = recording
    engine = Engine(demo, max_batch=4, max_queue=8)
    try:
        requests = [engine.submit(p, SamplingOptions(max_tokens=4)) for p in PROMPTS[:n]]
        for r in requests:
            list(r.stream(timeout=60))
        wait = threading.Event()
        for _ in range(50):  # the scheduler drops them right after the last step
            gc.collect()
            if all(ref() is None for ref in made):
                break
            wait.wait(0.05)
        assert len(made) == n and all(ref() is None for ref in made), "a cache is still alive"
    finally:
        engine.close()
        del demo.new_cache


def test_long_prompts_are_read_in_pieces_with_the_same_tokens(demo):
    """prefill_chunk=3: a prompt is fed in pieces that end at multiples of 3 positions, at
    most 3 prompt tokens a step in all, beside the other sequences' decode rows; greedy
    tokens are still `generate`'s (whole prompts at once: the demo model's logits do not
    depend on where a prompt is cut)."""
    engine = Engine(demo, max_batch=4, max_queue=8, prefill_chunk=3)
    steps: list[list[int]] = []
    original = engine.decoder._forward

    def recorded(batch):
        steps.append([len(ids) for ids, _ in batch])
        return original(batch)

    engine.decoder._forward = recorded
    try:
        lone = engine.submit(PROMPTS[4], SamplingOptions(max_tokens=1))  # 8 tokens: 3 + 3 + 2
        assert [e.kind for e in lone.stream(timeout=60)] == ["token", "end"]
        assert steps == [[3], [3], [2]]
        steps.clear()
        opts = [SamplingOptions(max_tokens=6) for _ in PROMPTS]
        want = [generate(demo, p, o).tokens for p, o in zip(PROMPTS, opts, strict=True)]
        requests = [engine.submit(p, o) for p, o in zip(PROMPTS, opts, strict=True)]
        for request in requests:
            assert list(request.stream(timeout=60))[-1].finish == "length"
        assert [r.tokens for r in requests] == want
        assert all(sum(s) <= 3 + len(s) for s in steps), steps  # decode rows + <= 3 prompt
        assert max(max(s) for s in steps) == 3
    finally:
        engine.close()


def test_latency_histograms_count_every_token_and_request(demo):
    """/metrics' histograms: one first-token time per request, a gap per further token, one
    whole time per request, and their sums the requests' own times."""
    engine = Engine(demo, max_batch=2, max_queue=4)  # 3 requests: one waits, joins later
    try:
        opts = [SamplingOptions(max_tokens=n) for n in (3, 5, 4)]
        requests = [engine.submit(p, o) for p, o in zip(PROMPTS[:3], opts, strict=True)]
        for r in requests:
            assert list(r.stream(timeout=60))[-1].finish == "length"
        st = engine.stats
        _, first_sum, first_n = st.first_token.snapshot()
        _, gap_sum, gap_n = st.inter_token.snapshot()
        _, whole_sum, whole_n = st.request_time.snapshot()
        assert (first_n, gap_n, whole_n) == (3, 2 + 4 + 3, 3)
        assert first_sum == pytest.approx(sum(r.first_token_s for r in requests))
        last = [r.last_token_at - r.submitted for r in requests]  # to each one's last token
        assert gap_sum == pytest.approx(sum(last) - first_sum)
        assert whole_sum >= sum(last)
    finally:
        engine.close()


def test_histogram_buckets_are_cumulative_and_inclusive():
    from moeshard.coordinator.serve.histogram import Histogram

    h = Histogram((0.01, 0.1, 1.0))
    for seconds in (0.005, 0.01, 0.05, 0.5, 2.0):
        h.observe(seconds)
    assert h.snapshot() == ([2, 3, 4, 5], pytest.approx(2.565), 5)
    lines = h.prometheus("x_seconds", "a test")
    assert 'x_seconds_bucket{le="0.01"} 2' in lines and 'x_seconds_bucket{le="+Inf"} 5' in lines
    assert lines[-2:] == ["x_seconds_sum 2.565", "x_seconds_count 5"]
    with pytest.raises(ValueError, match="must increase"):
        Histogram((0.1, 0.01))
