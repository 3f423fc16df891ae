"""Receipts of work and settlements: what a node says it computed, and what a coordinator
agrees it owes for, each signed in the style of moe/identity/signed.py (a domain prefix, then
the protobuf message serialized deterministically with its signature field empty).

Receipt (signed by the node, one per Forward that carried a session): session, request id,
layer, the distinct experts computed, the rows, the expert-record bytes used, and two hashes
that tie it to the exact call: `input_sha256(request)` and sha256 of the reply's out.data as
sent. A Receipt carries no public key: whoever checks it needs the node's key (from the
node's signed Info, or the ledger entry that stores it) and checks that the key's id is the
receipt's node_id.

Settlement (signed by the coordinator): its cumulative totals for one node in one session,
and `receipts_sha256`, a hash chain over the receipts it accepted from that node, in order
(`chain_step`). The coordinator's key travels in the message.

Signing costs one Ed25519 signature (about 50 us); checking one about 120 us. A coordinator
checks receipts off its token path (coordinator/remote/accounts.py), or at `ledger verify`.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from moeshard.moe.identity.keys import Identity, key_id, verify
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb

RECEIPT_PREFIX = b"moeshard-receipt-v1"
SETTLEMENT_PREFIX = b"moeshard-settlement-v1"
INPUT_PREFIX = b"moeshard-input-v2"  # v1 hashed only the tensors' data
SESSION_BYTES = 16  # a coordinator's session id: random bytes
MAX_RECEIPT_BYTES = 16 << 10  # larger ones are refused unread (unknown fields, garbage)
MAX_SETTLEMENT_BYTES = 1 << 10
CHAIN_START = bytes(32)  # receipts_sha256 of a session with no receipts yet


def input_sha256(request: pb.ForwardRequest) -> bytes:
    """sha256 over everything a reply depends on: the model id, the layer, the reply's dtype
    and the hidden, ids and weights tensors (each its dtype, its shape and its data). Every
    field is preceded by its length as an 8-byte big-endian integer, so no two requests share
    the bytes hashed: a signed receipt then names exactly one computation, and a fraud proof
    (`moeshard.moe.identity.fraud`) cannot be made of the node's signature over another request with
    the same data read another way (other rows, another dtype, another reply dtype)."""
    h = hashlib.sha256(INPUT_PREFIX)

    def field(data: bytes) -> None:
        h.update(struct.pack(">Q", len(data)))
        h.update(data)

    field(request.model_id.encode())
    field(struct.pack(">II", request.layer, request.out_dtype or request.hidden.dtype))
    for tensor in (request.hidden, request.ids, request.weights):
        field(struct.pack(f">I{len(tensor.shape)}q", tensor.dtype, *tensor.shape))
        field(tensor.data)
    return h.digest()


def _unsigned_bytes(message) -> bytes:
    unsigned = type(message)()
    unsigned.CopyFrom(message)
    unsigned.signature = b""
    return unsigned.SerializeToString(deterministic=True)


def receipt_message(receipt: pb.Receipt) -> bytes:
    """What a receipt's signature covers."""
    return RECEIPT_PREFIX + _unsigned_bytes(receipt)


def settlement_message(settlement: pb.Settlement) -> bytes:
    """What a settlement's signature covers."""
    return SETTLEMENT_PREFIX + _unsigned_bytes(settlement)


def make_receipt(
    identity: Identity,
    model_id: str,
    request: pb.ForwardRequest,
    out_data: bytes,
    experts,
    rows: int,
    expert_bytes: int,
    arithmetic: int,
) -> pb.Receipt:
    """The node's signed receipt for `request`, whose reply carries `out_data` (out.data),
    computed with the kernels' `arithmetic` (`moeshard.moe.kernels.build.ARITHMETIC`)."""
    receipt = pb.Receipt(
        session=request.session,
        request_id=request.request_id,
        layer=request.layer,
        experts=[int(e) for e in experts],
        rows=int(rows),
        expert_bytes=int(expert_bytes),
        input_sha256=input_sha256(request),
        output_sha256=hashlib.sha256(out_data).digest(),
        node_id=identity.id,
        model_id=model_id,
        arithmetic=int(arithmetic),
    )  # signature empty: serialized as it is, this is what the signature covers
    receipt.signature = identity.sign(
        RECEIPT_PREFIX + receipt.SerializeToString(deterministic=True)
    )
    return receipt


def check_receipt(
    receipt: pb.Receipt,
    public_key: bytes,
    expected_node_id: str | None = None,
    model_id: str | None = None,
    signature: bool = True,
) -> str:
    """'' if `receipt` is signed by `public_key` and that key is its node_id's (and the node
    and model are the expected ones, when given), else why not. signature=False skips the
    Ed25519 check (about 0.2 ms), for a caller that got the receipt over a channel already
    authenticated as that node."""
    if receipt.ByteSize() > MAX_RECEIPT_BYTES:
        return f"receipt of {receipt.ByteSize()} bytes (at most {MAX_RECEIPT_BYTES})"
    if key_id(public_key) != receipt.node_id:
        return f"receipt names node {receipt.node_id or '(none)'}, not its key's"
    if expected_node_id is not None and receipt.node_id != expected_node_id:
        return f"receipt from node {receipt.node_id}, expected {expected_node_id}"
    if model_id is not None and receipt.model_id != model_id:
        return f"receipt for model {receipt.model_id[:16] or '(none)'}, not {model_id[:16]}"
    if signature and not verify(public_key, receipt.signature, receipt_message(receipt)):
        return "receipt's signature does not verify"
    return ""


def receipt_mismatch(
    receipt: pb.Receipt,
    request: pb.ForwardRequest,
    out_data: bytes,
    record_nbytes: int = 0,
    arithmetic: int | None = None,
) -> str:
    """'' if a (signature-checked) receipt describes this request and this reply's data, else
    the first field that does not: what the caller sent is the truth here. `record_nbytes` >
    0 also checks expert_bytes (distinct experts x record size); `arithmetic` the arithmetic
    the receipt must name (the one the node was admitted with)."""
    if receipt.session != request.session:
        return "receipt for another session"
    if receipt.request_id != request.request_id or receipt.layer != request.layer:
        return f"receipt for request {receipt.request_id} layer {receipt.layer}"
    if receipt.input_sha256 != input_sha256(request):
        return "receipt's input hash is not the request's"
    if receipt.output_sha256 != hashlib.sha256(out_data).digest():
        return "receipt's output hash is not the reply's"
    try:
        ids = codec.decode(request.ids, "ids", (codec.I32,), (None, None))  # [T, k]
    except codec.CodecError as exc:
        return str(exc)
    experts = np.unique(ids[ids >= 0]).tolist()  # ascending
    if list(receipt.experts) != experts:
        return (
            f"receipt claims experts {list(receipt.experts)[:8]}, the request routed {experts[:8]}"
        )
    rows = int((ids >= 0).any(axis=1).sum())
    if receipt.rows != rows:
        return f"receipt claims {receipt.rows} rows, the request has {rows} routed rows"
    if record_nbytes and receipt.expert_bytes != len(experts) * record_nbytes:
        return f"receipt claims {receipt.expert_bytes} expert bytes, not {len(experts)} records"
    if arithmetic is not None and receipt.arithmetic != arithmetic:
        return f"receipt names arithmetic {receipt.arithmetic}, not the admitted {arithmetic}"
    return ""


def chain_step(chain: bytes, receipt: pb.Receipt) -> bytes:
    """receipts_sha256 after one more receipt: sha256(chain || sha256(receipt serialized
    deterministically, signature included))."""
    digest = hashlib.sha256(receipt.SerializeToString(deterministic=True)).digest()
    return hashlib.sha256(chain + digest).digest()


@dataclass
class Totals:
    """Cumulative work of one node in one session, as a settlement states it."""

    calls: int = 0
    rows: int = 0
    expert_bytes: int = 0
    audits_passed: int = 0
    audits_failed: int = 0
    chain: bytes = field(default=CHAIN_START, repr=False)  # receipts_sha256

    def add(self, receipt: pb.Receipt) -> None:
        self.calls += 1
        self.rows += receipt.rows
        self.expert_bytes += receipt.expert_bytes
        self.chain = chain_step(self.chain, receipt)

    def audit(self, passed: bool) -> None:
        if passed:
            self.audits_passed += 1
        else:
            self.audits_failed += 1

    @classmethod
    def of(cls, settlement: pb.Settlement) -> Totals:
        s = settlement
        return cls(
            s.calls, s.rows, s.expert_bytes, s.audits_passed, s.audits_failed, s.receipts_sha256
        )


def make_settlement(
    identity: Identity,
    session: bytes,
    node_id: str,
    model_id: str,
    seq: int,
    totals: Totals,
    now: float | None = None,
) -> pb.Settlement:
    """The coordinator's signed statement of `totals` for `node_id` in `session`."""
    settlement = pb.Settlement(
        session=session,
        coordinator_id=identity.id,
        coordinator_key=identity.public_raw,
        node_id=node_id,
        model_id=model_id,
        seq=seq,
        calls=totals.calls,
        rows=totals.rows,
        expert_bytes=totals.expert_bytes,
        audits_passed=totals.audits_passed,
        audits_failed=totals.audits_failed,
        receipts_sha256=totals.chain,
        unix_ms=int((time.time() if now is None else now) * 1000),
    )
    settlement.signature = identity.sign(
        SETTLEMENT_PREFIX + settlement.SerializeToString(deterministic=True)
    )
    return settlement


def check_settlement(
    settlement: pb.Settlement,
    expected_node_id: str | None = None,
    model_id: str | None = None,
) -> str:
    """'' if `settlement` is signed by the key it carries and that key is its coordinator_id's
    (and it is for the expected node and model, when given), else why not."""
    s = settlement
    if s.ByteSize() > MAX_SETTLEMENT_BYTES:
        return f"settlement of {s.ByteSize()} bytes (at most {MAX_SETTLEMENT_BYTES})"
    if len(s.session) != SESSION_BYTES:
        return f"settlement's session is {len(s.session)} bytes, not {SESSION_BYTES}"
    if key_id(s.coordinator_key) != s.coordinator_id:
        return f"settlement names coordinator {s.coordinator_id or '(none)'}, not its key's"
    if expected_node_id is not None and s.node_id != expected_node_id:
        return f"settlement for node {s.node_id or '(none)'}, not this node {expected_node_id}"
    if model_id is not None and s.model_id != model_id:
        return f"settlement for model {s.model_id[:16] or '(none)'}, not {model_id[:16]}"
    if not verify(s.coordinator_key, s.signature, settlement_message(s)):
        return "settlement's signature does not verify"
    return ""
