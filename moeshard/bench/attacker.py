"""The attackers of `moeshard bench attack`: one process (`python -m moeshard.bench.attacker
MODE ...`) that plays many strangers against a node, each with a key of its own, so that the
node sees what it would see from the internet under `--allow-any` and the honest coordinator's
process shares none of the attackers' CPU or GIL.

Modes:
  idle        every key opens `--streams` ForwardStreams and sends nothing on them
  big         `--concurrency` Forwards of `--rows` rows in a loop, keys taken in turn
  unread      every key opens `--streams` ForwardStreams, sends requests of `--rows` rows on
              them and never reads a reply
  settle      every key sends self-signed settlements of random sessions, as fast as the node
              answers (`--concurrency` threads)

It prints `attacking` once every stream or call is started, then runs until killed. Counts of
what the node answered go to stderr every few seconds (refusals are what it should see).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from moeshard.coordinator.remote.transport import PeerSpec, dial
from moeshard.moe.identity.keys import generate
from moeshard.moe.identity.receipts import Totals, make_settlement
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc


def forward_request(info: pb.NodeInfo, rows: int, layer: int) -> pb.ForwardRequest:
    """A valid Forward of `rows` rows to experts the node holds (so it computes them all)."""
    experts = sorted(e for h in info.holdings if h.layer == layer for e in h.experts)[:2]
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((rows, info.hidden_size)).astype(np.float32)  # [T, H]
    ids = np.tile(np.asarray(experts, dtype=np.int32), (rows, 1))  # [T, k]
    weights = np.full(ids.shape, 0.5, dtype=np.float32)  # [T, k]
    return pb.ForwardRequest(
        model_id=info.model_id,
        layer=layer,
        hidden=codec.encode(hidden, codec.F32),
        ids=codec.encode(ids, codec.I32),
        weights=codec.encode(weights, codec.F32),
    )


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.seen: collections.Counter = collections.Counter()

    def add(self, what: str) -> None:
        with self.lock:
            self.seen[what] += 1

    def report(self) -> str:
        with self.lock:
            return " ".join(f"{k}={v}" for k, v in sorted(self.seen.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="attacker")
    p.add_argument("mode", choices=("idle", "big", "unread", "settle"))
    p.add_argument("--target", required=True, help="ID@HOST:PORT of the node")
    p.add_argument("--keys", type=int, default=8)
    p.add_argument("--streams", type=int, default=4, help="streams per key")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layer", type=int, default=-1, help="-1: the first MoE layer it holds")
    p.add_argument(
        "--mbps", type=float, default=1000, help="the attacker's uplink in Mbit/s, all keys"
    )
    args = p.parse_args(argv)
    node_id, _, addr = args.target.rpartition("@")
    spec = PeerSpec(addr, node_id)
    tmp = Path(tempfile.mkdtemp(prefix="attacker-"))
    channels, keys = [], []
    for k in range(args.keys):
        keys.append(generate(tmp / f"key-{k}.pem"))
        channel, _ = dial(spec, client_tls(keys[-1]), timeout=10)
        channels.append(channel)
    stubs = [pb_grpc.ExpertNodeStub(c) for c in channels]
    info = stubs[0].Info(pb.InfoRequest(), timeout=10)
    layer = args.layer if args.layer >= 0 else min(h.layer for h in info.holdings)
    rows = min(args.rows, info.max_rows)
    request = forward_request(info, rows, layer)
    counts = Counts()
    uplink = Uplink(args.mbps * 1e6 / 8)
    keep: list = []  # calls kept open for the life of the process

    if args.mode == "idle":
        for stub in stubs:
            for _ in range(args.streams):
                outbox: queue.SimpleQueue = queue.SimpleQueue()
                call = stub.ForwardStream(iter(outbox.get, None))
                call.add_done_callback(lambda c: counts.add(f"ended:{c.code().name}"))
                keep.append((call, outbox))
    elif args.mode == "unread":
        for stub in stubs:
            for _ in range(args.streams):
                call = stub.ForwardStream(_endless(request, counts, uplink))
                call.add_done_callback(lambda c: counts.add(f"ended:{c.code().name}"))
                keep.append(call)
    elif args.mode == "settle":
        for i in range(args.concurrency):
            target = (stubs[i % len(stubs)], keys[i % len(keys)], spec.node_id, info.model_id)
            thread = threading.Thread(target=_settle, args=(*target, counts))
            thread.daemon = True
            thread.start()
    else:  # big
        for i in range(args.concurrency):
            # serialized once: the attacker's CPU (on a shared test machine) goes to sending
            forward = channels[i % len(channels)].unary_unary(
                "/moeshard.v1.ExpertNode/Forward", None, None
            )  # (replies left as bytes)
            payload = request.SerializeToString()
            thread = threading.Thread(target=_loop, args=(forward, payload, counts, uplink))
            thread.daemon = True
            thread.start()
    print(f"attacking {args.mode}: {args.keys} keys, {rows} rows", flush=True)
    while True:
        time.sleep(5)
        print(f"attacker {args.mode}: {counts.report()}", file=sys.stderr, flush=True)


class Uplink:
    """The attacker's upload bandwidth, shared by all its keys: `send(n)` waits until n more
    bytes may go. (On loopback the bytes cost the machine's CPU, which the node shares; a
    stranger on the internet has an uplink.)"""

    def __init__(self, bytes_per_s: float):
        self.rate, self.lock, self.at = bytes_per_s, threading.Lock(), time.monotonic()

    def send(self, nbytes: int) -> None:
        with self.lock:
            self.at = max(self.at, time.monotonic()) + nbytes / self.rate
            wait = self.at - time.monotonic()
        if wait > 0:
            time.sleep(wait)


def _endless(request, counts: Counts, uplink: Uplink):
    size = request.ByteSize()
    while True:
        uplink.send(size)
        counts.add("sent")
        yield request


def _settle(stub, key, node_id: str, model_id: str, counts: Counts) -> None:
    # signed beforehand: the attacker's own CPU (on a shared test machine) goes to sending
    signed = [
        make_settlement(key, os.urandom(16), node_id, model_id, 1, Totals()) for _ in range(256)
    ]
    for settlement in itertools.cycle(signed):
        try:
            reply = stub.Settle(settlement, timeout=10)
            counts.add("accepted" if reply.accepted else "refused")
        except grpc.RpcError as exc:
            counts.add(exc.code().name)


def _loop(forward, payload: bytes, counts: Counts, uplink: Uplink) -> None:
    while True:
        uplink.send(len(payload))
        try:
            forward(payload, timeout=30)
            counts.add("ok")
        except grpc.RpcError as exc:
            counts.add(exc.code().name)
            time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
