"""The decode loop: prefill the prompt in one batch, then one token at a time with the KV cache."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from moe.errors import MoeshardError
from moe.model.trunk import time_linear
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
    # OpenAI's penalties, counted over the tokens this generation has made (`adjust_logits`)
    presence_penalty: float = 0.0  # subtracted once from every token already made
    frequency_penalty: float = 0.0  # subtracted once per time a token was made
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)


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
    profile: dict | None = None  # with profile=True: DecodeProfile.summary()

    @property
    def positions_done(self) -> int:
        """Positions whose forward pass yielded a kept token: the prefill (the prompt's
        positions) made token 0, and each later token's pass added one position."""
        return len(self.prompt_ids) + len(self.tokens) - 1 if self.tokens else 0


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


ROLLBACK_STEPS = 8  # steps a recurrent (KDA) state can be rolled back when nodes are audited


def generate(
    model,
    prompt_ids: list[int],
    opts: SamplingOptions,
    on_token: Callable[[int], None] | None = None,
    on_forward: Callable[[int, int], None] | None = None,
    verifier: Verifier | None = None,
    on_rollback: Callable[[int], None] | None = None,
    keep_partial: bool = False,
    profile: bool = False,
) -> GenerationResult:
    """Run `model` (a family Transformer) on the prompt and generate up to opts.max_tokens.

    on_token(token) after each generated token; on_forward(position, phase) before each
    forward pass (PREFILL or DECODE; a TraceRecorder's `mark`). With a `verifier`, a step
    found to rest on a lying node's work is undone: the KV cache is truncated to where that
    step began, its tokens (and the sampler's state) are forgotten, `on_rollback(tokens kept)`
    is called and the steps run again, so the tokens are those of an honest run.

    keep_partial: a stop before the end (KeyboardInterrupt, Terminated, a MoeshardError such
    as a node or disk failure) returns the tokens so far, with `stopped_by` and `error` set,
    instead of raising.

    profile: time where each decode step goes (`DecodeProfile`); `result.profile` has it."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    loop = _DecodeLoop(model, opts, on_token, on_forward, verifier, on_rollback)
    result = GenerationResult(prompt_ids=list(prompt_ids), tokens=[])
    cache = model.new_cache(len(prompt_ids) + opts.max_tokens)
    if verifier is not None and hasattr(cache, "keep_rollback"):
        cache.keep_rollback(ROLLBACK_STEPS)  # a recurrent state keeps copies to roll back to
    if profile:
        loop.profile = DecodeProfile()
        loop.profile.install(model)
    try:
        try:
            loop.run(result, cache)
        except SystemError as exc:
            raise _signal_behind(exc) from None
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
    finally:
        if loop.profile is not None:
            loop.profile.uninstall(model)
            result.profile = loop.profile.summary()
    return result


_STOPPED_BY = {KeyboardInterrupt: "interrupted", Terminated: "terminated"}


def _signal_behind(exc: SystemError) -> BaseException:
    """The KeyboardInterrupt or Terminated a signal handler raised while a compiled kernel
    ran, else exc. numba's dispatcher reports a handler's exception set during its call as
    a SystemError caused by it ("returned a result with an exception set"), which would
    otherwise turn a Ctrl-C into an internal error (exit 1, no partial result).  Depending on
    where in the call the signal lands, the handler's exception is the SystemError's cause, its
    context, or further down a chain of such SystemErrors (one dispatcher inside another): the
    first KeyboardInterrupt or Terminated along the chain counts."""
    seen, pending = set(), [exc]
    while pending:
        e = pending.pop()
        if isinstance(e, (KeyboardInterrupt, Terminated)):
            return e
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            pending += [e.__context__, e.__cause__]
    return exc


class _DecodeLoop:
    """One generation's steps; keeps what a rollback needs (cache length, sampler state)."""

    def __init__(self, model, opts, on_token, on_forward, verifier, on_rollback):
        self.model, self.opts = model, opts
        self.on_token, self.on_forward = on_token, on_forward
        self.verifier, self.on_rollback = verifier, on_rollback
        self.rng = np.random.default_rng(opts.seed)
        self.starts: list[tuple[int, dict]] = []  # per step: cache length, sampler state
        self.profile: DecodeProfile | None = None

    def run(self, result: GenerationResult, cache) -> None:
        opts, verifier, profile = self.opts, self.verifier, self.profile
        step = 0
        while True:
            if profile:
                profile.begin_step()
            if step == len(self.starts):
                self.starts.append((cache.length, self.rng.bit_generator.state))
            ids = result.prompt_ids if step == 0 else [result.tokens[step - 1]]
            t0 = time.perf_counter()
            if self.on_forward:
                self.on_forward(cache.length, PREFILL if step == 0 else DECODE)
            if verifier:
                verifier.begin_step(step)
            if profile:
                profile.forward_started()
            ids = np.asarray(ids, dtype=np.int64)
            logits = self.model.forward(ids, cache, last_only=True)[-1]  # [V]
            if profile:
                profile.forward_done()
            if step == 0:
                result.prefill_s = time.perf_counter() - t0
            else:
                result.decode_s.append(time.perf_counter() - t0)
            token = sample(logits, opts, self.rng, result.tokens)
            result.tokens.append(token)
            if opts.keep_logits:
                result.logits.append(logits.astype(np.float32))
            if self.on_token:
                self.on_token(token)
            if profile:
                profile.end_step(decode=step > 0)
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


class DecodeProfile:
    """Where a decode step's time goes (`moeshard generate --profile`), per token:

    * trunk: the forward pass less routing and experts: embedding, norms, attention
      projections, RoPE, attention, residual adds, dense and shared MLPs, final norm, lm_head
      ("linear" is the part of it spent in the trunk's linear layers);
    * routing: the routers, and the next layer's router run for the prefetch hint;
    * experts: the experts backend's calls (local kernels, the cache, or the nodes);
    * overhead: the rest of the step: sampling, the token callback, Python between.

    Only decode steps count (not the prefill). The timers are perf_counter_ns accumulators
    installed for the generation only (the model's `route` and `experts` wrapped, Linear's
    call timed, see `moe.model.trunk.time_linear`), so a generation without --profile runs
    no timing code."""

    PARTS = ("trunk", "routing", "experts", "overhead")

    def __init__(self):
        self.totals = dict.fromkeys(("total", "forward", "routing", "experts", "linear"), 0)
        self.step = dict.fromkeys(("routing", "experts", "linear"), 0)
        self.tokens = 0  # decode steps timed
        self._t_step = self._t_forward = self._forward_ns = 0

    # -- installing the timers -------------------------------------------------------------

    def install(self, model) -> None:
        route = model.route  # the bound method (or whatever a caller set)
        step = self.step

        def timed_route(layer, h):
            t0 = time.perf_counter_ns()
            try:
                return route(layer, h)
            finally:
                step["routing"] += time.perf_counter_ns() - t0

        self._saved = (model.__dict__.get("route"), model.experts)
        model.route = timed_route
        model.experts = _TimedExperts(model.experts, step)
        time_linear(self._linear)

    def uninstall(self, model) -> None:
        route, experts = self._saved
        time_linear(None)
        model.experts = experts
        if route is None:
            del model.route
        else:
            model.route = route

    def _linear(self, ns: int) -> None:
        self.step["linear"] += ns

    # -- one step --------------------------------------------------------------------------

    def begin_step(self) -> None:
        for key in self.step:
            self.step[key] = 0
        self._forward_ns = 0
        self._t_step = time.perf_counter_ns()

    def forward_started(self) -> None:
        self._t_forward = time.perf_counter_ns()

    def forward_done(self) -> None:
        self._forward_ns = time.perf_counter_ns() - self._t_forward

    def end_step(self, decode: bool) -> None:
        if not decode:
            return
        totals = self.totals
        totals["total"] += time.perf_counter_ns() - self._t_step
        totals["forward"] += self._forward_ns
        for key, ns in self.step.items():
            totals[key] += ns
        self.tokens += 1

    # -- the result ------------------------------------------------------------------------

    def summary(self) -> dict:
        """Milliseconds per decode token: total and its parts (trunk + routing + experts +
        overhead = total), trunk_linear (within trunk); JSON-able."""
        t, n = self.totals, max(self.tokens, 1)
        parts_ns = {
            "trunk": t["forward"] - t["routing"] - t["experts"],
            "routing": t["routing"],
            "experts": t["experts"],
            "overhead": t["total"] - t["forward"],
        }
        out = {"decode_tokens": self.tokens, "total_ms": t["total"] / n / 1e6}
        out.update({f"{k}_ms": v / n / 1e6 for k, v in parts_ns.items()})
        out["trunk_linear_ms"] = t["linear"] / n / 1e6
        return out


def format_profile(p: dict) -> str:
    """`DecodeProfile.summary()` as a short table (generate --profile prints it on stderr)."""
    total = p["total_ms"] or 1.0
    lines = [f"[profile: {p['decode_tokens']} decode tokens; ms per token]"]
    for part in DecodeProfile.PARTS:
        ms = p[f"{part}_ms"]
        note = ""
        if part == "trunk":
            note = f"  (linear layers {p['trunk_linear_ms']:.3f})"
        lines.append(f"  {part:<9} {ms:8.3f} {ms / total:6.1%}{note}")
    lines.append(f"  {'total':<9} {p['total_ms']:8.3f} {1:6.1%}")
    return "\n".join(lines)


class _TimedExperts:
    """An experts backend whose calls are timed into step["experts"]; every other attribute
    is the wrapped backend's (so `moe.model.layers.uses_hints` answers for it)."""

    def __init__(self, inner, step: dict):
        self.inner, self._step = inner, step

    def __call__(self, layer, hidden, ids, weights, dtype=np.float32, hint=None):
        t0 = time.perf_counter_ns()
        try:
            return self.inner(layer, hidden, ids, weights, dtype, hint=hint)
        finally:
            self._step["experts"] += time.perf_counter_ns() - t0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
