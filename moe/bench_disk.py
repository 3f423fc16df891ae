"""`moeshard bench disk`: O_DIRECT random-read bandwidth by read size and queue depth.

Raw reads are `depth` threads each issuing os.preadv of `size` bytes at random aligned offsets
of a scratch file (or of given record locations) into its own aligned buffer, for a fixed
time; the figure is the median GB/s of `reps` repetitions. The last column runs the same reads
through `moe.io.ReaderPool` (the reader the expert cache uses) so its overhead shows as a
ratio to the raw disk at the same size and depth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from moe.budget import fmt_bytes, parse_size
from moe.io import ReaderPool, ReadRequest, aligned_buffer, open_direct

SIZES = "4K,64K,256K,1M,2M,8M"
DEPTHS = "1,2,4,8"


def make_scratch(path: Path, size: int) -> None:
    """A file of random bytes, written in 64 MiB chunks and fsynced."""
    if path.exists() and path.stat().st_size >= size:
        return
    rng = np.random.default_rng(0)
    chunk = 64 << 20
    with open(path, "wb") as f:
        for _ in range(0, size, chunk):
            f.write(rng.integers(0, 256, chunk, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())


def raw_read_gbps(
    targets: list[tuple[Path, int]], size: int, depth: int, seconds: float, seed: int = 0
) -> float:
    """Random O_DIRECT reads of `size` bytes at the (path, offset) targets, `depth` threads."""
    fds = {p: open_direct(p)[0] for p in {p for p, _ in targets}}
    done = [0] * depth
    stop = time.perf_counter() + seconds

    def worker(i: int) -> None:
        rng = np.random.default_rng(seed + i)
        buf = memoryview(aligned_buffer(size))
        while True:  # at least one read, even if this thread starts after `stop`
            path, off = targets[int(rng.integers(len(targets)))]
            done[i] += os.preadv(fds[path], [buf], off)
            if time.perf_counter() >= stop:
                break

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return sum(done) / elapsed / 1e9


def reader_gbps(
    targets: list[tuple[Path, int]], size: int, depth: int, seconds: float, seed: int = 0
) -> float:
    """The same random reads through ReaderPool, in batches of 2 x depth (no two adjacent),
    the next batch submitted before the previous one is waited for, so the pool never drains."""
    pool = ReaderPool(depth, merge=False)
    batch = 2 * depth
    bufs = [[aligned_buffer(size) for _ in range(batch)] for _ in range(2)]
    rng = np.random.default_rng(seed)
    total, stop = 0, time.perf_counter() + seconds
    pending: list = []
    t0 = time.perf_counter()
    i = 0
    while time.perf_counter() < stop:
        picks = rng.integers(len(targets), size=batch)
        reqs = [
            ReadRequest(targets[int(j)][0], targets[int(j)][1], size, bufs[i % 2][n])
            for n, j in enumerate(picks)
        ]
        futures = pool.submit(reqs)
        for f in pending:
            f.result()
        pending = futures
        total += size * batch
        i += 1
    for f in pending:
        f.result()
    elapsed = time.perf_counter() - t0
    pool.close()
    return total / elapsed / 1e9


def median_of(fn, reps: int, *args) -> float:
    return statistics.median(fn(*args, seed=r) for r in range(reps))


def interleaved(targets, size: int, depth: int, seconds: float, reps: int) -> tuple[float, float]:
    """Median GB/s of raw reads and of ReaderPool reads, measured alternately (a shared cloud
    disk drifts; alternating keeps the ratio honest)."""
    raw, pool = [], []
    for r in range(reps):
        raw.append(raw_read_gbps(targets, size, depth, seconds, seed=r))
        pool.append(reader_gbps(targets, size, depth, seconds, seed=r))
    return statistics.median(raw), statistics.median(pool)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="/var/tmp", help="where the scratch file goes (real disk)")
    p.add_argument("--file-size", default="4G", help="scratch file size")
    p.add_argument("--sizes", default=SIZES, help="read sizes")
    p.add_argument("--depths", default=DEPTHS, help="queue depths")
    p.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    p.add_argument("--reps", type=int, default=3, help="median of this many")
    p.add_argument("--keep", action="store_true", help="keep the scratch file")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeshard bench disk", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    file_size = parse_size(args.file_size)
    path = Path(args.dir) / "moeshard-bench-disk.bin"
    make_scratch(path, file_size)
    try:
        reader_depth = 4 if 4 in depths else depths[-1]
        head = "read size " + "".join(f"  QD{d:<2} GB/s" for d in depths)
        print(f"O_DIRECT random reads of {path} ({fmt_bytes(file_size)}), median of {args.reps}")
        print(head + f"  QD{reader_depth} raw vs reader, alternated (ratio)")
        for size in sizes:
            targets = [(path, off) for off in range(0, file_size - size + 1, size)]
            row = [
                median_of(raw_read_gbps, args.reps, targets, size, d, args.seconds) for d in depths
            ]
            raw, pool = interleaved(targets, size, reader_depth, args.seconds, args.reps)
            print(
                f"{fmt_bytes(size):>9} "
                + "".join(f"  {g:>9.3f}" for g in row)
                + f"  {raw:>6.3f} vs {pool:>6.3f} ({pool / raw:.2f})"
            )
            sys.stdout.flush()
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    return 0
