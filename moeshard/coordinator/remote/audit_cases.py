"""What an audit is about and what it can end in: the call (`Case`), the counters, the two
ways a node escapes a verdict (it withholds a record: convicted; it stays away: no verdict),
and the one comparison audits make, bit for bit (`same_bits`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeshard.coordinator.remote.peers import Peer
from moeshard.moe.wire import moeshard_pb2 as pb

# the audited node answered, and refused: no honest node says this of a record it just used
REFUSALS = {
    "NOT_FOUND", "DATA_LOSS", "PERMISSION_DENIED", "UNAUTHENTICATED", "INVALID_ARGUMENT",
    "FAILED_PRECONDITION", "UNIMPLEMENTED", "OUT_OF_RANGE",
}  # fmt: skip


class Withheld(Exception):
    """The audited node refused a record its reply used (evidence: it claims to hold it)."""


class Unverifiable(Exception):
    """The audited node, the only holder, stayed busy or unreachable: no verdict possible."""


@dataclass
class Case:
    """One Forward call whose reply was used."""

    step: int
    peer: Peer
    experts: list[int]
    request: pb.ForwardRequest
    reply: pb.ForwardReply
    id: int = 0


@dataclass
class AuditStats:
    picked: int = 0  # calls picked for an audit
    passed: int = 0  # recomputed: the same bits
    failed: int = 0  # recomputed: other bits (the node convicted)
    withheld: int = 0  # a record the audited node refused (convicted)
    unverifiable: int = 0  # the audited node stayed busy or away (dropped for the run)
    convicted: list[str] = field(default_factory=list)  # node ids caught lying
    proofs: list[str] = field(default_factory=list)  # fraud-proof files written
    cpu_s: float = 0.0  # the audit thread's CPU time (fetching, hashing, recomputing)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def same_bits(want: pb.Tensor, got: pb.Tensor) -> bool:
    """Whether a reply is, bit for bit, the recomputed one: the same dtype, shape and bytes.
    The only comparison audits make (no tolerance a node could choose or aim under)."""
    return want.dtype == got.dtype and list(want.shape) == list(got.shape) and want.data == got.data


def first_wrong_row(want: bytes, got: bytes, rows: int) -> int:
    """The first row whose bytes differ (row 0 when the lengths differ)."""
    if len(want) != len(got) or rows == 0:
        return 0
    a = np.frombuffer(want, dtype=np.uint8).reshape(rows, -1)  # [T, row bytes]
    b = np.frombuffer(got, dtype=np.uint8).reshape(rows, -1)  # [T, row bytes]
    return int(np.nonzero((a != b).any(axis=1))[0][0])
