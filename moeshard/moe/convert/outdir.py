"""Where a writer may put its output, and how it replaces an old one (issue 16).

A writer (`convert`, `synth`, `shard`) never deletes what it did not create:

* the output may not be one of its inputs, contain one, or lie inside one (`convert SRC SRC
  --force` used to delete the checkpoint; `convert SRC PARENT --force` its parent);
* an existing output is replaced only with `--force`, and only when it is itself an output of
  the same kind (a model directory with its manifest, a shard set with its plan) or empty;
* the replacement is atomic: the new tree is written beside it under a temporary name, the old
  one renamed aside, the new one renamed in, and only then the old one removed (`staged`);
* if writing fails, the temporary tree is removed and the old output is left as it was; a disk
  that fills up (or a quota, or a file size limit) is one line naming the file, not a traceback.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moeshard.moe.errors import MoeshardError
from moeshard.moe.storage.io import DiskFullError, out_of_space
from moeshard.moe.storage.manifest import MANIFEST

PLAN_FILE = "plan.json"  # what marks a shard set (`moeshard shard`)
KINDS = {
    "model": (MANIFEST, "a model directory (moeshard.json)"),
    "shards": (PLAN_FILE, "a shard set (plan.json)"),
}


def check_output(out: str | Path, inputs: list[str | Path], force: bool, kind: str) -> Path:
    """`out` resolved, if a writer of `kind` ("model" or "shards") may write it; MoeshardError
    (one line, exit 2) naming why not."""
    out = Path(out)
    target = out.resolve()
    for given in inputs:
        src = Path(given).resolve()
        if target == src:
            raise MoeshardError(f"{out}: the output is the input {given}; choose another directory")
        if target in src.parents:
            raise MoeshardError(f"{out}: the output contains the input {given}; choose another")
        if src in target.parents:
            raise MoeshardError(f"{out}: the output is inside the input {given}; choose another")
    for parent in out.absolute().parents:  # the nearest existing ancestor must be a directory
        if parent.exists():
            if not parent.is_dir():
                raise MoeshardError(f"{out}: {parent} is not a directory")
            break
    if not out.exists():
        return out
    marker, what = KINDS[kind]
    if not out.is_dir():
        raise MoeshardError(f"{out}: exists and is not a directory; not replacing it")
    if not force:
        raise MoeshardError(f"{out}: already exists (pass --force to replace it)")
    if not (out / marker).is_file() and any(out.iterdir()):
        raise MoeshardError(
            f"{out}: exists and is not {what}; --force replaces only those (remove it yourself)"
        )
    return out


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished tree `tmp` at `out`: old one aside, new one in, old one removed."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)  # put it back: nothing lost
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged(out: Path, tmp: Path) -> Iterator[Path]:
    """Build the new tree for `out` in `tmp` (made empty here), put in place by `replace_dir`
    when the block ends. If the block (or the replacement) fails, `tmp` is removed and `out`
    is left as it was; a write that ran out of room (ENOSPC, EDQUOT, EFBIG) becomes a
    DiskFullError (one line, exit 2) naming the file it was writing and `out`."""
    existed = out.exists()
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted earlier run
    try:
        tmp.mkdir(parents=True)
        yield tmp
        replace_dir(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = out_of_space(exc, tmp)
        if full is None:
            raise
        kept = "left as it was" if existed else "not written"
        raise DiskFullError(f"{full}; {out} {kept}") from None
