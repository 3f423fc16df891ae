"""A node keeps serving well-behaved clients whatever a few others do (node/limits.py): idle
streams and calls, bursts of large requests, shapes that overflow, absurd inputs, clients over
their rate or their open calls. Real node processes (and an in-process node) on loopback."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from helpers import (
    PROMPT,
    TOKENS,
    client_key,
    memory_mib,
    node_process,
    remote_runtime,
    reset_peak_memory,
    start_nodes,
    wait_until,
)

from moeshard.cli import build_parser
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.transport import CHANNEL_OPTIONS, PeerSpec, dial
from moeshard.coordinator.runtime import open_local
from moeshard.moe.identity import keys
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.wire import codec, health_pb2, health_pb2_grpc
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc
from moeshard.node.daemon import Node, NodeConfig, resolve_limits
from moeshard.node.fairness import Busy, FairGate, Flow
from moeshard.node.limits import Limits

H = 64  # hidden size of the qwen3_moe fixture (8 experts per MoE layer)
IDLE_S = 5.0  # idle timeout of the attacked node
DECODE = 24  # tokens per measured generation
FIXED_MIB = 64  # RSS allowed beyond the limits' request memory: grpc buffers, thread stacks
OK, BUSY = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
FORWARD = "/moeshard.v1.ExpertNode/Forward"


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("qwen3_moe")


@pytest.fixture(scope="module")
def model_id(model_dir):
    return ModelDir(model_dir).model_id


@pytest.fixture(scope="module")
def plain_node(model_dir):
    """A node process with the default limits, plaintext on loopback (each connection is a
    client of its own)."""
    [node] = start_nodes([model_dir], advertise=False, insecure=True)
    yield node
    node.stop()


def forward_request(model_id: str, rows: int, slots: int = 2, scale: float = 1.0):
    """A Forward of layer 0: `rows` random rows (times `scale`), each to experts 0, 1, ..."""
    hidden = np.random.default_rng(rows).standard_normal((rows, H), dtype=np.float32)  # [T, H]
    ids = np.full((rows, slots), -1, np.int32)  # [T, slots]
    ids[:, : min(slots, 8)] = np.arange(min(slots, 8))
    weights = np.full((rows, slots), 1 / slots, np.float32)  # [T, slots]
    return pb.ForwardRequest(
        model_id=model_id,
        layer=0,
        hidden=codec.encode(hidden * np.float32(scale)),
        ids=codec.encode(ids, codec.I32),
        weights=codec.encode(weights),
    )


def own_channel(addr: str) -> grpc.Channel:
    """A plaintext channel on a connection of its own (not shared with the process's others)."""
    return grpc.insecure_channel(
        addr, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    )


def status_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return OK, ""


class HealthChecks:
    """grpc.health.v1 Check every 20 ms in a thread while the block runs."""

    def __init__(self, channel: grpc.Channel):
        self.stub = health_pb2_grpc.HealthStub(channel)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthChecks:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            t0 = time.perf_counter()
            try:
                reply = self.stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    self.failures.append(f"status {reply.status}")
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
            self.latencies.append(time.perf_counter() - t0)

    def summary(self) -> str:
        return f"{len(self.latencies)} health checks, slowest {max(self.latencies) * 1e3:.0f} ms"


class Ends:
    """How and when (seconds after this was made) each watched call ended."""

    def __init__(self):
        self.start = time.monotonic()
        self.kinds: list[str] = []
        self.ended: dict[int, tuple[float, grpc.StatusCode, str]] = {}

    def watch(self, call, kind: str):
        index = len(self.kinds)
        self.kinds.append(kind)
        call.add_done_callback(lambda c: self._done(index, c))
        return call

    def _done(self, index: int, call) -> None:
        self.ended[index] = (time.monotonic() - self.start, call.code(), call.details() or "")

    def of(self, kind: str, code: grpc.StatusCode) -> list[tuple[float, grpc.StatusCode, str]]:
        return [e for i, e in sorted(self.ended.items()) if self.kinds[i] == kind and e[1] == code]


# -- (a) idle streams and calls ---------------------------------------------------------------


def honest_tokens_per_s(model_dir, node, want: list[int]) -> float:
    """The best decode tokens/s of three generations through `node` by a fresh client, each
    checked to give `want`."""
    transformer, remote = remote_runtime(model_dir, [node.spec])
    try:
        generate(transformer, PROMPT, SamplingOptions(max_tokens=2))  # connect, open the stream
        best = 0.0
        for _ in range(3):
            result = generate(transformer, PROMPT, SamplingOptions(max_tokens=DECODE))
            assert result.tokens == want
            best = max(best, len(result.decode_s) / sum(result.decode_s))
        return best
    finally:
        remote.close()


def test_idle_streams_and_calls_do_not_stop_an_honest_generation(model_dir, tmp_path):
    """Three clients open 16 ForwardStreams each and send nothing; a fourth opens 8 Forward
    calls whose message never comes and 8 health Watch streams. A generation through the node
    still gives the tokens of one machine at no less than half its normal speed, health checks
    are answered all along, and the idle calls end after the idle timeout."""
    attackers = [keys.generate(tmp_path / f"attacker-{i}.pem") for i in range(4)]
    allow = ",".join([client_key().id, *(a.id for a in attackers)])
    node = node_process(model_dir, "--idle-timeout", str(IDLE_S), allow=allow)
    silent: queue.SimpleQueue = queue.SimpleQueue()  # nothing is ever sent from it ...
    channels = []
    try:
        local = open_local(model_dir).transformer
        want = generate(local, PROMPT, SamplingOptions(max_tokens=DECODE)).tokens
        normal = honest_tokens_per_s(model_dir, node, want)

        ends = Ends()
        for key in attackers:
            channel, _ = dial(node.spec, client_tls(key), 5)
            channels.append(channel)
        for channel in channels[:3]:
            stub = pb_grpc.ExpertNodeStub(channel)
            for _ in range(16):
                ends.watch(stub.ForwardStream(iter(silent.get, None)), "stream")
        forward = channels[3].stream_unary(  # a unary Forward whose message never comes
            FORWARD, pb.ForwardRequest.SerializeToString, pb.ForwardReply.FromString
        )
        for _ in range(8):
            ends.watch(forward.future(iter(silent.get, None)), "unary")
        watches = [
            ends.watch(
                health_pb2_grpc.HealthStub(channels[3]).Watch(health_pb2.HealthCheckRequest()),
                "watch",
            )
            for _ in range(8)
        ]
        per_client = Limits().per_client
        refused = 3 * (16 - per_client) + (8 - per_client) + (8 - Limits().max_watches)
        wait_until(lambda: len(ends.ended) >= refused, 10, what="the calls over the caps refused")
        assert all(code == BUSY for _, code, _ in ends.ended.values()), ends.ended

        health_channel, _ = dial(node.spec, client_tls(client_key()), 5)
        with health_channel, HealthChecks(health_channel) as health:
            attacked = honest_tokens_per_s(model_dir, node, want)
            attack_over = time.monotonic() - ends.start
        assert len(ends.ended) == refused, "idle calls ended before the generation was over"
        print(
            f"\nhonest decode {normal:.0f} tokens/s normally, {attacked:.0f} tokens/s beside "
            f"{3 * per_client} idle streams, {per_client} idle calls and "
            f"{Limits().max_watches} watches ({attack_over:.1f} s into the attack); "
            f"{health.summary()}"
        )
        assert attacked >= normal / 2
        assert not health.failures, health.failures

        idle = 3 * per_client + per_client
        wait_until(
            lambda: len(ends.ended) >= refused + idle, IDLE_S + 10, what="the idle calls to end"
        )
        timed_out = ends.of("stream", grpc.StatusCode.DEADLINE_EXCEEDED)
        timed_out += ends.of("unary", grpc.StatusCode.DEADLINE_EXCEEDED)
        assert len(timed_out) == idle
        assert all(IDLE_S <= at <= IDLE_S + 3 and "idle" in why for at, _, why in timed_out)
        for watch in watches:
            watch.cancel()
        assert "Traceback" not in node.text()
    finally:
        for _ in range(64):
            silent.put(None)  # ... until the end: every iterator on it stops
        for channel in channels:
            channel.close()
        node.stop()


# -- (b) a burst of large requests ------------------------------------------------------------


def burst(addr: str, request, n: int) -> list[tuple[grpc.StatusCode, str]]:
    """`n` concurrent Forward calls of `request`, each on a connection of its own: their
    status codes and details."""

    def one(_) -> tuple[grpc.StatusCode, str]:
        with own_channel(addr) as channel:
            stub = pb_grpc.ExpertNodeStub(channel)
            # wait_for_ready: a connection slow to come up under load is not the node's answer
            return status_of(lambda: stub.Forward(request, timeout=60, wait_for_ready=True))

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_burst_of_large_requests_stays_within_the_memory_bound(plain_node, model_dir, model_id):
    """40 concurrent ~34 MB Forwards (refused by grpc, unread: over the request limit), then 40
    that fit (computed a few at a time, the rest refused "node busy"): the node's RSS stays
    within its idle RSS + the limits' request memory + FIXED_MIB, health checks are answered
    throughout, and a normal Forward is answered after."""
    node, pid = plain_node, plain_node.proc.pid
    limits = resolve_limits(ModelDir(model_dir), NodeConfig(path=str(model_dir)))
    big = forward_request(model_id, 65536, slots=32)  # [65536, 64] f32 + 2 x [65536, 32]
    rows = min(limits.max_rows, (limits.max_request_bytes - 4096) // (4 * H + 8 * 2))
    fits = forward_request(model_id, rows)
    assert big.ByteSize() > 32 << 20 and fits.ByteSize() < limits.max_request_bytes
    with own_channel(node.addr) as channel:
        stub = pb_grpc.ExpertNodeStub(channel)
        assert stub.Forward(forward_request(model_id, 4), timeout=5).out.data
        idle = memory_mib(pid)["VmRSS"]
        peaks, statuses = [], []
        with HealthChecks(channel) as health:
            for request in (big, fits):
                reset_peak_memory(pid)
                statuses.append(burst(node.addr, request, 40))
                peaks.append(memory_mib(pid)["VmHWM"])
        after = memory_mib(pid)["VmRSS"]
        codes = [[code for code, _ in s] for s in statuses]
        bound = idle + limits.request_memory() / (1 << 20) + FIXED_MIB
        print(
            f"\nnode RSS: {idle:.0f} MiB idle; peak {peaks[0]:.0f} MiB in 40 x "
            f"{big.ByteSize() / 1e6:.0f} MB, {peaks[1]:.0f} MiB in 40 x "
            f"{fits.ByteSize() / 1e6:.1f} MB ({codes[1].count(OK)} computed); {after:.0f} MiB "
            f"after; bound {bound:.0f} MiB; {health.summary()}"
        )
        assert codes[0] == [BUSY] * 40, set(statuses[0])  # grpc refuses them itself, unread
        assert OK in codes[1] and set(codes[1]) <= {OK, BUSY}, set(statuses[1])
        assert max(peaks) <= bound
        assert not health.failures, health.failures
        assert stub.Forward(forward_request(model_id, 4), timeout=5).out.data


# -- (c), (d) malformed shapes and absurd inputs ----------------------------------------------


def test_shapes_that_overflow_are_invalid_and_the_node_keeps_serving(plain_node, model_id):
    ok = forward_request(model_id, 4)
    huge = 2**62
    twice = np.array([[0, 1]] * 3 + [[2, 2]])  # [4, 2]: the last row names expert 2 twice

    def edit(**tensors) -> pb.ForwardRequest:
        request = pb.ForwardRequest()
        request.CopyFrom(ok)
        for name, tensor in tensors.items():
            getattr(request, name).CopyFrom(tensor)
        return request

    cases = {
        "hidden [4, 2**62]": edit(hidden=pb.Tensor(shape=[4, huge], dtype=pb.F32)),
        "hidden [2**62, H]": edit(hidden=pb.Tensor(shape=[huge, H], dtype=pb.F32)),
        "ids [4, 2**62]": edit(ids=pb.Tensor(shape=[4, huge], dtype=pb.I32)),
        "weights [4, 2**62]": edit(weights=pb.Tensor(shape=[4, huge], dtype=pb.F32)),
        "an expert in two slots": edit(ids=codec.encode(twice, codec.I32)),
    }
    with own_channel(plain_node.addr) as channel:
        stub = pb_grpc.ExpertNodeStub(channel)
        for name, request in cases.items():
            with pytest.raises(grpc.RpcError) as err:
                stub.Forward(request, timeout=5)
            assert err.value.code() == INVALID, f"{name}: {err.value.details()}"
            assert "shape" in err.value.details() or "two slots" in err.value.details()
            assert stub.Forward(ok, timeout=5).out.data, f"node stopped serving after {name}"
    assert "Traceback" not in plain_node.text()


def test_absurd_inputs_get_invalid_argument_not_inf(plain_node, model_id):
    """A hidden state times 1e30 (finite) overflows in the experts; times 1e16 gives ~1e32:
    both are refused rather than sent as results."""
    with own_channel(plain_node.addr) as channel:
        stub = pb_grpc.ExpertNodeStub(channel)
        for scale in (1e30, 1e16):
            with pytest.raises(grpc.RpcError) as err:
                stub.Forward(forward_request(model_id, 4, scale=scale), timeout=5)
            assert err.value.code() == INVALID
            assert "result not finite" in err.value.details()
            assert "input too large" in err.value.details()
        reply = stub.Forward(forward_request(model_id, 4, scale=1e3), timeout=5)
        assert np.isfinite(codec.decode(reply.out, "out", (codec.F32,), (4, H))).all()


# -- (e) rate and open calls per client -------------------------------------------------------


@pytest.fixture
def strict_node(model_dir, tmp_path):
    """An in-process node over mutual TLS open to any client, with small per-client limits."""
    limits = Limits(rate=20, per_client=2, max_rows=64, rate_rows=64)
    node = Node(
        NodeConfig(
            path=str(model_dir),
            advertise=False,
            key=str(tmp_path / "node.pem"),
            allow_any=True,
            limits=limits,
        )
    )
    port = node.start()
    yield node, PeerSpec(f"127.0.0.1:{port}", node.identity.node_id)
    node.stop()


def test_a_client_over_its_rate_or_open_calls_is_refused_while_another_is_served(
    strict_node, tmp_path
):
    node, spec = strict_node
    model_id = node.identity.model_id
    greedy_channel, _ = dial(spec, client_tls(keys.generate(tmp_path / "greedy.pem")), 5)
    other_channel, _ = dial(spec, client_tls(keys.generate(tmp_path / "other.pem")), 5)
    greedy = pb_grpc.ExpertNodeStub(greedy_channel)
    other = pb_grpc.ExpertNodeStub(other_channel)
    small, full = forward_request(model_id, 1), forward_request(model_id, 64)
    silent: queue.SimpleQueue = queue.SimpleQueue()
    try:
        # calls/s: the bucket holds 20 (one second of --rate 20)
        served = 0
        with pytest.raises(grpc.RpcError) as err:
            for _ in range(100):
                greedy.Forward(small, timeout=5)
                served += 1
        assert err.value.code() == BUSY and "calls/s (--rate)" in err.value.details()
        assert 20 <= served < 30
        assert other.Forward(small, timeout=5).out.data

        # rows/s: a bucket of 64 rows takes one full request, not a second one
        time.sleep(1.1)  # the greedy client's buckets fill up again
        assert greedy.Forward(full, timeout=5).out.data
        with pytest.raises(grpc.RpcError) as err:
            greedy.Forward(full, timeout=5)
        assert err.value.code() == BUSY and "rows/s (--rate-rows)" in err.value.details()
        assert other.Forward(full, timeout=5).out.data
        with pytest.raises(grpc.RpcError) as err:
            other.Forward(forward_request(model_id, 65), timeout=5)
        assert err.value.code() == BUSY and "(--max-rows)" in err.value.details()

        # open calls: of three idle streams, the client's cap of two is admitted
        ends = Ends()
        streams = [
            ends.watch(greedy.ForwardStream(iter(silent.get, None)), "stream") for _ in range(3)
        ]
        wait_until(lambda: ends.ended, 5, what="a stream over the client's cap to be refused")
        [(_, code, why)] = ends.ended.values()
        assert code == BUSY and "(--per-client)" in why
        assert other.Info(pb.InfoRequest(), timeout=5).node_id == node.identity.node_id
        assert node.servicer.guard.open["stream"] == 2
        for stream in streams:
            stream.cancel()
    finally:
        for _ in range(3):
            silent.put(None)
        greedy_channel.close()
        other_channel.close()


# -- the machinery and the flags --------------------------------------------------------------


def test_the_work_gate_queues_in_order_and_refuses_at_once_when_full():
    gate = FairGate(slots=1, queue=1)
    one = Flow("127.0.0.1", "one")
    release, order = threading.Event(), []

    def holder() -> None:
        with gate.hold(one, 1, 5):
            order.append("holder")
            release.wait()

    def waiter() -> None:
        with gate.hold(one, 1, 5):
            order.append("waiter")

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    wait_until(lambda: order, 5, what="the holder")
    threads.append(threading.Thread(target=waiter))
    threads[1].start()
    wait_until(lambda: gate.waiting, 5, what="the waiter to queue")
    t0 = time.perf_counter()
    with pytest.raises(Busy, match="node busy"):  # the queue is full of its own: refused at once
        with gate.hold(one, 1, 5):
            pass
    assert time.perf_counter() - t0 < 2.5  # not after its 5 s wait (a loaded CI: no tighter)
    release.set()
    for thread in threads:
        thread.join()
    assert order == ["holder", "waiter"]
    with gate.hold(one, 1, 5):  # a slot held, the queue free: refused after the wait
        t0 = time.perf_counter()
        with pytest.raises(Busy, match="within 0.2 s"):
            with gate.hold(one, 1, 0.2):
                pass
        assert 0.2 <= time.perf_counter() - t0 < 2.5  # its own wait, not the holder's 5 s


def test_node_flags_default_to_the_limits_defaults_and_size_the_server():
    args = build_parser().parse_args(["node", "DIR"])
    want = Limits()
    assert args.max_request_mb == want.max_request_bytes == 0
    assert args.max_rows == want.max_rows == 0
    assert args.rate_rows == want.rate_rows == 0
    assert (args.max_inflight, args.max_streams, args.per_client) == (
        want.max_queue,
        want.max_streams,
        want.per_client,
    )
    assert (args.rate, args.idle_timeout) == (want.rate, want.idle_timeout_s)
    # the threads hold every call and stream the caps admit and still leave spares for health
    assert want.workers() > want.max_calls + want.max_streams + want.max_watches
    budget = 4 * want.messages_held() * (64 << 20) + (1 << 30)  # the budget the ceiling needs
    sized = want.resolve(budget=budget, row_bytes=4 * 2048 + 8 * 8, moe_layers=48)
    assert sized.max_request_bytes == 64 << 20  # the ceiling: a quarter of grpc's limit
    assert sized.request_memory() <= budget // 4
    small = want.resolve(budget=1 << 20, row_bytes=4 * H + 16, moe_layers=3)
    assert small.max_request_bytes == 8 << 20  # the floor
    assert small.max_rows == (8 << 20) // (4 * H + 16)


def test_the_coordinator_splits_requests_over_a_nodes_row_limit_and_reopens_ended_streams(
    model_dir,
):
    """A node that takes 2 rows per Forward (stated in its Info) still serves a 5-token
    prefill: the coordinator splits it, and the logits are the single machine's bit for bit.
    A stream the node ends after its idle timeout is replaced, not taken for a dead node."""
    local = open_local(model_dir)
    opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
    want = generate(local.transformer, PROMPT, opts)
    node = Node(
        NodeConfig(
            path=str(model_dir),
            advertise=False,
            insecure=True,
            limits=Limits(max_rows=2, idle_timeout_s=1.0),
        )
    )
    port = node.start()
    try:
        transformer, remote = remote_runtime(
            model_dir, [PeerSpec(f"127.0.0.1:{port}")], insecure=True
        )
        try:
            assert remote.live_peers()[0].max_rows == 2
            got = generate(transformer, PROMPT, opts)
            assert got.tokens == want.tokens
            assert all(np.array_equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))
            time.sleep(1.5)  # past the node's idle timeout: it ends the coordinator's stream
            again = generate(transformer, PROMPT, opts)
            assert again.tokens == want.tokens and remote.retries == 0
        finally:
            remote.close()
    finally:
        node.stop()
