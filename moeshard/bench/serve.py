"""`moeshard bench serve MODEL --concurrency 1,4,16`: the server and its load generator in
one run.

The server (`moeshard serve`) runs in its own process on a loopback port; for each
concurrency C, the level's requests (the same number at every level: at concurrency 1 they
run one after another) are shared among C client threads, each sending streamed greedy
completions back to back (distinct prompts), over HTTP as any client would.  Per level:
aggregate tokens/s, per-request tokens/s (after its first token), time to first token p50 and
p99, the gaps between a stream's successive chunks p50 and p99 (what a reader sees stall while
another request's prompt is read: `--prompt-tokens` with `--prefill-chunk`), and the experts'
cost per generated token: bytes read from SSD (`--ram`) or calls to nodes (network mode),
against the level of concurrency 1 measured in the same run.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import threading
import time
import urllib.request

import numpy as np

from moeshard.moe.errors import MoeshardError

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

SERVED = "bench"  # the name the server is given, and the requests ask for


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
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="prompts of N token ids each (0: a few words of text)",
    )
    p.add_argument(
        "--ramp",
        type=float,
        default=0.0,
        metavar="S",
        help="client c of C starts c*S/C seconds after the first, so that prompts arrive while "
        "other requests decode, as they do with users (0: all at once, in lockstep)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="the server's --prefill-chunk (prompt tokens a step feeds at most; 0: whole prompts)",
    )
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="the server's --engine-in-process: its engine in the server's own process",
    )
    p.add_argument(
        "--engine-only",
        action="store_true",
        help="no HTTP: the clients submit to the batching engine in this process (what the "
        "model and scheduler give, without the server's and clients' per-token cost)",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(base: str, prompt: str | list[int], tokens: int) -> dict:
    """One streamed greedy completion: its first-token and end times, token count (the usage
    the server reports at the end: a chunk's text may hold no token or several) and the gaps
    between its successive chunks."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, n, arrivals = None, 0, []
    with urllib.request.urlopen(request, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter()
            if '"usage"' in line:
                n = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens") or n
            else:
                arrivals.append(time.perf_counter())
    end = time.perf_counter() - t0
    return {"ttft": (first or t0 + end) - t0, "end": end, "n": n, "gaps": np.diff(arrivals)}


def _prompt(i: int, ids: bool, length: int = 0) -> str | list[int]:
    """Request i's prompt: text, or token ids (`length` of them, 8 by default) for a model
    without a tokenizer or when a prompt length is asked for."""
    if ids or length:
        return [1 + (i * 7 + j * 13) % 200 for j in range(length or 8)]
    return PROMPTS[i % len(PROMPTS)] + f" {i}"


def _level(base: str, clients: int, requests: int, args, ids: bool) -> dict:
    def one(i: int) -> dict:
        return _one(base, _prompt(i, ids, args.prompt_tokens), args.tokens)

    return _clients(one, clients, requests, args.ramp)


def _clients(one, clients: int, requests: int, ramp: float = 0.0) -> dict:
    """`clients` threads share requests 0..requests-1 (`one(i)` makes request i and returns
    its times and token count), each sending its next when its last has ended; client c
    starts `ramp` * c / `clients` seconds after the first."""
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        time.sleep(ramp * c / clients)
        for i in range(c, requests, clients):  # request i, prompt i: the same set per level
            out = one(i)
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
    gaps = np.concatenate([r["gaps"] for r in results] + [np.zeros(0)])  # [chunks - 1 each]
    return {
        "clients": clients,
        "tokens": total,
        "aggregate_tok_s": total / wall,
        "per_request_tok_s": statistics.median(per_request) if per_request else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "gap_p50_s": float(np.percentile(gaps, 50)) if gaps.size else 0.0,
        "gap_p99_s": float(np.percentile(gaps, 99)) if gaps.size else 0.0,
    }


def run(args) -> int:
    import subprocess
    import sys

    from moeshard.moe.model.model_dir import ModelDir

    levels = sorted({int(c) for c in args.concurrency.split(",")})
    if not levels or levels[0] < 1:
        raise MoeshardError("--concurrency: positive integers, e.g. 1,4,16")
    from moeshard.coordinator.tokenizer import load as load_tokenizer

    model = ModelDir(args.model)  # a clear error before a server starts
    if not (args.peers or args.discover):
        model.require_experts(
            "bench serve with --peers or --discover, or use the full model directory"
        )
    ids = load_tokenizer(model.path) is None  # no tokenizer: prompts as token ids
    top, port = levels[-1], _free_port()
    requests = args.requests or 2 * top
    if requests < top:
        raise MoeshardError(f"--requests {requests}: fewer than the {top} clients of a level")
    if args.prompt_tokens < 0 or (args.prefill_chunk or 0) < 0 or args.ramp < 0:
        raise MoeshardError("--prompt-tokens, --prefill-chunk and --ramp must be >= 0")
    if args.prompt_tokens + args.tokens > args.context:
        raise MoeshardError(
            f"--prompt-tokens {args.prompt_tokens} + --tokens {args.tokens} exceed --context "
            f"{args.context}"
        )
    if args.engine_only:
        return _run_engine_only(args, model, levels, requests, ids)
    cmd = [sys.executable, "-m", "moeshard", "serve", args.model, "--port", str(port),
           "--max-batch", str(top), "--max-queue", str(top), "--context", str(args.context),
           "--no-eos", "--name", SERVED]  # fmt: skip  # (every request makes all its tokens)
    if args.ram:
        cmd += ["--ram", args.ram]
    if args.prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    for flag, value in (("--peers", args.peers), ("--key", args.key)):
        if value:
            cmd += [flag, value]
    cmd += ["--discover"] * args.discover + ["--insecure"] * args.insecure
    cmd += ["--engine-in-process"] * args.engine_in_process
    # the server in its own process, as a user runs it: its engine and event loop do not
    # share an interpreter lock with the load generator's client threads
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(base, server)
        _one(base, _prompt(10_000, ids, args.prompt_tokens), 2)
        rows = []
        for clients in levels:
            before, cpu = _health(base), _cpu_seconds(server.pid)
            row = _level(base, clients, requests, args, ids)
            after = _health(base)
            cpu1 = _cpu_seconds(server.pid)
            row |= _cpu_cost(cpu, cpu1, before, after, row, engine_apart=not args.engine_in_process)
            row |= _expert_cost(before["experts"], after["experts"], row["tokens"])
            rows.append(row)
            _print_row(row, rows[0])
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


def _run_engine_only(args, model, levels: list[int], requests: int, ids: bool) -> int:
    """The levels against `Engine` in this process: the same requests, greedy, every token
    made (no end-of-sequence), over the runtime `moeshard serve` would open.  Tokens are
    timed by a listener on the engine thread as it emits them, so a client thread wakes once
    per request, not once per token: each wake took the interpreter's lock from the engine
    at its next kernel call (measured here: 15-16% fewer tokens/s at 1 and at 16 clients)."""
    from moeshard.coordinator.generate import SamplingOptions
    from moeshard.coordinator.runtime import open_serving_runtime
    from moeshard.coordinator.serve.engine import Engine
    from moeshard.moe.units import parse_size

    remote = None
    if args.peers or args.discover:
        from moeshard.coordinator.remote.config import RemoteConfig

        remote = RemoteConfig.for_client(args.key, args.insecure)
    top = levels[-1]
    rt = open_serving_runtime(
        model, args.ram and parse_size(args.ram), args.context * top, args.peers,
        args.discover, remote_config=remote,
    )  # fmt: skip
    chunk = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
    engine = Engine(rt.transformer, max_batch=top, max_queue=top, verifier=rt.verifier, **chunk)

    def one(i: int) -> dict:
        prompt = _prompt(i, ids, args.prompt_tokens)
        prompt_ids = prompt if isinstance(prompt, list) else rt.encode(prompt)
        opts = SamplingOptions(max_tokens=args.tokens, temperature=0.0)
        arrivals: list[float] = []
        ended = threading.Event()

        def listener(event) -> None:  # on the engine thread, as it emits each token
            if event.kind == "token":
                arrivals.append(time.perf_counter())
            elif event.kind == "end":
                ended.set()

        t0 = time.perf_counter()
        request = engine.submit(prompt_ids, opts, listener=listener)
        ended.wait()
        end = time.perf_counter() - t0
        ttft = request.first_token_s or 0.0
        return {"ttft": ttft, "end": end, "n": len(arrivals), "gaps": np.diff(arrivals)}

    def health() -> dict:  # what the server's /health would say
        st = engine.stats
        engine_stats = {"steps": st.steps, "batch_rows": st.batch_rows, "busy_s": st.busy_s}
        return {"engine": engine_stats, "experts": rt.experts.stats()}

    try:
        one(10_000)  # (as the HTTP run's first request: the kernels warm)
        rows = []
        for clients in levels:
            before, cpu = health(), _cpu_seconds(os.getpid())
            row = _clients(one, clients, requests, args.ramp)
            after = health()
            row |= _cpu_cost(cpu, _cpu_seconds(os.getpid()), before, after, row)
            row |= _expert_cost(before["experts"], after["experts"], row["tokens"])
            rows.append(row)
            _print_row(row, rows[0], engine_only=True)
    finally:
        engine.close()
        rt.close()
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


def _health(base: str) -> dict:
    """The server's /health: its engine's and its experts' counters."""
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        return json.loads(r.read())


def _cpu_seconds(server_pid: int) -> tuple[float, float, float]:
    """CPU seconds (user + system) used so far by the server's own process (HTTP, and the
    engine too with --engine-in-process), by its engine's child process, and by this one
    (the load generator): the machine's cores are shared by them all, so each one's cost per
    token says where a level's time goes."""
    engine = sum(_process_cpu(pid) for pid in _children(server_pid))
    own = resource.getrusage(resource.RUSAGE_SELF)
    return _process_cpu(server_pid), engine, own.ru_utime + own.ru_stime


def _process_cpu(pid: int) -> float:
    """A running process's user + system CPU seconds (0 if it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _children(pid: int) -> list[int]:
    """The process's children (Linux: /proc/PID/task/*/children)."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _cpu_cost(cpu0, cpu1, health0: dict, health1: dict, row: dict, engine_apart=False) -> dict:
    """Per generated token: the CPU time of the server and of the load generator, and
    (engine_apart: the engine ran in a child process) of the server's HTTP process and
    engine process each; per step: the engine's mean batch and busy time (its forward passes
    and sampling)."""
    tokens = max(row["tokens"], 1)
    e0, e1 = health0["engine"], health1["engine"]
    steps = max(e1["steps"] - e0["steps"], 1)
    http, engine, client = ((b - a) / tokens * 1e6 for a, b in zip(cpu0, cpu1, strict=True))
    split = {"http_cpu_us_per_token": http, "engine_cpu_us_per_token": engine}
    return (split if engine_apart else {}) | {
        "server_cpu_us_per_token": http + engine,
        "client_cpu_us_per_token": client,
        "mean_batch": (e1["batch_rows"] - e0["batch_rows"]) / steps,
        "step_ms": (e1["busy_s"] - e0["busy_s"]) / steps * 1e3,
    }


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


def _print_row(row: dict, base: dict, engine_only: bool = False) -> None:
    ratio = row["aggregate_tok_s"] / base["aggregate_tok_s"]
    line = (
        f"concurrency {row['clients']:>3}: {row['tokens']:>5} tokens, aggregate "
        f"{row['aggregate_tok_s']:8.1f} tok/s ({ratio:5.2f}x concurrency {base['clients']}), "
        f"per request {row['per_request_tok_s']:7.1f} tok/s, first token p50 "
        f"{row['ttft_p50_s'] * 1e3:7.1f} ms p99 {row['ttft_p99_s'] * 1e3:7.1f} ms, gaps p50 "
        f"{row['gap_p50_s'] * 1e3:6.1f} ms p99 {row['gap_p99_s'] * 1e3:6.1f} ms"
    )
    line += f"; mean batch {row['mean_batch']:4.1f}, step {row['step_ms']:5.2f} ms, CPU per token: "
    if engine_only:  # one process: engine and clients
        line += f"{row['client_cpu_us_per_token']:5.0f} us"
    else:
        line += f"server {row['server_cpu_us_per_token']:5.0f} us"
        if "engine_cpu_us_per_token" in row:  # (not with --engine-in-process)
            line += (
                f" (HTTP {row['http_cpu_us_per_token']:4.0f}, engine "
                f"{row['engine_cpu_us_per_token']:4.0f})"
            )
        line += f", load generator {row['client_cpu_us_per_token']:5.0f} us"
    if "expert_bytes_per_token" in row:
        share = row["expert_bytes_per_token"] / max(base["expert_bytes_per_token"], 1e-9)
        line += f", experts read {row['expert_bytes_per_token'] / 1e6:.2f} MB/token ({share:.2f}x)"
    if "node_calls_per_token" in row:
        share = row["node_calls_per_token"] / max(base["node_calls_per_token"], 1e-9)
        line += f", node calls {row['node_calls_per_token']:.1f}/token ({share:.2f}x)"
    print(line, flush=True)
