"""The ledger of work: `ledger verify FILE`, `ledger summary FILE`, and `ledger check-fraud
FILE MODEL` for the fraud proofs audits leave (moe/ledger)."""

from __future__ import annotations

import json
import sys

from moeshard.commands import EXIT_BAD_INPUT, EXIT_OK


def add_ledger(sub) -> None:
    p = sub.add_parser("ledger", help="check a ledger of receipts, or sum up the work in it")
    cmds = p.add_subparsers(
        dest="ledger_command", required=True, metavar="ACTION", help="what to do with the ledger"
    )
    v = cmds.add_parser(
        "verify",
        help="check the hash chain and every signature (exit 2 naming the first bad entry)",
    )
    v.add_argument("file", help="a ledger (.jsonl) written by `node` or `generate`")
    v.set_defaults(func=cmd_verify)
    s = cmds.add_parser(
        "summary",
        help="work per node: calls settled and unsettled, rows, expert bytes, audits, "
        "settlements and whether they agree",
    )
    s.add_argument("file", help="a ledger (.jsonl)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_summary)
    f = cmds.add_parser(
        "check-fraud",
        help="verify a fraud proof against the model alone (exit 0: proven; 2: it proves "
        "nothing, and why)",
    )
    f.add_argument("file", help="a fraud proof (.fraud) written when an audit convicted a node")
    f.add_argument(
        "model", help="the model directory (a coordinator directory from `shard` will do)"
    )
    f.set_defaults(func=cmd_check_fraud)


def cmd_check_fraud(args) -> int:
    """Recompute the proof's row from its records (checked against the model's Merkle
    roots) and compare it with the node's signed reply."""
    from moeshard.moe.ledger import fraud
    from moeshard.moe.model.model_dir import ModelDir

    verdict = fraud.check(args.file, ModelDir(args.model))  # FraudError: one line, exit 2
    print(verdict.describe())
    return EXIT_OK


def cmd_verify(args) -> int:
    from moeshard.moe.ledger import verify

    report = verify(args.file)
    if not report.ok:
        print(report.describe(), file=sys.stderr)
        return EXIT_BAD_INPUT
    print(report.describe())
    return EXIT_OK


def cmd_summary(args) -> int:
    """The totals of the entries that verify; exit 2 (after printing them) if some do not."""
    from moeshard.moe.ledger import summary

    result = summary(args.file)
    report, nodes = result.report, sorted(result.nodes.values(), key=lambda w: w.node_id)
    if args.json:
        doc = {
            "file": str(args.file),
            "verified": report.ok,
            "problem": "" if report.ok else report.describe(),
            "owner": report.owner,
            "role": report.role,
            "entries": report.entries,
            "nodes": [w.as_dict() for w in nodes],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(_table(report, nodes))
    if not report.ok:
        print(report.describe(), file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


UNSETTLED = {  # what an unsettled call is, in whose ledger
    "node": "receipts this node signed that no coordinator's settlement covers",
    "coordinator": "receipts this coordinator accepted and signed no settlement for",
}
LEGEND = (
    "settled: calls covered by a settlement the coordinator signed; unsettled: receipts alone "
    "(they prove only that the node claims the work)\n"
    "settlements agree: whether each settlement states what this ledger holds before it in its "
    "session; it says nothing of unsettled calls"
)


def _table(report, nodes) -> str:
    from moeshard.moe.units import fmt_bytes

    head = f"ledger of {report.role or '?'} {report.owner or '?'}: {report.entries} entries"
    rows = [
        (
            "node",
            "calls",
            "settled",
            "unsettled",
            "rows",
            "expert bytes",
            "audits ok/failed",
            "settled sessions",
            "settlements agree",
        )
    ]
    for w in nodes:
        agrees = {None: "-", True: "yes", False: "NO"}[w.agrees]
        rows.append(
            (
                w.node_id[:12],
                str(w.calls),
                str(w.settled_calls),
                str(w.unsettled_calls),
                str(w.rows),
                fmt_bytes(w.expert_bytes),
                f"{w.audits_passed}/{w.audits_failed}",
                str(w.settlements),
                agrees,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head] + [
        "  ".join(
            c.ljust(n) if i == 0 else c.rjust(n)
            for i, (c, n) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    for w in nodes:
        lines += [f"{w.node_id[:12]}: {d}" for d in w.disagreements]
        if w.unsettled_calls:
            what = UNSETTLED.get(report.role, "receipts no settlement covers")
            sessions = f"{w.unsettled_sessions} session" + "s" * (w.unsettled_sessions != 1)
            lines.append(
                f"{w.node_id[:12]}: {w.unsettled_calls} unsettled calls in {sessions}: {what}"
            )
    if len(rows) == 1:
        lines.append("(no work recorded)")
    else:
        lines.append(LEGEND)
    return "\n".join(lines)
