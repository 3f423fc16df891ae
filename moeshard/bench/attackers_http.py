"""The attackers of `moeshard bench attack`'s HTTP rows, each run in a child process of its
own by `attack_http` until `stop` is set, when `report` gets one dict of what it saw: big
prompts, nested JSON, an unauthenticated scrape, slowloris connections."""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import socket
import threading

KEY = "sk-bench-attack"
TIMEOUT = 30.0  # seconds an honest request may take before it counts as failed
BIG_PROMPT_BYTES = 3_900_000  # the 3.9 MB prompts
NESTING = 100_000  # depth of the nested-JSON attack's bodies


def _headers(key: str | None) -> dict:
    h = {"Content-Type": "application/json"}
    return h | ({"Authorization": f"Bearer {key}"} if key else {})


def _get(port: int, path: str, key: str | None, timeout: float) -> tuple[int, bytes]:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request("GET", path, headers=_headers(key))
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return 0, b""


def _posting(port: int, stop, report, body: bytes, what: str, want: set[int]) -> None:
    """3 threads posting `body` back to back; reports the answers' statuses (`refused`: all
    of them in `want`)."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
                try:
                    conn.request("POST", "/v1/completions", body, _headers(KEY))
                    status = conn.getresponse().status
                finally:
                    conn.close()
            except (OSError, http.client.HTTPException):
                status = 0  # (the connection failed or was closed)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = sum(statuses.values())
    note = f"{sent} {what} sent; answers {_statuses(statuses)}"
    report.put({"note": note, "refused": set(statuses) <= want})


def _statuses(statuses: dict[int, int]) -> str:
    return ", ".join(f"{s or 'no answer'} x{n}" for s, n in sorted(statuses.items())) or "none"


def big_prompts(port: int, stop, report) -> None:
    words = "word " * (BIG_PROMPT_BYTES // 5)
    body = json.dumps({"model": "demo", "prompt": words, "max_tokens": 8}).encode()
    _posting(port, stop, report, body, f"prompts of {len(body) / 1e6:.1f} MB", {400, 413})


def nested_json(port: int, stop, report) -> None:
    body = b'{"prompt": ' + b"[" * NESTING + b"]" * NESTING + b"}"
    _posting(port, stop, report, body, f"bodies nested {NESTING:,} deep", {400})


def scrape(port: int, stop, report) -> None:
    """3 threads GETting /metrics and /health without the key; any 200 is a leak."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def client(path: str) -> None:
        while not stop.is_set():
            status, _ = _get(port, path, None, TIMEOUT)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    paths = ("/metrics", "/health", "/metrics")
    threads = [threading.Thread(target=client, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    note = f"{sum(statuses.values())} scrapes; answers {_statuses(statuses)}"
    report.put({"note": note, "refused": set(statuses) <= {401}})


def slowloris(port: int, stop, report, connections: int) -> None:
    """`connections` sockets each sending half a request's headers, then a header line every
    5 s, never the end; one closed by the server is opened again (as slowloris does)."""

    raise_fd_limit()
    counts = {"opened": 0, "closed_by_server": 0, "connect_failed": 0, "held_max": 0}
    held = [0]

    async def hold() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                sock.close()
                counts["connect_failed"] += 1
                await asyncio.sleep(0.5)
                continue
            counts["opened"] += 1
            held[0] += 1
            counts["held_max"] = max(counts["held_max"], held[0])
            try:
                while not stop.is_set():
                    try:
                        data = await asyncio.wait_for(loop.sock_recv(sock, 64), 5.0)
                    except TimeoutError:
                        await loop.sock_sendall(sock, b"X-a: b\r\n")
                        continue
                    if not data:
                        break
                counts["closed_by_server"] += not stop.is_set()
            except OSError:
                counts["closed_by_server"] += 1
            finally:
                held[0] -= 1
                sock.close()

    async def main() -> None:
        tasks = []
        for i in range(connections):
            tasks.append(asyncio.create_task(hold()))
            if i % 200 == 199:
                await asyncio.sleep(0.01)  # (a ramp: the listen backlog is 2048)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    report.put({"counts": counts})


def raise_fd_limit() -> None:
    """This process's (and its attackers') descriptor limit to the hard one: the slowloris
    client holds thousands of sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
