"""The testbed's namespaces and processes: node daemons, the coordinator, shell-outs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "qwen3_moe"
NODES = ("n1", "n2", "n3")
PORT = 50051
RELAY_PORT = 50061
MOESHARD = [sys.executable, "-m", "moeshard"]


def log(msg: str) -> None:
    print(f"[testbed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Bed:
    prefix: str
    subnet: str
    work: Path
    deadline: float
    discover_timeout: float
    client: str  # the coordinator's key id: the one client the nodes allow
    procs: dict = field(default_factory=dict)  # name -> Popen
    logs: dict = field(default_factory=dict)  # name -> log path
    delay_mode: str = ""
    coordinators: int = 0  # generate processes started so far

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        octet = {"coord": 1, "n1": 11, "n2": 12, "n3": 13, "x": 21}[host]
        return f"{self.subnet}.{octet}"

    def nsexec(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    # -- processes --------------------------------------------------------------------------

    def start_node(
        self, host: str, shard_dir: Path, node_id: str, extra=(), env: dict | None = None
    ) -> None:
        """A node daemon named `node_id` (its id proper is its key's, kept in `shard_dir`
        unless `extra` gives --key); `env`: more environment (a liar's failpoints)."""
        path = self.work / f"node-{node_id}.log"
        argv = [*MOESHARD, "node", str(shard_dir), "--host", self.addr(host), "--port", str(PORT)]
        argv += ["--name", node_id, "--allow", self.client, *extra]
        out = open(path, "ab")  # noqa: SIM115 (kept open for the daemon's lifetime)
        # `ip netns exec` execs the command, so the Popen pid is the daemon's own pid.
        self.procs[node_id] = subprocess.Popen(
            self.nsexec(host, argv),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, **(env or {})),
        )
        self.logs[node_id] = path

    def wait_healthy(self, host: str, timeout: float = 90.0) -> None:
        """grpc.health.v1 from the coordinator's namespace, across the bridge."""
        target = f"{self.addr(host)}:{PORT}"
        end = time.monotonic() + timeout
        while True:
            r = subprocess.run(
                self.nsexec("coord", [*MOESHARD, "health", target, "--timeout", "1"]),
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"{target} not SERVING after {timeout} s: {r.stdout.strip()}")
            time.sleep(0.5)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def wait_admitted(self, hosts, proc, timeout: float = 60.0) -> None:
        """Until the coordinator holds a TCP connection to every node in `hosts` (it connects
        right after discovery, just before the generation starts)."""
        end = time.monotonic() + timeout
        coord = self.addr("coord")
        while time.monotonic() < end and proc.poll() is None:
            pending = []
            for host in hosts:
                r = subprocess.run(
                    self.nsexec(host, ["ss", "-Htn", "state", "established", f"sport = :{PORT}"]),
                    capture_output=True,
                    text=True,
                )
                if coord not in r.stdout:
                    pending.append(host)
            if not pending:
                return
            time.sleep(0.1)
        if proc.poll() is not None:
            out, err = proc.communicate()
            tail = "\n".join(err.strip().splitlines()[-5:])
            raise RuntimeError(
                f"the generation ended (exit {proc.returncode}) before the coordinator was "
                f"seen connected to {','.join(hosts)}; its stderr ends:\n{tail}"
            )
        raise RuntimeError(f"the coordinator did not connect to {','.join(hosts)}")

    def busiest(self, hosts, window: float = 0.5) -> str:
        """The node host whose daemon used the most CPU over `window` s: the one the
        coordinator is sending work to right now (the one whose loss a layer call will feel)."""

        def cpu(host: str) -> int:
            stat = Path(f"/proc/{self.procs[f'tb-{host}'].pid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        before = {h: cpu(h) for h in hosts}
        time.sleep(window)
        return max(hosts, key=lambda h: cpu(h) - before[h])

    # -- the coordinator ------------------------------------------------------------------

    def generate(self, model: Path, prompt: str, max_tokens: int, remote: bool = True, extra=()):
        argv = [*MOESHARD, "generate", str(model), "--prompt-ids", prompt]
        argv += ["--max-tokens", str(max_tokens), "--json", *extra]
        if remote:
            argv += ["--discover", "--discover-timeout", str(self.discover_timeout)]
            argv += ["--deadline", str(self.deadline)]
            argv = self.nsexec("coord", argv)
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.coordinators += 1  # `finish` keeps its stderr here, for a failure's post-mortem
        proc.log_path = self.work / f"coord-{self.coordinators:02d}.log"
        proc.log_path.write_text(" ".join(argv) + "\n")
        return proc


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def convert(src: Path, out: Path, experts: str) -> str:
    r = run([*MOESHARD, "convert", str(src), str(out), "--force", "--quiet", "--experts", experts])
    m = re.search(r"model id ([0-9a-f]+)", r.stdout + r.stderr)
    return m.group(1) if m else "?"
