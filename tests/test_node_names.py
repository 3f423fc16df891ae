"""Node names are 1-64 characters of [A-Za-z0-9._-] (moe/wire/names.py): a node refuses to
start with another --name (one line, exit 2), and a coordinator admitting a node that calls
itself something else (a newline injected lines into /metrics) uses the safe form."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, client_key

from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.experts import RemoteExperts
from moeshard.coordinator.remote.transport import PeerSpec
from moeshard.moe.errors import MoeshardError
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.wire.names import name_problem, safe_node_name
from moeshard.node.daemon import Node, NodeConfig

CLIENT = client_key()
EVIL = "evil\nmoeshard_requests_total 999999"


def test_the_safe_form_of_a_name():
    assert safe_node_name("node-1.lan_a") == "node-1.lan_a" and not name_problem("node-1.lan_a")
    assert safe_node_name(EVIL) == "evil_moeshard_requests_total_999999"
    assert safe_node_name("é" * 100) == "_" * 64 and safe_node_name("") == "_"
    assert name_problem("a b") and name_problem("x" * 65) and name_problem("")


@pytest.mark.parametrize("bad", [EVIL, "a b", "x" * 65, 'q"}'])
def test_a_node_refuses_a_bad_name(converted, bad):
    with pytest.raises(MoeshardError, match="--name"):
        Node(NodeConfig(path=str(converted("qwen3_moe")), name=bad, allow_any=True))


def test_the_node_command_exits_2_with_one_line(converted):
    out = subprocess.run(
        [sys.executable, "-m", "moeshard", "node", str(converted("qwen3_moe"))]
        + ["--name", EVIL, "--allow-any", "--no-advertise"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--name" in lines[0], out.stderr


def test_the_coordinator_admits_a_badly_named_node_under_the_safe_form(converted, caplog):
    path = converted("qwen3_moe")
    allow = frozenset({CLIENT.id})
    node = Node(NodeConfig(path=str(path), name="fine", allow=allow, advertise=False))
    node.start()
    node.identity.name = EVIL  # what a hostile node's Info says (it is signed all the same)
    try:
        model = ModelDir(path)
        spec = PeerSpec(f"127.0.0.1:{node.port}", node.identity.node_id)
        remote = RemoteExperts(model.model_id, 64, [spec], RemoteConfig(identity=CLIENT, audit=0))
        try:
            [peer] = remote.peers.peers
            assert peer.up and peer.name == safe_node_name(EVIL)
            assert "\n" not in peer.label
        finally:
            remote.close()
    finally:
        node.stop()
