"""`moeshard bench p2p COORDINATOR_DIR --bootstrap ADDR --tcp ID@HOST:PORT`: what each path to
a node found in the wide-area registry costs per expert call, against TLS over plain TCP in
the same run.

The same ~14 KB Forward (`bench rpc`'s) goes, over mutual TLS pinned by id:
- straight over TCP to a node the coordinator can dial (`--tcp`): the baseline;
- through the wide-area registry (`--bootstrap`) to every node it finds, each on the path the
  coordinator settled on: "tcp" (straight to an endpoint its record lists, as `--peers`),
  "direct" (a p2p connection, hole-punched when both sides are behind NATs), "relayed"
  (spliced by a bootstrap peer's moeshard relay) or "circuit" (the daemon's own relay, capped
  at 128 KiB: moeshard.moe.p2p.relay).
Rows are timed in alternated rounds (the machine may be shared) and reported as medians and
as ratios to the baseline. Goals (issue 37): tcp and direct within 1.2x, relayed within 2x.
Run it where the paths exist: `tools/p2p_testbed.py` does, in its two homes behind NATs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import grpc
import numpy as np

from moeshard.bench.rpc import BIG_FORWARD_BYTES, ROUNDS, _forward
from moeshard.coordinator.remote.transport import dial, parse_peers
from moeshard.coordinator.remote.wide import WideDirectory
from moeshard.moe.errors import MoeshardError
from moeshard.moe.identity.keys import client_identity
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc

GOALS = {"tcp": 1.2, "direct": 1.2, "relayed": 2.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the coordinator's model directory (with trunk)")
    p.add_argument("--bootstrap", required=True, help="bootstrap peers, comma-separated")
    p.add_argument("--tcp", required=True, help="the baseline node: ID@HOST:PORT, dialled over TCP")
    p.add_argument("--expect", type=int, default=1, help="nodes to find in the registry")
    p.add_argument("--iters", type=int, default=300, help="calls per row")
    p.add_argument("--key", default="", help="this client's key (default: the client key)")


def run(args) -> int:
    model = ModelDir(args.model)
    tls = client_tls(client_identity(args.key or None))
    request, _ = _forward(model, _rows(model), codec.F32)
    baseline = parse_peers(args.tcp, insecure=False)[0]
    wide = WideDirectory(model.model_id, [a for a in args.bootstrap.split(",") if a], tls)
    channels = []
    try:
        nodes = wide.lookup(timeout_s=30, expect=args.expect)
        if not nodes:
            raise MoeshardError("the registry gave no node of this model")
        targets = [("TLS over TCP", baseline)] + [
            (f"p2p to {n.record.get('name', n.spec.node_id)}", n.spec) for n in nodes
        ]
        stubs, requests = [], []
        for _, spec in targets:
            channel, _ = dial(spec, tls, timeout=10.0)
            channels.append(channel)
            stubs.append(pb_grpc.ExpertNodeStub(channel))
            requests.append(_for_an_expert_it_holds(stubs[-1], request))
        times, broken = _timed(stubs, requests, args.iters)
        paths = ["tcp"] + [n.via for n in nodes]
        if 0 in broken:
            raise MoeshardError(f"the TLS-over-TCP baseline failed: {broken[0]}")
        base = statistics.median(times[0])
        rtt = _connect_rtt_ms(baseline.addr)
        print(f"bare link RTT to the baseline node (median TCP connect): {rtt:.3f} ms")
        print(f"{request.ByteSize() / 1024:.1f} KB Forward, median of up to {args.iters} calls:")
        failed = False
        for i, ((label, _), path) in enumerate(zip(targets, paths, strict=True)):
            goal = GOALS.get(path) if i else None  # (row 0 is the baseline itself)
            if i in broken:
                failed = True
                print(f"  {label:<24} {path:<8} FAILED: {broken[i]}")
                continue
            med = statistics.median(times[i])
            verdict = ""
            if goal is not None:
                ok = med / base <= goal
                failed |= not ok
                verdict = f" (goal {goal:.1f}x: {'met' if ok else 'NOT met'})"
            print(f"  {label:<24} {path:<8} {med:7.3f} ms  {med / base:5.2f}x{verdict}")
        return 1 if failed else 0
    finally:
        for channel in channels:
            channel.close()
        wide.close()


def _for_an_expert_it_holds(stub, request):
    """`request` sent to the first expert of the first layer the node holds (a shard need not
    hold expert 0)."""
    info = stub.Info(pb.InfoRequest(nonce=os.urandom(16)), timeout=10.0)
    if not info.holdings or not info.holdings[0].experts:
        raise MoeshardError(f"node {info.name or info.node_id} holds no expert")
    mine = pb.ForwardRequest()
    mine.CopyFrom(request)
    mine.layer = info.holdings[0].layer
    ids = np.full(tuple(request.ids.shape), info.holdings[0].experts[0], np.int32)  # [T, 1]
    mine.ids.CopyFrom(codec.encode(ids, codec.I32))
    return mine


def _timed(stubs, requests, iters: int) -> tuple[list[list[float]], dict[int, str]]:
    """ms per call of each stub, in ROUNDS alternated rounds; a stub whose call fails is
    dropped from the later rounds and reported with the bytes it carried before it broke."""
    times: list[list[float]] = [[] for _ in stubs]
    broken: dict[int, str] = {}
    sent = [0] * len(stubs)
    per_round = max(1, iters // ROUNDS)
    for r in range(ROUNDS):
        order = list(range(len(stubs)))
        for i in order if r % 2 == 0 else order[::-1]:
            if i in broken:
                continue
            for _ in range(per_round):
                t0 = time.perf_counter()
                try:
                    reply = stubs[i].Forward(requests[i], timeout=10.0)
                except grpc.RpcError as exc:
                    broken[i] = (
                        f"{exc.code().name} after {len(times[i])} calls ({sent[i] / 1024:.0f} KiB "
                        f"sent): {exc.details()}"
                    )
                    break
                times[i].append((time.perf_counter() - t0) * 1e3)
                sent[i] += requests[i].ByteSize()
                del reply
    return times, broken


def _connect_rtt_ms(addr: str, tries: int = 21) -> float:
    """The link's round trip without TLS or gRPC: the median time a TCP connect takes (one
    SYN, one SYN-ACK)."""
    host, _, port = addr.rpartition(":")
    took = []
    for _ in range(tries):
        t0 = time.perf_counter()
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5.0):
            took.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(took)


def _rows(model: ModelDir) -> int:
    return max(1, round(BIG_FORWARD_BYTES / (model.config.expert_hidden * 4)))
