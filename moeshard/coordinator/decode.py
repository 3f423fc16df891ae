"""The one decode core: sequences stepped through the model together, checked as they go.

`Decoder.step` runs one forward pass over a batch of (sequence, ids it feeds) — a prompt (or a
piece of one) beside other sequences' single decode rows — and samples a token for every
sequence whose prompt is all in. Each sequence keeps its own cache and random generator, so
its tokens are the same alone or in any batch (the kernels compute a row the same way in any
batch). `generate` runs it with one sequence; the serving engine with many, joining and
leaving at token boundaries.

With a `Verifier` (the auditor of the nodes' work, coordinator/remote/audit.py), every step
is numbered, and each sequence remembers where each of its forward passes began (cache length,
sampler state, tokens so far, what it was to feed). When the verifier finds that some step
used a lie, `rollback` undoes every sequence back to that step, so the steps run again on
honest work. A caller that has already shown a sequence's tokens to someone (`Sequence.shown`)
asks for no retraction: that sequence goes back no further than its first unshown token.
`settled` says how many of a sequence's tokens rest only on calls whose audits are done (or
were never picked): those may be shown without ever being taken back for a caught lie. A
caller keeps within MAX_LAG steps of the last settled step (`Verifier.wait_settled`), so a lie
caught by an audit is never further back than a recurrent (KDA) state can be rolled back.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from moeshard.coordinator.sampling import SamplingOptions, sample
from moeshard.moe.errors import MoeshardError

log = logging.getLogger(__name__)

ROLLBACK_STEPS = 8  # steps a recurrent (KDA) state can be rolled back when nodes are audited
MAX_LAG = ROLLBACK_STEPS - 1  # steps the decoder may run ahead of the last settled one


class LieTooFarBack(MoeshardError):
    """A lie was caught in a step a sequence's state can no longer go back to: the sequence
    rests on it and cannot go on honestly. Exit 3 (the nodes cannot give an honest run)."""

    exit_code = 3


class Verifier(Protocol):
    """What the decoder asks of a backend that checks its nodes' work after the fact
    (`moeshard.coordinator.remote.audit.Auditor`). Steps are numbered upwards, one per
    forward pass."""

    step: int  # the step the calls now coming belong to

    def begin_step(self, step: int) -> None:
        """The next expert calls belong to forward pass `step`."""

    def rollback_step(self) -> int | None:
        """The earliest step whose result used work now known to be wrong (then cleared)."""

    def undo(self, step: int) -> None:
        """Steps from `step` on were undone: forget the calls they made."""

    def settled_step(self) -> int:
        """The last step whose every picked call has been checked."""

    def forget_before(self, step: int) -> None:
        """Steps before `step` will never be undone."""

    def tokens(self, n: int) -> None:
        """`n` tokens were generated (the audits' byte budget is per token)."""

    def drain(self) -> None:
        """Wait for the checks still in flight."""

    def wait_settled(self, step: int, timeout: float = ..., stall: bool = True) -> bool:
        """Wait until `settled_step() >= step` or a rollback is due (AuditStall after
        `timeout`, or False with `stall` False)."""


@dataclass
class _Start:
    """Where one forward pass of a sequence began: what a rollback restores."""

    step: int  # the decoder's step number
    length: int  # the cache's length
    rng_state: dict  # the sampler's
    tokens: int  # tokens made before it
    pending: list[int]  # what was left to feed (the rest of the prompt, or the last token)


@dataclass
class Sequence:
    """One generation: its prompt, sampler and cache, and what it has made so far."""

    prompt_ids: list[int]
    opts: SamplingOptions
    cache: object
    rng: np.random.Generator
    pending: list[int]  # ids to feed: what is left of the prompt, then the last token
    tokens: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # the step that made each token
    logits: list[np.ndarray] = field(default_factory=list)  # [V] per token (opts.keep_logits)
    last_logits: np.ndarray | None = None  # [V]: what the latest token was chosen from
    history: list[_Start] = field(default_factory=list)
    shown: int = 0  # tokens the caller has shown: a rollback keeps them (no retraction)
    rollbacks: int = 0  # times its steps were undone and run again


class Decoder:
    def __init__(self, model, verifier: Verifier | None = None):
        self.model, self.verifier = model, verifier
        batched = getattr(model, "forward_batch", None)
        # each sequence's last row's logits: all sampling reads (families without a batched
        # pass run their sequences one after the other)
        self._forward = (
            (lambda batch: batched(batch, last_only=True))
            if batched
            else (lambda batch: [model.forward(ids, cache, True)[-1:] for ids, cache in batch])
        )
        # the steps of earlier generations on the same verifier are never undone
        self.step_no = verifier.step + 1 if verifier is not None else 0
        if verifier is not None:
            verifier.forget_before(self.step_no)

    def start(self, prompt_ids: list[int], opts: SamplingOptions) -> Sequence:
        """A new sequence, its cache sized for its prompt and max_tokens."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        cache = self.model.new_cache(len(prompt_ids) + opts.max_tokens)
        if self.verifier is not None and hasattr(cache, "keep_rollback"):
            cache.keep_rollback(ROLLBACK_STEPS)  # a recurrent state keeps copies to roll back to
        rng = np.random.default_rng(opts.seed)
        return Sequence(list(prompt_ids), opts, cache, rng, list(prompt_ids))

    def step(self, batch: list[tuple[Sequence, list[int]]]) -> list[Sequence]:
        """One forward pass: each sequence feeds its ids (the head of its `pending`); those
        whose prompt is then all in sample a token. Returns them, in batch order."""
        if self.verifier is not None:
            self.verifier.begin_step(self.step_no)
        for seq, _ in batch:
            state = seq.rng.bit_generator.state
            start = _Start(self.step_no, seq.cache.length, state, len(seq.tokens), seq.pending)
            seq.history.append(start)
        logits = self._forward([(np.asarray(ids, dtype=np.int64), s.cache) for s, ids in batch])
        made = []
        for (seq, ids), out in zip(batch, logits, strict=True):
            seq.pending = seq.pending[len(ids) :]
            if seq.pending:  # more of its prompt to feed
                continue
            last = out[-1]  # [V]
            token = sample(last, seq.opts, seq.rng, seq.tokens)
            seq.tokens.append(token)
            seq.token_steps.append(self.step_no)
            seq.last_logits = last
            if seq.opts.keep_logits:
                seq.logits.append(last.astype(np.float32))
            seq.pending = [token]
            made.append(seq)
        self.step_no += 1
        if self.verifier is not None:
            self.verifier.tokens(len(made))
        return made

    def rollback(
        self, sequences: list[Sequence], retract: bool
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Undo what a caught lie touched: every sequence goes back to its first forward pass
        at or after the step the verifier names; with `retract` False, or with a recurrent
        state (which keeps only ROLLBACK_STEPS passes), no further back than its first
        unshown token. Returns (the sequences undone: their `pending` is what to feed again,
        the sequences that cannot go back far enough: they rest on the lie and must end)."""
        back = self.verifier.rollback_step() if self.verifier is not None else None
        if back is None:
            return [], []
        undone, lost = [], []
        for seq in sequences:
            outcome = self._undo(seq, back, retract)
            if outcome is not None:
                (undone if outcome else lost).append(seq)
        self.verifier.undo(back)
        return undone, lost

    @staticmethod
    def _undo(seq: Sequence, back: int, retract: bool) -> bool | None:
        """True: undone to the pass at or after `back`; None: nothing of it to undo; False:
        its cache cannot go back there (a recurrent state's copies are gone)."""
        floor = 0 if retract and not hasattr(seq.cache, "keep_rollback") else seq.shown
        at = next((i for i, s in enumerate(seq.history) if s.step >= back), None)
        while at is not None and seq.history[at].tokens < floor:
            at = at + 1 if at + 1 < len(seq.history) else None
        if at is None:
            return None
        start = seq.history[at]
        try:
            seq.cache.truncate(start.length)
        except ValueError:  # more than ROLLBACK_STEPS passes back: it ends, its tokens cut
            log.warning("a lie caught at step %d is further back than its state keeps", back)
            del seq.tokens[start.tokens :], seq.token_steps[start.tokens :]
            del seq.logits[start.tokens :]
            return False
        seq.rng.bit_generator.state = start.rng_state
        del seq.tokens[start.tokens :], seq.token_steps[start.tokens :], seq.logits[start.tokens :]
        del seq.history[at:]
        seq.pending = start.pending
        seq.rollbacks += 1
        return True

    def settled(self, seq: Sequence) -> int:
        """How many of `seq`'s tokens rest only on settled steps (all of them, unverified)."""
        if self.verifier is None:
            return len(seq.tokens)
        return bisect.bisect_right(seq.token_steps, self.verifier.settled_step())

    def forget(self, sequences: list[Sequence], retract: bool) -> None:
        """Tell the verifier which steps can no longer be undone: those before every running
        sequence's earliest undoable pass (its first with `retract`, else the one making its
        first unshown token), so its records stay bounded however long it serves."""
        if self.verifier is None:
            return
        floors = [self.step_no]
        for seq in sequences:
            if not seq.history:
                continue
            if retract:
                floors.append(seq.history[0].step)
            else:
                live = [s.step for s in seq.history if s.tokens >= seq.shown]
                floors.append(live[0] if live else self.step_no)
        self.verifier.forget_before(min(floors))
