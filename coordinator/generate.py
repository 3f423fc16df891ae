"""The decode loop: prefill the prompt in one batch, then one token at a time with the KV cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moe.storage.traces import DECODE, PREFILL


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
    stopped_by: str = "max_tokens"  # "eos" or "max_tokens"


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


def generate(
    model,
    prompt_ids: list[int],
    opts: SamplingOptions,
    on_token: Callable[[int], None] | None = None,
    on_forward: Callable[[int, int], None] | None = None,
) -> GenerationResult:
    """Run `model` (a family Transformer) on the prompt and generate up to opts.max_tokens.

    on_token(token) after each generated token; on_forward(position, phase) before each
    forward pass (PREFILL or DECODE; a TraceRecorder's `mark`)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    rng = np.random.default_rng(opts.seed)
    cache = model.new_cache(len(prompt_ids) + opts.max_tokens)
    result = GenerationResult(prompt_ids=list(prompt_ids), tokens=[])
    t0 = time.perf_counter()
    if on_forward:
        on_forward(cache.length, PREFILL)
    logits = model.forward(np.asarray(prompt_ids, dtype=np.int64), cache)[-1]  # [V]
    result.prefill_s = time.perf_counter() - t0
    while len(result.tokens) < opts.max_tokens:
        token = sample(logits, opts, rng)
        result.tokens.append(token)
        if opts.keep_logits:
            result.logits.append(logits.astype(np.float32))
        if on_token:
            on_token(token)
        if token in opts.eos_ids:
            result.stopped_by = "eos"
            break
        if len(result.tokens) == opts.max_tokens:
            break
        t0 = time.perf_counter()
        if on_forward:
            on_forward(cache.length, DECODE)
        logits = model.forward(np.asarray([token], dtype=np.int64), cache)[-1]  # [V]
        result.decode_s.append(time.perf_counter() - t0)
    return result
