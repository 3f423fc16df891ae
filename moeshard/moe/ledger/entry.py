"""One ledger line: its canonical bytes, the owner's signature over them, and every check
`verify` makes on it.

A line is the canonical JSON of one object (keys sorted, no spaces, ASCII only) and a newline:

    {"body":{...},"by":OWNER_ID,"kind":KIND,"prev":HEX,"seq":N,"sig":B64,"t":UNIX_S}

- seq: 0, 1, 2, ... (the line number minus one).
- prev: hex sha256 of the previous line's bytes without its newline (64 zeros on line 1).
- kind and body:
    open        {"pk": owner's raw public key, "role": "node" | "coordinator"}   (line 1 only)
    receipt     {"pb": a Receipt message, "pk": the signing node's raw public key}
    settlement  {"pb": a Settlement message (it carries the coordinator's key)}
    audit       {"node_id", "session" (hex), "layer", "passed", "detail"}
  bytes are standard base64 with padding.
- by: the owner's key id; sig: the owner's Ed25519 signature over LINE_PREFIX + the canonical
  JSON of the object without "sig".

Every field is read strictly (the exact key set, types, base64 and hex that re-encode to the
same text) and the line must be exactly the canonical encoding of what it parses to, so no
byte of a line can change without the line failing: a changed byte either breaks the JSON,
breaks the canonical form, or changes signed content.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time

from google.protobuf.message import DecodeError

from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity.keys import Identity, key_id, looks_like_id, verify
from moeshard.moe.identity.receipts import check_receipt, check_settlement
from moeshard.moe.wire import moeshard_pb2 as pb

LINE_PREFIX = b"moeshard-ledger-v1\n"
FIELDS = {"body", "by", "kind", "prev", "seq", "sig", "t"}
KINDS = ("open", "receipt", "settlement", "audit")
ROLES = ("node", "coordinator")
GENESIS = "0" * 64  # prev of the first line
MAX_LINE = 1 << 20  # longer lines are refused unread


class LedgerError(MoeshardError):
    """A ledger cannot be opened, appended to, or read."""


class BadEntry(Exception):
    """One line fails a check: `why` says which."""


def canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def line_hash(line: bytes) -> str:
    """The `prev` the next line must carry (`line` without its newline)."""
    return hashlib.sha256(line).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text, what: str) -> bytes:
    """Strict base64: only the one text that encodes these bytes is accepted."""
    try:
        data = base64.b64decode(text, validate=True) if isinstance(text, str) else None
    except (binascii.Error, ValueError):
        data = None
    if data is None or b64(data) != text:
        raise BadEntry(f"{what} is not base64")
    return data


# -- making lines -----------------------------------------------------------------------------


def make_line(identity: Identity, seq: int, prev: str, kind: str, body: dict) -> bytes:
    """The signed line (without its newline)."""
    entry = {
        "body": body,
        "by": identity.id,
        "kind": kind,
        "prev": prev,
        "seq": seq,
        "t": round(time.time(), 3),
    }
    entry["sig"] = b64(identity.sign(LINE_PREFIX + canonical(entry)))
    return canonical(entry)


def open_body(identity: Identity, role: str) -> dict:
    return {"pk": b64(identity.public_raw), "role": role}


def receipt_body(receipt: pb.Receipt, public_key: bytes) -> dict:
    return {"pb": b64(receipt.SerializeToString(deterministic=True)), "pk": b64(public_key)}


def settlement_body(settlement: pb.Settlement) -> dict:
    return {"pb": b64(settlement.SerializeToString(deterministic=True))}


def audit_body(node_id: str, session: bytes, layer: int, passed: bool, detail: str) -> dict:
    return {
        "detail": str(detail)[:500],
        "layer": int(layer),
        "node_id": node_id,
        "passed": bool(passed),
        "session": session.hex(),
    }


# -- checking lines ---------------------------------------------------------------------------


def parse_line(line: bytes) -> dict:
    """The entry a line (without its newline) holds, or BadEntry if it is not a well-formed,
    canonical entry (signatures are not checked here)."""
    try:
        entry = json.loads(line.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise BadEntry("not a JSON entry (a changed byte, or not a ledger)") from None
    if not isinstance(entry, dict) or set(entry) != FIELDS:
        raise BadEntry("not a ledger entry (wrong fields)")
    if canonical(entry) != line:
        raise BadEntry("entry not in canonical form (altered)")
    seq, kind = entry["seq"], entry["kind"]
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise BadEntry("bad seq")
    if kind not in KINDS or not isinstance(entry["body"], dict):
        raise BadEntry(f"unknown kind {str(kind)[:20]!r}")
    if not isinstance(entry["t"], int | float) or isinstance(entry["t"], bool):
        raise BadEntry("bad time")
    prev = entry["prev"]
    if not isinstance(prev, str) or len(prev) != 64 or prev != prev.lower():
        raise BadEntry("bad prev hash")
    return entry


def check_signature(entry: dict, owner_pk: bytes) -> None:
    """BadEntry unless the owner signed `entry`."""
    if entry["by"] != key_id(owner_pk):
        raise BadEntry(f"written by {str(entry['by'])[:26]}, not the ledger's owner")
    signature = unb64(entry["sig"], "sig")
    unsigned = {k: v for k, v in entry.items() if k != "sig"}
    if not verify(owner_pk, signature, LINE_PREFIX + canonical(unsigned)):
        raise BadEntry("owner's signature does not verify")


def check_open(entry: dict) -> tuple[bytes, str]:
    """The owner's public key and role from a ledger's first entry."""
    body = entry["body"]
    if entry["kind"] != "open" or set(body) != {"pk", "role"}:
        raise BadEntry("the first entry must be 'open' (owner's key and role)")
    pk = unb64(body["pk"], "owner key")
    if len(pk) != 32 or body["role"] not in ROLES:
        raise BadEntry("bad owner key or role")
    check_signature(entry, pk)
    return pk, body["role"]


def check_body(entry: dict):
    """The entry's content, checked: a Receipt (its node's signature), a Settlement (the
    coordinator's signature), an audit dict; BadEntry if it does not hold."""
    kind, body = entry["kind"], entry["body"]
    if kind == "open":
        raise BadEntry("a second 'open' entry")
    if kind == "audit":
        return _check_audit(body)
    if set(body) != ({"pb", "pk"} if kind == "receipt" else {"pb"}):
        raise BadEntry(f"bad {kind} body")
    data = unb64(body["pb"], kind)
    message = pb.Receipt() if kind == "receipt" else pb.Settlement()
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise BadEntry(f"{kind} is not a {type(message).__name__} message") from None
    if kind == "receipt":
        why = check_receipt(message, unb64(body["pk"], "node key"))
    else:
        why = check_settlement(message)
    if why:
        raise BadEntry(why)
    return message


def _check_audit(body: dict) -> dict:
    if set(body) != {"detail", "layer", "node_id", "passed", "session"}:
        raise BadEntry("bad audit body")
    ok = (
        isinstance(body["node_id"], str)
        and looks_like_id(body["node_id"])
        and isinstance(body["passed"], bool)
        and isinstance(body["layer"], int)
        and isinstance(body["detail"], str)
        and isinstance(body["session"], str)
    )
    if not ok:
        raise BadEntry("bad audit body")
    try:
        session = bytes.fromhex(body["session"])
    except ValueError:
        session = None
    if session is None or session.hex() != body["session"]:
        raise BadEntry("bad audit session")
    return body
