"""A node in the wide-area registry (`--bootstrap`): found by model id from anywhere, reached
through NATs. See `moeshard.moe.p2p.registry` for the protocol and docs/p2p.md for the paths.

The node runs a p2p daemon that joins the bootstrap peers' DHT. Its expert calls arrive as
streams of GRPC_PROTOCOL, each piped to its own gRPC port on loopback: the TLS inside is the
node's, end to end, so a relay on the way carries only ciphertext. Every REANNOUNCE_S it
re-signs its record with the addresses the daemon has now and renews its provider record.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

from moeshard.moe.identity.keys import Identity
from moeshard.moe.identity.signed import sign_announcement
from moeshard.moe.p2p.control import P2PError
from moeshard.moe.p2p.daemon import P2PDaemon, peer_args
from moeshard.moe.p2p.registry import (
    GRPC_PROTOCOL,
    REANNOUNCE_S,
    RECORD_PROTOCOL,
    RECORD_TTL_S,
    registry_key,
    write_record,
)
from moeshard.moe.p2p.tunnel import Inbound
from moeshard.moe.wire.hosts import advertised_addresses
from moeshard.node.announce import announcement_fields

log = logging.getLogger(__name__)
RECORD_LINGER_S = 10.0  # how long a record stream is held open for its reader to close it
ADDRESS_POLL_S = 2.0  # how often the daemon's addresses are looked at
DEFAULT_LISTEN = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
REJOIN_S = 20.0  # with no way in for this long, a node behind a NAT restarts its daemon


def tcp_endpoints(host: str, port: int) -> list[str]:
    """Where the gRPC port may be dialled straight over TCP (the record's signed `tcp`
    field): the node's non-loopback addresses. A coordinator on the same network, or any one
    when the node has a public address, then calls it as `--peers` does, with no daemon in
    the way; behind a NAT they answer no one outside and it falls back to p2p streams."""
    return [f"{ip}:{port}" for ip in advertised_addresses(host) if not ip.startswith("127.")]


def reachability(addresses: list[str]) -> str:
    """What a node's addresses say of it: relayed ones mean AutoNAT found it unreachable."""
    relayed = [a for a in addresses if "/p2p-circuit" in a]
    if relayed:
        return f"behind a NAT, reachable through relays: {', '.join(relayed)}"
    return f"reachable directly: {', '.join(addresses) or '(no address yet)'}"


class WidePublisher:
    def __init__(
        self,
        key: Identity,
        name: str,
        model_id: str,
        format_version: int,
        wire_version: int,
        held,
        grpc_port: int,
        bootstrap: list[str],
        grpc_host: str = "127.0.0.1",
        listen: list[str] | None = None,
        key_file=None,
        log_file=None,
    ):
        self.key, self.model_id = key, model_id
        self.fields = announcement_fields(name, model_id, format_version, wire_version, held)
        self.fields["tcp"] = ",".join(tcp_endpoints(grpc_host, grpc_port))
        self.grpc_port = grpc_port
        self.daemon_args = peer_args(listen or DEFAULT_LISTEN, bootstrap)
        self.key_file, self.log_file = key_file, log_file
        self.record: dict[str, str] = {}
        self.addresses: list[str] = []
        self.relayed = False  # it has had relayed addresses (it is behind a NAT)
        self.lost_since: float | None = None  # since when it has had no way in at all
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._start_daemon()
        self._thread = threading.Thread(target=self._refresh, name="wide-announce", daemon=True)
        self._thread.start()

    def _start_daemon(self) -> None:
        self.daemon = P2PDaemon(self.daemon_args, key_file=self.key_file, log_file=self.log_file)
        self.fields["p2p"] = self.daemon.peer_id
        self.addresses = []
        self._resign()
        self.inbound = [
            Inbound(self.daemon.control, GRPC_PROTOCOL, target=("127.0.0.1", self.grpc_port)),
            Inbound(self.daemon.control, RECORD_PROTOCOL, serve=self._serve_record),
        ]
        self._provide()

    def _restart_daemon(self) -> None:
        """A node behind a NAT whose router dropped it (a reboot, a new WAN address) can be
        left with no relay slot and no public address: its daemon's AutoNAT has gone back to
        "unknown" and may not ask again for minutes (seen: over 2 minutes). A new daemon,
        with the same key and so the same peer id, asks at once."""
        if self._stop.is_set():
            return
        log.warning("p2p: no relayed or public address for %g s: restarting the daemon", REJOIN_S)
        for inbound in self.inbound:
            inbound.close()
        self.daemon.close()
        self.relayed, self.lost_since = False, None
        self._start_daemon()

    def _check_reachable(self) -> None:
        """Restart the daemon if, once behind a NAT, it has had no way in for REJOIN_S."""
        relayed = any("/p2p-circuit" in a for a in self.addresses)
        public = any(_is_public(a) for a in self.addresses)
        self.relayed |= relayed
        if relayed or public or not self.relayed:
            self.lost_since = None
        elif self.lost_since is None:
            self.lost_since = time.monotonic()
        elif time.monotonic() - self.lost_since >= REJOIN_S:
            self._restart_daemon()

    @property
    def peer_id(self) -> str:
        return self.daemon.peer_id

    def _resign(self) -> bool:
        """Sign the record afresh with the daemon's addresses now; True if they changed."""
        try:
            addresses = sorted(self.daemon.addresses())
        except P2PError as exc:
            log.warning("p2p daemon: %s", exc)
            return False
        changed = addresses != self.addresses
        if changed:
            log.info("p2p: %s", reachability(addresses))
            self.addresses = addresses
        record = sign_announcement(
            self.key, dict(self.fields, addrs=",".join(addresses)), ttl_s=RECORD_TTL_S
        )
        with self._lock:
            self.record = record
        return changed

    def _provide(self) -> None:
        try:
            self.daemon.control.provide(registry_key(self.model_id))
        except P2PError as exc:  # no DHT peer yet: the next round tries again
            log.info("p2p: provider record not stored yet: %s", exc)

    def _serve_record(self, sock: socket.socket, peer_id: str) -> None:
        with self._lock:
            record = self.record
        try:
            write_record(sock, record)
            sock.settimeout(RECORD_LINGER_S)  # then wait for the reader to close: the daemon
            while sock.recv(64):  # drops what is still in flight when our end closes first
                pass
        except OSError:
            pass
        finally:
            sock.close()

    def _refresh(self) -> None:
        """Every REANNOUNCE_S, and at once when the daemon's addresses change (a relay
        reservation, a port mapping, a new network): a fresh record and provider record."""
        since = 0.0
        while not self._stop.wait(ADDRESS_POLL_S):
            since += ADDRESS_POLL_S
            if since >= REANNOUNCE_S or self._check_addresses():
                self._resign()
                self._provide()
                since = 0.0
            try:
                self._check_reachable()
            except (P2PError, OSError) as exc:  # (a daemon that would not start: next round)
                log.warning("p2p daemon: %s", exc)

    def _check_addresses(self) -> bool:
        try:
            return sorted(self.daemon.addresses()) != self.addresses
        except P2PError:
            return False

    def close(self) -> None:
        self._stop.set()
        for inbound in self.inbound:
            inbound.close()
        self.daemon.close()


def _is_public(multiaddr: str) -> bool:
    """A multiaddr at an IP anyone may dial: not relayed, private, loopback or link-local."""
    parts = multiaddr.split("/")
    if "/p2p-circuit" in multiaddr or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return False
    return not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_unspecified)
