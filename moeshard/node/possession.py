"""A node's answer to a possession challenge (rpc Challenge, docs/security.md).

The coordinator names blocks of records the node says it holds and a fresh nonce; the node
reads each named record from its shard files (checksum-verified: a record that rotted on disk
is refused with DATA_LOSS and marked bad, as a Forward would), builds its Merkle tree
(`moe/storage/merkle.py`) and returns every block with its path, signed with its key over the
nonce. Records are read one at a time and dropped once their blocks are out, so a challenge
holds one record in memory; MAX_AT_ONCE challenges are answered at once, and they do not wait
for the compute queue (an honest node busy computing must still answer in time).
"""

from __future__ import annotations

import threading

import grpc

from moeshard.moe.errors import StoreError
from moeshard.moe.identity.keys import Identity
from moeshard.moe.storage import merkle
from moeshard.moe.storage.shards import ShardSet
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire.constants import MAX_BLOCKS, MAX_RECORDS
from moeshard.node.holdings import unavailable
from moeshard.node.limits import Refused

NONCE_BYTES = (16, 64)  # shortest and longest nonce taken
MAX_AT_ONCE = 2  # challenges answered at once (each reads whole records)
MAX_WAIT_S = 5.0  # longest wait for a turn (never past the call's deadline)


class ChallengeRefused(Refused):
    """A challenge the node will not answer: the status code and why (the servicer turns any
    `Refused` into the call's status)."""


class Prover:
    """Answers challenges from `shards`, the records this node serves. `held` and `bad` are
    the servicer's own sets (read and updated under `lock`): only held records that are not
    bad are answered for, and a record that fails its checksum here joins `bad`."""

    def __init__(
        self,
        shards: ShardSet | None,
        key: Identity | None,
        model_id: str,
        held: set,
        bad: set,
        lock: threading.Lock,
    ):
        self.shards, self.key, self.model_id = shards, key, model_id
        self.held, self.bad, self.lock = held, bad, lock
        self.turns = threading.BoundedSemaphore(MAX_AT_ONCE)

    def answer(self, request: pb.ChallengeRequest, wait_s: float | None = None, forge=False):
        """The signed ChallengeReply, or ChallengeRefused. `forge`: tests only (failpoint
        forged_block): one byte of each block flipped, as a node without the data would."""
        if self.shards is None or self.key is None:
            raise ChallengeRefused(grpc.StatusCode.UNIMPLEMENTED, "this node cannot prove")
        by_record = self._check(request)
        wait_s = MAX_WAIT_S if wait_s is None else max(0.0, min(wait_s, MAX_WAIT_S))
        if not self.turns.acquire(timeout=wait_s):
            raise ChallengeRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "node busy with other challenges"
            )
        try:
            proofs: list[pb.BlockProof | None] = [None] * len(request.blocks)
            for (layer, expert), wanted in by_record.items():
                tree, record = self._read(layer, expert)
                for i, block in wanted:
                    start, end = merkle.block_span(block, tree.nbytes, tree.block_size)
                    data = bytearray(record[start:end].tobytes())
                    if forge:
                        data[len(data) // 2] ^= 0xFF
                    proofs[i] = pb.BlockProof(
                        at=request.blocks[i], data=bytes(data), path=tree.path(block)
                    )
                del tree, record
        finally:
            self.turns.release()
        reply = pb.ChallengeReply(proofs=proofs)
        reply.signature = self.key.sign(merkle.possession_message(request.nonce, reply))
        return reply

    def _check(self, request) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """Validate the request; the wanted (position, block) per record, in request order."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if request.model_id != self.model_id:
            raise ChallengeRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model id {request.model_id[:16] or '(empty)'} does not match this node's "
                f"{self.model_id[:16]}",
            )
        low, high = NONCE_BYTES
        if not low <= len(request.nonce) <= high:
            raise ChallengeRefused(invalid, f"nonce of {len(request.nonce)} bytes: {low}..{high}")
        if not 1 <= len(request.blocks) <= MAX_BLOCKS:
            raise ChallengeRefused(
                invalid, f"{len(request.blocks)} blocks: a challenge names 1..{MAX_BLOCKS}"
            )
        count = merkle.n_blocks(self.shards.record_nbytes)
        by_record: dict[tuple[int, int], list[tuple[int, int]]] = {}
        with self.lock:
            for i, at in enumerate(request.blocks):
                key = (at.layer, at.expert)
                refused = unavailable(at.layer, at.expert, self.held, self.bad)
                if refused:
                    raise ChallengeRefused(*refused)
                if at.block >= count:
                    raise ChallengeRefused(
                        invalid, f"block {at.block} out of range (a record has {count} blocks)"
                    )
                by_record.setdefault(key, []).append((i, at.block))
        if len(by_record) > MAX_RECORDS:
            raise ChallengeRefused(
                invalid, f"{len(by_record)} records: a challenge reads at most {MAX_RECORDS}"
            )
        return by_record

    def _read(self, layer: int, expert: int) -> tuple[merkle.Tree, object]:
        """The record's tree and its bytes; DATA_LOSS (and the record marked bad) if it fails
        its checksum."""
        try:
            record = self.shards.read(layer, expert, verify=True)  # uint8 [nbytes]
        except StoreError as exc:
            with self.lock:
                self.bad.add((layer, expert))
            raise ChallengeRefused(grpc.StatusCode.DATA_LOSS, str(exc)) from None
        return merkle.Tree(record), record
