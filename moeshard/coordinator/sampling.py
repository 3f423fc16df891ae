"""Choosing the next token from a step's logits: greedy, temperature, top-k, top-p, and
OpenAI's logit_bias, presence and frequency penalties. One definition for `generate` and the
serving engine (`moeshard.coordinator.decode`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingOptions:
    max_tokens: int = 64  # stop after this many generated tokens
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # keep only the k most likely tokens (0: off)
    top_p: float = 1.0  # nucleus: smallest set whose probability reaches p (1: off)
    seed: int | None = None  # RNG seed for sampling
    eos_ids: tuple[int, ...] = ()  # stop when one of these is generated
    keep_logits: bool = False  # return the logits each token was chosen from
    # OpenAI's penalties, counted over the tokens this generation has made (`adjust_logits`)
    presence_penalty: float = 0.0  # subtracted once from every token already made
    frequency_penalty: float = 0.0  # subtracted once per time a token was made
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)


def adjust_logits(
    logits: np.ndarray, opts: SamplingOptions, generated: Sequence[int] = ()
) -> np.ndarray:
    """logits [V] with opts.logit_bias added and the presence and frequency penalties taken
    off, as OpenAI defines them: logit[j] - c[j] * frequency_penalty - (c[j] > 0) *
    presence_penalty, c[j] the times token j is in `generated` (this generation's tokens so
    far; the prompt's do not count, as in vLLM).  The same array when there are none."""
    if not (opts.logit_bias or opts.presence_penalty or opts.frequency_penalty):
        return logits
    out = logits.astype(np.float32, copy=True)  # [V]
    for token, bias in opts.logit_bias:
        out[token] += np.float32(bias)
    if len(generated) and (opts.presence_penalty or opts.frequency_penalty):
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=out.size)  # [V]
        counts = counts[: out.size]
        out -= (opts.frequency_penalty * counts + opts.presence_penalty * (counts > 0)).astype(
            np.float32
        )
    return out


def sample(
    logits: np.ndarray,
    opts: SamplingOptions,
    rng: np.random.Generator,
    generated: Sequence[int] = (),
) -> int:
    """Pick the next token from logits [V] (after `adjust_logits` with `generated`, this
    generation's tokens so far)."""
    logits = adjust_logits(logits, opts, generated)
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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """logits [V] -> log-probabilities [V], in float64."""
    shifted = logits.astype(np.float64) - logits.max()  # [V]
    return shifted - np.log(np.exp(shifted).sum())
