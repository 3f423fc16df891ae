"""Addresses both ends use: is a host this machine's loopback (where --insecure may go), and
the addresses a node bound to a host is reached at (its announcement, its `--peers` line)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 brackets allowed) resolves to loopback."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host.strip("[]"))).is_loopback
    except (OSError, ValueError):
        return False


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


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
