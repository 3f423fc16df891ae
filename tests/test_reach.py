"""A node the coordinator cannot reach is reported with what would fix it: nothing listening,
a TLS node asked in plaintext (--insecure on one side only), or a plaintext node asked over
TLS (issue 35).  Real nodes on loopback."""

from __future__ import annotations

import socket

from moeshard.cli import main
from moeshard.coordinator.remote.reach import speaks_tls
from tests.helpers import NodeProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_the_reason_a_node_is_unreachable_says_what_to_change(demo, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MOESHARD_HOME", str(tmp_path / "home"))
    tls = NodeProcess(demo, advertise=False, allow_any=True).wait_ready()
    plain = NodeProcess(demo, advertise=False, insecure=True).wait_ready()
    ask = ("generate", str(demo), "--prompt", "hi", "--max-tokens", "2")
    try:
        assert speaks_tls("127.0.0.1", tls.port, 5) is True
        assert speaks_tls("127.0.0.1", plain.port, 5) is False
        err = _error(capsys, *ask, "--peers", tls.addr, "--insecure")
        assert "it speaks TLS, and --insecure is plaintext" in err, err
        err = _error(capsys, *ask, "--peers", f"{tls.node_id}@{plain.addr}")
        assert "it does not speak TLS" in err, err
    finally:
        tls.stop()
        plain.stop()
    port = _free_port()
    assert speaks_tls("127.0.0.1", port, 5) is None
    err = _error(capsys, *ask, "--peers", f"127.0.0.1:{port}", "--insecure")
    assert "nothing accepts connections there" in err, err
