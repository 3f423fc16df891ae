"""Appending to a ledger: `LedgerWriter` (synchronous) and `BackgroundLedger` (a thread and a
queue, so a caller on a hot path only enqueues).

Each append takes an exclusive flock on the file, continues the chain from the file's current
last line (re-read only when another process appended since: two daemons sharing a key share
the default ledger), and writes the whole line, newline included, with one write() to a file
opened O_APPEND. A short write is cut back off. The file is created, with its 'open' entry,
on the first append, so a process that never records anything leaves no file behind.

An existing file is checked at its head and tail before anything is appended: the first line
must be an 'open' entry of this writer's key, the last line must be signed by the owner and
chained to the line before it. The rest is `verify`'s job. A torn last line (no newline: the
process died mid-write, e.g. a node killed by SIGKILL or the OOM killer) is the one damage a
writer mends by itself, so that a node restarts unattended: its bytes are appended to
``<ledger>.torn`` (kept, not lost) and cut off the ledger, with a warning; the entry never
completed, so no whole entry is lost.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from moeshard.moe.identity.keys import Identity, home
from moeshard.moe.ledger.entry import (
    GENESIS,
    MAX_LINE,
    ROLES,
    BadEntry,
    LedgerError,
    check_open,
    check_signature,
    line_hash,
    make_line,
    open_body,
    parse_line,
)

log = logging.getLogger(__name__)
LEDGER_DIR = "ledger"  # under moe.identity.keys.home()


def default_path(owner_id: str, role: str) -> Path:
    """Where a process keeps its ledger when not told: home()/ledger/ROLE-IDPREFIX.jsonl."""
    return home() / LEDGER_DIR / f"{role}-{owner_id[:8]}.jsonl"


def first_line(fd: int) -> bytes:
    head = os.pread(fd, MAX_LINE + 1, 0)
    end = head.find(b"\n")
    return head[: end if end >= 0 else len(head)]


def last_lines(fd: int, size: int, n: int = 2) -> list[bytes]:
    """Up to the last `n` lines (without their newlines, oldest first) of a file of `size`
    bytes that ends with a newline. BadEntry if one is longer than MAX_LINE."""
    data, start = b"", size
    while start > 0 and data.count(b"\n") <= n:
        if size - start > (n + 1) * (MAX_LINE + 1):
            raise BadEntry(f"a line longer than {MAX_LINE} bytes")
        read = min(1 << 16, start)
        start -= read
        data = os.pread(fd, read, start) + data
    lines = data[:-1].split(b"\n")
    return (lines[1:] if start > 0 else lines)[-n:]


def torn_tail(fd: int, size: int) -> int:
    """Bytes after the last newline of a file of `size` bytes (its torn last line)."""
    start = size
    while start > 0:
        read = min(1 << 16, start)
        start -= read
        at = os.pread(fd, read, start).rfind(b"\n")
        if at >= 0:
            return size - (start + at + 1)
    return size


class LedgerWriter:
    """Appends signed, chained entries to one ledger file owned by `identity`. Thread-safe."""

    def __init__(self, path: str | Path, identity: Identity, role: str):
        if role not in ROLES:
            raise ValueError(f"role {role}: one of {ROLES}")
        self.path, self.identity, self.role = Path(path), identity, role
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.end = -1  # file size after our last append (-1: not read yet)
        self.seq, self.prev = 0, GENESIS  # of the next entry
        if self.path.exists():  # refuse a bad file now, not at the first append
            self._open()
            size = os.fstat(self.fd).st_size
            self._load(size)
            self.end = size

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise LedgerError(f"{self.path}: cannot open the ledger ({exc.strerror})") from None

    def _set_aside_torn_tail(self, size: int) -> int:
        """Move the bytes after the last newline to <ledger>.torn; returns the new size."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(self.fd).st_size  # (another writer may have mended it meanwhile)
            tail = torn_tail(self.fd, size)
            if tail == 0:
                return size
            torn = os.pread(self.fd, tail, size - tail)
            aside = self.path.with_name(self.path.name + ".torn")
            try:
                fd = os.open(aside, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, torn + b"\n")
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.ftruncate(self.fd, size - tail)
            except OSError as exc:
                raise LedgerError(
                    f"{self.path}: the last entry is incomplete (a crash mid-write?) and could "
                    f"not be set aside ({exc.strerror}); to continue, remove it: "
                    f"truncate -s {size - tail} {self.path}"
                ) from None
            log.warning(
                "%s: its last entry was incomplete (a crash mid-write); its %d bytes were moved "
                "to %s and the ledger continues from the entry before",
                self.path, tail, aside.name,
            )  # fmt: skip
            return size - tail
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _load(self, size: int) -> None:
        """Continue the chain of an existing file (see the module's docstring)."""
        if size == 0:
            self.seq, self.prev = 0, GENESIS
            return
        if os.pread(self.fd, 1, size - 1) != b"\n":
            size = self._set_aside_torn_tail(size)
            if size == 0:
                self.seq, self.prev = 0, GENESIS
                return
        try:
            owner_pk, role = check_open(parse_line(first_line(self.fd)))
            if owner_pk != self.identity.public_raw:
                raise LedgerError(
                    f"{self.path}: this ledger belongs to another key; this process is "
                    f"{self.identity.id} (use another --ledger file)"
                )
            if role != self.role:
                raise LedgerError(f"{self.path}: a {role}'s ledger, not a {self.role}'s")
            lines = last_lines(self.fd, size)
            last = parse_line(lines[-1])
            check_signature(last, owner_pk)
            if len(lines) == 2 and last["prev"] != line_hash(lines[0]):
                raise BadEntry("its last entry is not chained to the one before it")
        except BadEntry as exc:
            raise LedgerError(
                f"{self.path}: not a ledger that verifies at its head and tail ({exc}); "
                f"`moeshard ledger verify {self.path}` names the bad entry"
            ) from None
        self.seq, self.prev = last["seq"] + 1, line_hash(lines[-1])

    def append(self, kind: str, body: dict, sync: bool = False) -> int:
        """Append one entry (after the 'open' entry if the file is new); its seq. `sync`:
        fsync before returning."""
        with self.lock:
            if self.fd is None:
                self._open()
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(self.fd).st_size
                if size != self.end:  # first append, or another process appended meanwhile
                    self._load(size)
                data, seq, prev = b"", self.seq, self.prev
                if seq == 0:
                    line = make_line(
                        self.identity, 0, prev, "open", open_body(self.identity, self.role)
                    )
                    data, seq, prev = line + b"\n", 1, line_hash(line)
                line = make_line(self.identity, seq, prev, kind, body)
                data += line + b"\n"
                self._write(data, size)
                if sync:
                    os.fsync(self.fd)
                self.end, self.seq, self.prev = size + len(data), seq + 1, line_hash(line)
                return seq
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _write(self, data: bytes, size: int) -> None:
        try:
            written = os.write(self.fd, data)
        except OSError as exc:
            written, why = -1, exc.strerror
        else:
            why = f"short write ({written} of {len(data)} bytes)"
        if written != len(data):
            if written > 0:
                os.ftruncate(self.fd, size)  # never leave a torn line behind
            raise LedgerError(f"{self.path}: cannot append ({why})")

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                try:
                    os.fsync(self.fd)
                finally:
                    os.close(self.fd)
                    self.fd = None


class BackgroundLedger:
    """A LedgerWriter behind a queue and one thread: `append` and `submit` return at once; the
    thread runs the jobs in order. A failed job is logged (and counted in `errors`); callers
    that must know wait on the Future."""

    def __init__(self, writer: LedgerWriter):
        self.writer = writer
        self.path = writer.path
        self.errors = 0
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="ledger", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[LedgerWriter], object]) -> Future:
        """Run `job(writer)` on the ledger's thread, after everything submitted before it."""
        future: Future = Future()
        self.queue.put((job, future))
        return future

    def append(self, kind: str, body: dict, sync: bool = False) -> Future:
        return self.submit(lambda w: w.append(kind, body, sync))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far is done."""
        self.submit(lambda w: None).result(timeout)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            job, future = item
            try:
                future.set_result(job(self.writer))
            except Exception as exc:  # a job must never stop the thread
                self.errors += 1
                if self.errors == 1 or self.errors & (self.errors - 1) == 0:
                    log.error("ledger %s: %s (%d errors)", self.path, exc, self.errors)
                future.set_exception(exc)

    def close(self) -> None:
        """Finish the queued jobs, then fsync and close the file."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        self.writer.close()


def open_ledger(path: str | Path | None, identity: Identity, role: str) -> BackgroundLedger:
    """A background ledger at `path`, or at the default place for this key and role."""
    return BackgroundLedger(LedgerWriter(path or default_path(identity.id, role), identity, role))
