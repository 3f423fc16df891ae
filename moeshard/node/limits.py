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

`Limits.resolve` derives the sizes from the node's RAM budget; `Guard` (node/guard.py)
enforces the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import grpc

from moeshard.moe.errors import MoeshardError
from moeshard.moe.units import fmt_bytes
from moeshard.moe.wire.constants import MAX_MESSAGE_BYTES, MAX_ROWS

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
