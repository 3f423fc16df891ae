"""`moeshard bench rpc MODEL`: what the network costs, measured against same-run baselines.

Starts real node daemons (subprocesses, loopback, ports 0) on MODEL and on shard splits of it,
plaintext (`--insecure`), and again with mutual TLS for MODEL and the N-node split (allowing a
client key made for the run; see rpc_nodes). Then prints, plaintext and TLS side by side:
  1. one round trip: unary Info (empty), unary Forward (one expert, one row), the same Forward
     as a message on a persistent bidirectional stream, a ~14 KB Forward (many rows of one
     expert) unary and streamed, and the same work in-process; then TLS/plaintext at the median
     per call for the 14 KB Forward, against the goal of at most 10% more;
  2. per-layer fan-out latency (p50 / p99) of RemoteExperts vs LocalExperts on the same work;
  3. decode tokens/s and bytes on the wire per token: in-process, 1 node, 2 nodes, N nodes.
The machine may be shared, so every row of 1 and 2 is timed in ROUNDS alternated rounds of
iters/ROUNDS calls (the order reversed every other round) and pooled, and the generations of 3
alternate in DECODE_ROUNDS rounds. Wire bytes are message bytes (no HTTP/2 or TLS framing).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moeshard.bench.rpc_nodes import NodeProcs, client_key, layouts_for, serving
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.experts import RemoteExperts
from moeshard.coordinator.remote.transport import ForwardStream, PeerSpec, dial
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.identity.keys import Identity
from moeshard.moe.identity.tls import client_tls
from moeshard.moe.kernels import quant
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.wire import codec
from moeshard.moe.wire import moeshard_pb2 as pb
from moeshard.moe.wire import moeshard_pb2_grpc as pb_grpc

ROUNDS = 10  # alternated rounds per timing (sections 1 and 2)
DECODE_ROUNDS = 3  # alternated generations per backend (section 3)
WARMUP = 20  # untimed calls of each row before the first round
BIG_FORWARD_BYTES = 14 * 1024  # the hidden state of the "14 KB" Forward
TLS_GOAL = 1.10  # TLS may cost at most 10% more per 14 KB Forward at the median

Row = tuple[str, str, object]  # (what, wire: "plain" / "TLS" / "-", callable or backend)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (with trunk)")
    p.add_argument("--nodes", type=int, default=3, help="largest cluster to measure")
    p.add_argument("--iters", type=int, default=400, help="round trips per measurement")
    p.add_argument("--tokens", type=int, default=24, help="decode tokens per generation")
    p.add_argument(
        "--wire-dtype", choices=("f32", "bf16"), default="f32", help="activations on the wire"
    )


def _percentiles(ms: list[float]) -> tuple[float, float]:
    ordered = sorted(ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _rounds(fns: list[Callable[[], object]], iters: int) -> list[list[float]]:
    """ms per call of every fn, taken in ROUNDS alternated rounds of iters/ROUNDS calls each."""
    per_round = max(1, iters // ROUNDS)
    for fn in fns:
        for _ in range(min(WARMUP, iters)):
            fn()
    out: list[list[float]] = [[] for _ in fns]
    for r in range(ROUNDS):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            fns[i]()  # untimed: the first call after switching pays for the switch
            for _ in range(per_round):
                t0 = time.perf_counter()
                fns[i]()
                out[i].append((time.perf_counter() - t0) * 1e3)
    return out


def _print_timings(
    label: str, rows: list[Row], timings: list[list[float]]
) -> dict[tuple[str, str], float]:
    """p50 / p99 rows, and TLS/plaintext of the p50 on TLS rows; returns the p50s."""
    print(f"   {label:<44} {'wire':<5} {'p50':>7} {'p99':>7} {'TLS/plain':>9}")
    p50s = {}
    for (what, wire, _), ms in zip(rows, timings, strict=True):
        p50, p99 = _percentiles(ms)
        p50s[what, wire] = p50
        ratio = f"{p50 / p50s[what, 'plain']:9.3f}" if wire == "TLS" else ""
        print(f"   {what:<44} {wire:<5} {p50:7.3f} {p99:7.3f} {ratio}")
    return p50s


def _forward(model: ModelDir, rows: int, dtype: int) -> tuple[pb.ForwardRequest, tuple]:
    """A Forward of `rows` rows to expert 0 of the first MoE layer, and its LocalExperts args."""
    layer = model.config.moe_layers[0]
    hidden = np.random.default_rng(0).standard_normal(
        (rows, model.config.expert_hidden), dtype=np.float32
    )  # [T, H]
    ids, weights = np.zeros((rows, 1), np.int32), np.ones((rows, 1), np.float32)  # [T, 1]
    request = pb.ForwardRequest(
        model_id=model.model_id,
        layer=layer,
        hidden=codec.encode(hidden, dtype),
        ids=codec.encode(ids, codec.I32),
        weights=codec.encode(weights, codec.F32),
    )
    return request, (layer, hidden, ids, weights)


def _calls(stub: pb_grpc.ExpertNodeStub, stream: ForwardStream, small, big) -> list:
    """The timed calls on one node: Info, then each Forward unary and as a stream message."""

    def streamed(request) -> Callable[[], object]:
        def once():
            return stream.send(request).result()

        return once

    return [
        lambda: stub.Info(pb.InfoRequest()),
        lambda: stub.Forward(small),
        streamed(small),
        lambda: stub.Forward(big),
        streamed(big),
    ]


def _round_trips(model: ModelDir, plain: PeerSpec, tls: PeerSpec, me: Identity, args) -> None:
    dtype = codec.BY_NAME[args.wire_dtype]
    big_rows = max(
        1, round(BIG_FORWARD_BYTES / (model.config.expert_hidden * codec.ITEMSIZE[dtype]))
    )
    small, small_args = _forward(model, 1, dtype)
    big, big_args = _forward(model, big_rows, dtype)
    names = [
        "unary Info (empty message)",
        f"unary Forward ({small.ByteSize()} B, 1 row, 1 expert)",
        "bidi stream message, same Forward",
        f"unary Forward ({big.ByteSize()} B, {big_rows} rows, 1 expert)",
        f"bidi stream message, same {big.ByteSize()} B Forward",
    ]
    channels, streams, calls = [], [], {}
    for wire, spec, material in (("plain", plain, None), ("TLS", tls, client_tls(me))):
        channel, _ = dial(spec, material, timeout=5.0)
        stub = pb_grpc.ExpertNodeStub(channel)
        streams.append(ForwardStream(stub))
        channels.append(channel)
        calls[wire] = _calls(stub, streams[-1], small, big)
    rows: list[Row] = []
    for i, what in enumerate(names):
        rows += [(what, "plain", calls["plain"][i]), (what, "TLS", calls["TLS"][i])]
    local = LocalExperts(model.shard_set)
    rows.append(("in-process LocalExperts, same 1-row work", "-", lambda: local(*small_args)))
    rows.append(
        (f"in-process LocalExperts, same {big_rows}-row work", "-", lambda: local(*big_args))
    )

    print(f"\n1. one round trip on loopback ({args.iters} calls each in {ROUNDS} rounds, ms)")
    p50s = _print_timings("call", rows, _rounds([fn for _, _, fn in rows], args.iters))
    unary = p50s[names[3], "TLS"] / p50s[names[3], "plain"]
    stream = p50s[names[4], "TLS"] / p50s[names[4], "plain"]
    goal = f"goal <= {TLS_GOAL:.2f}"
    print(f"   TLS / plaintext, p50 per call of the {big.ByteSize()} B Forward ({goal})")
    for how, ratio in (("unary", unary), ("stream", stream)):
        verdict = "goal met" if ratio <= TLS_GOAL else "goal NOT met"
        print(f"     {how:<6} {ratio:6.3f} ({ratio - 1:+.1%})  {verdict}")
    for stream_, channel in zip(streams, channels, strict=True):
        stream_.close()
        channel.close()


def _remotes(
    model: ModelDir,
    plain: dict[int, list[PeerSpec]],
    tls: dict[int, list[PeerSpec]],
    me: Identity,
    args,
) -> list[Row]:
    """RemoteExperts on each plaintext layout (stream; unary too on N nodes), and on the N-node
    TLS layout (stream)."""
    n = max(plain)
    out: list[Row] = []

    def remote(specs: list[PeerSpec], transport: str, identity: Identity | None):
        config = RemoteConfig(  # audits have their own bench (`bench audit`)
            wire_dtype=args.wire_dtype,
            prefetch=False,
            transport=transport,
            identity=identity,
            audit=0.0,
        )
        return RemoteExperts(model.model_id, model.config.expert_hidden, specs, config)

    for k, specs in plain.items():
        for transport in ("unary", "stream") if k == n else ("stream",):
            name = f"RemoteExperts, {k} node(s), {transport}"
            out.append((name, "plain", remote(specs, transport, None)))
    out.append((f"RemoteExperts, {n} node(s), stream", "TLS", remote(tls[n], "stream", me)))
    return out


def _layer_inputs(model: ModelDir, count: int) -> list[tuple]:
    """`count` one-row layers: (layer, hidden [1, H], ids [1, k], weights [1, k])."""
    c = model.config
    rng = np.random.default_rng(1)
    out = []
    for i in range(count):
        hidden = rng.standard_normal((1, c.expert_hidden), dtype=np.float32)  # [1, H]
        ids = rng.choice(c.n_experts, size=(1, c.top_k), replace=False)  # [1, k]
        weights = np.full((1, c.top_k), 1.0 / c.top_k, np.float32)  # [1, k]
        out.append((c.moe_layers[i % len(c.moe_layers)], hidden, ids, weights))
    return out


def _layers(model: ModelDir, backends: list[Row], iters: int) -> None:
    inputs = _layer_inputs(model, iters)

    def one_layer(backend) -> Callable[[], object]:
        work = itertools.cycle(inputs)  # every backend gets the same layers in the same order
        return lambda: backend(*next(work))

    print(f"\n2. one MoE layer, 1 row, top-{model.config.top_k} ({iters} layers each, ms)")
    _print_timings("backend", backends, _rounds([one_layer(b) for _, _, b in backends], iters))


def _wire_bytes(backend) -> int:
    return getattr(backend, "bytes_sent", 0) + getattr(backend, "bytes_received", 0)


def _decode(model: ModelDir, backends: list[Row], tokens: int) -> None:
    """Each backend's generations alternate with the others'; per-token times are pooled."""
    prompt, opts = [1, 2, 3], SamplingOptions(max_tokens=tokens)
    transformers = []
    for _, _, backend in backends:
        transformers.append(model.family.Transformer(model.config, model.load_trunk(), backend))
        generate(transformers[-1], prompt, SamplingOptions(max_tokens=2))  # warm
    seconds: list[list[float]] = [[] for _ in backends]
    wire, outputs = [0] * len(backends), [[] for _ in backends]
    for r in range(DECODE_ROUNDS):
        for i in range(len(backends)) if r % 2 == 0 else reversed(range(len(backends))):
            before = _wire_bytes(backends[i][2])
            result = generate(transformers[i], prompt, opts)
            wire[i] += _wire_bytes(backends[i][2]) - before
            seconds[i] += result.decode_s
            outputs[i].append(result.tokens)

    print(f"\n3. decode, {tokens} tokens after a 3-token prompt ({DECODE_ROUNDS} rounds)")
    print(f"   {'backend':<44} {'wire':<5} {'tok/s':>7} {'ms/tok':>7} {'wire B/tok':>10}")
    for (what, kind, _), s, b, out in zip(backends, seconds, wire, outputs, strict=True):
        per_token = b / (DECODE_ROUNDS * (tokens + len(prompt)))
        same = "" if out == outputs[0] else "  (OUTPUT DIFFERS)"
        rate = len(s) / sum(s)
        print(f"   {what:<44} {kind:<5} {rate:7.1f} {1e3 / rate:7.2f} {per_token:10.0f}{same}")


def run(args) -> int:
    model = ModelDir(args.model)
    model.require_experts(
        "bench rpc starts its nodes from the records: use the full model directory"
    )
    n = max(1, args.nodes)
    with tempfile.TemporaryDirectory(prefix="moeshard-bench-") as tmp:
        nodes = NodeProcs(Path(tmp))
        try:
            layouts = layouts_for(model.path, n, Path(tmp))
            me = client_key(Path(tmp))
            quant.warmup()  # compile once into numba's disk cache; the nodes then load it
            plain = {k: [nodes.launch(d, None) for d in dirs] for k, dirs in layouts.items()}
            tls = {k: [nodes.launch(d, me) for d in layouts[k]] for k in sorted({1, n})}
            n_tls = sum(map(len, tls.values()))
            print(
                f"starting {len(nodes.procs)} node processes ({len(nodes.procs) - n_tls} "
                f"plaintext, {n_tls} TLS allowing only client {me.id}) ..."
            )
            plain_specs, tls_specs = serving(plain), serving(tls)

            _round_trips(model, plain_specs[1][0], tls_specs[1][0], me, args)
            local: Row = ("in-process LocalExperts", "-", LocalExperts(model.shard_set))
            remotes = _remotes(model, plain_specs, tls_specs, me, args)
            try:
                _layers(model, [local, *remotes], args.iters)
                _decode(model, [local, *remotes], args.tokens)
            finally:
                for _, _, remote in remotes:
                    remote.close()
        finally:
            nodes.close()
    return 0
