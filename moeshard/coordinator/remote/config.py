"""The coordinator's client settings for the node network, and its one error type."""

from __future__ import annotations

from dataclasses import dataclass

from moeshard.coordinator.remote.policy import AUDIT_RATE, VETTING_AUDITS
from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity.keys import Identity, client_identity


class RemoteError(MoeshardError):
    """The cluster cannot be used: no usable node (refused, wrong key), a node refusing a
    layer, or no live node for an expert (`UncoveredError`). Exit 2, like bad input."""


class UncoveredError(RemoteError):
    """No live node holds an expert a layer needs (nodes died, or never held it)."""

    exit_code = 3  # the cluster does not cover the model (the CLI's EXIT_UNCOVERED)


@dataclass
class RemoteConfig:
    deadline_s: float = 5.0  # deadline of one Forward call
    transport: str = "stream"  # "stream": one persistent bidi stream per node; "unary": futures
    connect_timeout_s: float = 3.0  # deadline of the start-up Info call to each peer
    wire_dtype: str = "f32"  # activations on the wire: f32 (exact) or bf16 (half the bytes)
    ewma_alpha: float = 0.2  # weight of the newest round trip in a node's latency estimate
    call_cost_ms: float = 0.3  # extra score for involving one more node in a layer
    trial_share: float = 0.05  # layer calls giving a new node one expert (`experts._give_trial`)
    backoff_s: float = 0.5  # first ban after a failure; doubles on each failed probe
    max_backoff_s: float = 30.0  # longest ban between probes
    probe_interval_s: float = 0.2  # how often the prober looks for banned nodes due a probe
    prefetch: bool = True  # forward next-layer prefetch hints to the nodes
    hedge: bool = True  # a reply later than its node's recent p95: its rows go to a replica too
    queue_aware: bool = True  # a node's stated queue raises its expected finish time
    degrade: bool = False  # drop experts no live node holds (renormalising) instead of failing
    own_experts: bool = False  # compute experts no live node holds from this directory's records
    identity: Identity | None = None  # this client's key (mutual TLS); None = --insecure
    audit: float = AUDIT_RATE  # share of a vetted node's calls recomputed here (0: none)
    audit_new: int = VETTING_AUDITS  # completed audits at rate 1 before `audit` applies
    audit_cache: int = 0  # bytes of expert records kept for audits (0: sized for the model)
    audit_bytes_per_token: int = 0  # cap on record bytes audits fetch per token (0: none)
    evidence: str = ""  # directory for fraud proofs ('' = evidence/ in the moeshard home)
    reputation: object | None = None  # reputation.Reputation: evidence kept across runs
    ledger: str = ""  # receipts and settlements go here ('' = the default; needs an identity)
    roots: object | None = None  # the model's Merkle roots: possession challenges (None: off)
    challenge_interval_s: float = 60.0  # mean time between two challenges of a node (0: off)
    challenge_first_s: float = 10.0  # a new node's first challenge comes within this
    challenge_blocks: int = 8  # blocks per challenge

    @classmethod
    def for_client(cls, key: str | None, insecure: bool, **fields) -> RemoteConfig:
        """A client command's settings: its key (`key`, or the default one) unless `insecure`
        (plaintext, to nodes that allow it)."""
        return cls(identity=None if insecure else client_identity(key), **fields)

    def check(self) -> None:
        if self.wire_dtype not in ("f32", "bf16"):
            raise MoeshardError(f"wire dtype {self.wire_dtype}: use f32 or bf16")
        if self.transport not in ("stream", "unary"):
            raise MoeshardError(f"transport {self.transport}: use stream or unary")
        if not 0 <= self.audit <= 1 or self.audit_new < 0:
            raise MoeshardError(f"--audit {self.audit}: need 0 <= P <= 1 and --audit-new >= 0")
        if self.audit_cache < 0 or self.audit_bytes_per_token < 0:
            raise MoeshardError("--audit-cache and --audit-bytes must not be negative")
