"""Byte pipes between local sockets and libp2p streams: how gRPC (with its own mutual TLS)
runs through the p2p daemon unchanged.

- `Forward` (a coordinator): a TCP listener on loopback; each connection to it becomes a
  stream to one peer (direct, hole-punched or relayed: the daemon picks), so a gRPC channel
  to 127.0.0.1:PORT reaches that node. The TLS handshake inside still pins the node's key.
- `Inbound` (a node): the daemon hands each incoming stream of a protocol to a Unix socket of
  ours; each becomes a TCP connection to the node's own gRPC port, or goes to a `serve`
  function (a short answer, such as the node's signed record).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from moeshard.moe.p2p import addrs
from moeshard.moe.p2p import p2pd_pb2 as pb
from moeshard.moe.p2p.control import Control, P2PError, read_message

log = logging.getLogger(__name__)
CHUNK = 256 << 10
RELAY_PROTOCOL = "/moeshard/relay/1"  # a stream spliced by a relay (relay.py) to a node's gRPC
MAX_LINE = 128  # the relay exchange's lines (a peer id is 52 characters)
ANSWER_TIMEOUT_S = 15.0  # for a relay's answer (it opens a stream to the target first)
MAX_INBOUND = 256  # incoming streams a node holds open at once (record and gRPC together)


def _copy(src: socket.socket, dst: socket.socket, throttle=None) -> None:
    """src -> dst until src ends; then dst learns it (half-close), or both close on error.
    `throttle(n)`, if given, is called before n bytes are passed on (and may sleep)."""
    try:
        while data := src.recv(CHUNK):
            if throttle is not None:
                throttle(len(data))
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def pipe(a: socket.socket, b: socket.socket, throttle=None) -> threading.Thread:
    """Copy both ways on two threads; both sockets are closed when both directions end (when
    the returned thread does). `throttle`: as `_copy`'s, shared by both directions."""

    def run() -> None:
        other = threading.Thread(target=_copy, args=(b, a, throttle), daemon=True)
        other.start()
        _copy(a, b, throttle)
        other.join()
        a.close()
        b.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def accept_each(listener: socket.socket, handle) -> None:
    """`handle(conn)` for each connection to `listener`, until it is closed."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        handle(conn)


class Forward:
    """127.0.0.1:`port` -> a `protocol` stream to `peer_id` through `control`'s daemon: over
    a direct connection if there is one (the registry's lookup gives hole punches time to
    make one first), else spliced through one of `relays` (moeshard relays, relay.py), else
    over whatever path the daemon finds (a circuit relay: capped, see relay.py)."""

    def __init__(
        self, control: Control, peer_id: str, protocol: str, relays: list[str] | None = None
    ):
        self.control, self.peer_id, self.protocol = control, peer_id, protocol
        self.relays = list(relays or [])
        self.path = ""  # how the last stream went: direct, relayed (spliced) or circuit
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=accept_each, args=(self.listener, self._one), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        """One local connection: a stream to the peer, piped (in the accept thread: a tunnel
        carries one gRPC connection at a time)."""
        try:
            stream = self._open()
        except P2PError as exc:
            log.warning("p2p: no stream to %s: %s", self.peer_id, exc)
            conn.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe(conn, stream)

    def _open(self) -> socket.socket:
        if not self._direct():
            for relay in self.relays:
                try:
                    stream = open_relayed(self.control, relay, self.peer_id)
                except (P2PError, OSError) as exc:
                    log.info("p2p: relay %s for %s: %s", relay, self.peer_id, exc)
                    continue
                self.path = "relayed"
                return stream
        stream, via = self.control.open_stream(self.peer_id, self.protocol)
        self.path = "circuit" if "/p2p-circuit" in via else "direct"
        return stream

    def _direct(self) -> bool:
        """Whether a stream opened now should go straight to the peer: it has a direct
        connection, or there is no relay to use instead (the stream will dial)."""
        try:
            conns = [p for p in self.control.peers() if p.peer_id == self.peer_id]
        except P2PError:
            return not self.relays
        return not self.relays or any("/p2p-circuit" not in a for p in conns for a in p.addrs)

    def close(self) -> None:
        self.listener.close()


class Inbound:
    """Incoming `protocol` streams: each piped to TCP `target`, or handed to `serve(sock,
    peer_id)` (which must close it)."""

    def __init__(
        self,
        control: Control,
        protocol: str,
        target: tuple[str, int] | None = None,
        serve: Callable[[socket.socket, str], None] | None = None,
    ):
        self.target, self.serve = target, serve
        self.dir = tempfile.mkdtemp(prefix="moeshard-p2p-in-")
        self.path = str(Path(self.dir) / "in.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.slots = threading.BoundedSemaphore(MAX_INBOUND)
        threading.Thread(target=accept_each, args=(self.listener, self._start), daemon=True).start()
        control.add_handler(protocol, self.path)

    def _start(self, conn: socket.socket) -> None:
        """Any peer of the DHT may open streams: at most MAX_INBOUND are held at once (each
        holds threads and a socket); beyond that a stream is closed at once."""
        if not self.slots.acquire(blocking=False):
            log.warning("p2p: %d incoming streams open, one more refused", MAX_INBOUND)
            conn.close()
            return
        threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        finally:
            self.slots.release()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10.0)
            info = read_message(conn, pb.StreamInfo)
            conn.settimeout(None)
            peer = addrs.peer_id_text(info.peer)
            if self.serve is not None:
                self.serve(conn, peer)
                return
            out = socket.create_connection(self.target, timeout=10.0)
            out.settimeout(None)
            out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, P2PError) as exc:
            log.info("incoming p2p stream dropped: %s", exc)
            conn.close()
            return
        pipe(conn, out).join()

    def close(self) -> None:
        self.listener.close()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


def read_line(sock: socket.socket) -> str:
    """One line of at most MAX_LINE bytes, read a byte at a time (what follows it is the
    spliced stream's and must stay in the socket)."""
    line = bytearray()
    while len(line) <= MAX_LINE:
        byte = sock.recv(1)
        if not byte:
            raise P2PError("the stream ended before its first line")
        if byte == b"\n":
            return line.decode("ascii", "replace").strip()
        line += byte
    raise P2PError(f"a first line longer than {MAX_LINE} bytes")


def open_relayed(control: Control, relay: str, target: str) -> socket.socket:
    """A stream to `target`'s gRPC port spliced through `relay`; P2PError if it refuses."""
    sock, _ = control.open_stream(relay, RELAY_PROTOCOL)
    try:
        sock.settimeout(ANSWER_TIMEOUT_S)
        sock.sendall(f"{target}\n".encode())
        answer = read_line(sock)
        if answer != "ok":
            raise P2PError(f"relay {relay[:12]}... refused: {answer.removeprefix('no: ')}")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def relays_of(addresses: list[str]) -> list[str]:
    """The relays' peer ids in a record's relayed addresses (.../p2p/RELAY/p2p-circuit...)."""
    found = []
    for a in addresses:
        head, circuit, _ = a.partition("/p2p-circuit")
        if circuit and "/p2p/" in head:
            relay = head.rsplit("/p2p/", 1)[1]
            if relay not in found:
                found.append(relay)
    return found
