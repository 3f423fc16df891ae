"""A real cluster on loopback: node daemons as subprocesses (ports 0), the coordinator's
RemoteExperts over gRPC, zeroconf discovery, failover after SIGKILL, re-admission, placement."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from coordinator.generate import SamplingOptions, generate
from coordinator.remote.config import RemoteConfig, RemoteError
from coordinator.remote.discovery import browse
from coordinator.remote.experts import RemoteExperts
from coordinator.runtime import open_local
from moe.convert.placement import shard_model
from moe.kernels import quant
from moe.model.model_dir import ModelDir
from moe.storage.shards import ShardFile
from moe.wire import codec
from moe.wire import moeshard_pb2 as pb
from moe.wire import moeshard_pb2_grpc as pb_grpc
from node.announce import advertised_addresses
from node.daemon import Node, NodeConfig

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 2, 7]
TOKENS = 12


class NodeProcess:
    """`moeshard node DIR` as a real subprocess; the port is read from its first line.

    A thread drains its output (so the pipe never fills) into `lines`.
    """

    def __init__(self, path, port: int = 0, advertise: bool = True, node_id: str = ""):
        cmd = [sys.executable, "-X", "faulthandler", "-m", "coordinator.cli", "node", str(path)]
        cmd += ["--port", str(port)] + ([] if advertise else ["--no-advertise"])
        cmd += ["--node-id", node_id] if node_id else []
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.path, self.port = path, 0
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put("")

    def wait_ready(self, timeout: float = 90.0) -> NodeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if " serving " in line:
                self.port = int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1])
                return self
            if not line:
                break
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(
            f"node {self.path} did not start (exit {self.proc.returncode}): {''.join(self.output)}"
        )

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def text(self) -> str:
        return "".join(self.output)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_nodes(paths, **kw) -> list[NodeProcess]:
    quant.warmup()  # compile once here into numba's disk cache; the nodes then just load it
    procs = [NodeProcess(p, **kw) for p in paths]
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            return list(pool.map(lambda n: n.wait_ready(), procs))
    except RuntimeError:
        for n in procs:
            n.stop()
        raise


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted("qwen3_moe")


@pytest.fixture(scope="module")
def plan(model_dir, tmp_path_factory):
    return shard_model(model_dir, 3, 2, tmp_path_factory.mktemp("shard") / "cluster")


@pytest.fixture(scope="module")
def cluster(plan):
    nodes = start_nodes([n["dir"] for n in plan["nodes"]])
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    rt = open_local(model_dir)
    return generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS, keep_logits=True))


def remote_runtime(model_dir, addrs, **config):
    model = ModelDir(model_dir)
    remote = RemoteExperts(model.model_id, model.config.hidden_size, addrs, RemoteConfig(**config))
    transformer = model.family.Transformer(model.config, model.load_trunk(), remote)
    return transformer, remote


# -- placement -----------------------------------------------------------------------------


def test_placement_replicates_and_copies_records_byte_for_byte(model_dir, plan):
    model = ModelDir(model_dir)
    holders = {tuple(map(int, k.split(":"))): v for k, v in plan["holders"].items()}
    assert set(holders) == set(model.locations)
    assert all(len(set(v)) == 2 for v in holders.values())
    counts = [len(n["experts"]) for n in plan["nodes"]]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 2 * len(model.locations)
    for node in plan["nodes"]:
        shard_dir = ModelDir(node["dir"])  # a valid model directory
        assert shard_dir.model_id == model.model_id and not shard_dir.has_trunk
        assert sorted(map(list, shard_dir.locations)) == node["experts"]
        for key, (shard, loc) in shard_dir.locations.items():
            src_shard, src_loc = model.locations[key]
            assert loc.crc32 == src_loc.crc32
            assert np.array_equal(shard.read(*key), src_shard.read(*key))
        assert not any(ShardFile(s.path).verify_all() for s in shard_dir.shards)
    assert json.loads(Path(plan["plan_file"]).read_text())["model_id"] == model.model_id


def test_placement_balances_trace_load(model_dir, tmp_path):
    trace = tmp_path / "trace.json"
    hot = {"0:0": 1000, "0:1": 900, "1:2": 800}  # three hot experts -> three different nodes
    trace.write_text(json.dumps(hot))
    plan = shard_model(model_dir, 3, 1, tmp_path / "out", trace)
    where = {k: v[0] for k, v in plan["holders"].items() if k in hot}
    assert len(set(where.values())) == 3
    loads = [n["load"] for n in plan["nodes"]]
    assert max(loads) < 1001  # the hottest expert's node gets (almost) nothing else
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"9:0": 1}))
    with pytest.raises(Exception, match="not in model"):
        shard_model(model_dir, 3, 1, tmp_path / "out2", bad)


# -- generation through the cluster --------------------------------------------------------


def test_generation_through_three_nodes_equals_single_node(model_dir, cluster, reference):
    transformer, remote = remote_runtime(model_dir, [n.addr for n in cluster])
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS, keep_logits=True))
        assert result.tokens == reference.tokens
        assert all(
            np.array_equal(a, b) for a, b in zip(result.logits, reference.logits, strict=True)
        )
        summary = remote.stats()
        assert summary["retries"] == 0 and all(n["up"] for n in summary["nodes"])
        assert sum(n["calls"] > 0 for n in summary["nodes"]) >= 2  # work is spread
    finally:
        remote.close()


def test_many_experts_per_token_give_the_same_bits_as_one_machine(model_dir, cluster, tmp_path):
    """Top-4 routing spreads a token's experts over all three nodes; the partial sums come back
    unrounded (f64), so the total is bit-identical to the single-process sum."""
    import shutil

    wide = tmp_path / "top4"
    shutil.copytree(model_dir, wide)
    config = json.loads((wide / "config.json").read_text())
    config["num_experts_per_tok"] = 4
    (wide / "config.json").write_text(json.dumps(config))
    opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
    local = generate(open_local(wide).transformer, PROMPT, opts)
    transformer, remote = remote_runtime(wide, [n.addr for n in cluster])
    try:
        result = generate(transformer, PROMPT, opts)
        assert result.tokens == local.tokens
        assert all(np.array_equal(a, b) for a, b in zip(result.logits, local.logits, strict=True))
        assert sum(n["calls"] > 0 for n in remote.stats()["nodes"]) == 3
    finally:
        remote.close()


def test_bf16_wire_is_close(model_dir, cluster, reference):
    transformer, remote = remote_runtime(model_dir, [n.addr for n in cluster], wire_dtype="bf16")
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=2, keep_logits=True))
        ref = reference.logits[0]
        assert np.abs(result.logits[0] - ref).max() < 0.05 * np.abs(ref).max()
    finally:
        remote.close()


def test_missing_expert_is_a_clear_error_or_dropped_with_degrade(model_dir, cluster, plan):
    one = [cluster[0].addr]  # node-00 holds 16 of the 24 experts
    transformer, remote = remote_runtime(model_dir, one)
    try:
        with pytest.raises(RemoteError, match=r"no live node holds expert \d+ of layer \d+"):
            generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
    finally:
        remote.close()
    transformer, remote = remote_runtime(model_dir, one, degrade=True)
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=4))
        assert len(result.tokens) == 4
        held = {tuple(k) for k in plan["nodes"][0]["experts"]}
        assert remote.dropped and all(k not in held for k in remote.dropped)
    finally:
        remote.close()


def test_foreign_model_node_is_ignored(model_dir, converted, cluster, caplog):
    other = Node(NodeConfig(path=str(converted("qwen3_moe", experts="bf16")), node_id="foreign"))
    port = other.start()  # advertised too
    try:
        model = ModelDir(model_dir)
        with caplog.at_level(logging.WARNING):
            remote = RemoteExperts(
                model.model_id, 64, [f"127.0.0.1:{port}", cluster[0].addr], RemoteConfig()
            )
        try:
            assert [p.addr for p in remote.peers.peers] == [cluster[0].addr]
            assert "differs" in remote.peers.ignored[f"127.0.0.1:{port}"]
        finally:
            remote.close()
        # Discovery sees every node, keeps the three of this model, warns about the other.
        found = []
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                found += browse(model.model_id, timeout=1.5)
                warned = any("foreign" in r.getMessage() for r in caplog.records)
                if warned and {n.addr for n in found} >= {n.addr for n in cluster}:
                    break
        assert {n.addr for n in found} >= {n.addr for n in cluster}
        assert f"127.0.0.1:{port}" not in {n.addr for n in found}
        assert any(
            "foreign" in r.getMessage() and "model id" in r.getMessage() for r in caplog.records
        )
        all_nodes: set[str] = set()
        for _ in range(3):  # mDNS answers can be late on a loaded machine
            all_nodes |= {n.node_id for n in browse(None, timeout=1.5)}
            if "foreign" in all_nodes:
                break
        assert "foreign" in all_nodes
        # A request carrying the wrong model id is refused by the node itself.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ExpertNodeStub(ch).Forward(
                    pb.ForwardRequest(model_id=model.model_id, layer=0), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        other.stop()


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_node_killed_mid_generation_then_readmitted(model_dir, cluster, plan, reference, transport):
    addrs = [n.addr for n in cluster]
    transformer, remote = remote_runtime(model_dir, addrs, backoff_s=0.2, transport=transport)
    killed: list[int] = []
    send = remote._send

    def kill_then_send(peer, request):
        """Mid-generation (after three tokens' worth of layer calls), SIGKILL the very node
        the coordinator is about to call, so the failure lands inside a layer's fan-out."""
        if not killed and remote.layer_calls >= 3 * 3:
            victim = addrs.index(peer.addr)
            os.kill(cluster[victim].proc.pid, signal.SIGKILL)
            cluster[victim].proc.wait()
            killed.append(victim)
        return send(peer, request)

    remote._send = kill_then_send
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
        assert killed and result.tokens == reference.tokens
        dead = next(p for p in remote.peers.peers if p.addr == addrs[killed[0]])
        assert not dead.up and dead.failures >= 1 and remote.retries >= 1
        # Restart it on the same port: the prober re-admits it.
        restarted = NodeProcess(plan["nodes"][killed[0]]["dir"], port=cluster[killed[0]].port)
        cluster[killed[0]] = restarted.wait_ready()
        deadline = time.monotonic() + 15
        while not dead.up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dead.up, "restarted node was not re-admitted"
        again = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
        assert again.tokens == reference.tokens
    finally:
        remote.close()
        for i in killed:  # whatever happened above, later tests get a full cluster back
            if cluster[i].proc.poll() is not None:
                node = NodeProcess(plan["nodes"][i]["dir"], port=cluster[i].port)
                cluster[i] = node.wait_ready()


def test_sigterm_finishes_in_flight_calls_and_exits_0(model_dir):
    quant.warmup()
    node = NodeProcess(model_dir, advertise=False).wait_ready()
    try:
        model = ModelDir(model_dir)
        with grpc.insecure_channel(node.addr) as ch:
            stub = pb_grpc.ExpertNodeStub(ch)
            rows = 2048
            ids = np.tile(np.arange(8), (rows, 1))  # [rows, 8]: every expert on every row
            req = pb.ForwardRequest(
                model_id=model.model_id,
                layer=0,
                hidden=codec.encode(np.ones((rows, 64), np.float32)),
                ids=codec.encode(ids, codec.I32),
                weights=codec.encode(np.full((rows, 8), 0.125, np.float32)),
            )
            stub.Forward(req, timeout=30)  # warm: connection up, records cached
            futures = [stub.Forward.future(req, timeout=30) for _ in range(3)]
            time.sleep(0.02)
            node.proc.send_signal(signal.SIGTERM)
            for f in futures:
                assert f.result().out.data  # in-flight calls finish
        assert node.proc.wait(timeout=20) == 0
        time.sleep(0.2)
        assert "stopped" in node.text()
    finally:
        node.stop()


def test_health_command(cluster):
    cli = [sys.executable, "-m", "coordinator.cli", "health"]
    ok = subprocess.run([*cli, cluster[0].addr], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    down = subprocess.run(
        [*cli, "127.0.0.1:1", "--timeout", "1"], capture_output=True, text=True, cwd=ROOT
    )
    assert down.returncode == 1 and "UNREACHABLE" in down.stdout


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_hung_node_misses_deadline_and_replicas_take_over(model_dir, cluster, reference, transport):
    addrs = [n.addr for n in cluster]
    transformer, remote = remote_runtime(
        model_dir, addrs, deadline_s=0.5, backoff_s=0.2, probe_interval_s=0.05, transport=transport
    )
    stopped: list[int] = []
    send = remote._send

    def stop_then_send(peer, request):
        """Mid-generation, SIGSTOP the node about to be called: alive, connected, silent."""
        if not stopped and remote.layer_calls >= 3 * 3:
            victim = addrs.index(peer.addr)
            os.kill(cluster[victim].proc.pid, signal.SIGSTOP)
            stopped.append(victim)
        return send(peer, request)

    remote._send = stop_then_send
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
        assert stopped and result.tokens == reference.tokens
        hung = next(p for p in remote.peers.peers if p.addr == addrs[stopped[0]])
        assert not hung.up and hung.failures >= 1
        os.kill(cluster[stopped[0]].proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while not hung.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hung.up, "node was not re-admitted after it resumed"
    finally:
        for i in stopped:
            os.kill(cluster[i].proc.pid, signal.SIGCONT)
        remote.close()


def test_node_on_all_interfaces_is_discovered_at_a_real_address(model_dir):
    node = Node(NodeConfig(path=str(model_dir), host="0.0.0.0", node_id="all-interfaces"))
    port = node.start()
    try:
        found: list = []
        for _ in range(3):
            found = [
                n for n in browse(node.identity.model_id, 1.5) if n.node_id == "all-interfaces"
            ]
            if found:
                break
        assert found, "zeroconf did not find the node"
        host, _, got_port = found[0].addr.rpartition(":")
        assert int(got_port) == port
        assert host == advertised_addresses("0.0.0.0")[0]  # a real interface when there is one
        with grpc.insecure_channel(found[0].addr) as ch:
            info = pb_grpc.ExpertNodeStub(ch).Info(pb.InfoRequest(), timeout=5)
        assert info.node_id == "all-interfaces"
    finally:
        node.stop()
    # Unregistered on stop: a fresh browse no longer sees it.
    assert "all-interfaces" not in {n.node_id for n in browse(None, 1.0)}


def test_node_started_later_joins_a_running_generation(converted):
    """With --discover the coordinator keeps browsing: a node announced after start-up is
    admitted (its id not doubled), and once the first node dies the late one carries the
    generation to the same tokens as one machine. A model id of its own keeps other tests'
    nodes out of the picture."""
    from coordinator.runtime import open_remote

    path = converted("qwen3_moe", experts="q8_0")
    local = open_local(path)
    want = generate(local.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS)).tokens
    early = Node(NodeConfig(path=str(path), node_id="early"))
    early.start()
    late = None
    rt = None
    try:
        rt = open_remote(path, discover=True, discover_timeout=1.5)
        remote = rt.experts
        assert [p.node_id for p in remote.live_peers()] == ["early"]
        late = Node(NodeConfig(path=str(path), node_id="late"))
        late.start()
        deadline = time.monotonic() + 20  # mDNS announcements can be slow on a loaded box
        while time.monotonic() < deadline:
            if "late" in {p.node_id for p in remote.live_peers()}:
                break
            time.sleep(0.1)
        assert sorted(p.node_id for p in remote.live_peers()) == ["early", "late"]
        assert not remote.add_peer(f"127.0.0.1:{late.port}")  # known: not added twice
        early.stop()
        got = generate(rt.transformer, PROMPT, SamplingOptions(max_tokens=TOKENS)).tokens
        assert got == want
        assert next(p for p in remote.peers.peers if p.node_id == "late").calls > 0
    finally:
        if rt is not None:
            rt.experts.close()
        if late is not None:
            late.stop()
        early.stop()
