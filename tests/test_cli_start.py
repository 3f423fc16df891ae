"""The command line starts without importing what it does not need, says its version, and
makes the client's key where a first-time user needs it (issue 35)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

HEAVY = ("numpy", "numba", "grpc", "transformers", "tokenizers")


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv", [["--help"], ["id", "--help"], ["bench", "--help"], ["node", "--help"], ["--version"]]
)
def test_help_and_version_import_nothing_heavy(argv):
    code = (
        "import sys\nfrom moeshard.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_version_names_the_installed_distribution():
    done = _run("from moeshard.cli import main; main(['--version'])")
    assert done.stdout.startswith("moeshard ") and done.returncode == 0, done


def test_id_makes_the_client_key_on_first_use_then_reads_it(tmp_path, capsys, monkeypatch):
    from moeshard.cli import main

    home = tmp_path / "no" / "such" / "home"
    monkeypatch.setenv("MOESHARD_HOME", str(home))
    assert main(["id"]) == 0
    first = capsys.readouterr()
    assert "made this client's key" in first.err and (home / "key.pem").exists()
    assert (home / "key.pem").stat().st_mode & 0o077 == 0
    assert main(["id"]) == 0
    again = capsys.readouterr()
    assert again.out == first.out and again.err == ""
    assert main(["id", str(home / "key.pem")]) == 0
    assert capsys.readouterr().out == first.out


def test_keygen_makes_its_directory_and_never_overwrites(tmp_path, capsys):
    from moeshard.cli import main

    key = tmp_path / "a" / "b" / "node.pem"
    assert main(["keygen", str(key)]) == 0
    made = capsys.readouterr().out
    assert key.exists() and len(made.strip()) == 26
    assert main(["keygen", str(key)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_misspelled_option_is_named_before_a_missing_required_one(capsys):
    from moeshard.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "out/demo", "--promt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "moeshard generate: error: unknown option --promt (did you mean --prompt?)"


def test_a_hugging_face_checkpoint_is_told_to_be_converted_first(capsys):
    from moeshard.cli import main

    checkpoint = ROOT / "models" / "demo-hf"
    assert main(["generate", str(checkpoint), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"a Hugging Face checkpoint, to convert first: moeshard convert {checkpoint}" in err
