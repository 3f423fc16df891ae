"""Advertise a node on the local network with zeroconf (mDNS/DNS-SD).

Service type `_moeshard._tcp.local.`; the instance name is the node's name. TXT records:
  node_id   the id of the node's key (clients pin it: the TLS handshake must present that key)
  name      the node's display name
  pk, exp, sig  the node's public key, the record's expiry and its signature over all fields
            (`moeshard.moe.identity.signed`); unsigned, forged or expired records are ignored
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
import logging
import socket
import threading

from zeroconf import IPVersion, ServiceInfo, Zeroconf

from moeshard.moe.identity.keys import Identity
from moeshard.moe.identity.signed import ANNOUNCE_TTL_S, sign_announcement
from moeshard.moe.wire.constants import SERVICE_TYPE
from moeshard.moe.wire.hosts import advertised_addresses

log = logging.getLogger(__name__)


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


def announcement_fields(name, model_id, format_version, wire_version, held) -> dict[str, str]:
    """What a node says of itself, signed, on the LAN (zeroconf) and in the wide-area registry
    (`node/wide.py`)."""
    return {
        "name": name,
        "model_id": model_id,
        "fmt": str(format_version),
        "wire": str(wire_version),
        **shard_summary(held),
    }


class Announcer:
    """Registers the node's signed service record on start(), re-signs it before it expires
    (every ANNOUNCE_TTL_S / 2), unregisters it on close()."""

    def __init__(
        self,
        key: Identity,
        name: str,
        model_id: str,
        format_version: int,
        wire_version: int,
        held,
        host: str,
        port: int,
    ):
        self.key, self.name, self.host, self.port = key, name, host, port
        self.fields = announcement_fields(name, model_id, format_version, wire_version, held)
        self.info = self._service_info()
        self.zeroconf: Zeroconf | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def _service_info(self) -> ServiceInfo:
        return ServiceInfo(
            SERVICE_TYPE,
            f"{self.name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in advertised_addresses(self.host)],
            port=self.port,
            properties=sign_announcement(self.key, self.fields),
            server=f"{self.name}.local.",
        )

    def start(self) -> None:
        self.zeroconf = Zeroconf(ip_version=IPVersion.V4Only)
        self.zeroconf.register_service(self.info, allow_name_change=True)
        log.info("advertising %s on port %d", self.info.name, self.info.port)
        self._refresher = threading.Thread(target=self._refresh, name="announce", daemon=True)
        self._refresher.start()

    def _refresh(self) -> None:
        while not self._stop.wait(ANNOUNCE_TTL_S / 2):
            fresh = self._service_info()
            fresh.name = self.info.name  # the name zeroconf settled on at registration
            self.zeroconf.update_service(fresh)
            self.info = fresh

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=2)
        if self.zeroconf is not None:
            self.zeroconf.unregister_service(self.info)
            self.zeroconf.close()
            self.zeroconf = None
            log.info("stopped advertising %s", self.info.name)
