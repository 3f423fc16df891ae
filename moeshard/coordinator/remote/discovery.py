"""Find expert nodes on the local network with zeroconf (see node/announce.py for the records).

Nodes are keyed by the id their signed announcement proves, not by instance name: every
address heard under the names carrying a node's announcement is tried, in parallel, until one
passes the pin check (a TLS 1.3 handshake showing the node's key), so an announcement replayed
from elsewhere cannot hide the node. The records themselves: discovery_records.py.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

from moeshard.coordinator.remote.discovery_records import (
    MAX_NAMES,
    MAX_PER_NAME,
    WARNINGS,
    NodeRecords,
    Records,
)
from moeshard.coordinator.remote.transport import PeerSpec, parse_peers
from moeshard.moe.errors import MoeshardError, StoreError
from moeshard.moe.identity.keys import Identity
from moeshard.moe.identity.tls import TLSMaterial, client_tls, fetch_node_identity
from moeshard.moe.storage.manifest import FORMAT_VERSION
from moeshard.moe.wire.constants import SERVICE_TYPE
from moeshard.moe.wire.names import safe_node_name

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a browse looks at what it has heard (it also wakes on new records)
PIN_TIMEOUT_S = 1.0  # one pin check's TCP connect and TLS handshake
PIN_WORKERS = 8  # pin checks in flight at once
PIN_RETRY_S = 0.5  # a failed pin check is tried again after this, doubled per failure...
PIN_RETRY_MAX_S = 30.0  # ...up to this
MAX_CHECKS = 4 * MAX_NAMES * MAX_PER_NAME  # (id, address) pin results remembered
WATCH_S = 0.5  # a watcher's look at pin checks under way
WATCH_RESOLVE_S = 3.0  # how long a watcher queries a new name's records


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


def _pin_ok(tls: TLSMaterial, node_id: str, ip: str, port: int, timeout: float) -> bool:
    """Whether the TLS server at ip:port holds the key of `node_id` (a TLS 1.3 handshake)."""
    try:
        return fetch_node_identity(ip, port, tls, timeout)[0] == node_id
    except (OSError, ssl.SSLError, MoeshardError) as exc:
        log.debug("discovery: %s at %s:%d failed the pin check: %s", node_id, ip, port, exc)
        return False


@dataclass
class PinCheck:
    """One (id, address) pin check: the one under way or done, and when a failed one may be
    tried again."""

    future: Future
    failures: int = 0  # checks of this address that failed before this one
    done_at: float | None = None  # when this one was seen to fail

    def retry_due(self, now: float) -> bool:
        """A failed check is tried again after PIN_RETRY_S, doubled per failure (to
        PIN_RETRY_MAX_S): a node's first handshake can time out on a loaded box, or the node
        may not listen yet, and a watcher that never asked again would never admit it."""
        if self.done_at is None:
            return False
        return now - self.done_at >= min(PIN_RETRY_S * 2**self.failures, PIN_RETRY_MAX_S)


class Pins:
    """Which of a node id's announced addresses hold its key. Each (id, address) is checked
    in parallel (a bounded pool), a failed one again later with back-off, so a replayed
    announcement pointing elsewhere costs a refused handshake now and then and cannot hide
    the node. Without `tls` (plaintext) nothing can be checked: the best-ranked address is
    taken as it is."""

    def __init__(self, tls: TLSMaterial | None, timeout: float = PIN_TIMEOUT_S):
        self.tls, self.timeout = tls, timeout
        self.pool = ThreadPoolExecutor(PIN_WORKERS, thread_name_prefix="pin-check")
        self.checks: OrderedDict[tuple[str, str, int], PinCheck] = OrderedDict()
        self.in_flight: set[Future] = set()

    def address(self, node: NodeRecords) -> tuple[str, int] | None:
        """The first of `node`'s addresses (in their order) that passed; starts the checks
        of those not yet checked (or due again); None while none has passed."""
        if self.tls is None:
            return node.endpoints[0] if node.endpoints else None
        now = time.monotonic()
        for ip, port in node.endpoints:
            key = (node.node_id, ip, port)
            check = self.checks.get(key)
            if check is not None and check.future.done() and not check.future.result():
                if check.done_at is None:
                    check.done_at = now
                if not check.retry_due(now) or self.busy():
                    continue  # (a retry waits for a free worker: first checks go first)
                check = PinCheck(self._submit(key), check.failures + 1)
                self.checks[key] = check
            elif check is None:
                self.checks[key] = PinCheck(self._submit(key))
                while len(self.checks) > MAX_CHECKS:
                    self.checks.popitem(last=False)
        for ip, port in node.endpoints:
            check = self.checks.get((node.node_id, ip, port))
            if check is not None and check.future.done() and check.future.result():
                return ip, port
        return None

    def _submit(self, key: tuple[str, str, int]) -> Future:
        node_id, ip, port = key
        future = self.pool.submit(_pin_ok, self.tls, node_id, ip, port, self.timeout)
        self.in_flight.add(future)
        return future

    def busy(self) -> bool:
        """Every worker has a check (so retries, which could otherwise queue without bound
        when many announced addresses never answer, wait)."""
        self.in_flight = {f for f in self.in_flight if not f.done()}
        return len(self.in_flight) >= PIN_WORKERS

    def pending(self) -> bool:
        return any(not c.future.done() for c in self.checks.values())

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Discovery:
    """A zeroconf browser feeding `Records`, and `Pins` to check what it hears: the part
    `browse` and `Watcher` share. `found()`: node id -> Discovered, for the nodes of
    `model_id` (all: None) whose key answered at one of their announced addresses."""

    def __init__(self, model_id: str | None, tls: TLSMaterial | None, resolve_s: float):
        self.model_id, self.resolve_s = model_id, resolve_s
        self.zc = Zeroconf(ip_version=IPVersion.V4Only)
        self.records = Records(self.zc)
        self.pins = Pins(tls)
        self.networks = local_networks()
        self.browser = ServiceBrowser(self.zc, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type, name, state_change) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            if not self.records.track(name, self.resolve_s):
                WARNINGS.warn(
                    "", "full", "discovery: tracking %d names already; more are ignored", MAX_NAMES
                )
        elif state_change is ServiceStateChange.Removed:
            self.records.forget(name)

    def found(self) -> dict[str, Discovered]:
        out = {}
        nodes = self.records.nodes(lambda ip: address_rank(ip, self.networks))
        for node_id, node in nodes.items():
            if not self._wanted(node):
                continue
            endpoint = self.pins.address(node)
            if endpoint is not None:
                out[node_id] = _discovered(node, f"{endpoint[0]}:{endpoint[1]}")
        return out

    def _wanted(self, node: NodeRecords) -> bool:
        """Of this model and format; else False with one warning per name and reason."""
        f, name = node.fields, node.names[0]
        model, fmt = f.get("model_id", ""), f.get("fmt", "0")
        if self.model_id is not None and model != self.model_id:
            why = f"model id {model[:16]} differs from {self.model_id[:16]}"
        elif fmt != str(FORMAT_VERSION):
            why = f"format version {fmt}, ours is {FORMAT_VERSION}"
        else:
            return True
        display = f.get("name", name)
        WARNINGS.warn(
            name,
            why.split(" ")[0],
            "discovery: ignoring node %s (%s): %s",
            display,
            node.node_id,
            why,
        )
        return False

    def close(self) -> None:
        self.browser.cancel()
        self.pins.close()
        self.records.close()
        self.zc.close()


def _discovered(node: NodeRecords, addr: str) -> Discovered:
    f = node.fields
    try:
        fmt = int(f.get("fmt", "0") or 0)
    except ValueError:
        fmt = 0
    return Discovered(
        node_id=node.node_id,
        addr=addr,
        name=safe_node_name(f.get("name", node.names[0].removesuffix("." + SERVICE_TYPE))),
        model_id=f.get("model_id", ""),
        format_version=fmt,
        txt=f,
    )


def browse(
    model_id: str | None,
    timeout: float = 2.0,
    expect: int | None = None,
    settle: bool = False,
    max_s: float | None = None,
    tls: TLSMaterial | None = None,
) -> list[Discovered]:
    """Nodes of model `model_id` (all models: None) announced on `_moeshard._tcp.local.`,
    one per node id, each at an announced address where its key answered the pin check
    (with `tls`; without, the best-ranked address, unchecked).

    Names are resolved in parallel as they appear, within the browse. Browses for `timeout`
    seconds; with `settle`, on until `timeout` passes without a new node; with `expect`,
    until that many nodes are found. Never longer than `max_s` (default: 10 x `timeout`, at
    least 5 s), plus at most PIN_TIMEOUT_S for pin checks under way at the end. Nodes of
    another model or format, and bad records, are left out with a warning.
    """
    max_s = max(10 * timeout, 5.0) if max_s is None else max_s
    start = time.monotonic()
    d = Discovery(model_id, tls, resolve_s=max(timeout, 0.1))
    found: dict[str, Discovered] = {}
    try:
        last_new = start
        while True:
            d.records.changed.wait(POLL_S)
            d.records.changed.clear()
            now = time.monotonic()
            current = d.found()
            if set(current) - set(found):
                last_new = now
            found = current
            if expect is not None and len(found) >= expect:
                break
            if now - start >= max_s:
                break
            if now - start >= timeout and expect is None:
                if not settle or now - last_new >= timeout:
                    break
        end = time.monotonic() + PIN_TIMEOUT_S  # checks under way: let them finish
        while d.pins.pending() and time.monotonic() < end:
            time.sleep(POLL_S / 4)
        found = d.found()
        silent = d.records.silent()
        if silent:
            log.warning(
                "discovery: %d service names did not resolve in %.1f s (e.g. %s); skipped",
                len(silent),
                time.monotonic() - start,
                ", ".join(silent[:3]),
            )
        if d.records.dropped:
            log.warning(
                "discovery: %d more names ignored (%d tracked)", d.records.dropped, MAX_NAMES
            )
    finally:
        d.close()
    return sorted(found.values(), key=lambda n: (n.name, n.node_id))


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


class Watcher:
    """Keeps browsing after start-up and hands every node of `model_id` that is announced
    (or found at a new address) to `on_node`, so nodes that join a running generation are
    used. One worker thread wakes on new records (or every WATCH_S for pin checks under way)
    and calls `on_node` (which may block on an RPC); each (id, address) is handed over once."""

    def __init__(
        self,
        model_id: str,
        on_node: Callable[[Discovered], None],
        tls: TLSMaterial | None = None,
    ):
        self.model_id, self.on_node = model_id, on_node
        self._d = Discovery(model_id, tls, resolve_s=WATCH_RESOLVE_S)
        self._stop = threading.Event()
        self._handed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._worker = threading.Thread(target=self._run, name="node-watcher", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._d.records.changed.wait(WATCH_S)
            self._d.records.changed.clear()
            try:
                for node in self._d.found().values():
                    if self._stop.is_set() or (node.node_id, node.addr) in self._handed:
                        continue
                    self._handed[(node.node_id, node.addr)] = None
                    while len(self._handed) > MAX_CHECKS:
                        self._handed.popitem(last=False)
                    self.on_node(node)
            except Exception:  # a bad announcement must not end the watch
                log.exception("discovery: handling a discovered node failed")

    def close(self) -> None:
        self._stop.set()
        self._d.records.changed.set()
        self._worker.join(timeout=5)
        self._d.close()


def resolve_peers(
    model_id: str,
    peers: str | None,
    discover: bool,
    discover_timeout: float = 2.0,
    insecure: bool = False,
    expect: int | None = None,
    settle: bool = False,
    identity: Identity | None = None,
) -> list[PeerSpec]:
    """The expert nodes to use: `--peers ID@HOST:PORT,...`, or zeroconf's announcements (each
    node pinned by the id it announces, at an address where `identity`'s TLS handshake met
    that key; `expect`/`settle`: see `browse`)."""
    if peers:
        return parse_peers(peers, insecure)
    if discover:
        tls = None if insecure or identity is None else client_tls(identity)
        nodes = browse(model_id, discover_timeout, expect, settle, tls=tls)
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
