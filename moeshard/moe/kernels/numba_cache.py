"""Where numba keeps the compiled kernels: one directory per version of the kernels' sources.

numba keys a cached function on its own file's path and time stamp alone.  A kernel that
calls or inlines a function of another file keeps the code it was compiled with when only
that other file changes: after a `git pull` or an edit that changed `fused.py` but not
`fused_layer.py`, `decode_layers` ran the old attention while the step-by-step path ran the
new one (their logits differed in the last bits, and tests/test_batching.py failed), and a
node whose expert kernels were stale so would compute another arithmetic than the
`build.kernel_build` it reports, and fail honest audits.  numba's own advice is to clear
the cache by hand.

So, unless the user names a cache (NUMBA_CACHE_DIR: the container image does), the kernels
are cached under $MOESHARD_CACHE (default ~/.cache/moeshard) in numba/<digest>, the digest
of every moeshard source file that mentions numba: any change to any of them compiles
everything once, in a fresh directory.  The directories of other versions are removed once
they have not been used for a day, keeping the last few (`KEEP`).

Every cache file is read and written under a lock (`lock_cache_files`): numba's own files are
not safe for several processes at once, and a node, its siblings and a coordinator all compile
the same kernels on a cold cache.  See `LockedIndexDataCacheFile`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path

import numba.core.caching
import numba.core.config

PACKAGE = Path(__file__).resolve().parents[2]  # moeshard/
KEEP = 3  # other versions' caches kept however old (switching branches back and forth)
STALE_S = 24 * 3600  # older ones than this are removed


def source_digest(root: Path = PACKAGE) -> str:
    """16 hex digits: the relative paths and bytes of every .py file under `root` whose text
    mentions numba (a file that does not cannot define or change a kernel)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        text = path.read_bytes()
        if b"numba" in text:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(text).digest())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """$MOESHARD_CACHE/numba, else ~/.cache/moeshard/numba."""
    return Path(os.environ.get("MOESHARD_CACHE") or "~/.cache/moeshard").expanduser() / "numba"


def use_source_keyed_cache() -> Path | None:
    """Point numba's cache at cache_root()/source_digest() (made if absent; its time stamp
    renewed: it is in use) unless NUMBA_CACHE_DIR is set; remove the stale directories of
    other versions.  -> the directory, or None where the user's or numba's default stands
    (a cache directory that cannot be made leaves numba's default)."""
    if numba.core.config.CACHE_DIR:  # (NUMBA_CACHE_DIR, read when numba was imported)
        return None
    here = cache_root() / source_digest()
    try:
        here.mkdir(parents=True, exist_ok=True)
        os.utime(here)
    except OSError:
        return None
    numba.core.config.CACHE_DIR = str(here)
    prune(here.parent, keep=here)
    return here


def prune(root: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove the directories under `root` but `keep` and the KEEP most recently used
    others, of those unused for STALE_S -> the removed ones.  (A process of an old version
    still running keeps its compiled code in memory; at worst it cannot save a new one.)"""
    now = time.time() if now is None else now
    try:
        others = [p for p in root.iterdir() if p.is_dir() and p != keep]
    except OSError:
        return []
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    for path in others[KEEP:]:
        if now - path.stat().st_mtime > STALE_S:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class LockedIndexDataCacheFile(numba.core.caching.IndexDataCacheFile):
    """numba's index-and-data cache of one function, read and written under a file lock.

    numba saves a compiled overload by reading the function's index, picking the first free
    data file name, writing the index, then the data.  Two processes compiling two overloads
    of one function at once (say, for arrays of two layouts) can both pick `f.1.nbc`: the
    index then names one overload's data file while it holds the other's machine code
    (tests/test_numba_cache.py times this).  A process loading that entry runs code compiled
    for other argument types on its arguments (numba issue 4807: segfaults).  A reader can
    also meet an index written a moment before its data, whose file may still hold another
    overload's code from a stale version of the source.  (The likely cause of the segfaults
    of two fresh-clone test suites in `quant.warmup`, while node processes compiled the same
    kernels beside it: stop 58.)  Here a save holds an exclusive
    lock on `<index>.lock` from reading the index to writing the data, and a load a shared
    one from reading the index to reading the data: every entry read names its own code."""

    def save(self, key, data):
        with _locked(self._index_path, fcntl.LOCK_EX):
            super().save(key, data)

    def load(self, key):
        with _locked(self._index_path, fcntl.LOCK_SH):
            return super().load(key)


@contextlib.contextmanager
def _locked(index_path: str, how: int):
    """Hold flock(how) on index_path + '.lock' (made if absent).  Where the lock file cannot
    be made or locked (a read-only cache, such as a container image's, that nobody saves to;
    a file system without locks) the cache is used as numba alone would use it."""
    try:
        fd = os.open(index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # (which releases the lock)


def lock_cache_files() -> None:
    """Make numba cache every function created from now on through
    `LockedIndexDataCacheFile` (numba's `Cache` makes its file object from this module
    attribute when a `cache=True` function is defined)."""
    numba.core.caching.IndexDataCacheFile = LockedIndexDataCacheFile
