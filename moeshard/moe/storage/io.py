"""Page-cache-bypassing reads: aligned buffers, an O_DIRECT reader pool, read coalescing.

Why O_DIRECT: a buffered read leaves a second copy of every expert in the page cache, which
competes with our own cache for the same RAM, so a RAM budget would be a fiction. O_DIRECT
needs the file offset, the length and the buffer address aligned (4096 covers every device
here); shard records and trunk tensors start at 4096-byte boundaries and every destination is
a slice of an mmap'd (page-aligned) arena whose slots are multiples of 4096 bytes.

Where the filesystem refuses O_DIRECT (tmpfs, some overlays), files are opened buffered and
each read is followed by posix_fadvise(DONTNEED) so the page cache does not keep it; this is
logged once per process.

Coalescing: the misses of one layer are sorted by (file, offset) and runs of adjacent records
become one `preadv` whose iovecs point at the (non-contiguous) destination slots, so the disk
sees one large request instead of several small ones.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeshard.moe.errors import MoeshardError, StoreError

try:  # ISA-L's crc32 is ~10x zlib's (9 vs 0.8 GB/s here): checksums must keep up with the disk
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - the same function, slower
    from zlib import crc32 as _crc32

log = logging.getLogger(__name__)


def crc32(data) -> int:
    """zlib-compatible CRC-32 of a bytes-like object (releases the GIL on large buffers)."""
    return _crc32(data) & 0xFFFFFFFF


BLOCK = 4096  # O_DIRECT alignment for offsets, lengths and buffer addresses
MAX_MERGE_BYTES = 8 << 20  # one coalesced read never exceeds this
MAX_IOV = 512  # below the kernel's IOV_MAX (1024)

_fallback_reported = False
_fallback_lock = threading.Lock()


def align_up(n: int, alignment: int = BLOCK) -> int:
    return (n + alignment - 1) // alignment * alignment


HUGE_PAGE = 2 << 20


def aligned_buffer(nbytes: int, huge: bool = False) -> np.ndarray:
    """A page-aligned, zero-filled uint8 [nbytes] array backed by an anonymous mmap.

    Anonymous mmaps are page-aligned by construction; the pages are committed on first touch.
    huge: weights the kernels stream (an in-RAM model's experts and trunk): the array starts
    on a 2 MiB boundary and the mapping asks for transparent huge pages (MADV_HUGEPAGE: the
    kernel's default "madvise" mode gives them only where asked).  Measured on a 2-vCPU Xeon
    VM, two threads summing 2 MiB pieces of 960 MiB from DRAM: 12.6 GB/s on 4 KiB pages, 22.1
    on huge ones (a TLB miss is a two-level page walk in a VM).  Where the kernel has no THP
    the advice is ignored and the buffer is as without it.
    """
    nbytes = max(align_up(nbytes), BLOCK)
    if not huge or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(buf, dtype=np.uint8)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: plain pages
        pass
    whole = np.frombuffer(buf, dtype=np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE
    return whole[skip : skip + nbytes]


def open_direct(path: str | Path) -> tuple[int, bool]:
    """Open `path` read-only with O_DIRECT if the filesystem allows; returns (fd, direct)."""
    global _fallback_reported
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError as exc:
        if exc.errno != 22:  # EINVAL is how filesystems refuse O_DIRECT
            raise StoreError(f"{path}: cannot open ({exc.strerror})") from None
    with _fallback_lock:
        if not _fallback_reported:
            log.warning(
                "%s: O_DIRECT refused by the filesystem; using buffered reads with "
                "posix_fadvise(DONTNEED) (the page cache may briefly hold expert data)",
                path,
            )
            _fallback_reported = True
    try:
        return os.open(path, os.O_RDONLY), False
    except OSError as exc:
        raise StoreError(f"{path}: cannot open ({exc.strerror})") from None


# -- writes: every byte a writer puts on disk goes through write_all, and every way a write can
# run out of room becomes one DiskFullError naming the file (see `out_of_space`) ------------

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, file size limit


class DiskFullError(MoeshardError):
    """A write ran out of room (disk full, quota, file size limit); names the file."""


def out_of_space(exc: BaseException, where: str | Path) -> DiskFullError | None:
    """The one-line error for an out-of-room OSError (ENOSPC, EDQUOT, EFBIG), naming the file
    (`exc.filename`, else `where`); None for any other exception."""
    if not isinstance(exc, OSError) or exc.errno not in NO_ROOM:
        return None
    reason = os.strerror(exc.errno)
    reason = reason[:1].lower() + reason[1:]  # "no space left on device"
    return DiskFullError(f"{reason} writing {exc.filename or where}")


def with_filename(exc: OSError, path: str | Path) -> OSError:
    """`exc` with `path` as its filename (os.write and friends do not set one)."""
    if exc.filename is None and exc.errno is not None:
        return OSError(exc.errno, exc.strerror, str(path))
    return exc


def write_all(f, data, path: str | Path, offset: int | None = None) -> int:
    """Write all of `data` (bytes-like or contiguous array) to the raw file `f` (an unbuffered
    file object or an fd), at `offset` (pwrite) or at the current position; returns the byte
    count. A short write is continued where it stopped (the next write then reports a full
    disk as ENOSPC); OSErrors carry `path` as their filename."""
    fd = f if isinstance(f, int) else f.fileno()
    view = memoryview(data).cast("B")
    done = 0
    try:
        while done < len(view):
            if offset is None:
                n = os.write(fd, view[done:])
            else:
                n = os.pwrite(fd, view[done:], offset + done)
            if n <= 0:  # a regular file never does this unless it cannot grow
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += n
    except OSError as exc:
        raise with_filename(exc, path) from None
    return done


def check_output_file(path: str | Path, label: str = "") -> None:
    """Refuse, naming it (after `label`, e.g. an option), an output path that cannot be
    written as a file: an existing directory, a parent that is missing, not a directory, or
    not writable. Checked before the work that produces the file, so none of it is lost."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise MoeshardError(f"{label}{path}: is a directory")
    if not parent.exists():
        raise MoeshardError(f"{label}{path}: no such directory {parent}")
    if not parent.is_dir():
        raise MoeshardError(f"{label}{path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise MoeshardError(f"{label}{path}: cannot write in {parent}")


def write_file(path: str | Path, data: bytes) -> None:
    """Create (or truncate) `path` and write `data` to it (through write_all)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise with_filename(exc, path) from None
    try:
        write_all(fd, data, path)
    finally:
        os.close(fd)


def copy_file(src: str | Path, dst: str | Path) -> None:
    """shutil.copyfile, with the destination named in an OSError that lacks a filename
    (the kernel-side copy paths raise ENOSPC without one)."""
    try:
        shutil.copyfile(src, dst)
    except OSError as exc:
        raise with_filename(exc, dst) from None


@dataclass
class ReadRequest:
    """Read `nbytes` at `offset` of `path` into `dest` (uint8, >= align_up(nbytes) long).

    `key` names the record in errors and results, `crc` (if not None) is checked after the read.
    """

    path: Path
    offset: int  # multiple of BLOCK
    nbytes: int
    dest: np.ndarray  # page-aligned uint8 view, length a multiple of BLOCK
    key: object = None
    crc: int | None = None


@dataclass
class ReadStats:
    bytes_read: int = 0  # payload bytes (records), excluding alignment padding
    reads: int = 0  # syscalls issued (one per coalesced run)
    records: int = 0
    read_s: float = 0.0  # summed wall time of the reads (can exceed elapsed with depth > 1)


class ReaderPool:
    """A thread pool issuing O_DIRECT preadv calls, `depth` of them in flight at most.

    `submit(requests)` sorts and coalesces the requests and returns one Future per request
    (in the input order); a Future's result is the request's key, or it raises StoreError
    naming the file and the record on a short read or a checksum mismatch.
    """

    def __init__(self, depth: int = 4, direct: bool = True, merge: bool = True):
        if depth < 1:
            raise ValueError("read depth must be at least 1")
        self.depth, self.direct, self.merge = depth, direct, merge
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="moeshard-io")
        self.fds: dict[Path, tuple[int, bool]] = {}
        self.stats = ReadStats()
        self.timeline: list[tuple[float, float, int]] | None = None  # see record_timeline
        self._lock = threading.Lock()

    def record_timeline(self) -> None:
        """From now on keep (start, end, bytes) of every read, for `busy_throughput`."""
        with self._lock:
            self.timeline = []

    def fd(self, path: Path) -> tuple[int, bool]:
        path = Path(path)
        if path not in self.fds:
            if self.direct:
                self.fds[path] = open_direct(path)
            else:
                self.fds[path] = (os.open(path, os.O_RDONLY), False)
        return self.fds[path]

    def plan(self, requests: Sequence[ReadRequest]) -> list[list[int]]:
        """Group request indices into runs of adjacent records, each run one read."""
        order = sorted(
            range(len(requests)), key=lambda i: (str(requests[i].path), requests[i].offset)
        )
        runs: list[list[int]] = []
        end, size = None, 0
        for i in order:
            r = requests[i]
            span = align_up(r.nbytes)
            if (
                self.merge
                and runs
                and end == (r.path, r.offset)
                and size + span <= MAX_MERGE_BYTES
                and len(runs[-1]) < MAX_IOV
            ):
                runs[-1].append(i)
                size += span
            else:
                runs.append([i])
                size = span
            end = (r.path, r.offset + span)
        return runs

    def submit(self, requests: Sequence[ReadRequest]) -> list[Future]:
        futures: list[Future | None] = [None] * len(requests)
        for run in self.plan(requests):
            group = [requests[i] for i in run]
            done = self.pool.submit(self._read_run, group)
            for j, i in enumerate(run):
                futures[i] = _Slice(done, j)
        return futures  # type: ignore[return-value]

    def read(self, requests: Sequence[ReadRequest]) -> None:
        """Submit and wait for all (raises the first error)."""
        for f in self.submit(requests):
            f.result()

    def _read_run(self, group: list[ReadRequest]) -> list:
        first = group[0]
        fd, direct = self.fd(first.path)
        views = [memoryview(r.dest[: align_up(r.nbytes)]) for r in group]
        want = sum(len(v) for v in views)
        t0 = time.perf_counter()
        try:
            got = os.preadv(fd, views, first.offset)
        except OSError as exc:
            raise StoreError(
                f"{first.path}: read of {want} bytes at {first.offset} failed ({exc.strerror})"
            ) from None
        if not direct:
            os.posix_fadvise(fd, first.offset, want, os.POSIX_FADV_DONTNEED)
        elapsed = time.perf_counter() - t0
        # The last record of a file may end before its aligned span (EOF): that is fine.
        need = want - (align_up(group[-1].nbytes) - group[-1].nbytes)
        results: list[StoreError | None] = [None] * len(group)
        if got < need:
            bad = group[0]
            raise StoreError(
                f"{bad.path}: short read ({got} of {need} bytes) at record {_name(bad.key)}"
            )
        for j, r in enumerate(group):
            if r.crc is not None:
                if crc32(views[j][: r.nbytes]) != r.crc:
                    results[j] = StoreError(
                        f"{r.path}: checksum mismatch in {_name(r.key)} (record corrupted)"
                    )
        payload = sum(r.nbytes for r in group)
        with self._lock:
            self.stats.bytes_read += payload
            self.stats.reads += 1
            self.stats.records += len(group)
            self.stats.read_s += elapsed
            if self.timeline is not None:
                self.timeline.append((t0, t0 + elapsed, payload))
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()


@dataclass
class Busy:
    """How a stretch of reads used the device: see `busy_throughput`."""

    share: float  # of the wall time, with at least one read in flight
    gbps: float  # bytes moved / time with at least one read in flight
    in_flight: float  # mean reads in flight while busy
    reads: int


def busy_throughput(timeline: list[tuple[float, float, int]], start: float, end: float) -> Busy:
    """The device as a run saw it, from the reads that started in [start, end): the union of
    their (start, end) intervals is the busy time. Unlike a separate measurement window this
    is the disk at the very moments the run was reading."""
    reads = sorted(r for r in timeline if start <= r[0] < end)
    busy = in_flight = 0.0
    run_start = run_end = None
    for s, e, _ in reads:
        in_flight += e - s
        if run_end is None or s > run_end:
            busy += 0.0 if run_end is None else run_end - run_start
            run_start, run_end = s, e
        else:
            run_end = max(run_end, e)
    if not reads:
        return Busy(0.0, float("nan"), 0.0, 0)
    busy += run_end - run_start
    moved = sum(n for *_, n in reads)
    return Busy(busy / (end - start), moved / busy / 1e9, in_flight / busy, len(reads))


def _name(key) -> str:
    if isinstance(key, tuple) and len(key) == 2:
        return f"expert {key[1]} of layer {key[0]}"
    return str(key)


class _Slice:
    """The per-request view of a coalesced read's Future: result() returns nothing or raises."""

    def __init__(self, run: Future, index: int):
        self.run, self.index = run, index

    def done(self) -> bool:
        return self.run.done()

    def result(self, timeout: float | None = None) -> None:
        err = self.run.result(timeout)[self.index]
        if err is not None:
            raise err
