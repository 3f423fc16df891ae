"""`generate`: one prompt continued to the end, as the decode core's batch of one
(`moeshard.coordinator.decode`): prefill the prompt in one pass, then one token at a time with the
KV cache; with a verifier, a step found to rest on a lying node's work is undone and run again."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from moeshard.coordinator.decode import MAX_LAG, ROLLBACK_STEPS, Decoder, LieTooFarBack, Verifier
from moeshard.coordinator.profile import DecodeProfile, format_profile
from moeshard.coordinator.sampling import SamplingOptions
from moeshard.moe import sigint
from moeshard.moe.errors import MoeshardError, Terminated  # noqa: F401  (Terminated: re-exported)
from moeshard.moe.storage.traces import DECODE, PREFILL

__all__ = [
    "MAX_LAG", "ROLLBACK_STEPS", "DecodeProfile", "GenerationResult", "LieTooFarBack",
    "SamplingOptions", "Terminated", "Verifier", "format_profile", "generate",
    "stop_between_steps",
]  # fmt: skip


_PENDING: list[BaseException] = []  # a stop asked for by a signal, taken at the next step
_ASKED: list[int] = []  # signals seen in the block (a second one raises at once)


@contextmanager
def stop_between_steps() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM stop the generation between two steps: the
    handler only notes the signal, and the step loop raises KeyboardInterrupt or Terminated
    where nothing is half done (default: SIGTERM kills the process with the tokens so far,
    and SIGINT raises at whatever line runs, which inside grpc can leave one of its locks
    held and the process hung at exit, or a thread's traceback on the terminal).  A second
    signal raises at once, as before.  Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        exc = KeyboardInterrupt() if signum == signal.SIGINT else Terminated("terminated (SIGTERM)")
        if _ASKED:  # asked twice: stop now
            raise exc
        _ASKED.append(signum)
        _PENDING.append(exc)

    previous = {signal.SIGINT: sigint.install(handler)}  # (an ignored SIGINT stays ignored)
    previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
    try:
        yield
        _raise_pending()  # (a signal after the last step still counts)
    finally:
        _PENDING.clear()
        _ASKED.clear()
        for sig, old in previous.items():
            signal.signal(sig, old)


def _raise_pending() -> None:
    """Raise the stop a signal asked for, once."""
    if _PENDING:
        raise _PENDING.pop()


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
    is called and the steps run again, so the tokens are those of an honest run. The last
    tokens' checks are waited for before the result is final.

    keep_partial: a stop before the end (KeyboardInterrupt, Terminated, a MoeshardError such
    as a node or disk failure) returns the tokens so far, with `stopped_by` and `error` set,
    instead of raising.

    profile: time where each decode step goes (`DecodeProfile`); `result.profile` has it."""
    decoder = Decoder(model, verifier)
    seq = decoder.start(prompt_ids, opts)
    result = GenerationResult(prompt_ids=list(prompt_ids), tokens=seq.tokens, logits=seq.logits)
    loop = _Loop(decoder, seq, result, on_token, on_forward, on_rollback)
    if profile:
        loop.profile = DecodeProfile()
        loop.profile.install(model)
    try:
        try:
            loop.run()
        except SystemError as exc:
            raise _signal_behind(exc) from None
    except (KeyboardInterrupt, Terminated, MoeshardError) as exc:
        if not keep_partial:
            raise
        # stopped early (Ctrl-C, SIGTERM, a node or disk failure): the tokens so far are the
        # result, less those resting on work already known to be a lie
        loop.check_rollback()
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


class _Loop:
    """One generation's steps through the decoder, timed, with its callbacks."""

    def __init__(self, decoder: Decoder, seq, result, on_token, on_forward, on_rollback):
        self.decoder, self.seq, self.result = decoder, seq, result
        self.on_token, self.on_forward, self.on_rollback = on_token, on_forward, on_rollback
        self.profile: DecodeProfile | None = None

    def run(self) -> None:
        seq, result, opts, profile = self.seq, self.result, self.seq.opts, self.profile
        verifier = self.decoder.verifier
        while True:
            _raise_pending()  # Ctrl-C or SIGTERM (stop_between_steps)
            if profile:
                profile.begin_step()
            if self.on_forward:
                self.on_forward(seq.cache.length, DECODE if seq.tokens else PREFILL)
            prefill = not seq.tokens
            if verifier:  # at most MAX_LAG steps ahead of their audits
                verifier.wait_settled(self.decoder.step_no - MAX_LAG)
            t0 = time.perf_counter()
            if profile:
                profile.forward_started()
            self.decoder.step([(seq, seq.pending)])
            if verifier:  # what a recurrent state's rollback may not go back past
                seq.shown = max(seq.shown, self.decoder.settled(seq))
            if profile:
                profile.forward_done()
            if prefill:
                result.prefill_s = time.perf_counter() - t0
            else:
                result.decode_s.append(time.perf_counter() - t0)
            token = seq.tokens[-1]
            if self.on_token:
                self.on_token(token)
            if profile:
                profile.end_step(decode=not prefill)
            done = token in opts.eos_ids or len(seq.tokens) == opts.max_tokens
            if done and verifier:
                verifier.drain()  # the last tokens' checks, before calling the text final
            if self.check_rollback():
                continue
            if done:
                result.stopped_by = "eos" if token in opts.eos_ids else "max_tokens"
                return

    def check_rollback(self) -> bool:
        """Undo what a caught lie touched (timings too); True if something was.
        LieTooFarBack (its tokens cut before the lie) if the state cannot go back to it."""
        undone, lost = self.decoder.rollback([self.seq], retract=True)
        if lost:
            del self.result.decode_s[max(len(self.seq.tokens) - 1, 0) :]
            raise LieTooFarBack(
                "a node's lie was caught further back than this model's recurrent state can be "
                f"rolled back ({ROLLBACK_STEPS} steps): the {len(self.seq.tokens)} tokens before "
                "it are kept"
            )
        if not undone:
            return False
        kept = len(self.seq.history)  # forward passes kept: the prefill, then decode steps
        del self.result.decode_s[max(kept - 1, 0) :]
        self.result.rollbacks += 1
        if self.on_rollback:
            self.on_rollback(len(self.seq.tokens))
        return True
