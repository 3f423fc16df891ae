"""`moeshard serve` as a real server process on loopback, driven by the official `openai`
client: completions and chat, streamed and not, the same text as `generate`, bad requests as
OpenAI's 400s, the API key, /v1/models, /health and /metrics."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import openai
import pytest
from helpers import (
    ROOT,
    assert_quiet_stop,
    popen_from_a_terminal,
    wait_python_started,
    wait_until,
)

from moeshard.coordinator.chat import chat_prompt
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local

KEY = "sk-test-moeshard"
PROMPT = "The function returns"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(demo, *flags: str):
    """A `moeshard serve DEMO --name demo FLAGS...` subprocess on a free port, up: its base URL.
    Stopped on leaving.  Its output goes to a file (a pipe nobody reads could fill and
    stall it), shown when it fails to come up."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeshard", "serve", str(demo), "--port", str(port),
         "--name", "demo", *flags],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None

    def up() -> bool:
        try:
            with urllib.request.urlopen(authorised(base + "/health", key), timeout=1) as r:
                return r.status == 200
        except OSError:
            return proc.poll() is not None  # (died: stop waiting, fail below)

    try:
        wait_until(up, 180, what="the server")
        assert proc.poll() is None, log.seek(0) or log.read()
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def server(demo):
    with serving(demo, "--api-key", KEY, "--max-batch", "4") as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def local_text(demo, max_tokens: int, **options) -> str:
    """`generate`'s greedy text for PROMPT (with these SamplingOptions fields)."""
    rt = open_local(demo)
    ids = rt.tokenizer.encode(PROMPT)
    opts = SamplingOptions(max_tokens=max_tokens, **options)
    return rt.decode(generate(rt.transformer, ids, opts).tokens)


def test_completions_match_generate_streamed_or_not(client, demo):
    want = local_text(demo, 24)
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 24 and got.usage.prompt_tokens == 4
    stream = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stream=True
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert "".join(chunks) == want and len(chunks) > 3


def test_the_engine_in_the_servers_own_process_answers_the_same(demo):
    """`serve --engine-in-process` (no engine child process): the same greedy text."""
    want = local_text(demo, 16)
    with serving(demo, "--engine-in-process") as base:
        plain = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        got = plain.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            assert json.loads(r.read())["engine"]["finished"] == {"length": 1}


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "What does a function return?"}]
    got = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0
    )
    text = got.choices[0].message.content
    assert got.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_stop_sequences_end_the_text(client, demo):
    want = local_text(demo, 40)
    stop = want[10:14]
    got = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == want[: want.index(stop)]
    assert got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_reach_the_sampler(client, demo, penalty):
    """A penalty changes the greedy text, and the served text is `generate`'s with it."""
    want = local_text(demo, 24, **{penalty: 1.5})
    assert want != local_text(demo, 24)
    got = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=24, temperature=0, **{penalty: 1.5}
    )
    assert got.choices[0].text == want


def test_logit_bias_makes_a_token_win(client, demo):
    token = 42
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, logit_bias={str(token): 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == open_local(demo).decode([token] * 5)


def local_logprobs(demo, ids: list[int], max_tokens: int, top: int):
    """`generate`'s greedy tokens for prompt `ids`, each with its log-probability and the
    `top` most likely (token, log-probability), from its logits in float64."""
    rt = open_local(demo)
    result = generate(rt.transformer, ids, SamplingOptions(max_tokens=max_tokens, keep_logits=True))
    out = []
    for token, logits in zip(result.tokens, result.logits, strict=True):
        z = logits.astype(np.float64) - logits.max()
        logp = z - np.log(np.exp(z).sum())  # [V]
        best = np.argsort(-logp, kind="stable")[:top]
        out.append((token, logp[token], [(int(t), logp[t]) for t in best]))
    return rt, out


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_logprobs_are_the_models(client, demo, stream):
    """Completions' `logprobs: 3` and chat's `logprobs` with `top_logprobs: 3` give each
    token's text and log-probability and its three most likely alternatives, as the model's
    logits say (computed here from `generate`'s)."""
    rt = open_local(demo)
    got = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=stream
    )
    if stream:
        parts = [c.choices[0].logprobs for c in got if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        token_logprobs = [x for p in parts for x in p.token_logprobs]
        top_logprobs = [x for p in parts for x in p.top_logprobs]
        offsets = [x for p in parts for x in p.text_offset]
    else:
        lp = got.choices[0].logprobs
        tokens, token_logprobs = lp.tokens, lp.token_logprobs
        top_logprobs, offsets = lp.top_logprobs, lp.text_offset
    _, want = local_logprobs(demo, rt.tokenizer.encode(PROMPT), 6, 3)
    assert tokens == [rt.decode([t]) for t, _, _ in want]
    np.testing.assert_allclose(token_logprobs, [p for _, p, _ in want], atol=1e-5)
    assert offsets == list(np.cumsum([0] + [len(t) for t in tokens[:-1]]))
    for alternatives, (_, _, best) in zip(top_logprobs, want, strict=True):
        assert list(alternatives) == [rt.decode([t]) for t, _ in best]
        np.testing.assert_allclose(list(alternatives.values()), [p for _, p in best], atol=1e-5)

    messages = [{"role": "user", "content": "What does a function return?"}]
    chat = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, stream=stream,
    )  # fmt: skip
    if stream:
        content = [x for c in chat if c.choices and c.choices[0].logprobs
                   for x in c.choices[0].logprobs.content]  # fmt: skip
    else:
        content = chat.choices[0].logprobs.content
    ids = rt.tokenizer.encode(chat_prompt(demo, rt.model.config.model_type, messages))
    _, want = local_logprobs(demo, ids, 6, 3)
    assert [c.token for c in content] == [rt.decode([t]) for t, _, _ in want]
    np.testing.assert_allclose([c.logprob for c in content], [p for _, p, _ in want], atol=1e-5)
    for c, (_, _, best) in zip(content, want, strict=True):
        assert [a.token for a in c.top_logprobs] == [rt.decode([t]) for t, _ in best]
        assert c.bytes is None or bytes(c.bytes).decode() == c.token
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the best


def test_bad_requests_are_openai_400s(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt=PROMPT, temperature=5.0)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    for field, value in [("logprobs", 6), ("top_k", -1), ("presence_penalty", 3.0),
                         ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}),
                         ("logit_bias", {"999999": 1}),
                         ("logit_bias", {str(t): 1 for t in range(1025)})]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="demo", prompt=PROMPT, extra_body={field: value})
        assert err.value.body["param"] == field, (field, value)
    with pytest.raises(openai.BadRequestError) as err:  # alternatives without logprobs
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], top_logprobs=3
        )
    assert err.value.body["param"] == "top_logprobs"
    # what this server does not do is refused by name, not answered as if it were not asked
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt=PROMPT, echo=True)
    assert err.value.body["param"] == "echo"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], tools=[tool]
        )
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.APIStatusError) as err:  # a stranger's oversized body
        client.completions.create(model="demo", prompt="x" * (5 << 20), max_tokens=1)
    assert err.value.status_code == 413


def _raw(base: str, method: str, path: str, body: dict | None = None):
    """(status, headers, parsed JSON) of one request with the API key."""
    conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=30)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), json.loads(r.read())
    finally:
        conn.close()


def test_every_error_has_openais_shape_and_model_is_required(server):
    """404 and 405 from the router, and a request without "model" (OpenAI requires it), are
    OpenAI error objects like every other error of the server."""
    for method, path, status in [("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405),
                                 ("GET", "/v1/completions", 405)]:  # fmt: skip
        got, headers, body = _raw(server, method, path)
        assert got == status, (method, path, got, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] in ("not_found_error", "invalid_request_error")
        if status == 405:
            assert "GET" in headers.get("allow", "") or "POST" in headers.get("allow", "")
    got, _, body = _raw(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert got == 400 and body["error"]["param"] == "model", body
    assert "'demo'" in body["error"]["message"]


def test_a_busy_port_is_one_line_and_exit_2_before_loading(demo):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "moeshard", "serve", str(demo), "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"moeshard: error: cannot listen on 127.0.0.1:{port}: Address already in use (another "
        "server is on it: choose a --port)"
    ]
    assert "serving" not in done.stdout + done.stderr


def test_the_api_key_is_required(server):
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="demo", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def authorised(url: str, key: str | None) -> urllib.request.Request:
    """A GET of `url` with the API key (none: without)."""
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})


def metrics(base: str, key: str | None = None) -> dict[tuple[str, tuple], float]:
    """/metrics read with Prometheus' own parser (prometheus_client): {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(authorised(base + "/metrics", key)) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")

    def health() -> dict:
        with urllib.request.urlopen(authorised(server + "/health", KEY)) as r:
            return json.loads(r.read())

    wait_until(lambda: health()["running"] == 0, 30, what="the earlier tests' requests to end")
    before, values0 = health(), metrics(server, KEY)
    assert before["status"] == "ok"
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=3)
    engine, engine0 = health()["engine"], before["engine"]
    assert engine["steps"] - engine0["steps"] == 3  # a request alone: one step per token
    assert engine["batch_rows"] - engine0["batch_rows"] == 3
    assert engine["busy_s"] > engine0["busy_s"]
    values = metrics(server, KEY)
    assert values["moeshard_generated_tokens_total", ()] >= 3
    assert values["moeshard_requests_total", ()] >= 1
    assert ("moeshard_queue_depth", ()) in values and ("moeshard_batch_size_mean", ()) in values
    # the latency histograms: this request's first token, its 2 gaps, its whole time
    for name, n in (("time_to_first_token", 1), ("inter_token_latency", 2),
                    ("request_duration", 1)):  # fmt: skip
        count = (f"moeshard_{name}_seconds_count", ())
        assert values[count] - values0.get(count, 0) == n, name
        inf = (f"moeshard_{name}_seconds_bucket", (("le", "+Inf"),))
        assert values[inf] == values[count]


@pytest.mark.parametrize("mode", ["ram", "nodes"])
def test_served_under_a_ram_budget_or_through_nodes_the_text_is_the_same(demo, mode):
    """The same greedy text as `generate` in RAM when the server streams experts under --ram
    (and /metrics has the expert cache's hit ratio) or computes them on two nodes (and
    /metrics has each node's call latency), with requests batched together."""
    from helpers import NodeProcess

    nodes = []
    if mode == "nodes":
        nodes = [NodeProcess(demo, advertise=False, insecure=True) for _ in range(2)]
        for node in nodes:
            node.wait_ready()
        flags = ["--peers", ",".join(f"127.0.0.1:{n.port}" for n in nodes), "--insecure"]
    else:
        flags = ["--ram", "730M", "--context", "64", "--max-batch", "4"]
    try:
        with serving(demo, *flags) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            want = local_text(demo, 12)
            with ThreadPoolExecutor(3) as pool:
                texts = list(pool.map(
                    lambda _: client.completions.create(
                        model="demo", prompt=PROMPT, max_tokens=12, temperature=0
                    ).choices[0].text,
                    range(3),
                ))  # fmt: skip
            assert texts == [want] * 3
            values = metrics(base)
            if mode == "ram":
                assert 0.0 <= values["moeshard_expert_cache_hit_ratio", ()] <= 1.0
            else:
                latency = {
                    labels: v for (name, labels), v in values.items()
                    if name == "moeshard_node_call_latency_ms"
                }  # fmt: skip
                assert len(latency) == 2 and all(v > 0 for v in latency.values()), latency
    finally:
        for node in nodes:
            node.stop()


def test_the_chat_page_streams_in_a_real_browser(server):
    """Debian's chromium, headless, driven by selenium through chromium-driver: load the page,
    send a prompt, see the answer arrive in pieces; the screenshot is kept as an artefact."""
    import os
    import shutil

    browser, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver_path):
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("no chromium/chromedriver here (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.set_window_size(1000, 700)
        driver.get(server + "/")
        driver.find_element(By.ID, "key").send_keys(KEY)
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.ID, "model").text == "demo" or d.execute_script(
                "loadModel(); return false;")
        )  # fmt: skip
        driver.find_element(By.ID, "max").clear()
        driver.find_element(By.ID, "max").send_keys("40")
        box = driver.find_element(By.ID, "prompt")
        box.send_keys("How do I open a file?")
        box.send_keys(Keys.ENTER)
        WebDriverWait(driver, 60).until(lambda d: "pieces" in d.find_element(By.ID, "stats").text)
        answer = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
        stats = driver.find_element(By.ID, "stats").text
        pieces = int(stats.split(";")[1].split()[0])
        assert answer.strip() and pieces > 1, (answer, stats)  # arrived as a stream
        artefacts = ROOT / "out" / "test-artefacts"
        artefacts.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(artefacts / "chat-page.png"))
        assert (artefacts / "chat-page.png").stat().st_size > 1000
    finally:
        driver.quit()


@pytest.mark.parametrize("engine_only", [False, True], ids=["http", "engine-only"])
def test_bench_serve_runs(demo, engine_only):
    """`moeshard bench serve`: a server process and its clients, or (--engine-only) the
    clients submitting to the engine in-process; one line per level."""
    out = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "serve", str(demo),
         "--concurrency", "1,2", "--tokens", "32", "--requests", "2"]
        + ["--engine-only"] * engine_only,
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("concurrency")]
    assert len(lines) == 2 and "aggregate" in lines[1] and "first token p50" in lines[1]
    # one client: every engine step holds its one request; the CPU each process spent (in
    # clock ticks of 10 ms: 64 tokens, so that a fast machine's server spends a few)
    assert "mean batch  1.0" in lines[0], lines[0]
    assert int(lines[1].split(":")[1].split("tokens")[0]) == 2 * 32  # every token was made
    cpu = lines[0].split("CPU per token:")[1]
    # "server N us (HTTP A, engine B), load generator M us", or (engine only) "N us"
    figures = [float(f) for f in re.findall(r"(?:server|HTTP|engine|generator|^) *([0-9]+)", cpu)]
    assert len(figures) == (1 if engine_only else 4) and figures[0] > 0 < figures[-1], cpu
    if not engine_only:  # the server's figure is its two processes' (rounded apart); each
        server, http_side, engine, _ = figures  # counts in clock ticks, so one may be 0 here
        assert abs(server - http_side - engine) <= 1, cpu


def test_bench_serve_long_prompts_in_chunks(demo):
    """`--prompt-tokens` prompts read `--prefill-chunk` tokens a step, clients started over
    `--ramp`: every token is still made, and the gaps between a stream's chunks are reported."""
    out = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "serve", str(demo), "--engine-only",
         "--concurrency", "1,2", "--tokens", "6", "--requests", "2", "--prompt-tokens", "40",
         "--prefill-chunk", "8", "--ramp", "0.05"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("concurrency")]
    assert len(lines) == 2
    for line in lines:
        assert int(line.split(":")[1].split("tokens")[0]) == 2 * 6, line
        gaps = line.split("gaps p50")[1].split("ms")[0]
        assert float(gaps) > 0, line
    too_long = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "serve", str(demo), "--engine-only",
         "--prompt-tokens", "250", "--tokens", "8", "--context", "256"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert too_long.returncode == 2 and "exceed --context 256" in too_long.stderr


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_client_that_hangs_up_frees_its_slot_at_once(demo, stream):
    """One slot and no queue: while a request holds the slot another is refused (429, OpenAI's
    rate-limit error).  Its client hangs up (after the first event when streamed, while
    waiting when not): the engine ends it as cancelled well before its max_tokens, and the
    slot serves the next request."""
    max_tokens = 250  # ~0.3 s of decoding at the fastest this machine runs
    with serving(demo, "--max-batch", "1", "--max-queue", "0", "--no-eos") as base:
        port = int(base.rsplit(":", 1)[1])
        body = {"model": "demo", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(body | {"stream": stream}),
                     {"Content-Type": "application/json"})  # fmt: skip
        if stream:
            first = conn.getresponse().readline()
            assert first.startswith(b"data: "), first
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        wait_until(lambda: health(base)["running"] == 1, 30, what="the first request to run")
        with pytest.raises(openai.RateLimitError) as err:  # the one slot is taken
            client.completions.create(model="demo", prompt=PROMPT, max_tokens=1)
        assert err.value.body["type"] == "rate_limit_error"
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-answer
        conn.close()
        wait_until(lambda: health(base)["running"] == 0, 30, what="the slot to be freed")
        finished = health(base)["engine"]["finished"]
        assert finished == {"cancelled": 1}, finished  # not "length": it stopped early
        assert metrics(base)["moeshard_generated_tokens_total", ()] < max_tokens
        answer = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3)
        assert answer.usage.completion_tokens == 3


def health(base: str) -> dict:
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_queued_request_whose_client_hangs_up_leaves_the_queue(demo, stream):
    """One slot and room for one waiting request.  While a long request holds the slot, a
    second waits; its client hangs up: it leaves the queue at once, so a third is queued
    rather than refused, and it is never run (only the first's prompt is ever read)."""
    with serving(demo, "--max-batch", "1", "--max-queue", "1", "--no-eos") as base:
        port = int(base.rsplit(":", 1)[1])

        def send(max_tokens: int, streamed: bool) -> http.client.HTTPConnection:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            body = {"model": "demo", "prompt": PROMPT, "max_tokens": max_tokens,
                    "temperature": 0, "stream": streamed}  # fmt: skip
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            return conn

        def hang_up(conn: http.client.HTTPConnection) -> None:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()

        holder = send(2000, True)  # seconds of decoding: it holds the slot throughout
        assert holder.getresponse().readline().startswith(b"data: ")
        waiting = send(8, stream)
        wait_until(lambda: health(base)["waiting"] == 1, 30, what="the second request to queue")
        hang_up(waiting)
        wait_until(lambda: health(base)["waiting"] == 0, 10, what="the queue to drop it")
        assert health(base)["running"] == 1  # (the first still decoding: not its admission)
        third = send(8, stream)  # the room is free again: queued, not refused
        wait_until(lambda: health(base)["waiting"] == 1, 30, what="the third request to queue")
        hang_up(third)
        # (its hang-up noticed before the slot frees: else a server that notices the two
        # hang-ups the other way round admits it, and reads its prompt, before dropping it)
        wait_until(lambda: health(base)["waiting"] == 0, 10, what="the queue to drop it")
        hang_up(holder)
        wait_until(lambda: health(base)["running"] + health(base)["waiting"] == 0, 30,
                   what="the server to be idle")  # fmt: skip
        assert health(base)["engine"]["finished"] == {"cancelled": 3}
        assert metrics(base)["moeshard_prompt_tokens_total", ()] == 4  # the first's alone
        assert metrics(base).get(("moeshard_requests_rejected_total", ()), 0) == 0


def test_ctrl_c_at_any_moment_of_serve_leaves_no_traceback(demo):
    """SIGINT while serve starts and once it serves: 130 and "moeshard: interrupted", or
    (once uvicorn has taken the signal over) a normal stop, 0; never a traceback or a hang."""
    cmd = [sys.executable, "-m", "moeshard", "serve", str(demo), "--port", "0"]
    # after "serving" at once and a few ms on: before uvicorn takes the signal over, a Ctrl-C
    # raised as KeyboardInterrupt once landed in an event loop's finaliser (a traceback and
    # "did not start", 3 runs in 24); it is deferred there now
    for moment in (0.1, 0.6, "serving", "serving+0.005", "serving+0.03"):
        proc = popen_from_a_terminal(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        try:
            if moment.startswith("serving") if isinstance(moment, str) else False:
                line = proc.stderr.readline()  # its one line on stderr says it serves
                assert line.startswith("serving "), line
                time.sleep(float(moment.partition("+")[2] or 0))
            else:  # (after the interpreter's own start, however long that took)
                wait_python_started(proc)
                time.sleep(moment)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        # stopped (0), or interrupted before uvicorn took the signal over
        assert_quiet_stop(proc.returncode, err, moment)
