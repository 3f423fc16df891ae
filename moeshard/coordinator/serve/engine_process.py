"""The batching engine in a process of its own, behind the interface the API uses.

In one process the HTTP event loop and the engine thread take turns holding one interpreter
lock: every token the loop streams (Starlette, h11, JSON, a socket write) is time the engine's
Python waits, and each kernel the engine calls hands the lock to the loop and must win it
back.  Measured on the embedded model with 16 streams: a 16-row step took 4.3 ms with the
engine alone and 7.7 ms behind the HTTP server in the same process.  Here the engine runs in
a child process (`multiprocessing`, spawn: no threads or locks inherited) and the server
talks to it over a pipe:

* parent -> child: ("submit", rid, prompt ids, options, logprobs, top logprobs), answered
  with ("submitted", rid, None) or ("submitted", rid, (kind, message)) when it is refused;
  ("cancel", rid); ("stats",), answered with ("stats", snapshot); ("close",).
* child -> parent: ("ready", info) once the model is open, or ("failed", message);
  ("events", [(rid, Event), ...]): every event of one engine step in one message.

`EngineProcess` has the `Engine` methods the API calls (`submit`, `running`, `queue_depth`,
`stats`, `close`) and `experts.stats()`; its requests (`RemoteRequest`) have the `Request`
fields the API reads.  If the child dies, every open request ends with "error".
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from moeshard.coordinator.serve.engine import Engine, Event, QueueFull
from moeshard.moe import sigint
from moeshard.moe.errors import MoeshardError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0  # a submit or stats call the child does not answer in this is an error


class RemoteRequest:
    """A request running in the engine process: what the API reads of a `Request`."""

    def __init__(self, owner: EngineProcess, rid: int, prompt_ids, opts, logprobs, top, listener):
        self._owner, self.rid = owner, rid
        self.prompt_ids, self.opts = list(prompt_ids), opts
        self.logprobs, self.top_logprobs = logprobs, top
        self.listener: Callable[[Event], None] | None = listener
        self.events: queue.Queue = queue.Queue()  # Event, in order (when there is no listener)
        self.tokens: list[int] = []
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None
        self.finish = ""
        self._cancelled = threading.Event()

    def deliver(self, event: Event) -> None:
        """An event from the child, on the parent's reader thread."""
        if event.kind == "token":
            if self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.submitted
            self.tokens.append(event.token)
        else:
            self.finish = event.finish
        (self.listener or self.events.put)(event)

    def cancel(self) -> None:
        """The client went away: the engine drops the request at its next step."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._owner._send(("cancel", self.rid))

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


def _start_holding_ctrl_c(proc) -> None:
    """proc.start() with a Ctrl-C held until it returns, then acted on as it would have been.
    Interrupted between launching the spawned child and handing it its work, the parent left
    the child reading an empty pipe: its EOFError traceback on the shared stderr (`serve`
    stopped 0.6 s after start, once in a CI run). Once started, the child is a daemon: it
    stops with its parent."""
    if threading.current_thread() is not threading.main_thread():
        proc.start()  # (only the main thread receives signals)
        return
    with sigint.held(act_after=True):
        proc.start()


class EngineProcess:
    """An `Engine` over the runtime `opener(opener_args)` opens, in a child process.

    Construction waits until the child has opened the model (and warmed its kernels), and
    raises `MoeshardError` with the child's message if that fails."""

    def __init__(self, opener: Callable, opener_args: Any, engine_kwargs: dict):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main,
            args=(child, opener, opener_args, engine_kwargs),
            name="moeshard-engine",
            daemon=True,
        )
        _start_holding_ctrl_c(self._proc)
        child.close()
        try:
            kind, info = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise MoeshardError(
                f"the engine process stopped while opening the model (exit {self._proc.exitcode})"
            ) from None
        if kind != "ready":
            self._proc.join(5)
            raise MoeshardError(str(info))
        self.info = info  # vocab_size, eos_ids, warmup_s, startup_s
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=info["vocab_size"]))
        self.experts = SimpleNamespace(stats=lambda: self._stats()["experts"])
        self._requests: dict[int, RemoteRequest] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()  # one message on the pipe at a time
        self._call_lock = threading.Lock()  # one call waiting for its answer at a time
        self._answers: queue.Queue = queue.Queue()
        self._dead = False
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    # -- what the API calls -------------------------------------------------------------------

    def submit(self, prompt_ids, opts, logprobs=False, listener=None, top_logprobs: int = 0):
        """`Engine.submit`, in the child: QueueFull or ValueError as it raises them."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        rid = next(self._ids)
        request = RemoteRequest(self, rid, prompt_ids, opts, logprobs, top_logprobs, listener)
        self._requests[rid] = request  # before the child can send its first event
        msg = ("submit", rid, request.prompt_ids, opts, logprobs, top_logprobs)
        _, _, refused = self._call(msg, "submitted")
        if refused is not None:
            self._requests.pop(rid, None)
            kind, message = refused
            raise {"QueueFull": QueueFull, "ValueError": ValueError}.get(kind, RuntimeError)(
                message
            )
        return request

    @property
    def stats(self):
        """The engine's `EngineStats`, as the child has them now."""
        return self._stats()["stats"]

    def running(self) -> int:
        return self._stats()["running"]

    def queue_depth(self) -> int:
        return self._stats()["waiting"]

    def close(self) -> None:
        """Stop the child (its engine ends every request with "cancelled")."""
        if self._proc.is_alive():
            try:
                self._send(("close",))
            except OSError:
                pass
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._reader.join(5)

    # -- the pipe -----------------------------------------------------------------------------

    def _stats(self) -> dict:
        return self._call(("stats",), "stats")[1]

    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _call(self, msg, answer: str):
        with self._call_lock:
            if self._dead:
                raise RuntimeError("the engine process has stopped")
            self._send(msg)
            try:
                reply = self._answers.get(timeout=CALL_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"the engine process did not answer {msg[0]!r}") from None
        if reply[0] != answer:
            raise RuntimeError(f"the engine process stopped ({reply[0]})")
        return reply

    def _read(self) -> None:
        """The reader thread: events to their requests, answers to the waiting call."""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "events":
                for rid, event in msg[1]:
                    request = self._requests.get(rid)
                    if request is None:
                        continue
                    if event.kind == "end":
                        del self._requests[rid]
                    request.deliver(event)
            else:
                self._answers.put(msg)
        self._dead = True
        self._answers.put(("stopped",))
        stopped = Event("end", finish="error", error="the engine process stopped")
        for rid in list(self._requests):
            self._requests.pop(rid).deliver(stopped)


def _child_main(conn, opener, opener_args, engine_kwargs) -> None:
    """The engine process: open the runtime, then serve the parent's messages.  Ctrl-C
    reaches the whole process group: the parent stops it (or it sees the pipe close)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rt = opener(opener_args)
        engine = Engine(rt.transformer, verifier=rt.verifier, **engine_kwargs)
    except BaseException as exc:  # the parent reports it and exits
        conn.send(("failed", str(exc) or type(exc).__name__))
        return
    send_lock = threading.Lock()
    outbox: list[tuple[int, Event]] = []
    requests: dict[int, Any] = {}

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    def flush() -> None:
        """Every event emitted since the last flush, in one message (the engine calls this
        after each step, so a step of 16 streams is one message, not 16)."""
        with send_lock:
            if outbox:
                batch = outbox[:]
                outbox.clear()
                conn.send(("events", batch))

    def listener_for(rid: int) -> Callable[[Event], None]:
        def put(event: Event) -> None:
            with send_lock:
                outbox.append((rid, event))
            if event.kind == "end":
                requests.pop(rid, None)

        return put

    engine.after_step = flush
    info = {"vocab_size": rt.config.vocab_size, "eos_ids": list(rt.eos_ids)}
    info |= {"warmup_s": rt.warmup_s, "startup_s": rt.startup_s}
    send(("ready", info))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the parent has gone
            kind = msg[0]
            if kind == "submit":
                _, rid, ids, opts, logprobs, top = msg
                try:
                    requests[rid] = engine.submit(ids, opts, logprobs, listener_for(rid), top)
                    send(("submitted", rid, None))
                except (QueueFull, ValueError, RuntimeError) as exc:
                    send(("submitted", rid, (type(exc).__name__, str(exc))))
            elif kind == "cancel":
                request = requests.get(msg[1])
                if request is not None:
                    request.cancel()
                    engine.queue_depth()  # a waiting request leaves the queue now
            elif kind == "stats":
                waiting = engine.queue_depth()
                snapshot = {"stats": engine.stats_snapshot(), "running": engine.running()}
                snapshot |= {"waiting": waiting, "experts": rt.experts.stats()}
                send(("stats", snapshot))
            elif kind == "close":
                break
            flush()  # events a command caused (a cancelled waiting request's end)
    finally:
        engine.close()
        flush()
        rt.close()
        conn.close()
