"""Drive the network-namespace testbed built by tools/testbed.sh (run that, not this).

Inside namespaces PREFIX-coord, PREFIX-n1..n3 and PREFIX-x (one L2 bridge, 10.199.0.0/24):
converts the model (and a second conversion with another model id), `moeshard shard --nodes 3
--replicas 2`, starts a node daemon in each node namespace bound to its own address, and runs
`moeshard generate MODEL --discover` in the coordinator namespace (zeroconf across the bridge,
no peer list). Every scenario's tokens must equal the single-node output:

  discover           3 nodes found by zeroconf, output identical
  foreign model id   a 4th node serving another conversion is ignored (warning)
  latency 0/1/10 ms  one-way delay per hop (tc netem, or a delay relay where the kernel lacks
                     netem; see `delay_mode`), tokens/s at each
  link down/up       a node's switch port goes down mid-generation and comes back: banned,
                     then re-admitted within the same generation
  node SIGKILL       a node is killed mid-generation: its layer calls fail over to replicas
  new coordinator    a fresh coordinator after the kill: 2 of 3 nodes cover every expert
  node restart       the killed node restarts mid-generation: found by the coordinator's
                     running zeroconf browse (or its prober) and given work again

Prints a table (scenario, outcome, tokens/s, failovers) and exits 1 if any scenario failed.
`--delay-relay` is the internal entry point of the delay relay (one per node namespace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "qwen3_moe"
NODES = ("n1", "n2", "n3")
PORT = 50051
RELAY_PORT = 50061
MOESHARD = [sys.executable, "-m", "coordinator.cli"]


def log(msg: str) -> None:
    print(f"[testbed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Result:
    scenario: str
    ok: bool
    detail: str
    tokens_per_s: float | None = None
    failovers: int | None = None
    call_ms: float | None = None  # mean of the nodes' smoothed Forward round trips


@dataclass
class Bed:
    prefix: str
    subnet: str
    work: Path
    deadline: float
    discover_timeout: float
    procs: dict = field(default_factory=dict)  # name -> Popen
    logs: dict = field(default_factory=dict)  # name -> log path
    delay_mode: str = ""

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        octet = {"coord": 1, "n1": 11, "n2": 12, "n3": 13, "x": 21}[host]
        return f"{self.subnet}.{octet}"

    def nsexec(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    # -- processes --------------------------------------------------------------------------

    def start_node(self, host: str, shard_dir: Path, node_id: str) -> None:
        path = self.work / f"node-{node_id}.log"
        argv = [*MOESHARD, "node", str(shard_dir), "--host", self.addr(host), "--port", str(PORT)]
        argv += ["--node-id", node_id]
        out = open(path, "ab")  # noqa: SIM115 (kept open for the daemon's lifetime)
        # `ip netns exec` execs the command, so the Popen pid is the daemon's own pid.
        self.procs[node_id] = subprocess.Popen(
            self.nsexec(host, argv), cwd=REPO, stdout=out, stderr=subprocess.STDOUT
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

    def generate(self, model: Path, prompt: str, max_tokens: int, remote: bool = True):
        argv = [*MOESHARD, "generate", str(model), "--prompt-ids", prompt]
        argv += ["--max-tokens", str(max_tokens), "--json"]
        if remote:
            argv += ["--discover", "--discover-timeout", str(self.discover_timeout)]
            argv += ["--deadline", str(self.deadline)]
            argv = self.nsexec("coord", argv)
        return subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )


def finish(proc, timeout: float = 240.0) -> tuple[dict | None, str, float]:
    """(the JSON result or None, stderr, wall seconds) of a generate process."""
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += "\n[testbed: coordinator timed out]"
    wall = time.monotonic() - t0
    try:
        result = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (json.JSONDecodeError, IndexError):
        result = None
    return result, err, wall


def retries(stderr: str) -> int:
    m = re.search(r"(\d+) retried layer calls", stderr)
    return int(m.group(1)) if m else -1


def node_segments(stderr: str) -> list[str]:
    """The per-node parts of the coordinator's '[nodes: a N calls X ms, b ... DOWN; ...]'."""
    line = (lines_with(stderr, "[nodes:") or ["[nodes: ;"])[0]
    return [s.strip() for s in line.split("[nodes:", 1)[1].split(";", 1)[0].split(",")]


def node_calls(stderr: str, node_id: str) -> int:
    """Layer calls the coordinator's summary line credits to `node_id` (0 if not listed)."""
    seg = [s for s in node_segments(stderr) if s.startswith(f"{node_id} ")]
    calls = re.search(r" (\d+) calls", seg[0]) if seg else None
    return int(calls.group(1)) if calls else 0


def lines_with(stderr: str, *needles: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if all(n in ln for n in needles)]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def convert(src: Path, out: Path, experts: str) -> str:
    r = run([*MOESHARD, "convert", str(src), str(out), "--force", "--quiet", "--experts", experts])
    m = re.search(r"model id ([0-9a-f]+)", r.stdout + r.stderr)
    return m.group(1) if m else "?"


# -- latency: tc netem, or a delay relay where the kernel has no netem --------------------------


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
        argv = [sys.executable, __file__, "--delay-relay", str(RELAY_PORT), target, str(ms)]
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


# -- scenarios ------------------------------------------------------------------------------


def check(name, result, stderr, ref, extra_ok=True, extra="") -> Result:
    if result is None:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        return Result(name, False, f"coordinator failed: {tail}")
    same = result["tokens"] == ref["tokens"]
    n = retries(stderr)
    detail = ("identical output" if same else "OUTPUT DIFFERS from single-node") + (
        f"; {extra}" if extra else ""
    )
    tps = result["stats"]["tokens_per_s"]
    ms = [float(m) for m in re.findall(r"calls ([0-9.]+) ms", " ".join(node_segments(stderr)))]
    return Result(name, same and extra_ok, detail, tps, n, sum(ms) / len(ms) if ms else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", default="mstb")
    p.add_argument("--subnet", default="10.199.0")
    p.add_argument("--model", default=str(FIXTURE), help="Hugging Face checkpoint to convert")
    p.add_argument("--experts", default="q4_0", help="expert format of the conversion")
    p.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8")
    p.add_argument("--tokens", type=int, default=32, help="tokens of the plain scenarios")
    p.add_argument("--deadline", type=float, default=1.0, help="coordinator's per-call deadline")
    p.add_argument("--discover-timeout", type=float, default=2.0)
    p.add_argument("--work", help="work directory (default: a temporary one, removed)")
    p.add_argument("--json-out", help="also write the table as JSON here")
    args = p.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="moeshard-testbed-"))
    work.mkdir(parents=True, exist_ok=True)
    bed = Bed(args.prefix, args.subnet, work, args.deadline, args.discover_timeout)
    results: list[Result] = []
    t_start = time.monotonic()
    try:
        results = scenarios(bed, args)
    finally:
        bed.stop_all()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results, time.monotonic() - t_start, bed.delay_mode)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0 if results and all(r.ok for r in results) else 1


def scenarios(bed: Bed, args) -> list[Result]:
    work = bed.work
    model, foreign = work / "model", work / "foreign"
    log(f"converting {args.model} ({args.experts}) and a foreign conversion (q8_0)")
    model_id = convert(Path(args.model), model, args.experts)
    other = "q8_0" if args.experts != "q8_0" else "q4_0"
    foreign_id = convert(Path(args.model), foreign, other)
    if model_id == foreign_id:
        raise RuntimeError("the foreign conversion has the same model id")
    run(
        [*MOESHARD, "shard", str(model), "--nodes", "3", "--replicas", "2"]
        + ["--out", str(work / "shards"), "--force"]
    )
    run(
        [*MOESHARD, "shard", str(foreign), "--nodes", "1", "--replicas", "1"]
        + ["--out", str(work / "foreign-shards"), "--force"]
    )
    config = json.loads((model / "config.json").read_text())
    n_prompt = len(args.prompt_ids.split(","))
    context = int(config.get("max_position_embeddings", 4096))
    refs: dict[int, dict] = {}

    def ref(n: int) -> dict:
        if n not in refs:
            result, err, _ = finish(bed.generate(model, args.prompt_ids, n, remote=False))
            if result is None:
                raise RuntimeError(f"single-node reference failed:\n{err}")
            refs[n] = result
        return refs[n]

    for i, host in enumerate(NODES):
        bed.start_node(host, work / "shards" / f"node-{i:02d}", f"tb-{host}")
    for host in NODES:
        bed.wait_healthy(host)
    log("3 nodes SERVING (health checked from the coordinator namespace)")

    results = []
    # 1. discovery across the bridge, output identical to single-node.
    proc = bed.generate(model, args.prompt_ids, args.tokens)
    result, err, _ = finish(proc)
    found = [h for h in NODES if any(s.startswith(f"tb-{h} ") for s in node_segments(err))]
    results.append(
        check(
            "discover (zeroconf, 3 nodes)",
            result,
            err,
            ref(args.tokens),
            len(found) == 3,
            f"nodes used: {','.join(found) or 'none'}",
        )
    )
    base_tps = result["stats"]["tokens_per_s"] if result else 50.0
    log(f"baseline {base_tps:.1f} tok/s")

    def sized(seconds: float) -> int:
        return max(args.tokens, min(int(base_tps * seconds), context - n_prompt - 1))

    # 2. a node of another model id: ignored with a warning.
    bed.start_node("x", work / "foreign-shards" / "node-00", "tb-foreign")
    bed.wait_healthy("x")
    result, err, _ = finish(bed.generate(model, args.prompt_ids, args.tokens))
    warned = lines_with(err, "ignoring node tb-foreign", "model id")
    for line in warned[:1]:
        log("coordinator: " + line.split(": ", 1)[-1])
    results.append(
        check(
            "foreign model id",
            result,
            err,
            ref(args.tokens),
            bool(warned) and not any("tb-foreign" in s for s in node_segments(err)),
            "ignored with a warning" if warned else "NO WARNING",
        )
    )
    bed.stop("tb-foreign")

    # 3. latency per hop.
    if netem_available(bed):
        bed.delay_mode = "netem"
    elif shutil.which("nft"):
        bed.delay_mode = "relay"  # this kernel has no sch_netem
    else:
        bed.delay_mode = "none"
        results.append(Result("latency", True, "SKIPPED: neither tc netem nor nftables here"))
    log(f"latency via {bed.delay_mode}")
    steps = {"relay": (0, 1, 10), "netem": (1, 10), "none": ()}[bed.delay_mode]
    for ms in steps:
        set_delay(bed, ms)
        n = args.tokens if ms < 10 else max(8, args.tokens // 2)
        result, err, _ = finish(bed.generate(model, args.prompt_ids, n))
        results.append(check(f"latency {ms} ms/hop ({bed.delay_mode})", result, err, ref(n)))
    set_delay(bed, None)

    # 4. a node's link goes down mid-generation and comes back.
    n = sized(8.0)
    proc = bed.generate(model, args.prompt_ids, n)
    bed.wait_admitted(NODES, proc)
    time.sleep(1.0)
    port = bed.busiest(NODES)
    subprocess.run(["ip", "-n", bed.ns("sw"), "link", "set", port, "down"], check=True)
    log(f"link of {port} down (the busiest node)")
    time.sleep(2.0)
    subprocess.run(["ip", "-n", bed.ns("sw"), "link", "set", port, "up"], check=True)
    log(f"link of {port} up")
    result, err, _ = finish(proc)
    banned = lines_with(err, f"tb-{port}", "banned")
    back = lines_with(err, f"tb-{port}", "re-admitted")
    seg = [s for s in node_segments(err) if s.startswith(f"tb-{port} ")]
    up_at_end = bool(seg) and "DOWN" not in seg[0]
    results.append(
        check(
            f"link {port} down 2 s + up ({n} tok)",
            result,
            err,
            ref(n),
            bool(banned) and bool(back) and up_at_end,
            ("banned" if banned else "NOT banned")
            + ", "
            + ("re-admitted" if back else "NOT re-admitted"),
        )
    )
    if banned:
        log("coordinator: " + banned[0].split(": ", 1)[-1])
    if back:
        log("coordinator: " + back[0].split(": ", 1)[-1])

    # 5. a node SIGKILLed mid-generation.
    n = sized(5.0)
    proc = bed.generate(model, args.prompt_ids, n)
    bed.wait_admitted(NODES, proc)
    time.sleep(1.0)
    host = bed.busiest(NODES)
    victim = f"tb-{host}"
    bed.stop(victim, signal.SIGKILL)
    log(f"{victim} SIGKILLed (the busiest node)")
    result, err, _ = finish(proc)
    banned = lines_with(err, victim, "banned")
    used = node_calls(err, victim) > 0  # it had taken part in the generation
    for line in banned[:1]:
        log("coordinator: " + line.split(": ", 1)[-1])
    results.append(
        check(
            f"{host} SIGKILL ({n} tok)",
            result,
            err,
            ref(n),
            bool(banned) and used,
            ("NOT banned" if not banned else "banned, layer retried on replicas")
            if not banned or retries(err) > 0
            else "banned by an idle ping (no call in flight)",
        )
    )

    # 6. a new coordinator after the kill: the dead node sent no zeroconf goodbye; whether it is
    # still discovered (then unreachable, skipped) or not, 2 of 3 nodes cover every expert.
    result, err, _ = finish(bed.generate(model, args.prompt_ids, args.tokens))
    stale = lines_with(err, bed.addr(host), "unreachable at start")
    seg = [s for s in node_segments(err) if s.startswith(bed.addr(host)) or victim in s]
    for line in stale[:1]:
        log("coordinator: " + line.split(": ", 1)[-1])
    results.append(
        check(
            "new coordinator, 2 of 3 nodes",
            result,
            err,
            ref(args.tokens),
            not seg or "DOWN" in seg[0],
            "dead node discovered, unreachable, skipped" if stale else "dead node not discovered",
        )
    )

    # 7. the killed node restarts mid-generation: a coordinator that never knew it finds it
    # through its still-running zeroconf browse ("joined"); one that kept the stale address
    # re-admits it through its prober ("re-admitted"). Either way it must take work again.
    n = sized(6.0)
    alive = [h for h in NODES if h != host]
    proc = bed.generate(model, args.prompt_ids, n)
    bed.wait_admitted(alive, proc)
    time.sleep(1.0)
    bed.start_node(host, work / "shards" / f"node-{NODES.index(host):02d}", victim)
    log(f"{victim} restarted mid-generation")
    result, err, _ = finish(proc)
    joined = lines_with(err, victim, "joined")
    back = lines_with(err, victim, "re-admitted")
    calls = node_calls(err, victim)
    used = calls > 0
    for line in (joined or back)[:1]:
        log("coordinator: " + line.split(": ", 1)[-1])
    results.append(
        check(
            f"{host} restarted mid-run ({n} tok)",
            result,
            err,
            ref(n),
            bool(joined or back) and used,
            ("joined by zeroconf" if joined else "re-admitted" if back else "NOT used")
            + (f", {calls} calls" if used else ""),
        )
    )
    return results


def print_table(results: list[Result], seconds: float, delay_mode: str) -> None:
    rows = [("scenario", "outcome", "tok/s", "failovers", "call ms", "detail")]
    for r in results:
        tps = f"{r.tokens_per_s:.1f}" if r.tokens_per_s else "-"
        fo = str(r.failovers) if r.failovers is not None and r.failovers >= 0 else "-"
        ms = f"{r.call_ms:.2f}" if r.call_ms is not None else "-"
        rows.append((r.scenario, "PASS" if r.ok else "FAIL", tps, fo, ms, r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5])
        if i == 0:
            print("-" * (sum(widths) + 10 + max(len(r[5]) for r in rows)))
    failed = sum(not r.ok for r in results)
    print(
        f"{len(results) - failed}/{len(results)} scenarios passed in {seconds:.0f} s"
        + (f"; latency via {delay_mode}" if delay_mode else "")
        + "; failovers = layer calls retried on a replica; call ms = the coordinator's"
        " smoothed Forward round trip per node, averaged"
    )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--delay-relay":
        asyncio.run(_relay(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]) / 1e3))
    else:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        try:
            sys.exit(main())
        except KeyboardInterrupt:
            print("testbed: interrupted", file=sys.stderr)
            sys.exit(130)
