"""How Forward calls travel: channels, unary futures and persistent bidirectional streams.

A `ForwardStream` per node carries every Forward of a generation as messages on one HTTP/2
stream (about half the per-call cost of a unary call); replies come back in request order. A
stream reply has no gRPC deadline of its own, so `StreamCall` registers its deadline with a
`Watchdog` that the peer prober ticks, and an overdue stream is cancelled.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from moe.wire import moeshard_pb2_grpc as pb_grpc
from moe.wire.constants import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


def open_channel(addr: str) -> grpc.Channel:
    return grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)


class UnaryCall:
    """One Forward future; result() -> (reply, seconds from send to completion)."""

    def __init__(self, future):
        self.sent_at = time.perf_counter()
        self.finished = 0.0
        self.future = future
        future.add_done_callback(self._done)

    def _done(self, _future) -> None:
        self.finished = time.perf_counter()

    def result(self):
        reply = self.future.result()
        return reply, max(self.finished, self.sent_at) - self.sent_at


class StreamError(grpc.RpcError):
    """A ForwardStream that ended without a usable status: closed by the node, or a reply
    that missed its deadline (the watchdog cancelled the stream)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ForwardStream:
    """A persistent ForwardStream: requests go in through a queue, replies come back in order."""

    def __init__(self, stub: pb_grpc.ExpertNodeStub):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stub.ForwardStream(iter(self.outbox.get, None))
        self.timed_out = False

    def send(self, request) -> None:
        self.outbox.put(request)

    def receive(self):
        try:
            return next(self.replies)
        except StopIteration:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "stream closed by the node") from None
        except grpc.RpcError:
            if self.timed_out:
                raise StreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no reply by the deadline"
                ) from None
            raise

    def cancel(self) -> None:
        """Called by the watchdog when a reply is overdue."""
        self.timed_out = True
        self.replies.cancel()

    def close(self) -> None:
        self.outbox.put(None)
        self.replies.cancel()


class Watchdog:
    """Deadlines of stream replies being waited for; `tick` cancels the overdue streams."""

    def __init__(self):
        self.waiting: dict[int, tuple[ForwardStream, float]] = {}
        self.lock = threading.Lock()

    def watch(self, key: int, stream: ForwardStream, deadline: float) -> None:
        with self.lock:
            self.waiting[key] = (stream, deadline)

    def done(self, key: int) -> None:
        with self.lock:
            self.waiting.pop(key, None)

    def tick(self, now: float) -> None:
        with self.lock:
            overdue = [s for s, deadline in self.waiting.values() if now > deadline]
        for stream in overdue:
            stream.cancel()


class StreamCall:
    """One request on a peer's stream; result() waits for its reply under the deadline.
    `on_broken` is called when the stream fails, so the next call opens a new one."""

    def __init__(self, stream: ForwardStream, watchdog: Watchdog, deadline_s: float, on_broken):
        self.stream, self.watchdog, self.on_broken = stream, watchdog, on_broken
        self.sent_at = time.perf_counter()
        self.deadline = time.monotonic() + deadline_s

    def result(self):
        key = id(self)
        self.watchdog.watch(key, self.stream, self.deadline)
        try:
            reply = self.stream.receive()
        except grpc.RpcError:
            self.on_broken(self.stream)
            self.stream.close()
            raise
        finally:
            self.watchdog.done(key)
        return reply, time.perf_counter() - self.sent_at
