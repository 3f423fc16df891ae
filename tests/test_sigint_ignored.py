"""A background job keeps SIGINT ignored (`moeshard.moe.sigint`). A shell without job control
(`cmd &` in a script, `nohup`) starts its background jobs with SIGINT ignored, so that a
Ctrl-C meant for the foreground leaves them running. Started that way, `moeshard generate`
runs to its end through a SIGINT, and `node` and `serve` keep serving until SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

from moeshard.moe.convert.placement import shard_model
from tests.helpers import ROOT, NodeProcess, wait_until

TOKENS = 250


@contextmanager
def sigint_ignored():
    """Children started within inherit SIGINT ignored (exec keeps an ignored signal so)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_generate_runs_to_its_end_through_a_sigint(demo, tmp_path):
    stats = tmp_path / "stats.jsonl"
    cmd = [sys.executable, "-m", "moeshard", "generate", str(demo), "--prompt", "The function"]
    cmd += ["--max-tokens", str(TOKENS), "--ram", "60M", "--json", "--stats-json", str(stats)]
    with sigint_ignored():
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    try:
        wait_until(lambda: stats.exists() and stats.read_text().count("\n") >= 3, 120, what="3")
        made_before = stats.read_text().count("\n")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert made_before < TOKENS  # the signal came mid-generation
    assert proc.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["stopped_by"] == "max_tokens" and len(got["tokens"]) == TOKENS


def _alive_after_sigint(proc: subprocess.Popen) -> bool:
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)
    return proc.poll() is None


def test_a_node_keeps_serving_through_a_sigint_and_stops_on_sigterm(converted, tmp_path):
    plan = shard_model(converted("qwen3_moe"), 1, 1, tmp_path / "shard")
    with sigint_ignored():
        node = NodeProcess(plan["nodes"][0]["dir"], advertise=False, insecure=True).wait_ready()
    try:
        assert _alive_after_sigint(node.proc), node.text()
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=60) == 0, node.text()
    finally:
        node.stop()


def test_serve_keeps_serving_through_a_sigint_and_stops_on_sigterm(demo):
    cmd = [sys.executable, "-m", "moeshard", "serve", str(demo), "--port", "0"]
    with sigint_ignored():
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("serving "), line
        time.sleep(0.5)  # uvicorn has its handlers in place by now
        assert _alive_after_sigint(proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # uvicorn stops gracefully, then raises the signal again (as with SIGINT at its default)
    assert proc.returncode == -signal.SIGTERM, err
    assert "Traceback" not in err
