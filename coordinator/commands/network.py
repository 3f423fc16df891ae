"""The node network: node, shard, health, cluster."""

from __future__ import annotations

import sys

from coordinator.commands import EXIT_INTERNAL, EXIT_OK


def add_node(sub) -> None:
    p = sub.add_parser("node", help="serve a model or shard directory's experts over gRPC")
    p.add_argument("path", help="model directory or shard directory (from `moeshard shard`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=0, help="port (0: any free port, printed)")
    p.add_argument("--ram", default="0", help="expert cache budget, e.g. 8G (0: unbounded)")
    p.add_argument("--node-id", default="", help="node name (default hostname-port)")
    p.add_argument("--no-advertise", action="store_true", help="do not announce via zeroconf")
    p.add_argument("--no-verify", action="store_true", help="skip the start-up checksum pass")
    p.set_defaults(func=cmd_node)


def cmd_node(args) -> int:
    from moe.units import parse_size
    from node.daemon import NodeConfig, run

    config = NodeConfig(
        path=args.path,
        host=args.host,
        port=args.port,
        ram=parse_size(args.ram),
        advertise=not args.no_advertise,
        node_id=args.node_id,
        verify=not args.no_verify,
    )
    return run(config, sys.stdout)


def add_shard(sub) -> None:
    p = sub.add_parser("shard", help="split a model's experts into per-node shard directories")
    p.add_argument("model", help="model directory")
    p.add_argument("--nodes", type=int, required=True, help="number of node directories")
    p.add_argument("--replicas", type=int, default=2, help="copies of every expert")
    p.add_argument(
        "--trace", help="usage to balance by: a trace (.npz), a --profile-out JSON, or {'L:E': n}"
    )
    p.add_argument("--out", required=True, help="directory to create (node-00, node-01, ...)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=cmd_shard)


def cmd_shard(args) -> int:
    from moe.convert.placement import shard_model

    plan = shard_model(args.model, args.nodes, args.replicas, args.out, args.trace, args.force)
    for node in plan["nodes"]:
        print(
            f"{node['dir']}: {len(node['experts'])} experts, expected load "
            f"{node['load']:.3f}, {node['bytes'] / 1e6:.1f} MB"
        )
    print(f"plan written to {plan['plan_file']}")
    return EXIT_OK


def add_health(sub) -> None:
    p = sub.add_parser("health", help="grpc.health.v1 check of a node (exit 0 if SERVING)")
    p.add_argument("addr", help="HOST:PORT")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    p.set_defaults(func=cmd_health)


def cmd_health(args) -> int:
    from coordinator.remote.report import check_health

    status = check_health(args.addr, args.timeout)
    print(f"{args.addr}: {status}")
    return EXIT_OK if status == "SERVING" else EXIT_INTERNAL


def add_cluster(sub) -> None:
    p = sub.add_parser("cluster", help="live nodes, what they hold, coverage, latency")
    p.add_argument("model", help="the coordinator's model directory")
    add_peer_options(p, required=True)
    p.set_defaults(func=cmd_cluster)


def add_peer_options(p, required: bool) -> None:
    peers = p.add_mutually_exclusive_group(required=required)
    peers.add_argument("--peers", help="experts on remote nodes: HOST:PORT,HOST:PORT,...")
    peers.add_argument("--discover", action="store_true", help="find nodes with zeroconf")
    p.add_argument("--discover-timeout", type=float, default=2.0, help="seconds to browse")


def cmd_cluster(args) -> int:
    from coordinator.remote.discovery import resolve_peers
    from coordinator.remote.report import describe_cluster
    from moe.model.model_dir import ModelDir

    model = ModelDir(args.model)
    peers = resolve_peers(model.model_id, args.peers, args.discover, args.discover_timeout)
    print(describe_cluster(model, peers))
    return EXIT_OK
