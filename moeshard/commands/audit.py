"""`moeshard audit MODEL --peers ...`: challenge nodes to prove they hold their experts' bytes
(proof of possession, docs/security.md). Exit 0 if every node passes every round, 1 if a node
fails one (or serves another model), 3 if a node could not be audited (unreachable, refused
this client, or not the pinned key), 2 on bad input."""

from __future__ import annotations

import json
import sys

from moeshard.commands import EXIT_INTERNAL, EXIT_OK, EXIT_UNCOVERED
from moeshard.commands.network import add_peer_options, client_config, split_list
from moeshard.moe.errors import MoeshardError


def add_audit(sub) -> None:
    p = sub.add_parser(
        "audit",
        help="possession challenges: do the nodes hold their experts' bytes? (exit 1 if one "
        "fails, 3 if one cannot be reached)",
    )
    p.add_argument("model", help="the coordinator's model directory (its Merkle roots)")
    add_peer_options(p, required=True)
    p.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="blocks per challenge, at most 64 (0: 8, each of another record)",
    )
    p.add_argument("--rounds", type=int, default=3, help="challenges per node")
    p.add_argument(
        "--deadline-ms",
        type=float,
        default=0.0,
        help="time a node has to answer, in ms (0: 100 ms + its round trip + 10 ms per MB of "
        "records it must read)",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to connect to a node")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_audit)


def cmd_audit(args) -> int:
    from moeshard.coordinator.remote.possession import DEFAULT_BLOCKS, audit_node
    from moeshard.coordinator.runtime import find_nodes
    from moeshard.moe.identity.tls import client_tls
    from moeshard.moe.model.model_dir import ModelDir
    from moeshard.moe.wire.constants import MAX_BLOCKS

    args.blocks = args.blocks or DEFAULT_BLOCKS
    if not 1 <= args.blocks <= MAX_BLOCKS:
        raise MoeshardError(f"--blocks {args.blocks}: must be 1..{MAX_BLOCKS}")
    if args.rounds < 1 or args.deadline_ms < 0 or args.timeout <= 0:
        raise MoeshardError("--rounds must be >= 1, --deadline-ms >= 0 and --timeout > 0")
    model = ModelDir(args.model)
    wide = None
    try:
        roots = model.possession_roots()
        config = client_config(args)
        specs, wide = find_nodes(
            model.model_id,
            args.peers,
            args.discover,
            args.discover_timeout,
            config.identity,
            args.expect,
            split_list(args.bootstrap),
            args.insecure,
        )
        tls = None if config.identity is None else client_tls(config.identity)
        deadline_s = args.deadline_ms / 1e3 or None
        audits = [
            audit_node(
                spec,
                tls,
                model.model_id,
                roots,
                blocks=args.blocks,
                rounds=args.rounds,
                deadline_s=deadline_s,
                timeout=args.timeout,
            )
            for spec in specs
        ]
    finally:
        if wide is not None:
            wide.close()
        model.close()
    if args.json:
        print(json.dumps({"model_id": model.model_id, "nodes": [a.as_dict() for a in audits]}))
    else:
        print(_table(model.model_id, audits))
    if any(a.status == "failed" for a in audits):
        return EXIT_INTERNAL
    if any(a.status == "unreachable" for a in audits):
        print("moeshard: some nodes could not be audited", file=sys.stderr)
        return EXIT_UNCOVERED
    return EXIT_OK


def _table(model_id: str, audits) -> str:
    lines = [
        f"model {model_id[:16]}: {len(audits)} node(s)",
        f"  {'node':<26} {'name':<20} {'result':<11} {'rounds':>6} {'median ms':>9} "
        f"{'deadline ms':>11}  why",
    ]
    for a in audits:
        passed = sum(r.passed for r in a.rounds)
        deadline = max((r.deadline_ms for r in a.rounds), default=0.0)
        lines.append(
            f"  {a.node_id or a.addr:<26} {a.name[:20]:<20} {a.status:<11} "
            f"{passed:>2}/{len(a.rounds):<3} {a.median_ms:>9.1f} {deadline:>11.0f}  {a.why}"
        )
    return "\n".join(lines)
