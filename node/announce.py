"""Advertise a node on the local network with zeroconf (mDNS/DNS-SD).

Service type `_moeshard._tcp.local.`; the instance name is the node's name. TXT records:
  node_id   the id of the node's key (clients pin it: the TLS handshake must present that key)
  name      the node's display name
  model_id  sha256 hex of the model its records belong to
  fmt       shard format version (moe.store.FORMAT_VERSION)
  wire      wire contract version
  records   how many (layer, expert) records it serves
  layers    first-last MoE layer it holds records of
  digest    8 hex digits identifying the exact set of records (changes when it changes)
The full holdings come from the node's Info RPC; TXT stays small (one packet).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket

from zeroconf import IPVersion, ServiceInfo, Zeroconf

from moe.wire.constants import SERVICE_TYPE

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def shard_summary(held) -> dict[str, str]:
    """Compact description of a set of (layer, expert) records for the TXT record."""
    keys = sorted(held)
    layers = sorted({layer for layer, _ in keys})
    digest = hashlib.sha256(";".join(f"{a}.{b}" for a, b in keys).encode()).hexdigest()[:8]
    return {
        "records": str(len(keys)),
        "layers": f"{layers[0]}-{layers[-1]}" if layers else "",
        "digest": digest,
    }


def advertised_addresses(host: str) -> list[str]:
    """The IPv4 addresses to put in the service record for a server bound to `host`."""
    if host not in WILDCARD_HOSTS:
        return [socket.gethostbyname(host)]
    import ifaddr

    addrs = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback:
                addrs.append(ip.ip)
    return addrs or ["127.0.0.1"]


class Announcer:
    """Registers the node's service on start(), unregisters it on close()."""

    def __init__(
        self,
        node_id: str,
        name: str,
        model_id: str,
        format_version: int,
        wire_version: int,
        held,
        host: str,
        port: int,
    ):
        properties = {
            "node_id": node_id,
            "name": name,
            "model_id": model_id,
            "fmt": str(format_version),
            "wire": str(wire_version),
            **shard_summary(held),
        }
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in advertised_addresses(host)],
            port=port,
            properties=properties,
            server=f"{name}.local.",
        )
        self.zeroconf: Zeroconf | None = None

    def start(self) -> None:
        self.zeroconf = Zeroconf(ip_version=IPVersion.V4Only)
        self.zeroconf.register_service(self.info, allow_name_change=True)
        log.info("advertising %s on port %d", self.info.name, self.info.port)

    def close(self) -> None:
        if self.zeroconf is not None:
            self.zeroconf.unregister_service(self.info)
            self.zeroconf.close()
            self.zeroconf = None
            log.info("stopped advertising %s", self.info.name)
