"""`moeshard bench serve MODEL --concurrency 1,4,16`: the server and its load generator in
one run.

The server (`moeshard serve`) runs in its own process on a loopback port; for each
concurrency C, the level's requests (the same number at every level: at concurrency 1 they
run one after another) are shared among C client threads, each sending streamed greedy
completions back to back (distinct prompts), over HTTP as any client would.  Per level:
aggregate tokens/s, per-request tokens/s (after its first token), time to first token p50 and
p99, and the experts' cost per generated token: bytes read from SSD (`--ram`) or calls to
nodes (network mode), against the level of concurrency 1 measured in the same run.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.request

import numpy as np

from moe.errors import MoeshardError

PROMPTS = [
    "The function returns",
    "A list comprehension",
    "To open a file",
    "The module provides",
    "An exception is raised when",
    "The default value of",
    "Classes and instances",
    "The following example shows",
]


def add_arguments(p) -> None:
    p.add_argument("model", help="model directory")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent clients, per level")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument(
        "--requests",
        type=int,
        help="requests at each level, shared among its clients (default: twice the highest "
        "concurrency, so 16 clients send 2 each and 1 client sends all 32 in turn)",
    )
    p.add_argument("--ram", help="RAM budget: stream experts from SSD (e.g. 300M)")
    p.add_argument("--peers", help="experts on these nodes (as `moeshard serve --peers`)")
    p.add_argument("--discover", action="store_true", help="find nodes with zeroconf")
    p.add_argument("--key", help="this client's key (as `moeshard serve --key`)")
    p.add_argument("--insecure", action="store_true", help="plaintext to nodes on loopback")
    p.add_argument("--context", type=int, default=256, help="prompt + tokens a request may use")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(base: str, prompt: str | list[int], tokens: int) -> dict:
    """One streamed greedy completion: its first-token and end times and token count."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    ).encode()
    request = urllib.request.Request(
        base + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, n = None, 0
    with urllib.request.urlopen(request, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n += 1
            if first is None:
                first = time.perf_counter()
    return {"ttft": (first or time.perf_counter()) - t0, "end": time.perf_counter() - t0, "n": n}


def _prompt(i: int, ids: bool) -> str | list[int]:
    """Request i's prompt: text, or token ids for a model without a tokenizer."""
    if ids:
        return [1 + (i * 7 + j * 13) % 200 for j in range(8)]
    return PROMPTS[i % len(PROMPTS)] + f" {i}"


def _level(base: str, clients: int, requests: int, tokens: int, ids: bool) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(c, requests, clients):  # request i, prompt i: the same set per level
            out = _one(base, _prompt(i, ids), tokens)
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    total = sum(r["n"] for r in results)
    ttft = [r["ttft"] for r in results]
    per_request = [(r["n"] - 1) / (r["end"] - r["ttft"]) for r in results if r["n"] > 1]
    return {
        "clients": clients,
        "tokens": total,
        "aggregate_tok_s": total / wall,
        "per_request_tok_s": statistics.median(per_request) if per_request else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
    }


def run(args) -> int:
    import subprocess
    import sys

    from moe.model.model_dir import ModelDir

    levels = sorted({int(c) for c in args.concurrency.split(",")})
    if not levels or levels[0] < 1:
        raise MoeshardError("--concurrency: positive integers, e.g. 1,4,16")
    from coordinator.tokenizer import load as load_tokenizer

    model = ModelDir(args.model)  # a clear error before a server starts
    ids = load_tokenizer(model.path) is None  # no tokenizer: prompts as token ids
    top, port = levels[-1], _free_port()
    requests = args.requests or 2 * top
    if requests < top:
        raise MoeshardError(f"--requests {requests}: fewer than the {top} clients of a level")
    cmd = [sys.executable, "-m", "coordinator.cli", "serve", args.model, "--port", str(port),
           "--max-batch", str(top), "--max-queue", str(top), "--context", str(args.context),
           "--no-eos"]  # fmt: skip  # (every request makes all its tokens)
    if args.ram:
        cmd += ["--ram", args.ram]
    for flag, value in (("--peers", args.peers), ("--key", args.key)):
        if value:
            cmd += [flag, value]
    cmd += ["--discover"] * args.discover + ["--insecure"] * args.insecure
    # the server in its own process, as a user runs it: its engine and event loop do not
    # share an interpreter lock with the load generator's client threads
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(base, server)
        _one(base, _prompt(10_000, ids), 2)
        rows = []
        for clients in levels:
            before = _stats(base)
            row = _level(base, clients, requests, args.tokens, ids)
            row |= _expert_cost(before, _stats(base), row["tokens"])
            rows.append(row)
            _print_row(row, rows[0])
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


def _wait_up(base: str, server) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise MoeshardError(f"the server stopped: {server.stderr.read().strip()[-500:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise MoeshardError("the server did not answer /health within 300 s")


def _stats(base: str) -> dict:
    """The server's experts counters (its /health carries them)."""
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        return json.loads(r.read()).get("experts", {})


def _expert_cost(before: dict, after: dict, tokens: int) -> dict:
    out = {}
    if "expert_bytes_read" in after and "hits" in after:  # a RAM budget: reads from SSD
        read = after["expert_bytes_read"] - before.get("expert_bytes_read", 0)
        out["expert_bytes_per_token"] = read / max(tokens, 1)
    nodes_after, nodes_before = after.get("nodes"), before.get("nodes") or []
    if nodes_after:
        calls = sum(n.get("calls", 0) for n in nodes_after)
        calls -= sum(n.get("calls", 0) for n in nodes_before)
        out["node_calls_per_token"] = calls / max(tokens, 1)
    return out


def _print_row(row: dict, base: dict) -> None:
    ratio = row["aggregate_tok_s"] / base["aggregate_tok_s"]
    line = (
        f"concurrency {row['clients']:>3}: {row['tokens']:>5} tokens, aggregate "
        f"{row['aggregate_tok_s']:8.1f} tok/s ({ratio:5.2f}x concurrency {base['clients']}), "
        f"per request {row['per_request_tok_s']:7.1f} tok/s, first token p50 "
        f"{row['ttft_p50_s'] * 1e3:7.1f} ms p99 {row['ttft_p99_s'] * 1e3:7.1f} ms"
    )
    if "expert_bytes_per_token" in row:
        share = row["expert_bytes_per_token"] / max(base["expert_bytes_per_token"], 1e-9)
        line += f", experts read {row['expert_bytes_per_token'] / 1e6:.2f} MB/token ({share:.2f}x)"
    if "node_calls_per_token" in row:
        share = row["node_calls_per_token"] / max(base["node_calls_per_token"], 1e-9)
        line += f", node calls {row['node_calls_per_token']:.1f}/token ({share:.2f}x)"
    print(line, flush=True)
