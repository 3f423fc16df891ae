"""Finding nodes through the wide-area registry (`--bootstrap`): a coordinator behind a NAT
finds a model's nodes by its id alone and reaches each one, directly, hole-punched or
relayed. See `moeshard.moe.p2p.registry`.

The coordinator runs its own p2p daemon, asks the DHT for the model's providers, reads each
one's signed record over a stream (ignoring forged, expired, foreign-model and replayed ones),
and gives every node it keeps a loopback port (`Forward`) whose connections become streams
to it. The node's id is pinned as for `--peers`: the TLS handshake through the tunnel must
present that key, so a relay or a registry peer can neither read nor alter a call.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from moeshard.coordinator.remote.transport import PeerSpec
from moeshard.moe.errors import MoeshardError, StoreError
from moeshard.moe.identity.tls import TLSMaterial, fetch_node_identity
from moeshard.moe.p2p.control import P2PError
from moeshard.moe.p2p.daemon import P2PDaemon, peer_args
from moeshard.moe.p2p.registry import (
    GRPC_PROTOCOL,
    RECORD_PROTOCOL,
    check_record,
    read_record,
    registry_key,
)
from moeshard.moe.p2p.tunnel import Forward, relays_of

log = logging.getLogger(__name__)
CLIENT_LISTEN = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
POLL_S = 0.5  # between DHT lookups while waiting for the nodes expected
RECORD_TRIES = 3
RECORD_TIMEOUT_S = 10.0  # for a record to arrive on its stream
SETTLE_S = 5.0  # the longest a lookup waits for hole punches to replace relayed paths
PUNCH_AGAIN_AT = (1.0, 2.5)  # s into that wait: punches started again (see `_settle`)
WATCH_S = 10.0  # between lookups once running: late and returning nodes
PIN_TIMEOUT_S = 1.0  # a TCP endpoint's connect and TLS handshake (as zeroconf's pin checks)
MAX_TCP_ENDPOINTS = 8  # of a record's `tcp` endpoints, pin-checked (a record cannot ask more)


@dataclass
class WideNode:
    spec: PeerSpec  # HOST:PORT of its gRPC over plain TCP, or 127.0.0.1:PORT of its tunnel
    record: dict[str, str]
    peer_id: str
    forward: Forward
    tcp: str = ""  # the record's TCP endpoint that passed the pin check, if any

    @property
    def via(self) -> str:
        """How its calls go: 'tcp' (straight to its gRPC port, as `--peers`), or how the
        tunnel's last stream went: 'direct' (a p2p connection; hole-punched where both are
        behind NATs), 'relayed' (spliced by a moeshard relay) or 'circuit' (the daemon's
        capped relay)."""
        return "tcp" if self.tcp else self.forward.path or "none yet"


class WideDirectory:
    """The registry as seen from one coordinator; `close()` stops its daemon and tunnels."""

    def __init__(
        self, model_id: str, bootstrap: list[str], tls: TLSMaterial | None = None, log_file=None
    ):
        self.model_id, self.tls = model_id, tls  # tls: to pin-check a record's TCP endpoints
        self.daemon = P2PDaemon(peer_args(CLIENT_LISTEN, bootstrap), log_file=log_file)
        self.nodes: dict[str, WideNode] = {}  # by node id
        self.ignored: dict[str, str] = {}  # peer id -> why its record was not used
        self._stop = threading.Event()

    def lookup(self, timeout_s: float = 10.0, expect: int | None = None) -> list[WideNode]:
        """Ask the DHT until `expect` nodes (or, without it, any) are found or `timeout_s`
        passes; every provider's record is read and checked once."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                providers = self.daemon.control.find_providers(
                    registry_key(self.model_id), timeout_s=max(1, int(deadline - time.monotonic()))
                )
            except P2PError as exc:
                log.info("p2p lookup: %s", exc)
                providers = []
            admitted = [
                peer.peer_id
                for peer in providers
                if peer.peer_id not in self.ignored
                and not self._known(peer.peer_id)
                and self._admit(peer.peer_id)
            ]
            self._try_tcp(admitted)
            self._settle(admitted)
            enough = len(self.nodes) >= expect if expect else bool(self.nodes)
            if enough or time.monotonic() >= deadline:
                return list(self.nodes.values())
            time.sleep(POLL_S)

    def _known(self, peer_id: str) -> bool:
        return any(n.peer_id == peer_id for n in self.nodes.values())

    def _fetch_record(self, peer_id: str) -> dict[str, str] | None:
        """The record `peer_id` serves; None if it gives none in RECORD_TRIES streams (the
        first stream to a new peer can be reset when its daemon settles on one of several
        connections it opened at once)."""
        for attempt in range(RECORD_TRIES):
            try:
                sock, _ = self.daemon.control.open_stream(peer_id, RECORD_PROTOCOL)
            except P2PError as exc:
                log.info("p2p: no record stream to %s: %s", peer_id, exc)
                return None  # unreachable now: asked again at the next lookup
            try:
                return _read_and_close(sock)
            except (P2PError, OSError) as exc:
                if attempt == RECORD_TRIES - 1:
                    self.ignored[peer_id] = f"no record ({exc})"
                    return None
                time.sleep(0.2)
        return None

    def _admit(self, peer_id: str) -> bool:
        """Read, check and keep `peer_id`'s record; True if it is kept."""
        record = self._fetch_record(peer_id)
        if record is None:
            return False
        why = check_record(record, self.model_id, peer_id)
        if why:
            self.ignored[peer_id] = why
            log.warning("p2p: ignored the record of %s: %s", peer_id, why)
            return False
        node_id = record["node_id"]
        old = self.nodes.get(node_id)
        relays = relays_of(record.get("addrs", "").split(","))
        if old is not None:  # back under another peer id (a restarted daemon): same port
            old.forward.peer_id, old.peer_id, old.record = peer_id, peer_id, record
            old.forward.relays = relays
            return True
        forward = Forward(self.daemon.control, peer_id, GRPC_PROTOCOL, relays=relays)
        spec = PeerSpec(f"127.0.0.1:{forward.port}", node_id)
        self.nodes[node_id] = WideNode(spec, record, peer_id, forward)
        return True

    def _try_tcp(self, peer_ids: list[str]) -> None:
        """Calls go straight over TCP to a node whose record lists an endpoint that holds its
        key (the pin check: a TLS handshake, all in parallel, each within PIN_TIMEOUT_S), the
        first that does in the record's order; others keep their tunnels."""
        nodes = [n for n in self.nodes.values() if n.peer_id in peer_ids and not n.tcp]
        checks = [
            (node, endpoint)
            for node in nodes
            for endpoint in node.record.get("tcp", "").split(",")[:MAX_TCP_ENDPOINTS]
            if endpoint and self.tls is not None
        ]
        if not checks:
            return
        with ThreadPoolExecutor(min(len(checks), 16), thread_name_prefix="wide-pin") as pool:
            passed = list(pool.map(lambda c: self._pin_ok(c[0], c[1]), checks))
        for (node, endpoint), ok in zip(checks, passed, strict=True):
            if ok and not node.tcp:
                node.tcp = endpoint
                node.spec = PeerSpec(endpoint, node.spec.node_id)

    def _pin_ok(self, node: WideNode, endpoint: str) -> bool:
        host, _, port = endpoint.rpartition(":")
        try:
            return fetch_node_identity(host, int(port), self.tls, PIN_TIMEOUT_S)[0] == (
                node.spec.node_id
            )
        except (OSError, ValueError, ssl.SSLError, MoeshardError) as exc:
            log.debug("p2p: %s at %s: no direct TCP (%s)", node.peer_id, endpoint, exc)
            return False

    def _settle(self, peer_ids: list[str]) -> None:
        """Reading the record of a node behind a NAT opened a relayed connection, and with it
        a hole punch (DCUtR), which succeeds where both NATs keep a port per socket. Wait, up
        to SETTLE_S, until each node not reached over TCP is reached directly, so that its
        calls take the direct path rather than a relay; a node whose NAT defeats the punch
        costs the lookup that wait once.

        A punch also needs this daemon to know its own public address, which it learns from
        the peers it meets (go-libp2p trusts an observed address once several peers report
        it): a coordinator a moment old may not yet, and the node's punch then finds no
        DCUtR handler here and is not retried. So at each of PUNCH_AGAIN_AT, each node still
        relayed is disconnected and its record read again: a fresh relayed connection and a
        fresh punch."""
        waiting = {n.peer_id for n in self.nodes.values() if n.peer_id in peer_ids and not n.tcp}
        start = time.monotonic()
        again = list(PUNCH_AGAIN_AT)
        while waiting and time.monotonic() < start + SETTLE_S:
            try:
                connected = self.daemon.control.peers()
            except P2PError:
                return
            direct = {p.peer_id for p in connected if any("/p2p-circuit" not in a for a in p.addrs)}
            waiting -= direct
            if waiting and again and time.monotonic() >= start + again[0]:
                again.pop(0)
                log.info("p2p: punching again to %s", sorted(waiting))
                for peer_id in waiting:
                    self._punch_again(peer_id)
            if waiting:
                time.sleep(0.1)
        if waiting:
            log.info("p2p: no direct path to %s: relayed", sorted(waiting))
        else:
            log.info("p2p: direct paths after %.1f s", time.monotonic() - start)

    def _punch_again(self, peer_id: str) -> None:
        """A fresh relayed connection to `peer_id` (its record read again, only to open
        it: the record was checked), and with it a fresh hole punch."""
        try:
            self.daemon.control.disconnect(peer_id)
            _read_and_close(self.daemon.control.open_stream(peer_id, RECORD_PROTOCOL)[0])
        except (P2PError, OSError) as exc:
            log.info("p2p: %s: %s", peer_id, exc)

    def paths(self) -> dict[str, str]:
        """'NAME ID8' -> how its last stream went: direct or relayed."""
        return {
            f"{n.record.get('name', '')} {node_id[:8]}": n.via for node_id, n in self.nodes.items()
        }

    def watch(self, on_new, every_s: float = WATCH_S) -> None:
        """Look again every `every_s` in the background; `on_new(spec)` for each node found
        since. A known node found under a new peer id keeps its tunnel's port, now to it."""

        def run() -> None:
            while not self._stop.wait(every_s):
                before = set(self.nodes)
                self.ignored.clear()  # a node whose record was stale may have re-signed
                try:
                    self.lookup(timeout_s=5.0, expect=len(self.nodes) + 1)
                except (P2PError, OSError) as exc:
                    log.info("p2p lookup: %s", exc)
                    continue
                for node_id, node in list(self.nodes.items()):
                    if node_id not in before:
                        on_new(node.spec)

        self._watcher = threading.Thread(target=run, name="wide-watch", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        self._stop.set()
        for node in self.nodes.values():
            node.forward.close()
        self.daemon.close()


def find_wide(
    model_id: str,
    bootstrap: list[str],
    timeout_s: float,
    expect: int | None,
    tls: TLSMaterial | None = None,
) -> tuple[WideDirectory, list[PeerSpec]]:
    """The directory (kept open: its tunnels carry the calls) and the nodes' specs."""
    directory = WideDirectory(model_id, bootstrap, tls)
    try:
        nodes = directory.lookup(timeout_s, expect)
        if expect is not None and len(nodes) < expect:
            raise StoreError(
                f"the registry gave {len(nodes)} of the {expect} expected nodes of model "
                f"{model_id[:16]} in {timeout_s:g} s"
            )
        if not nodes:
            raise StoreError(f"the registry has no node of model {model_id[:16]} ({timeout_s:g} s)")
    except BaseException:
        directory.close()
        raise
    return directory, [n.spec for n in nodes]


def _read_and_close(sock) -> dict[str, str]:
    """The record on a `/moeshard/record/1` stream (P2PError or OSError if none comes)."""
    try:
        sock.settimeout(RECORD_TIMEOUT_S)
        return read_record(sock)
    finally:
        sock.close()
