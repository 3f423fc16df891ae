"""What `pip install .` puts into site-packages: one package, `moeshard` (and its dist-info),
nothing with a generic name (`moe`, `node`, `coordinator` once went in as they were), and the
files the package needs at run time (the chat page, the generated gRPC modules)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from helpers import ROOT


def test_the_wheel_installs_one_package_named_moeshard(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("moeshard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"moeshard"}, sorted(top)
    assert len(dist_info) == 1 and dist_info.pop().startswith("moeshard-")
    for needed in (
        "moeshard/coordinator/serve/page.html",
        "moeshard/moe/wire/moeshard_pb2.py",
        "moeshard/moe/wire/moeshard_pb2_grpc.py",
        "moeshard/__main__.py",
    ):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "moeshard = moeshard.entry:main" in text
