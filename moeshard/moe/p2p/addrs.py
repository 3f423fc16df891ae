"""The libp2p names moeshard handles: binary multiaddrs, peer ids in base58, content ids.

Only the address protocols a swarm of moeshard nodes meets (ip4/ip6/dns, tcp/udp, QUIC,
relayed circuits, peer ids, Unix sockets); another protocol code in an address is refused by
name, never guessed at. The codes are the multiformats table's
(github.com/multiformats/multiaddr, protocols.csv).
"""

from __future__ import annotations

import hashlib
import ipaddress

from moeshard.moe.errors import MoeshardError

# code -> (name, size in bytes: 0 none, -1 varint-length-prefixed)
PROTOCOLS = {
    4: ("ip4", 4),
    6: ("tcp", 2),
    41: ("ip6", 16),
    53: ("dns", -1),
    54: ("dns4", -1),
    55: ("dns6", -1),
    273: ("udp", 2),
    290: ("p2p-circuit", 0),
    400: ("unix", -1),
    421: ("p2p", -1),
    460: ("quic", 0),
    461: ("quic-v1", 0),
}
CODES = {name: (code, size) for code, (name, size) in PROTOCOLS.items()}
B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_uvarint(data: bytes, at: int) -> tuple[int, int]:
    """(value, the offset after it) of the unsigned varint at `at`."""
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise MoeshardError("malformed varint in a libp2p message")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        if ch not in B58:
            raise MoeshardError(f"{text!r}: not a base58 peer id")
        n = n * 58 + B58.index(ch)
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def peer_id_text(raw: bytes) -> str:
    return b58encode(raw)


def peer_id_bytes(text: str) -> bytes:
    raw = b58decode(text)
    _, at = read_uvarint(raw, 0)  # a multihash: code, length, digest
    length, at = read_uvarint(raw, at)
    if at + length != len(raw):
        raise MoeshardError(f"{text!r}: not a libp2p peer id")
    return raw


def encode(text: str) -> bytes:
    """'/ip4/1.2.3.4/tcp/5' -> its binary multiaddr."""
    parts = text.split("/")
    if len(parts) < 2 or parts[0]:
        raise MoeshardError(f"{text!r}: a multiaddr starts with '/'")
    out, i = bytearray(), 1
    while i < len(parts):
        name = parts[i]
        if name not in CODES:
            raise MoeshardError(f"{text!r}: unknown multiaddr protocol {name!r}")
        code, size = CODES[name]
        out += uvarint(code)
        if size == 0:
            i += 1
            continue
        if name == "unix":  # the rest of the text is the path
            value = ("/" + "/".join(parts[i + 1 :])).encode()
            out += uvarint(len(value)) + value
            break
        if i + 1 >= len(parts):
            raise MoeshardError(f"{text!r}: {name} needs a value")
        out += _value_bytes(name, parts[i + 1], text)
        i += 2
    return bytes(out)


def _value_bytes(name: str, value: str, text: str) -> bytes:
    try:
        if name in ("ip4", "ip6"):
            return ipaddress.ip_address(value).packed
        if name in ("tcp", "udp"):
            return int(value).to_bytes(2, "big")
    except ValueError:
        raise MoeshardError(f"{text!r}: bad {name} value {value!r}") from None
    raw = peer_id_bytes(value) if name == "p2p" else value.encode()
    return uvarint(len(raw)) + raw


def decode(raw: bytes) -> str:
    """A binary multiaddr -> its text form."""
    out, at = [], 0
    while at < len(raw):
        code, at = read_uvarint(raw, at)
        if code not in PROTOCOLS:
            raise MoeshardError(f"unknown multiaddr protocol code {code}")
        name, size = PROTOCOLS[code]
        out.append(name)
        if size == -1:
            size, at = read_uvarint(raw, at)
        if at + size > len(raw):
            raise MoeshardError("truncated multiaddr")
        value = raw[at : at + size]
        at += size
        if name in ("ip4", "ip6"):
            out.append(str(ipaddress.ip_address(value)))
        elif name in ("tcp", "udp"):
            out.append(str(int.from_bytes(value, "big")))
        elif name == "p2p":
            out.append(peer_id_text(value))
        elif name == "unix":
            out.append(value.decode().lstrip("/"))
        elif size:
            out.append(value.decode())
    return "/" + "/".join(out)


def content_id(key: str) -> bytes:
    """A CIDv1 (raw codec, sha2-256) naming `key`: what the DHT's provider records go under."""
    digest = hashlib.sha256(key.encode()).digest()
    return uvarint(1) + uvarint(0x55) + bytes([0x12, 32]) + digest
