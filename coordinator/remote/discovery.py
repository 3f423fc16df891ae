"""Find expert nodes on the local network with zeroconf (see node/announce.py for the records)."""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

from coordinator.remote.transport import PeerSpec, parse_peers
from moe.errors import StoreError
from moe.identity.signed import check_announcement
from moe.storage.manifest import FORMAT_VERSION
from moe.wire.constants import SERVICE_TYPE

log = logging.getLogger(__name__)


@dataclass
class Discovered:
    node_id: str  # the id of the node's key, as announced (the TLS handshake must match it)
    addr: str  # host:port to dial
    name: str  # the node's display name
    model_id: str
    format_version: int
    txt: dict = field(default_factory=dict)

    @property
    def spec(self) -> PeerSpec:
        return PeerSpec(self.addr, self.node_id)


def _txt(info) -> dict[str, str]:
    out = {}
    for key, value in (info.properties or {}).items():
        k = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        v = value.decode(errors="replace") if isinstance(value, bytes) else (value or "")
        out[k] = v
    return out


def browse(
    model_id: str | None,
    timeout: float = 2.0,
    expect: int | None = None,
    settle: bool = False,
    max_s: float | None = None,
) -> list[Discovered]:
    """Nodes of model `model_id` (all models: None) announced on `_moeshard._tcp.local.`.

    Browses for `timeout` seconds; with `settle`, then on until a further `timeout` finds no
    new node; with `expect`, until that many nodes of the model are found. Never longer than
    `max_s` (default: 10 x `timeout`, at least 5 s). Nodes of another model or format, and bad
    records, are left out with a warning.
    """
    max_s = max(10 * timeout, 5.0) if max_s is None else max_s
    names: set[str] = set()

    def on_change(zeroconf, service_type, name, state_change) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            names.add(name)
        elif state_change is ServiceStateChange.Removed:
            names.discard(name)

    zc = Zeroconf(ip_version=IPVersion.V4Only)
    found: dict[str, Discovered] = {}
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        start = time.monotonic()
        time.sleep(timeout)
        while True:
            before = len(found)
            for name in sorted(names - set(found)):
                node = _resolve(zc, name, model_id)
                if node is not None:
                    found[name] = node
            enough = expect is not None and len(found) >= expect
            quiet = settle and expect is None and len(found) == before
            waited = time.monotonic() - start
            if enough or quiet or (not settle and expect is None) or waited >= max_s:
                break
            time.sleep(min(timeout, max(max_s - waited, 0.0)))
        browser.cancel()
    finally:
        zc.close()
    return [found[name] for name in sorted(found)]


def best_address(addresses: list[str]) -> str:
    """The address of a node's record to dial. A node bound to every interface announces
    them all (its LAN address, but also e.g. Docker's bridge, 172.17.0.1, which only its own
    host can reach), and the records do not keep the node's order. Prefer an address on a
    network one of this machine's interfaces is on and up, then one on a network of an
    interface that is down, then the rest; the record's order breaks ties."""
    networks = local_networks()
    return min(addresses, key=lambda a: address_rank(a, networks))


def address_rank(addr: str, networks) -> int:
    """0: on a network of an interface that is up here; 1: of one that is down; 2: neither."""
    ip = ipaddress.ip_address(addr)
    states = [up for net, up in networks if ip in net]
    return 0 if any(states) else 1 if states else 2


def local_networks() -> list[tuple[ipaddress.IPv4Network, bool]]:
    """(network, whether its interface is up) of this machine's IPv4 addresses."""
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        try:
            state = Path(f"/sys/class/net/{adapter.name}/operstate").read_text().strip()
        except OSError:
            state = "unknown"  # not Linux, or no such entry: count it as up
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                net = ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}", strict=False)
                out.append((net, state != "down"))
    return out


def _resolve(zc: Zeroconf, name: str, model_id: str | None) -> Discovered | None:
    """The node behind a service name, or None (logged) if it does not resolve or serves
    another model or format version."""
    info = zc.get_service_info(SERVICE_TYPE, name, timeout=1000)
    if info is None or not info.addresses:
        log.warning("discovery: %s did not resolve; skipped", name)
        return None
    txt = _txt(info)
    why = check_announcement(txt)
    if why:
        _warn_once(name, why)
        return None
    node = Discovered(
        node_id=txt.get("node_id", ""),
        addr=f"{best_address([socket.inet_ntoa(a) for a in info.addresses])}:{info.port}",
        name=txt.get("name", name.removesuffix("." + SERVICE_TYPE)),
        model_id=txt.get("model_id", ""),
        format_version=int(txt.get("fmt", "0") or 0),
        txt=txt,
    )
    if model_id is not None and node.model_id != model_id:
        log.warning(
            "discovery: ignoring node %s (%s) at %s: model id %s differs from %s",
            node.name,
            node.node_id,
            node.addr,
            node.model_id[:16],
            model_id[:16],
        )
        return None
    if node.format_version != FORMAT_VERSION:
        log.warning(
            "discovery: ignoring node %s (%s) at %s: format version %d, ours is %d",
            node.name,
            node.node_id,
            node.addr,
            node.format_version,
            FORMAT_VERSION,
        )
        return None
    return node


_warned: set[tuple[str, str]] = set()


def _warn_once(name: str, why: str) -> None:
    """One warning per service name and kind of reason (browses repeat, and so do records)."""
    kind = why.split(" (")[0]
    if (name, kind) not in _warned:
        _warned.add((name, kind))
        log.warning("discovery: ignoring %s: %s", name, why)


class Watcher:
    """Keeps browsing after start-up and hands every node of `model_id` that is announced
    (or re-announced) to `on_node`, so nodes that join a running generation are used.

    zeroconf calls its handlers on its own thread, which must not block, so names are queued
    and one worker thread resolves them and calls `on_node` (which may block on an RPC).
    """

    def __init__(self, model_id: str, on_node: Callable[[Discovered], None]):
        self.model_id, self.on_node = model_id, on_node
        self._names: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._zc = Zeroconf(ip_version=IPVersion.V4Only)
        self._worker = threading.Thread(target=self._run, name="node-watcher", daemon=True)
        self._worker.start()
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type, name, state_change) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            self._names.put(name)

    def _run(self) -> None:
        while (name := self._names.get()) is not None:
            try:
                node = _resolve(self._zc, name, self.model_id)
                if node is not None:
                    self.on_node(node)
            except Exception:  # a bad announcement must not end the watch
                log.exception("discovery: handling %s failed", name)

    def close(self) -> None:
        self._browser.cancel()
        self._names.put(None)
        self._worker.join(timeout=5)
        self._zc.close()


def resolve_peers(
    model_id: str,
    peers: str | None,
    discover: bool,
    discover_timeout: float = 2.0,
    insecure: bool = False,
    expect: int | None = None,
    settle: bool = False,
) -> list[PeerSpec]:
    """The expert nodes to use: `--peers ID@HOST:PORT,...`, or zeroconf's announcements (each
    node pinned by the id it announces; `expect`/`settle`: see `browse`)."""
    if peers:
        return parse_peers(peers, insecure)
    if discover:
        nodes = browse(model_id, discover_timeout, expect, settle)
        if expect is not None and len(nodes) < expect:
            raise StoreError(
                f"zeroconf found {len(nodes)} of the {expect} expected nodes of model "
                f"{model_id[:16]}"
            )
        specs = [n.spec for n in nodes]
        if not specs:
            raise StoreError(
                f"zeroconf found no node serving model {model_id[:16]} in {discover_timeout} s"
            )
        return specs
    raise StoreError("no expert nodes: give --peers or --discover")
