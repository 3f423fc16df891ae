"""Reading a ledger: `verify` (the chain, the owner's signature on every line, the signature
inside every receipt and settlement) and `summary` (the work per node, the calls a settlement
covers apart from those only receipts claim, and whether the last settlement of each session
agrees with the receipts the ledger holds).

Both stop at the first bad entry; the Report names it by seq and line. A last line without its
newline is a torn write (the process died mid-append) and fails like any other bad entry:
nothing after the last whole line can be trusted, and a writer refuses to continue such a file
until the torn line is removed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from moeshard.moe.identity.receipts import Totals
from moeshard.moe.ledger.entry import (
    GENESIS,
    MAX_LINE,
    BadEntry,
    LedgerError,
    check_body,
    check_open,
    check_signature,
    line_hash,
    parse_line,
)
from moeshard.moe.wire import moeshard_pb2 as pb


@dataclass
class Report:
    path: str
    entries: int = 0  # entries that verified
    owner: str = ""  # the owner's key id (from the 'open' entry)
    role: str = ""
    kinds: Counter = field(default_factory=Counter)  # verified entries per kind
    line: int = 0  # the first bad entry's line (1-based); 0 if all verified
    why: str = ""

    @property
    def ok(self) -> bool:
        return not self.why

    def describe(self) -> str:
        """One line: OK with the counts, or the first bad entry."""
        if not self.ok:
            return f"{self.path}: entry {self.line - 1} (line {self.line}): {self.why}"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()) if k != "open")
        return (
            f"{self.path}: OK, {self.entries} entries ({kinds or 'none'}), {self.role} {self.owner}"
        )


def entries(source: str | Path | BinaryIO, report: Report) -> Iterator[tuple[dict, object]]:
    """(entry, checked content) for each entry that verifies, in order; fills in `report`
    (stopping at the first bad entry). `source`: a path or a binary file. LedgerError if the
    file cannot be read at all."""
    try:
        f = source if hasattr(source, "readline") else open(source, "rb")  # noqa: SIM115
    except OSError as exc:
        raise LedgerError(f"{source}: cannot read the ledger ({exc.strerror})") from None
    with f:
        prev, owner_pk = GENESIS, b""
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), start=1):
            report.line = number
            try:
                if not raw.endswith(b"\n"):
                    torn = len(raw) <= MAX_LINE
                    raise BadEntry(
                        "incomplete last entry (no newline: a crash mid-write?)"
                        if torn
                        else f"line longer than {MAX_LINE} bytes"
                    )
                line = raw[:-1]
                entry = parse_line(line)
                if entry["seq"] != number - 1:
                    raise BadEntry(f"seq {entry['seq']}, expected {number - 1}")
                if entry["prev"] != prev:
                    raise BadEntry("not chained to the entry before it (prev hash differs)")
                if number == 1:
                    owner_pk, report.role = check_open(entry)
                    report.owner, content = entry["by"], None
                else:
                    check_signature(entry, owner_pk)
                    content = check_body(entry)
            except BadEntry as exc:
                report.why = str(exc)
                return
            prev = line_hash(line)
            report.entries += 1
            report.kinds[entry["kind"]] += 1
            yield entry, content
        if report.entries == 0:
            report.line, report.why = 1, "empty: no 'open' entry"
        else:
            report.line = 0


def verify(path: str | Path | BinaryIO) -> Report:
    """Check every entry of the ledger at `path` (or in a binary file); the Report says OK or
    the first bad one."""
    report = Report(str(getattr(path, "name", path)))
    for _ in entries(path, report):
        pass
    return report


@dataclass
class NodeWork:
    """One node's work as a ledger records it (all sessions).

    A call is *settled* when a settlement of its session covers it: one the coordinator
    signed, stating at least as many calls as the ledger holds before it in that session.
    Every other receipt is *unsettled*: signed by the node alone (in a node's own ledger it
    may write any number of them, for work nobody asked for), or not yet countersigned (a
    coordinator that stopped before settling). `agrees` speaks of settled sessions only."""

    node_id: str
    calls: int = 0
    rows: int = 0
    expert_bytes: int = 0
    audits_passed: int = 0
    audits_failed: int = 0
    settlements: int = 0  # sessions with a settlement for this node
    settled_calls: int = 0  # calls a settlement covers (see above)
    unsettled_sessions: int = 0  # sessions with receipts beyond what a settlement covers
    disagreements: list[str] = field(default_factory=list)  # sessions whose settlement differs

    @property
    def unsettled_calls(self) -> int:
        return self.calls - self.settled_calls

    @property
    def agrees(self) -> bool | None:
        """Whether every settled session's last settlement agrees (None: none settled)."""
        return None if not self.settlements else not self.disagreements

    def as_dict(self) -> dict:
        fields = ("node_id", "calls", "rows", "expert_bytes", "audits_passed", "audits_failed")
        return {
            **{k: getattr(self, k) for k in fields},
            "settled_calls": self.settled_calls,
            "unsettled_calls": self.unsettled_calls,
            "settlements": self.settlements,
            "unsettled_sessions": self.unsettled_sessions,
            "settlement_agrees": self.agrees,
            "disagreements": self.disagreements,
        }


@dataclass
class Summary:
    report: Report
    nodes: dict[str, NodeWork]  # node id -> its work


def summary(path: str | Path) -> Summary:
    """The work per node in the verified entries of a ledger (up to the first bad one: see
    `.report`), settled and unsettled calls apart (`NodeWork`), with each session's last
    settlement compared to the receipts before it.

    In the coordinator's own ledger a settlement must match its receipts exactly (totals,
    audits, and the receipts' hash chain); in a node's ledger the receipts are those the node
    issued, and the calls, rows and bytes must match (a disagreement: replies the coordinator
    did not count, or a coordinator that under-states)."""
    report = Report(str(path))
    nodes: dict[str, NodeWork] = {}
    sessions: dict[tuple[str, str], Totals] = {}  # (session hex, node) -> so far
    last: dict[tuple[str, str], tuple[pb.Settlement, Totals]] = {}  # its settlement, then
    for entry, content in entries(path, report):
        kind = entry["kind"]
        if kind == "receipt":
            work = nodes.setdefault(content.node_id, NodeWork(content.node_id))
            work.calls += 1
            work.rows += content.rows
            work.expert_bytes += content.expert_bytes
            sessions.setdefault((content.session.hex(), content.node_id), Totals()).add(content)
        elif kind == "audit":
            node_id = content["node_id"]
            work = nodes.setdefault(node_id, NodeWork(node_id))
            work.audits_passed += content["passed"]
            work.audits_failed += not content["passed"]
            sessions.setdefault((content["session"], node_id), Totals()).audit(content["passed"])
        elif kind == "settlement":
            key = (content.session.hex(), content.node_id)
            earlier = last.get(key)
            if earlier is None or content.seq > earlier[0].seq:
                seen = sessions.get(key, Totals())
                last[key] = content, Totals(**vars(seen))  # a snapshot
    for (session, node_id), (settlement, seen) in sorted(last.items()):
        work = nodes.setdefault(node_id, NodeWork(node_id))
        work.settlements += 1
        work.settled_calls += min(settlement.calls, seen.calls)
        mine = settlement.coordinator_id == report.owner
        why = _disagreement(settlement, seen, mine)
        if why:
            work.disagreements.append(f"session {session[:8]}: {why}")
    for key, totals in sessions.items():
        covered = min(last[key][0].calls, last[key][1].calls) if key in last else 0
        if totals.calls > covered:
            nodes[key[1]].unsettled_sessions += 1
    return Summary(report, nodes)


def _disagreement(settlement: pb.Settlement, seen: Totals, own: bool) -> str:
    """'' if `settlement` states what the ledger saw before it; else what differs. `own`: the
    ledger is the settling coordinator's, which also records the audits and the chain."""
    stated = Totals.of(settlement)
    names = ["calls", "rows", "expert_bytes"]
    if own:
        names += ["audits_passed", "audits_failed"]
    diffs = [
        f"{n} settled {getattr(stated, n)}, ledger {getattr(seen, n)}"
        for n in names
        if getattr(stated, n) != getattr(seen, n)
    ]
    if own and stated.chain != seen.chain:
        diffs.append("receipts chain differs")
    return "; ".join(diffs)
