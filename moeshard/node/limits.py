"""What a node's clients may make it do, and the machinery that holds them to it.

A node keeps serving well-behaved clients whatever a few others do:

- size: grpc itself refuses a message over `max_request_bytes` before decoding it; a Forward
  has at most `max_rows` rows;
- work: `max_active` Forward requests are decoded and computed at once (of which one fewer may
  be over CHUNK_ROWS rows, so a small request always finds a place), `max_queue` more wait
  their turn (at most `queue_wait_s`), let in by fair tags per client (`moeshard.node.fairness`);
  when the queue is full the largest client's newest waiter gives way to a smaller client, else the
  newcomer is refused with RESOURCE_EXHAUSTED "node busy". A client's next Forward is read
  only once none of its own waits in that queue (`Guard.before_reading`), so a client sending
  faster than the node computes for it is held by HTTP/2 flow control, not received and then
  refused. Compute itself goes in turns of at most CHUNK_ROWS rows, also by fair tags, so one
  client's large request delays another's small one by a chunk, not by the whole request;
- calls: at most `max_calls` unary calls and `max_streams` ForwardStreams are open at once, and a
  client (its key's id; its address under --insecure) has at most `per_client` of them together.
  When a pool is full, a call or stream that has waited for its next message for EVICT_IDLE_S
  or more is ended (RESOURCE_EXHAUSTED "evicted") to make room, the longest idle of the client
  holding the most (by address, then key: `moeshard.node.fairness`), if that client holds more than
  the newcomer would; a stranger cannot keep others out with streams that send nothing;
- records: at most `max_records` Record streams are open at once, `per_client_records` of them
  per client (counted apart from its calls and streams), and a client's record bytes go
  through a token bucket of `record_rate` bytes per second: a coordinator's audits get their
  records, a stranger cannot use the node as a download mirror at disk speed. As many again
  are kept for the clients this node computed for in the last RESERVED_S (the coordinators
  whose audits need its records), so strangers who fill the open pool with streams that send
  nothing cannot keep an honest node from handing over a record it just computed with;
- rate: a client's calls (every stream message counts) and rows go through token buckets;
- idle: a call whose next message does not come within `idle_timeout_s` ends with
  DEADLINE_EXCEEDED. grpc's request iterator has no timeout, so messages are read in helper
  threads and waited for with one; on the timeout the call is aborted, grpc cancels it and the
  helper's read returns. The other way round, a Record chunk the client does not take within
  `idle_timeout_s` gets its stream cancelled by a `Watchdog`: grpc's send of a streamed reply
  waits for HTTP/2 flow control (the client's window) with no timeout, so a client that stops
  reading would otherwise hold the server thread and the record in memory for good;
- threads: the server gets `workers()` threads, `spare_workers` more than all the calls and
  streams the caps admit, so health checks are always answered.

`Limits.resolve` derives the sizes from the node's RAM budget; `Guard` enforces the rest.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import grpc

from moeshard.moe.errors import MoeshardError
from moeshard.moe.units import fmt_bytes
from moeshard.moe.wire.constants import CREDIT_CAP, MAX_MESSAGE_BYTES, MAX_ROWS
from moeshard.node.fairness import Busy, FairGate, Flow, flow_of, largest_flow

MiB = 1 << 20
MIN_REQUEST_BYTES = 8 * MiB  # derived request limit: floor (1024 f32 rows of a 2048-wide model)
MAX_REQUEST_BYTES = 64 * MiB  # ... and ceiling (a quarter of grpc's 256 MiB message limit)
REPLY_SIZES = 2  # a reply not yet taken holds up to this many request sizes (f64 out of f32 in)
WORK_COPIES = 8  # a request in compute holds about this many copies of its message's size:
# decoded activations, float64 partial sums, the backend's gathers and outputs, the reply
BURST_S = 1.0  # a client's token buckets hold this many seconds of its rate
# A prompt's prefill sends each node up to a few full-size requests per MoE layer within a
# second; the row rate must not refuse that (the compute gate, not the rate, bounds the work)
ROWS_RATE_FACTOR = 16
MAX_CLIENTS = 4096  # client records kept before the idle ones are dropped
RESERVED_S = 120.0  # a client this node computed for this lately may use the reserved records
# Record bytes per second per client. A coordinator that recomputes sampled Forward calls
# fetches a few records per second: Kimi K3's MXFP4 records are 17.5 MB, so 64 MiB/s lets
# ~3.8 of them a second through (and the 1 s burst, BURST_S, three at once). Reading a whole
# 1.5 TB model that way takes one client ~6.5 hours: 1/30 to 1/100 of an NVMe's 2-7 GB/s, so a
# stranger cannot turn the node's disk and network into a mirror that starves its Forwards.
RECORD_RATE = 64 * MiB
CHUNK_ROWS = 32  # rows of one compute turn (see the module docstring)
EVICT_IDLE_S = 0.5  # a call waiting this long for its next message may be ended for a newcomer
# A call refused for asking too much keeps its place this long before it hears so: a client's
# refusals then come at most (its open calls) / TARPIT_S a second, and all clients' at most
# (the pools' sizes) / TARPIT_S, however many keys they have; refusing at full speed cost a
# node 62% of a core for 2,200 refused Settles a second. The place can be taken meanwhile
# by a newcomer, as an idle one can.
TARPIT_S = 0.25


class Refused(Exception):
    """A call the limits refuse: the gRPC status code and a message for the client. `slow`:
    for asking too much (a rate, a full queue): answered only after TARPIT_S (`Guard.admit`)."""

    def __init__(self, code: grpc.StatusCode, message: str, slow: bool = False):
        super().__init__(message)
        self.code, self.slow = code, slow


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
    max_calls: int = 16  # unary Forward calls open at once, each on a thread
    max_controls: int = 8  # other unary calls (Info, Prefetch, Settle, Challenge) open at once:
    # apart, so Forwards queued for compute never keep a coordinator from being admitted
    max_streams: int = 32  # ForwardStreams open at once, each on a thread while open
    max_watches: int = 4  # health Watch streams open at once, each on a thread
    per_client: int = 4  # calls + streams one client may have open at once
    # records (rpc Record: a coordinator fetching a record to recompute a Forward itself)
    max_records: int = 4  # Record streams open at once, each on a thread holding its record
    per_client_records: int = 2  # Record streams one client may have open at once (apart from
    # per_client: a coordinator's audits do not take the slots of its Forward work)
    record_rate: float = RECORD_RATE  # record bytes per second per client (see RECORD_RATE);
    # a record larger than the bucket (one second of it) is served when the bucket is full and
    # paid for by waiting after it
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
            ("max_controls", self.max_controls, 1, None),
            ("--max-streams", self.max_streams, 1, None),
            ("max_watches", self.max_watches, 1, None),
            ("--per-client", self.per_client, 1, None),
            ("--max-records", self.max_records, 1, None),
            ("--per-client-records", self.per_client_records, 1, None),
            ("--record-rate-mb", self.record_rate / MiB, 1e-3, None),
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
        """Request sizes in memory at worst: per unary call and stream (Forward or Record) a
        message being read or waiting and its reply not yet taken by the client, with grpc's
        serialized copy of it (a float64 partial sum is twice its float32 request:
        REPLY_SIZES), and the working copies of the requests in compute. (A Record stream
        also holds its record: 2 x `max_records` records at worst.)"""
        records = 2 * self.max_records  # the open pool and the reserved one
        per_call = 1 + 2 * REPLY_SIZES  # its request; its reply and grpc's serialized copy
        calls = self.max_calls + self.max_controls + self.max_streams
        return calls * per_call + records + WORK_COPIES * self.max_active

    def request_memory(self) -> int:
        """Bytes requests may hold at once, at worst."""
        return self.messages_held() * self.max_request_bytes

    def workers(self) -> int:
        """Server threads: every call and stream the caps admit, and spares for health."""
        return (
            self.max_calls
            + self.max_controls
            + self.max_streams
            + 2 * self.max_records  # the open pool and the reserved one
            + self.max_watches
            + self.spare_workers
        )

    def summary(self) -> str:
        return (
            f"requests up to {fmt_bytes(self.max_request_bytes)} and {self.max_rows} rows; "
            f"{self.max_active} computing + {self.max_queue} queued; {self.max_calls} Forward "
            f"calls + {self.max_controls} other calls + "
            f"{self.max_streams} streams, {self.per_client} per client; {self.max_records} "
            f"record streams, {self.per_client_records} per client; per client {self.rate:g} "
            f"calls/s, {self.rate_rows:g} rows/s and {fmt_bytes(self.record_rate)}/s of records; "
            f"idle timeout {self.idle_timeout_s:g} s; {self.workers()} threads; "
            f"requests and replies hold at most "
            f"{self.request_memory() / MiB:.0f} MiB"
        )


class TokenBucket:
    """`rate` tokens per second, holding at most `capacity`; starts full."""

    def __init__(self, rate: float, capacity: float):
        self.rate, self.capacity = rate, capacity
        self.tokens, self.stamp = capacity, time.monotonic()

    def refill(self, now: float) -> float:
        # (`now` may predate the bucket: a caller reads the clock before making a new one)
        self.tokens = min(self.capacity, self.tokens + max(now - self.stamp, 0.0) * self.rate)
        self.stamp = max(now, self.stamp)
        return self.tokens

    def take(self, n: float, now: float) -> bool:
        if self.refill(now) < n:
            return False
        self.tokens -= n
        return True


class Client:
    """One client's open calls, streams and record streams, and its buckets."""

    def __init__(self, limits: Limits):
        self.open = 0  # unary calls and ForwardStreams
        self.records = 0  # Record streams
        self.worked_at = -math.inf  # monotonic time of the last Forward computed for it
        self.record_credit = 0  # record bytes it may fetch beyond its rate: what it had computed
        self.calls = TokenBucket(limits.rate, limits.rate * BURST_S)
        rows_capacity = max(limits.rate_rows * BURST_S, float(limits.max_rows))
        self.rows = TokenBucket(limits.rate_rows, rows_capacity)
        self.record_bytes = TokenBucket(limits.record_rate, limits.record_rate * BURST_S)

    def idle(self, now: float) -> bool:
        """Nothing open and every bucket full: forgetting it changes nothing."""
        return (
            self.open == 0
            and self.records == 0
            and all(b.refill(now) >= b.capacity for b in (self.calls, self.rows, self.record_bytes))
        )


@dataclass(eq=False)
class Open:
    """One admitted call or stream: whose, in which pool, and whether it waits for a message."""

    flow: Flow
    pool: str  # "call", "stream", "record" or "reserved"
    seq: int
    reading_since: float = math.inf  # monotonic time it began waiting on its client (inf: not):
    # for its next message, or for it to take a reply
    evicted: threading.Event = field(default_factory=threading.Event)
    cancel: Callable[[], object] | None = None  # ends the call while a reply waits (`sending`)
    wake: threading.Event | None = None  # ends its wait for a message (`read`)


class Guard:
    """The limits of one node, shared by all its calls. Thread-safe."""

    def __init__(self, limits: Limits):
        if not limits.max_request_bytes or not limits.max_rows or not limits.rate_rows:
            raise ValueError("Guard needs resolved limits (Limits.resolve)")
        self.limits = limits
        self.lock = threading.Lock()
        self.clients: dict[str, Client] = {}
        self.sweep_at = MAX_CLIENTS  # drop idle client records when there are this many
        # unary calls, ForwardStreams and Record streams: open now, and the most open at once
        self.open = {"call": 0, "control": 0, "stream": 0, "record": 0, "reserved": 0}
        self.caps = {
            "call": limits.max_calls,
            "control": limits.max_controls,
            "stream": limits.max_streams,
            "record": limits.max_records,
            "reserved": limits.max_records,  # Record streams of clients it computed for lately
        }
        big = max(1, limits.max_active - 1)  # one place kept for requests of <= CHUNK_ROWS
        self.work = FairGate(limits.max_active, limits.max_queue, big, what="compute")
        self.turns = FairGate(1, limits.max_active, what="compute turn")  # all of work's holders
        self.opens: set[Open] = set()
        self.seq = itertools.count()
        self.evictions = 0
        # every admitted call and stream has at most one read outstanding: reads never queue
        self.readers = ThreadPoolExecutor(
            limits.max_calls + limits.max_controls + limits.max_streams + 2 * limits.max_records,
            thread_name_prefix="read",
        )
        self.stalls = Watchdog()  # streams whose client stops taking their replies

    # -- admission ------------------------------------------------------------------------

    @contextmanager
    def admit(self, client: str, kind: str, peer: str = ""):
        """Count a unary call (`kind` "call"), a ForwardStream ("stream") or a Record stream
        ("record") of `client` (its grpc peer string `peer`) as open for the block, which
        gets its `Open`; Refused (RESOURCE_EXHAUSTED) over the client's cap, or over the
        node's when no idle call of a larger client can be ended for it."""
        flow = flow_of(client, peer)
        with self.lock:
            record = self._client(client)
            self._check_client_cap(client, record, kind)
            pool = kind
            if kind == "record" and self.open["record"] >= self.caps["record"]:
                if time.monotonic() - record.worked_at < RESERVED_S:  # a client it serves
                    pool = "reserved"
            cap = self.caps[pool]
            if self.open[pool] >= cap:
                self._evict_for(flow, pool, cap, kind)
            self._count(record, pool, +1)
            handle = Open(flow, pool, next(self.seq))
            self.opens.add(handle)
        try:
            yield handle
        except Refused as exc:
            if exc.slow:
                self._tarpit(handle)
            raise
        finally:
            with self.lock:
                if handle in self.opens:  # (an evicted one was counted out when evicted)
                    self.opens.discard(handle)
                    self._count(record, pool, -1)

    def _tarpit(self, handle: Open) -> None:
        """Hold `handle`'s place TARPIT_S before its refusal is sent (see TARPIT_S), evictable
        as an idle call is, and ended at once if evicted."""
        wake = threading.Event()
        with self.lock:
            if handle.evicted.is_set():
                return
            handle.reading_since, handle.wake = time.monotonic() - EVICT_IDLE_S, wake
        wake.wait(TARPIT_S)
        with self.lock:
            handle.reading_since, handle.wake = math.inf, None

    def _evict_for(self, newcomer: Flow, pool: str, cap: int, kind: str) -> None:
        """The pool is full (under self.lock): end the longest-idle call of the client holding
        the most of it, if it holds more than `newcomer` would and one of its calls has
        waited EVICT_IDLE_S for a message; else Refused."""
        now = time.monotonic()
        held = [o for o in self.opens if o.pool == pool]
        top = largest_flow([o.flow for o in held], newcomer)
        idle = [
            o for o in held if o.flow == top and now - o.reading_since >= EVICT_IDLE_S
        ]  # fmt: skip
        if not idle:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"node busy: {cap} {kind}s open already"
            )
        victim = min(idle, key=lambda o: o.reading_since)
        self.opens.discard(victim)
        victim_client = self.clients.get(victim.flow.key)
        if victim_client is not None:
            self._count(victim_client, pool, -1)
        else:
            self.open[pool] -= 1
        self.evictions += 1
        victim.evicted.set()
        if victim.wake is not None:  # waiting for its next message: its read ends
            victim.wake.set()
        if victim.cancel is not None:  # waiting for its client to take a reply: end it
            victim.cancel()

    def _check_client_cap(self, client: str, record: Client, kind: str) -> None:
        if kind == "record" and record.records >= self.limits.per_client_records:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {_show(client)} has {record.records} record streams open, the most "
                f"this node allows (--per-client-records)",
            )
        if kind != "record" and record.open >= self.limits.per_client:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {_show(client)} has {record.open} calls and streams open, the most "
                f"this node allows (--per-client)",
            )

    def _count(self, record: Client, kind: str, step: int) -> None:
        """Open (+1) or close (-1) a call of `kind` (under self.lock)."""
        if kind in ("record", "reserved"):
            record.records += step
        else:
            record.open += step
        self.open[kind] += step

    def charge(self, client: str, rows: int = 0, calls: int = 1) -> None:
        """`calls` calls (or stream messages) of `rows` rows; Refused when the client is over
        its rate. A refused call takes no tokens. (A Forward is charged twice: its call
        before it is parsed, its rows after.)"""
        now = time.monotonic()
        with self.lock:
            record = self._client(client)
            if rows:
                record.worked_at = now  # (refused or not: it asked for work)
            if calls and record.calls.refill(now) < calls:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {_show(client)} is over its rate of {self.limits.rate:g} calls/s "
                    f"(--rate)",
                    slow=True,
                )
            if not record.rows.take(rows, now):
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {_show(client)} is over its rate of {self.limits.rate_rows:g} "
                    f"rows/s (--rate-rows)",
                    slow=True,
                )
            record.calls.take(calls, now)

    def credit_records(self, client: str, nbytes: int) -> None:
        """This node just computed with `nbytes` of records for `client`: it may fetch as many
        bytes of records beyond its rate (up to CREDIT_CAP). A coordinator that audits its
        calls fetches at most the records they used, at its audit rate, so an honest
        coordinator's audits are never refused for the rate, however large the records;
        whoever wants records without having the node compute gets the rate alone."""
        with self.lock:
            record = self._client(client)
            record.record_credit = min(CREDIT_CAP, record.record_credit + nbytes)

    def charge_bytes(self, client: str, nbytes: int) -> None:
        """A record of `nbytes` bytes for `client`: from its credit when that holds it, else
        from its record-byte bucket; Refused when the bucket holds less than that (or, for a
        record larger than the bucket, is not full). The bucket may go below zero: a record
        larger than one second of the rate is paid for by the wait after it. A refused record
        takes nothing."""
        now = time.monotonic()
        with self.lock:
            record = self._client(client)
            if record.record_credit >= nbytes:
                record.record_credit -= nbytes
                return
            bucket = record.record_bytes
            if bucket.refill(now) < min(nbytes, bucket.capacity):
                wait_s = (min(nbytes, bucket.capacity) - bucket.tokens) / bucket.rate
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {_show(client)} is over its rate of "
                    f"{fmt_bytes(self.limits.record_rate)}/s of record bytes (--record-rate-mb): "
                    f"this record in {wait_s:.2g} s",
                    slow=True,
                )
            bucket.tokens -= nbytes

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

    def computing(self, flow: Flow, rows: int, deadline_s: float | None = None):
        """A place among the requests decoded and computed at once, for the block (context
        manager), by fair tags; Refused "node busy" when none frees up within queue_wait_s
        (or the call's remaining time), or when dropped from a full queue."""
        wait = self.limits.queue_wait_s
        wait = wait if deadline_s is None else max(0.0, min(wait, deadline_s))
        return _refusing(self.work.hold(flow, max(rows, 1), wait, big=rows > CHUNK_ROWS))

    def before_reading(
        self, flow: Flow, deadline_s: float | None = None, handle: Open | None = None
    ) -> None:
        """Before a Forward's message is read: wait until no earlier request of `flow` waits
        for a compute place (at most queue_wait_s, or the call's remaining time), else Refused
        "node busy" with the message unread. A client that sends faster than the node
        computes for it then has one request read and waiting, and the rest of its bytes stay
        on its side of HTTP/2's flow control: the node does not spend its core receiving
        requests it would refuse (measured: 8 keys sending 8 MB requests at 1 Gbit/s left an
        honest client 0.44-0.50x of its speed, 0.54-0.63x with this, same machine). Waiting
        so, `handle` may be evicted at once for a newcomer (nothing of it has been read)."""
        wait = self.limits.queue_wait_s
        wait = wait if deadline_s is None else max(0.0, min(wait, deadline_s))
        end = time.monotonic() + wait
        if handle is not None:
            with self.lock:
                handle.reading_since = time.monotonic() - EVICT_IDLE_S
        try:
            while not self.work.wait_none_waiting(flow, min(max(end - time.monotonic(), 0), 0.05)):
                if handle is not None and handle.evicted.is_set():
                    raise Refused(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "evicted: this waiting call was ended to make room for another client's",
                    )
                if time.monotonic() >= end:
                    raise Refused(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"node busy: this client's earlier request still waits for compute "
                        f"after {wait:.3g} s",
                        slow=True,
                    )
        finally:
            if handle is not None:
                with self.lock:
                    handle.reading_since = math.inf

    def turn(self, flow: Flow, rows: int):
        """One turn of compute (at most CHUNK_ROWS rows) for the block, by fair tags."""
        return _refusing(self.turns.hold(flow, max(rows, 1), self.limits.queue_wait_s))

    def read(self, requests: Iterator, timeout_s: float | None = None, handle: Open | None = None):
        """The next message of a call, or None at its end (or when the client cancelled);
        Refused (DEADLINE_EXCEEDED) when none comes within `timeout_s` (default
        idle_timeout_s), Refused (RESOURCE_EXHAUSTED) when `handle` is evicted meanwhile for
        a newcomer: the caller aborts the call, which ends the helper's read."""
        wait = self.limits.idle_timeout_s if timeout_s is None else timeout_s
        wake = threading.Event()  # the message came, or the call was evicted
        pending = self.readers.submit(next, requests, None)
        pending.add_done_callback(lambda _: wake.set())
        if handle is not None:
            with self.lock:
                handle.reading_since, handle.wake = time.monotonic(), wake
                if handle.evicted.is_set():
                    wake.set()
        try:
            wake.wait(wait)
            if pending.done():
                return pending.result()
            if handle is not None and handle.evicted.is_set():
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "evicted: this idle call was ended to make room for another client's",
                )
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no message for {wait:g} s: idle call ended (--idle-timeout)",
            )
        except grpc.RpcError:  # cancelled by the client
            return None
        finally:
            if handle is not None:
                with self.lock:
                    handle.reading_since, handle.wake = math.inf, None

    @contextmanager
    def sending(self, cancel: Callable[[], object], handle: Open | None = None):
        """Around handing one streamed reply to grpc (context manager): `cancel` (the call's
        context.cancel) is called if the block has not ended within idle_timeout_s, that is
        when the client has stopped taking replies and flow control holds the send. Such a
        stream reads no more requests meanwhile (paused), and after EVICT_IDLE_S it counts as
        idle: it may be ended for a newcomer (`handle`'s cancel)."""
        if handle is not None:
            with self.lock:
                handle.reading_since, handle.cancel = time.monotonic(), cancel
        try:
            with self.stalls.watch(self.limits.idle_timeout_s, cancel):
                yield
        finally:
            if handle is not None:
                with self.lock:
                    handle.reading_since, handle.cancel = math.inf, None

    def close(self) -> None:
        self.readers.shutdown(wait=False, cancel_futures=True)
        self.stalls.close()


class Watchdog:
    """Calls the `cancel` of every watched block still running at its deadline. One daemon
    thread, started on first use, sleeps until the earliest deadline."""

    def __init__(self):
        self.cond = threading.Condition()
        self.due: dict[int, tuple[float, Callable[[], object]]] = {}  # key -> (deadline, cancel)
        self.keys = itertools.count()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.fired = 0  # blocks cancelled so far

    @contextmanager
    def watch(self, timeout_s: float, cancel: Callable[[], object]):
        with self.cond:
            key = next(self.keys)
            self.due[key] = (time.monotonic() + timeout_s, cancel)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
                self.thread.start()
            self.cond.notify()
        try:
            yield
        finally:
            with self.cond:
                self.due.pop(key, None)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not self._overdue():
                    soonest = min((at for at, _ in self.due.values()), default=None)
                    self.cond.wait(None if soonest is None else soonest - time.monotonic())
                if self.closed:
                    return
                overdue = self._overdue()
                cancels = [self.due.pop(key)[1] for key in overdue]
                self.fired += len(cancels)
            for cancel in cancels:
                cancel()

    def _overdue(self) -> list[int]:
        now = time.monotonic()
        return [key for key, (at, _) in self.due.items() if at <= now]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()


@contextmanager
def _refusing(hold):
    """`hold` (a FairGate place) with its Busy raised as Refused."""
    try:
        with hold:
            yield
    except Busy as exc:
        raise Refused(Busy.code, str(exc), slow=True) from None


def _show(client: str) -> str:
    return client or "(anonymous)"
