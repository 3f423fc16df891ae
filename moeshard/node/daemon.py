"""The node daemon: serve the expert records of one model (or shard) directory over gRPC.

`moeshard node DIR` opens DIR (a full model directory or a shard directory from
`moeshard shard`; only the shard files its manifest lists are opened), verifies every record's
checksum, serves moeshard.v1.ExpertNode + grpc.health.v1 under its limits (node/limits.py) and
advertises itself with zeroconf.
SIGTERM / SIGINT: stop advertising, report NOT_SERVING, finish in-flight calls, exit 0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from moeshard.moe import sigint
from moeshard.moe.errors import MoeshardError
from moeshard.moe.experts.backend import ExpertsBackend
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.experts.store import ExpertStore
from moeshard.moe.identity.keys import NODE_KEY, load_or_create
from moeshard.moe.identity.tls import TLSMaterial, accepts_tls12, client_tls, node_tls
from moeshard.moe.kernels import quant
from moeshard.moe.ledger import open_ledger
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.budget import expert_slots
from moeshard.moe.storage.io import align_up
from moeshard.moe.storage.manifest import FORMAT_VERSION
from moeshard.moe.wire import health_pb2_grpc
from moeshard.moe.wire.constants import MAX_MESSAGE_BYTES, WIRE_VERSION
from moeshard.moe.wire.hosts import advertised_addresses, is_loopback
from moeshard.moe.wire.names import name_problem, safe_node_name
from moeshard.node.access import AccessPolicy
from moeshard.node.checks import NodeIdentity
from moeshard.node.health import HealthServicer
from moeshard.node.limits import Limits
from moeshard.node.servicer import ExpertNodeServicer

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@dataclass
class NodeConfig:
    path: str  # model or shard directory to serve
    host: str = "127.0.0.1"  # address to bind ("0.0.0.0" = every interface)
    port: int = 0  # port to bind (0 = any free port, printed on start)
    ram: int = 0  # expert cache budget in bytes (0 = unbounded)
    advertise: bool = True  # register the service with zeroconf
    name: str = ""  # a display name ("" = hostname-port); the node's id is its key's
    key: str = ""  # identity key file ("" = node-key.pem in the served directory)
    allow: frozenset[str] = frozenset()  # client ids allowed to call (with TLS)
    allow_any: bool = False  # any authenticated client may call (public compute)
    insecure: bool = False  # plaintext, no identities: loopback only, for debugging
    verify: bool = True  # recompute every record checksum at start
    limits: Limits = field(default_factory=Limits)  # what clients may make it do (node/limits.py);
    # its zero fields are derived at start from the RAM budget and the model (Limits.resolve)
    grace_s: float = 10.0  # on SIGTERM, how long in-flight calls may take to finish
    ledger: str = ""  # receipts issued, settlements accepted ("" = moe.ledger.default_path)
    bootstrap: tuple[
        str, ...
    ] = ()  # wide-area registry: bootstrap peers' multiaddrs (node/wide.py)
    p2p_listen: tuple[str, ...] = ()  # the p2p daemon's listen multiaddrs (() = any port, tcp+quic)


def make_backend(model: ModelDir, ram: int) -> ExpertsBackend:
    """The experts backend: unbounded LocalExperts, or with --ram the RAM-budgeted ExpertStore
    (O_DIRECT reads into a fixed arena of `ram` bytes of expert slots, LRU, prefetch)."""
    if ram <= 0:
        return LocalExperts(model.shard_set)
    c = model.config
    slot = align_up(model.shard_set.record_nbytes)
    held = len(model.locations)
    slots = expert_slots(ram, slot, held, c.top_k, c.top_k)
    log.info("expert cache: %d slots of %d B (%d records held)", slots, slot, held)
    return ExpertStore(model.shard_set, slots, c.top_k, prefetch_slots=c.top_k)


def resolve_limits(model: ModelDir, config: NodeConfig) -> Limits:
    """config.limits with its derived fields filled in, from the node's RAM budget (the expert
    cache, --ram, or without one the bytes of the records it holds) and the model's sizes."""
    c = model.config
    budget = config.ram if config.ram > 0 else len(model.locations) * model.shard_set.record_nbytes
    row_bytes = 4 * c.expert_hidden + 8 * c.top_k  # one f32 row on the wire: hidden, ids, weights
    return config.limits.resolve(budget, row_bytes, len(c.moe_layers))


def create_server(
    addr: str,
    servicer: ExpertNodeServicer,
    health: HealthServicer,
    tls: TLSMaterial | None = None,
) -> tuple[grpc.Server, int]:
    """A ready (not started) gRPC server on `addr` ('host:port', port 0 = any): mutual TLS
    with `tls` (clients must present a certificate), plaintext without. grpc refuses a request
    message over the servicer's max_request_bytes before decoding it; the thread pool has room
    for every call and stream the limits admit, and spares for health checks."""
    limits = servicer.limits
    options = [
        ("grpc.max_receive_message_length", limits.max_request_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        # no BDP probing: it grows every stream's receive window far past the message the
        # servicer is reading (grpc opens the window for that one anyway), so 8 streams that
        # never take their replies held 220-320 MiB more in grpc's buffers, outside the
        # stated bound (tests/test_strangers.py: peak 630-750 MiB with it, 416-431 without)
        ("grpc.http2.bdp_probe", 0),
    ]
    pool = futures.ThreadPoolExecutor(limits.workers(), thread_name_prefix="grpc")
    server = grpc.server(pool, options=options)
    servicer.register(server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if tls is None:
        port = server.add_insecure_port(addr)
    else:
        credentials = grpc.ssl_server_credentials(
            [(tls.key, tls.chain)], root_certificates=tls.client_root, require_client_auth=True
        )
        port = server.add_secure_port(addr, credentials)
    if port == 0:
        raise MoeshardError(f"cannot bind {addr}")
    return server, port


class Node:
    """One node: its records, backend, servicers; start() binds and serves, stop() drains."""

    def __init__(self, config: NodeConfig):
        self.config = config
        if config.insecure and not is_loopback(config.host):
            raise MoeshardError(f"--insecure serves plaintext: only on loopback, not {config.host}")
        if config.name and name_problem(config.name):
            raise MoeshardError(f"--name: {name_problem(config.name)}")
        if not config.insecure and not config.allow and not config.allow_any:
            raise MoeshardError(
                "say who may call this node: --allow ID[,ID...] or FILE, or --allow-any "
                "(or --insecure on loopback)"
            )
        self.model = ModelDir(config.path)
        self.model.require_experts(
            "serve a node directory of its shard set (node-NN beside it), or the full model "
            "directory"
        )
        self.key = load_or_create(config.key or self.model.path / NODE_KEY)
        self.tls = None if config.insecure else node_tls(self.key)
        ledger = open_ledger(config.ledger, self.key, "node")  # the file is made on first use
        access = AccessPolicy(not config.insecure, config.allow, config.allow_any)
        held = set(self.model.locations)
        bad: set[tuple[int, int]] = set()
        if config.verify:
            for shard in self.model.shards:
                for key in shard.verify_all():
                    log.error(
                        "%s: expert %d of layer %d fails its checksum", shard.path, *key[::-1]
                    )
                    bad.add(key)
        c = self.model.config
        self.limits = resolve_limits(self.model, config)
        self.identity = NodeIdentity(
            node_id=self.key.id,
            name=config.name,
            model_id=self.model.model_id,
            format_version=FORMAT_VERSION,
            model_type=c.model_type,
            expert_format=self.model.expert_format,
            hidden_size=c.expert_hidden,
            n_experts=c.n_experts,
            moe_layers=tuple(c.moe_layers),
            ram_budget=config.ram,
        )
        self.servicer = ExpertNodeServicer(
            self.identity,
            held,
            make_backend(self.model, config.ram),
            access,
            self.key,
            limits=self.limits,
            shards=self.model.shard_set,
        )
        self.servicer.bad.update(bad)
        self.servicer.ledger = ledger
        self.health = HealthServicer(self.limits.max_watches)
        self.server: grpc.Server | None = None
        self.port = 0
        self.announcer = None
        self.wide = None  # the wide-area registry's publisher (with --bootstrap)

    def start(self) -> int:
        cfg = self.config
        quant.warmup()  # compile (or load) the kernels before the first request
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        self.server, self.port = create_server(
            f"{host}:{cfg.port}", self.servicer, self.health, self.tls
        )
        if not self.identity.name:
            self.identity.name = safe_node_name(f"{socket.gethostname()}-{self.port}"[:60])
        self.server.start()
        if self.tls is not None:
            self._refuse_tls12(host)
        self.health.set_serving(True)
        if cfg.advertise:
            from moeshard.node.announce import Announcer

            self.announcer = Announcer(
                self.key,
                self.identity.name,
                self.identity.model_id,
                FORMAT_VERSION,
                WIRE_VERSION,
                self.servicer.held - self.servicer.bad,
                cfg.host,
                self.port,
            )
            self.announcer.start()
        if cfg.bootstrap:
            if self.tls is None:
                raise MoeshardError("--bootstrap needs TLS: a relay must see only ciphertext")
            from moeshard.node.wide import WidePublisher

            self.wide = WidePublisher(
                self.key,
                self.identity.name,
                self.identity.model_id,
                FORMAT_VERSION,
                WIRE_VERSION,
                self.servicer.held - self.servicer.bad,
                self.port,
                list(cfg.bootstrap),
                cfg.host,
                list(cfg.p2p_listen) or None,
                key_file=_p2p_key_file(self.key.path),
            )
        return self.port

    def _refuse_tls12(self, host: str) -> None:
        """Stop and raise if this server completes a TLS 1.2 handshake (grpcio was imported
        before moe set its cipher list: see moe/__init__.py). One handshake, a few ms."""
        probe = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "[::]" else host
        if accepts_tls12(probe.strip("[]"), self.port, client_tls(self.key)):
            self.server.stop(0)
            raise MoeshardError(
                "this node completes TLS 1.2 handshakes: grpc was imported before moe set "
                f"GRPC_SSL_CIPHER_SUITES (now {os.environ.get('GRPC_SSL_CIPHER_SUITES')!r}); "
                "import moeshard first"
            )

    def stop(self) -> None:
        if self.announcer is not None:
            self.announcer.close()
            self.announcer = None
        if self.wide is not None:
            self.wide.close()
            self.wide = None
        self.health.set_serving(False)
        if self.server is not None:
            self.server.stop(self.config.grace_s).wait()
            self.server = None
        self.servicer.close()
        self.model.close()


def run(config: NodeConfig, out) -> int:
    """The `moeshard node` process: serve until SIGTERM/SIGINT, then drain and return 0."""
    return_big_buffers()
    node = Node(config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sigint.install(lambda *_: stop.set())  # (not when it came ignored: a background job)
    port = node.start()
    held = node.servicer.held - node.servicer.bad
    ident = node.identity
    print(
        f"node {ident.name} id {ident.node_id} serving {len(held)} experts of model "
        f"{ident.model_id[:16]} on {config.host}:{port}"
        + (" (plaintext, --insecure)" if config.insecure else " (TLS)")
        + ("" if config.advertise else " (not advertised)"),
        file=out,
        flush=True,
    )
    first, *others = advertised_addresses(config.host)  # what the announcement carries too
    also = f" (this host's other addresses: {', '.join(others)})" if others else ""
    print(f"as --peers: {ident.node_id}@{first}:{port}{also}", file=out, flush=True)
    if node.wide is not None:
        from moeshard.node.wide import reachability

        print(
            f"p2p: peer {node.wide.peer_id} in the registry of {len(config.bootstrap)} "
            f"bootstrap peer(s); {reachability(node.wide.addresses)}",
            file=out,
            flush=True,
        )
    print(f"limits: {node.limits.summary()}", file=out, flush=True)
    print(f"ledger: {node.servicer.ledger.path}", file=out, flush=True)
    if node.servicer.bad:
        print(f"warning: {len(node.servicer.bad)} records failed their checksum", file=out)
    stop.wait()
    log.info("shutting down: draining in-flight calls")
    node.stop()
    print(f"node {ident.name} stopped", file=out, flush=True)
    return 0


def return_big_buffers() -> None:
    """Have glibc's malloc map allocations of 1 MiB and up on their own and unmap them when
    freed. By default its threshold climbs to the largest buffer freed so far (up to 32 MiB), so
    after a burst of large requests their freed buffers stay in per-thread arenas and RSS stays
    high. No-op where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _p2p_key_file(identity_path) -> Path | None:
    """The node's libp2p key beside its identity key (`node-key.pem` -> `node-key.p2p`): its
    peer id then survives restarts, so coordinators keep their tunnel to it."""
    return None if identity_path is None else Path(identity_path).with_suffix(".p2p")
