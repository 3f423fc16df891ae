"""The testbed's scenarios, run in order against one conversion and three node daemons."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .bed import MOESHARD, NODES, Bed, convert, log, run
from .delay import netem_available, set_delay
from .liars import liars
from .results import Result, check, finish, lines_with, node_calls, node_segments, retries
from .strangers import strangers

GROUPS = ("discover", "foreign", "strangers", "liars", "latency", "faults")


def scenarios(bed: Bed, args) -> list[Result]:
    """The scenarios of the groups in `args.only` (the faults run in order: each needs the
    one before it)."""
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
    rates: list[float] = []  # tokens/s of plain runs, to size the fault scenarios

    def sized(seconds: float) -> int:
        """Tokens that take about `seconds` at the fastest rate seen so far: the first run
        can be slow (cold caches, a busy machine), and a fault scenario whose generation
        ends before the fault has played out proves nothing (seen once: 185 tokens sized
        at 23 tok/s ran at 66, over before the dead link was noticed)."""
        return max(
            args.tokens, min(int(max(rates, default=50.0) * seconds), context - n_prompt - 1)
        )

    if "discover" in args.only:
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
        if result:
            rates.append(result["stats"]["tokens_per_s"])
            log(f"baseline {rates[0]:.1f} tok/s")

    if "foreign" in args.only:
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

    if "strangers" in args.only:
        # 2b. strangers: a client no node allows, a wrong pin, plaintext, a forged announcement.
        results += strangers(bed, model, model_id, args, ref)

    if "liars" in args.only:
        # 2c. liars: a fourth node lies in each of six ways; caught, tokens unchanged, ledger good.
        results += liars(bed, model, args, ref)

    if "latency" in args.only:
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
            if ms == 0 and result:
                rates.append(result["stats"]["tokens_per_s"])
        set_delay(bed, None)

    if "faults" in args.only:
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
        n = sized(8.0)  # long enough to be seen connected, then killed mid-way, on a busy CI box
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
                "dead node discovered, unreachable, skipped"
                if stale
                else "dead node not discovered",
            )
        )

        # 7. the killed node restarts mid-generation: a coordinator that never knew it finds it
        # through its still-running zeroconf browse ("joined"); one that kept the stale address
        # re-admits it through its prober ("re-admitted"). Either way it must take work again.
        n = sized(15.0)  # a restart takes a few seconds (start-up, zeroconf, vetting audits)
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
