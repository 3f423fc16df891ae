"""The wide-area registry (`--bootstrap`) on loopback, with real go-libp2p daemons: nodes found
by model id alone, calls through tunnelled streams, and the records a reader must ignore.
(Across NATs: the namespace testbed, `tools/testbed.py --only p2p`.)"""

from __future__ import annotations

import time

import pytest
from helpers import client_key, node_process

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.wide import WideDirectory
from moeshard.coordinator.runtime import open_local, open_remote
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity.keys import generate as make_key
from moeshard.moe.identity.signed import sign_announcement
from moeshard.moe.p2p import addrs
from moeshard.moe.p2p.daemon import P2PDaemon, hub_args, load_or_make_key, peer_args, peer_id_of_key
from moeshard.moe.p2p.registry import GRPC_PROTOCOL, RECORD_PROTOCOL, registry_key, write_record
from moeshard.moe.p2p.relay import Relay, RelayLimits
from moeshard.moe.p2p.tunnel import Forward, Inbound, open_relayed
from moeshard.moe.storage.manifest import FORMAT_VERSION

HUB_PER_PEER = 3


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A bootstrap and relay peer; yields its --bootstrap address."""
    key = tmp_path_factory.mktemp("hub") / "hub.p2p"
    daemon = P2PDaemon(hub_args(["/ip4/127.0.0.1/tcp/0"]), key_file=key)
    assert daemon.peer_id == peer_id_of_key(load_or_make_key(key))  # our key file, its id
    relay = Relay(daemon.control, RelayLimits(streams=8, per_peer=HUB_PER_PEER))
    yield f"{daemon.addresses()[0]}/p2p/{daemon.peer_id}"
    relay.close()
    daemon.close()


def test_multiaddrs_and_peer_ids_round_trip():
    for text in (
        "/ip4/10.1.2.3/tcp/4001",
        "/ip6/::1/udp/4001/quic-v1",
        "/dns4/boot.example.org/tcp/4001/p2p/12D3KooWGdAeBnmiEp4oG1ZSvLuhyC63JUheoL5hGmExYuA6W9Ec",
        "/ip4/11.0.0.1/tcp/4001/p2p/12D3KooWGdAeBnmiEp4oG1ZSvLuhyC63JUheoL5hGmExYuA6W9Ec"
        "/p2p-circuit/p2p/12D3KooWNeXUo81WQ8VUTY272DHBjvXRUUc8eyuyzZY5rkeQCyM9",
        "/unix/tmp/a b/c.sock",
    ):
        assert addrs.decode(addrs.encode(text)) == text
    for bad in ("ip4/1.2.3.4", "/ip4/1.2.3.400/tcp/1", "/ip4/1.2.3.4/sctp/1", "/p2p/0OIl"):
        with pytest.raises(MoeshardError):
            addrs.encode(bad)
    with pytest.raises(MoeshardError, match="--bootstrap"):
        peer_args(["/ip4/0.0.0.0/tcp/0"], [])
    with pytest.raises(MoeshardError, match="no peer id"):
        peer_args(["/ip4/0.0.0.0/tcp/0"], ["/ip4/1.2.3.4/tcp/1"])
    with pytest.raises(MoeshardError, match="nonsense"):
        hub_args(["nonsense"])


@pytest.fixture(scope="module")
def sharded(converted, tmp_path_factory):
    model = converted("qwen3_moe")
    out = tmp_path_factory.mktemp("wide") / "shards"
    plan = shard_model(model, 2, 1, out, force=True)
    return model, out, plan


def test_nodes_found_by_model_id_give_the_same_tokens(sharded, hub, capsys):
    """Two nodes join through the bootstrap peer only (no zeroconf, no addresses given); a
    coordinator that knows the model and the bootstrap address finds both, calls them through
    its tunnels with their TLS pinned, and decodes what one process decodes."""
    model, out, plan = sharded
    # the first bound to every interface: its record lists TCP endpoints, which the
    # coordinator dials straight (pin-checked); the second on loopback only: a p2p stream
    hosts = ["0.0.0.0", "127.0.0.1"]
    nodes = [
        node_process(n["dir"], "--bootstrap", hub, "--host", host)
        for n, host in zip(plan["nodes"], hosts, strict=True)
    ]
    try:
        opts = SamplingOptions(max_tokens=12)
        local = open_local(model)
        want = generate(local.transformer, [5, 6, 7, 8], opts).tokens
        local.close()
        config = RemoteConfig(identity=client_key())
        rt = open_remote(out / "coordinator", remote_config=config, expect=2, bootstrap=[hub])
        try:
            found = {n.spec.node_id for n in rt.wide.nodes.values()}
            assert found == {n.node_id for n in nodes}
            assert generate(rt.transformer, [5, 6, 7, 8], opts).tokens == want
            via = {n.spec.node_id: n.via for n in rt.wide.nodes.values()}
            assert [via[n.node_id] for n in nodes] == ["tcp", "direct"]
            assert all(c["calls"] > 0 for c in rt.experts.stats()["nodes"])
            assert all("p2p: peer 12D3" in n.text() for n in nodes)  # printed at start
        finally:
            rt.close()
        # `cluster` and `audit` find them the same way
        import json

        from moeshard.cli import main

        found_by = ["--bootstrap", hub, "--expect", "2", "--key", str(client_key().path)]
        assert main(["cluster", str(out / "coordinator"), *found_by, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert sorted(n["node_id"] for n in report["nodes"] if n["up"]) == sorted(
            n.node_id for n in nodes
        )
        assert report["coverage"]["0"] == 0
        assert main(["audit", str(out / "coordinator"), *found_by, "--rounds", "1", "--json"]) == 0
        audits = json.loads(capsys.readouterr().out)["nodes"]
        assert [a["status"] for a in audits] == ["passed", "passed"]
    finally:
        for n in nodes:
            n.stop()


def test_calls_spliced_by_the_relay_carry_far_past_the_circuit_cap(sharded, hub):
    """A coordinator with no connection to a node reaches it through the bootstrap peer's
    relay (as one behind another NAT does): 2 MiB of expert calls go through, with the
    node's TLS pinned end to end; the daemon's own circuit would have reset the connection
    after 128 KiB. The relay refuses a target not connected to it, garbage, and a peer's
    streams past its per-peer limit."""
    import re

    from moeshard.bench.p2p import _for_an_expert_it_holds
    from moeshard.bench.rpc import _forward
    from moeshard.coordinator.remote.transport import PeerSpec, dial
    from moeshard.moe.identity.tls import client_tls
    from moeshard.moe.model.model_dir import ModelDir
    from moeshard.moe.wire import codec
    from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc

    model, out, plan = sharded
    node = node_process(plan["nodes"][0]["dir"], "--bootstrap", hub)
    relay_id = hub.rsplit("/p2p/", 1)[1]
    coordinator = P2PDaemon(peer_args(["/ip4/127.0.0.1/tcp/0"], [hub]))
    forward = channel = None
    held: list = []
    try:
        node_peer = re.search(r"p2p: peer (\w+)", node.text()).group(1)
        forward = Forward(coordinator.control, node_peer, GRPC_PROTOCOL, [relay_id])
        channel, _ = dial(
            PeerSpec(f"127.0.0.1:{forward.port}", node.node_id), client_tls(client_key()), 10.0
        )
        stub = pb_grpc.ExpertNodeStub(channel)
        request, _ = _forward(ModelDir(out / "coordinator"), 64, codec.F32)  # ~16 KB
        request = _for_an_expert_it_holds(stub, request)
        sent = 0
        while sent < 2 << 20:
            reply = stub.Forward(request, timeout=10.0)
            sent += request.ByteSize() + reply.ByteSize()
        assert forward.path == "relayed"
        # the limits: one stream is the channel's; fill up to the per-peer limit, then refused
        held = [open_relayed(coordinator.control, relay_id, node_peer)]
        held += [open_relayed(coordinator.control, relay_id, node_peer)]
        with pytest.raises(MoeshardError, match="streams from you are open already"):
            open_relayed(coordinator.control, relay_id, node_peer)
        stranger = "12D3KooWNeXUo81WQ8VUTY272DHBjvXRUUc8eyuyzZY5rkeQCyM9"
        for s in held:
            s.close()
        freed_by = time.monotonic() + 10
        while True:  # the slots come back when the closed streams end on the relay's side
            try:
                open_relayed(coordinator.control, relay_id, node_peer).close()
                break
            except MoeshardError:
                if time.monotonic() > freed_by:
                    raise
                time.sleep(0.2)
        with pytest.raises(MoeshardError, match="not connected to this relay"):
            open_relayed(coordinator.control, relay_id, stranger)
        sock, _ = coordinator.control.open_stream(relay_id, "/moeshard/relay/1")
        sock.sendall(b"x" * 300)  # no line: closed
        sock.settimeout(10)
        assert sock.recv(100) == b""
        sock.close()
    finally:
        for s in held:
            s.close()
        if channel is not None:
            channel.close()
        if forward is not None:
            forward.close()
        coordinator.close()
        node.stop()


def test_forged_expired_foreign_and_replayed_records_are_ignored(hub, tmp_path):
    """Peers that provide the model's key but serve records a reader must not use: each is
    ignored, with its reason; an honest one beside them is kept."""
    model_id = "ab" * 32
    key = make_key(tmp_path / "k.pem")
    fields = {
        "name": "n", "model_id": model_id, "fmt": str(FORMAT_VERSION), "wire": "1", "records": "1"
    }  # fmt: skip
    daemons, inbound = [], []

    def peer_serving(make_record) -> str:
        d = P2PDaemon(peer_args(["/ip4/127.0.0.1/tcp/0"], [hub]))
        record = make_record(d.peer_id)

        def serve(sock, _peer):
            write_record(sock, record)
            sock.settimeout(5)
            while sock.recv(64):  # the reader closes first
                pass
            sock.close()

        inbound.append(Inbound(d.control, RECORD_PROTOCOL, serve=serve))
        daemons.append(d)
        for _ in range(50):  # the DHT may not have the hub in its table yet
            try:
                d.control.provide(registry_key(model_id))
                break
            except MoeshardError:
                time.sleep(0.1)
        return d.peer_id

    def forged(p2p):
        record = sign_announcement(key, dict(fields, p2p=p2p))
        return dict(record, records="9999")  # changed after signing

    def expired(p2p):
        return sign_announcement(key, dict(fields, p2p=p2p), now=time.time() - 600, ttl_s=120)

    def foreign(p2p):
        return sign_announcement(key, dict(fields, p2p=p2p, model_id="cd" * 32))

    def replayed(p2p):
        return sign_announcement(
            key, dict(fields, p2p="12D3KooWNeXUo81WQ8VUTY272DHBjvXRUUc8eyuyzZY5rkeQCyM9")
        )

    def honest(p2p):
        return sign_announcement(key, dict(fields, p2p=p2p))

    try:
        bad = {peer_serving(f): f.__name__ for f in (forged, expired, foreign, replayed)}
        good = peer_serving(honest)
        directory = WideDirectory(model_id, [hub])
        try:
            found = directory.lookup(timeout_s=5, expect=5)  # waits: reads every provider
            assert [n.peer_id for n in found] == [good]
            why = {bad[p]: reason for p, reason in directory.ignored.items()}
            assert "bad signature" in why["forged"]
            assert "expired" in why["expired"]
            assert "another model" in why["foreign"]
            assert "replayed" in why["replayed"]
        finally:
            directory.close()
    finally:
        for i in inbound:
            i.close()
        for d in daemons:
            d.close()


def test_a_daemon_dies_with_its_process(tmp_path):
    """A node killed without cleaning up must not leave its daemon announcing it."""
    import subprocess
    import sys

    code = (
        "from moeshard.moe.p2p.daemon import P2PDaemon, hub_args; import os, time; "
        "d = P2PDaemon(hub_args(['/ip4/127.0.0.1/tcp/0'])); print(d.proc.pid, flush=True); "
        "time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    for _ in range(50):
        try:
            status = open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            break
        if "State:\tZ" in status:  # exited, not yet reaped by init
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"p2pd {pid} outlived its parent")
