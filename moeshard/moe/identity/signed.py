"""Signed records: a node's zeroconf announcement and its Info reply, each signed with the
node's identity key so a coordinator can tell a forged or stale one from the node's own.

Announcement (TXT record): the fields below, `pk` (the raw public key, base64url) and `exp`
(unix seconds after which it is stale), signed over a canonical text of every field but `sig`.
The id in `node_id` must be the hash of `pk`, so a record can only speak for its own key.

Info: the NodeInfo message serialized deterministically with an empty signature, prefixed by
the caller's nonce, so a reply can be neither forged nor replayed from an earlier call.
"""

from __future__ import annotations

import base64
import time

from moeshard.moe.identity.keys import Identity, key_id, verify

ANNOUNCE_PREFIX = b"moeshard-announce-v1\n"
INFO_PREFIX = b"moeshard-info-v1"
ANNOUNCE_TTL_S = 600  # an announcement is valid this long; the node re-signs at half of it
MAX_TTL_S = 3600  # an expiry further ahead than this is refused (a forged "forever" record)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _canonical(fields: dict[str, str]) -> bytes:
    lines = [f"{k}={fields[k]}" for k in sorted(fields) if k != "sig"]
    return ANNOUNCE_PREFIX + "\n".join(lines).encode()


def sign_announcement(
    identity: Identity,
    fields: dict[str, str],
    now: float | None = None,
    ttl_s: int = ANNOUNCE_TTL_S,
):
    """`fields` plus node_id, pk, exp and sig: the TXT record to announce (or the record a
    node serves to the wide-area registry, `moeshard.moe.p2p.registry`), valid `ttl_s`."""
    now = time.time() if now is None else now
    record = dict(fields, node_id=identity.id, pk=_b64(identity.public_raw))
    record["exp"] = str(int(now + ttl_s))
    record["sig"] = _b64(identity.sign(_canonical(record)))
    return record


def check_announcement(record: dict[str, str], now: float | None = None) -> str:
    """'' if the record is the announcing key's own and current, else why it is not."""
    now = time.time() if now is None else now
    if "sig" not in record or "pk" not in record:
        return "unsigned announcement"
    try:
        public_raw, signature = _unb64(record["pk"]), _unb64(record["sig"])
        expires = int(record.get("exp", ""))
    except ValueError:
        return "malformed announcement"
    if key_id(public_raw) != record.get("node_id"):
        return "forged announcement (its id is not its key's)"
    if not verify(public_raw, signature, _canonical(record)):
        return "forged announcement (bad signature)"
    if expires < now:
        return f"expired announcement ({int(now - expires)} s ago)"
    if expires > now + MAX_TTL_S:
        return "announcement valid too far ahead"
    return ""


def info_message(info, nonce: bytes) -> bytes:
    """What an Info reply's signature covers (`info.signature` is ignored)."""
    unsigned = type(info)()
    unsigned.CopyFrom(info)
    unsigned.signature = b""
    return INFO_PREFIX + nonce + unsigned.SerializeToString(deterministic=True)


def sign_info(identity: Identity, info, nonce: bytes) -> None:
    info.public_key = identity.public_raw
    info.signature = identity.sign(info_message(info, nonce))


def check_info(info, nonce: bytes) -> str:
    """'' if the reply is signed by the key its node_id names, for this nonce."""
    if key_id(info.public_key) != info.node_id:
        return f"Info's key is not node {info.node_id}'s"
    if not verify(info.public_key, info.signature, info_message(info, nonce)):
        return "Info's signature does not verify"
    return ""
