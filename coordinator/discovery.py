"""Find expert nodes on the local network with zeroconf (see node/announce.py for the records)."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field

from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

from moe.store import FORMAT_VERSION
from node.announce import SERVICE_TYPE

log = logging.getLogger(__name__)


@dataclass
class Discovered:
    node_id: str
    addr: str  # host:port to dial
    model_id: str
    format_version: int
    txt: dict = field(default_factory=dict)


def _txt(info) -> dict[str, str]:
    out = {}
    for key, value in (info.properties or {}).items():
        k = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        v = value.decode(errors="replace") if isinstance(value, bytes) else (value or "")
        out[k] = v
    return out


def discover(model_id: str | None, timeout: float = 2.0) -> list[Discovered]:
    """Browse `_moeshard._tcp.local.` for `timeout` seconds; nodes of model `model_id`.

    Nodes advertising another model id or format version are left out with a warning.
    """
    names: set[str] = set()

    def on_change(zeroconf, service_type, name, state_change) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            names.add(name)
        elif state_change is ServiceStateChange.Removed:
            names.discard(name)

    zc = Zeroconf(ip_version=IPVersion.V4Only)
    found: list[Discovered] = []
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        time.sleep(timeout)
        browser.cancel()
        for name in sorted(names):
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=1000)
            if info is None or not info.addresses:
                log.warning("discovery: %s did not resolve; skipped", name)
                continue
            txt = _txt(info)
            node = Discovered(
                node_id=txt.get("node_id", name),
                addr=f"{socket.inet_ntoa(info.addresses[0])}:{info.port}",
                model_id=txt.get("model_id", ""),
                format_version=int(txt.get("fmt", "0") or 0),
                txt=txt,
            )
            if model_id is not None and node.model_id != model_id:
                log.warning(
                    "discovery: ignoring node %s at %s: model id %s differs from %s",
                    node.node_id,
                    node.addr,
                    node.model_id[:16],
                    model_id[:16],
                )
                continue
            if node.format_version != FORMAT_VERSION:
                log.warning(
                    "discovery: ignoring node %s at %s: format version %d, ours is %d",
                    node.node_id,
                    node.addr,
                    node.format_version,
                    FORMAT_VERSION,
                )
                continue
            found.append(node)
    finally:
        zc.close()
    return found
