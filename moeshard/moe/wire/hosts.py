"""Addresses both ends check: is a host this machine's loopback (where --insecure may go)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 brackets allowed) resolves to loopback."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host.strip("[]"))).is_loopback
    except (OSError, ValueError):
        return False
