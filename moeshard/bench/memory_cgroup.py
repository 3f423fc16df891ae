"""Running a command under a hard memory cap: a fresh child cgroup (v2, or v1's memory
hierarchy) of this process's own, its OOM kills counted, and the page cache of given files
dropped first (pages already cached would not be charged to the cgroup). For
`moeshard bench compare-llamacpp`'s memory-capped rows."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CappedRun:
    returncode: int
    stdout: str
    stderr: str
    oom_killed: bool
    timed_out: bool = False


def _own_cgroup_paths() -> dict[str, str]:
    """{"v2": path} and/or {"v1": path of the memory hierarchy} from /proc/self/cgroup."""
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            found["v2"] = path
        elif "memory" in controllers.split(","):
            found["v1"] = path
    return found


def _mounts() -> dict[str, Path]:
    """{"v2": cgroup2 mount, "v1": the cgroup v1 memory hierarchy's mount}."""
    found = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, kind, options = line.split()[:4]
        if kind == "cgroup2":
            found.setdefault("v2", Path(point))
        elif kind == "cgroup" and "memory" in options.split(","):
            found["v1"] = Path(point)
    return found


def find_memory_cgroup() -> tuple[str, Path] | str:
    """("v2" | "v1", the cgroup to make children in: this process's own) or why there is none.
    Children of our own cgroup stay inside whatever limits this process already has."""
    mounts, paths = _mounts(), _own_cgroup_paths()
    reasons = []
    if "v2" in mounts and "v2" in paths:
        base = mounts["v2"] / paths["v2"].lstrip("/")
        try:
            if "memory" not in (base / "cgroup.controllers").read_text().split():
                raise OSError("no memory controller")
            if "memory" not in (base / "cgroup.subtree_control").read_text().split():
                (base / "cgroup.subtree_control").write_text("+memory")
            return "v2", base
        except OSError as exc:
            reasons.append(f"cgroup v2 at {base}: {exc.strerror or exc}")
    if "v1" in mounts:
        base = mounts["v1"] / paths.get("v1", "/").lstrip("/")
        base = base if base.is_dir() else mounts["v1"]
        if os.access(base, os.W_OK):
            return "v1", base
        reasons.append(f"cgroup v1 memory at {base}: not writable")
    return "; ".join(reasons) or "no cgroup memory controller mounted"


class MemoryCgroup:
    """A fresh child cgroup with a hard memory limit and no swap, removed on exit."""

    def __init__(self, version: str, parent: Path, limit: int) -> None:
        self.version, self.limit = version, limit
        self.path = parent / f"moeshard-bench-{os.getpid()}-{time.monotonic_ns()}"

    def __enter__(self) -> MemoryCgroup:
        self.path.mkdir()
        try:
            if self.version == "v2":
                (self.path / "memory.max").write_text(str(self.limit))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
        except BaseException:
            self.path.rmdir()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # the last task may take a moment to leave
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def run(self, cmd: Sequence[str], env: dict | None = None, timeout_s: float = 900) -> CappedRun:
        """cmd inside the cgroup: a shell joins it and execs cmd (so nothing this process
        allocated, and no fork of a threaded interpreter, is involved)."""
        procs = self.path / "cgroup.procs"
        wrapped = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *cmd]
        try:
            proc = subprocess.run(
                wrapped, capture_output=True, text=True, env=env, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            return CappedRun(-9, str(exc.stdout or ""), str(exc.stderr or ""), False, True)
        return CappedRun(proc.returncode, proc.stdout, proc.stderr, self.oom_kills() > 0)


def drop_page_cache(paths: Sequence[Path]) -> None:
    """Evict these files' pages from the page cache. A page already cached was charged to the
    cgroup that read it first; a capped run touching it would not be charged, and the cap
    would not cap."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def model_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
