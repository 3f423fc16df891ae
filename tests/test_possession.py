"""Proof of possession: Merkle trees over expert records, the roots file the model id covers,
challenges answered by real nodes on loopback and `moeshard audit`."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
from helpers import (
    PROMPT,
    ROOT,
    TOKENS,
    NodeProcess,
    client_key,
    flip_byte,
    remote_runtime,
    wait_until,
)

from moeshard.coordinator import generate as decode
from moeshard.coordinator.remote import patrol as patrol_module
from moeshard.coordinator.remote import possession
from moeshard.coordinator.remote.transport import PeerSpec, dial
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.errors import StoreError
from moeshard.moe.identity.keys import generate
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage import merkle
from moeshard.moe.storage.manifest import read_manifest, write_manifest
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.node import failpoints
from moeshard.node.daemon import Node, NodeConfig

BS = merkle.BLOCK_SIZE
SIZES = [1, 100, BS - 1, BS, BS + 1, 2 * BS, 3 * BS, 5 * BS + 17, 7 * BS, 13 * BS - 5]


# -- the tree ---------------------------------------------------------------------------------


def rfc6962_root(blocks: list[bytes]) -> bytes:
    """RFC 6962's Merkle tree hash, recursively: split at the largest power of two below n."""
    if len(blocks) == 1:
        return hashlib.sha256(b"\x00" + blocks[0]).digest()
    k = 1 << ((len(blocks) - 1).bit_length() - 1)
    left, right = rfc6962_root(blocks[:k]), rfc6962_root(blocks[k:])
    return hashlib.sha256(b"\x01" + left + right).digest()


def flipped(data: bytes, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[bit // 8 % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


@pytest.mark.parametrize("size", SIZES)
def test_every_block_proves_and_tampering_fails(size):
    record = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)  # [size]
    data = record.tobytes()
    tree = merkle.Tree(record)
    count = merkle.n_blocks(size)
    blocks = [data[i * BS : (i + 1) * BS] for i in range(count)]
    assert tree.root == merkle.root(data) == rfc6962_root(blocks)
    rng = random.Random(size)
    for i, block in enumerate(blocks):
        path = tree.path(i)
        assert path == merkle.proof(record, i)
        assert merkle.block_span(i, size) == (i * BS, i * BS + len(block))
        assert merkle.verify(tree.root, i, count, block, path)
        assert not merkle.verify(
            tree.root, i, count, flipped(block, rng.randrange(8 * len(block))), path
        )
        for j in range(len(path)):  # every sibling matters
            bad = [*path[:j], flipped(path[j], rng.randrange(256)), *path[j + 1 :]]
            assert not merkle.verify(tree.root, i, count, block, bad)
        assert not merkle.verify(tree.root, i, count, block, [*path, path[-1] if path else b""])
        if path:
            assert not merkle.verify(tree.root, i, count, block, path[:-1])
        for j in {0, i - 1, i + 1, count - 1, count} - {i}:  # another index, or out of range
            assert not merkle.verify(tree.root, j, count, block, path)
        assert not merkle.verify(flipped(tree.root), i, count, block, path)


def test_a_short_last_block_is_not_padded():
    record = b"x" * (BS + 10)
    padded = record + b"\x00" * (BS - 10)
    assert merkle.root(record) != merkle.root(padded)
    tree = merkle.Tree(record)
    assert merkle.verify(tree.root, 1, 2, b"x" * 10, tree.path(1))
    assert not merkle.verify(tree.root, 1, 2, b"x" * 10 + b"\x00", tree.path(1))


def test_roots_file_round_trip_and_garbage(tmp_path):
    rng = np.random.default_rng(0)
    roots = merkle.Roots(
        BS, 3 * BS + 7, {(lay, e): rng.bytes(32) for lay in (0, 2) for e in (3, 1)}
    )
    sha = merkle.write_roots(tmp_path, roots)
    path = tmp_path / merkle.ROOTS_FILE
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    back, sha_back = merkle.read_roots(path)
    assert (back, sha_back) == (roots, sha)
    assert back.n_blocks == 4 and back.keys() == set(roots.roots)
    assert not list(tmp_path.glob("*.tmp"))  # written under a temporary name, then renamed
    data = path.read_bytes()
    for bad, why in [(data[:-1], "roots need"), (b"nope" * 10, "not a moeshard"), (b"", "trunc")]:
        path.write_bytes(bad)
        with pytest.raises(StoreError, match=why):
            merkle.read_roots(path)


# -- the roots of a converted model -----------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("qwen3_moe")


def test_convert_writes_roots_the_model_id_covers(model_dir, tmp_path):
    model = ModelDir(model_dir)
    roots = model.possession_roots()
    assert roots.keys() == set(model.locations) and roots.block_size == BS
    for layer, expert in model.locations:
        assert roots.root(layer, expert) == merkle.root(model.shard_set.read(layer, expert))
    entry = model.manifest["merkle"]
    assert model.model_id == merkle.covered_id(entry["content_id"], entry["sha256"])
    model.close()

    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    path = copy / merkle.ROOTS_FILE
    flip_byte(path, path.stat().st_size - 1)  # one root changed
    with pytest.raises(StoreError, match="not the ones model id"):
        ModelDir(copy).possession_roots()
    _, sha = merkle.read_roots(path)
    assert merkle.covered_id(entry["content_id"], sha) != model.model_id  # so the id changes
    path.unlink()
    with pytest.raises(StoreError, match="missing"):
        ModelDir(copy).possession_roots()

    # A directory converted before roots files: computed from its own records, the same roots.
    manifest = read_manifest(copy)
    del manifest["merkle"]
    del manifest["covers"]  # (neither existed then)
    write_manifest(copy, manifest)
    old = ModelDir(copy)
    computed = old.possession_roots()
    assert isinstance(computed, merkle.ComputedRoots) and computed.keys() == roots.keys()
    assert all(computed.root(*k) == roots.root(*k) for k in sorted(roots.keys()))
    old.close()


def test_shard_dirs_keep_the_model_id_and_carry_the_roots(model_dir, tmp_path):
    plan = shard_model(model_dir, nodes=2, replicas=1, out=tmp_path / "split")
    full = ModelDir(model_dir)
    for node in plan["nodes"]:
        shard = ModelDir(node["dir"])
        assert shard.model_id == full.model_id
        assert shard.possession_roots().roots == full.possession_roots().roots
        shard.close()
    full.close()


# -- challenges on loopback ---------------------------------------------------------------------


def start_node(path, tmp, **config) -> Node:
    key = tmp / f"node-{len(list(tmp.glob('node-*.pem')))}.pem"
    node = Node(NodeConfig(path=str(path), advertise=False, key=str(key), **config))
    node.start()
    return node


@pytest.fixture(scope="module")
def honest(model_dir, tmp_path_factory):
    """A node serving the whole model over mutual TLS to the tests' client key."""
    node = start_node(
        model_dir, tmp_path_factory.mktemp("keys"), allow=frozenset([client_key().id])
    )
    yield node
    node.stop()


@pytest.fixture(scope="module")
def split(model_dir, tmp_path_factory):
    """node-00 of a 2-node, 1-replica split (12 of the 24 records), one record corrupted on
    disk; served without the start-up checksum pass, so the node still claims it."""
    plan = shard_model(model_dir, nodes=2, replicas=1, out=tmp_path_factory.mktemp("s") / "c")
    path = plan["nodes"][0]["dir"]
    shard = ModelDir(path)
    corrupt = sorted(shard.locations)[3]
    flip_byte(shard.shards[0].path, shard.locations[corrupt][1].offset + 5000)
    shard.close()
    node = start_node(path, tmp_path_factory.mktemp("keys"), insecure=True, verify=False)
    yield node, corrupt, plan
    node.stop()


def stub_of(node: Node, tls: bool):
    spec = PeerSpec(f"127.0.0.1:{node.port}", node.identity.node_id if tls else "")
    channel, _ = dial(spec, client_tls(client_key()) if tls else None, 5.0)
    return channel, pb_grpc.ExpertNodeStub(channel)


def audit_cli(model, *peers, args=()):
    """`moeshard audit MODEL --peers ...` as the tests' client."""
    env = dict(os.environ, MOESHARD_HOME=str(client_key().path.parent))
    cmd = [sys.executable, "-m", "moeshard", "audit", str(model), "--peers", ",".join(peers)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=ROOT, env=env)


def test_an_honest_node_passes_the_audit(model_dir, honest):
    peer = f"{honest.identity.node_id}@127.0.0.1:{honest.port}"
    done = audit_cli(model_dir, peer, args=["--rounds", "3", "--json"])
    assert done.returncode == 0, done.stdout + done.stderr
    (node,) = json.loads(done.stdout)["nodes"]
    assert node["status"] == "passed" and node["passed_rounds"] == 3, node
    assert node["node_id"] == honest.identity.node_id
    assert all(r["elapsed_ms"] < r["deadline_ms"] for r in node["rounds"])
    table = audit_cli(model_dir, peer, args=["--blocks", "64", "--rounds", "1"])
    assert table.returncode == 0 and " passed " in table.stdout, table.stdout + table.stderr


def test_the_reply_is_checked_block_by_block_and_signed(model_dir, honest, tmp_path):
    model = ModelDir(model_dir)
    roots, held = model.possession_roots(), set(model.locations)
    channel, stub = stub_of(honest, tls=True)
    with channel:
        key = possession.node_key(stub, honest.identity.node_id, 5.0)
        rng = random.Random(7)
        result = possession.challenge(stub, key, model.model_id, roots, held, 8, rng)
        assert result.passed and result.blocks == 8 and result.elapsed_ms > 0, result
        blocks = possession.pick(roots, held, 4, rng)
        assert len({(b.layer, b.expert) for b in blocks}) == 4  # distinct records first
        request = pb.ChallengeRequest(model_id=model.model_id, nonce=os.urandom(32), blocks=blocks)
        reply = stub.Challenge(request, timeout=5)
        wanted = {(b.layer, b.expert): roots.root(b.layer, b.expert) for b in blocks}
        assert possession.check_reply(request, reply, wanted, roots, key) == ""

        def tampered(edit) -> str:
            bad = pb.ChallengeReply()
            bad.CopyFrom(reply)
            edit(bad)
            return possession.check_reply(request, bad, wanted, roots, key)

        assert "Merkle root" in tampered(
            lambda r: setattr(r.proofs[1], "data", flipped(r.proofs[1].data))
        )
        assert "Merkle root" in tampered(lambda r: r.proofs[2].path.__setitem__(0, bytes(32)))
        assert "bytes, expected" in tampered(lambda r: setattr(r.proofs[0], "data", b"short"))
        assert "not for" in tampered(lambda r: r.proofs[0].at.CopyFrom(r.proofs[1].at))
        assert "proofs for" in tampered(lambda r: r.proofs.pop())
        other = generate(tmp_path / "other.pem")  # signed, but by another key
        assert "not signed" in tampered(
            lambda r: setattr(
                r, "signature", other.sign(merkle.possession_message(request.nonce, r))
            )
        )
        replayed = pb.ChallengeRequest()  # the same reply for another nonce
        replayed.CopyFrom(request)
        replayed.nonce = os.urandom(32)
        assert "not signed" in possession.check_reply(replayed, reply, wanted, roots, key)
        records = [pb.BlockIndex(layer=lay, expert=e) for lay, e in sorted(held)[:17]]
        too_many = pb.ChallengeRequest(model_id=model.model_id, nonce=request.nonce, blocks=records)
        with pytest.raises(grpc.RpcError) as err:
            stub.Challenge(too_many, timeout=5)
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "at most 16" in err.value.details()
        )
        late = possession.challenge(stub, key, model.model_id, roots, held, 8, rng, 1e-4)
        assert not late.passed and ("DEADLINE_EXCEEDED" in late.why or "past" in late.why)
    model.close()


def test_invalid_challenges_get_status_codes(model_dir, split):
    node, _, plan = split
    model = ModelDir(model_dir)
    mine = {tuple(k) for k in plan["nodes"][0]["experts"]}
    other = next(k for k in sorted(model.locations) if k not in mine)
    layer, expert = sorted(mine)[0]
    count = model.possession_roots().n_blocks
    channel, stub = stub_of(node, tls=False)

    def call(blocks, model_id=model.model_id, nonce=None):
        nonce = os.urandom(32) if nonce is None else nonce
        request = pb.ChallengeRequest(model_id=model_id, nonce=nonce, blocks=blocks)
        with pytest.raises(grpc.RpcError) as err:
            stub.Challenge(request, timeout=5)
        return err.value.code(), err.value.details()

    ok = pb.BlockIndex(layer=layer, expert=expert, block=0)
    with channel:
        assert call([ok], model_id="f" * 64)[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert call([ok], nonce=b"short")[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert call([])[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert call([ok] * 65)[0] == grpc.StatusCode.INVALID_ARGUMENT
        beyond = pb.BlockIndex(layer=layer, expert=expert, block=count)
        assert call([beyond]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"block {count} out of range (a record has {count} blocks)",
        )
        unknown = pb.BlockIndex(layer=other[0], expert=other[1], block=0)
        assert call([ok, unknown])[0] == grpc.StatusCode.NOT_FOUND
        request = pb.ChallengeRequest(model_id=model.model_id, nonce=os.urandom(16), blocks=[ok])
        assert len(stub.Challenge(request, timeout=5).proofs) == 1  # the node keeps serving
    model.close()


def test_a_corrupted_record_fails_the_audit(model_dir, split):
    node, corrupt, plan = split
    model = ModelDir(model_dir)
    channel, stub = stub_of(node, tls=False)
    with channel:
        key = possession.node_key(stub, "", 5.0)
        result = possession.challenge(
            stub, key, model.model_id, model.possession_roots(), {corrupt}, 2, random.Random(1)
        )
        assert not result.passed and "DATA_LOSS" in result.why, result
    # The node now says it lacks the record, so the audit challenges it from the node's next
    # Info on: corrupt a second record and let the CLI find it (16 blocks: every record).
    shard = ModelDir(plan["nodes"][0]["dir"])
    second = sorted(shard.locations)[7]
    flip_byte(shard.shards[0].path, shard.locations[second][1].offset + 100)
    shard.close()
    done = audit_cli(
        model_dir, f"127.0.0.1:{node.port}", args=["--insecure", "--blocks", "16", "--rounds", "1"]
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert " failed " in done.stdout and "DATA_LOSS" in done.stdout, done.stdout
    model.close()


def test_a_node_of_another_model_fails_and_an_unreachable_one_is_exit_3(
    model_dir, converted, tmp_path
):
    other_dir = converted("qwen3_moe", experts="q8_0")  # same weights, another model id
    other = start_node(other_dir, tmp_path, insecure=True)
    try:
        assert other.identity.model_id != ModelDir(model_dir).model_id
        done = audit_cli(model_dir, f"127.0.0.1:{other.port}", args=["--insecure"])
        assert done.returncode == 1 and "serves model" in done.stdout, done.stdout + done.stderr
    finally:
        other.stop()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = audit_cli(model_dir, f"127.0.0.1:{port}", args=["--insecure", "--timeout", "1"])
    assert done.returncode == 3 and "unreachable" in done.stdout, done.stdout + done.stderr
    assert (
        audit_cli(model_dir, "127.0.0.1:1", args=["--insecure", "--blocks", "65"]).returncode == 2
    )


# -- the coordinator's patrol -----------------------------------------------------------------


@contextmanager
def patrolled(cluster_model, cluster, lie: str, interval_s: float):
    """A node lying `lie` (a failpoint) beside the cluster, and a coordinator whose patrol
    challenges every node soon after admission and then every `interval_s`; yields
    (transformer, remote, the liar's Peer)."""
    liar = NodeProcess(cluster_model, advertise=False, env={failpoints.ENV: f"lie={lie}"})
    liar.wait_ready()
    try:
        roots = ModelDir(cluster_model).possession_roots()
        specs = [n.spec for n in cluster] + [liar.spec]
        transformer, remote = remote_runtime(
            cluster_model,
            specs,
            roots=roots,
            challenge_first_s=0.3,
            challenge_interval_s=interval_s,
        )
        try:
            bad = next(p for p in remote.peers.peers if p.node_id == liar.node_id)
            yield transformer, remote, bad
        finally:
            remote.close()
    finally:
        liar.stop()


def test_the_patrol_disqualifies_a_node_that_cannot_prove_and_keeps_honest_ones(
    cluster_model, cluster, cluster_reference
):
    """During a generation the coordinator challenges every node it uses; a node whose proofs
    are forged (failpoint forged_block: its Forward replies are honest) is disqualified, its
    unaudited work recomputed; the honest nodes pass, and the tokens are one machine's."""
    with patrolled(cluster_model, cluster, "forged_block", 0.5) as (transformer, remote, bad):
        opts = decode.SamplingOptions(max_tokens=TOKENS, keep_logits=True)
        result = decode.generate(transformer, PROMPT, opts, verifier=remote.verifier)
        honest = [p for p in remote.peers.peers if p is not bad]
        patrol = remote.trust.patrol.stats
        wait_until(
            lambda: bad.disqualified and patrol.passed >= len(honest),
            timeout=20,
            what="the liar disqualified and every honest node challenged",
        )
        stats = remote.stats()["possession"]
        assert "possession" in bad.disqualified, stats
        assert all(not p.disqualified for p in honest), stats
        assert stats["passed"] >= len(honest) and stats["failed"] >= 1
        assert result.tokens == cluster_reference.tokens
        assert all(
            np.array_equal(a, b)
            for a, b in zip(result.logits, cluster_reference.logits, strict=True)
        )


def test_a_late_answer_is_asked_again_and_the_third_disqualifies(
    cluster_model, cluster, cluster_reference
):
    """A node whose proofs come past the deadline (failpoint late_proof) is not disqualified for
    one late answer (an honest node can be paused at that moment) but is challenged again soon;
    its LATE_LIMIT-th late answer disqualifies it, and the tokens stay one machine's."""
    with patrolled(cluster_model, cluster, "late_proof:0.6", 60) as (transformer, remote, bad):
        opts = decode.SamplingOptions(max_tokens=TOKENS)
        result = decode.generate(transformer, PROMPT, opts, verifier=remote.verifier)
        patrol = remote.trust.patrol.stats
        wait_until(lambda: bad.disqualified, timeout=30, what="the late node disqualified")
        # the first answers were late and asked again sooner than the 60 s interval
        assert patrol.late == patrol_module.LATE_LIMIT and patrol.failed == 1, patrol
        assert "possession" in bad.disqualified and "late" in bad.disqualified
        assert result.tokens == cluster_reference.tokens
