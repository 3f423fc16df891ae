"""moeshard's relay: a bootstrap peer splices a coordinator's stream onto a stream to a node
behind a NAT, for calls that no direct or hole-punched connection can carry.

Why not the daemon's circuit relay alone: p2pd (hivemind 1.1.12's build) starts go-libp2p's
relay service twice, once with the limits it is given and once with the library's defaults
(p2pd/main.go: `relay.New(host)`); the second one's stream handler wins, so every relayed
connection is reset after 128 KiB or 2 minutes, a few dozen expert calls (docs/p2p.md). The
circuit still serves what it is made for, short exchanges: the record a coordinator reads and
the hole punch it starts. The calls themselves, when no direct path comes of it, go here:

    coordinator --/moeshard/relay/1--> bootstrap peer --/moeshard/grpc/1--> node

Both legs are libp2p streams (authenticated and encrypted by the daemons); inside them runs
the coordinator's mutual TLS with the node, pinned by id, so the relay forwards ciphertext it
can neither read nor alter undetected. It dials nobody: a target must already be connected to
it (a node behind a NAT keeps its connection to the bootstrap peers), so it is no open proxy.
What it carries is bounded per source peer: streams at once and bytes per second.

The exchange: the client writes the target's peer id and a newline; the relay answers
`ok` and a newline and from then on copies bytes both ways, or answers `no: WHY` and closes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

from moeshard.moe.p2p.control import Control, P2PError
from moeshard.moe.p2p.registry import GRPC_PROTOCOL
from moeshard.moe.p2p.tunnel import MAX_LINE, RELAY_PROTOCOL, Inbound, pipe, read_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayLimits:
    streams: int = 128  # spliced streams at once, from everyone
    per_peer: int = 16  # at once from one source peer (a coordinator holds one per node)
    rate: float = 0.0  # bytes per second one source peer may push through, both ways (0: any)


class TokenBucket:
    """`take(n)` sleeps as long as `rate` bytes/s (bursts of one second) requires."""

    def __init__(self, rate: float):
        self.rate, self.level, self.at = rate, rate, time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.level = min(self.rate, self.level + (now - self.at) * self.rate) - n
            self.at = now
            wait = -self.level / self.rate if self.level < 0 else 0.0
        if wait:
            time.sleep(wait)


class Relay:
    """Serves RELAY_PROTOCOL on `control`'s daemon within `limits`."""

    def __init__(self, control: Control, limits: RelayLimits = RelayLimits()):
        self.control, self.limits = control, limits
        self.lock = threading.Lock()
        self.open: Counter[str] = Counter()  # source peer id -> spliced streams open
        self.buckets: dict[str, TokenBucket] = {}
        self.inbound = Inbound(control, RELAY_PROTOCOL, serve=self._serve)

    def _serve(self, sock: socket.socket, source: str) -> None:
        try:
            self._splice(sock, source)
        finally:
            sock.close()

    def _splice(self, sock: socket.socket, source: str) -> None:
        try:
            sock.settimeout(10.0)
            target = read_line(sock)
            why = self._refusal(source, target)  # counted as open unless refused
        except (OSError, P2PError) as exc:
            log.info("relay: a stream from %s dropped: %s", source, exc)
            return
        if why:
            say(sock, f"no: {why}")
            return
        try:
            try:
                out, _ = self.control.open_stream(target, GRPC_PROTOCOL)
            except P2PError as exc:
                say(sock, f"no: {exc}")
                return
            try:
                sock.sendall(b"ok\n")
                sock.settimeout(None)
            except OSError:
                out.close()
                return
            bucket = self.buckets.get(source)
            pipe(sock, out, bucket.take if bucket else None).join()
        finally:
            self._release(source)

    def _refusal(self, source: str, target: str) -> str:
        """Why a splice from `source` to `target` is refused, or '' (and it is counted)."""
        if not target or target == source:
            return "no target"
        connected = {p.peer_id for p in self.control.peers()}
        if target not in connected:
            return "the target is not connected to this relay"
        with self.lock:
            if sum(self.open.values()) >= self.limits.streams:
                return f"this relay carries {self.limits.streams} streams already"
            if self.open[source] >= self.limits.per_peer:
                return f"{self.limits.per_peer} streams from you are open already"
            self.open[source] += 1
            if self.limits.rate and source not in self.buckets:
                self.buckets[source] = TokenBucket(self.limits.rate)
        return ""

    def _release(self, source: str) -> None:
        with self.lock:
            self.open[source] -= 1
            if self.open[source] <= 0:
                del self.open[source]
                self.buckets.pop(source, None)

    def close(self) -> None:
        self.inbound.close()


def say(sock: socket.socket, line: str) -> None:
    try:
        sock.sendall(line.encode()[:MAX_LINE] + b"\n")
    except OSError:
        pass
