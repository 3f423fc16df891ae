"""Nodes at home behind NATs, found and reached through the wide-area registry (root).

Network namespaces, nothing leaves the machine (no uplink):

    msp-pub   a "public" segment 11.0.0.0/24 on a bridge: the bootstrap/relay peer at
              11.0.0.1; four plain DHT peers at 11.0.0.2-5 (a peer behind a NAT trusts its
              observed public address only once several peers report it); two peers serving
              a forged and an expired record for the model
    msp-ra    home A's router: WAN 11.0.0.11, LANs 192.168.1.0/24 (msp-a1) and 192.168.2.0/24
              (msp-ac); masquerade on the WAN keeping source ports, unsolicited inbound WAN
              packets dropped (as a home router does: no port forward, no UPnP)
    msp-rb    home B's router: WAN 11.0.0.12, LAN 192.168.3.0/24 (msp-b1); the same rules
    msp-rc    home C's router: WAN 11.0.0.13, LAN 192.168.4.0/24 (msp-c1); a random port per
              connection (a "symmetric" NAT: no hole punch gets through)
    msp-a1, msp-b1, msp-c1   a node in each home
    msp-ac    the coordinator, in home A

(11.0.0.0/24, not a TEST-NET range: go-libp2p ignores those as public addresses.) The
scenario: the nodes join through `--bootstrap` only (no zeroconf crosses a NAT); the
coordinator finds them by model id, ignoring the forged and the expired record, and generates
the single-process tokens; a1 is reached over plain TCP (its record's LAN address, through
home A's router), b1 hole-punched, c1 through the bootstrap peer's relay. `bench p2p` times
each path. Then home B's WAN link drops and comes back: the node gets its relay slot back and
re-signs its record, and a new coordinator finds and uses it again. Prints one line per check
and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "qwen3_moe"
P = "msp"
MOESHARD = [sys.executable, "-m", "moeshard"]
BOOT_IP = "11.0.0.1"
NODE_PORT = 7070
HOMES = {  # router -> (WAN address, [(host, LAN prefix)], its NAT's port mapping)
    "ra": ("11.0.0.11", [("a1", "192.168.1"), ("ac", "192.168.2")], "masquerade"),
    "rb": ("11.0.0.12", [("b1", "192.168.3")], "masquerade"),
    "rc": ("11.0.0.13", [("c1", "192.168.4")], "masquerade fully-random"),
}
NODES = {"a1": "node-00", "b1": "node-01", "c1": "node-02"}  # host -> its shard
# Peers on the public segment besides the bootstrap peer (DHT servers, nothing else): a node
# learns its public address only once several peers at distinct addresses have seen it
# (go-libp2p's observed-address threshold), and a hole punch needs it.
OBSERVERS = [f"11.0.0.{k}" for k in range(2, 6)]
ROUTER_RULES = """
table ip msp_nat {
  chain post {
    type nat hook postrouting priority 100;
    oifname "wan" MAPPING
  }
}
table inet msp_filter {
  chain forward_wan {
    type filter hook forward priority 0; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" drop
  }
  chain input_wan {
    type filter hook input priority 0; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" drop
  }
}
"""


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def ns(host: str) -> str:
    return f"{P}-{host}"


def nsx(host: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns(host), *argv]


def teardown() -> None:
    for name in sh("ip", "netns", "list").stdout.split():
        if name.startswith(f"{P}-"):
            pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                sh("kill", "-KILL", pid, check=False)
            sh("ip", "netns", "del", name, check=False)


def build() -> None:
    teardown()
    hosts = [h for router, (_, lans, _) in HOMES.items() for h in [router, *(n for n, _ in lans)]]
    for host in ["pub", *hosts]:
        sh("ip", "netns", "add", ns(host))
        sh(*nsx(host, "ip", "link", "set", "lo", "up"))
    sh(*nsx("pub", "ip", "link", "add", "name", "pubbr", "type", "bridge"))
    for ip in [BOOT_IP, *OBSERVERS]:
        sh(*nsx("pub", "ip", "addr", "add", f"{ip}/24", "dev", "pubbr"))
    sh(*nsx("pub", "ip", "link", "set", "pubbr", "up"))
    for router, (wan, lans, mapping) in HOMES.items():
        sh("ip", "link", "add", "wan", "netns", ns(router), "type", "veth", "peer", "name",
           f"{router}-up", "netns", ns("pub"))  # fmt: skip
        sh(*nsx("pub", "ip", "link", "set", f"{router}-up", "master", "pubbr", "up"))
        sh(*nsx(router, "ip", "addr", "add", f"{wan}/24", "dev", "wan"))
        sh(*nsx(router, "ip", "link", "set", "wan", "up"))
        sh(*nsx(router, "sysctl", "-qw", "net.ipv4.ip_forward=1"))
        for host, prefix in lans:
            sh("ip", "link", "add", f"lan-{host}", "netns", ns(router), "type", "veth", "peer",
               "name", "eth0", "netns", ns(host))  # fmt: skip
            sh(*nsx(router, "ip", "addr", "add", f"{prefix}.1/24", "dev", f"lan-{host}"))
            sh(*nsx(router, "ip", "link", "set", f"lan-{host}", "up"))
            sh(*nsx(host, "ip", "addr", "add", f"{prefix}.2/24", "dev", "eth0"))
            sh(*nsx(host, "ip", "link", "set", "eth0", "up"))
            sh(*nsx(host, "ip", "route", "add", "default", "via", f"{prefix}.1"))
        sh(*nsx(router, "nft", "-f", "-"), input=ROUTER_RULES.replace("MAPPING", mapping))


class Procs:
    def __init__(self, work: Path):
        self.work, self.procs = work, {}

    def start(self, name: str, host: str, argv: list[str]) -> Path:
        log = self.work / f"{name}.log"
        out = open(log, "ab")  # noqa: SIM115 (kept open for the process's lifetime)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs[name] = subprocess.Popen(
            nsx(host, *argv), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        return log

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_for(log: Path, pattern: str, timeout: float) -> re.Match:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        time.sleep(0.2)
    raise RuntimeError(
        f"{log.name}: no {pattern!r} within {timeout:g} s:\n{log.read_text()[-2000:]}"
    )


def observe(bootstrap: str) -> int:
    """(`--observe ADDR`, in msp-pub) DHT servers at OBSERVERS, known to the bootstrap peer,
    until SIGTERM."""
    import signal
    import threading

    sys.path.insert(0, str(REPO))
    from moeshard.moe.p2p.daemon import P2PDaemon, hub_args

    hub_id, hub_addr = bootstrap.rsplit("/p2p/", 1)[1], bootstrap.rsplit("/p2p/", 1)[0]
    daemons = [P2PDaemon(hub_args([f"/ip4/{ip}/tcp/4001", f"/ip4/{ip}/udp/4001/quic-v1"]))
               for ip in OBSERVERS]  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for d in daemons:  # in the bootstrap peer's routing table: the DHT hands them out
            d.control.connect(hub_id, [hub_addr])
        print(f"{len(daemons)} observers up", flush=True)
        stop.wait()
    finally:
        for d in daemons:
            d.close()
    return 0


def forge(bootstrap: str, model_id: str, work: Path) -> int:
    """(`--forge ADDR MODEL_ID`, in msp-pub) two peers that provide the model's registry key
    and serve records a reader must ignore: one changed after signing, one expired; until
    SIGTERM."""
    import signal
    import threading

    sys.path.insert(0, str(REPO))
    from moeshard.moe.identity.keys import generate as make_key
    from moeshard.moe.identity.signed import sign_announcement
    from moeshard.moe.p2p.daemon import P2PDaemon, peer_args
    from moeshard.moe.p2p.registry import RECORD_PROTOCOL, registry_key, write_record
    from moeshard.moe.p2p.tunnel import Inbound

    fields = {"name": "forger", "model_id": model_id, "fmt": "2", "wire": "1", "records": "1"}
    key = make_key(work / "forger.pem")
    made = {
        "forged": lambda p2p: dict(sign_announcement(key, dict(fields, p2p=p2p)), records="99"),
        "expired": lambda p2p: sign_announcement(
            key, dict(fields, p2p=p2p), now=time.time() - 600, ttl_s=120
        ),
    }
    daemons, inbound = [], []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for kind, make in made.items():
            d = P2PDaemon(peer_args([f"/ip4/{BOOT_IP}/tcp/0"], [bootstrap]))
            record = make(d.peer_id)

            def serve(sock, _peer, record=record):
                write_record(sock, record)
                sock.settimeout(5)
                try:
                    while sock.recv(64):  # the reader closes first
                        pass
                finally:
                    sock.close()

            inbound.append(Inbound(d.control, RECORD_PROTOCOL, serve=serve))
            daemons.append(d)
            for _ in range(100):  # until the DHT takes the provider record
                try:
                    d.control.provide(registry_key(model_id))
                    break
                except Exception:  # noqa: BLE001 (the daemon's error: no DHT peer yet)
                    time.sleep(0.2)
            print(f"{kind} {d.peer_id}", flush=True)
        print("forgers up", flush=True)
        stop.wait()
    finally:
        for i in inbound:
            i.close()
        for d in daemons:
            d.close()
    return 0


def generate(work, coordinator, bootstrap: str, prompt: str, tokens: int, tag: str, wait=30):
    """A coordinator in home A: (its JSON result or None, its stderr)."""
    argv = [*MOESHARD, "-v", "generate", str(coordinator), "--bootstrap", bootstrap]
    argv += ["--expect", str(len(NODES))]
    argv += ["--discover-timeout", str(wait), "--deadline", "5"]
    argv += ["--prompt-ids", prompt, "--max-tokens", str(tokens)]
    r = subprocess.run(nsx("ac", *argv, "--json"), cwd=REPO, capture_output=True, text=True)
    (work / f"coord-{tag}.log").write_text(r.stderr)
    if r.returncode:
        return None, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(FIXTURE), help="Hugging Face checkpoint to convert")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--iters", type=int, default=300, help="calls per path in bench p2p")
    p.add_argument("--work", help="work directory (default: a temporary one)")
    p.add_argument("--observe", metavar="ADDR", help=argparse.SUPPRESS)  # (the observers)
    p.add_argument("--forge", nargs=2, metavar=("ADDR", "MODEL_ID"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.observe:
        return observe(args.observe)
    if args.forge:
        return forge(*args.forge, Path(args.work or tempfile.mkdtemp()))
    if os.geteuid():
        print("p2p testbed: needs root (network namespaces)", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="moeshard-p2p-testbed-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["MOESHARD_HOME"] = str(work / "home")
    sh(*MOESHARD, "bootstrap", "--fetch-only", cwd=REPO)  # the daemon binary, before timing
    model = work / "model"
    sh(*MOESHARD, "convert", args.model, str(model), "--force", "--quiet", cwd=REPO)
    sh(*MOESHARD, "shard", str(model), "--nodes", str(len(NODES)), "--replicas", "1", "--out",
       str(work / "shards"), "--force", cwd=REPO)  # fmt: skip
    prompt = "1,2,3,4,5,6,7,8"
    ref = sh(*MOESHARD, "generate", str(model), "--prompt-ids", prompt, "--max-tokens",
             str(args.tokens), "--json", cwd=REPO)  # fmt: skip
    want = json.loads(ref.stdout.strip().splitlines()[-1])["tokens"]
    checks: list[tuple[str, bool, str]] = []
    procs = Procs(work)
    try:
        build()
        boot = procs.start("bootstrap", "pub", [*MOESHARD, "-v", "bootstrap", "--listen",
                           f"/ip4/{BOOT_IP}/tcp/4001,/ip4/{BOOT_IP}/udp/4001/quic-v1"])  # fmt: skip
        addr = wait_for(boot, r"--bootstrap (/ip4/11\.0\.0\.1/tcp/4001/p2p/\w+)", 30).group(1)
        observers = procs.start("observers", "pub", [sys.executable, __file__, "--observe", addr])
        wait_for(observers, r"observers up", 30)
        model_id = json.loads((model / "moeshard.json").read_text())["model_id"]
        forgers = procs.start("forgers", "pub", [sys.executable, __file__, "--forge", addr,
                              model_id, "--work", str(work)])  # fmt: skip
        wait_for(forgers, r"forgers up", 60)
        forged = dict(re.findall(r"^(forged|expired) (\w+)$", forgers.read_text(), re.M))
        nodes = {}
        for host, shard in NODES.items():
            nodes[host] = procs.start(f"node-{host}", host, [*MOESHARD, "-v", "node",
                str(work / "shards" / shard), "--allow-any", "--no-advertise", "--bootstrap",
                addr, "--host", "0.0.0.0", "--port", str(NODE_PORT), "--name", host])  # fmt: skip
        for host, log in nodes.items():
            m = wait_for(log, r"behind a NAT, reachable through relays: (\S+)", 90)
            checks.append((f"{host}: learns it is behind a NAT, advertises a relayed address",
                           True, m.group(1)[:60] + "..."))  # fmt: skip
        coordinator = work / "shards" / "coordinator"
        result, err = generate(work, coordinator, addr, prompt, args.tokens, "first")
        ok = result is not None and result["tokens"] == want
        paths = result["stats"].get("p2p_paths", {}) if result else {}
        checks.append(("coordinator in home A finds the three nodes through --bootstrap only, "
                       "same tokens as one process", ok and len(paths) == len(NODES),
                       f"paths {paths}" if result else err.strip().splitlines()[-1]))  # fmt: skip
        by_host = {name.split()[0]: path for name, path in paths.items()}
        ignored = {kind: re.search(rf"ignored the record of {peer}: ([^\n]*)", err)
                   for kind, peer in forged.items()}  # fmt: skip
        checks.append(("a forged and an expired record in the registry are ignored",
                       result is not None and all(ignored.values()),
                       "; ".join(f"{k}: {m.group(1) if m else 'NOT ignored'}"
                                 for k, m in ignored.items())))  # fmt: skip
        want_paths = {"a1": "tcp", "b1": "direct", "c1": "relayed"}
        checks.append(("the paths: a1 (same home) over TCP, b1 hole-punched through two "
                       "port-preserving NATs, c1 (random-port NAT) relayed",
                       by_host == want_paths, str(by_host)))  # fmt: skip
        # per-call cost of each path: a1 over TCP across home A's LAN (the baseline), and
        # every node through the registry on the path it settled on
        a1_id = wait_for(nodes["a1"], r" id (\w+) serving", 5).group(1)
        # a node with a public address, for the direct p2p path (a copy of a1's shard): its
        # gRPC port on loopback only, as a node whose router maps just its daemon's port
        # (a1 is reached over plain TCP: home A's router routes between its two LANs)
        public = procs.start("node-p1", "pub", [*MOESHARD, "node", str(work / "shards" /
            "node-00"), "--allow-any", "--no-advertise", "--bootstrap", addr, "--name", "p1",
            "--key", str(work / "p1.pem")])  # fmt: skip
        wait_for(public, r"p2p: peer", 60)
        bench = subprocess.run(nsx("ac", *MOESHARD, "bench", "p2p", str(coordinator),
            "--bootstrap", addr, "--tcp", f"{a1_id}@{HOMES['ra'][1][0][1]}.2:{NODE_PORT}",
            "--expect", str(len(NODES) + 1), "--iters", str(args.iters)), cwd=REPO,
            capture_output=True,
            text=True)  # fmt: skip
        procs.stop("node-p1")
        (work / "bench-p2p.log").write_text(bench.stdout + bench.stderr)
        print(bench.stdout, end="")
        rows = re.findall(r"p2p to (\w+)\s+(\w+)\s+(FAILED|[\d.]+ ms)", bench.stdout)
        relayed = [name for name, path, ms in rows if path == "relayed" and ms != "FAILED"]
        seen = ", ".join(f"{n} {p} {m}" for n, p, m in rows) or bench.stderr[-160:]
        checks.append(("bench p2p: every path carries its calls (relayed ones through the "
                       "bootstrap peer's relay, far past the daemon circuit's 128 KiB)",
                       bool(rows) and "FAILED" not in bench.stdout and "c1" in relayed,
                       seen))  # fmt: skip
        # home B's NAT drops: its WAN link goes down and the router forgets every mapping (a
        # router reboot); the relay's connection to the node is dead, then the link returns
        sh(*nsx("rb", "ip", "link", "set", "wan", "down"))
        if shutil.which("conntrack"):
            sh(*nsx("rb", "conntrack", "-F"), check=False)
        result, err = generate(work, coordinator, addr, prompt, args.tokens, "during-drop", 10)
        checks.append(("while home B is cut off, its node's experts cannot be reached",
                       result is None, (err.strip().splitlines() or ["?"])[-1][:160]))  # fmt: skip
        sh(*nsx("rb", "ip", "link", "set", "wan", "up"))
        t0 = time.monotonic()
        for attempt in range(6):  # until the node has its relay slot back and is re-announced
            result, err = generate(work, coordinator, addr, prompt, args.tokens, f"after-{attempt}")
            if result is not None:
                break
        nodes_line = re.search(r"\[nodes: ([^;\]]*)", err)
        calls = dict(re.findall(r"(\S+) (\d+) calls", nodes_line.group(1) if nodes_line else ""))
        ok = (
            result is not None
            and result["tokens"] == want
            and all(int(c) > 0 for c in calls.values())
        )
        detail = (f"back after {time.monotonic() - t0:.0f} s; "
                  + ", ".join(f"{n} {c} calls" for n, c in calls.items())) if result else (
                  err.strip().splitlines() or ["?"])[-1][:160]  # fmt: skip
        checks.append(("the link returns: the node rejoins, a new coordinator uses it again, "
                       "same tokens", ok, detail))  # fmt: skip
    finally:
        procs.stop_all()
        teardown()
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    passed = bool(checks) and all(ok for _, ok, _ in checks)
    if passed and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    kept = "" if passed and not args.work else f"; logs in {work}"
    print(f"p2p testbed: {sum(ok for _, ok, _ in checks)}/{len(checks)} passed{kept}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
