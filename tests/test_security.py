"""Identity and mutual TLS on loopback: keys and ids, pinning, the allow list, plaintext refused."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import stat
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers import client_key, moeshard_run, remote_runtime, wait_until

from moeshard.coordinator.remote.config import RemoteError
from moeshard.coordinator.remote.transport import PeerSpec, PinError, dial, parse_peers
from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity import keys, signed, tls
from moeshard.moe.identity.tls import TLS_NAME, certificate_identity, client_tls, node_tls
from moeshard.moe.kernels.build import ARITHMETIC
from moeshard.moe.storage.manifest import FORMAT_VERSION
from moeshard.moe.wire import health_pb2, health_pb2_grpc
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.node.daemon import Node, NodeConfig


def test_keygen_writes_a_private_key_and_id_prints_its_id(tmp_path):
    path = tmp_path / "k.pem"
    made = moeshard_run("keygen", path, home=tmp_path)
    assert made.returncode == 0, made.stderr
    key_id = made.stdout.strip()
    assert keys.looks_like_id(key_id) and len(key_id) == keys.ID_LENGTH
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    shown = moeshard_run("id", path, home=tmp_path)
    assert shown.returncode == 0 and shown.stdout.strip() == key_id
    assert keys.load(path).id == key_id == keys.key_id(keys.load(path).public)
    again = moeshard_run("keygen", path, home=tmp_path)  # never overwritten
    assert again.returncode == 2 and "already exists" in again.stderr
    assert moeshard_run("id", tmp_path / "missing.pem", home=tmp_path).returncode == 2
    (tmp_path / "junk.pem").write_text("not a key")
    assert (
        "not a PEM private key" in moeshard_run("id", tmp_path / "junk.pem", home=tmp_path).stderr
    )


def test_ids_differ_per_key_and_a_forged_binding_is_refused(tmp_path):
    """A certificate claiming b's identity key with a binding signed by a (an attacker who
    knows b's public key but not its private key) is refused; so is one with no binding."""
    a, b = keys.generate(tmp_path / "a"), keys.generate(tmp_path / "b")
    assert a.id != b.id
    assert certificate_identity(node_tls(a).chain) == a.id
    tls_key = ec.generate_private_key(ec.SECP256R1())
    spki = tls_key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    forged = tls._der_binding(b.public_raw, a.sign(tls.BINDING_PREFIX + spki))
    for extension in (forged, None):
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, b.id)])
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(tls_key.public_key())
            .serial_number(1)
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if extension is not None:
            builder = builder.add_extension(
                x509.UnrecognizedExtension(tls.BINDING_OID, extension), critical=False
            )
        cert = builder.sign(tls_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        with pytest.raises(keys.IdentityError, match="forged|no moeshard identity"):
            certificate_identity(cert)


@pytest.fixture(scope="module")
def tls_node(converted, tmp_path_factory):
    """A node over mutual TLS that allows only the tests' client."""
    key = tmp_path_factory.mktemp("node") / "node.pem"
    node = Node(
        NodeConfig(
            path=str(converted("qwen3_moe")),
            advertise=False,
            name="tls",
            key=str(key),
            allow=frozenset({client_key().id}),
        )
    )
    port = node.start()
    yield node, f"127.0.0.1:{port}"
    node.stop()


def test_pinned_node_answers_and_sees_the_client_id(tls_node):
    """...and states the kernel build and CPU level its arithmetic depends on (this process
    runs the same kernels on the same CPU, so it must state the same ones)."""
    from moeshard.moe.kernels.build import cpu_level, kernel_build

    node, addr = tls_node
    channel, seen = dial(PeerSpec(addr, node.identity.node_id), client_tls(client_key()), 5)
    with channel:
        info = pb_grpc.ExpertNodeStub(channel).Info(pb.InfoRequest(), timeout=5)
    assert seen == info.node_id == node.identity.node_id and info.name == "tls"
    assert info.kernel_build == kernel_build() and len(info.kernel_build) == 16
    assert info.cpu_level == cpu_level() in ("avx512", "avx2", "baseline")
    assert info.arithmetic == ARITHMETIC


def test_a_node_with_another_key_than_pinned_is_refused_naming_both(tls_node, tmp_path):
    node, addr = tls_node
    other = keys.generate(tmp_path / "other").id
    with pytest.raises(PinError) as err:
        dial(PeerSpec(addr, other), client_tls(client_key()), 5)
    assert node.identity.node_id in str(err.value) and other in str(err.value)


def test_a_client_not_on_the_allow_list_is_refused(tls_node, tmp_path):
    node, addr = tls_node
    stranger = keys.generate(tmp_path / "stranger")
    channel, _ = dial(PeerSpec(addr, node.identity.node_id), client_tls(stranger), 5)
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ExpertNodeStub(channel).Info(pb.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stranger.id in err.value.details()
        # health is answered to any authenticated client
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_to_a_tls_node_fails(tls_node):
    _, addr = tls_node
    with grpc.insecure_channel(addr) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ExpertNodeStub(channel).Info(pb.InfoRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_without_a_client_certificate_fails(tls_node):
    node, addr = tls_node
    pinned = node.tls.chain  # the node's own certificate: trusted, but we show no key of ours
    creds = grpc.ssl_channel_credentials(pinned)
    options = [("grpc.ssl_target_name_override", TLS_NAME)]
    with grpc.secure_channel(addr, creds, options=options) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ExpertNodeStub(channel).Info(pb.InfoRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_node_must_say_who_may_call_and_insecure_stays_on_loopback(converted):
    path = str(converted("qwen3_moe"))
    with pytest.raises(MoeshardError, match="--allow"):
        Node(NodeConfig(path=path, advertise=False))
    with pytest.raises(MoeshardError, match="loopback"):
        Node(NodeConfig(path=path, advertise=False, host="0.0.0.0", insecure=True))


def test_peers_must_be_pinned_unless_insecure_and_insecure_is_loopback_only():
    with pytest.raises(MoeshardError, match="names no node id"):
        parse_peers("127.0.0.1:5000", insecure=False)
    assert parse_peers("127.0.0.1:5000", insecure=True) == [PeerSpec("127.0.0.1:5000")]
    with pytest.raises(MoeshardError, match="not a node id"):
        parse_peers("nope@127.0.0.1:5000", insecure=False)
    with pytest.raises(MoeshardError, match="loopback"):
        dial(PeerSpec("10.1.2.3:5000"), None, 1)


def test_announcements_are_signed_and_forged_or_expired_ones_fail(tmp_path):
    node, other = keys.generate(tmp_path / "n"), keys.generate(tmp_path / "o")
    fields = {
        "name": "n",
        "model_id": "ab" * 32,
        "fmt": str(FORMAT_VERSION),
        "wire": "1",
        "digest": "0" * 8,
    }
    record = signed.sign_announcement(node, fields)
    assert signed.check_announcement(record) == ""
    assert record["node_id"] == node.id
    tampered = dict(record, model_id="cd" * 32)
    assert "bad signature" in signed.check_announcement(tampered)
    impostor = dict(record, node_id=other.id)  # claims another node's id with its own key
    assert "not its key's" in signed.check_announcement(impostor)
    unsigned = {k: v for k, v in record.items() if k not in ("sig", "pk")}
    assert signed.check_announcement(unsigned) == "unsigned announcement"
    old = signed.sign_announcement(node, fields, now=time.time() - 2 * signed.ANNOUNCE_TTL_S)
    assert "expired" in signed.check_announcement(old)


def test_forged_and_expired_announcements_are_ignored_by_discovery(tmp_path, caplog):
    """Real zeroconf records on this machine: a forged one (another node's id), an expired
    one and an unsigned one are ignored with one warning each; a good one is found."""
    from zeroconf import IPVersion, ServiceInfo, Zeroconf

    from moeshard.coordinator.remote.discovery import browse
    from moeshard.moe.wire.constants import SERVICE_TYPE

    good, victim = keys.generate(tmp_path / "g"), keys.generate(tmp_path / "v")
    model_id = "e" * 64
    fields = {"model_id": model_id, "fmt": str(FORMAT_VERSION), "wire": "1", "digest": "0" * 8}
    tag = os.urandom(3).hex()
    records = {
        f"good-{tag}": signed.sign_announcement(good, dict(fields, name=f"good-{tag}")),
        f"forged-{tag}": dict(
            signed.sign_announcement(good, dict(fields, name=f"forged-{tag}")),
            node_id=victim.id,
        ),
        f"expired-{tag}": signed.sign_announcement(
            good, dict(fields, name=f"expired-{tag}"), now=time.time() - 3600
        ),
        f"unsigned-{tag}": dict(fields, name=f"unsigned-{tag}", node_id=good.id),
    }
    zc = Zeroconf(ip_version=IPVersion.V4Only)
    infos = [
        ServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton("127.0.0.1")],
            port=9,
            properties=props,
            server=f"{name}.local.",
        )
        for name, props in records.items()
    ]
    try:
        for info in infos:
            zc.register_service(info)
        with caplog.at_level(logging.WARNING):
            found = wait_until(
                lambda: [n for n in browse(model_id, 1.5) if n.name == f"good-{tag}"],
                10,
                0.0,
                what="the good announcement",
            )
            browse(model_id, 1.5)  # a second browse: still one warning per record
        assert found[0].node_id == good.id
        # (1.5 s: a browser's first answers can come with its second query, 1 s in)
        names = wait_until(
            lambda: {n.name for n in browse(model_id, 1.5)}, 10, 0.0, what="a browse's answer"
        )
        assert names == {f"good-{tag}"}
        for kind, why in (("forged", "forged"), ("expired", "expired"), ("unsigned", "unsigned")):
            warnings = [
                r
                for r in caplog.records
                if f"{kind}-{tag}" in r.getMessage() and why in r.getMessage()
            ]
            assert len(warnings) == 1, kind
    finally:
        for info in infos:
            zc.unregister_service(info)
        zc.close()


def test_info_is_signed_for_the_callers_nonce(tls_node):
    node, addr = tls_node
    channel, _ = dial(PeerSpec(addr, node.identity.node_id), client_tls(client_key()), 5)
    with channel:
        nonce = os.urandom(16)
        info = pb_grpc.ExpertNodeStub(channel).Info(pb.InfoRequest(nonce=nonce), timeout=5)
    assert signed.check_info(info, nonce) == ""
    assert "does not verify" in signed.check_info(info, os.urandom(16))  # replayed
    info.model_id = "0" * 64
    assert "does not verify" in signed.check_info(info, nonce)  # altered


def test_a_coordinator_refused_by_every_node_says_so(tls_node, tmp_path):
    """A client the node does not allow: not 'unreachable' (and retried) but refused."""
    from moeshard.coordinator.remote.config import RemoteConfig, RemoteError
    from moeshard.coordinator.remote.experts import RemoteExperts

    node, addr = tls_node
    stranger = keys.generate(tmp_path / "stranger")
    spec = PeerSpec(addr, node.identity.node_id)
    with pytest.raises(RemoteError, match=f"refused this client: PERMISSION_DENIED.*{stranger.id}"):
        RemoteExperts(
            node.identity.model_id, 64, [spec], RemoteConfig(identity=stranger, audit=0.0)
        )


def test_a_node_computing_another_arithmetic_is_refused_not_audited(converted, monkeypatch):
    """A node of another moeshard version (its kernels compute another arithmetic: say float32
    activations where we quantise them) would give replies an auditor finds wrong by far more
    than its tolerance: it is refused at admission, with the reason, instead of accused."""
    from moeshard.node import servicer

    monkeypatch.setattr(servicer, "ARITHMETIC", 0)
    config = NodeConfig(path=str(converted("qwen3_moe")), advertise=False, insecure=True)
    old = Node(config)
    port = old.start()
    try:
        ours = f"kernels compute arithmetic 0, ours {ARITHMETIC}"
        with pytest.raises(RemoteError, match=ours):
            remote_runtime(converted("qwen3_moe"), [PeerSpec(f"127.0.0.1:{port}")], insecure=True)
    finally:
        old.stop()
