"""The machinery that holds a node's clients to its `Limits` (node/limits.py has the rules
and why): admission to the call, stream and record pools with eviction of idle holders, fair
places in the compute queue and fair turns at compute (node/fairness.py), token buckets for
calls, rows and record bytes, reading a call's messages under the idle timeout, and the
`Watchdog` that cancels a Record stream whose client stopped reading."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from moeshard.moe.units import fmt_bytes
from moeshard.moe.wire.constants import CREDIT_CAP
from moeshard.node.fairness import Busy, FairGate, Flow, flow_of, largest_flow
from moeshard.node.limits import (
    BURST_S,
    CHUNK_ROWS,
    EVICT_IDLE_S,
    MAX_CLIENTS,
    RESERVED_S,
    TARPIT_S,
    Limits,
    Refused,
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

    def waiting(self) -> int:
        """Forward calls waiting for a compute place now (every client's)."""
        with self.work.lock:
            return len(self.work.waiting)

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
