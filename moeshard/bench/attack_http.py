"""`moeshard serve` under the HTTP attacks of issue 34, one `AttackRow` each.

A real server (`moeshard serve MODEL --api-key ...`) on a loopback port; an honest client
sends a normal request (8 greedy tokens) back to back for `seconds` without an attack, then
for `seconds` during each attack, and after it once more, by turns on a new connection and
on one kept open (as a client with a connection pool does).  Per row: the honest request's
p99 latency on a new connection (the harder case) before and during (a kept connection's in
the notes), the server process's peak RSS during the
attack (sampled from /proc), whether every honest answer was the unattacked text, whether the
server answered afterwards, and what the attack saw (answers, connections closed, the
server's log growth).  The goal per row: p99 < 1 s during the attack, an answer afterwards,
the same text.

The attackers run in a child process of their own (so that they do not share this process's
interpreter lock with the honest client's timing), kept light for a 2-core machine: bodies
built once, slowloris on raw non-blocking sockets in one asyncio loop.

`http_attack_rows(model_dir, seconds)` is what `moeshard bench attack` calls; `add_arguments`
and `run` run it alone (`python -m moeshard.bench.attack_http MODEL`).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from moeshard.bench.attack_rows import AttackRow
from moeshard.bench.attackers_http import (
    KEY,
    TIMEOUT,
    _get,
    _headers,
    big_prompts,
    nested_json,
    raise_fd_limit,
    scrape,
    slowloris,
)
from moeshard.moe.errors import MoeshardError

PROMPT = "The function returns"
GOAL = "p99 < 1 s during, answers afterwards, same text, the attack refused (4xx)"
SOCKETS_PER_PROCESS = 12_000  # slowloris connections one attacker process holds at most
ATTACKS = ("big-prompts", "slowloris", "nested-json", "unauthenticated-scrape")


def add_arguments(p) -> None:
    p.add_argument("model", help="model directory (the embedded demo model: out/demo)")
    p.add_argument(
        "--seconds", type=float, default=10.0, help="honest requests before, and during each attack"
    )
    p.add_argument(
        "--attacks",
        default=",".join(ATTACKS),
        help=f"which, comma-separated, of {', '.join(ATTACKS)}",
    )
    p.add_argument(
        "--connections",
        default="5000,cap",
        help="slowloris: half-open connections the attacker keeps trying to hold, one row per "
        "number; 'cap': as many as the server holds (its --max-connections, lowered to what "
        "its descriptor limit allows; beyond, its oldest are closed for newer ones; the "
        "original server ran out of descriptors near 20,000)",
    )
    p.add_argument(
        "--server-src",
        metavar="DIR",
        help="run the server from this source tree instead (e.g. a checkout of the code before a "
        "change, to measure what the change did)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def run(args) -> int:
    attacks = [a for a in args.attacks.split(",") if a]
    try:
        connections = [n if n == "cap" else int(n) for n in args.connections.split(",") if n]
    except ValueError:
        raise MoeshardError("--connections: numbers or 'cap', e.g. 5000,cap,25000") from None
    rows = http_attack_rows(args.model, args.seconds, attacks, connections, args.server_src)
    for row in rows:
        print(json.dumps(asdict(row)) if args.json else format_row(row), flush=True)
    return 0 if all(r.passed for r in rows) else 1


def format_row(row: AttackRow) -> str:
    ok = "PASS" if row.passed else "FAIL"
    line = (
        f"{ok} {row.attack}: normal request p99 {row.before:.3f} s before, {row.during:.3f} s "
        f"during; server peak RSS {row.peak_rss_mb:.0f} MiB; same text {row.same_output}"
    )
    return line + "".join(f"\n     {note}" for note in row.notes)


def http_attack_rows(
    model_dir,
    seconds: float,
    attacks: list[str] | tuple[str, ...] = ATTACKS,
    connections: list[int | str] | tuple[int | str, ...] = (5000, "cap"),
    server_src: str | None = None,
) -> list[AttackRow]:
    """Each attack of `attacks` against one `moeshard serve` of `model_dir`, its row (the
    slowloris one row per number of `connections`, "cap" standing for the server's cap on
    connections).  The server's and the attackers' descriptors: the hard limit (the
    slowloris client holds one per connection)."""
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise MoeshardError(f"unknown attacks {sorted(unknown)}: choose from {', '.join(ATTACKS)}")
    numbers = [n for n in connections if n != "cap"]
    if seconds <= 0 or not connections or (numbers and min(numbers) < 1):
        raise MoeshardError("--seconds must be > 0 and --connections >= 1")
    raise_fd_limit()
    with Server(model_dir, server_src) as server:
        want, _ = server.normal()  # (warm: the kernels compile on the first request)
        before = server.honest_for(seconds)
        rows = []
        for attack in attacks:
            for n in connections if attack == "slowloris" else (0,):
                n = server.max_connections() if n == "cap" else n
                rows.append(_one_attack(server, attack, seconds, want, before, n))
        return rows


def _attackers(ctx, attack: str, port: int, stop, report, connections: int) -> list:
    """The processes (not started) that run `attack` until `stop` is set."""
    target = {"big-prompts": big_prompts, "slowloris": slowloris, "nested-json": nested_json,
              "unauthenticated-scrape": scrape}[attack]  # fmt: skip
    if attack == "slowloris":  # (shared among processes: one holds SOCKETS_PER_PROCESS at most)
        n = -(-connections // SOCKETS_PER_PROCESS)
        extras = [(connections // n + (i < connections % n),) for i in range(n)]
    else:
        extras = [()]
    return [ctx.Process(target=target, args=(port, stop, report, *extra), daemon=True)
            for extra in extras]  # fmt: skip


def _stopped(procs, stop, report) -> list[dict]:
    """Stop the attacker processes `procs`; what each reported."""
    stop.set()
    reports = []
    for _ in procs:
        try:
            reports.append(report.get(timeout=30))
        except Exception:  # queue.Empty: an attacker that died says nothing
            reports.append({"note": "an attacker process said nothing"})
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return reports


def _one_attack(server, attack: str, seconds, want, before, connections) -> AttackRow:
    ctx = multiprocessing.get_context("spawn")
    stop, report = ctx.Event(), ctx.Queue()
    procs = _attackers(ctx, attack, server.port, stop, report, connections)
    log0 = server.log_size()
    for proc in procs:
        proc.start()
    time.sleep(2.0 if attack == "slowloris" else 0.3)  # (the attack under way first)
    with server.sampler() as peak:
        during = server.honest_for(seconds)
    reports = _stopped(procs, stop, report)
    seen = _merged(reports)
    refused = all(r.get("refused", True) for r in reports)
    log_growth = server.log_size() - log0
    after_text, after_s = server.normal(timeout=10)
    answered_after = after_text is not None
    same = answered_after and after_text == want and all(t == want for t in during["texts"])
    p99 = during["p99"]
    notes = [
        f"attacker: {seen}" + ("" if refused else " -- NOT REFUSED AS IT SHOULD BE"),
        f"honest, a new connection each: {during['n']} requests during ({during['failed']} "
        f"failed), {before['n']} before; p50 {before['p50']:.3f} -> {during['p50']:.3f} s",
        f"honest, a kept connection: {during['kept_n']} requests during ({during['kept_failed']} "
        f"failed); p50 {before['kept_p50']:.3f} -> {during['kept_p50']:.3f} s, p99 "
        f"{before['kept_p99']:.3f} -> {during['kept_p99']:.3f} s",
        f"answered afterwards in {after_s:.3f} s" if answered_after else "no answer afterwards",
        f"server: log grew {log_growth:,} bytes during the attack; peak open descriptors "
        f"{peak['fds']:,}",
    ]
    return AttackRow(
        attack=ATTACK_TEXT[attack].format(connections=connections),
        metric="p99 s",
        before=before["p99"],
        during=p99,
        peak_rss_mb=peak["rss"] / 2**20,
        rss_bound_mb=0.0,
        same_output=same,
        passed=p99 < 1.0 and answered_after and same and refused,
        goal=GOAL,
        notes=notes,
    )


def http_soak(model_dir, seconds: float, every: float, connections: int = 5000) -> bool:
    """Every HTTP attack at once (slowloris with `connections`) against one server for
    `seconds` while the two honest clients keep sending; every `every` seconds a line: the
    server's RSS and descriptors, its log's size, the honest p99s in the interval and whether
    every answer was the unattacked text (growth without bound shows as a column that keeps
    climbing).  True if every interval met the goal and the server answered afterwards."""
    raise_fd_limit()
    ctx = multiprocessing.get_context("spawn")
    stop, report = ctx.Event(), ctx.Queue()
    with Server(model_dir) as server:
        want, _ = server.normal()
        procs = [
            proc
            for attack in ATTACKS
            for proc in _attackers(ctx, attack, server.port, stop, report, connections)
        ]
        for proc in procs:
            proc.start()
        print(f"== HTTP soak: {len(ATTACKS)} attacks at once for {seconds:.0f} s "
              f"(slowloris {connections} connections)")  # fmt: skip
        print(f"   {'t s':>6} {'RSS MiB':>8} {'peak':>6} {'fds':>7} {'log KB':>8} "
              f"{'p99 new':>8} {'p99 kept':>9} {'requests':>9}  same")  # fmt: skip
        t0, ok = time.monotonic(), True
        try:
            while time.monotonic() - t0 < seconds:
                with server.sampler() as peak:
                    during = server.honest_for(min(every, seconds - (time.monotonic() - t0)))
                same = all(t == want for t in during["texts"])
                ok &= same and max(during["p99"], during["kept_p99"]) < 1.0
                print(f"   {time.monotonic() - t0:>6.0f} {_rss(server.proc.pid) / 2**20:>8.0f} "
                      f"{peak['rss'] / 2**20:>6.0f} {peak['fds']:>7,} "
                      f"{server.log_size() / 1e3:>8.0f} {during['p99']:>8.3f} "
                      f"{during['kept_p99']:>9.3f} {during['n'] + during['kept_n']:>9}  "
                      f"{'yes' if same else 'NO'}", flush=True)  # fmt: skip
        finally:
            reports = _stopped(procs, stop, report)
        after_text, after_s = server.normal(timeout=10)
        print(f"   attackers: {_merged(reports)}")
        print(f"   answered afterwards: {after_text == want} ({after_s:.3f} s)")
        return ok and after_text == want


ATTACK_TEXT = {
    "big-prompts": "serve: 3 clients posting 3.9 MB prompts in a loop",
    "slowloris": "serve: slowloris, {connections} half-open connections",
    "nested-json": "serve: 3 clients posting JSON nested 100,000 deep in a loop",
    "unauthenticated-scrape": "serve --api-key: 3 clients scraping /metrics, /health without it",
}


# -- the server and the honest client ---------------------------------------------------------


class Server:
    """`moeshard serve MODEL --api-key KEY` on a free loopback port, its log in a file."""

    def __init__(self, model_dir, server_src: str | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.kept: http.client.HTTPConnection | None = None  # the honest client's kept one
        self.log = tempfile.NamedTemporaryFile("w+", prefix="moeshard-serve-", suffix=".log")
        env, cwd = dict(os.environ), None
        if server_src:
            cwd = str(Path(server_src).resolve())
            env["PYTHONPATH"] = cwd + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moeshard", "serve", str(Path(model_dir).resolve()),
             "--port", str(self.port), "--name", "demo", "--api-key", KEY],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
        )  # fmt: skip

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise MoeshardError(f"the server stopped: {self.log.read()[-800:]}")
            if _get(self.port, "/health", KEY, 1.0)[0] in (200, 401):
                return self
            time.sleep(0.2)
        raise MoeshardError("the server did not answer /health within 300 s")

    def __exit__(self, *exc) -> None:
        if self.kept is not None:
            self.kept.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def max_connections(self) -> int:
        """The server's cap on connections, as its start-up line says ("connections N")."""
        self.log.seek(0)
        found = re.search(r"connections (\d+)", self.log.read())
        if found is None:
            raise MoeshardError("the server's start-up line names no cap on connections")
        return int(found.group(1))

    def log_size(self) -> int:
        return os.fstat(self.log.fileno()).st_size

    def normal(self, timeout: float = TIMEOUT, keep: bool = False) -> tuple[str | None, float]:
        """A normal request: its text (None: no answer) and seconds; on a new connection, or
        (`keep`) on the one kept open from the last such request, as a client with a
        connection pool sends it (a new one if there is none or it failed)."""
        body = json.dumps(
            {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        ).encode()
        t0 = time.perf_counter()
        conn = self.kept if keep and self.kept is not None else None
        self.kept = None
        try:
            conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            conn.request("POST", "/v1/completions", body, _headers(KEY))
            r = conn.getresponse()
            answer = json.loads(r.read())
            text = answer["choices"][0]["text"] if r.status == 200 else None
            if keep and text is not None:
                self.kept, conn = conn, None
        except (OSError, ValueError, KeyError, http.client.HTTPException):
            text = None
        finally:
            if conn is not None:
                conn.close()
        return text, time.perf_counter() - t0

    def honest_for(self, seconds: float) -> dict:
        """Normal requests back to back for `seconds` from two honest clients at once, one on
        a new connection each time, one on a kept one (taking turns, a kept connection would
        idle past the server's keep-alive timeout while the other waits): their texts, and
        latency percentiles of each (a failed request counts as TIMEOUT seconds)."""
        texts, times, failed = [], {False: [], True: []}, {False: 0, True: 0}
        end = time.monotonic() + seconds

        def client(keep: bool) -> None:
            while time.monotonic() < end:
                text, took = self.normal(keep=keep)
                if text is None:
                    failed[keep], took = failed[keep] + 1, max(took, TIMEOUT)
                texts.append(text)
                times[keep].append(took)

        threads = [threading.Thread(target=client, args=(keep,)) for keep in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for kind in times.values():
            kind.sort()
        new, kept = times[False], times[True]
        return {"texts": texts, "n": len(new), "failed": failed[False], "p50": _pct(new, 50),
                "p99": _pct(new, 99), "kept_n": len(kept), "kept_failed": failed[True],
                "kept_p50": _pct(kept, 50), "kept_p99": _pct(kept, 99)}  # fmt: skip

    def sampler(self):
        """A context in which the server process's RSS and open descriptors are sampled
        every 0.1 s: yields {"rss": peak bytes, "fds": peak descriptors}."""
        from contextlib import contextmanager

        pid = self.proc.pid

        @contextmanager
        def sampling():
            peak, done = {"rss": _rss(pid), "fds": _fds(pid)}, threading.Event()

            def sample() -> None:
                while not done.wait(0.1):
                    peak["rss"] = max(peak["rss"], _rss(pid))
                    peak["fds"] = max(peak["fds"], _fds(pid))

            t = threading.Thread(target=sample, daemon=True)
            t.start()
            try:
                yield peak
            finally:
                done.set()
                t.join()

        return sampling()


def _pct(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values))) - 1))
    return sorted_values[rank]


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _merged(reports: list[dict]) -> str:
    """The attacker processes' reports as one line (slowloris' counts summed)."""
    counts: dict[str, int] = {}
    notes = []
    for r in reports:
        for k, v in r.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + v
        if "note" in r:
            notes.append(r["note"])
    if counts:
        notes.insert(0, ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in counts.items()))
    return "; ".join(notes)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m moeshard.bench.attack_http", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
