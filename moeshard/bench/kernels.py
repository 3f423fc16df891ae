"""`moeshard bench kernels`: throughput of the packed-weight kernels vs this machine's DRAM.

For each shape and format it reports GB/s of *packed weight bytes* consumed per second
(median over several timed samples, after warm-up), at batch 1, 4 and 32, next to the DRAM
read bandwidth measured in the same run (numpy sum over a large array, median) and the
ratio.  Weights are cycled through a pool of copies larger than the last-level cache, so the
numbers are from DRAM the way experts are in a real MoE forward pass, not from cache.

Expert rows time `expert_ffn` (gate + up + down on one record); matrix rows time `matmul`.
The decode-layer table times one layer's worth of experts at batch 1 both ways the store can
run them: one `expert_ffn` call each, and one `experts_ffn_b1` call for all of them.
JIT warm-up is measured in child processes with an empty and then a filled numba cache.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import idots, quant
from moeshard.moe.kernels.build import cpu_level
from moeshard.moe.kernels.layout import F16_SCALE_BYTES

# (label, kind, a, b): expert -> (hidden, inter); matrix -> (rows, cols)
SHAPES = [
    ("small expert h256 i128", "expert", 256, 128),
    ("Qwen3-30B-A3B expert h2048 i768", "expert", 2048, 768),
    ("Kimi-K2 expert h7168 i2048", "expert", 7168, 2048),
    ("matrix 4096x14336", "matrix", 4096, 14336),
]
BATCHES = (1, 4, 32)


def _l3_bytes() -> int:
    """The largest cache's size (sysfs), or 0 when it cannot be read."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        best = max(best, int(digits) * unit if digits.isdigit() else 0)
    return best


# twice the last-level cache (480 MiB on one Xeon VM here) and at least 256 MiB, so every call
# streams its weights from DRAM
POOL_BYTES = max(256 << 20, 2 * _l3_bytes())


def _samples(fn: Callable[[], object], n_samples: int, min_sample_s: float) -> np.ndarray:
    """Per-call seconds for n_samples samples, each looping fn long enough to be timeable."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    loops = max(1, int(min_sample_s / once))
    out = np.empty(n_samples)
    for i in range(n_samples):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        out[i] = (time.perf_counter() - t0) / loops
    return out


def dram_read_gbs(gib: float, reps: int) -> float:
    """Median GB/s of numpy summing a `gib`-GiB float32 array (one thread)."""
    a = np.ones(int(gib * (1 << 30)) // 4, dtype=np.float32)
    a.sum()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        ts.append(time.perf_counter() - t0)
    return a.nbytes / float(np.median(ts)) / 1e9


@njit(cache=True, nogil=True, parallel=True)
def _parallel_sum(a):
    """Sum of a uint64 array across numba's threads (a multi-core DRAM read probe)."""
    s = np.uint64(0)
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def dram_read_gbs_threads(gib: float, reps: int) -> float:
    """Median GB/s of summing a `gib`-GiB array with all numba threads."""
    a = np.ones(int(gib * (1 << 30)) // 8, dtype=np.uint64)
    _parallel_sum(a)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _parallel_sum(a)
        ts.append(time.perf_counter() - t0)
    return a.nbytes / float(np.median(ts)) / 1e9


def _pool(record: np.ndarray) -> list[np.ndarray]:
    """Copies of record filling POOL_BYTES, each starting 64-byte aligned."""
    arena, offsets = _arena(record)
    return [arena[o : o + record.size] for o in offsets]


def _arena(record: np.ndarray, min_copies: int = 2) -> tuple[np.ndarray, list[int]]:
    """One array holding copies of record that fill POOL_BYTES (at least `min_copies`), and
    their 64-byte aligned offsets (an expert cache's arena, in miniature)."""
    n = max(min_copies, -(-POOL_BYTES // record.size))
    stride = -(-record.size // 64) * 64
    raw = np.empty(n * stride + 64, dtype=np.uint8)
    base = (-raw.ctypes.data) % 64
    offsets = [base + i * stride for i in range(n)]
    for o in offsets:
        raw[o : o + record.size] = record
    return raw, offsets


def random_ggml(fmt: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid ggml blocks of a format gguf-py cannot quantise to: random codes and scales,
    float16 d (and dmin) of a trained model's size -> the kernel layout."""
    block_cols, block_bytes = quant.ggml_block_size(fmt)
    per_row = cols // block_cols
    raw = rng.integers(0, 256, (rows, per_row, block_bytes), dtype=np.uint8)
    lo, hi = F16_SCALE_BYTES[fmt]
    d = rng.uniform(1e-4, 1e-3, (rows, per_row, (hi - lo) // 2)).astype(np.float16)
    raw[:, :, lo:hi] = d.view(np.uint8).reshape(rows, per_row, hi - lo)
    return quant.pack_ggml(raw.reshape(rows, -1), fmt, rows, cols)


def fits(fmt: str, kind: str, a: int, b_: int) -> bool:
    """Whether a shape's matrices have whole blocks of `fmt` (K-quants: 256 columns)."""
    cols = (a, b_) if kind == "expert" else (b_,)
    width = quant.ggml_block_size(fmt)[0] if fmt in quant.GGML_FORMATS else quant.QK
    return all(c % width == 0 for c in cols) if fmt not in ("f32", "bf16") else True


def packed_matrix(fmt: str, rows: int, cols: int, rng) -> np.ndarray:
    """A rows x cols matrix of Gaussian weights in `fmt` (random valid blocks for K-quants)."""
    if fmt in quant.GGML_FORMATS:
        return random_ggml(fmt, rows, cols, rng)
    return quant.pack(rng.standard_normal((rows, cols), dtype=np.float32), fmt)


def packed_expert(fmt: str, hidden: int, inter: int, rng) -> np.ndarray:
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))  # gate, up, down
    return np.concatenate([packed_matrix(fmt, r, c, rng) for r, c in shapes])


def bench_decode_layer(
    hidden: int, inter: int, fmt: str, experts: int, n_samples: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(seconds per layer: one call per expert, seconds per layer: one batched call, bytes per
    layer) for `experts` distinct records at batch 1, cycled through a pool bigger than L3."""
    rng = np.random.default_rng(0)
    record = packed_expert(fmt, hidden, inter, rng)
    arena, offsets = _arena(record, min_copies=2 * experts)  # >= 2 layers' worth
    groups = [offsets[i : i + experts] for i in range(0, len(offsets) - experts + 1, experts)]
    x = rng.standard_normal((1, hidden), dtype=np.float32)  # [1, H]
    xs = np.repeat(x, experts, axis=0)  # [experts, H]: the same decode row for each expert
    state = {"each": 0, "batched": 0}

    def each():
        group = groups[state["each"] % len(groups)]
        state["each"] += 1
        for o in group:
            quant.expert_ffn(arena[o : o + record.size], fmt, hidden, inter, x)

    def batched():
        group = groups[state["batched"] % len(groups)]
        state["batched"] += 1
        quant.experts_ffn_b1(arena, group, fmt, hidden, inter, xs)

    one = _samples(each, n_samples, min_sample_s=0.05)
    many = _samples(batched, n_samples, min_sample_s=0.05)
    return one, many, experts * record.size


def bench_shape(
    kind: str, a: int, b_: int, fmt: str, n_samples: int
) -> tuple[dict[int, np.ndarray], int]:
    """({batch: per-call seconds samples}, packed bytes per call) for one shape/format."""
    rng = np.random.default_rng(0)
    if kind == "expert":
        hidden, inter = a, b_
        pool = _pool(packed_expert(fmt, hidden, inter, rng))
        cols = hidden

        def call(rec, x):
            return quant.expert_ffn(rec, fmt, hidden, inter, x)
    else:
        rows, cols = a, b_
        pool = _pool(packed_matrix(fmt, rows, cols, rng))

        def call(rec, x):
            return quant.matmul(rec, fmt, rows, cols, x)

    out = {}
    for batch in BATCHES:
        x = rng.standard_normal((batch, cols), dtype=np.float32)
        it = iter(())

        def step(x=x):
            nonlocal it
            rec = next(it, None)
            if rec is None:
                it = iter(pool)
                rec = next(it)
            call(rec, x)

        out[batch] = _samples(step, n_samples, min_sample_s=0.05)
    return out, pool[0].size


def warmup_times() -> tuple[float, float]:
    """(cold compile s, load-from-cache s) of quant.warmup(), in fresh child processes."""
    code = "from moeshard.moe.kernels import quant; print(quant.warmup())"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        times = []
        for _ in range(2):
            res = subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
            )
            times.append(float(res.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, default=7, help="timed samples per cell (median)")
    p.add_argument("--dram-gib", type=float, default=1.0, help="size of the DRAM probe array")
    p.add_argument("--formats", default="q4_0,q8_0", help="comma-separated weight formats")
    p.add_argument("--quick", action="store_true", help="skip the big shapes")
    p.add_argument("--no-warmup-probe", action="store_true", help="skip child-process JIT timing")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeshard bench kernels", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    fmts = [f for f in args.formats.split(",") if f]
    for f in fmts:
        if f not in quant.ALL_FORMATS:
            raise MoeshardError(f"unknown format {f!r}; choose from {quant.ALL_FORMATS}")

    cpu = _cpu_name()
    print(f"cpu: {cpu}; numba threads: {numba.get_num_threads()}; os cpus: {os.cpu_count()}")
    print(f"kernels: {cpu_level()} level, integer step {idots.ISA}")
    if not args.no_warmup_probe:
        cold, cached = warmup_times()
        print(f"JIT warm-up: cold compile {cold:.1f} s, from cache {cached:.2f} s")
    print(f"in-process warm-up: {quant.warmup():.2f} s")
    wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"numba threading layer: {numba.threading_layer()}; OMP_WAIT_POLICY={wait}")
    dram = dram_read_gbs(args.dram_gib, reps=max(3, args.samples))
    dram_mt = dram_read_gbs_threads(args.dram_gib, reps=max(3, args.samples))
    print(f"DRAM read (numpy sum over {args.dram_gib:g} GiB, median): {dram:.1f} GB/s")
    print(f"DRAM read ({numba.get_num_threads()} numba threads, median): {dram_mt:.1f} GB/s\n")

    head = f"{'shape':34} {'fmt':5} {'MB':>7}"
    for batch in BATCHES:
        head += f" {'b=' + str(batch) + ' GB/s':>10} {'ratio':>6}"
    head += f" {'b=1 best':>9} {'b=1 us':>9}"
    print(head)
    print("-" * len(head))
    shapes = SHAPES[:2] if args.quick else SHAPES
    per_weight: dict[tuple[str, str], tuple[float, int]] = {}  # (shape, fmt) -> (s, bytes)
    for label, kind, a, b_ in shapes:
        for fmt in fmts:
            if not fits(fmt, kind, a, b_):
                print(f"{label:34} {fmt:5} (no whole {fmt} blocks in its rows)")
                continue
            res, nbytes = bench_shape(kind, a, b_, fmt, args.samples)
            per_weight[(label, fmt)] = (float(np.median(res[1])), nbytes)
            line = f"{label:34} {fmt:5} {nbytes / 1e6:7.2f}"
            for batch in BATCHES:
                gbs = nbytes / float(np.median(res[batch])) / 1e9
                line += f" {gbs:10.2f} {gbs / dram:6.2f}"
            best = nbytes / float(res[1].min()) / 1e9
            line += f" {best:9.2f} {float(np.median(res[1])) * 1e6:9.1f}"
            print(line, flush=True)
    print(
        "\nGB/s = packed weight bytes per second (median); ratio = GB/s / DRAM read (numpy); "
        "'b=1 best' = fastest sample (the machine may be shared)."
    )
    if "q4_0" in fmts and len(fmts) > 1:
        print_against_q4_0(per_weight, [s[0] for s in shapes], fmts, shapes)
    experts = 16
    print(f"\ndecode layer: {experts} experts at batch 1 (a top-{experts} MoE layer)")
    head = f"{'shape':34} {'fmt':5} {'MB':>7} {'per expert':>11} {'batched':>9} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for label, kind, a, b_ in shapes:
        if kind != "expert":
            continue
        for fmt in fmts:
            if not fits(fmt, kind, a, b_):
                continue
            one, many, nbytes = bench_decode_layer(a, b_, fmt, experts, args.samples)
            t_one, t_many = float(np.median(one)), float(np.median(many))
            print(
                f"{label:34} {fmt:5} {nbytes / 1e6:7.2f} {nbytes / t_one / 1e9:11.2f}"
                f" {nbytes / t_many / 1e9:9.2f} {t_one / t_many:6.2f}",
                flush=True,
            )
    print(
        "per expert = one expert_ffn call per expert (two parallel regions each); batched = "
        "one experts_ffn_b1 call (experts split across threads); GB/s of packed bytes, medians."
    )
    return 0


def print_against_q4_0(per_weight, labels, fmts, shapes) -> None:
    """Batch 1 per format against q4_0 on the same shape: time per weight, and time per
    packed byte (a format that moves more bytes per weight may take longer per weight)."""
    weights = {label: (3 * a * b_ if kind == "expert" else a * b_) for label, kind, a, b_ in shapes}
    print("\nbatch 1 against q4_0 on the same shape (medians)")
    head = f"{'shape':34} {'fmt':5} {'bits/w':>6} {'ns/weight':>9} {'x q4_0':>7} {'time/byte':>9}"
    print(head)
    print("-" * len(head))
    for label in labels:
        t0, b0 = per_weight[(label, "q4_0")]
        for fmt in fmts:
            if (label, fmt) not in per_weight:
                continue
            t, nbytes = per_weight[(label, fmt)]
            n = weights[label]
            print(
                f"{label:34} {fmt:5} {8 * nbytes / n:6.2f} {t / n * 1e9:9.4f} {t / t0:7.2f}"
                f" {(t / nbytes) / (t0 / b0):9.2f}"
            )
    print(
        "x q4_0 = time per weight over q4_0's; time/byte = time per packed byte over q4_0's "
        "(issue 39's goal for the K-quants: at most 1.3)."
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
