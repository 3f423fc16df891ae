"""Fetching an expert record from a node (rpc Record), checked against the model's Merkle root.

A coordinator that recomputes a node's Forward call itself needs the records the call used; it
does not store them, so it fetches each from any holder into a buffer of its own and checks
every byte against the record's root in the model's `merkle.bin` (which the model id covers):
a node cannot hand over weights other than the model's. The stream is checked as it comes
(consecutive offsets from 0, the record's length in every chunk, never a byte past it: the
call is cancelled at the first chunk that breaks a rule) and the call's gRPC deadline covers
the whole stream, so a node that trickles bytes or never stops cannot hold the caller past it.

`FetchError.evidence` tells a node that sent what is provably not the record (an honest node
never does) from a transfer that failed (`code` names the status: the caller decides what a
NOT_FOUND or DATA_LOSS for a record the node advertises means).
"""

from __future__ import annotations

import grpc
import numpy as np

from moeshard.coordinator.remote.possession import DEADLINE_BASE_S, READ_RATE
from moeshard.moe.storage import merkle
from moeshard.moe.wire import moeshard_pb2 as pb

# Bytes per second the link to a node must carry a record at (100 Mbit/s): with the node's read
# of the record at possession.READ_RATE, what the default deadline allows. A late record is
# not evidence, only a failed fetch, so the rate is set for slow links rather than loopback.
NET_RATE = 12.5e6


class FetchError(Exception):
    """A record not fetched. `why`: one line; `code`: the gRPC status name when the call failed
    ("" when the node's stream broke a rule); `evidence`: the node sent bytes that are provably
    not the record (wrong root, length or offsets)."""

    def __init__(self, why: str, code: str = "", evidence: bool = False):
        super().__init__(why)
        self.why, self.code, self.evidence = why, code, evidence


def default_deadline_s(record_nbytes: int, rtt_s: float = 0.0) -> float:
    """How long a node may take to send a record of `record_nbytes` bytes: the call's fixed
    costs, the round trip, reading the record (READ_RATE, as for a possession challenge) and
    sending it (NET_RATE)."""
    return DEADLINE_BASE_S + rtt_s + record_nbytes / READ_RATE + record_nbytes / NET_RATE


def fetch_record(
    stub,
    model_id: str,
    layer: int,
    expert: int,
    root: bytes,
    record_nbytes: int,
    out: np.ndarray,
    timeout_s: float,
    block_size: int = merkle.BLOCK_SIZE,
) -> int:
    """Stream record (layer, expert) of model `model_id` from the node behind `stub` into
    `out[:record_nbytes]` (a writable contiguous uint8 array, at least that long) and check it
    against its Merkle `root`; returns the bytes received (record_nbytes). FetchError when the
    call fails or the node's bytes are not the record; the whole call, stream included, ends by
    `timeout_s`. ValueError for an `out` that cannot take the record."""
    _check_buffer(out, record_nbytes)
    request = pb.RecordRequest(model_id=model_id, layer=layer, expert=expert)
    call = stub.Record(request, timeout=timeout_s)
    try:
        received = _receive(call, out, record_nbytes)
    except grpc.RpcError as exc:
        code = exc.code()
        name = code.name if code is not None else "UNKNOWN"
        raise FetchError(f"{name}: {_one_line(exc.details())}", code=name) from None
    finally:
        call.cancel()  # no-op once the call is over; else stops the node sending
    if received < record_nbytes:
        raise FetchError(
            f"the stream ended after {received} of the record's {record_nbytes} bytes",
            evidence=True,
        )
    if merkle.root(out[:record_nbytes], block_size) != root:
        raise FetchError(
            f"the {record_nbytes} bytes sent for expert {expert} of layer {layer} do not match "
            f"the record's Merkle root",
            evidence=True,
        )
    return received


def _one_line(text, limit: int = 300) -> str:
    """A node's status message as one line of at most `limit` characters (it is the node's
    text: it may hold anything)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _check_buffer(out: np.ndarray, record_nbytes: int) -> None:
    if record_nbytes < 1:
        raise ValueError(f"a record of {record_nbytes} bytes")
    if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous 1-D uint8 array, not {out.dtype} {out.shape}")
    if not out.flags.writeable or len(out) < record_nbytes:
        raise ValueError(f"out ({len(out)} bytes) cannot take a record of {record_nbytes} bytes")


def _receive(call, out: np.ndarray, record_nbytes: int) -> int:
    """Copy the stream's chunks into `out` as they come, up to the record's last byte (a node
    that sends it and then holds the call open costs nothing more); the bytes received.
    FetchError (evidence) at the first chunk an honest node would not send, before its data is
    used."""
    received = 0
    for chunk in call:
        why = _chunk_error(chunk, received, record_nbytes)
        if why:
            raise FetchError(why, evidence=True)
        end = received + len(chunk.data)
        out[received:end] = np.frombuffer(chunk.data, dtype=np.uint8)  # [len(chunk.data)]
        received = end
        if received == record_nbytes:  # the whole record: no need to wait for the status
            break
    return received


def _chunk_error(chunk: pb.RecordChunk, received: int, record_nbytes: int) -> str:
    """Why `chunk` cannot be the next piece of a record of `record_nbytes` bytes of which
    `received` have come, or ''."""
    if chunk.record_bytes != record_nbytes:
        return f"a chunk says the record has {chunk.record_bytes} bytes, not {record_nbytes}"
    if chunk.offset != received:
        return f"a chunk at offset {chunk.offset}, {received} bytes received so far"
    if not chunk.data:
        return f"an empty chunk at offset {received}"
    if received + len(chunk.data) > record_nbytes:
        return (
            f"{received + len(chunk.data)} bytes sent (a chunk of {len(chunk.data)} at offset "
            f"{received}), the record has {record_nbytes}"
        )
    return ""
