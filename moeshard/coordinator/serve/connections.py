"""What the HTTP server does about connections, before any request reaches the app.

uvicorn's h11 protocol (as of 0.55) has a keep-alive timeout but no timeout for reading a
request: a connection that sends half a header, or nothing, is held forever (slowloris), and
`limit_concurrency` only answers 503 once a whole request has arrived.  Measured on the
original server: 19,800 half-open connections were never closed, and at ~20,300 the process
ran out of file descriptors.  So the server runs a subclass of uvicorn's `H11Protocol`
(`guarded_protocol`) with

  * a deadline for a request's headers (`header_timeout`, from the connection or the end of
    the previous response) and for its body (`body_timeout`, from the end of the headers):
    a connection that misses one is closed;
  * a cap on open connections (`max_connections`): a new connection over the cap closes the
    oldest one still reading a request (half-open, idle keep-alive, or a body still coming:
    cheap for an honest owner to send again; one that has never had an answer first), or,
    when every connection has its request in and is being answered, is itself closed at once.
    An honest client sends its request at once and is never the oldest still reading; an
    attacker holding connections open keeps losing them.  Beyond the cap, an attacker that
    reconnects at once keeps the listen queue full, and new connections (honest ones too)
    wait for it (a dropped SYN is sent again after 1 s); connections kept open from an earlier
    answer are closed last.  So the cap is as high as the descriptor limit allows (65,536 at
    most, ~300 MiB), and what an attacker holds beyond that is for a per-address limit where
    connections are admitted (a firewall's `connlimit`) to stop.

Every connection held is ~22 Python objects that CPython's cyclic collector scans in its full
passes, which stop the event loop (~500 ms at 20,000 connections on a 2-core Zen 4 with the
attacker beside it); what the process made before serving is frozen out of those passes.

`AcceptErrors` bounds what running out of descriptors writes to the log: asyncio logs every
failed accept() with its traceback, up to the listen backlog (2048) per loop pass (the
original server's log grew 260 MB in 50 s); here one line per `every` seconds, with a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import threading
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors kept for everything but client connections (engine, model, nodes)
# asyncio accepts up to `backlog` connections in one pass of its loop, and listens with the
# same number: uvicorn's 2,048 made passes of ~100 ms under a flood of reconnections (every
# request waited several of them) and held 6,000 connections beyond a cap of 8,192 before
# closing the oldest.  So a pass accepts ACCEPTS_PER_PASS, and the kernel queues LISTEN_QUEUE.
ACCEPTS_PER_PASS = 16
LISTEN_QUEUE = 1024
# Connections held at most unless told otherwise (as many as the descriptor limit allows below
# it): 65,536 half-open connections cost ~300 MiB.  The more the server holds, the more an
# attacker needs before the cap's churn starts (see `ConnectionGuard.admit`).
DEFAULT_MAX_CONNECTIONS = 65536


@dataclass
class ConnectionGuard:
    """The limits and what they did (counters shown on /metrics)."""

    max_connections: int = (
        DEFAULT_MAX_CONNECTIONS  # open client connections at most (~4.6 KiB each, measured)
    )
    header_timeout: float = 10.0  # seconds to send a request's headers
    body_timeout: float = 30.0  # seconds to send a request's body, once its headers are in
    open: dict = field(default_factory=dict)  # protocol -> None, oldest first: none answered yet
    served: dict = field(default_factory=dict)  # ... those that have had an answer (keep-alive)
    timed_out: int = 0  # connections closed for missing a deadline
    evicted: int = 0  # connections still reading a request closed to admit a newer one
    refused: int = 0  # new connections closed at once: every open one was busy

    def count(self) -> int:
        return len(self.open) + len(self.served)

    def admit(self, proto: GuardedH11) -> bool:
        """Register a new connection; False if it must be closed (the cap, nobody to evict).

        The one closed for it is the oldest still reading a request among those never
        answered, else among the rest: a client that has had an answer on its connection
        and keeps it open (the OpenAI client does) keeps it through a flood of new ones."""
        if self.count() >= self.max_connections:
            oldest = next((p for p in self.open if p.reading()), None)
            if oldest is None:
                oldest = next((p for p in self.served if p.reading()), None)
            if oldest is None:
                self.refused += 1
                return False
            self.evicted += 1
            self.drop(oldest)
            oldest.transport.close()
        self.open[proto] = None
        return True

    def answered(self, proto: GuardedH11) -> None:
        """`proto` has had a response: it moves to the ones closed last at the cap."""
        if self.open.pop(proto, 0) is None:
            self.served[proto] = None

    def drop(self, proto: GuardedH11) -> None:
        self.open.pop(proto, None)
        self.served.pop(proto, None)


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol under `guard` (pass the class as `uvicorn.run(http=...)`)."""
    return type("GuardedH11", (GuardedH11,), {"guard": guard})


class GuardedH11(H11Protocol):
    """`H11Protocol` with a read deadline per request and a cap on open connections."""

    guard: ConnectionGuard  # set by `guarded_protocol`

    deadline: asyncio.TimerHandle | None = None
    phase: str | None = None  # what the deadline is for: "headers", "body" or None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.abort()  # (connection_lost follows and tidies up)
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.guard.answered(self)
        self._stop()  # idle until the next request: uvicorn's keep-alive timeout applies
        if self.conn.their_state is not h11.IDLE:  # a pipelined request is under way
            self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        self.guard.drop(self)
        super().connection_lost(exc)

    def waiting(self) -> bool:
        """Waiting for a request's headers (connected, or idle between requests)?"""
        return self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )

    def reading(self) -> bool:
        """Still reading a request (its headers or its body)?  An honest client's request
        is read within milliseconds of connecting; one that is not after many newer
        connections came is the one to close when there are too many."""
        return self.waiting() or self.conn.their_state is h11.SEND_BODY

    def _watch(self) -> None:
        """Set the deadline for what the connection is reading now (none between a request's
        end and the start of the next: the app's time and keep-alive are not ours to cut)."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.waiting() and self.timeout_keep_alive_task is None:
            phase, limit = "headers", self.guard.header_timeout
        elif state is h11.SEND_BODY:
            phase, limit = "body", self.guard.body_timeout
        else:
            phase, limit = None, 0.0
        if phase == self.phase:
            return
        self._stop()
        if phase is not None:
            self.phase = phase
            self.deadline = self.loop.call_later(limit, self._expired)

    def _stop(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.phase = None, None

    def _expired(self) -> None:
        """The request was not read in time: close (a request whose body was late sees the
        client as gone)."""
        self.deadline = None
        if not self.transport.is_closing():
            self.guard.timed_out += 1
            self.guard.drop(self)
            self.transport.close()


class AcceptErrors:
    """An asyncio exception handler that logs failed accept() calls (out of descriptors or
    memory) at most once per `every` seconds, with how many there were; anything else goes to
    the loop's default handler."""

    def __init__(self, every: float = 10.0, clock=time.monotonic):
        self.every, self.clock = every, clock
        self.count = 0  # failed accepts not yet logged
        self.total = 0  # failed accepts since start
        self.last = float("-inf")  # when the last line was logged

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        self.count += 1
        self.total += 1
        now = self.clock()
        if now - self.last >= self.every:
            log.error(
                "accept() failed %d times in the last %.0f s (%s); new connections wait",
                self.count, min(now - self.last, 1e9), context.get("exception"),
            )  # fmt: skip
            self.count, self.last = 0, now


def descriptors_for(max_connections: int) -> int:
    """Raise this process's descriptor limit to fit `max_connections` client connections, the
    accepts in flight beyond them (4 x `ACCEPTS_PER_PASS`) and `FD_RESERVE` others: the soft
    limit up to the hard one, and the hard one too where the process may (root, as nginx's
    `worker_rlimit_nofile` does); the number of connections that fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reserve = FD_RESERVE + 4 * ACCEPTS_PER_PASS
    want = max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            try:  # (allowed with CAP_SYS_RESOURCE, up to fs.nr_open)
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
                soft = hard = want
            except (ValueError, OSError):
                pass
        target = want if hard == resource.RLIM_INFINITY else min(hard, want)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - reserve))


def listening_socket(host: str, port: int):
    """A socket listening on host:port (port 0: a free one), or a MoeshardError saying why
    not: made before the model is loaded, so that a busy port is one line and exit 2, not a
    "serving ..." line and a failure after the model's start-up (connections that come
    meanwhile wait in the listen queue)."""
    import socket

    from moeshard.moe.errors import MoeshardError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise MoeshardError(f"--host {host}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn does)
        sock.bind(address)
        sock.listen(LISTEN_QUEUE)  # (two bound sockets not listening may share a port)
    except OSError as exc:
        sock.close()
        hint = " (another server is on it: choose a --port)" if exc.errno == 98 else ""
        raise MoeshardError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    return sock


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C between the "serving ..." line and uvicorn taking the signal over sets the
    yielded event instead of raising KeyboardInterrupt wherever the main thread is: raised
    there, it once landed in an event loop's finaliser mid-start ("Exception ignored ...
    Traceback" and "did not start"). `serve_http` stops at once if it is set. The previous
    handler is back on exit (main thread only, as every signal handler)."""
    from moeshard.moe import sigint

    with sigint.held() as interrupted:
        yield interrupted


def serve_http(app, sock, guard: ConnectionGuard, interrupted: threading.Event) -> None:
    """Run `app` on the bound socket `sock` under uvicorn, as `uvicorn.run` does, with the
    guarded protocol and the accept batch and listen queue above (the queue set after
    asyncio's `listen`). Within `interrupts_deferred`: a Ctrl-C before uvicorn took the signal
    over stops the server as soon as it has started (exit 0), or, if it never started,
    raises KeyboardInterrupt here."""
    import gc
    import signal
    import socket

    import uvicorn

    from moeshard.moe import sigint
    from moeshard.moe.errors import MoeshardError

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGINT and sigint.IGNORED:  # a background job: it stays ignored
                return
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            # What was made before serving (modules, model, tokenizer: ~100,000 objects) lives
            # as long as the process: out of the cyclic collector's sight, so that its full
            # passes, which stop the event loop, scan only what connections and requests made.
            gc.collect()
            gc.freeze()
            for server in self.servers:
                for sock in server.sockets:
                    with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
                        dup.listen(LISTEN_QUEUE)
            if interrupted.is_set():  # a Ctrl-C before uvicorn took the signal over
                self.should_exit = True

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", http=guarded_protocol(guard),
        backlog=ACCEPTS_PER_PASS,
    )  # fmt: skip
    server = Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    if not server.started:
        if interrupted.is_set():
            raise KeyboardInterrupt
        raise MoeshardError(f"the HTTP server did not start on {host}:{port} (see above)")
