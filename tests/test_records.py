"""rpc Record and coordinator/remote/fetch.py: a node hands over an expert record in chunks, the
coordinator checks every byte against the model's Merkle root. Real nodes on loopback (node
processes, and an in-process node where its open-stream count is read), and hostile nodes: real
gRPC servers that answer Record with what an adversary who has read fetch.py might send."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from helpers import NodeProcess, client_key, flip_byte, node_process, wait_until

from moeshard.cli import build_parser
from moeshard.coordinator.remote.fetch import FetchError, default_deadline_s, fetch_record
from moeshard.coordinator.remote.transport import CHANNEL_OPTIONS, dial
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.convert.synth import synth
from moeshard.moe.identity import keys
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage import merkle
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.node import failpoints
from moeshard.node.daemon import Node, NodeConfig
from moeshard.node.limits import Limits
from moeshard.node.records import CHUNK_BYTES
from moeshard.node.servicer import SERVICE

MiB = 1 << 20
RECORD_NBYTES = 3_342_336  # the model's records: 3 chunks of 1 MiB and a partial one
IDLE_S = 2.0  # idle timeout of the in-process node
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
RECORD = "/moeshard.v1.ExpertNode/Record"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Kimi K3 (synth) with one MoE layer of 4 experts: MXFP4 records of 3.3 MB, so a record
    takes several chunks (the embedded fixtures' records fit in one)."""
    out = tmp_path_factory.mktemp("records") / "k3"
    synth(out, "k3", n_experts=4, top_k=2, layers=2, latent=2048, inter=1024)
    return out


@pytest.fixture(scope="module")
def model(model_dir):
    model = ModelDir(model_dir)
    assert model.shard_set.record_nbytes == RECORD_NBYTES
    yield model
    model.close()


@pytest.fixture(scope="module")
def honest(model_dir):
    """A node serving the whole model over mutual TLS to the tests' client key."""
    node = node_process(model_dir)
    yield node
    node.stop()


def tls_stub(node, key=None):
    """(channel, stub) to `node` over mutual TLS as `key` (the tests' client by default)."""
    channel, _ = dial(node.spec, client_tls(key or client_key()), 5.0)
    return channel, pb_grpc.ExpertNodeStub(channel)


def fetch(stub, model, key, timeout_s: float = 10.0, root=None) -> np.ndarray:
    """Record `key` of `model` fetched from `stub` (checked against its root): uint8 [nbytes]."""
    nbytes = model.shard_set.record_nbytes
    out = np.empty(nbytes, dtype=np.uint8)  # [nbytes]
    root = model.possession_roots().root(*key) if root is None else root
    assert fetch_record(stub, model.model_id, *key, root, nbytes, out, timeout_s) == nbytes
    return out


def refused(call: Callable[[], object]) -> FetchError:
    with pytest.raises(FetchError) as err:
        call()
    return err.value


# -- an honest node ---------------------------------------------------------------------------


def test_a_fetched_record_is_the_shard_files_record_with_merkle_bins_root(model, honest):
    roots = model.possession_roots()
    channel, stub = tls_stub(honest)
    with channel:
        for key in sorted(model.locations):
            want = model.shard_set.read(*key)  # uint8 [nbytes], checksum-verified
            deadline = default_deadline_s(RECORD_NBYTES)
            got = fetch(stub, model, key, timeout_s=deadline)
            assert np.array_equal(got, want), key
            assert merkle.root(got) == roots.root(*key)  # merkle.bin's root, which the id covers
        # as sent: consecutive chunks of CHUNK_BYTES, the record's length in each
        request = pb.RecordRequest(model_id=model.model_id, layer=1, expert=2)
        sent = list(stub.Record(request, timeout=10))
        assert [c.offset for c in sent] == list(range(0, RECORD_NBYTES, CHUNK_BYTES))
        assert [len(c.data) for c in sent] == [CHUNK_BYTES] * 3 + [RECORD_NBYTES - 3 * CHUNK_BYTES]
        assert {c.record_bytes for c in sent} == {RECORD_NBYTES}
        # a buffer larger than the record: only the record's bytes are written
        out = np.full(RECORD_NBYTES + 10, 7, dtype=np.uint8)  # [nbytes + 10]
        root = roots.root(1, 0)
        assert (
            fetch_record(stub, model.model_id, 1, 0, root, RECORD_NBYTES, out, 10) == RECORD_NBYTES
        )
        assert np.array_equal(out[:RECORD_NBYTES], model.shard_set.read(1, 0))
        assert (out[RECORD_NBYTES:] == 7).all()


def test_a_wrong_root_or_model_id_or_a_stranger_is_refused(model, honest, tmp_path):
    channel, stub = tls_stub(honest)
    with channel:
        err = refused(lambda: fetch(stub, model, (1, 0), root=model.possession_roots().root(1, 1)))
        assert err.evidence and err.code == "" and "Merkle root" in err.why
        nbytes, out = RECORD_NBYTES, np.empty(RECORD_NBYTES, np.uint8)
        err = refused(lambda: fetch_record(stub, "f" * 64, 1, 0, b"", nbytes, out, 5))
        assert (err.code, err.evidence) == ("FAILED_PRECONDITION", False), err.why
        err = refused(lambda: fetch_record(stub, model.model_id, 0, 0, b"", nbytes, out, 5))
        assert (err.code, err.evidence) == ("NOT_FOUND", False), err.why  # layer 0 is dense
        assert fetch(stub, model, (1, 3)).size == nbytes  # the node keeps serving
    stranger = keys.generate(tmp_path / "stranger.pem")  # not on the node's --allow list
    channel, stub = tls_stub(honest, stranger)
    with channel:
        err = refused(lambda: fetch(stub, model, (1, 0)))
        assert (err.code, err.evidence) == ("PERMISSION_DENIED", False), err.why


def test_the_deadline_covers_the_whole_stream(model, honest):
    channel, stub = tls_stub(honest)
    with channel:
        fetch(stub, model, (1, 0))  # the connection is up: only the stream is timed
        t0 = time.perf_counter()
        err = refused(lambda: fetch(stub, model, (1, 0), timeout_s=0.002))
        assert (err.code, err.evidence) == ("DEADLINE_EXCEEDED", False), err.why
        assert time.perf_counter() - t0 < 5.0  # the 2 ms deadline, not the 10 s default


def test_the_buffer_must_take_the_record():
    for out, why in [
        (np.empty(RECORD_NBYTES - 1, np.uint8), "cannot take"),
        (np.empty(RECORD_NBYTES, np.int8), "uint8"),
        (np.empty((2, RECORD_NBYTES), np.uint8)[:, 0], "contiguous"),
        (np.frombuffer(bytes(RECORD_NBYTES), np.uint8), "cannot take"),  # read-only
    ]:
        with pytest.raises(ValueError, match=why):
            fetch_record(None, "", 1, 0, b"", RECORD_NBYTES, out, 1.0)


# -- a node that lies, a node that lacks a record, a record rotted on disk ---------------------


def test_a_forged_record_is_evidence(model_dir, model):
    liar = NodeProcess(model_dir, advertise=False, env={failpoints.ENV: "lie=forged_record"})
    liar.wait_ready()
    try:
        channel, stub = tls_stub(liar)
        with channel:
            err = refused(lambda: fetch(stub, model, (1, 1)))
            assert err.evidence and err.code == "" and "Merkle root" in err.why, err.why
            # the forged bytes are the record's length and differ from it in one byte
            out = np.empty(RECORD_NBYTES, np.uint8)  # [nbytes]
            request = pb.RecordRequest(model_id=model.model_id, layer=1, expert=1)
            for chunk in stub.Record(request, timeout=10):
                out[chunk.offset : chunk.offset + len(chunk.data)] = np.frombuffer(chunk.data, "u1")
            assert np.count_nonzero(out != model.shard_set.read(1, 1)) == 1
    finally:
        liar.stop()


def holdings(stub) -> tuple[set, set]:
    """(holdings, bad) of the node's Info, as (layer, expert) sets."""
    info = stub.Info(pb.InfoRequest(), timeout=5)
    return tuple(
        {(h.layer, e) for h in lists for e in h.experts} for lists in (info.holdings, info.bad)
    )


def test_an_unheld_record_is_not_found_and_a_rotten_one_is_data_loss_then_bad(
    model_dir, model, tmp_path
):
    """node-00 of a 2-node split holds 2 of the 4 records; one of them is corrupted on disk
    and the node started without its checksum pass, so it still claims it."""
    plan = shard_model(model_dir, nodes=2, replicas=1, out=tmp_path / "split")
    path = plan["nodes"][0]["dir"]
    shard = ModelDir(path)
    mine = sorted(shard.locations)
    other = next(k for k in sorted(model.locations) if k not in mine)
    where = shard.shard_set.location(*mine[0])
    flip_byte(where.path, where.offset + RECORD_NBYTES // 2)
    shard.close()
    node = node_process(path, "--no-verify")
    try:
        channel, stub = tls_stub(node)
        with channel:
            assert holdings(stub) == (set(mine), set())
            err = refused(lambda: fetch(stub, model, other))
            assert (err.code, err.evidence) == ("NOT_FOUND", False), err.why
            err = refused(lambda: fetch(stub, model, mine[0]))
            assert (err.code, err.evidence) == ("DATA_LOSS", False), err.why
            assert "checksum" in err.why
            assert holdings(stub) == (set(mine[1:]), {mine[0]})
            err = refused(lambda: fetch(stub, model, mine[0]))  # refused from then on
            assert (err.code, err.evidence) == ("DATA_LOSS", False), err.why
            assert np.array_equal(fetch(stub, model, mine[1]), model.shard_set.read(*mine[1]))
    finally:
        node.stop()


# -- limits -----------------------------------------------------------------------------------


def test_a_client_over_its_record_rate_is_refused_while_another_is_served(
    model_dir, model, tmp_path
):
    """--record-rate-mb 4: a bucket of 4 MiB takes one 3.3 MB record, not a second one at once;
    it refills at 4 MiB/s, and another client has its own."""
    greedy, other = (keys.generate(tmp_path / f"{n}.pem") for n in ("greedy", "other"))
    node = node_process(model_dir, "--record-rate-mb", "4", allow=f"{greedy.id},{other.id}")
    try:
        greedy_channel, greedy_stub = tls_stub(node, greedy)
        other_channel, other_stub = tls_stub(node, other)
        with greedy_channel, other_channel:
            fetch(greedy_stub, model, (1, 0))
            t0 = time.monotonic()
            err = refused(lambda: fetch(greedy_stub, model, (1, 1)))
            assert (err.code, err.evidence) == ("RESOURCE_EXHAUSTED", False), err.why
            assert "(--record-rate-mb)" in err.why
            fetch(other_stub, model, (1, 1))
            time.sleep(max(0.0, t0 + 0.8 - time.monotonic()))  # 0.8 s refills 3.4 MB
            fetch(greedy_stub, model, (1, 1))
    finally:
        node.stop()


def test_node_flags_default_to_the_limits_defaults():
    args = build_parser().parse_args(["node", "DIR"])
    want = Limits()
    assert (args.max_records, args.per_client_records) == (
        want.max_records,
        want.per_client_records,
    )
    assert args.record_rate_mb * MiB == want.record_rate
    assert want.workers() > want.max_calls + want.max_streams + want.max_records + want.max_watches


@pytest.fixture
def small_node(model_dir):
    """An in-process node, plaintext on loopback (each connection a client of its own): 2
    record streams at once, 1 per client, idle timeout IDLE_S."""
    limits = Limits(max_records=2, per_client_records=1, idle_timeout_s=IDLE_S)
    node = Node(NodeConfig(path=str(model_dir), advertise=False, insecure=True, limits=limits))
    port = node.start()
    yield node, f"127.0.0.1:{port}"
    node.stop()


def own_stub(addr: str, stalling: bool = False):
    """(channel, stub) on a connection of its own. `stalling`: without BDP probing, so the
    client's HTTP/2 window stays small and a stream it stops reading holds the node's send,
    as an adversary's client would (grpc's own client otherwise takes whole records into its
    buffers unread)."""
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    if stalling:
        options.append(("grpc.http2.bdp_probe", 0))
    channel = grpc.insecure_channel(addr, options=options)
    return channel, pb_grpc.ExpertNodeStub(channel)


def open_record(stub, model):
    """A Record stream of which one chunk has been read."""
    call = stub.Record(pb.RecordRequest(model_id=model.model_id, layer=1, expert=0))
    assert next(call).offset == 0
    return call


def drain(call) -> tuple[int, grpc.StatusCode]:
    """Read the rest of a stream: (bytes, status)."""
    received = 0
    try:
        for chunk in call:
            received += len(chunk.data)
    except grpc.RpcError as exc:
        return received, exc.code()
    return received, grpc.StatusCode.OK


def test_record_streams_are_capped_and_an_abandoned_one_is_cleaned_up(small_node, model):
    node, addr = small_node
    guard = node.servicer.guard
    a, b, c = (own_stub(addr, stalling=True) for _ in range(3))
    try:
        # a client that cancels its stream: gone at once
        t0 = time.monotonic()
        open_record(a[1], model).cancel()
        wait_until(lambda: guard.open["record"] == 0, IDLE_S / 2, what="the cancelled stream")
        assert time.monotonic() - t0 < IDLE_S / 2 and guard.stalls.fired == 0

        # clients that stop reading: counted against the caps until the watchdog ends them
        t0 = time.monotonic()
        stalled = [open_record(a[1], model), open_record(b[1], model)]
        assert guard.open["record"] == 2
        err = refused(lambda: fetch(a[1], model, (1, 1)))
        assert err.code == "RESOURCE_EXHAUSTED" and "(--per-client-records)" in err.why
        silent = silent_record(a[0])  # refused before its request is read: at once
        assert (silent.code(), "(--per-client-records)" in silent.details()) == (BUSY, True)
        err = refused(lambda: fetch(c[1], model, (1, 1)))
        assert err.code == "RESOURCE_EXHAUSTED" and "2 records open already" in err.why
        assert c[1].Info(pb.InfoRequest(), timeout=5).model_id == model.model_id
        wait_until(lambda: guard.open["record"] == 0, IDLE_S + 3, what="the stalled streams to end")
        assert IDLE_S <= time.monotonic() - t0 < IDLE_S + 3 and guard.stalls.fired == 2
        for call in stalled:  # cancelled by the node: never the whole record
            received, code = drain(call)
            assert code == grpc.StatusCode.CANCELLED and received < RECORD_NBYTES
        for stub in (a[1], b[1], c[1]):  # the node keeps serving, every client
            assert np.array_equal(fetch(stub, model, (1, 2)), model.shard_set.read(1, 2))
        assert not any(guard.open.values()), guard.open
    finally:
        for channel, _ in (a, b, c):
            channel.close()


def forward_once(stub, model) -> None:
    """One honest Forward call of one row: the node has now computed for this client."""
    hidden = np.zeros((1, model.shard_set.hidden), dtype=np.float32)  # [1, H]
    request = pb.ForwardRequest(
        model_id=model.model_id,
        request_id=1,
        layer=1,
        hidden=codec.encode(hidden, codec.F32),
        ids=codec.encode(np.array([[0]], dtype=np.int32), codec.I32),
        weights=codec.encode(np.ones((1, 1), dtype=np.float32), codec.F32),
    )
    assert stub.Forward(request, timeout=10).request_id == 1


def test_record_slots_are_kept_for_the_clients_the_node_computes_for(small_node, model):
    """Strangers who computed nothing here fill the open pool with streams they stop reading;
    a client the node just computed for still gets its record (the pool kept for such
    clients), while another stranger is refused."""
    node, addr = small_node
    guard = node.servicer.guard
    a, b, c, d = (own_stub(addr, stalling=True) for _ in range(4))
    try:
        stalled = [open_record(a[1], model), open_record(b[1], model)]
        assert guard.open["record"] == 2
        err = refused(lambda: fetch(d[1], model, (1, 1)))
        assert err.code == "RESOURCE_EXHAUSTED" and "2 records open already" in err.why
        forward_once(c[1], model)
        assert np.array_equal(fetch(c[1], model, (1, 1)), model.shard_set.read(1, 1))
        assert guard.open["record"] == 2 and guard.open["reserved"] == 0
        for call in stalled:
            call.cancel()
    finally:
        for channel, _ in (a, b, c, d):
            channel.close()


def silent_record(channel) -> grpc.RpcError:
    """A Record call whose request never comes: how it ends (within 10 s)."""
    silent = queue.SimpleQueue()
    record = channel.stream_stream(
        RECORD, pb.RecordRequest.SerializeToString, pb.RecordChunk.FromString
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            next(record(iter(silent.get, None), timeout=10))
        return err.value
    finally:
        silent.put(None)


def test_a_record_request_that_never_comes_ends_at_the_idle_timeout(small_node):
    node, addr = small_node
    channel, _ = own_stub(addr)
    with channel:
        t0 = time.monotonic()
        err = silent_record(channel)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in err.details()
        assert IDLE_S <= time.monotonic() - t0 < IDLE_S + 2
    wait_until(lambda: node.servicer.guard.open["record"] == 0, 2, what="the idle call closed")


# -- hostile nodes: the client's checks -------------------------------------------------------


class Hostile:
    """A gRPC server on loopback whose Record sends what `script(record)` yields (chunks, or a
    float: seconds to sleep), for a record of its own; `ended` is set when the stream is over
    (the script ran out, or the call was cancelled or past its deadline)."""

    def __init__(self, script: Callable[[bytes], Iterator], nbytes: int = 3 * 4096 + 100):
        self.script = script
        self.record = np.random.default_rng(nbytes).bytes(nbytes)
        self.root = merkle.root(self.record)
        self.ended = threading.Event()
        self.server = grpc.server(ThreadPoolExecutor(2))
        handler = grpc.unary_stream_rpc_method_handler(
            self._record, pb.RecordRequest.FromString, pb.RecordChunk.SerializeToString
        )
        handlers = grpc.method_handlers_generic_handler(SERVICE, {"Record": handler})
        self.server.add_generic_rpc_handlers((handlers,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _record(self, request, context):
        try:
            for item in self.script(self.record):
                if not context.is_active():
                    return
                if isinstance(item, float):
                    time.sleep(item)
                else:
                    yield item
        finally:
            self.ended.set()

    def fetch(self, timeout_s: float = 10.0) -> int:
        channel, stub = own_stub(f"127.0.0.1:{self.port}")
        with channel:
            out = np.empty(len(self.record), np.uint8)  # [nbytes]
            received = fetch_record(stub, "m", 1, 0, self.root, len(self.record), out, timeout_s)
            assert out.tobytes() == self.record
            return received

    def close(self) -> None:
        self.server.stop(None)


def pieces(record: bytes, size: int, start: int = 0, total: int | None = None) -> Iterator:
    """Consecutive chunks of `size` bytes of `record` from `start`, saying it has `total`."""
    total = len(record) if total is None else total
    for at in range(start, len(record), size):
        yield pb.RecordChunk(offset=at, data=record[at : at + size], record_bytes=total)


def endless(record: bytes) -> Iterator:
    """Chunks of 5000 bytes that go on past the record's end, for ever."""
    at = 0
    while True:
        data = (record[at : at + 5000] + b"x" * 5000)[:5000]
        yield pb.RecordChunk(offset=at, data=data, record_bytes=len(record))
        at += 5000


def skipped(record: bytes) -> Iterator:
    chunks = list(pieces(record, 4096))
    yield from chunks[:1] + chunks[2:]


def replayed(record: bytes) -> Iterator:
    chunks = list(pieces(record, 4096))
    yield from chunks[:2] + chunks[1:]


def forged(record: bytes) -> Iterator:
    yield from pieces(record[:-1] + bytes([record[-1] ^ 1]), 4096)


HOSTILE = {  # script -> what the client says
    "endless": (endless, "bytes sent"),
    "one huge chunk": (lambda r: iter([pb.RecordChunk(data=r + r, record_bytes=len(r))]), "sent"),
    "a skipped chunk": (skipped, "at offset 8192, 4096 bytes received"),
    "a chunk sent twice": (replayed, "at offset 4096, 8192 bytes received"),
    "another length": (lambda r: pieces(r, 4096, total=len(r) + 1), "bytes, not"),
    "an empty chunk": (lambda r: iter([pb.RecordChunk(record_bytes=len(r))]), "empty chunk"),
    "cut short": (lambda r: pieces(r[:-1], 4096, total=len(r)), "ended after"),
    "forged bytes": (forged, "Merkle root"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_stream_that_is_not_the_record_is_evidence_at_once(name):
    script, why = HOSTILE[name]
    node = Hostile(script)
    try:
        t0 = time.perf_counter()
        with pytest.raises(FetchError) as err:
            node.fetch(timeout_s=30)
        assert err.value.evidence and err.value.code == "" and why in err.value.why, err.value.why
        assert time.perf_counter() - t0 < 2  # not left to the deadline
        # the client cancelled the call (an endless stream would otherwise run to the deadline)
        wait_until(node.ended.is_set, 5, what="the hostile stream to end")
    finally:
        node.close()


def test_unusual_but_honest_chunks_are_taken():
    node = Hostile(lambda r: pieces(r, 5000))  # not block-aligned: still the record
    try:
        assert node.fetch() == len(node.record)
    finally:
        node.close()


def test_the_client_stops_reading_at_the_records_end():
    """A node that sends the whole record and then holds the call open (or sends more) does
    not keep the client: it has the record, checked, and cancels the rest."""

    def then_hang(record: bytes) -> Iterator:
        yield from pieces(record, 4096)
        while True:
            yield 0.05

    node = Hostile(then_hang)
    try:
        t0 = time.perf_counter()
        assert node.fetch(timeout_s=30) == len(node.record)
        assert time.perf_counter() - t0 < 2
        wait_until(node.ended.is_set, 5, what="the hanging stream to be cancelled")
    finally:
        node.close()


def test_a_node_that_trickles_bytes_is_cut_off_at_the_deadline():
    def trickle(record: bytes) -> Iterator:
        for chunk in pieces(record, 100):
            yield chunk
            yield 0.05  # 2 kB/s: the record would take 6 s

    node = Hostile(trickle)
    try:
        t0 = time.perf_counter()
        with pytest.raises(FetchError) as err:
            node.fetch(timeout_s=1.0)
        elapsed = time.perf_counter() - t0
        assert (err.value.code, err.value.evidence) == ("DEADLINE_EXCEEDED", False)
        assert 1.0 <= elapsed < 4.0  # the 1 s deadline, not the 6 s the record would take
        wait_until(node.ended.is_set, 5, what="the trickling stream to end")
    finally:
        node.close()


def test_a_client_may_fetch_the_records_the_node_computed_with_for_it_beyond_its_rate():
    """Record credit (`Guard.credit_records`): the bytes of the records a node's replies to a
    client used may be fetched by that client on top of its record rate, as a coordinator's
    audits need them; another client, which had nothing computed, has its rate alone."""
    from moeshard.node.guard import Guard
    from moeshard.node.limits import Refused

    mib = 1 << 20
    guard = Guard(Limits(record_rate=4 * mib).resolve(1 << 30, 4096, 2))
    guard.charge_bytes("auditor", 4 * mib)  # the bucket's one second, spent
    with pytest.raises(Refused, match="--record-rate-mb"):
        guard.charge_bytes("auditor", mib)
    guard.credit_records("auditor", 3 * mib)  # three records of 1 MiB computed for it
    for _ in range(3):
        guard.charge_bytes("auditor", mib)
    with pytest.raises(Refused):
        guard.charge_bytes("auditor", mib)  # the credit is spent, the bucket still empty
    guard.charge_bytes("stranger", 4 * mib)
    with pytest.raises(Refused):
        guard.charge_bytes("stranger", mib)
