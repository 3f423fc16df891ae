"""One-way latency per coordinator<->node hop: tc netem, or a delay relay where the kernel
has no netem (`moeshard.bench.delay_relay`, one in each node namespace)."""

from __future__ import annotations

import subprocess
import sys
import time

from .bed import NODES, PORT, RELAY_PORT, REPO, Bed, run


def netem_available(bed: Bed) -> bool:
    r = subprocess.run(
        ["ip", "netns", "exec", bed.ns("x"), "tc", "qdisc", "add", "dev", "eth0", "root"]
        + ["netem", "delay", "1ms"],
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        subprocess.run(["tc", "-n", bed.ns("x"), "qdisc", "del", "dev", "eth0", "root"])
        return True
    return False


def set_delay(bed: Bed, ms: float | None) -> None:
    """One-way delay `ms` on every coordinator<->node hop (None: remove it).

    netem: a delay qdisc on the egress of every namespace's veth (request delayed leaving the
    coordinator, reply leaving the node: RTT +2*ms). Relay: in each node namespace an nftables
    redirect sends the node port to a relay that holds each chunk `ms` in each direction (the
    same RTT +2*ms, applied to gRPC bytes; multicast is not delayed)."""
    hosts = ("coord", *NODES)
    if bed.delay_mode == "none":
        return
    if bed.delay_mode == "netem":
        for host in hosts:
            subprocess.run(
                ["tc", "-n", bed.ns(host), "qdisc", "del", "dev", "eth0", "root"],
                capture_output=True,
            )
            if ms is not None:
                run(
                    ["tc", "-n", bed.ns(host), "qdisc", "add", "dev", "eth0", "root"]
                    + ["netem", "delay", f"{ms}ms"]
                )
        return
    for host in NODES:
        bed.stop(f"relay-{host}")
        subprocess.run(
            bed.nsexec(host, ["nft", "delete", "table", "ip", "moeshard_testbed"]),
            capture_output=True,
        )
        if ms is None:
            continue
        target = f"{bed.addr(host)}:{PORT}"
        argv = [
            sys.executable,
            "-m",
            "moeshard.bench.delay_relay",
            str(RELAY_PORT),
            target,
            str(ms),
        ]
        relay_log = open(bed.work / f"relay-{host}.log", "ab")  # noqa: SIM115
        bed.procs[f"relay-{host}"] = subprocess.Popen(
            bed.nsexec(host, argv), cwd=REPO, stdout=relay_log, stderr=subprocess.STDOUT
        )
        rules = (
            "table ip moeshard_testbed {\n"
            " chain pre { type nat hook prerouting priority -100;\n"
            f"  ip daddr {bed.addr(host)} tcp dport {PORT} redirect to :{RELAY_PORT}\n }}\n"
            "}\n"
        )
        run(bed.nsexec(host, ["nft", "-f", "-"]), input=rules)
    time.sleep(0.5)  # relays listening
