"""One node on loopback (in-process gRPC server on port 0): results, validation, DATA_LOSS."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest
from helpers import wait_until

from moeshard.moe.convert.placement import shard_model
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.wire import codec, health_pb2, health_pb2_grpc
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.node.daemon import Node, NodeConfig

H = 64  # hidden size of the qwen3_moe fixture


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("qwen3_moe")


RAM = {"local": 0, "store": 5 * 24 << 10}  # LocalExperts; ExpertStore with 5 slots of 24 KiB


@pytest.fixture(scope="module", params=sorted(RAM))
def node(model_dir, tmp_path_factory, request):
    """A node serving node-00 of a 2-node, 1-replica split (so it lacks half the experts),
    computing with LocalExperts or with the RAM-budgeted ExpertStore (--ram)."""
    out = tmp_path_factory.mktemp("split") / "cluster"
    plan = shard_model(model_dir, nodes=2, replicas=1, out=out)
    n = Node(
        NodeConfig(
            path=plan["nodes"][0]["dir"],
            advertise=False,
            name="test-node",
            insecure=True,
            ram=RAM[request.param],
        )
    )
    port = n.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield n, pb_grpc.ExpertNodeStub(channel), channel, plan
    channel.close()
    n.stop()


def request(model_id, layer, hidden, ids, weights, dtype=codec.F32) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        model_id=model_id,
        layer=layer,
        hidden=codec.encode(hidden, dtype),
        ids=codec.encode(ids, codec.I32),
        weights=codec.encode(weights, codec.F32),
    )


def held_experts(plan, node_index: int, layer: int) -> list[int]:
    return [e for lay, e in plan["nodes"][node_index]["experts"] if lay == layer]


def test_forward_matches_local_experts_exactly(node, model_dir):
    n, stub, _, plan = node
    mine = held_experts(plan, 0, 1)
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((4, H), dtype=np.float32)  # [4, H]
    ids = np.array([[mine[0], mine[1]], [mine[2], -1], [mine[1], mine[3]], [-1, -1]])  # [4, 2]
    weights = rng.random((4, 2), dtype=np.float32)  # [4, 2]
    reply = stub.Forward(request(n.identity.model_id, 1, hidden, ids, weights))
    got = codec.decode(reply.out, "out", (codec.F32,), (4, H))  # [4, H]
    local = LocalExperts(ModelDir(model_dir).shard_set)
    for t in range(3):
        keep = ids[t] >= 0
        want = local(1, hidden[t : t + 1], ids[t : t + 1, keep], weights[t : t + 1, keep])
        assert np.array_equal(got[t], want[0]), f"row {t}"
    assert not got[3].any()
    assert reply.experts_computed == 4
    # The same over a bidirectional stream.
    stream = stub.ForwardStream(iter([request(n.identity.model_id, 1, hidden, ids, weights)] * 2))
    for r in stream:
        assert np.array_equal(codec.decode(r.out, "out", (codec.F32,), (4, H)), got)


def test_bf16_activations(node):
    n, stub, _, plan = node
    mine = held_experts(plan, 0, 0)
    hidden = np.random.default_rng(2).standard_normal((2, H), dtype=np.float32)  # [2, H]
    ids, w = np.array([[mine[0]], [mine[1]]]), np.ones((2, 1), np.float32)
    f32 = codec.decode(
        stub.Forward(request(n.identity.model_id, 0, hidden, ids, w)).out, "o", (codec.F32,)
    )
    reply = stub.Forward(request(n.identity.model_id, 0, hidden, ids, w, codec.BF16))
    assert reply.out.dtype == codec.BF16 and len(reply.out.data) == 2 * H * 2
    bf16 = codec.decode(reply.out, "o", (codec.BF16,))
    assert np.allclose(bf16, f32, rtol=0.05, atol=0.05 * np.abs(f32).max())


def test_info_and_health(node):
    n, stub, channel, plan = node
    info = stub.Info(pb.InfoRequest())
    assert info.name == "test-node" and info.node_id == n.identity.node_id
    assert info.model_id == plan["model_id"]
    held = sorted([h.layer, e] for h in info.holdings for e in h.experts)
    assert held == sorted(plan["nodes"][0]["experts"])
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _malformed(model_id, mine, other):
    h = np.zeros((2, H), np.float32)  # [2, H]
    ids = np.array([[mine[0]], [mine[1]]])  # [2, 1]
    w = np.ones((2, 1), np.float32)  # [2, 1]
    ok = request(model_id, 0, h, ids, w)
    INV, NF, FP = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
    )

    def edit(**fields):
        r = pb.ForwardRequest()
        r.CopyFrom(ok)
        for name, value in fields.items():
            if isinstance(value, pb.Tensor):
                getattr(r, name).CopyFrom(value)
            else:
                setattr(r, name, value)
        return r

    return [
        ("model id mismatch", edit(model_id="f" * 64), FP, "does not match"),
        ("empty model id", edit(model_id=""), FP, "does not match"),
        ("layer not MoE", edit(layer=99), NF, "not a MoE layer"),
        (
            "expert not held",
            edit(ids=codec.encode(np.array([[other], [mine[0]]]), codec.I32)),
            NF,
            "does not hold",
        ),
        (
            "expert out of range",
            edit(ids=codec.encode(np.array([[8], [0]]), codec.I32)),
            INV,
            "out of range",
        ),
        (
            "negative id",
            edit(ids=codec.encode(np.array([[-5], [0]]), codec.I32)),
            INV,
            "out of range",
        ),
        (
            "wrong hidden size",
            edit(hidden=codec.encode(np.zeros((2, H + 1), np.float32))),
            INV,
            "expected [*, 64]",
        ),
        (
            "hidden dtype i32",
            edit(hidden=codec.encode(np.zeros((2, H)), codec.I32)),
            INV,
            "dtype i32",
        ),
        ("ids dtype f32", edit(ids=codec.encode(np.zeros((2, 1)), codec.F32)), INV, "ids: dtype"),
        ("weights dtype bf16", edit(weights=codec.encode(w, codec.BF16)), INV, "weights: dtype"),
        (
            "byte length",
            edit(hidden=pb.Tensor(data=b"\0" * 10, shape=[2, H], dtype=pb.F32)),
            INV,
            "10 bytes",
        ),
        ("ids rows", edit(ids=codec.encode(np.zeros((3, 1)), codec.I32)), INV, "ids: shape"),
        ("weights shape", edit(weights=codec.encode(np.ones((2, 2)))), INV, "weights: shape"),
        (
            "no rows",
            edit(
                hidden=codec.encode(np.zeros((0, H))),
                ids=codec.encode(np.zeros((0, 1)), codec.I32),
                weights=codec.encode(np.zeros((0, 1))),
            ),
            INV,
            "0 rows",
        ),
        ("missing tensors", pb.ForwardRequest(model_id=model_id, layer=0), INV, "dtype 0"),
        ("NaN hidden", edit(hidden=codec.encode(np.full((2, H), np.nan, np.float32))), INV, "NaN"),
        ("bad out dtype", edit(out_dtype=pb.I32), INV, "out_dtype"),
        ("3-d hidden", edit(hidden=codec.encode(np.zeros((2, 1, H)))), INV, "hidden: shape"),
    ], ok


def test_malformed_requests_get_status_and_node_keeps_serving(node):
    n, stub, _, plan = node
    mine = held_experts(plan, 0, 0)
    other = next(e for e in range(8) if e not in mine)
    cases, ok = _malformed(n.identity.model_id, mine, other)
    for name, bad, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(bad, timeout=5)
        assert err.value.code() == code, f"{name}: {err.value.code()} {err.value.details()}"
        assert text in err.value.details(), f"{name}: {err.value.details()}"
        assert stub.Forward(ok, timeout=5).out.data, f"node stopped serving after {name}"
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefetch(pb.PrefetchRequest(model_id="x", layer=0, experts=[0]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    accepted = stub.Prefetch(
        pb.PrefetchRequest(model_id=n.identity.model_id, layer=0, experts=[*mine, other, 500])
    )
    assert accepted.accepted == len(mine)
    # A bad request on a stream ends that stream with its status; the node keeps serving.
    stream = stub.ForwardStream(iter([ok, cases[0][1], ok]))
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Forward(ok, timeout=5).out.data


def _corrupt(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("backend", sorted(RAM))
def test_checksum_failure_is_data_loss_and_expert_marked_bad(model_dir, tmp_path, backend):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    n = Node(
        NodeConfig(path=str(copy), advertise=False, name="dl", ram=RAM[backend], insecure=True)
    )
    port = n.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExpertNodeStub(channel)
            loc = n.model.locations[(1, 3)][1]
            _corrupt(loc.path, loc.offset)  # after the start-up check: found on first read
            h, w = np.ones((1, H), np.float32), np.ones((1, 2), np.float32)
            bad = request(n.identity.model_id, 1, h, np.array([[2, 3]]), w)
            for _ in range(2):  # the second time it is refused as a known-bad expert
                with pytest.raises(grpc.RpcError) as err:
                    stub.Forward(bad)
                assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert "expert 3 of layer 1" in err.value.details()
            info = stub.Info(pb.InfoRequest())
            assert [(b.layer, list(b.experts)) for b in info.bad] == [(1, [3])]
            assert 3 not in next(h.experts for h in info.holdings if h.layer == 1)
            good = request(n.identity.model_id, 1, h, np.array([[2, 4]]), w)
            assert stub.Forward(good).out.data  # still serving the healthy experts
    finally:
        n.stop()
    # A record already corrupt at start-up is found by the verification pass.
    n = Node(NodeConfig(path=str(copy), advertise=False, insecure=True))
    assert n.servicer.bad == {(1, 3)}
    n.model.close()


def test_prefetch_hint_reads_at_once_and_the_forward_hits(model_dir):
    """A Prefetch RPC starts its reads at once, before any Forward (within the node's --ram
    cache); the Forward for those experts that follows finds them resident: prefetch hits."""
    n = Node(
        NodeConfig(path=str(model_dir), advertise=False, name="pf", ram=8 * 24 << 10, insecure=True)
    )
    port = n.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExpertNodeStub(channel)
    try:
        model_id = n.identity.model_id
        reply = stub.Prefetch(pb.PrefetchRequest(model_id=model_id, layer=1, experts=[3, 5]))
        assert reply.accepted == 2
        record = ModelDir(model_dir).shard_set.record_nbytes
        wait_until(
            lambda: stub.Info(pb.InfoRequest()).stats["bytes_read"] >= 2 * record,
            10,
            what="the prefetched records to be read, with no Forward",
        )
        before = stub.Info(pb.InfoRequest()).stats
        assert before["calls"] == 0  # read with no Forward at all
        hidden = np.random.default_rng(2).standard_normal((1, H), dtype=np.float32)  # [1, H]
        ids, weights = np.array([[3, 5]]), np.array([[0.25, 0.75]], np.float32)  # [1, 2]
        stub.Forward(request(model_id, 1, hidden, ids, weights))
        after = stub.Info(pb.InfoRequest()).stats
        assert after["prefetch_hits"] == 2 and after["misses"] == 0
        assert after["bytes_read"] == before["bytes_read"]  # nothing read again
    finally:
        channel.close()
        n.stop()
