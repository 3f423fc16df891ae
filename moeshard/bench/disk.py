"""`moeshard bench disk`: O_DIRECT random-read bandwidth by read size and queue depth.

Raw reads are `depth` threads each issuing os.preadv of `size` bytes at random aligned offsets
of a scratch file (or of given record locations) into its own aligned buffer, for a fixed
time; the figure is the median GB/s of `reps` repetitions. The last column runs the same reads
through `moeshard.moe.io.ReaderPool` (the reader the expert cache uses) so its overhead shows as a
ratio to the raw disk at the same size and depth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.analysis.disk import write_disk_profile
from moeshard.moe.errors import MoeshardError
from moeshard.moe.storage.io import ReaderPool, ReadRequest, aligned_buffer, open_direct
from moeshard.moe.units import fmt_bytes, parse_size

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
        rng = np.random.default_rng([seed, i])  # its own stream per window and thread
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
    targets: list[tuple], size: int, depth: int, seconds: float, seed: int = 0
) -> float:
    """The same random reads through ReaderPool, in batches of 2 x depth (no two adjacent),
    the next batch submitted before the previous one is waited for, so the pool never drains.

    Targets given as (path, offset, nbytes, crc32) are read and verified the way the expert
    cache reads them (the checksum is part of the reader's cost); (path, offset) targets are
    read unverified. Either way `size` bytes per read are counted, like `raw_read_gbps`."""
    pool = ReaderPool(depth, merge=False)
    batch = 2 * depth
    bufs = [[aligned_buffer(size) for _ in range(batch)] for _ in range(2)]
    rng = np.random.default_rng([seed, 1 << 16])  # never a raw window's stream
    total, stop = 0, time.perf_counter() + seconds
    pending: list = []
    t0 = time.perf_counter()
    i = 0
    while time.perf_counter() < stop:
        picks = rng.integers(len(targets), size=batch)
        reqs = [_request(targets[int(j)], size, bufs[i % 2][n]) for n, j in enumerate(picks)]
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


def _request(target: tuple, size: int, buf: np.ndarray) -> ReadRequest:
    if len(target) == 4:
        path, offset, nbytes, crc = target
        return ReadRequest(path, offset, nbytes, buf, (path, offset), crc)
    path, offset = target
    return ReadRequest(path, offset, size, buf)


def median_of(fn, reps: int, *args) -> float:
    return statistics.median(fn(*args, seed=r) for r in range(reps))


@dataclass
class Alternated:
    raw: float  # median GB/s of the raw windows
    pool: float  # median GB/s of the reader windows
    ratio: float  # median over window pairs of reader / raw
    pairs: int  # raw/reader window pairs measured


def interleaved(targets, size: int, depth: int, seconds: float, reps: int) -> Alternated:
    """Raw reads and ReaderPool reads in short alternating windows (raw, reader, raw, ...).

    A shared cloud disk drifts by tens of percent over seconds; comparing each reader window
    with the raw window just before it, and taking the median of those ratios, keeps the
    reader's overhead from drowning in that drift. Raw windows read (path, offset) only."""
    raw, pool, ratios = [], [], []
    plain = [t[:2] for t in targets]
    for r in range(reps):
        raw.append(raw_read_gbps(plain, size, depth, seconds, seed=r))
        pool.append(reader_gbps(targets, size, depth, seconds, seed=r))
        ratios.append(pool[-1] / raw[-1])
    return Alternated(
        statistics.median(raw), statistics.median(pool), statistics.median(ratios), reps
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="/var/tmp", help="where the scratch file goes (real disk)")
    p.add_argument("--file-size", default="4G", help="scratch file size")
    p.add_argument("--sizes", default=SIZES, help="read sizes")
    p.add_argument("--depths", default=DEPTHS, help="queue depths")
    p.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    p.add_argument("--reps", type=int, default=3, help="median of this many")
    p.add_argument("--keep", action="store_true", help="keep the scratch file")
    p.add_argument(
        "--profile-out",
        metavar="FILE",
        help="also write the measured points as a disk profile for `moeshard simulate --disk`",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeshard bench disk", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    file_size = parse_size(args.file_size)
    if args.profile_out and not Path(args.profile_out).resolve().parent.is_dir():
        raise MoeshardError(f"--profile-out {args.profile_out}: no such directory")
    path = Path(args.dir) / "moeshard-bench-disk.bin"
    make_scratch(path, file_size)
    try:
        reader_depth = 4 if 4 in depths else depths[-1]
        points = []  # [read bytes, depth, GB/s]: a `moeshard.moe.analysis.disk.Disk` profile
        head = "read size " + "".join(f"  QD{d:<2} GB/s" for d in depths)
        print(f"O_DIRECT random reads of {path} ({fmt_bytes(file_size)}), median of {args.reps}")
        print(head + f"  QD{reader_depth} raw vs reader, alternated (ratio)")
        for size in sizes:
            targets = [(path, off) for off in range(0, file_size - size + 1, size)]
            row = [
                median_of(raw_read_gbps, args.reps, targets, size, d, args.seconds) for d in depths
            ]
            points += [[size, d, g] for d, g in zip(depths, row, strict=True)]
            alt = interleaved(targets, size, reader_depth, args.seconds, 2 * args.reps + 1)
            print(
                f"{fmt_bytes(size):>9} "
                + "".join(f"  {g:>9.3f}" for g in row)
                + f"  {alt.raw:>6.3f} vs {alt.pool:>6.3f} ({alt.ratio:.2f})"
            )
            sys.stdout.flush()
        if args.profile_out:
            write_disk_profile(Path(args.profile_out), points)
            print(f"wrote {args.profile_out}: use it with moeshard simulate TRACE --disk FILE")
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    return 0
