"""How often the coordinator recomputes a node's calls: the audit rate and the vetting rule,
written once (the CLI's defaults, `RemoteConfig`, the auditor and the reputation read them here).

A call is picked after its reply is in, secretly (`random.SystemRandom`), with probability

    rate_for(node) = 1               while the node has fewer than `vetting` completed audits
                                     (this run's and, with a reputation database, earlier ones'),
                                     or is a suspect (failed an audit lately, in any run)
                     base rate       otherwise

times the budget's factor (`AuditBudget`, the same for every call, whatever it routes), so
nothing a node can see or choose changes its own chance of being checked.
"""

from __future__ import annotations

from dataclasses import dataclass

AUDIT_RATE = 0.05  # the base rate: share of a vetted node's calls recomputed
VETTING_AUDITS = 100  # completed audits a node gets at rate 1 before the base rate applies


def rate_for(base: float, vetting: int, completed: int, suspect: bool) -> float:
    """The chance a call of a node with `completed` audits behind it is picked (see above)."""
    if base <= 0:
        return 0.0
    return 1.0 if suspect or completed < vetting else base


@dataclass
class AuditBudget:
    """A cap on the record bytes audits fetch per generated token, as a factor on every pick.

    Audits of records the coordinator has (its own model directory, its audit cache) cost
    CPU only; a record it must fetch costs its bytes on the wire. With a cap, the factor is
    cap / (what the last picks cost per token), smoothed over many tokens, so it moves slowly
    and does not depend on any one call: a node cannot time a lie to a moment without audits.
    """

    bytes_per_token: float = 0.0  # the cap (0: none)
    alpha: float = 0.02  # weight of the newest token in the smoothed cost
    cost: float = 0.0  # smoothed fetched bytes per token at factor 1
    factor: float = 1.0

    def token(self, fetched_bytes: float) -> None:
        """One token was generated; `fetched_bytes` is what audits fetched since the last."""
        if self.bytes_per_token <= 0:
            return
        unscaled = fetched_bytes / max(self.factor, 1e-6)  # what it would have cost at 1
        self.cost = (1 - self.alpha) * self.cost + self.alpha * unscaled
        self.factor = 1.0 if self.cost <= self.bytes_per_token else self.bytes_per_token / self.cost
