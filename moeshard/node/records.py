"""A node's answer to rpc Record: one expert record's bytes, as stored, in chunks.

A coordinator that recomputes a Forward call itself fetches the records the call used from any
holder and checks every byte against the record's Merkle root (coordinator/remote/fetch.py), so
what matters here is only that an honest node hands over exactly its record: read whole and
checksum-verified (a record that rotted on disk is refused with DATA_LOSS and marked bad, as a
Forward would), then sent as consecutive chunks of CHUNK_BYTES.

Admission (the caps on open record streams, the per-client byte rate) and the watchdog on a
client that stops reading are the servicer's and node/limits.py's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc
import numpy as np

from moeshard.moe.errors import StoreError
from moeshard.moe.storage.shards import ShardSet
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.node.holdings import unavailable
from moeshard.node.limits import Refused

log = logging.getLogger(__name__)

# 1 MiB: a quarter of grpc's default 4 MiB receive limit, so any client takes a chunk whatever
# its channel options; a multiple of the 4096-byte Merkle block, so an honest chunk holds whole
# leaves; large enough that the per-message cost (tens of us) is noise beside its transfer, and
# small enough that a stream the client stops reading has little of the record in grpc's
# buffers and the watchdog (node/limits.py) sees progress chunk by chunk.
CHUNK_BYTES = 1 << 20


class RecordRefused(Refused):
    """A record the node will not send: the status code and why (the servicer turns any
    `Refused` into the call's status)."""


class Records:
    """Reads the records this node serves from `shards`. `held` and `bad` are the servicer's own
    sets (read and updated under `lock`): only held records that are not bad are sent, and a
    record that fails its checksum here joins `bad`."""

    def __init__(
        self,
        shards: ShardSet | None,
        model_id: str,
        held: set,
        bad: set,
        lock: threading.Lock,
    ):
        self.shards, self.model_id = shards, model_id
        self.held, self.bad, self.lock = held, bad, lock

    @property
    def record_nbytes(self) -> int:
        return self.shards.record_nbytes if self.shards is not None else 0

    def check(self, request: pb.RecordRequest) -> None:
        """RecordRefused unless this node may send the record `request` names: the model id
        (FAILED_PRECONDITION), a record it holds (NOT_FOUND) that has not failed its checksum
        (DATA_LOSS)."""
        if self.shards is None:
            raise RecordRefused(grpc.StatusCode.UNIMPLEMENTED, "this node cannot send records")
        if request.model_id != self.model_id:
            raise RecordRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model id {request.model_id[:16] or '(empty)'} does not match this node's "
                f"{self.model_id[:16]}",
            )
        with self.lock:
            refused = unavailable(request.layer, request.expert, self.held, self.bad)
        if refused:
            raise RecordRefused(*refused)

    def read(self, layer: int, expert: int) -> np.ndarray:
        """The record's bytes, uint8 [record_nbytes], checksum-verified; DATA_LOSS (and the
        record marked bad) if it fails its checksum."""
        try:
            return self.shards.read(layer, expert, verify=True)  # uint8 [nbytes]
        except StoreError as exc:
            with self.lock:
                self.bad.add((layer, expert))
            log.error("layer %d: marked expert %d bad: %s", layer, expert, exc)
            raise RecordRefused(grpc.StatusCode.DATA_LOSS, str(exc)) from None


def chunks(record: np.ndarray, forge: bool = False) -> Iterator[pb.RecordChunk]:
    """`record` (uint8 [nbytes]) as consecutive RecordChunks of at most CHUNK_BYTES. `forge`:
    tests only (failpoint forged_record): one byte flipped, as a node without the record (or
    with other weights) would send."""
    nbytes = len(record)
    if forge:
        record = record.copy()  # [nbytes]; the read is a read-only view of the file's bytes
        record[nbytes // 2] ^= 0xFF
    for start in range(0, nbytes, CHUNK_BYTES):
        data = record[start : start + CHUNK_BYTES].tobytes()
        yield pb.RecordChunk(offset=start, data=data, record_bytes=nbytes)
