"""Routing traces: coact, merge-traces, pack, simulate."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from moeshard.commands import EXIT_OK
from moeshard.moe.errors import MoeshardError


def add_coact(sub) -> None:
    p = sub.add_parser("coact", help="expert frequencies, co-activation, reuse, cache hit rates")
    p.add_argument("traces", nargs="+", help="trace files from `generate --trace` (merged)")
    p.add_argument("--out", required=True, help="directory for coact.json and PNG plots")
    p.add_argument(
        "--cache-sizes",
        metavar="N,N,...",
        help="cache sizes in expert records for the hit-rate table (default: 2%%-50%% of all)",
    )
    p.set_defaults(func=cmd_coact)


def add_merge_traces(sub) -> None:
    p = sub.add_parser("merge-traces", help="merge traces of several runs into one file")
    p.add_argument("out", help="merged trace file (.npz)")
    p.add_argument("traces", nargs="+", help="trace files")
    p.set_defaults(func=cmd_merge_traces)


def cmd_coact(args) -> int:
    from moeshard.moe.analysis import coact
    from moeshard.moe.storage import traces as trace

    sizes = None
    if args.cache_sizes:
        try:
            sizes = [int(v) for v in args.cache_sizes.split(",")]
        except ValueError:
            sizes = [0]
        if min(sizes) < 1:
            raise MoeshardError(f"--cache-sizes wants positive integers, got {args.cache_sizes!r}")
    merged = trace.merge([trace.load(p) for p in args.traces])
    result, plots = coact.run(merged, Path(args.out), sizes)
    print(coact.summary(result))
    print(f"wrote {Path(args.out) / 'coact.json'} and {len(plots)} plots")
    return EXIT_OK


def cmd_merge_traces(args) -> int:
    from moeshard.moe.storage import traces as trace
    from moeshard.moe.storage.io import check_output_file

    check_output_file(args.out)
    out = Path(args.out).resolve()
    for p in args.traces:
        if Path(p).resolve() == out or (out.exists() and _same_file(p, out)):
            raise MoeshardError(f"{args.out}: the output is one of the inputs ({p})")
    merged = trace.merge([trace.load(p) for p in args.traces])
    merged.save(args.out)
    print(f"{args.out}: {len(merged.layer)} rows from {merged.meta['runs']} runs")
    return EXIT_OK


def _same_file(a, b) -> bool:
    """Whether two paths are one file (a hard link or a symlink too)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def add_pack(sub) -> None:
    p = sub.add_parser("pack", help="rewrite the expert layout so co-firing experts are adjacent")
    p.add_argument("model", help="model directory")
    p.add_argument("--trace", nargs="+", required=True, help="trace file(s) of this model")
    p.add_argument("--out", help="write a new directory instead of rewriting MODEL in place")
    p.set_defaults(func=cmd_pack)


def cmd_pack(args) -> int:
    from moeshard.moe.convert import pack
    from moeshard.moe.storage import traces as trace

    merged = trace.merge([trace.load(p) for p in args.trace])
    out = pack.pack(args.model, merged, args.out)
    manifest = json.loads((out / "moeshard.json").read_text())
    order = {int(k): v for k, v in manifest["layout"]["order"].items()}
    gain = pack.adjacency_gain(merged, order)
    print(
        f"packed {out}: reads per (token, layer) on the trace: "
        f"{gain['reads_per_layer_file_order']:.2f} in file order -> "
        f"{gain['reads_per_layer_packed']:.2f} packed (adjacent records merged)"
    )
    return EXIT_OK


def add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="replay a trace against policies and a disk model")
    p.add_argument("traces", nargs="+", help="trace file(s) (with --validate: the prompt ids)")
    p.add_argument(
        "--geometry",
        default="k3",
        help="k3, k2, k2.5, gpt-oss-20b, gpt-oss-120b, qwen3.6-35b-a3b, qwen3-next-80b-a3b (as "
        "published), a synth preset (e.g. glm-4.6: the model it would write), or a model "
        "directory",
    )
    p.add_argument("--ram", default="8G", help="RAM budget, e.g. 8G")
    p.add_argument(
        "--trunk",
        help="the trunk stored in this format instead (f32, bf16, q8_0, q4_0; default: as the "
        "geometry has it, bf16 for k3)",
    )
    p.add_argument("--disk", default="this-machine", help="this-machine, pcie4-nvme or a JSON file")
    p.add_argument("--depth", type=int, default=8, help="reads in flight")
    p.add_argument("--kernel-gbps", type=float, default=7.0, help="expert kernel throughput")
    p.add_argument("--memory-gbps", type=float, default=20.0, help="trunk compute bandwidth")
    p.add_argument("--prefetch-recall", type=float, default=0.8, help="share of misses predicted")
    p.add_argument(
        "--validate", metavar="MODEL", help="run MODEL for real and print measured vs simulated"
    )
    p.add_argument(
        "--swarm",
        metavar="FILE",
        help="a network of nodes described in FILE (TOML: moeshard/moe/analysis/swarm.py has "
        "the fields) instead of one box; --ram, --disk and the throughputs are then the file's",
    )
    p.add_argument(
        "--nodes", metavar="N,N,...", help="with --swarm: one line per node count (its one class)"
    )
    p.add_argument(
        "--coordinator-ram", metavar="SIZE", help="with --swarm: the coordinator's RAM instead"
    )
    p.add_argument(
        "--trunk-hosts",
        type=int,
        metavar="N",
        help="with --swarm: the trunk split tensor-parallel over N hosts of the coordinator's "
        "kind (a model of a later step, not built)",
    )
    p.add_argument("--policy", default="lru", help="with --validate: cache policy")
    p.add_argument("--prefetch", action="store_true", help="with --validate: prefetch on")
    p.add_argument("--tokens", type=int, default=48, help="with --validate: decode tokens")
    p.add_argument(
        "--repeat", type=int, default=3, help="with --validate: real runs (median), disk between"
    )
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> int:
    from moeshard.moe.analysis import simulate
    from moeshard.moe.analysis.disk import Disk
    from moeshard.moe.storage import traces as trace
    from moeshard.moe.units import parse_size

    _check_simulate_options(args)
    if args.validate:
        from moeshard.bench import sim_validate

        if args.repeat < 1:
            raise MoeshardError("--repeat must be at least 1")
        if args.tokens < 1:
            raise MoeshardError(f"--tokens {args.tokens}: need at least 1")
        try:
            prompt = [int(t) for t in args.traces[0].split(",")]
        except ValueError:
            raise MoeshardError(
                f"with --validate the argument is the prompt ids (e.g. 1,2,3), got "
                f"{args.traces[0]!r}"
            ) from None
        runs, predictions, seen, _ = sim_validate.validate(
            args.validate,
            parse_size(args.ram),
            args.policy,
            args.prefetch,
            args.tokens,
            prompt,
            args.repeat,
        )
        print(
            f"{args.validate}, --ram {args.ram}, policy {args.policy}, prefetch "
            f"{'on' if args.prefetch else 'off'}, {args.tokens} tokens after prompt {prompt}"
        )
        print(sim_validate.report(runs, predictions, seen))
        return EXIT_OK

    if args.swarm:
        return _simulate_swarm(args)
    merged = trace.merge([trace.load(p) for p in args.traces])
    geometry = _geometry(args.geometry)
    if args.trunk:
        geometry = simulate.with_trunk(geometry, args.trunk)
    ram = parse_size(args.ram)
    disk = Disk.load(args.disk)
    results = simulate.run_all(
        merged,
        geometry,
        ram,
        disk,
        depth=args.depth,
        kernel_gbps=args.kernel_gbps,
        memory_gbps=args.memory_gbps,
        prefetch_recall=args.prefetch_recall,
    )
    print(simulate.table(results, geometry, ram, args.disk))
    return EXIT_OK


def _simulate_swarm(args) -> int:
    """`simulate --swarm FILE [--nodes N,...]`: one line per node count (the file and the
    options checked before the traces are read)."""
    from dataclasses import replace

    from moeshard.moe.analysis import simulate, swarm
    from moeshard.moe.storage import traces as trace
    from moeshard.moe.units import parse_size

    spec = swarm.load_swarm(args.swarm)
    if args.trunk:
        spec = replace(spec, coordinator=replace(spec.coordinator, trunk=args.trunk))
    if args.trunk_hosts is not None:
        if args.trunk_hosts < 1:
            raise MoeshardError(f"--trunk-hosts {args.trunk_hosts}: need at least 1")
        spec = replace(spec, coordinator=replace(spec.coordinator, trunk_hosts=args.trunk_hosts))
    if args.coordinator_ram:
        ram = parse_size(args.coordinator_ram)
        spec = replace(spec, coordinator=replace(spec.coordinator, ram=ram))
    counts = [spec.node_count]
    if args.nodes:
        try:
            counts = [int(n) for n in args.nodes.split(",")]
        except ValueError:
            raise MoeshardError(f"--nodes {args.nodes!r}: node counts, e.g. 8,16,32") from None
        if min(counts) < spec.replicas:
            raise MoeshardError(f"--nodes: at least --replicas ({spec.replicas}) nodes")
    merged = trace.merge([trace.load(p) for p in args.traces])
    geometry = _geometry(args.geometry)
    tokens = simulate.project(merged, geometry)
    warm = simulate.prefill_sets(merged, geometry)  # the prompt's pass fills the caches first
    hints = simulate.project_hints(merged, geometry)  # the hints the run sent, if recorded
    results = [
        swarm.simulate_swarm(
            tokens,
            geometry,
            spec if n == spec.node_count else spec.with_nodes(n),
            warm=warm,
            hints=hints,
        )
        for n in counts
    ]
    print(swarm.table(results, geometry, spec, args.swarm))
    return EXIT_OK


def _check_simulate_options(args) -> None:
    """Every numeric option of `simulate` in its range, refused naming the option (0 GB/s would
    divide by zero; a negative, nan or infinite one, or a recall outside [0, 1], is nonsense
    the simulator would happily turn into a table)."""
    if args.depth < 1:
        raise MoeshardError(f"--depth {args.depth}: need at least 1 read in flight")
    for option, value in (("--kernel-gbps", args.kernel_gbps), ("--memory-gbps", args.memory_gbps)):
        if not (math.isfinite(value) and value > 0):
            raise MoeshardError(f"{option} {value:g}: need a positive, finite number of GB/s")
    swarm_only = [f"--{o.replace('_', '-')}" for o in ("nodes", "coordinator_ram", "trunk_hosts")
                  if getattr(args, o) is not None]  # fmt: skip
    if args.swarm and args.validate:
        raise MoeshardError("--swarm and --validate: one at a time (--validate runs one box)")
    if swarm_only and not args.swarm:
        raise MoeshardError(f"{', '.join(swarm_only)}: only with --swarm FILE")
    recall = args.prefetch_recall
    if not (math.isfinite(recall) and 0 <= recall <= 1):
        raise MoeshardError(f"--prefetch-recall {recall:g}: need a share between 0 and 1")


def _geometry(spec: str):
    """`--geometry`: a named one (k3, k2), a synth preset's (`synth.preset_sizes`: the model
    the preset would write, at sizes no disk here need hold), or a model directory's."""
    from moeshard.moe.analysis import simulate
    from moeshard.moe.convert import synth

    if spec not in simulate.GEOMETRIES and spec in synth.PRESETS:
        return simulate.config_geometry(spec, *synth.preset_sizes(spec))
    return simulate.geometry_of(spec)
