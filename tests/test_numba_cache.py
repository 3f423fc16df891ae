"""numba's cache goes to a directory of the kernels' source version (`numba_cache`): any change
to a file that mentions numba gives a fresh one (numba alone kept kernels compiled against an
older version of a function in another file), NUMBA_CACHE_DIR still wins, and other versions'
directories go once stale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from moeshard.moe.kernels import numba_cache


def _tree(root):
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "inner.py").write_text(
        "from numba import njit\n\n@njit\ndef f(x):\n    return x\n"
    )
    (root / "kernels" / "outer.py").write_text("import numba\nfrom kernels.inner import f\n")
    (root / "cli.py").write_text("print('no kernels here')\n")


def test_the_digest_follows_every_file_that_mentions_numba(tmp_path):
    _tree(tmp_path)
    first = numba_cache.source_digest(tmp_path)
    assert first == numba_cache.source_digest(tmp_path) and len(first) == 16
    (tmp_path / "cli.py").write_text("print('still none')\n")  # no numba: no new cache
    assert numba_cache.source_digest(tmp_path) == first
    inner = tmp_path / "kernels" / "inner.py"  # the callee alone changes: a new cache
    inner.write_text(inner.read_text().replace("return x", "return x + 1"))
    second = numba_cache.source_digest(tmp_path)
    assert second != first
    shutil.move(inner, tmp_path / "kernels" / "moved.py")  # the same text elsewhere
    assert numba_cache.source_digest(tmp_path) not in (first, second)


def _cache_dir_of_a_new_process(env) -> str:
    code = "import moeshard.moe.kernels, numba; print(numba.core.config.CACHE_DIR)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_a_process_caches_under_its_source_version_unless_told(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["MOESHARD_CACHE"] = str(tmp_path / "cache")
    want = tmp_path / "cache" / "numba" / numba_cache.source_digest()
    assert _cache_dir_of_a_new_process(env) == str(want)
    assert want.is_dir()
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")  # the user's choice stands
    assert _cache_dir_of_a_new_process(env) == str(tmp_path / "mine")


def test_other_versions_go_once_stale_but_the_last_few(tmp_path):
    now = 1_000_000_000.0
    current = tmp_path / "current"
    current.mkdir()
    ages = {f"v{i}": i * 3600.0 for i in range(8)}  # v0 newest ... v7 seven hours old
    ages["fresh-but-many"] = 60.0
    for name, age in ages.items():
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age, now - age))
    stale = 5 * 3600.0  # (STALE_S, shortened for the test)
    old, numba_cache.STALE_S = numba_cache.STALE_S, stale
    try:
        removed = numba_cache.prune(tmp_path, keep=current, now=now)
    finally:
        numba_cache.STALE_S = old
    # kept: the current one, the KEEP most recently used others, and any used within STALE_S
    kept = {p.name for p in tmp_path.iterdir()}
    by_use = sorted(ages, key=ages.get)
    want = {"current", *by_use[: numba_cache.KEEP]} | {n for n, a in ages.items() if a <= stale}
    assert kept == want
    assert {p.name for p in removed} == set(ages) - want and removed
