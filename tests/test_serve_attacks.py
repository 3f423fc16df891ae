"""`moeshard serve` attacked as a public endpoint is (issue 34's HTTP rows), each against a
real server process over real sockets: slowloris, slow bodies, running out of descriptors,
huge prompts, deeply nested JSON, unauthenticated /health and /metrics, a node name that
would write lines of its own into /metrics."""

from __future__ import annotations

import http.client
import json
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import ROOT, wait_until
from test_serve_api import authorised, metrics, serving

from moeshard.coordinator.serve.metrics import label_value
from moeshard.coordinator.serve.requests import too_deep

KEY = "sk-attack-test"
PROMPT = "The function returns"
CAP = 200  # the server's --max-connections
HEADER_TIMEOUT = 2.0  # its --header-timeout and --body-timeout


@pytest.fixture(scope="module")
def server(demo):
    flags = ["--api-key", KEY, "--max-connections", str(CAP)]
    flags += ["--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(HEADER_TIMEOUT)]
    with serving(demo, *flags) as base:
        yield base


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def post(base: str, path: str, body: bytes, key: str | None = KEY, timeout: float = 30.0):
    """(status, parsed JSON answer, seconds) of a POST of raw `body`."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=timeout)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key
                                                      else {})  # fmt: skip
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body, headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null"), time.perf_counter() - t0
    finally:
        conn.close()


def normal(base: str) -> tuple[str, float]:
    """A normal request (8 greedy tokens): its text and how long it took."""
    body = json.dumps(
        {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    ).encode()
    status, answer, seconds = post(base, "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"], seconds


def closed_by_server(sock: socket.socket) -> bool:
    """Has the server closed this connection (EOF or reset)?"""
    ready, _, _ = select.select([sock], [], [], 0)
    if not ready:
        return False
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def test_half_open_connections_are_closed_and_requests_answered_meanwhile(server):
    """Slowloris: 3 x CAP connections, half of them sending half a request's headers.  The
    server keeps at most CAP open (the oldest still-unsent ones closed for newer ones),
    answers a normal request at once while they are held, and closes every one of them
    within the header timeout (the original server never closed one).  A client's connection
    kept open after an answer is not among those closed."""
    want, _ = normal(server)
    port, held = port_of(server), []
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps(
        {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    ).encode()

    def on_kept() -> str:
        kept.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
        return json.loads(kept.getresponse().read())["choices"][0]["text"]

    assert on_kept() == want
    kept_port = kept.sock.getsockname()[1]
    try:
        for i in range(3 * CAP):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-a: ")  # and never the rest
            held.append(s)
        text, seconds = normal(server)
        assert text == want and seconds < 2.0, seconds
        assert on_kept() == want and kept.sock.getsockname()[1] == kept_port  # the same one
        gauge = metrics(server, KEY)["moeshard_http_connections", ()]
        assert gauge <= CAP, gauge
        time.sleep(0.3)  # (trickle one more byte on the newest: still within the deadline)
        for s in held[-CAP // 2 :: 2]:
            s.sendall(b"b")
        wait_until(
            lambda: all(closed_by_server(s) for s in held), HEADER_TIMEOUT + 5,
            what="every half-open connection closed by the server",
        )  # fmt: skip
    finally:
        kept.close()
        for s in held:
            s.close()
    values = metrics(server, KEY)
    closed = values["moeshard_http_connections_timed_out_total", ()]
    closed += values["moeshard_http_connections_evicted_total", ()]
    assert closed >= 3 * CAP, values
    assert normal(server)[0] == want


def test_a_body_sent_too_slowly_is_cut_at_the_body_timeout(server):
    """Headers sent, then a body that never finishes: closed after --body-timeout, and the
    server answers the next request as before."""
    s = socket.create_connection(("127.0.0.1", port_of(server)), timeout=5)
    try:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        t0 = time.perf_counter()
        wait_until(lambda: closed_by_server(s), HEADER_TIMEOUT + 5, what="the slow body cut")
        assert time.perf_counter() - t0 >= HEADER_TIMEOUT * 0.8
    finally:
        s.close()
    assert normal(server)[1] < 2.0


ACCEPT_SERVER = textwrap.dedent(
    """
    import asyncio, logging, resource, sys
    from moeshard.coordinator.serve.connections import AcceptErrors

    logging.basicConfig(stream=sys.stderr, format="%(name)s %(message)s")
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    async def main():
        loop = asyncio.get_running_loop()
        if sys.argv[1] == "bounded":
            loop.set_exception_handler(AcceptErrors(every=1.0))
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0, backlog=512)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(3.0)

    asyncio.run(main())
    """
)


def accept_error_lines(handler: str) -> tuple[int, str]:
    """An asyncio server with 48 descriptors and 300 clients for 3 s (`handler`: asyncio's
    default, or `AcceptErrors` as `serve` installs it): the lines its log got about failed
    accepts, and the last of them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ACCEPT_SERVER, handler], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    port = int(proc.stdout.readline())
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        for c in clients:
            c.close()
    lines = [line for line in err.splitlines() if "accept" in line]
    return len(lines), (lines or [""])[-1]


def test_running_out_of_descriptors_is_logged_at_a_bounded_rate():
    """asyncio logs each failed accept() with a traceback, up to the listen backlog per pass
    of the loop (the original server's log grew 260 MB in 50 s); `serve`'s handler writes a
    line a second at most here, with the count."""
    flood, _ = accept_error_lines("default")
    assert flood > 100, flood  # the failure is real in this setting
    bounded, last = accept_error_lines("bounded")
    assert 1 <= bounded <= 4, bounded
    assert "accept() failed" in last and "Too many open files" in last, last


def test_huge_prompts_are_refused_before_tokenizing_and_health_keeps_answering(server):
    """3 clients posting 3.9 MB prompts in a loop: each refused with a 400 fast (its
    tokenizing alone would take ~2 s, on the event loop in the original server), while
    /health and a normal request keep answering within a second, with the same text."""
    want, _ = normal(server)
    big = json.dumps(
        {"model": "demo", "prompt": "word " * 780_000, "max_tokens": 8}
    ).encode()  # 3.9 MB
    stop, answers = threading.Event(), []

    def attacker() -> None:
        while not stop.is_set():
            answers.append(post(server, "/v1/completions", big))

    threads = [threading.Thread(target=attacker) for _ in range(3)]
    for t in threads:
        t.start()
    health_s, normal_s, texts = [], [], []
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            with urllib.request.urlopen(authorised(server + "/health", KEY), timeout=30) as r:
                assert r.status == 200
            health_s.append(time.perf_counter() - t0)
            text, seconds = normal(server)
            texts.append(text)
            normal_s.append(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert max(health_s) < 1.0 and max(normal_s) < 1.0, (max(health_s), max(normal_s))
    assert answers and all(status == 400 for status, _, _ in answers), answers[:3]
    assert "characters" in answers[0][1]["error"]["message"]
    assert max(s for _, _, s in answers) < 1.5, max(s for _, _, s in answers)
    assert texts == [want] * len(texts)


def test_deeply_nested_json_is_a_400(server):
    """A body nested 100,000 deep made the original server's parser raise RecursionError
    (HTTP 500); one nested 40 deep is refused too, by the depth cap."""
    for depth in (100_000, 40):
        body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        status, answer, _ = post(server, "/v1/completions", body)
        assert status == 400, (depth, answer)
        assert "nested deeper" in answer["error"]["message"]
    assert normal(server)[0]


def test_too_deep_counts_lists_and_objects():
    assert not too_deep({"a": [1, {"b": [2]}]}, 4)
    assert too_deep({"a": [1, {"b": [2]}]}, 3)
    assert not too_deep("text", 0) and not too_deep([], 1)
    nested: list = []
    for _ in range(5000):  # deeper than Python's recursion limit: no RecursionError
        nested = [nested]
    assert too_deep(nested, 32)


def test_the_api_key_guards_health_and_metrics_and_the_page_asks_for_it(server):
    """Without the key /health and /metrics are 401 (in network mode they name the nodes,
    their addresses and the session); the chat page is the static file, which asks for the
    key and holds nothing of the server's."""
    for path in ("/health", "/metrics"):
        for key in (None, "sk-wrong"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(authorised(server + path, key), timeout=10)
            assert err.value.code == 401, path
        with urllib.request.urlopen(authorised(server + path, KEY), timeout=10) as r:
            assert r.status == 200
    with urllib.request.urlopen(server + "/", timeout=10) as r:
        page = r.read().decode()
    assert 'id="key"' in page and "401" in page  # the key field, and what shows it is needed
    assert "demo" not in page and "running" not in page


def test_label_values_are_escaped_per_the_exposition_format():
    assert label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert label_value("node-1") == "node-1"
    from prometheus_client.parser import text_string_to_metric_families

    name = 'evil"}\nmoeshard_requests_total 999999\n#'
    text = f'm{{node="{label_value(name)}"}} 1\n'
    [sample] = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert sample.labels == {"node": name} and sample.value == 1


def test_a_node_name_cannot_write_lines_into_metrics(demo):
    """A node whose signed Info names it with a line feed and a sample after it (a node
    refuses such a --name, so it is set in-process, as a hostile node's code would): /metrics
    shows one label value, the safe form the coordinator admits it under (the original server
    let the sample through as a line of its own)."""
    from moeshard.moe.wire.names import safe_node_name
    from moeshard.node.daemon import Node, NodeConfig

    evil = 'evil"\nmoeshard_requests_total 999999'
    node = Node(NodeConfig(path=str(demo), name="fine", insecure=True, advertise=False))
    node.start()
    node.identity.name = evil
    try:
        flags = ["--peers", f"127.0.0.1:{node.port}", "--insecure", "--api-key", KEY]
        with serving(demo, *flags) as base:
            normal(base)
            with urllib.request.urlopen(authorised(base + "/metrics", KEY), timeout=10) as r:
                text = r.read().decode()
            assert "\nmoeshard_requests_total 999999" not in text
            values = metrics(base, KEY)
            assert values["moeshard_requests_total", ()] == 1
            latency = [labels for (n, labels), _ in values.items()
                       if n == "moeshard_node_call_latency_ms"]  # fmt: skip
            assert latency == [(("node", safe_node_name(evil)),)], latency
    finally:
        node.stop()


def test_the_http_attack_bench_makes_its_rows(demo):
    """`http_attack_rows` (what `moeshard bench attack` calls), two attacks, a second each:
    a row per attack, met goals, and the attackers' answers in the notes."""
    from moeshard.bench.attack_http import http_attack_rows

    rows = http_attack_rows(demo, 1.0, ("nested-json", "unauthenticated-scrape"))
    assert [r.metric for r in rows] == ["p99 s", "p99 s"]
    assert all(r.passed and r.same_output and r.peak_rss_mb > 0 for r in rows), rows
    assert "answers 400 x" in rows[0].notes[0] and "answers 401 x" in rows[1].notes[0], rows
