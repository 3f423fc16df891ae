"""Drive the network-namespace testbed built by tools/testbed.sh (run that, not this).

Inside namespaces PREFIX-coord, PREFIX-n1..n3 and PREFIX-x (one L2 bridge, 10.199.0.0/24):
converts the model (and a second conversion with another model id), `moeshard shard --nodes 3
--replicas 2`, starts a node daemon in each node namespace bound to its own address, and runs
`moeshard generate MODEL --discover` in the coordinator namespace (zeroconf across the bridge,
no peer list). Every scenario's tokens must equal the single-node output:

  discover           3 nodes found by zeroconf, output identical
  foreign model id   a 4th node serving another conversion is ignored (warning)
  strangers          a client no node allows is refused; a node with another key than pinned
                     is refused naming both ids; plaintext to a TLS node fails; a forged
                     zeroconf announcement is ignored while an honest run gives the same tokens
  latency 0/1/10 ms  one-way delay per hop (tc netem, or a delay relay where the kernel lacks
                     netem; see `delay_mode`), tokens/s at each
  link down/up       a node's switch port goes down mid-generation and comes back: banned,
                     then re-admitted within the same generation
  node SIGKILL       a node is killed mid-generation: its layer calls fail over to replicas
  new coordinator    a fresh coordinator after the kill: 2 of 3 nodes cover every expert
  node restart       the killed node restarts mid-generation: found by the coordinator's
                     running zeroconf browse (or its prober) and given work again

Prints a table (scenario, outcome, tokens/s, failovers) and exits 1 if any scenario failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from testbed_lib.bed import FIXTURE, MOESHARD, Bed, run  # noqa: E402  # noqa: E402
from testbed_lib.results import Result  # noqa: E402
from testbed_lib.scenarios import GROUPS, scenarios  # noqa: E402


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
    p.add_argument(
        "--work", help="work directory (default: a temporary one, removed unless a scenario fails)"
    )
    p.add_argument(
        "--only",
        help=f"comma-separated scenario groups to run (of {','.join(GROUPS)}; default all)",
    )
    p.add_argument("--json-out", help="also write the table as JSON here")
    args = p.parse_args()
    args.only = set(args.only.split(",")) if args.only else set(GROUPS)
    if unknown := args.only - set(GROUPS):
        p.error(
            f"--only: unknown group(s) {','.join(sorted(unknown))}; choose of {','.join(GROUPS)}"
        )

    work = Path(args.work or tempfile.mkdtemp(prefix="moeshard-testbed-"))
    work.mkdir(parents=True, exist_ok=True)
    # The coordinator's identity: every moeshard process started here finds it through
    # MOESHARD_HOME; the nodes allow exactly this client (mutual TLS across the bridge).
    os.environ["MOESHARD_HOME"] = str(work / "client")
    (work / "client").mkdir(exist_ok=True)
    key = work / "client" / "key.pem"
    if not key.exists():
        run([*MOESHARD, "keygen", str(key)])
    client = run([*MOESHARD, "id", str(key)]).stdout.strip()
    bed = Bed(args.prefix, args.subnet, work, args.deadline, args.discover_timeout, client)
    results: list[Result] = []
    t_start = time.monotonic()
    passed = False
    try:
        results = scenarios(bed, args)
        passed = bool(results) and all(r.ok for r in results)
    finally:
        bed.stop_all()
        if passed and not args.work:
            shutil.rmtree(work, ignore_errors=True)
        else:  # a failure's evidence: node logs and every coordinator's stderr (coord-*.log)
            print(f"testbed: work directory kept: {work}", file=sys.stderr)
    print_table(results, time.monotonic() - t_start, bed.delay_mode)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0 if passed else 1


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
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("testbed: interrupted", file=sys.stderr)
        sys.exit(130)
