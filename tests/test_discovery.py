"""Zeroconf discovery on loopback: nodes of another model are ignored, a node bound to every
interface is found at a real address, and a node started later joins a running generation.
The cluster fixtures are in conftest.py."""

from __future__ import annotations

import functools
import logging
import subprocess
import sys

import grpc
import pytest
from helpers import PROMPT, ROOT, TOKENS, client_key, wait_until

from coordinator.generate import SamplingOptions, generate
from coordinator.remote.config import RemoteConfig
from coordinator.remote.discovery import address_rank, browse, local_networks
from coordinator.remote.experts import RemoteExperts
from coordinator.remote.transport import PeerSpec, dial
from coordinator.runtime import open_local
from moe.identity.tls import client_tls
from moe.model.model_dir import ModelDir
from moe.wire import moeshard_pb2 as pb
from moe.wire import moeshard_pb2_grpc as pb_grpc
from node.announce import advertised_addresses
from node.daemon import Node, NodeConfig

BROWSE_S = 1.5  # one zeroconf browse; a wait repeats it (mDNS answers can be late)
CLIENT = client_key()
ALLOW = frozenset({CLIENT.id})


def test_foreign_model_node_is_ignored(cluster_model, converted, cluster, caplog):
    other = Node(
        NodeConfig(path=str(converted("qwen3_moe", experts="bf16")), name="foreign", allow=ALLOW)
    )
    port = other.start()  # advertised too
    try:
        model = ModelDir(cluster_model)
        with caplog.at_level(logging.WARNING):
            foreign = PeerSpec(f"127.0.0.1:{port}", other.identity.node_id)
            remote = RemoteExperts(
                model.model_id,
                64,
                [foreign, cluster[0].spec],
                RemoteConfig(identity=CLIENT, audit=0),
            )
        try:
            assert [p.addr for p in remote.peers.peers] == [cluster[0].addr]
            assert "differs" in remote.peers.ignored[f"127.0.0.1:{port}"]
        finally:
            remote.close()
        # Discovery sees every node, keeps the three of this model, warns about the other.
        found: set[str] = set()

        def cluster_found_and_foreign_warned() -> bool:
            found.update(n.addr for n in browse(model.model_id, timeout=BROWSE_S))
            warned = any("foreign" in r.getMessage() for r in caplog.records)
            return warned and found >= {n.addr for n in cluster}

        with caplog.at_level(logging.WARNING):
            wait_until(
                cluster_found_and_foreign_warned,
                10,
                0.0,
                what="a browse to find the cluster's three nodes and warn about 'foreign'",
            )
        assert f"127.0.0.1:{port}" not in found
        assert any(
            "foreign" in r.getMessage() and "model id" in r.getMessage() for r in caplog.records
        )
        all_nodes: set[str] = set()

        def foreign_listed() -> bool:
            all_nodes.update(n.name for n in browse(None, timeout=BROWSE_S))
            return "foreign" in all_nodes

        wait_until(foreign_listed, 10, 0.0, what="a browse of every model to list 'foreign'")
        # A request carrying the wrong model id is refused by the node itself.
        channel, _ = dial(foreign, client_tls(CLIENT), 5)
        with channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ExpertNodeStub(channel).Forward(
                    pb.ForwardRequest(model_id=model.model_id, layer=0), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        other.stop()


def test_node_on_all_interfaces_is_discovered_at_a_real_address(cluster_model):
    node = Node(
        NodeConfig(path=str(cluster_model), host="0.0.0.0", name="all-interfaces", allow=ALLOW)
    )
    port = node.start()
    try:
        found = wait_until(
            lambda: [
                n for n in browse(node.identity.model_id, BROWSE_S) if n.name == "all-interfaces"
            ],
            10,
            0.0,
            what="zeroconf to find the node 'all-interfaces'",
        )
        host, _, got_port = found[0].addr.rpartition(":")
        assert int(got_port) == port
        # a real interface when there is one; of several, one on a network that is up here
        networks = local_networks()
        ranks = {a: address_rank(a, networks) for a in advertised_addresses("0.0.0.0")}
        assert host in ranks and ranks[host] == min(ranks.values()), (host, ranks)
        assert found[0].node_id == node.identity.node_id  # the announced id is the key's
        channel, seen = dial(found[0].spec, client_tls(CLIENT), 5)
        with channel:
            info = pb_grpc.ExpertNodeStub(channel).Info(pb.InfoRequest(), timeout=5)
        assert info.name == "all-interfaces" and info.node_id == seen == node.identity.node_id
    finally:
        node.stop()
    # Unregistered on stop: a fresh browse no longer sees it.
    assert "all-interfaces" not in {n.name for n in browse(None, BROWSE_S)}


def test_node_started_later_joins_a_running_generation(converted, tmp_path):
    """With --discover the coordinator keeps browsing: a node announced after start-up is
    admitted (its id not doubled), and once the first node dies the late one carries the
    generation to the same tokens as one machine. A model id of its own keeps other tests'
    nodes out of the picture."""
    from coordinator.runtime import open_remote

    path = converted("qwen3_moe", experts="q8_0")
    local = open_local(path)
    want = generate(local.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS)).tokens
    early = Node(NodeConfig(path=str(path), name="early", allow=ALLOW))
    early.start()
    late = None
    rt = None
    try:
        config = RemoteConfig(identity=CLIENT)
        rt = open_remote(path, discover=True, discover_timeout=BROWSE_S, remote_config=config)
        remote = rt.experts
        assert [p.name for p in remote.live_peers()] == ["early"]
        # the same directory, but a node of its own: its own key (the default key lives in
        # the directory, so two nodes serving one directory would be one node)
        late = Node(NodeConfig(path=str(path), name="late", allow=ALLOW, key=str(tmp_path / "k")))
        late.start()
        wait_until(  # mDNS announcements can be slow on a loaded box
            lambda: "late" in {p.name for p in remote.live_peers()},
            20,
            0.1,
            what="the browsing coordinator to admit the node 'late'",
        )
        assert sorted(p.name for p in remote.live_peers()) == ["early", "late"]
        known = PeerSpec(f"127.0.0.1:{late.port}", late.identity.node_id)
        assert not remote.add_peer(known)  # known: not added twice
        early.stop()
        got = generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS)).tokens
        assert got == want
        assert next(p for p in remote.peers.peers if p.name == "late").calls > 0
    finally:
        if rt is not None:
            rt.experts.close()
        if late is not None:
            late.stop()
        early.stop()


def test_cluster_report_waits_for_the_expected_nodes_and_flags_missing_experts(
    cluster_model, cluster
):
    """`cluster --discover --expect 3` finds the three nodes (none missed on a first browse)
    and exits 0; one node alone of a two-replica split leaves experts uncovered: exit 3."""
    cli = [sys.executable, "-m", "coordinator.cli", "cluster", str(cluster_model)]
    key = ["--key", str(CLIENT.path)]
    run = functools.partial(subprocess.run, capture_output=True, text=True, cwd=ROOT)
    full = run([*cli, "--discover", "--expect", "3", "--discover-timeout", "1", *key])
    assert full.returncode == 0, full.stderr
    assert all(n.node_id in full.stdout for n in cluster)
    assert "0 with 0 live replicas" in full.stdout
    one = run([*cli, "--peers", str(cluster[0].spec), *key])
    assert one.returncode == 3 and "have no live node" in one.stderr
    missing = run([*cli, "--discover", "--expect", "9", "--discover-timeout", "0.5", *key])
    assert missing.returncode == 2 and "of the 9 expected nodes" in missing.stderr


def test_the_address_dialled_is_on_a_network_that_is_up_here():
    """Of a record's addresses, one on a network of an interface that is up here comes
    first, then one of an interface that is down, then the rest (record order breaks ties)."""
    from ipaddress import ip_network

    from coordinator.remote import discovery

    nets = [(ip_network("192.0.2.0/24"), True), (ip_network("172.17.0.0/16"), False)]
    real = discovery.local_networks
    discovery.local_networks = lambda: nets
    try:
        assert discovery.best_address(["172.17.0.1", "198.51.100.7", "192.0.2.9"]) == "192.0.2.9"
        assert discovery.best_address(["198.51.100.7", "172.17.0.1"]) == "172.17.0.1"
        assert discovery.best_address(["198.51.100.7", "203.0.113.1"]) == "198.51.100.7"
    finally:
        discovery.local_networks = real
