"""One row of `moeshard bench attack`: an attack run against real processes, and what an
honest user saw before and during it. Shared by the node attacks (`attack_nodes`) and the HTTP
attacks (`attack_http`), printed as one table by `moeshard.bench.attack`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AttackRow:
    attack: str  # what the attacker did, in a few words
    metric: str  # what `before` and `during` measure: "tok/s" or "p99 s"
    before: float  # the honest figure without the attack (same run)
    during: float  # ... while it runs
    peak_rss_mb: float  # the attacked process's peak RSS during the attack (MiB)
    rss_bound_mb: float  # the bound that process states (0: none stated)
    same_output: bool  # the honest output equals the unattacked one
    passed: bool  # the goal for this row was met (see `goal`)
    goal: str  # the goal in words: ">= 50% tok/s, same tokens, RSS within bound"
    notes: list[str] = field(default_factory=list)  # what else was seen

    def ratio(self) -> float:
        """during / before (for a latency, before / during: higher is better either way)."""
        if self.metric.endswith("/s"):
            return self.during / self.before if self.before else 0.0
        return self.before / self.during if self.during else 0.0
