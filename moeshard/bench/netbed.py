"""Node namespaces for `moeshard bench swarm`: each node in its own network namespace, on a
bridge the benching process (the coordinator) sits on, with a round trip added per node.

    this process (root namespace, BRIDGE at SUBNET.1) ── veth ── namespace PREFIX-NN (SUBNET.10+NN)

Latency: this kernel may have no netem (`tc qdisc ... netem` is refused where sch_netem is not
built), so each node gets a delay relay in its namespace (`moeshard.bench.delay_relay`): an
nftables rule redirects the node's port to the relay, which forwards to the node holding each
chunk ONE_WAY ms each way. The round trip is measured, not assumed (`bench swarm` prints it).
Needs root (ip netns, nft); everything made is removed by `close()`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from moeshard.moe.errors import MoeshardError

NODE_PORT = 50051
RELAY_PORT = 50061
NFT_TABLE = "moeshard_bench"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise MoeshardError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def check_tools() -> None:
    """Root, `ip` and `nft`: one line naming what is missing."""
    import os

    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        why = f"missing {', '.join(missing)}" if missing else "not root"
        raise MoeshardError(f"bench swarm needs root, ip and nft (network namespaces): {why}")


class NetBed:
    def __init__(self, nodes: int, prefix: str, subnet: str, work: Path):
        if not 1 <= nodes <= 200:
            raise MoeshardError(f"{nodes} nodes: between 1 and 200")
        self.nodes, self.prefix, self.subnet, self.work = nodes, prefix, subnet, Path(work)
        self.bridge = f"{prefix}-br"
        self.relays: dict[int, subprocess.Popen] = {}
        self.made: list[str] = []  # namespaces made

    def ns(self, i: int) -> str:
        return f"{self.prefix}-{i:02d}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    @property
    def host_addr(self) -> str:
        return f"{self.subnet}.1"

    def prefix_cmd(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def create(self) -> None:
        self.close()  # what an interrupted earlier run left
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i in range(self.nodes):
            ns, veth = self.ns(i), f"{self.prefix}-v{i:02d}"
            _run(["ip", "netns", "add", ns])
            self.made.append(ns)
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def set_delay(self, i: int, one_way_ms: float) -> None:
        """Node i's round trip grows by 2 x one_way_ms (0: no relay)."""
        old = self.relays.pop(i, None)
        if old is not None:
            old.terminate()
            old.wait()
        subprocess.run(
            [*self.prefix_cmd(i), "nft", "delete", "table", "ip", NFT_TABLE], capture_output=True
        )
        if one_way_ms <= 0:
            return
        target = f"{self.addr(i)}:{NODE_PORT}"
        argv = [sys.executable, "-m", "moeshard.bench.delay_relay", str(RELAY_PORT), target]
        with open(self.work / f"relay-{i:02d}.log", "ab") as log:
            self.relays[i] = subprocess.Popen(
                [*self.prefix_cmd(i), *argv, str(one_way_ms)], stdout=log, stderr=log
            )
        rules = (
            f"table ip {NFT_TABLE} {{\n chain pre {{ type nat hook prerouting priority -100;\n"
            f"  ip daddr {self.addr(i)} tcp dport {NODE_PORT} redirect to :{RELAY_PORT}\n }}\n}}\n"
        )
        _run([*self.prefix_cmd(i), "nft", "-f", "-"], input=rules)

    def wait_relays(self, timeout: float = 30.0) -> None:
        """Until every relay accepts on its port (it starts a Python interpreter first)."""
        end = time.monotonic() + timeout
        for i, proc in self.relays.items():
            while True:
                if proc.poll() is not None:
                    raise MoeshardError(f"the delay relay of node {i} exited ({proc.returncode})")
                r = subprocess.run(
                    [*self.prefix_cmd(i), "ss", "-Htln", f"sport = :{RELAY_PORT}"],
                    capture_output=True,
                    text=True,
                )
                if str(RELAY_PORT) in r.stdout:
                    break
                if time.monotonic() > end:
                    raise MoeshardError(f"the delay relay of node {i} is not listening")
                time.sleep(0.1)

    def close(self) -> None:
        for proc in self.relays.values():
            proc.terminate()
        for proc in self.relays.values():
            proc.wait()
        self.relays.clear()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"{self.prefix}-"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.made.clear()
