"""`moeshard bench stream MODEL --ram SIZE`: one table, every row measured in this run.

Rows: naive (no cache; one synchronous O_DIRECT read per expert in file order, then its
compute), then each cache policy with and without next-layer prefetch, all under the same RAM
plan (`moeshard.moe.budget`). Every row decodes the same fixed prompt with the same seeded sampling,
so every row sees the same routing trace (checked); the trace of the first row is the one Belady's
offline optimum is computed on, for the same number of cache slots.

The floor: the bytes that must be read per token (Belady's misses for this cache size, plus the
streamed trunk layers) divided by the disk's bandwidth measured in this run with random
O_DIRECT reads of the model's own expert records at the same read size and queue depth (the
median of short windows taken before the rows and after every row, since a shared disk drifts
while the rows run). Since
the experts must also be computed, the table shows a second bound, max(I/O floor, the smallest
non-I/O time per token of any row), and each row's ratio to both.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections import Counter

import numpy as np

from moeshard.bench.disk import interleaved, raw_read_gbps
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.moe.analysis.cachesim import belady_hits
from moeshard.moe.errors import MoeshardError
from moeshard.moe.experts.backend import ExpertsBase
from moeshard.moe.experts.compute import KERNELS, ExpertKernels, run_experts, weighted_sum
from moeshard.moe.experts.store import ExpertStore
from moeshard.moe.experts.store_stats import StoreStats
from moeshard.moe.kernels.blas import limit_blas_threads
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.model.streaming_trunk import StreamingTrunk
from moeshard.moe.storage.budget import measure_overhead, peak_rss_bytes, plan_budget
from moeshard.moe.storage.io import ReaderPool, ReadRequest, aligned_buffer
from moeshard.moe.units import fmt_bytes, parse_size

log = logging.getLogger(__name__)


def no_ffn(record, fmt, hidden, inter, x, glu=None) -> np.ndarray:
    """--io-only: the expert contributes nothing (its record is still read and checked)."""
    return np.zeros_like(x)  # [n, H]


IO_ONLY = ExpertKernels(one=no_ffn, batch1=None, batch1_sum=None, rows=None)


class NaiveExperts(ExpertsBase):
    """No cache: each routed expert is read (one synchronous O_DIRECT read, experts in file
    order) into one buffer and computed before the next is read."""

    def __init__(self, model: ModelDir, kernels: ExpertKernels = KERNELS):
        self.shards, self.kernels = model.shard_set, kernels
        self.buf = aligned_buffer(self.shards.record_nbytes)
        self.reader = ReaderPool(1, merge=False)
        self.stats_ = StoreStats()
        self.accesses: list[tuple[int, tuple[int, ...]]] = []
        self.counts: Counter = Counter()

    def snapshot(self) -> StoreStats:
        return self.stats_.with_reads(self.reader.stats)

    def __call__(self, layer, hidden, ids, weights, dtype=np.float32, hint=None):
        t_call = time.perf_counter()
        needed = np.unique(ids)  # [n]
        self.accesses.append((layer, tuple(int(e) for e in needed)))
        s, st = self.shards, self.stats_
        locs = {int(e): s.location(layer, int(e)) for e in needed}
        parts = {}
        for e in sorted(locs, key=lambda e: locs[e].offset):
            loc = locs[e]
            t0 = time.perf_counter()
            self.reader.read(
                [ReadRequest(loc.path, loc.offset, loc.nbytes, self.buf, (layer, e), loc.crc32)]
            )
            st.stall_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            parts.update(
                run_experts(self.buf, {e: 0}, s.record_format(layer), s.hidden, s.inter, hidden,
                            ids, weights, self.kernels, s.glu)
            )  # fmt: skip
            st.compute_s += time.perf_counter() - t0
            self.counts[(layer, e)] += len(parts[e][0])
        st.calls += 1
        st.accesses += len(needed)
        st.misses += len(needed)
        st.call_s += time.perf_counter() - t_call
        return weighted_sum(parts, hidden.shape, dtype)

    def close(self) -> None:
        self.reader.close()


def packed_model(path: str, model: ModelDir) -> ModelDir:
    """The same model with its experts laid out by `moeshard pack` (checked: same model id)."""
    packed = ModelDir(path)
    if packed.model_id != model.model_id:
        raise MoeshardError(f"--packed {path}: model id differs from {model.path}'s")
    if "layout" not in packed.manifest:
        raise MoeshardError(f"--packed {path}: not a packed layout (run `moeshard pack`)")
    return packed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (e.g. from `moeshard synth`)")
    p.add_argument("--ram", required=True, help="RAM budget, e.g. 2G")
    p.add_argument("--tokens", type=int, default=32, help="decode steps per row")
    p.add_argument(
        "--prompt-ids", default="1,2,3,4,5,6,7,8", help="prompt as comma-separated token ids"
    )
    p.add_argument("--depth", type=int, default=4, help="O_DIRECT reads in flight")
    p.add_argument("--policies", default="lru,lfu,pin,none", help="cache policies, one row each")
    p.add_argument(
        "--packed", metavar="DIR", help="also run every row on this `moeshard pack` copy of MODEL"
    )
    p.add_argument("--disk-seconds", type=float, default=0.3, help="per disk window")
    p.add_argument(
        "--reps", type=int, default=9, help="raw/reader disk window pairs before the rows"
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="rounds over all rows; each row's median round"
    )
    p.add_argument(
        "--prefetch-top",
        type=int,
        metavar="N",
        help="also a '+prefetch topN' row per policy: prefetch each token's N best predictions",
    )
    p.add_argument(
        "--io-only",
        action="store_true",
        help="skip the expert kernels (records still read and checksummed): the I/O path alone",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeshard bench stream", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    if args.reps < 1 or args.repeat < 1 or args.disk_seconds <= 0:
        raise MoeshardError("--reps and --repeat must be at least 1, --disk-seconds above 0")
    kernels = IO_ONLY if args.io_only else KERNELS
    limit_blas_threads(1)  # as `generate --ram` does (see moe/kernels/blas.py)
    overhead = measure_overhead()  # interpreter + numba warm-up, before any model allocation
    model = ModelDir(args.model)
    model.require_experts("bench stream reads the records here: use the full model directory")
    c = model.config
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    context = len(prompt) + args.tokens
    plan = plan_budget(model, parse_size(args.ram), context, len(prompt))
    plan.overhead = overhead
    layout = model.trunk_layout()
    trunk = StreamingTrunk(layout, plan.trunk_prefix)
    tf = model.family.Transformer(c, trunk, None)
    opts = SamplingOptions(max_tokens=args.tokens + 1, temperature=1.0, seed=0)
    total = sum(loc.nbytes for _, loc in model.locations.values())
    print(
        f"model {model.path} ({fmt_bytes(total)} of experts, {c.n_experts} experts x "
        f"{len(c.moe_layers)} layers, top {c.top_k}); {plan.describe().splitlines()[0]}"
    )
    print("\n".join(plan.describe().splitlines()[1:]))

    # the disk, at the experts' read size and this queue depth
    record = plan.slot_bytes
    targets = [(loc.path, loc.offset, loc.nbytes, loc.crc32) for _, loc in model.locations.values()]
    offsets = [t[:2] for t in targets]  # (path, offset) for the raw windows
    alt = interleaved(targets, record, args.depth, args.disk_seconds, args.reps)
    print(
        f"disk: random O_DIRECT {fmt_bytes(record)} reads at QD{args.depth}: raw {alt.raw:.3f} "
        f"GB/s, through the reader pool (checksums verified) {alt.pool:.3f} GB/s; reader/raw "
        f"{alt.ratio:.0%} (median of {alt.pairs} alternated {args.disk_seconds:g} s window pairs)"
    )
    # the disk drifts while the rows run: one more raw window after every row, and the floor
    # uses the median of all raw windows of the run
    raw_windows = [alt.raw]

    rows: list[tuple[str, dict]] = [("naive", {})]
    for policy in args.policies.split(","):
        rows.append((policy, {"policy": policy, "prefetch": False}))
        rows.append((f"{policy} +prefetch", {"policy": policy, "prefetch": True}))
        if args.prefetch_top:
            rows.append(
                (
                    f"{policy} +prefetch top{args.prefetch_top}",
                    {"policy": policy, "prefetch": True, "top": args.prefetch_top},
                )
            )
    packed = packed_model(args.packed, model) if args.packed else None
    if packed is not None:  # the same rows on the co-activation layout (`moeshard pack`)
        rows += [(f"{name} [packed]", dict(opts, packed=True)) for name, opts in rows]
    runs: dict[str, list] = {name: [] for name, _ in rows}
    trace0, profile = None, None
    for name, options in [row for _ in range(args.repeat) for row in rows]:
        source = packed if options.get("packed") else model
        if options.get("policy"):
            store = ExpertStore(
                source.shard_set,
                plan.expert_slots,
                c.top_k,
                options["policy"],
                prefetch=options["prefetch"],
                prefetch_slots=plan.prefetch_slots,
                prefetch_top=options.get("top"),
                depth=args.depth,
                profile=profile,
                kernels=kernels,
                record_accesses=True,
            )
        else:
            store = NaiveExperts(source, kernels)
        tf.experts = store
        marks: list = []

        def on_token(_tok, store=store, marks=marks):
            if not marks:
                marks.append((store.snapshot(), trunk.bytes_read, trunk.stall_s))

        result = generate(tf, prompt, opts, on_token)
        end = store.snapshot()
        start, trunk_start, trunk_stall = marks[0]
        d = end.minus(start)
        n = len(result.decode_s)
        s_tok = statistics.median(result.decode_s)  # robust to the shared CPU's hiccups
        mean_s = sum(result.decode_s) / n
        trunk_read = (trunk.bytes_read - trunk_start) / n
        stall = (d.stall_s + trunk.stall_s - trunk_stall) / n * (s_tok / mean_s)  # as a share
        if trace0 is None:
            trace0, prefill_calls = store.accesses, start.calls
            profile = store.counts
        same = store.accesses == trace0
        runs[name].append(
            (name, s_tok, d.bytes_read / n + trunk_read, d, stall, same, result.tokens)
        )
        trunk_per_token = trunk_read
        store.close()
        raw_windows.append(
            # a fresh seed per window: re-reading the same offsets would be served by the
            # host's cache on a virtual disk and inflate the floor's bandwidth
            raw_read_gbps(
                offsets,
                record,
                args.depth,
                args.disk_seconds,
                seed=1000 + len(raw_windows),
            )
        )
        print(f"[{name}: {s_tok:.4f} s/token]", file=sys.stderr, flush=True)

    results = []  # per row: the run with the median s/token (rounds alternate the rows)
    for name, _ in rows:
        by_time = sorted(runs[name], key=lambda r: r[1])
        median = by_time[len(by_time) // 2]
        results.append((*median[:5], all(r[5] for r in by_time), median[6]))

    keys = [(layer, e) for layer, experts in trace0 for e in experts]
    prefill_accesses = sum(len(experts) for _, experts in trace0[:prefill_calls])
    hits = belady_hits(keys, plan.expert_slots, prefill_accesses)
    accesses = len(keys) - prefill_accesses
    belady = hits / accesses
    decode_tokens = len(results[0][6]) - 1
    must_read = (accesses - hits) * plan.slot_bytes / decode_tokens
    raw = statistics.median(raw_windows)
    io_floor = (must_read + trunk_per_token) / (raw * 1e9)
    compute = min(s - st for _, s, _, _, st, _, _ in results)
    floor = max(io_floor, compute)
    print(
        f"trace: {decode_tokens} decode tokens after a {len(prompt)}-token prefill, "
        f"{accesses / decode_tokens:.1f} expert uses/token; {plan.expert_slots} cache slots; "
        f"Belady hit rate {belady:.1%} -> must read {must_read / 1e9:.3f} GB/token"
        + (f" + trunk {trunk_per_token / 1e9:.3f} GB/token" if trunk_per_token else "")
    )
    print(
        f"disk through the run: raw {raw:.3f} GB/s median of {len(raw_windows)} windows "
        f"(min {min(raw_windows):.3f}, max {max(raw_windows):.3f})"
    )
    print(
        f"floor: I/O {io_floor:.4f} s/token (must-read bytes / {raw:.2f} GB/s); non-I/O time "
        f"(min over rows of s/token - stall) {compute:.4f} s/token; bound = max = {floor:.4f}"
    )
    w = max(16, 1 + max(len(name) for name, *_ in results))  # the config column
    head = (
        f"{'config':<{w}}{'s/token':>9}{'GB/token':>10}{'hit rate':>10}{'Belady':>8}"
        f"{'stall':>7}{'recall':>8}{'prec.':>7}{'x I/O floor':>12}{'x bound':>9}"
        f"{'reads/tok':>10}{'KiB/read':>9}"
    )
    mode = "I/O path only: expert kernels skipped" if args.io_only else "with expert compute"
    print(
        f"decode, {mode}; s/token = median step, GB/token and stall share = means; "
        "hit rate counts prefetched experts as hits (Belady: no prefetch)"
    )
    print(head)
    print("-" * len(head))
    for name, s_tok, gb, d, stall, same, _ in results:
        pf = "prefetch" in name
        print(
            f"{name:<{w}}{s_tok:>9.4f}{gb / 1e9:>10.3f}{d.hit_rate:>10.1%}{belady:>8.1%}"
            f"{stall / s_tok:>7.0%}"
            + (f"{d.recall:>8.0%}{d.precision:>7.0%}" if pf else f"{'-':>8}{'-':>7}")
            + f"{s_tok / io_floor:>12.2f}{s_tok / floor:>9.2f}"
            + f"{d.reads / decode_tokens:>10.1f}{d.bytes_read / max(d.reads, 1) / 1024:>9.0f}"
            + ("" if same else "  (routing differs!)")
        )
    print(
        f"peak RSS {fmt_bytes(peak_rss_bytes())} = budget {fmt_bytes(plan.budget)} + interpreter "
        f"{fmt_bytes(overhead)} {'+' if peak_rss_bytes() > plan.budget + overhead else '-'} "
        f"{fmt_bytes(abs(peak_rss_bytes() - plan.budget - overhead))}"
    )
    trunk.close()
    sys.stdout.flush()
    return 0
