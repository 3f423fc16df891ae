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
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

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
