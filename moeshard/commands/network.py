"""The node network: node, shard, health, cluster."""

from __future__ import annotations

import sys

from moeshard.commands import EXIT_INTERNAL, EXIT_OK, EXIT_UNCOVERED
from moeshard.moe.errors import MoeshardError


def add_node(sub) -> None:
    p = sub.add_parser("node", help="serve a model or shard directory's experts over gRPC")
    p.add_argument("path", help="model directory or shard directory (from `moeshard shard`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=0, help="port (0: any free port, printed)")
    p.add_argument("--ram", default="0", help="expert cache budget, e.g. 8G (0: unbounded)")
    p.add_argument("--name", default="", help="display name (default: hostname-port)")
    p.add_argument("--no-advertise", action="store_true", help="do not announce via zeroconf")
    p.add_argument(
        "--bootstrap",
        metavar="ADDR[,ADDR...]",
        help="also join the wide-area registry through these bootstrap peers "
        "(/ip4/HOST/tcp/PORT/p2p/ID, as `moeshard bootstrap` prints): found by model id from "
        "anywhere, reached through NATs (port mapping, hole punching, or relayed)",
    )
    p.add_argument(
        "--p2p-listen",
        metavar="ADDR[,ADDR...]",
        default="",
        help="the p2p daemon's listen multiaddrs (default: any port, TCP and QUIC)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the start-up checksum pass")
    p.add_argument(
        "--key",
        default="",
        help="identity key (default: node-key.pem in PATH, made on first start)",
    )
    p.add_argument(
        "--ledger",
        metavar="FILE",
        default="",
        help="where to keep the receipts this node signs and the settlements it accepts "
        "(default: node-IDPREFIX.jsonl in $MOESHARD_HOME/ledger, made on first use)",
    )
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--allow", metavar="ID[,ID...]|FILE", help="client ids allowed to call (or a file of ids)"
    )
    who.add_argument(
        "--allow-any", action="store_true", help="any authenticated client (public compute)"
    )
    who.add_argument(
        "--insecure", action="store_true", help="plaintext, no identities (loopback only)"
    )
    # Limits (node/limits.py): the defaults here are Limits' own; 0 = derived at start
    lim = p.add_argument_group("limits (what one client, or all of them, may make the node do)")
    lim.add_argument(
        "--max-request-mb",
        type=float,
        default=0,
        help="largest request message in MiB, refused by grpc before decoding (0: derived, a "
        "quarter of the RAM budget (--ram, or the held records) over the requests the node may "
        "hold at once, 8..64)",
    )
    lim.add_argument(
        "--max-rows",
        type=int,
        default=0,
        help="rows of one Forward (0: the f32 rows --max-request-mb holds, <= 65536)",
    )
    lim.add_argument(
        "--max-inflight",
        type=int,
        default=8,
        help="Forward requests that may wait for the 2 computing ones; more get "
        "RESOURCE_EXHAUSTED 'node busy' at once",
    )
    lim.add_argument("--max-streams", type=int, default=32, help="ForwardStreams open at once")
    lim.add_argument(
        "--per-client",
        type=int,
        default=4,
        help="calls + streams one client may have open at once",
    )
    lim.add_argument(
        "--rate",
        type=float,
        default=5000.0,
        help="calls per second per client, each stream message counting",
    )
    lim.add_argument(
        "--rate-rows",
        type=float,
        default=0,
        help="rows per second per client (0: --max-rows times the MoE layers)",
    )
    lim.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="seconds a call or stream may send nothing (or a Record stream's client take "
        "nothing) before it is ended",
    )
    lim.add_argument(
        "--max-records", type=int, default=4, help="Record streams (a record's bytes) open at once"
    )
    lim.add_argument(
        "--per-client-records",
        type=int,
        default=2,
        help="Record streams one client may have open at once",
    )
    lim.add_argument(
        "--record-rate-mb",
        type=float,
        default=64.0,
        help="MiB of records per second per client (a one-second burst)",
    )
    p.set_defaults(func=cmd_node)


def cmd_node(args) -> int:
    from moeshard.moe.units import parse_size
    from moeshard.node.access import read_allow
    from moeshard.node.daemon import NodeConfig, run
    from moeshard.node.limits import Limits

    limits = Limits(
        max_request_bytes=round(args.max_request_mb * (1 << 20)),
        max_rows=args.max_rows,
        max_queue=args.max_inflight,
        max_streams=args.max_streams,
        per_client=args.per_client,
        rate=args.rate,
        rate_rows=args.rate_rows,
        idle_timeout_s=args.idle_timeout,
        max_records=args.max_records,
        per_client_records=args.per_client_records,
        record_rate=args.record_rate_mb * (1 << 20),
    )
    config = NodeConfig(
        path=args.path,
        host=args.host,
        port=args.port,
        ram=parse_size(args.ram),
        advertise=not args.no_advertise,
        name=args.name,
        verify=not args.no_verify,
        key=args.key,
        allow=read_allow(args.allow) if args.allow else frozenset(),
        allow_any=args.allow_any,
        insecure=args.insecure,
        limits=limits,
        ledger=args.ledger,
        bootstrap=tuple(split_list(args.bootstrap)),
        p2p_listen=tuple(split_list(args.p2p_listen)),
    )
    return run(config, sys.stdout)


def split_list(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def add_bootstrap(sub) -> None:
    p = sub.add_parser(
        "bootstrap",
        help="run a bootstrap and relay peer of a private swarm's wide-area registry",
        description="A p2p peer on a public address: the DHT the nodes' registry lives in, "
        "the dial-back checks that tell a node whether it is reachable, and a circuit relay "
        "for nodes behind NATs (it carries their TLS ciphertext; see docs/security.md). "
        "Prints the --bootstrap address for nodes and coordinators.",
    )
    p.add_argument(
        "--listen",
        default="/ip4/0.0.0.0/tcp/4001,/ip4/0.0.0.0/udp/4001/quic-v1",
        help="listen multiaddrs, comma-separated",
    )
    p.add_argument("--announce", default="", help="public multiaddrs to announce (behind a DNAT)")
    p.add_argument(
        "--key",
        default="",
        help="its libp2p key (default: bootstrap.p2p in $MOESHARD_HOME or ~/.config/moeshard, "
        "made on first start: the address it prints stays the same)",
    )
    p.add_argument(
        "--relay-streams",
        type=int,
        default=128,
        help="calls' streams it relays at once for nodes behind NATs (0: relays none)",
    )
    p.add_argument(
        "--relay-per-peer", type=int, default=16, help="of those, at most this many per peer"
    )
    p.add_argument(
        "--relay-rate",
        type=float,
        metavar="MB_S",
        help="MB/s one peer may push through it, both ways together (unless given: no limit)",
    )
    p.add_argument(
        "--address-file",
        metavar="FILE",
        help="also write its --bootstrap addresses to FILE, one per line (the first: the "
        "one to use), for a script that starts the nodes (compose.yaml)",
    )
    p.add_argument(
        "--fetch-only", action="store_true", help="fetch the p2p daemon binary, print its path"
    )
    p.set_defaults(func=cmd_bootstrap)


def cmd_bootstrap(args) -> int:
    import signal
    import threading
    from pathlib import Path

    from moeshard.moe.identity.keys import home
    from moeshard.moe.p2p.daemon import P2PDaemon, hub_args, p2pd_path
    from moeshard.moe.p2p.relay import Relay, RelayLimits

    if args.fetch_only:
        print(p2pd_path())
        return EXIT_OK
    args.relay_rate = args.relay_rate or 0.0
    if min(args.relay_streams, args.relay_per_peer, args.relay_rate) < 0:
        raise MoeshardError("--relay-streams, --relay-per-peer and --relay-rate must be >= 0")
    address_file = Path(args.address_file) if args.address_file else None
    if address_file is not None and not address_file.parent.is_dir():
        raise MoeshardError(f"--address-file {address_file}: no directory {address_file.parent}")
    key = Path(args.key) if args.key else home() / "bootstrap.p2p"
    daemon = P2PDaemon(hub_args(split_list(args.listen), split_list(args.announce)), key_file=key)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    relay = None
    try:
        if args.relay_streams:
            limits = RelayLimits(args.relay_streams, args.relay_per_peer, args.relay_rate * 1e6)
            relay = Relay(daemon.control, limits)
        print(f"bootstrap peer {daemon.peer_id}; give nodes and coordinators:", flush=True)
        full = [f"{addr}/p2p/{daemon.peer_id}" for addr in _best_first(daemon.addresses())]
        for addr in full:
            print(f"  --bootstrap {addr}", flush=True)
        if address_file is not None:
            _write_addresses(address_file, full)
        if relay:
            rate = f"{args.relay_rate:g} MB/s" if args.relay_rate else "no rate limit"
            print(f"relaying calls: {args.relay_streams} streams, {args.relay_per_peer} per "
                  f"peer, {rate}", flush=True)  # fmt: skip
        stop.wait()
    finally:
        if relay:
            relay.close()
        daemon.close()
    return EXIT_OK


def _write_addresses(target, addresses: list[str]) -> None:
    """One per line, under a temporary name and then renamed: a reader never sees half."""
    import os

    tmp = target.with_name(f".{target.name}.partial")
    try:
        tmp.write_text("".join(f"{a}\n" for a in addresses))
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MoeshardError(f"--address-file {target}: {exc.strerror or exc}") from None


def _best_first(addresses: list[str]) -> list[str]:
    """Announced names and routable addresses before loopback ones."""
    return sorted(addresses, key=lambda a: ("/127." in a or "/::1/" in a, "/dns" not in a))


def add_keys(sub) -> None:
    p = sub.add_parser("keygen", help="write a new identity key (Ed25519, PEM, mode 0600)")
    p.add_argument(
        "file", help="key file to create (never overwritten; its directory is made if missing)"
    )
    p.set_defaults(func=cmd_keygen)
    p = sub.add_parser(
        "id",
        help="print the id of an identity key (the client's own by default, made on first use): "
        "what nodes' --allow and coordinators' --peers name",
    )
    p.add_argument(
        "file",
        nargs="?",
        help="key file (default: this client's key, key.pem in $MOESHARD_HOME or "
        "~/.config/moeshard, made if there is none yet)",
    )
    p.set_defaults(func=cmd_id)


def cmd_keygen(args) -> int:
    from pathlib import Path

    from moeshard.moe.identity.keys import generate

    parent = Path(args.file).parent
    try:
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise MoeshardError(f"{parent}: cannot make the key's directory ({exc.strerror})") from None
    print(generate(args.file).id)
    return EXIT_OK


def cmd_id(args) -> int:
    from moeshard.moe.identity.keys import CLIENT_KEY, home, load, load_or_make

    if args.file:
        print(load(args.file).id)
        return EXIT_OK
    path = home() / CLIENT_KEY
    identity, made = load_or_make(path)
    if made:
        print(f"moeshard: made this client's key, {path}", file=sys.stderr)
    print(identity.id)
    return EXIT_OK


def check_peer_options(args) -> None:
    """`--expect` only counts what `--discover` or `--bootstrap` finds."""
    expect = getattr(args, "expect", None)
    found_by = getattr(args, "discover", False) or getattr(args, "bootstrap", None)
    if expect is not None and (expect < 1 or not found_by):
        raise MoeshardError("--expect N needs --discover or --bootstrap, and N >= 1")


def client_config(args, **fields):
    """The RemoteConfig of a client command: its key (--key, or the default one) unless
    --insecure."""
    from moeshard.coordinator.remote.config import RemoteConfig

    fields.setdefault("hedge", not getattr(args, "no_hedge", False))
    return RemoteConfig.for_client(args.key, args.insecure, **fields)


def add_shard(sub) -> None:
    p = sub.add_parser(
        "shard",
        help="split a model's experts into per-node shard directories, and write the "
        "coordinator's directory (trunk, tokenizer, Merkle roots; no experts)",
    )
    p.add_argument("model", help="model directory")
    p.add_argument("--nodes", type=int, required=True, help="number of node directories")
    p.add_argument("--replicas", type=int, default=2, help="copies of every expert")
    p.add_argument(
        "--trace", help="usage to balance by: a trace (.npz), a --profile-out JSON, or {'L:E': n}"
    )
    p.add_argument(
        "--capacity",
        metavar="W,W,...",
        help="a relative weight per node (e.g. its RAM in GB times its disk's GB/s): a node of "
        "twice the weight gets twice the expected load, the hottest experts first (default: all "
        "equal)",
    )
    p.add_argument(
        "--domains",
        metavar="D,D,...",
        help="a failure-domain label per node (a house, a power circuit, an uplink): every "
        "expert's replicas go to different domains where there are enough",
    )
    p.add_argument(
        "--out", required=True, help="directory to create (node-00, node-01, ..., coordinator)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it is an earlier shard set or empty, never anything else",
    )
    p.set_defaults(func=cmd_shard)


def cmd_shard(args) -> int:
    from moeshard.moe.convert.placement import shard_model

    capacity = None
    if args.capacity:
        try:
            capacity = [float(w) for w in args.capacity.split(",")]
        except ValueError:
            raise MoeshardError(f"--capacity {args.capacity!r}: numbers, e.g. 16,8,8") from None
        if len(capacity) != args.nodes or not all(0 < w < float("inf") for w in capacity):
            raise MoeshardError(
                f"--capacity: {args.nodes} positive weights, one per node (got {args.capacity!r})"
            )
    domains = None
    if args.domains:
        domains = [d.strip() for d in args.domains.split(",")]
        if len(domains) != args.nodes or not all(domains):
            raise MoeshardError(
                f"--domains: {args.nodes} non-empty labels, one per node (got {args.domains!r})"
            )
    plan = shard_model(
        args.model, args.nodes, args.replicas, args.out, args.trace, args.force, capacity, domains
    )
    for node in plan["nodes"]:
        print(
            f"{node['dir']}: {len(node['experts'])} experts, expected load "
            f"{node['load']:.3f}, {node['bytes'] / 1e6:.1f} MB"
        )
    coord = plan["coordinator"]
    print(
        f"{coord['dir']}: the coordinator's directory (trunk, config, tokenizer, Merkle roots; "
        f"no expert records), {coord['bytes'] / 1e6:.1f} MB (the full model directory: "
        f"{coord['source_bytes'] / 1e6:.1f} MB)"
    )
    if domains is not None:
        kept = "keeps" if plan["survives_any_domain"] else "does NOT keep"
        print(
            f"failure domains {', '.join(sorted(set(domains)))}: losing any one of them "
            f"{kept} a copy of every expert"
        )
    print(f"plan written to {plan['plan_file']}")
    return EXIT_OK


def add_health(sub) -> None:
    p = sub.add_parser("health", help="grpc.health.v1 check of a node (exit 0 if SERVING)")
    p.add_argument("addr", help="[ID@]HOST:PORT (with an id, the node must present that key)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    add_client_identity(p)
    p.set_defaults(func=cmd_health)


def cmd_health(args) -> int:
    from moeshard.coordinator.remote.report import check_health
    from moeshard.moe.identity.tls import client_tls

    config = client_config(args)
    tls = None if config.identity is None else client_tls(config.identity)
    status, node_id = check_health(args.addr, tls, args.timeout)
    print(f"{args.addr}: {status}" + (f" (node {node_id})" if node_id else ""))
    return EXIT_OK if status == "SERVING" else EXIT_INTERNAL


def add_cluster(sub) -> None:
    p = sub.add_parser(
        "cluster",
        help="live nodes, what they hold, coverage, latency (exit 3 if an expert has no live node)",
    )
    p.add_argument("model", help="the coordinator's model directory")
    add_peer_options(p, required=True)
    p.add_argument(
        "--reputation",
        metavar="FILE",
        help="reputation database to show each node's record from (default: reputation.sqlite "
        "in $MOESHARD_HOME or ~/.config/moeshard, if there is one)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    out.add_argument(
        "--peers-list",
        action="store_true",
        help="print only the live nodes as ID@HOST:PORT,... (what --peers takes), on one line",
    )
    p.set_defaults(func=cmd_cluster)


def add_peer_options(p, required: bool) -> None:
    peers = p.add_mutually_exclusive_group(required=required)
    peers.add_argument(
        "--peers", help="experts on remote nodes, pinned by key id: ID@HOST:PORT,ID@HOST:PORT,..."
    )
    peers.add_argument("--discover", action="store_true", help="find nodes with zeroconf")
    peers.add_argument(
        "--bootstrap",
        metavar="ADDR[,ADDR...]",
        help="find nodes in the wide-area registry through these bootstrap peers (nodes "
        "behind NATs too: reached directly, hole-punched or relayed)",
    )
    p.add_argument("--discover-timeout", type=float, default=2.0, help="seconds to browse")
    p.add_argument(
        "--expect",
        type=int,
        metavar="N",
        help="with --discover: browse until N nodes are found, for at most 10 x "
        "--discover-timeout (at least 5 s), and fail with fewer; with --bootstrap: look up "
        "the registry until N nodes are found, for at most --discover-timeout (at least 10 s)",
    )
    p.add_argument(
        "--no-hedge",
        action="store_true",
        help="never send a late node's rows to a replica as well (hedged requests are on by "
        "default: a reply later than the node's recent p95 is hedged once)",
    )
    add_client_identity(p)


def add_audit_options(p) -> None:
    """How the coordinator checks its nodes' work (`generate` and `serve` with nodes)."""
    from moeshard.coordinator.remote.policy import AUDIT_RATE, VETTING_AUDITS

    g = p.add_argument_group("audits (the coordinator recomputes a share of the nodes' work)")
    g.add_argument(
        "--audit",
        type=float,
        default=AUDIT_RATE,
        metavar="P",
        help="share of a vetted node's calls recomputed here, from Merkle-checked records, "
        "and compared bit for bit (0: off)",
    )
    g.add_argument(
        "--audit-new",
        type=int,
        default=VETTING_AUDITS,
        metavar="N",
        help="a node's calls are all recomputed until N audits of it have passed (this run's "
        "plus its reputation's)",
    )
    g.add_argument(
        "--audit-cache",
        metavar="SIZE",
        help="RAM for the expert records audits recompute with (default: the whole model's "
        "when small, else 256M or two calls' worth)",
    )
    g.add_argument(
        "--audit-bytes",
        metavar="SIZE",
        help="cap on the record bytes audits fetch from nodes per generated token, on average "
        "(default: none); every pick's chance is scaled down to keep it",
    )
    g.add_argument(
        "--evidence",
        metavar="DIR",
        help="where fraud proofs of convicted nodes go (default: $MOESHARD_HOME/evidence)",
    )


def audit_settings(args) -> dict:
    """`add_audit_options`' values as RemoteConfig fields."""
    from moeshard.moe.units import parse_size

    return {
        "audit": args.audit,
        "audit_new": args.audit_new,
        "audit_cache": parse_size(args.audit_cache) if args.audit_cache else 0,
        "audit_bytes_per_token": parse_size(args.audit_bytes) if args.audit_bytes else 0,
        "evidence": args.evidence or "",
    }


def add_client_identity(p) -> None:
    p.add_argument(
        "--key",
        help="this client's identity key (default: key.pem in $MOESHARD_HOME or "
        "~/.config/moeshard, made on first use)",
    )
    p.add_argument(
        "--insecure", action="store_true", help="plaintext to nodes on loopback (debugging)"
    )


def cmd_cluster(args) -> int:
    import json
    from pathlib import Path

    from moeshard.coordinator.remote.report import cluster_report, format_cluster
    from moeshard.coordinator.remote.reputation import Reputation, default_path
    from moeshard.coordinator.runtime import find_nodes
    from moeshard.moe.model.model_dir import ModelDir

    model = ModelDir(args.model)
    path = Path(args.reputation) if args.reputation else default_path()
    if args.reputation and not path.exists():
        raise MoeshardError(f"{path}: no such reputation database")
    # Read only: a missing default database is not created (shown as "rep new")
    reputation = Reputation(path if path.exists() else ":memory:")
    config = client_config(args)
    wide = None
    try:
        peers, wide = find_nodes(
            model.model_id,
            args.peers,
            args.discover,
            args.discover_timeout,
            config.identity,
            args.expect,
            split_list(args.bootstrap),
            args.insecure,
            settle=True,
        )
        report = cluster_report(model, peers, config, reputation=reputation)
    finally:
        if wide is not None:
            wide.close()
        reputation.close()
    if args.peers_list:
        live = [n for n in report["nodes"] if n["up"]]
        print(",".join(f"{n['node_id']}@{n['addr']}" if n["node_id"] else n["addr"] for n in live))
    else:
        print(json.dumps(report, indent=2) if args.json else format_cluster(report))
    uncovered = report["coverage"]["0"]
    if uncovered:
        print(f"moeshard: {uncovered} experts have no live node", file=sys.stderr)
        return EXIT_UNCOVERED
    return EXIT_OK
