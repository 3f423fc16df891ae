"""What a node's clients may make it do, and the machinery that holds them to it.

A node keeps serving well-behaved clients whatever a few others do:

- size: grpc itself refuses a message over `max_request_bytes` before decoding it; a Forward
  has at most `max_rows` rows;
- work: `max_active` Forward requests are decoded and computed at once, `max_queue` more wait
  their turn (in arrival order, at most `queue_wait_s`); beyond that a request is refused at once
  with RESOURCE_EXHAUSTED "node busy";
- calls: at most `max_calls` unary calls and `max_streams` ForwardStreams are open at once, and a
  client (its key's id; its address under --insecure) has at most `per_client` of them together;
- rate: a client's calls (every stream message counts) and rows go through token buckets;
- idle: a call whose next message does not come within `idle_timeout_s` ends with
  DEADLINE_EXCEEDED. grpc's request iterator has no timeout, so messages are read in helper
  threads and waited for with one; on the timeout the call is aborted, grpc cancels it and the
  helper's read returns;
- threads: the server gets `workers()` threads, `spare_workers` more than all the calls and
  streams the caps admit, so health checks are always answered.

`Limits.resolve` derives the sizes from the node's RAM budget; `Guard` enforces the rest.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, replace

import grpc

from moe.errors import MoeshardError
from moe.units import fmt_bytes
from moe.wire.constants import MAX_MESSAGE_BYTES, MAX_ROWS

MiB = 1 << 20
MIN_REQUEST_BYTES = 8 * MiB  # derived request limit: floor (1024 f32 rows of a 2048-wide model)
MAX_REQUEST_BYTES = 64 * MiB  # ... and ceiling (a quarter of grpc's 256 MiB message limit)
WORK_COPIES = 8  # a request in compute holds about this many copies of its message's size:
# decoded activations, float64 partial sums, the backend's gathers and outputs, the reply
BURST_S = 1.0  # a client's token buckets hold this many seconds of its rate
# A prompt's prefill sends each node up to a few full-size requests per MoE layer within a
# second; the row rate must not refuse that (the compute gate, not the rate, bounds the work)
ROWS_RATE_FACTOR = 16
MAX_CLIENTS = 4096  # client records kept before the idle ones are dropped


class Refused(Exception):
    """A call the limits refuse: the gRPC status code and a message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    # one request (0: derived by `resolve` from the node's RAM budget)
    max_request_bytes: int = 0  # bytes of one request message; grpc refuses more, unread
    max_rows: int = 0  # rows of one Forward (0: the f32 rows max_request_bytes holds)
    # Forward work
    max_active: int = 2  # requests decoded and computed at once (compute is one at a time)
    max_queue: int = 8  # requests waiting for that; more are refused at once: "node busy"
    queue_wait_s: float = 5.0  # longest wait in the queue (never past the call's deadline)
    # calls, streams and clients
    max_calls: int = 16  # unary calls (Info, Forward, Prefetch) open at once, each on a thread
    max_streams: int = 32  # ForwardStreams open at once, each on a thread while open
    max_watches: int = 4  # health Watch streams open at once, each on a thread
    per_client: int = 4  # calls + streams one client may have open at once
    rate: float = 5000.0  # calls per second per client (each stream message counts)
    rate_rows: float = 0.0  # rows per second per client (0: ROWS_RATE_FACTOR full requests
    # to every MoE layer each second)
    idle_timeout_s: float = 60.0  # a call that sends nothing for this long ends
    spare_workers: int = 4  # server threads beyond what calls and streams can hold

    def resolve(self, budget: int, row_bytes: int, moe_layers: int) -> Limits:
        """These limits with the derived fields filled in.

        `budget` is the node's RAM budget (--ram, or the bytes of the records it holds), of
        which a quarter may go to requests: the most they hold at once is `messages_held()`
        request sizes, so max_request_bytes = budget / 4 / messages_held(), clamped to
        8..64 MiB. `row_bytes`: one f32 row on the wire (hidden, ids and weights)."""
        self.check()
        size = self.max_request_bytes or min(
            MAX_REQUEST_BYTES, max(MIN_REQUEST_BYTES, budget // 4 // self.messages_held())
        )
        rows = self.max_rows or max(1, min(MAX_ROWS, size // row_bytes))
        rate_rows = self.rate_rows or float(ROWS_RATE_FACTOR * rows * max(1, moe_layers))
        return replace(self, max_request_bytes=size, max_rows=rows, rate_rows=rate_rows)

    def check(self) -> None:
        """MoeshardError naming the first value out of range (by its flag, if it has one)."""
        ranges = [  # (name, value, lowest, highest)
            ("--max-request-mb", self.max_request_bytes / MiB, 0, MAX_MESSAGE_BYTES / MiB),
            ("--max-rows", self.max_rows, 0, MAX_ROWS),
            ("max_active", self.max_active, 1, None),
            ("--max-inflight", self.max_queue, 0, None),
            ("queue_wait_s", self.queue_wait_s, 0, None),
            ("max_calls", self.max_calls, 1, None),
            ("--max-streams", self.max_streams, 1, None),
            ("max_watches", self.max_watches, 1, None),
            ("--per-client", self.per_client, 1, None),
            ("--rate", self.rate, 1e-3, None),
            ("--rate-rows", self.rate_rows, 0, None),
            ("--idle-timeout", self.idle_timeout_s, 1e-3, None),
            ("spare_workers", self.spare_workers, 0, None),
        ]
        for name, value, low, high in ranges:
            if value < low or (high is not None and value > high):
                within = f"{low:g}..{high:g}" if high is not None else f"at least {low:g}"
                raise MoeshardError(f"{name} {value:g}: must be {within}")

    def messages_held(self) -> int:
        """Request sizes in memory at worst: a message per unary call and stream being read or
        waiting, and the working copies of the requests in compute."""
        return self.max_calls + self.max_streams + WORK_COPIES * self.max_active

    def request_memory(self) -> int:
        """Bytes requests may hold at once, at worst."""
        return self.messages_held() * self.max_request_bytes

    def workers(self) -> int:
        """Server threads: every call and stream the caps admit, and spares for health."""
        return self.max_calls + self.max_streams + self.max_watches + self.spare_workers

    def summary(self) -> str:
        return (
            f"requests up to {fmt_bytes(self.max_request_bytes)} and {self.max_rows} rows; "
            f"{self.max_active} computing + {self.max_queue} queued; {self.max_calls} calls + "
            f"{self.max_streams} streams, {self.per_client} per client; per client "
            f"{self.rate:g} calls/s and {self.rate_rows:g} rows/s; idle timeout "
            f"{self.idle_timeout_s:g} s; {self.workers()} threads; requests hold at most "
            f"{self.request_memory() / MiB:.0f} MiB"
        )


class Gate:
    """At most `active` holders at once; up to `queue` more wait in arrival order."""

    def __init__(self, active: int, queue: int):
        self.lock = threading.Lock()
        self.free, self.queue = active, queue
        self.waiting: deque[threading.Event] = deque()

    @contextmanager
    def hold(self, wait_s: float):
        """Hold a slot for the block; Refused at once when the queue is full, or after
        `wait_s` without a slot."""
        self._enter(wait_s)
        try:
            yield
        finally:
            self._leave()

    def _enter(self, wait_s: float) -> None:
        with self.lock:
            if self.free and not self.waiting:
                self.free -= 1
                return
            if len(self.waiting) >= self.queue:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"node busy: {len(self.waiting)} requests already wait for compute",
                )
            turn = threading.Event()
            self.waiting.append(turn)
        if turn.wait(wait_s):
            return
        with self.lock:
            if turn.is_set():  # handed a slot just as the wait ended
                return
            self.waiting.remove(turn)
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"node busy: no compute slot within {wait_s:.3g} s"
        )

    def _leave(self) -> None:
        with self.lock:
            if self.waiting:
                self.waiting.popleft().set()  # the slot passes straight to the next in line
            else:
                self.free += 1


class TokenBucket:
    """`rate` tokens per second, holding at most `capacity`; starts full."""

    def __init__(self, rate: float, capacity: float):
        self.rate, self.capacity = rate, capacity
        self.tokens, self.stamp = capacity, time.monotonic()

    def refill(self, now: float) -> float:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens

    def take(self, n: float, now: float) -> bool:
        if self.refill(now) < n:
            return False
        self.tokens -= n
        return True


class Client:
    """One client's open calls and streams and its buckets."""

    def __init__(self, limits: Limits):
        self.open = 0
        self.calls = TokenBucket(limits.rate, limits.rate * BURST_S)
        rows_capacity = max(limits.rate_rows * BURST_S, float(limits.max_rows))
        self.rows = TokenBucket(limits.rate_rows, rows_capacity)

    def idle(self, now: float) -> bool:
        """No call open and both buckets full: forgetting it changes nothing."""
        return (
            self.open == 0
            and self.calls.refill(now) >= self.calls.capacity
            and self.rows.refill(now) >= self.rows.capacity
        )


class Guard:
    """The limits of one node, shared by all its calls. Thread-safe."""

    def __init__(self, limits: Limits):
        if not limits.max_request_bytes or not limits.max_rows or not limits.rate_rows:
            raise ValueError("Guard needs resolved limits (Limits.resolve)")
        self.limits = limits
        self.lock = threading.Lock()
        self.clients: dict[str, Client] = {}
        self.sweep_at = MAX_CLIENTS  # drop idle client records when there are this many
        self.open = {"call": 0, "stream": 0}  # unary calls and ForwardStreams open now
        self.work = Gate(limits.max_active, limits.max_queue)
        # every admitted call and stream has at most one read outstanding: reads never queue
        self.readers = ThreadPoolExecutor(
            limits.max_calls + limits.max_streams, thread_name_prefix="read"
        )

    # -- admission ------------------------------------------------------------------------

    @contextmanager
    def admit(self, client: str, kind: str):
        """Count a unary call (`kind` "call") or a ForwardStream ("stream") of `client` as
        open for the block; Refused (RESOURCE_EXHAUSTED) over the node's or the client's cap."""
        cap = self.limits.max_calls if kind == "call" else self.limits.max_streams
        with self.lock:
            record = self._client(client)
            if record.open >= self.limits.per_client:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {_show(client)} has {record.open} calls and streams open, the most "
                    f"this node allows (--per-client)",
                )
            if self.open[kind] >= cap:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"node busy: {cap} {kind}s open already"
                )
            record.open += 1
            self.open[kind] += 1
        try:
            yield
        finally:
            with self.lock:
                record.open -= 1
                self.open[kind] -= 1

    def charge(self, client: str, rows: int = 0) -> None:
        """One call (or stream message) of `rows` rows; Refused when the client is over its
        rate. A refused call takes no tokens."""
        now = time.monotonic()
        with self.lock:
            record = self._client(client)
            if record.calls.refill(now) < 1:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {_show(client)} is over its rate of {self.limits.rate:g} calls/s "
                    f"(--rate)",
                )
            if not record.rows.take(rows, now):
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {_show(client)} is over its rate of {self.limits.rate_rows:g} "
                    f"rows/s (--rate-rows)",
                )
            record.calls.take(1, now)

    def _client(self, client: str) -> Client:
        """The record of `client` (under self.lock), dropping idle ones when there are many."""
        record = self.clients.get(client)
        if record is None:
            if len(self.clients) >= self.sweep_at:
                now = time.monotonic()
                for key in [k for k, c in self.clients.items() if c.idle(now)]:
                    del self.clients[key]
                self.sweep_at = max(MAX_CLIENTS, 2 * len(self.clients))  # amortised O(1)
            record = self.clients[client] = Client(self.limits)
        return record

    # -- work and reads -------------------------------------------------------------------

    def computing(self, deadline_s: float | None = None):
        """A slot of Forward work for the block (context manager); Refused "node busy" when
        none frees up within queue_wait_s (or the call's remaining time)."""
        wait = self.limits.queue_wait_s
        return self.work.hold(wait if deadline_s is None else max(0.0, min(wait, deadline_s)))

    def read(self, requests: Iterator):
        """The next message of a call, or None at its end (or when the client cancelled);
        Refused (DEADLINE_EXCEEDED) when none comes within idle_timeout_s: the caller aborts
        the call, which ends the helper's read."""
        pending = self.readers.submit(next, requests, None)
        try:
            return pending.result(self.limits.idle_timeout_s)
        except FutureTimeout:
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no message for {self.limits.idle_timeout_s:g} s: idle call ended "
                f"(--idle-timeout)",
            ) from None
        except grpc.RpcError:  # cancelled by the client
            return None

    def close(self) -> None:
        self.readers.shutdown(wait=False, cancel_futures=True)


def _show(client: str) -> str:
    return client or "(anonymous)"
