"""The decode loop: prefill the prompt in one batch, then one token at a time with the KV cache."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from moe.errors import MoeshardError
from moe.storage.traces import DECODE, PREFILL


class Terminated(BaseException):
    """SIGTERM arrived during a generation (raised like KeyboardInterrupt for SIGINT, so no
    `except Exception` swallows it); the CLI exits 143 after writing the partial result."""


@contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated in the main thread (default: the process
    dies at once and the tokens so far are lost)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated("terminated (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class SamplingOptions:
    max_tokens: int = 64  # stop after this many generated tokens
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # keep only the k most likely tokens (0: off)
    top_p: float = 1.0  # nucleus: smallest set whose probability reaches p (1: off)
    seed: int | None = None  # RNG seed for sampling
    eos_ids: tuple[int, ...] = ()  # stop when one of these is generated
    keep_logits: bool = False  # return the logits each token was chosen from


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    logits: list[np.ndarray] = field(default_factory=list)  # [V] per generated token
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)  # seconds per decode step
    stopped_by: str = "max_tokens"  # "eos", "max_tokens", "interrupted", "terminated", "error"
    rollbacks: int = 0  # times a lying node's work was undone and recomputed
    error: BaseException | None = None  # what stopped the generation early, if anything

    @property
    def positions_done(self) -> int:
        """Positions whose forward pass yielded a kept token: the prefill (the prompt's
        positions) made token 0, and each later token's pass added one position."""
        return len(self.prompt_ids) + len(self.tokens) - 1 if self.tokens else 0


def sample(logits: np.ndarray, opts: SamplingOptions, rng: np.random.Generator) -> int:
    """Pick the next token from logits [V]."""
    if opts.temperature <= 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / opts.temperature  # [V]
    if opts.top_k > 0 and opts.top_k < scaled.size:
        kth = np.partition(scaled, -opts.top_k)[-opts.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()  # [V]
    if opts.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")  # [V]
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, opts.top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(probs.size, p=probs))


class Verifier(Protocol):
    """What the decode loop asks of a backend that checks its nodes' work after the fact
    (`coordinator.remote.audit.Auditor`). Steps are forward passes: 0 is the prefill, step
    s >= 1 feeds token s - 1 and yields token s."""

    def begin_step(self, step: int) -> None:
        """The next expert calls belong to forward pass `step`."""

    def rollback_step(self) -> int | None:
        """The earliest step whose result used work now known to be wrong (then cleared)."""

    def drain(self) -> None:
        """Wait for the checks still in flight."""


def generate(
    model,
    prompt_ids: list[int],
    opts: SamplingOptions,
    on_token: Callable[[int], None] | None = None,
    on_forward: Callable[[int, int], None] | None = None,
    verifier: Verifier | None = None,
    on_rollback: Callable[[int], None] | None = None,
    keep_partial: bool = False,
) -> GenerationResult:
    """Run `model` (a family Transformer) on the prompt and generate up to opts.max_tokens.

    on_token(token) after each generated token; on_forward(position, phase) before each
    forward pass (PREFILL or DECODE; a TraceRecorder's `mark`). With a `verifier`, a step
    found to rest on a lying node's work is undone: the KV cache is truncated to where that
    step began, its tokens (and the sampler's state) are forgotten, `on_rollback(tokens kept)`
    is called and the steps run again, so the tokens are those of an honest run.

    keep_partial: a stop before the end (KeyboardInterrupt, Terminated, a MoeshardError such
    as a node or disk failure) returns the tokens so far, with `stopped_by` and `error` set,
    instead of raising."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    loop = _DecodeLoop(model, opts, on_token, on_forward, verifier, on_rollback)
    result = GenerationResult(prompt_ids=list(prompt_ids), tokens=[])
    cache = model.new_cache(len(prompt_ids) + opts.max_tokens)
    try:
        loop.run(result, cache)
    except (KeyboardInterrupt, Terminated, MoeshardError) as exc:
        if not keep_partial:
            raise
        # stopped early (Ctrl-C, SIGTERM, a node or disk failure): the tokens so far are the
        # result, less those resting on work already known to be a lie
        back = verifier.rollback_step() if verifier else None
        if back is not None and back < len(loop.starts):
            loop.roll_back(result, cache, back)
        result.error = exc
        result.stopped_by = _STOPPED_BY.get(type(exc), "error")
    return result


_STOPPED_BY = {KeyboardInterrupt: "interrupted", Terminated: "terminated"}


class _DecodeLoop:
    """One generation's steps; keeps what a rollback needs (cache length, sampler state)."""

    def __init__(self, model, opts, on_token, on_forward, verifier, on_rollback):
        self.model, self.opts = model, opts
        self.on_token, self.on_forward = on_token, on_forward
        self.verifier, self.on_rollback = verifier, on_rollback
        self.rng = np.random.default_rng(opts.seed)
        self.starts: list[tuple[int, dict]] = []  # per step: cache length, sampler state

    def run(self, result: GenerationResult, cache) -> None:
        opts, verifier = self.opts, self.verifier
        step = 0
        while True:
            if step == len(self.starts):
                self.starts.append((cache.length, self.rng.bit_generator.state))
            ids = result.prompt_ids if step == 0 else [result.tokens[step - 1]]
            t0 = time.perf_counter()
            if self.on_forward:
                self.on_forward(cache.length, PREFILL if step == 0 else DECODE)
            if verifier:
                verifier.begin_step(step)
            logits = self.model.forward(np.asarray(ids, dtype=np.int64), cache)[-1]  # [V]
            if step == 0:
                result.prefill_s = time.perf_counter() - t0
            else:
                result.decode_s.append(time.perf_counter() - t0)
            token = sample(logits, opts, self.rng)
            result.tokens.append(token)
            if opts.keep_logits:
                result.logits.append(logits.astype(np.float32))
            if self.on_token:
                self.on_token(token)
            done = token in opts.eos_ids or len(result.tokens) == opts.max_tokens
            if done and verifier:
                verifier.drain()  # the last tokens' checks, before calling the text final
            back = verifier.rollback_step() if verifier else None
            if back is not None and back <= step:
                step = self.roll_back(result, cache, back)
                continue
            if done:
                result.stopped_by = "eos" if token in opts.eos_ids else "max_tokens"
                return
            step += 1

    def roll_back(self, result: GenerationResult, cache, step: int) -> int:
        """Undo steps `step`.. : cache, tokens, logits, timings and the sampler; returns
        `step`, the one to run next."""
        length, state = self.starts[step]
        cache.truncate(length)
        self.rng.bit_generator.state = state
        del self.starts[step + 1 :]
        del result.tokens[step:]
        del result.logits[step:]
        del result.decode_s[max(step - 1, 0) :]
        result.rollbacks += 1
        if self.on_rollback:
            self.on_rollback(len(result.tokens))
        return step
