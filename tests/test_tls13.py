"""TLS 1.3 only, against a real node: a client held to TLS 1.2 is refused at the handshake
(whatever suites it offers), TLS 1.3 serves, and a node whose grpc could not be held to TLS
1.3 (grpc imported before moe) refuses to start. See moe/__init__.py for how."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import tempfile

import pytest
from helpers import ROOT, client_key

from moeshard.moe.identity.tls import TLS_NAME, client_tls, fetch_node_identity
from moeshard.node.daemon import Node, NodeConfig

CLIENT = client_key()


@pytest.fixture(scope="module")
def node(converted):
    n = Node(
        NodeConfig(
            path=str(converted("qwen3_moe")),
            name="tls",
            allow=frozenset({CLIENT.id}),
            advertise=False,
        )
    )
    n.start()
    yield n
    n.stop()


def _handshake(port: int, maximum: ssl.TLSVersion, ciphers: str | None = None) -> str:
    """The version a Python `ssl` client (presenting a client certificate) gets, or raises."""
    mine = client_tls(CLIENT)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.maximum_version = maximum
    ctx.set_alpn_protocols(["h2"])
    if ciphers:
        ctx.set_ciphers(ciphers)
    with tempfile.TemporaryDirectory() as tmp:
        chain, key = os.path.join(tmp, "c"), os.path.join(tmp, "k")
        open(chain, "wb").write(mine.chain)
        open(key, "wb").write(mine.key)
        ctx.load_cert_chain(chain, key)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=TLS_NAME) as conn:
            return conn.version()


@pytest.mark.parametrize(
    "ciphers",
    [None, "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256", "ALL"],
)
def test_a_tls12_client_is_refused(node, ciphers):
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        _handshake(node.port, ssl.TLSVersion.TLSv1_2, ciphers)


def test_tls13_is_served(node):
    assert _handshake(node.port, ssl.TLSVersion.TLSv1_3) == "TLSv1.3"
    node_id, _ = fetch_node_identity("127.0.0.1", node.port, client_tls(CLIENT))
    assert node_id == node.identity.node_id


def test_a_node_whose_grpc_allows_tls12_refuses_to_start(converted):
    """grpc imported before moe reads grpc's default cipher list: the node's start-up check
    finds that it completes a TLS 1.2 handshake and refuses to start."""
    code = (
        "import os; os.environ.pop('GRPC_SSL_CIPHER_SUITES', None)\n"
        "import grpc\n"
        "from moeshard.moe.errors import MoeshardError\n"
        "from moeshard.node.daemon import Node, NodeConfig\n"
        f"n = Node(NodeConfig(path={str(converted('qwen3_moe'))!r}, allow_any=True,"
        " advertise=False))\n"
        "try:\n    n.start()\n"
        "except MoeshardError as e:\n    print('REFUSED', e); raise SystemExit(0)\n"
        "print('STARTED'); n.stop()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0 and "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "TLS 1.2" in out.stdout
