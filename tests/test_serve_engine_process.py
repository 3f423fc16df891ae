"""The batching engine in a child process (`moeshard.coordinator.serve.engine_process`), as
`moeshard serve` runs it: the same tokens as the engine in-process, refusals and counters across the
pipe, a cancel that reaches the child, and requests that end with "error" when the child
dies.  (tests/test_serve_api.py drives a whole server, which runs its engine this way.)"""

from __future__ import annotations

import argparse
import os
import signal

import pytest
from helpers import wait_until

from moeshard.cli import build_parser
from moeshard.commands.serve import open_runtime
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.coordinator.serve.engine import QueueFull
from moeshard.coordinator.serve.engine_process import EngineProcess
from moeshard.moe.errors import MoeshardError

PROMPTS = [[1, 5, 9, 2, 7], [42], [100, 200, 300], [7] * 8]


@pytest.fixture(scope="module")
def model_dir(demo):
    return demo


def serve_args(model_dir, **fields) -> argparse.Namespace:
    """What `moeshard serve MODEL --context 64 --max-batch 4` parses (the real parser), with
    `fields` set on top, for `open_runtime`."""
    args = build_parser().parse_args(
        ["serve", str(model_dir), "--context", "64", "--max-batch", "4"]
    )
    return argparse.Namespace(**(vars(args) | fields))


def start(model_dir, **engine_kwargs) -> EngineProcess:
    kwargs = {"max_batch": 4, "max_queue": 2, "prefill_chunk": 512} | engine_kwargs
    return EngineProcess(open_runtime, serve_args(model_dir), kwargs)


def test_tokens_and_counters_come_back_from_the_child(model_dir):
    transformer = open_local(model_dir).transformer
    opts = [SamplingOptions(max_tokens=5 + 2 * i) for i in range(len(PROMPTS))]
    alone = [generate(transformer, p, o).tokens for p, o in zip(PROMPTS, opts, strict=True)]
    engine = start(model_dir)
    try:
        assert engine.model.config.vocab_size == 4096
        requests = [engine.submit(p, o) for p, o in zip(PROMPTS, opts, strict=True)]
        for r in requests:
            events = list(r.stream(timeout=60))
            assert events[-1].kind == "end" and events[-1].finish == "length"
            assert [e.token for e in events[:-1]] == r.tokens
            assert r.first_token_s is not None and r.finish == "length"
        assert [r.tokens for r in requests] == alone  # greedy: the in-process engine's tokens
        stats = engine.stats
        assert stats.generated_tokens == sum(o.max_tokens for o in opts)
        assert stats.finished_by == {"length": len(PROMPTS)}
        assert stats.first_token.snapshot()[2] == len(PROMPTS)  # the histograms crossed too
        assert engine.running() == 0 and engine.queue_depth() == 0
        assert engine.experts.stats()["records_loaded"] > 0
        with pytest.raises(ValueError, match="empty"):
            engine.submit([], opts[0])
    finally:
        engine.close()


def test_a_full_queue_is_refused_and_a_cancel_reaches_the_child(model_dir):
    engine = start(model_dir, max_batch=1, max_queue=1)
    try:
        long = engine.submit([1, 2, 3], SamplingOptions(max_tokens=5000))  # seconds of work
        waiting = engine.submit([4, 5], SamplingOptions(max_tokens=40))
        with pytest.raises(QueueFull):
            engine.submit([6], SamplingOptions(max_tokens=4))
        waiting.cancel()  # leaves the queue in the child: a new request fits again
        wait_until(lambda: waiting.finish == "cancelled", 30, what="the waiting request's end")
        third = engine.submit([6], SamplingOptions(max_tokens=4))
        long.cancel()
        assert [e.finish for e in long.stream(timeout=60) if e.kind == "end"] == ["cancelled"]
        assert len(long.tokens) < 5000
        assert [e.finish for e in third.stream(timeout=60) if e.kind == "end"] == ["length"]
    finally:
        engine.close()


def test_requests_end_with_an_error_when_the_child_dies(model_dir):
    engine = start(model_dir)
    try:
        request = engine.submit([1, 2, 3], SamplingOptions(max_tokens=5000))  # seconds of work
        os.kill(engine._proc.pid, signal.SIGKILL)
        end = [e for e in request.stream(timeout=60) if e.kind == "end"]
        assert end[0].finish == "error" and "stopped" in end[0].error
        with pytest.raises(RuntimeError, match="stopped"):
            engine.submit([1], SamplingOptions(max_tokens=2))
    finally:
        engine.close()


def test_a_model_that_does_not_open_is_a_clear_error(tmp_path):
    with pytest.raises(MoeshardError, match="no-such-model"):
        EngineProcess(open_runtime, serve_args(tmp_path / "no-such-model"), {})
