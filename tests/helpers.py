"""Plain helpers and constants shared by the tests (pytest fixtures live in conftest.py).

Test modules import them as `from helpers import ...` (pyproject puts tests/ on sys.path).
"""

from __future__ import annotations

import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import numpy as np

from moeshard.coordinator.remote.config import RemoteConfig
from moeshard.coordinator.remote.experts import RemoteExperts
from moeshard.coordinator.remote.transport import PeerSpec
from moeshard.moe.identity.keys import Identity, generate
from moeshard.moe.kernels import quant
from moeshard.moe.model.model_dir import ModelDir

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
FAMILY_FIXTURES = (
    sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").exists())
    if FIXTURES.exists()
    else []
)
DIALECTS = ("rope_theta", "rope_parameters")
# (family, expert format, trunk format) of the converted tiny models whose fused decode and
# prefill calls are checked against the step-by-step bits (tests/test_fused_*.py)
FUSED_CASES = [
    ("qwen3_moe", "q4_0", "bf16"),
    ("qwen3_moe", "q8_0", "q8_0"),
    ("olmoe", "f32", "f32"),
    ("mixtral", "q4_0", "f32"),
]

T = TypeVar("T")


# -- the committed reference checkpoints ------------------------------------------------------


def checkpoint_in_dialect(name: str, dialect: str, tmp: Path) -> Path:
    """The fixture checkpoint with config.json in the requested dialect.

    The committed config.json is the older dialect (rope_theta + rope_scaling, as published
    checkpoints have it); config.rope_parameters.json is the same model as transformers 5
    writes it. For the latter, a copy of the checkpoint gets it as its config.json.
    """
    src = FIXTURES / name
    if dialect == "rope_theta" or not (src / "config.rope_parameters.json").exists():
        return src  # (a fixture committed with one config.json)
    dst = tmp / f"{name}-{dialect}"
    if not dst.exists():
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in ("config.json", "config.rope_parameters.json", "reference.npz"):
                (dst / f.name).symlink_to(f.resolve())
        shutil.copyfile(src / "config.rope_parameters.json", dst / "config.json")
    return dst


def reference(name: str) -> dict[str, np.ndarray]:
    """The outputs transformers computed for fixture `name` (tools/make_fixtures.py)."""
    with np.load(FIXTURES / name / "reference.npz") as ref:
        return {k: ref[k] for k in ref.files}


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte of a file in place (every bit of it inverted)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- waiting ----------------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], T], timeout: float, interval: float = 0.05, *, what: str
) -> T:
    """Poll `predicate` every `interval` s until it returns something truthy, and return that.

    After `timeout` s (the predicate is asked one last time at the deadline) the test fails
    with a message naming `what` it waited for.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(min(interval, left))


# -- printed figures --------------------------------------------------------------------------


@dataclass
class DiskRow:
    """One read size of `moeshard bench disk`'s table."""

    size: str  # as printed, e.g. "1.00 MiB"
    gbps: dict[int, float]  # queue depth -> GB/s of raw O_DIRECT reads
    raw: float  # the alternated windows: raw GB/s ...
    reader: float  # ... and GB/s through the reader pool (checksums verified)
    ratio: float  # median over the window pairs of reader / raw


def parse_bench_disk(out: str) -> list[DiskRow]:
    """The rows of the table `moeshard bench disk` prints, in the order printed.

    A row is `SIZE UNIT  GB/s per depth ...  RAW vs READER (RATIO)`."""
    lines = out.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("read size")), None)
    assert head is not None, f"no bench disk table in:\n{out}"
    depths = [int(d) for d in re.findall(r"QD(\d+) +GB/s", lines[head])]
    rows = []
    for line in lines[head + 1 :]:
        tokens = line.split()
        if len(tokens) < 6 or tokens[-3] != "vs":
            break
        figures = tokens[2:-4]
        assert len(figures) == len(depths), f"{len(depths)} depths, row {line!r}"
        rows.append(
            DiskRow(
                size=" ".join(tokens[:2]),
                gbps={d: float(g) for d, g in zip(depths, figures, strict=True)},
                raw=float(tokens[-4]),
                reader=float(tokens[-2]),
                ratio=float(tokens[-1].strip("()")),
            )
        )
    return rows


def positive(x: float | None) -> bool:
    """A finite number > 0."""
    return x is not None and math.isfinite(x) and x > 0


# -- node daemons as real processes on loopback -----------------------------------------------

PROMPT = [1, 5, 9, 2, 7]  # what the cluster tests generate from
TOKENS = 12


class NodeProcess:
    """`moeshard node DIR` as a real subprocess; the port is read from its first line.

    A thread drains its output (so the pipe never fills) into `lines`; `eof` is set once the
    process has closed its output.
    """

    def __init__(
        self,
        path,
        port: int = 0,
        advertise: bool = True,
        name: str = "",
        allow: str | None = None,
        insecure: bool = False,
        env: dict | None = None,
        flags: tuple[str, ...] = (),
        allow_any: bool = False,
    ):
        cmd = [sys.executable, "-X", "faulthandler", "-m", "moeshard", "node", str(path)]
        cmd += ["--port", str(port)] + ([] if advertise else ["--no-advertise"]) + list(flags)
        cmd += ["--name", name] if name else []
        if insecure:
            cmd += ["--insecure"]
        elif allow_any:  # public compute: any client with a key
            cmd += ["--allow-any"]
        else:  # mutual TLS; the tests' client (or `allow`) may call
            cmd += ["--allow", allow or client_key().id]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.path, self.port, self.node_id = path, 0, ""
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.eof = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put("")
        self.eof.set()

    def wait_ready(self, timeout: float = 90.0) -> NodeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if " serving " in line:
                self.port = int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1])
                self.node_id = line.split(" id ")[1].split()[0]
                return self
            if not line:
                break
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(
            f"node {self.path} did not start (exit {self.proc.returncode}): {''.join(self.output)}"
        )

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def spec(self) -> PeerSpec:
        """The node pinned by the key it printed."""
        return PeerSpec(self.addr, self.node_id)

    def text(self) -> str:
        return "".join(self.output)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_nodes(paths, **kw) -> list[NodeProcess]:
    quant.warmup()  # compile once here into numba's disk cache; the nodes then just load it
    procs = [NodeProcess(p, **kw) for p in paths]
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            return list(pool.map(lambda n: n.wait_ready(), procs))
    except RuntimeError:
        for n in procs:
            n.stop()
        raise


_CLIENT: list[Identity] = []


def client_key() -> Identity:
    """The tests' client key (made once per session, in a private temporary directory)."""
    if not _CLIENT:
        home = Path(tempfile.mkdtemp(prefix="moeshard-test-client-"))
        _CLIENT.append(generate(home / "key.pem"))
    return _CLIENT[0]


def remote_runtime(model_dir, specs, insecure: bool = False, trust_dir=None, **config):
    """(transformer, RemoteExperts): the model's trunk here, its experts on the nodes (mutual
    TLS as the tests' client, each node pinned by its key; plaintext with insecure=True).
    `trust_dir`: the directory the coordinator runs on instead of `model_dir` (a coordinator
    directory, with no records, makes every audit fetch its records from the nodes)."""
    model = ModelDir(trust_dir if trust_dir is not None else model_dir)
    remote_config = RemoteConfig(identity=None if insecure else client_key(), **config)
    remote = RemoteExperts.for_model(model, specs, remote_config)
    transformer = model.family.Transformer(model.config, model.load_trunk(), remote)
    return transformer, remote


# -- a node with extra flags, and what its process holds in RAM -------------------------------


def generate_on_nodes(model_dir, plan: dict, prompt: list[int], opts):
    """Start a node for each of the plan's shard directories, generate through them, stop
    them: (the GenerationResult, each node's call count)."""
    from moeshard.coordinator.generate import generate

    nodes = [node_process(n["dir"]) for n in plan["nodes"]]
    try:
        transformer, remote = remote_runtime(model_dir, [n.spec for n in nodes])
        try:
            result = generate(transformer, prompt, opts)
            return result, [n["calls"] for n in remote.stats()["nodes"]]
        finally:
            remote.close()
    finally:
        for n in nodes:
            n.stop()


def check_recurrent_rollback(model, prompt) -> None:
    """A recurrent (KDA, Gated DeltaNet) model's cache with `keep_rollback(3)` goes back to the
    start of either of the last two steps and recomputes the same bits; further back, or
    without keep_rollback, it refuses."""
    import pytest

    cache = model.new_cache(32)
    cache.keep_rollback(3)
    model.forward(prompt, cache)
    first = model.forward(np.array([61]), cache)  # one decode step from the prompt's length
    model.forward(np.array([370]), cache)
    cache.truncate(len(prompt))  # roll back both steps (states, and any keys alike)
    np.testing.assert_array_equal(model.forward(np.array([61]), cache), first)
    for _ in range(3):
        model.forward(np.array([5]), cache)
    with pytest.raises(ValueError, match="only the starts of the last 3 steps"):
        cache.truncate(len(prompt))
    plain = model.new_cache(32)  # without keep_rollback: no copies, no rollback
    model.forward(prompt, plain)
    model.forward(np.array([61]), plain)
    with pytest.raises(ValueError, match="cannot roll a recurrent"):
        plain.truncate(len(prompt))


def same_bits_everywhere(
    model_dir, prompt: list[int], shards: Path, nodes: int = 2, replicas: int = 1
) -> SimpleNamespace:
    """Generate 8 tokens in RAM, through `nodes` node processes holding `replicas` copies of
    each expert, and streamed under the smallest --ram budget (64 positions, so experts are
    missed): the same tokens and logits bits each time (asserted).  -> (local: the RAM run's
    result, stats: the streamed store's, trunk_streamed: whether its trunk came through the
    ring)."""
    from moeshard.coordinator.generate import SamplingOptions, generate
    from moeshard.coordinator.runtime import open_local, open_streaming
    from moeshard.moe.convert.placement import shard_model
    from moeshard.moe.storage.budget import plan_budget

    opts = SamplingOptions(max_tokens=8, keep_logits=True)
    local = generate(open_local(model_dir).transformer, prompt, opts)
    plan = shard_model(model_dir, nodes, replicas, shards)
    remote, calls = generate_on_nodes(model_dir, plan, prompt, opts)
    rt = open_streaming(model_dir, plan_budget(ModelDir(model_dir), 1 << 40, 64).minimum, 64)
    try:
        streamed = generate(rt.transformer, prompt, opts)
        stats, trunk = rt.experts.stats(), rt.transformer.trunk
        trunk_streamed = bool(trunk.streamed) and trunk.bytes_read > 0
    finally:
        rt.close()
    assert all(c > 0 for c in calls) and stats["misses"] > 0
    for run in (remote, streamed):
        assert run.tokens == local.tokens
        assert all(np.array_equal(a, b) for a, b in zip(run.logits, local.logits, strict=True))
    return SimpleNamespace(local=local, stats=stats, trunk_streamed=trunk_streamed)


def node_process(
    path, *flags: str, allow: str | None = None, insecure: bool = False, allow_any: bool = False
):
    """A ready `moeshard node PATH --no-advertise FLAGS...` subprocess (a NodeProcess), for the
    flags NodeProcess has no argument for (e.g. the limits). Callers: the tests' client
    (`allow`: these ids instead; `allow_any`: every authenticated client; `insecure`)."""
    quant.warmup()  # compile once here into numba's disk cache; the node then just loads it
    node = NodeProcess.__new__(NodeProcess)
    cmd = [sys.executable, "-X", "faulthandler", "-m", "moeshard", "node", str(path)]
    cmd += ["--port", "0", "--no-advertise", *flags]
    if insecure or allow_any:
        cmd += ["--insecure" if insecure else "--allow-any"]
    else:
        cmd += ["--allow", allow or client_key().id]
    node.proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    node.path, node.port, node.node_id = path, 0, ""
    node.lines, node.output, node.eof = queue.Queue(), [], threading.Event()
    threading.Thread(target=node._drain, daemon=True).start()
    return node.wait_ready()


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (peak resident) of process `pid`, in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {
        key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024
        for key in ("VmRSS", "VmHWM")
    }


def reset_peak_memory(pid: int) -> None:
    """Start VmHWM over from the current RSS (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def moeshard_run(*args, home) -> subprocess.CompletedProcess:
    """`python -m moeshard ARGS` in a process of its own with `$MOESHARD_HOME` at `home`
    (its keys, ledgers and reputations kept there), its output captured."""
    env = dict(os.environ, MOESHARD_HOME=str(home))
    cmd = [sys.executable, "-m", "moeshard", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)


def popen_from_a_terminal(cmd, **kw) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **kw)` with SIGINT at its default in the child, as a terminal's
    foreground command has it. Tests run in the background (`make test &`, a CI job) have
    SIGINT ignored, and a child inherits that: Python and moeshard keep an ignored SIGINT
    ignored (`moeshard.moe.sigint`), so a Ctrl-C sent to such a child is lost (the command
    runs to its end, exit 0). A handler set here is
    reset to the default by exec; an ignored signal would stay ignored. (Main thread only.)"""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(cmd, **kw)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def wait_python_started(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until `proc` (a Python started with SIGINT at its default) catches SIGINT: the
    interpreter has started and installed its handler (the SigCgt mask of /proc/PID/status)."""

    def catches() -> bool:
        with open(f"/proc/{proc.pid}/status") as status:
            mask = next(line for line in status if line.startswith("SigCgt:")).split()[1]
        return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)

    wait_until(catches, timeout, interval=0.005, what="the command's Python to start")


# What a process interrupted by SIGINT may end with: exit status 130, or death by SIGINT itself
# (Popen's -2), which Python chooses under `python -m` when a KeyboardInterrupt was left
# unhandled on the way out (bpo-1054041) and which a shell reports as 130 all the same.
INTERRUPTED = (130, -2)


def assert_quiet_stop(returncode: int, err: str, context, finished_ok: bool = True) -> None:
    """What a command stopped by SIGINT must show: no traceback; exit 0 where it had finished
    before the signal (`finished_ok`), else an `INTERRUPTED` status with "moeshard:
    interrupted" as the last line on stderr."""
    assert "Traceback" not in err, (context, err)
    if finished_ok and returncode == 0:
        return
    assert returncode in INTERRUPTED, (context, returncode, err)
    assert err.strip().splitlines()[-1] == "moeshard: interrupted", (context, err)
