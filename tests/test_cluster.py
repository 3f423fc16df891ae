"""A real cluster on loopback: node daemons as subprocesses (ports 0), the coordinator's
RemoteExperts over gRPC, placement, failover after SIGKILL or SIGSTOP, re-admission, SIGTERM.
Zeroconf discovery and late joins are in test_discovery.py; the fixtures in conftest.py."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers import (
    FIXTURES,
    PROMPT,
    ROOT,
    TOKENS,
    NodeProcess,
    generate_on_nodes,
    node_process,
    remote_runtime,
    wait_until,
)

from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import RemoteError
from moeshard.coordinator.runtime import open_local
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.kernels import quant
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.shards import ShardFile
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc

# -- placement -----------------------------------------------------------------------------


def test_placement_replicates_and_copies_records_byte_for_byte(cluster_model, cluster_plan):
    model = ModelDir(cluster_model)
    holders = {tuple(map(int, k.split(":"))): v for k, v in cluster_plan["holders"].items()}
    assert set(holders) == set(model.locations)
    assert all(len(set(v)) == 2 for v in holders.values())
    counts = [len(n["experts"]) for n in cluster_plan["nodes"]]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 2 * len(model.locations)
    for node in cluster_plan["nodes"]:
        shard_dir = ModelDir(node["dir"])  # a valid model directory
        assert shard_dir.model_id == model.model_id and not shard_dir.has_trunk
        assert sorted(map(list, shard_dir.locations)) == node["experts"]
        for key, (shard, loc) in shard_dir.locations.items():
            src_shard, src_loc = model.locations[key]
            assert loc.crc32 == src_loc.crc32
            assert np.array_equal(shard.read(*key), src_shard.read(*key))
        assert not any(ShardFile(s.path).verify_all() for s in shard_dir.shards)
    assert json.loads(Path(cluster_plan["plan_file"]).read_text())["model_id"] == model.model_id


def test_placement_balances_trace_load(cluster_model, tmp_path):
    trace = tmp_path / "trace.json"
    hot = {"0:0": 1000, "0:1": 900, "1:2": 800}  # three hot experts -> three different nodes
    trace.write_text(json.dumps(hot))
    plan = shard_model(cluster_model, 3, 1, tmp_path / "out", trace)
    where = {k: v[0] for k, v in plan["holders"].items() if k in hot}
    assert len(set(where.values())) == 3
    loads = [n["load"] for n in plan["nodes"]]
    assert max(loads) < 1001  # the hottest expert's node gets (almost) nothing else
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"9:0": 1}))
    with pytest.raises(Exception, match="not in model"):
        shard_model(cluster_model, 3, 1, tmp_path / "out2", bad)


# -- generation through the cluster --------------------------------------------------------


def test_generation_through_three_nodes_equals_single_node(
    cluster_model, cluster, cluster_reference
):
    transformer, remote = remote_runtime(cluster_model, [n.spec for n in cluster])
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS, keep_logits=True))
        assert result.tokens == cluster_reference.tokens
        assert all(
            np.array_equal(a, b)
            for a, b in zip(result.logits, cluster_reference.logits, strict=True)
        )
        summary = remote.stats()
        assert summary["retries"] == 0 and all(n["up"] for n in summary["nodes"])
        assert sum(n["calls"] > 0 for n in summary["nodes"]) >= 2  # work is spread
    finally:
        remote.close()


def test_many_experts_per_token_give_the_same_bits_as_one_machine(tmp_path):
    """Top-4 routing spreads a token's experts over all three nodes; the partial sums come back
    unrounded (f64), so the total is bit-identical to the single-process sum. (A top-4 model is
    another model: its own conversion, with its own id, on its own nodes.)"""
    import shutil

    from moeshard.moe.convert.converter import convert

    src = tmp_path / "top4-hf"
    shutil.copytree(FIXTURES / "qwen3_moe", src)
    config = json.loads((src / "config.json").read_text())
    config["num_experts_per_tok"] = 4
    (src / "config.json").write_text(json.dumps(config))
    wide = tmp_path / "top4"
    convert(src, wide, "f32", "f32", progress=False)
    plan = shard_model(wide, 3, 2, tmp_path / "top4-shards")
    opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
    local = generate(open_local(wide).transformer, PROMPT, opts)
    result, calls = generate_on_nodes(wide, plan, PROMPT, opts)
    assert result.tokens == local.tokens
    assert all(np.array_equal(a, b) for a, b in zip(result.logits, local.logits, strict=True))
    assert sum(c > 0 for c in calls) == 3


def test_bf16_wire_is_close(cluster_model, cluster, cluster_reference):
    transformer, remote = remote_runtime(
        cluster_model, [n.spec for n in cluster], wire_dtype="bf16"
    )
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=2, keep_logits=True))
        ref = cluster_reference.logits[0]
        assert np.abs(result.logits[0] - ref).max() < 0.05 * np.abs(ref).max()
    finally:
        remote.close()


def test_missing_expert_is_a_clear_error_or_dropped_with_degrade(
    cluster_model, cluster, cluster_plan
):
    one = [cluster[0].spec]  # node-00 holds 16 of the 24 experts
    transformer, remote = remote_runtime(cluster_model, one)
    try:
        with pytest.raises(RemoteError, match=r"no live node holds expert \d+ of layer \d+"):
            generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
    finally:
        remote.close()
    transformer, remote = remote_runtime(cluster_model, one, degrade=True)
    try:
        result = generate(transformer, PROMPT, SamplingOptions(max_tokens=4))
        assert len(result.tokens) == 4
        held = {tuple(k) for k in cluster_plan["nodes"][0]["experts"]}
        assert remote.dropped and all(k not in held for k in remote.dropped)
    finally:
        remote.close()


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_node_killed_mid_generation_then_readmitted(
    cluster_model, cluster, cluster_plan, cluster_reference, transport
):
    addrs = [n.addr for n in cluster]
    specs = [n.spec for n in cluster]
    transformer, remote = remote_runtime(cluster_model, specs, backoff_s=0.2, transport=transport)
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
        assert killed and result.tokens == cluster_reference.tokens
        dead = next(p for p in remote.peers.peers if p.addr == addrs[killed[0]])
        # The call to the dead node may have been hedged: the generation then ends before its
        # failure is seen, which bans it as soon as the stream (or the call) fails.
        wait_until(lambda: not dead.up, 5, 0.02, what="the dead node to be banned")
        assert dead.failures >= 1 and remote.retries + remote.hedges >= 1
        # Restart it on the same port: the prober re-admits it.
        restarted = NodeProcess(
            cluster_plan["nodes"][killed[0]]["dir"], port=cluster[killed[0]].port
        )
        cluster[killed[0]] = restarted.wait_ready()
        wait_until(lambda: dead.up, 15, 0.1, what="the prober to re-admit the restarted node")
        again = generate(transformer, PROMPT, SamplingOptions(max_tokens=TOKENS))
        assert again.tokens == cluster_reference.tokens
    finally:
        remote.close()
        for i in killed:  # whatever happened above, later tests get a full cluster back
            if cluster[i].proc.poll() is not None:
                node = NodeProcess(cluster_plan["nodes"][i]["dir"], port=cluster[i].port)
                cluster[i] = node.wait_ready()


def test_sigterm_finishes_in_flight_calls_and_exits_0(cluster_model):
    quant.warmup()
    node = NodeProcess(cluster_model, advertise=False, insecure=True).wait_ready()
    try:
        model = ModelDir(cluster_model)
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
            # A moment for the calls to reach the node, not for them to finish (one takes
            # ~65 ms here). Not a wait on Info: it answers only after the compute lock is free,
            # i.e. once calls have finished, which is the state this test must not wait for.
            time.sleep(0.02)
            node.proc.send_signal(signal.SIGTERM)
            pending = sum(not f.done() for f in futures)
            for f in futures:
                assert f.result().out.data  # in-flight calls finish
            assert pending, "every call had finished before SIGTERM: nothing was in flight"
        assert node.proc.wait(timeout=20) == 0
        wait_until(node.eof.is_set, 10, what="the node's output to end")
        assert "stopped" in node.text()
    finally:
        node.stop()


def test_health_command(cluster, tmp_path):
    """Over TLS with a client key of its own (not on the node's allow list: health is
    answered to every authenticated client); the node's id is shown and can be pinned."""
    cli = [sys.executable, "-m", "moeshard", "health"]
    env = dict(os.environ, MOESHARD_HOME=str(tmp_path))
    run = functools.partial(subprocess.run, capture_output=True, text=True, cwd=ROOT, env=env)
    ok = run([*cli, cluster[0].addr])
    assert ok.returncode == 0 and "SERVING" in ok.stdout and cluster[0].node_id in ok.stdout
    pinned = run([*cli, f"{cluster[0].node_id}@{cluster[0].addr}"])
    assert pinned.returncode == 0 and "SERVING" in pinned.stdout
    down = run([*cli, "127.0.0.1:1", "--timeout", "1"])
    assert down.returncode == 1 and "UNREACHABLE" in down.stdout


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_hung_node_misses_deadline_and_replicas_take_over(
    cluster_model, cluster, cluster_reference, transport
):
    addrs = [n.addr for n in cluster]
    transformer, remote = remote_runtime(
        cluster_model,
        [n.spec for n in cluster],
        deadline_s=0.5,
        backoff_s=0.2,
        probe_interval_s=0.05,
        transport=transport,
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
        assert stopped and result.tokens == cluster_reference.tokens
        hung = next(p for p in remote.peers.peers if p.addr == addrs[stopped[0]])
        # banned at its deadline, or (its rows hedged to a replica first) when the ping sent
        # after LATE_PING_S fails: that can land just after the last token
        wait_until(lambda: not hung.up and hung.failures >= 1, 5, what="the hung node banned")
        os.kill(cluster[stopped[0]].proc.pid, signal.SIGCONT)
        wait_until(lambda: hung.up, 15, what="the prober to re-admit the resumed node")
    finally:
        for i in stopped:
            os.kill(cluster[i].proc.pid, signal.SIGCONT)
        remote.close()


def test_quantized_experts_on_shard_nodes_split_into_single_rows_give_one_machines_bits(
    converted, tmp_path
):
    """q4_0 experts (the demo's format), spread over three shard nodes that take at most 1
    and 2 rows per Forward: every expert sees its rows in other batches than on one machine
    (a prefill row alone, or with another), yet the kernels are deterministic per row and the
    partial sums come back unrounded, so the logits are one machine's bit for bit, twice (and
    every audit's re-run gives the same bits). With the kernels before issue 15 this failed."""
    model = converted("qwen3_moe", experts="q4_0")
    plan = shard_model(model, 3, 2, tmp_path / "q4")
    opts = SamplingOptions(max_tokens=TOKENS, keep_logits=True)
    local = generate(open_local(model).transformer, PROMPT, opts)
    limits = (["--max-rows", "1"], ["--max-rows", "2"], [])
    nodes = [node_process(n["dir"], *f) for n, f in zip(plan["nodes"], limits, strict=True)]
    try:
        for _ in range(2):
            transformer, remote = remote_runtime(model, [n.spec for n in nodes], audit=1.0)
            try:
                got = generate(transformer, PROMPT, opts, verifier=remote.verifier)
                audit = remote.stats()["audit"]
            finally:
                remote.close()
            assert got.tokens == local.tokens
            assert all(np.array_equal(a, b) for a, b in zip(got.logits, local.logits, strict=True))
            assert audit["picked"] > 0 and audit["passed"] == audit["picked"], audit
    finally:
        for n in nodes:
            n.stop()
