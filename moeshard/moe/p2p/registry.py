"""The wide-area registry: how nodes behind NATs are found by a model id alone.

A node joins the DHT of the swarm's bootstrap peers and, every REANNOUNCE_S, adds a provider
record under the model's registry key (`registry_key`) and re-signs its own record, valid
RECORD_TTL_S. The DHT says only which peers claim the key; what each one is comes from the
peer itself, over a stream of RECORD_PROTOCOL: its signed record (the zeroconf announcement's
fields and signature, `moeshard.moe.identity.signed`, plus `p2p`, the peer id it serves from,
and `addrs`, its direct and relayed addresses). A reader keeps a record only if it is signed by
the key its node id names, current, for the model it wants, and served by the peer it names
(`check_record`): a forged, expired, foreign-model or replayed record is ignored. The expert
calls then go over GRPC_PROTOCOL streams with the node's TLS inside.
"""

from __future__ import annotations

import json
import socket

from moeshard.moe.identity.signed import check_announcement
from moeshard.moe.p2p import addrs
from moeshard.moe.p2p.control import P2PError

REGISTRY_PREFIX = "moeshard/registry/1/"
RECORD_PROTOCOL = "/moeshard/record/1"
GRPC_PROTOCOL = "/moeshard/grpc/1"
RECORD_TTL_S = 120  # a record is valid this long ...
REANNOUNCE_S = 60  # ... and re-signed and re-provided this often (hivemind's 60 s and 120 s)
MAX_RECORD = 16 << 10  # bytes: a record is a few hundred


def registry_key(model_id: str) -> str:
    return REGISTRY_PREFIX + model_id


def write_record(sock: socket.socket, record: dict[str, str]) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    sock.sendall(addrs.uvarint(len(data)) + data)


def read_record(sock: socket.socket) -> dict[str, str]:
    """One length-prefixed JSON record of strings from `sock` (at most MAX_RECORD bytes)."""
    head = b""
    while not head or head[-1] & 0x80:
        byte = sock.recv(1)
        if not byte or len(head) > 4:
            raise P2PError("no record from the peer")
        head += byte
    length, _ = addrs.read_uvarint(head, 0)
    if length > MAX_RECORD:
        raise P2PError(f"a {length}-byte record (at most {MAX_RECORD})")
    data = b""
    while len(data) < length:
        chunk = sock.recv(length - len(data))
        if not chunk:
            raise P2PError("the record was cut short")
        data += chunk
    try:
        record = json.loads(data)
    except ValueError:
        raise P2PError("the record is not JSON") from None
    if not isinstance(record, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in record.items()
    ):
        raise P2PError("the record is not a map of strings")
    return record


def check_record(
    record: dict[str, str], model_id: str, peer_id: str, now: float | None = None
) -> str:
    """'' if `record` may be used: the announcing key's own, current, for `model_id`, and
    naming as its peer the one that served it (a copy replayed by another peer is not)."""
    why = check_announcement(record, now)
    if why:
        return why
    if record.get("model_id") != model_id:
        return f"a record for another model ({record.get('model_id', '')[:16]})"
    if record.get("p2p") != peer_id:
        return "a record of another peer (replayed)"
    return ""
