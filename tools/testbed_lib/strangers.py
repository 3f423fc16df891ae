"""Strangers across the bridge: a client no node allows, a wrong pin, plaintext to a TLS node,
and a forged zeroconf announcement. Each must be refused or ignored, and an honest generation
running beside the forged announcement must give the single-node tokens."""

from __future__ import annotations

import subprocess
import sys
import time

from .bed import MOESHARD, PORT, REPO, Bed, run
from .results import Result, check, finish, lines_with

# Run in a node namespace: announce a record that claims node `victim_id` with another key.
FORGER = """
import socket, sys, time
from pathlib import Path
from zeroconf import IPVersion, ServiceInfo, Zeroconf
from moeshard.moe.identity import keys, signed
from moeshard.moe.storage.manifest import FORMAT_VERSION
from moeshard.moe.wire.constants import SERVICE_TYPE
key_path, addr, victim_id, model_id = sys.argv[1:5]
liar = keys.load_or_create(key_path)
fields = {"name": "tb-forged", "model_id": model_id, "fmt": str(FORMAT_VERSION), "wire": "1",
          "digest": "0" * 8}
record = dict(signed.sign_announcement(liar, fields), node_id=victim_id)
info = ServiceInfo(SERVICE_TYPE, "tb-forged." + SERVICE_TYPE, addresses=[socket.inet_aton(addr)],
                   port=50051, properties=record, server="tb-forged.local.")
zc = Zeroconf(ip_version=IPVersion.V4Only)
zc.register_service(info)
print("announced", flush=True)
time.sleep(float(sys.argv[5]))
zc.unregister_service(info)
zc.close()
"""

PLAINTEXT = """
import sys, grpc
from moeshard.moe.wire import health_pb2, health_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError as exc:
        print(exc.code().name)
        sys.exit(0)
print("ANSWERED")
"""


def node_id_of(bed: Bed, name: str) -> str:
    """The key id a node printed on its first line ('node NAME id ID serving ...')."""
    for line in bed.logs[name].read_text().splitlines():
        if line.startswith(f"node {name} id "):
            return line.split(" id ")[1].split()[0]
    raise RuntimeError(f"{name} printed no id")


def coordinator(bed: Bed, argv: list[str]) -> subprocess.CompletedProcess:
    cmd = bed.nsexec("coord", [*MOESHARD, *argv])
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def strangers(bed: Bed, model, model_id: str, args, ref) -> list[Result]:
    results = []
    short = ["--prompt-ids", args.prompt_ids, "--max-tokens", "4"]
    # a. a coordinator whose key no node allows
    stranger = bed.work / "stranger.pem"
    if not stranger.exists():
        run([*MOESHARD, "keygen", str(stranger)])
    r = coordinator(
        bed,
        ["generate", str(model), *short, "--discover", "--key", str(stranger)]
        + ["--discover-timeout", str(bed.discover_timeout)],
    )
    refused = r.returncode == 2 and r.stderr.count("refused this client: PERMISSION_DENIED") >= 3
    results.append(
        Result(
            "client not on the allow list",
            refused,
            "refused by all 3 nodes (PERMISSION_DENIED), exit 2"
            if refused
            else f"exit {r.returncode}: {r.stderr.strip()[-200:]}",
        )
    )
    # b. n1's address pinned to n2's id
    n1, n2 = node_id_of(bed, "tb-n1"), node_id_of(bed, "tb-n2")
    target = f"{bed.addr('n1')}:{PORT}"
    r = coordinator(bed, ["generate", str(model), *short, "--peers", f"{n2}@{target}"])
    named = f"presents key {n1}, not the pinned {n2}" in r.stderr
    results.append(
        Result(
            "node with another key than pinned",
            r.returncode == 2 and named,
            "refused naming both ids, exit 2"
            if named
            else f"exit {r.returncode}: {r.stderr[-200:]}",
        )
    )
    # c. plaintext to a TLS node
    cmd = bed.nsexec("coord", [sys.executable, "-c", PLAINTEXT, target])
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    failed = r.returncode == 0 and r.stdout.strip() == "UNAVAILABLE"
    results.append(
        Result(
            "plaintext to a TLS node",
            failed,
            "handshake refused (UNAVAILABLE)"
            if failed
            else f"{r.stdout.strip()} {r.stderr[-200:]}",
        )
    )
    # d. a forged announcement (n1's id, another key, the foreign host's address) while an
    # honest generation discovers nodes: ignored with a warning, tokens unchanged
    forger = subprocess.Popen(
        bed.nsexec(
            "x",
            [sys.executable, "-c", FORGER, str(bed.work / "liar.pem"), bed.addr("x"), n1]
            + [model_id, "60"],
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if forger.stdout.readline().strip() != "announced":
            raise RuntimeError("the forged announcement did not start")
        time.sleep(1.0)
        result, err, _ = finish(bed.generate(model, args.prompt_ids, args.tokens))
    finally:
        forger.kill()
        forger.wait()
    warned = lines_with(err, "tb-forged", "forged announcement")
    results.append(
        check(
            "forged announcement",
            result,
            err,
            ref(args.tokens),
            bool(warned),
            "ignored with a warning" if warned else "NOT warned about",
        )
    )
    return results
