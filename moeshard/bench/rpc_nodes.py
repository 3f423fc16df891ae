"""The node processes of `moeshard bench rpc`: real `moeshard node` daemons on loopback ports.

A node serves plaintext (`--insecure`) or mutual TLS (`--allow` the bench's own client key,
made in its temporary directory). Every node prints `node NAME id ID serving ... on HOST:PORT`
first; its address and id become the PeerSpec a client dials (the id is pinned over TLS).
Nodes are launched together and waited for afterwards, so they start in parallel.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

from moeshard.coordinator.remote.transport import PeerSpec
from moeshard.moe.convert.placement import shard_model
from moeshard.moe.identity.keys import Identity, generate

SERVING = re.compile(r" id (?P<id>[a-z2-7]{26}) serving .* on (?P<addr>\S+)")
START_TIMEOUT_S = 180


def layouts_for(model: Path, n: int, tmp: Path) -> dict[int, list[Path]]:
    """Node directories for 1, 2 and n nodes: the model itself, then shard splits of it in
    `tmp` (2 replicas of every expert beyond 2 nodes)."""
    layouts: dict[int, list[Path]] = {1: [Path(model)]}
    for k in sorted({min(2, n), n} - {1}):
        plan = shard_model(model, k, min(2, k) if k > 2 else 1, tmp / f"n{k}")
        layouts[k] = [Path(node["dir"]) for node in plan["nodes"]]
    return layouts


def client_key(tmp: Path) -> Identity:
    """A fresh client identity for the TLS nodes to --allow (kept in the bench's tmp dir)."""
    return generate(Path(tmp) / "bench-client-key.pem")


class Launched:
    """A node process that was started; spec() waits until it serves."""

    def __init__(self, proc: subprocess.Popen, path: Path, log: Path, tls: bool):
        self.proc, self.path, self.log, self.tls = proc, path, log, tls
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:  # keep reading so the node never blocks on a full pipe
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def spec(self) -> PeerSpec:
        """Its address, and its id when it serves TLS (pinned by whoever dials it)."""
        while True:
            line = self.lines.get(timeout=START_TIMEOUT_S)
            match = SERVING.search(line)
            if match:
                if self.tls != ("(TLS)" in line):
                    raise RuntimeError(f"node on {self.path} does not serve as asked: {line}")
                return PeerSpec(match["addr"], match["id"] if self.tls else "")
            if not line:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
                detail = "".join(f"\n  {t}" for t in tail)
                raise RuntimeError(f"node on {self.path} exited with {self.proc.wait()}{detail}")


def serving(launched: dict[int, list[Launched]]) -> dict[int, list[PeerSpec]]:
    """Waits for every launched node of every layout; their PeerSpecs."""
    return {k: [node.spec() for node in nodes] for k, nodes in launched.items()}


class NodeProcs:
    """The bench's node subprocesses (stderr logged in `log_dir`); close() stops them all."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []

    def launch(
        self,
        path: Path,
        allow: Identity | None,
        env: dict | None = None,
        flags: tuple = (),
        allow_any: bool = False,
        prefix: list[str] | None = None,
    ) -> Launched:
        """A node on `path`: TLS serving only `allow`'s key (any client's with `allow_any`), or
        plaintext without either; `env`: more environment (`bench audit`'s liar has its
        failpoints there); `flags`: more options (a `--key` of its own for a second node on
        one directory); `prefix`: a command the node runs under (`taskset -c 1`)."""
        cmd = [*(prefix or []), sys.executable, "-m", "moeshard", "node", str(path)]
        cmd += ["--no-advertise", *flags]
        if allow_any:
            cmd += ["--allow-any"]
        else:
            cmd += ["--insecure"] if allow is None else ["--allow", allow.id]
        log = self.log_dir / f"node-{len(self.procs)}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, **(env or {})},
            )
        self.procs.append(proc)
        return Launched(proc, Path(path), log, tls=allow is not None or allow_any)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait()
