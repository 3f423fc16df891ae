"""Continuous batching: many requests share one model, joining and leaving at token
boundaries.

One scheduler thread owns the model and the decode core (`moeshard.coordinator.decode.Decoder`, the
one `generate` runs with a batch of one).  Each step it admits waiting requests (up to
`max_batch` running), then makes one `Decoder.step` over every running sequence, each with
its own cache: a new request's prompt (its prefill, in pieces of at most `prefill_chunk`
tokens a step: `_schedule`) beside the others' single decode rows.  So each
MoE layer makes one experts call with every sequence's rows, and an expert that several
sequences route to is read (or fetched from a node) once per step.  Each sequence samples its
next token from its own logits with its own random generator; a sequence's logits do not
depend on what else is in the batch (the kernels compute a row the same way in any batch),
so greedy requests give the same tokens alone or together (tests/test_serve_engine.py).

A request ends at an end-of-sequence token, a stop sequence, `max_tokens`, or when its
client goes away (`Request.cancel`): it leaves the batch at the next token boundary and its
cache is dropped at once.  Beyond `max_queue` waiting requests `submit` refuses (HTTP 429 in
the server).

With a `verifier` (nodes whose work is audited), a token is sent to its client only once the
steps it rests on are settled: every call of theirs that was picked for an audit has been
recomputed (calls not picked are settled at once).  A lie caught by an audit therefore never
reaches a client: the decoder rolls the sequences it touched back to the step that used it,
never past a token already sent (no retraction), and they run again on honest work.  The
engine runs at most `max_lag` steps ahead of the last settled one (then it waits for the
audits), which bounds how long a token waits and how far a rollback may go.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from moeshard.coordinator.decode import MAX_LAG, Decoder, Sequence, Verifier
from moeshard.coordinator.sampling import SamplingOptions, log_softmax
from moeshard.coordinator.serve.histogram import REQUEST_BUCKETS, TOKEN_BUCKETS, Histogram

log = logging.getLogger(__name__)

HELD_BUCKETS = (0, 1, 2, 4, 8, 16)  # steps a token waits to be settled


class QueueFull(Exception):
    """More requests are waiting than the engine accepts (`max_queue`)."""


@dataclass(frozen=True)
class Event:
    """What a request's stream receives: a token (with its logits' log-probabilities when
    asked), or the end with why ("eos", "stop", "length", "cancelled", "error")."""

    kind: str  # "token" or "end"
    token: int = -1
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs
    finish: str = ""
    error: str = ""


@dataclass
class Request:
    prompt_ids: list[int]
    opts: SamplingOptions
    logprobs: bool = False
    top_logprobs: int = 0  # also the log-probabilities of this many most likely tokens
    events: queue.Queue = field(default_factory=queue.Queue)  # Event, in order
    tokens: list[int] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None  # seconds from submit to the first token
    last_token_at: float = 0.0  # perf_counter when its latest token was made
    finish: str = ""
    _cancelled: threading.Event = field(default_factory=threading.Event)
    listener: Callable[[Event], None] | None = None  # gets the events instead of `events`

    def put(self, event: Event) -> None:
        (self.listener or self.events.put)(event)

    def cancel(self) -> None:
        """The client went away: leave the batch at the next token boundary."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def stream(self, timeout: float | None = None):
        """The request's events as they come, up to and including its end."""
        while True:
            event = self.events.get(timeout=timeout)
            yield event
            if event.kind == "end":
                return


@dataclass
class _Running:
    request: Request
    seq: Sequence
    events: list[tuple[Event, float]] = field(default_factory=list)  # (event, when made) per
    # token made and not yet sent
    finish: str = ""  # why it is done (its last tokens may still wait to be sent)


@dataclass
class EngineStats:
    requests: int = 0
    finished: int = 0
    finished_by: dict[str, int] = field(default_factory=dict)  # why: eos, length, cancelled...
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    batch_rows: int = 0  # sum over steps of the sequences in the step
    busy_s: float = 0.0
    rollbacks: int = 0  # sequences undone and run again because a node was caught lying
    verify_wait_s: float = 0.0  # time steps waited for audits (the lag bound)
    # what a token waited between being made and being sent (audits settling it): steps, s
    held_steps: Histogram = field(default_factory=lambda: Histogram(HELD_BUCKETS))
    held: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    # seconds from submit to the first token; between a request's successive tokens; from
    # submit to the end (every request that ends, whatever why)
    first_token: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    request_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))


class Engine:
    """The scheduler (see the module docstring).  `model` is a family Transformer (any
    experts backend), `verifier` its experts' auditor (nodes) or None; `close` stops the
    thread and ends every request with "cancelled"."""

    def __init__(
        self,
        model,
        max_batch: int = 16,
        max_queue: int = 64,
        prefill_chunk: int = 512,
        verifier: Verifier | None = None,
        max_lag: int = MAX_LAG,
    ):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 0 or max_lag < 1:
            raise ValueError("max_batch, max_lag must be >= 1, max_queue, prefill_chunk >= 0")
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.prefill_chunk = prefill_chunk  # prompt tokens a step feeds at most (0: no limit)
        self.decoder = Decoder(model, verifier)
        self.verifier, self.max_lag = verifier, max_lag
        self.stats = EngineStats()
        # called on the scheduler thread after every step (`EngineProcess` sends the step's
        # events to the server process in one message)
        self.after_step: Callable[[], None] | None = None
        self._waiting: deque[Request] = deque()
        self._running: list[_Running] = []
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="moeshard-engine", daemon=True)
        self._thread.start()

    # -- the clients' side ------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        opts: SamplingOptions,
        logprobs=False,
        listener=None,
        top_logprobs: int = 0,
    ) -> Request:
        """Queue a request; its events go to `request.events`, or to `listener` (called on
        the scheduler thread: an asyncio server passes one that hands them to its loop)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        request = Request(list(prompt_ids), opts, logprobs, top_logprobs, listener=listener)
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._drop_cancelled_waiting()  # (their clients left: they hold no room)
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - len(self._running)):
                self.stats.rejected += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting already")
            self._waiting.append(request)
            self.stats.requests += 1
            self._lock.notify()
        return request

    def queue_depth(self) -> int:
        """Requests waiting for a slot (not those whose clients have left)."""
        with self._lock:
            self._drop_cancelled_waiting()
            return len(self._waiting)

    def _drop_cancelled_waiting(self) -> None:
        """End the waiting requests whose clients have left (called with the lock held)."""
        if any(r.cancelled for r in self._waiting):
            for r in [r for r in self._waiting if r.cancelled]:
                self._end(r, "cancelled")
            self._waiting = deque(r for r in self._waiting if not r.cancelled)

    def running(self) -> int:
        return len(self._running)

    def stats_snapshot(self) -> EngineStats:
        """The counters as they are now, to hand to another thread or process (the
        histograms copy themselves under their own locks when pickled)."""
        return replace(self.stats, finished_by=dict(self.stats.finished_by))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    # -- the scheduler thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._waiting and not self._running:
                    self._lock.wait()
                if self._closed:
                    break
                self._admit()
            try:
                self._step()
            except Exception as exc:  # a failed step ends its requests, not the server
                log.exception("batch step failed")
                for r in self._running:
                    self._end(r.request, "error", str(exc) or type(exc).__name__)
                self._running.clear()
            if self.after_step is not None:
                self.after_step()
        for r in self._running:
            self._end(r.request, "cancelled")
        for request in self._waiting:
            self._end(request, "cancelled")

    def _admit(self) -> None:
        """Waiting requests join while there is room (called with the lock held)."""
        while self._waiting and len(self._running) < self.max_batch:
            request = self._waiting.popleft()
            if request.cancelled:
                self._end(request, "cancelled")
                continue
            seq = self.decoder.start(request.prompt_ids, request.opts)
            self._running.append(_Running(request, seq))
            self.stats.prompt_tokens += len(request.prompt_ids)

    def _step(self) -> None:
        for r in [r for r in self._running if r.request.cancelled]:
            self._end(r.request, "cancelled")  # its cache goes with it
            self._running.remove(r)
        if not self._running:
            return
        t0 = time.perf_counter()
        scheduled = self._schedule()  # (sequence, ids it feeds this step)
        if scheduled:
            self._keep_within_lag()
            made = self.decoder.step([(r.seq, ids) for r, ids in scheduled])
            self.stats.steps += 1
            self.stats.batch_rows += len(scheduled)
            for r in [r for r, _ in scheduled if r.seq in made]:
                self._made(r)
        elif self.verifier is not None:  # only finished sequences waiting for their audits
            self.verifier.wait_settled(self.decoder.step_no - 1, timeout=0.05, stall=False)
        undone, lost = self.decoder.rollback([r.seq for r in self._running], retract=False)
        for r in [r for r in self._running if r.seq in undone]:
            del r.events[len(r.seq.tokens) - r.seq.shown :]
            r.finish = ""  # it runs again from where it was undone
            self.stats.rollbacks += 1
        for r in [r for r in self._running if r.seq in lost]:  # never, within the lag bound
            self._end(r.request, "error", "a node lied further back than can be undone")
            self._running.remove(r)
        self._send_settled()
        self.decoder.forget([r.seq for r in self._running], retract=False)
        if not self._running and hasattr(self.model, "forget_caches"):
            self.model.forget_caches()  # the finished sequences' caches go now
        self.stats.busy_s += time.perf_counter() - t0

    def _keep_within_lag(self) -> None:
        """With audits, wait until the steps more than `max_lag` back are settled."""
        if self.verifier is None:
            return
        t0 = time.perf_counter()
        self.verifier.wait_settled(self.decoder.step_no - self.max_lag)
        self.stats.verify_wait_s += time.perf_counter() - t0

    def _made(self, r: _Running) -> None:
        """A token was made for `r`: its event (sent once settled), and whether it ends."""
        seq, request = r.seq, r.request
        token, logits = seq.tokens[-1], seq.last_logits
        r.events.append((self._token_event(request, token, logits), time.perf_counter()))
        if token in request.opts.eos_ids:
            r.finish = "eos"
        elif len(seq.tokens) >= request.opts.max_tokens:
            r.finish = "length"

    def _send_settled(self) -> None:
        """Send every token whose steps are settled; end the sequences whose last is sent."""
        still = []
        for r in self._running:
            seq = r.seq
            ready = max(self.decoder.settled(seq) - seq.shown, 0)
            for event, made in r.events[:ready]:
                self._emit(r.request, event)
                self.stats.held.observe(time.perf_counter() - made)
                self.stats.held_steps.observe(self.decoder.step_no - 1 - seq.token_steps[seq.shown])
                seq.shown += 1
            del r.events[:ready]
            if r.finish and seq.shown == len(seq.tokens):
                self._end(r.request, r.finish)
            else:
                still.append(r)
        self._running = still

    def _schedule(self) -> list[tuple[_Running, list[int]]]:
        """What each running sequence feeds this step: a decoding one its last token; one
        still reading its prompt the next piece of it, in pieces that end at multiples of
        `prefill_chunk` positions, while the step's prompt budget (`prefill_chunk` tokens)
        lasts, in the order they arrived (the first always gets its piece).  So a long
        prompt does not hold up every other stream for its whole prefill, and where its
        pieces end never depends on what else runs: the same bits alone or together."""
        chunk = self.prefill_chunk
        budget, out = chunk, []
        for r in self._running:
            if r.finish:  # done: its last tokens wait for their audits
                continue
            seq = r.seq
            if seq.tokens or not chunk:  # decoding (or no chunking): all it has
                out.append((r, seq.pending))
                continue
            take = min(len(seq.pending), chunk - seq.cache.length % chunk)
            if take <= budget:
                budget -= take
                out.append((r, seq.pending[:take]))
        return out

    def _token_event(self, request: Request, token: int, logits: np.ndarray) -> Event:
        logprob, top = None, ()
        if request.logprobs or request.top_logprobs:  # of the model's logits, as vLLM gives
            logp = log_softmax(logits)  # [V]
            logprob = float(logp[token])
            if request.top_logprobs:
                n = min(request.top_logprobs, logp.size)
                best = np.argpartition(-logp, n - 1)[:n]  # [n], in no order
                best = best[np.lexsort((best, -logp[best]))]  # most likely first, ties by id
                top = tuple((int(t), float(logp[t])) for t in best)
        return Event("token", token=token, logprob=logprob, top=top)

    def _emit(self, request: Request, event: Event) -> None:
        now = time.perf_counter()
        if request.first_token_s is None:
            request.first_token_s = now - request.submitted
            self.stats.first_token.observe(request.first_token_s)
        else:
            self.stats.inter_token.observe(now - request.last_token_at)
        request.last_token_at = now
        request.tokens.append(event.token)
        self.stats.generated_tokens += 1
        request.put(event)

    def _end(self, request: Request, finish: str, error: str = "") -> None:
        request.finish = finish
        self.stats.request_time.observe(time.perf_counter() - request.submitted)
        self.stats.finished += 1
        self.stats.finished_by[finish] = self.stats.finished_by.get(finish, 0) + 1
        request.put(Event("end", finish=finish, error=error))
