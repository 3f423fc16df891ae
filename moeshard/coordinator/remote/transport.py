"""How Forward calls travel: pinned TLS channels, unary futures, persistent bidi streams.

A `ForwardStream` per node carries every Forward of a generation as messages on one HTTP/2
stream (about half the per-call cost of a unary call); replies come back in request order, and a
reader thread per stream completes each request's future as its reply arrives. A stream reply
has no gRPC deadline of its own: `StreamCall.result` waits for its future under the call's
deadline, and an overdue reply cancels the stream.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc

from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity.keys import looks_like_id
from moeshard.moe.identity.tls import TLS_NAME, TLSMaterial, fetch_node_identity
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.moe.wire.constants import MAX_MESSAGE_BYTES
from moeshard.moe.wire.hosts import is_loopback

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class PinError(MoeshardError):
    """A node presented another key than the one pinned for it."""


@dataclass(frozen=True)
class PeerSpec:
    """Where a node is and which key it must present ("" with --insecure: nothing pinned)."""

    addr: str  # HOST:PORT
    node_id: str = ""

    def __str__(self) -> str:
        return f"{self.node_id}@{self.addr}" if self.node_id else self.addr


def parse_peers(text: str, insecure: bool) -> list[PeerSpec]:
    """`--peers ID@HOST:PORT,...` (plain HOST:PORT only with --insecure)."""
    specs = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        node_id, _, addr = item.rpartition("@")
        if not addr.rpartition(":")[2].isdigit():
            raise MoeshardError(f"--peers: '{item}' is not ID@HOST:PORT")
        if node_id and not looks_like_id(node_id):
            raise MoeshardError(f"--peers: '{node_id}' is not a node id (`moeshard id KEY`)")
        if not node_id and not insecure:
            raise MoeshardError(
                f"--peers: '{item}' names no node id: nodes are pinned by the id of their key "
                f"(ID@HOST:PORT; the node prints it), or use --insecure on loopback"
            )
        specs.append(PeerSpec(addr, node_id))
    if not specs:
        raise MoeshardError("--peers: no addresses given")
    return specs


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def dial(spec: PeerSpec, tls: TLSMaterial | None, timeout: float) -> tuple[grpc.Channel, str]:
    """A channel to the node and the id it proved. With `tls`: a TLS 1.3 handshake fetches
    the node's certificate and checks its key against the pinned id (PinError naming both),
    then the channel trusts exactly that certificate. Without: plaintext, loopback only.
    OSError / ssl.SSLError when the node cannot be reached over TLS."""
    if tls is None:
        if not is_loopback(_split(spec.addr)[0]):
            raise MoeshardError(f"--insecure is plaintext: loopback only, not {spec.addr}")
        return grpc.insecure_channel(spec.addr, options=CHANNEL_OPTIONS), spec.node_id
    host, port = _split(spec.addr)
    node_id, cert = fetch_node_identity(host, port, tls, timeout)
    if spec.node_id and node_id != spec.node_id:
        raise PinError(f"node at {spec.addr} presents key {node_id}, not the pinned {spec.node_id}")
    credentials = grpc.ssl_channel_credentials(cert, tls.key, tls.chain)
    options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", TLS_NAME)]
    return grpc.secure_channel(spec.addr, credentials, options=options), node_id


class UnaryCall:
    """One Forward future; result() -> (reply, seconds from send to completion)."""

    def __init__(self, future, deadline_s: float):
        self.sent_at = time.perf_counter()
        self.deadline = self.sent_at + deadline_s + 1.0  # gRPC ends it at its own deadline
        self.finished = 0.0
        self.ready: Future = Future()  # completed with the call (for waiting on several)
        self.future = future
        future.add_done_callback(self._done)

    def _done(self, _future) -> None:
        self.finished = time.perf_counter()
        self.ready.set_result(None)

    def deadline_left(self) -> float:
        return self.deadline - time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def result(self):
        reply = self.future.result()
        return reply, max(self.finished, self.sent_at) - self.sent_at

    def abandon(self) -> None:
        """Another node's answer was taken instead: cancel this call."""
        self.future.cancel()


class StreamError(grpc.RpcError):
    """A ForwardStream that ended without a usable status: closed by the node, or a reply
    that missed its deadline (the stream was cancelled)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ForwardStream:
    """A persistent ForwardStream: requests go in through a queue; a reader thread takes the
    replies as they come (in request order) and completes each request's future, so the
    coordinator can wait for several nodes at once, with a timeout (hedged requests)."""

    def __init__(self, stub: pb_grpc.ExpertNodeStub):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stub.ForwardStream(iter(self.outbox.get, None))
        self.timed_out = False
        self.sent = self.received = 0  # replies come in order: received <= sent, honestly
        self.unsolicited = 0  # replies no request asked for (a duplicate: a lie)
        self.lock = threading.Lock()
        self.waiting: collections.deque[Future] = collections.deque()  # in request order
        self.reader = threading.Thread(target=self._read, name="forward-stream", daemon=True)
        self.reader.start()

    def send(self, request) -> Future:
        """Send `request`; its future gets the reply (or the stream's error)."""
        future: Future = Future()
        with self.lock:
            self.sent += 1
            self.waiting.append(future)
        self.outbox.put(request)
        return future

    def _read(self) -> None:
        error: grpc.RpcError | None = None
        try:
            for reply in self.replies:
                with self.lock:
                    future = self.waiting.popleft() if self.waiting else None
                    if future is None:
                        self.unsolicited += 1
                    else:
                        self.received += 1
                if future is not None:
                    future.set_result(reply)
            error = StreamError(grpc.StatusCode.UNAVAILABLE, "stream closed by the node")
        except grpc.RpcError as exc:
            error = exc
            if self.timed_out:
                error = StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply by the deadline")
        except ValueError:  # grpc's "call error 8": closed meanwhile by the client's end
            error = StreamError(grpc.StatusCode.CANCELLED, "stream closed")
        with self.lock:
            left, self.waiting = list(self.waiting), collections.deque()
        for future in left:
            future.set_exception(error)

    def ended(self) -> bool:
        """Whether the node has already ended this stream (a reply would only raise)."""
        return self.replies.done()

    def cancel(self) -> None:
        """A reply is overdue: end the stream (its waiting requests fail)."""
        self.timed_out = True
        self.replies.cancel()

    def close(self) -> None:
        self.outbox.put(None)
        self.replies.cancel()

    def finish(self, wait_s: float) -> int:
        """Half-close the stream and let the reader take it to its end (at most `wait_s`);
        returns how many replies came that no request asked for. A reply sent twice is
        otherwise only noticed when the next request's reply is read, which never happens if
        the node gets no more work (issue 15's duplicate liar went unseen that way)."""
        self.outbox.put(None)
        self.reader.join(wait_s)
        self.replies.cancel()
        self.reader.join(1.0)
        return self.unsolicited


class StreamCall:
    """One request on a peer's stream; result() waits for its reply under the deadline (an
    overdue reply cancels the stream). `on_broken` is called when the stream fails, so the
    next call opens a new one."""

    def __init__(self, stream: ForwardStream, request, deadline_s: float, on_broken):
        self.stream, self.on_broken = stream, on_broken
        self.sent_at = time.perf_counter()
        self.deadline = self.sent_at + deadline_s
        self.future = self.ready = stream.send(request)
        self.finished = 0.0
        self.future.add_done_callback(self._done)

    def _done(self, _future) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def deadline_left(self) -> float:
        return self.deadline - time.perf_counter()

    def result(self):
        try:
            reply = self.future.result(timeout=max(self.deadline_left(), 0.0))
        except FutureTimeout:
            self.stream.cancel()
            self.on_broken(self.stream)
            raise StreamError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "no reply by the deadline"
            ) from None
        except grpc.RpcError:
            self.on_broken(self.stream)
            self.stream.close()
            raise
        return reply, max(self.finished, self.sent_at) - self.sent_at

    def abandon(self) -> None:
        """Another node's answer was taken instead: this reply is left to arrive and be
        dropped (one message of a stream cannot be cancelled; the node computes it anyway)."""
