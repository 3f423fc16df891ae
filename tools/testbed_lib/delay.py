"""One-way latency per coordinator<->node hop: tc netem, or a delay relay where the kernel
has no netem. The relay runs as `testbed.py --delay-relay PORT TARGET MS` in a node namespace."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from .bed import NODES, PORT, RELAY_PORT, Bed, run

# the entry point the relay is started as (testbed.py re-executed with --delay-relay)
SCRIPT = str(Path(__file__).resolve().parent.parent / "testbed.py")


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
        argv = [sys.executable, SCRIPT, "--delay-relay", str(RELAY_PORT), target, str(ms)]
        relay_log = open(bed.work / f"relay-{host}.log", "ab")  # noqa: SIM115
        bed.procs[f"relay-{host}"] = subprocess.Popen(
            bed.nsexec(host, argv), stdout=relay_log, stderr=subprocess.STDOUT
        )
        rules = (
            "table ip moeshard_testbed {\n"
            " chain pre { type nat hook prerouting priority -100;\n"
            f"  ip daddr {bed.addr(host)} tcp dport {PORT} redirect to :{RELAY_PORT}\n }}\n"
            "}\n"
        )
        run(bed.nsexec(host, ["nft", "-f", "-"]), input=rules)
    time.sleep(0.5)  # relays listening


async def _relay(listen_port: int, target: str, delay_s: float) -> None:
    host, port = target.rsplit(":", 1)

    async def pump(reader, writer) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(deliver())
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(1 << 16):
                await queue.put((loop.time() + delay_s, data))
        except ConnectionError:
            pass
        await queue.put((0.0, None))
        await sender

    async def handle(reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True
        )

    server = await asyncio.start_server(handle, "0.0.0.0", listen_port)
    async with server:
        await server.serve_forever()
