"""Possession challenges, the coordinator's side (docs/security.md, "Proof of possession").

`challenge` picks random blocks of records a node says it holds (distinct records first), sends
them with a fresh nonce, and passes the node only if it answers within the deadline, every
block verifies against the model's roots (`ModelDir.possession_roots()`) and the reply is
signed by the node's key over the nonce. `node_key` gets that key from a signed Info reply.

The default deadline grows with the bytes the node must read: a node reads each challenged
record whole (the path of a block needs every leaf), so it is DEADLINE_BASE_S plus the round
trip plus the records' bytes at READ_RATE (measurements in docs/security.md).
"""

from __future__ import annotations

import os
import random
import ssl
import statistics
import time
from dataclasses import asdict, dataclass, field

import grpc

from moeshard.coordinator.remote.transport import PeerSpec, PinError, dial
from moeshard.moe.identity.keys import verify
from moeshard.moe.identity.signed import check_info
from moeshard.moe.identity.tls import TLSMaterial
from moeshard.moe.storage import merkle
from moeshard.moe.wire import health_pb2, health_pb2_grpc
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.moe.wire.constants import MAX_BLOCKS, MAX_RECORDS

DEFAULT_BLOCKS = 8  # blocks per challenge
DEADLINE_BASE_S = 0.1  # a challenge's fixed costs: the call, signing, a busy node's scheduling
READ_RATE = 100e6  # bytes per second a node must read and hash challenged records at
NONCE_BYTES = 32


@dataclass
class Result:
    passed: bool
    why: str  # "" when passed; else what failed (a status code, a bad block, lateness)
    elapsed_ms: float  # send to reply (or to the failure)
    blocks: int = 0  # blocks challenged
    deadline_ms: float = 0.0


def default_deadline_s(records: int, record_nbytes: int, rtt_s: float = 0.0) -> float:
    """How long a node may take to prove `records` records of `record_nbytes` bytes each."""
    return DEADLINE_BASE_S + rtt_s + records * record_nbytes / READ_RATE


def node_key(stub, node_id: str, timeout: float) -> bytes:
    """The raw public key of node `node_id`, from its Info signed over a fresh nonce.
    ValueError if the reply is forged or names another node; grpc.RpcError if the call fails."""
    nonce = os.urandom(16)
    info = stub.Info(pb.InfoRequest(nonce=nonce), timeout=timeout)
    forged = check_info(info, nonce)
    if forged:
        raise ValueError(forged)
    if node_id and info.node_id != node_id:
        raise ValueError(f"Info names node {info.node_id}, not {node_id}")
    return info.public_key


def pick(roots, held, n_blocks: int, rng: random.Random) -> list[pb.BlockIndex]:
    """`n_blocks` random blocks of the records in `held` that `roots` can check: distinct
    records while they last (each checks one record more; a node reads at most MAX_RECORDS
    per challenge), then more blocks of those."""
    keys = sorted(set(held) & roots.keys())
    n_blocks = min(n_blocks, MAX_BLOCKS)
    if not keys or n_blocks < 1:
        return []
    chosen = rng.sample(keys, min(n_blocks, len(keys), MAX_RECORDS))
    count = roots.n_blocks
    return [
        pb.BlockIndex(layer=layer, expert=expert, block=rng.randrange(count))
        for layer, expert in (chosen[i % len(chosen)] for i in range(n_blocks))
    ]


def challenge(
    stub,
    public_key: bytes,
    model_id: str,
    roots,
    held,
    n_blocks: int = DEFAULT_BLOCKS,
    rng: random.Random | None = None,
    deadline_s: float | None = None,
    rtt_s: float = 0.0,
) -> Result:
    """Challenge the node behind `stub` once (see the module docstring). `roots`: the model's
    (`ModelDir.possession_roots()`); `held`: the (layer, expert) records the node claims;
    `deadline_s` None: `default_deadline_s` for the records picked (plus `rtt_s`)."""
    rng = rng or random.SystemRandom()
    blocks = pick(roots, held, n_blocks, rng)
    if not blocks:
        return Result(False, "holds no record of this model to challenge", 0.0)
    wanted = {(b.layer, b.expert): roots.root(b.layer, b.expert) for b in blocks}  # before timing
    if deadline_s is None:
        deadline_s = default_deadline_s(len(wanted), roots.record_nbytes, rtt_s)
    request = pb.ChallengeRequest(model_id=model_id, nonce=os.urandom(NONCE_BYTES), blocks=blocks)
    t0 = time.perf_counter()
    try:
        reply = stub.Challenge(request, timeout=deadline_s)
        why = ""
    except grpc.RpcError as exc:
        reply, why = None, f"{exc.code().name}: {exc.details()}"
    elapsed = time.perf_counter() - t0
    if reply is not None and elapsed > deadline_s:
        why = f"answered in {elapsed * 1e3:.1f} ms, past the {deadline_s * 1e3:.1f} ms deadline"
    if reply is not None and not why:
        why = check_reply(request, reply, wanted, roots, public_key)
    return Result(not why, why, elapsed * 1e3, len(blocks), deadline_s * 1e3)


def check_reply(request, reply, wanted: dict, roots, public_key: bytes) -> str:
    """'' if `reply` proves every block of `request` and is signed by `public_key`."""
    if len(reply.proofs) != len(request.blocks):
        return f"{len(reply.proofs)} proofs for {len(request.blocks)} blocks"
    count = roots.n_blocks
    for i, (at, proof) in enumerate(zip(request.blocks, reply.proofs, strict=True)):
        where = f"block {at.block} of expert {at.expert} of layer {at.layer}"
        if (proof.at.layer, proof.at.expert, proof.at.block) != (at.layer, at.expert, at.block):
            return f"proof {i} is not for {where}"
        start, end = merkle.block_span(at.block, roots.record_nbytes, roots.block_size)
        if len(proof.data) != end - start:
            return f"{where}: {len(proof.data)} bytes, expected {end - start}"
        root = wanted[(at.layer, at.expert)]
        if not merkle.verify(root, at.block, count, proof.data, list(proof.path)):
            return f"{where}: does not match the model's Merkle root"
    if not verify(public_key, reply.signature, merkle.possession_message(request.nonce, reply)):
        return "reply not signed by the node's key"
    return ""


# -- `moeshard audit`: one node, several rounds ---------------------------------------------


@dataclass
class NodeAudit:
    addr: str
    node_id: str = ""
    name: str = ""
    status: str = "unreachable"  # "passed", "failed" (a challenge failed), "unreachable"
    why: str = ""  # the first failure, or why the node could not be audited
    rounds: list[Result] = field(default_factory=list)
    rtt_ms: float = 0.0  # the best of a few health round trips (part of the default deadline)

    @property
    def median_ms(self) -> float:
        times = [r.elapsed_ms for r in self.rounds if r.elapsed_ms > 0]
        return statistics.median(times) if times else 0.0

    def as_dict(self) -> dict:
        return {
            "addr": self.addr,
            "node_id": self.node_id,
            "name": self.name,
            "status": self.status,
            "why": self.why,
            "rtt_ms": round(self.rtt_ms, 3),
            "median_ms": round(self.median_ms, 3),
            "passed_rounds": sum(r.passed for r in self.rounds),
            "rounds": [asdict(r) for r in self.rounds],
        }


def audit_node(
    spec: PeerSpec,
    tls: TLSMaterial | None,
    model_id: str,
    roots,
    *,
    blocks: int = DEFAULT_BLOCKS,
    rounds: int = 3,
    deadline_s: float | None = None,
    timeout: float = 3.0,
) -> NodeAudit:
    """Dial `spec` (pinned over TLS), read its signed Info, then challenge it `rounds` times."""
    audit = NodeAudit(spec.addr, spec.node_id)
    try:
        channel, seen = dial(spec, tls, timeout)
    except (OSError, ssl.SSLError, PinError) as exc:
        audit.why = str(exc)
        return audit
    with channel:
        stub = pb_grpc.ExpertNodeStub(channel)
        try:
            nonce = os.urandom(16)
            info = stub.Info(pb.InfoRequest(nonce=nonce), timeout=timeout)
            health = health_pb2_grpc.HealthStub(channel)
            audit.rtt_ms = min(_ping_ms(health, timeout) for _ in range(3))
        except grpc.RpcError as exc:
            audit.why = f"Info: {exc.code().name}: {exc.details()}"
            return audit
        audit.node_id, audit.name = info.node_id, info.name
        why = check_info(info, nonce)
        if not why and (spec.node_id or seen) and info.node_id != (spec.node_id or seen):
            why = f"Info names node {info.node_id}, not {spec.node_id or seen}"
        if not why and info.model_id != model_id:
            why = f"serves model {info.model_id[:16]}, not {model_id[:16]}"
        if why:
            audit.status, audit.why = "failed", why
            return audit
        held = {(h.layer, e) for h in info.holdings for e in h.experts}
        rng = random.SystemRandom()
        for _ in range(rounds):
            audit.rounds.append(
                challenge(
                    stub,
                    info.public_key,
                    model_id,
                    roots,
                    held,
                    blocks,
                    rng,
                    deadline_s,
                    audit.rtt_ms / 1e3,
                )
            )
    failed = [r for r in audit.rounds if not r.passed]
    audit.status = "failed" if failed else "passed"
    audit.why = failed[0].why if failed else ""
    return audit


def _ping_ms(health, timeout: float) -> float:
    t0 = time.perf_counter()
    health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return (time.perf_counter() - t0) * 1e3
