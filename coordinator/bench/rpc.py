"""`moeshard bench rpc MODEL`: what the network costs, measured against same-run baselines.

Starts real node daemons (subprocesses, loopback, ports 0) on MODEL and on shard splits of it,
then prints:
  1. one round trip: unary Info (empty), unary Forward (one expert, one row), the same Forward
     as a message on a persistent bidirectional stream, and the same expert in-process;
  2. per-layer fan-out latency (p50 / p99) of RemoteExperts vs LocalExperts on the same work;
  3. decode tokens/s and bytes on the wire per token: in-process, 1 node, 2 nodes, N nodes.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from coordinator.generate import SamplingOptions, generate
from coordinator.remote.config import RemoteConfig
from coordinator.remote.experts import RemoteExperts
from coordinator.remote.transport import PeerSpec
from moe.convert.placement import shard_model
from moe.experts.local import LocalExperts
from moe.kernels import quant
from moe.model.model_dir import ModelDir
from moe.wire import codec
from moe.wire import moeshard_pb2 as pb
from moe.wire import moeshard_pb2_grpc as pb_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (with trunk)")
    p.add_argument("--nodes", type=int, default=3, help="largest cluster to measure")
    p.add_argument("--iters", type=int, default=400, help="round trips per measurement")
    p.add_argument("--tokens", type=int, default=24, help="decode tokens per generation")
    p.add_argument("--wire-dtype", choices=("f32", "bf16"), default="f32")


def _spawn(path: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "coordinator.cli", "node", str(path), "--no-advertise"]
    cmd += ["--insecure"]  # plaintext on loopback: the network's own cost, no TLS
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    while True:
        line = lines.get(timeout=180)
        if " serving " in line:
            return proc, line.split(" on ")[1].split()[0]
        if not line:
            raise RuntimeError(f"node on {path} exited with {proc.wait()}")


def _percentiles(ms: list[float]) -> tuple[float, float]:
    ordered = sorted(ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _time(fn, iters: int) -> list[float]:
    for _ in range(min(20, iters)):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _round_trips(model: ModelDir, addr: str, iters: int, dtype: int) -> list[tuple[str, list]]:
    h = model.config.hidden_size
    layer = model.config.moe_layers[0]
    hidden = np.random.default_rng(0).standard_normal((1, h), dtype=np.float32)  # [1, H]
    ids, weights = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)  # [1, 1]
    request = pb.ForwardRequest(
        model_id=model.model_id,
        layer=layer,
        hidden=codec.encode(hidden, dtype),
        ids=codec.encode(ids, codec.I32),
        weights=codec.encode(weights, codec.F32),
    )
    channel = grpc.insecure_channel(addr)
    stub = pb_grpc.ExpertNodeStub(channel)
    rows = [("unary Info (empty message)", _time(lambda: stub.Info(pb.InfoRequest()), iters))]
    rows.append(
        (
            f"unary Forward ({request.ByteSize()} B, 1 expert)",
            _time(lambda: stub.Forward(request), iters),
        )
    )
    outbox: queue.Queue = queue.Queue()
    replies = stub.ForwardStream(iter(outbox.get, None))

    def stream_once() -> None:
        outbox.put(request)
        next(replies)

    rows.append(("bidi stream message, same Forward", _time(stream_once, iters)))
    outbox.put(None)
    local = LocalExperts(model.shard_set)
    rows.append(
        (
            "in-process LocalExperts, same expert",
            _time(lambda: local(layer, hidden, ids, weights), iters),
        )
    )
    channel.close()
    return rows


def _layer_latency(model: ModelDir, backend, iters: int) -> list[float]:
    c = model.config
    rng = np.random.default_rng(1)
    layers = list(c.moe_layers)
    out = []
    for i in range(iters + 20):
        hidden = rng.standard_normal((1, c.hidden_size), dtype=np.float32)  # [1, H]
        ids = rng.choice(c.n_experts, size=(1, c.top_k), replace=False)  # [1, k]
        weights = np.full((1, c.top_k), 1.0 / c.top_k, np.float32)  # [1, k]
        t0 = time.perf_counter()
        backend(layers[i % len(layers)], hidden, ids, weights)
        if i >= 20:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _decode(model: ModelDir, backend, tokens: int) -> tuple[float, list[int]]:
    transformer = model.family.Transformer(model.config, model.load_trunk(), backend)
    opts = SamplingOptions(max_tokens=tokens)
    generate(transformer, [1, 2, 3], SamplingOptions(max_tokens=2))  # warm
    result = generate(transformer, [1, 2, 3], opts)
    return len(result.decode_s) / sum(result.decode_s), result.tokens


def run(args) -> int:
    model = ModelDir(args.model)
    n = max(1, args.nodes)
    dtype = codec.BY_NAME[args.wire_dtype]
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="moeshard-bench-") as tmp:
        try:
            layouts: dict[int, list[Path]] = {1: [model.path]}
            for k in sorted({min(2, n), n} - {1}):
                plan = shard_model(model.path, k, min(2, k) if k > 2 else 1, Path(tmp) / f"n{k}")
                layouts[k] = [Path(node["dir"]) for node in plan["nodes"]]
            quant.warmup()  # compile once into numba's disk cache; the nodes then load it
            print(f"starting {sum(len(v) for v in layouts.values())} node processes ...")
            addrs: dict[int, list[str]] = {}
            for k, dirs in layouts.items():
                started = [_spawn(d) for d in dirs]
                procs += [p for p, _ in started]
                addrs[k] = [a for _, a in started]

            print(f"\n1. one round trip on loopback ({args.iters} calls, ms)")
            print(f"   {'call':<44} {'p50':>7} {'p99':>7}")
            for name, ms in _round_trips(model, addrs[1][0], args.iters, dtype):
                p50, p99 = _percentiles(ms)
                print(f"   {name:<44} {p50:7.3f} {p99:7.3f}")

            print(f"\n2. one MoE layer, 1 row, top-{model.config.top_k} ({args.iters} layers, ms)")
            print(f"   {'backend':<44} {'p50':>7} {'p99':>7}")
            rows = [("in-process LocalExperts", LocalExperts(model.shard_set))]
            remotes = {}
            for k, a in addrs.items():
                for transport in ("unary", "stream") if k == n else ("stream",):
                    config = RemoteConfig(
                        wire_dtype=args.wire_dtype, prefetch=False, transport=transport
                    )
                    remotes[f"RemoteExperts, {k} node(s), {transport}"] = RemoteExperts(
                        model.model_id, model.config.hidden_size, [PeerSpec(x) for x in a], config
                    )
            rows += list(remotes.items())
            for name, backend in rows:
                p50, p99 = _percentiles(_layer_latency(model, backend, args.iters))
                print(f"   {name:<44} {p50:7.3f} {p99:7.3f}")

            print(f"\n3. decode, {args.tokens} tokens after a 3-token prompt")
            print(f"   {'backend':<44} {'tok/s':>7} {'ms/tok':>7} {'wire B/tok':>10}")
            base, ref = _decode(model, LocalExperts(model.shard_set), args.tokens)
            print(f"   {'in-process LocalExperts':<44} {base:7.1f} {1e3 / base:7.2f} {0:10d}")
            for k, remote in remotes.items():
                before = remote.bytes_sent + remote.bytes_received
                rate, tokens = _decode(model, remote, args.tokens)
                wire = (remote.bytes_sent + remote.bytes_received - before) / (args.tokens + 3)
                same = "" if tokens == ref else "  (OUTPUT DIFFERS)"
                print(f"   {k:<44} {rate:7.1f} {1e3 / rate:7.2f} {wire:10.0f}{same}")
            for remote in remotes.values():
                remote.close()
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait()
    return 0
