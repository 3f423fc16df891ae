"""numba's cache goes to a directory of the kernels' source version (`numba_cache`): any change
to a file that mentions numba gives a fresh one (numba alone kept kernels compiled against an
older version of a function in another file), NUMBA_CACHE_DIR still wins, other versions'
directories go once stale, and processes compiling one kernel at once leave each overload its
own code (the cache's files are locked)."""

from __future__ import annotations

import os
import pickle
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


_RACE_MODULE = """
from numba import njit


@njit(cache=True)
def f(x):
    return x[0] + 1
"""

# One of N processes compiling `f` of RACE_MODULE for its own dtype into a shared, cold cache.
# They meet at a barrier when they come to save; from there, the cache's writes are timed so
# that the N read the empty index together, write their indexes in the order 0..N-1 and their
# data files in the order N-1..0 (unless a lock makes them take turns).
_RACE_CHILD = """
import importlib, os, sys, time
from pathlib import Path
import numpy as np
from numba.core import caching
if os.environ["RACE_LOCK"] == "1":
    import moeshard.moe.kernels  # noqa: F401  (locks the cache files)
i, n, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
barrier = Path(os.environ["RACE_DIR"]) / "barrier"
numba_own = caching.IndexDataCacheFile.__mro__[-2]
save, save_index, save_data = (
    caching.IndexDataCacheFile.save, numba_own._save_index, numba_own._save_data
)
met = {}

def at_the_barrier(self, key, data):
    (barrier / str(i)).touch()
    deadline = time.time() + 60
    while len(list(barrier.iterdir())) < n:
        if time.time() > deadline:
            sys.exit("the other processes never came to the barrier")
        time.sleep(0.002)
    met["t"] = time.time()
    save(self, key, data)

def index_in_order(self, overloads):
    time.sleep(max(0.0, met["t"] + 0.2 * (i + 1) - time.time()))
    save_index(self, overloads)

def data_in_reverse(self, name, data):
    time.sleep(max(0.0, met["t"] + 0.2 * (2 * n - i) - time.time()))
    save_data(self, name, data)

caching.IndexDataCacheFile.save = at_the_barrier
numba_own._save_index, numba_own._save_data = index_in_order, data_in_reverse
sys.path.insert(0, os.environ["RACE_DIR"])
racemod = importlib.import_module(os.environ["RACE_MODULE"])
print(racemod.f(np.array([i], dtype=dtype)))
"""

_RACE_DTYPES = ("int64", "int32", "float64", "float32")


def _compile_at_once(tmp_path, monkeypatch, lock: bool) -> tuple[dict, dict]:
    """Run the race's processes on a fresh cache -> ({argument types: the types of the code
    its index entry names}, the environment a process of that cache runs with)."""
    name = "racemod_locked" if lock else "racemod_numba"
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / f"{name}.py").write_text(_RACE_MODULE)
    monkeypatch.syspath_prepend(str(run_dir))  # (its cached code names the module)
    env = dict(os.environ, RACE_DIR=str(run_dir), RACE_LOCK=str(int(lock)), RACE_MODULE=name)
    env["NUMBA_CACHE_DIR"] = str(run_dir / "cache")
    (run_dir / "barrier").mkdir()
    n = len(_RACE_DTYPES)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE_CHILD, str(i), str(n), dtype], env=env, **pipes
        )
        for i, dtype in enumerate(_RACE_DTYPES)
    ]
    for i, child in enumerate(children):
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert float(out) == i + 1
    (index,) = (run_dir / "cache").rglob("*.nbi")
    with open(index, "rb") as fh:
        pickle.load(fh)  # numba's version
        _stamp, overloads = pickle.loads(fh.read())
    named = {}
    for key, data_name in overloads.items():
        code = pickle.loads((index.parent / data_name).read_bytes())
        named[tuple(key[0])] = tuple(code[3].args)  # (the compiled code's signature)
    return named, env


def test_processes_compiling_one_kernel_at_once_leave_each_entry_its_own_code(
    tmp_path, monkeypatch
):
    """numba's cache, written by several processes at once, can name one overload's code
    under another's types (numba issue 4807: the process that loads it runs code for other
    argument types, and crashes).  Locked (`LockedIndexDataCacheFile`), every overload keeps
    its own entry and code.  The same timed race on numba's own files shows the test sees
    the fault."""
    unlocked, _ = _compile_at_once(tmp_path, monkeypatch, lock=False)
    assert any(key != code for key, code in unlocked.items()) or len(unlocked) < 4, (
        "numba's own cache no longer mixes the overloads here: the race test cannot tell"
    )
    locked, env = _compile_at_once(tmp_path, monkeypatch, lock=True)
    assert len(locked) == len(_RACE_DTYPES)
    assert all(key == code for key, code in locked.items()), locked
    # and a later process runs every overload from that cache, each right
    code = (
        "import importlib, os, sys, numpy as np; import moeshard.moe.kernels;"
        "sys.path.insert(0, os.environ['RACE_DIR']);"
        "m = importlib.import_module(os.environ['RACE_MODULE']);"
        f"print([float(m.f(np.array([2], dtype=d))) for d in {_RACE_DTYPES!r}],"
        " sum(m.f.stats.cache_hits.values()), sum(m.f.stats.cache_misses.values()))"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[3.0,", "3.0,", "3.0,", "3.0]", "4", "0"]
