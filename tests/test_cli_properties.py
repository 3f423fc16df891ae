"""Property-based tests of the command line (issue 16): generated argument lists and generated
config.json edits thrown at `moeshard`, in process.

Whatever the input, the CLI must
  * exit 0 or 2 (1 is an internal error: a bug to fix, not an answer to accept),
  * never print a traceback (nor log one), and on exit 2 end with one error line,
  * change no file outside the output directory the command was given (inputs, the shared
    converted model, $MOESHARD_HOME and the repository's checkpoints are left as they were).

The runs are reproducible (derandomized, no example database). For a deeper local search set
MOESHARD_FUZZ=N: N examples per property, drawn at random instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import FIXTURES, ROOT
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from moeshard.cli import main

DEMO = ROOT / "models" / "demo-hf"
# what a checkpoint copy needs (the demo's loss.png, train_log.json and val.txt are left out)
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
)
# the checkpoints whose config.json the edits are made to: the demo and the test fixtures
FAMILIES = ["demo", "qwen3_moe", "qwen3_moe_yarn", "qwen2_moe", "mixtral", "olmoe"]
FAMILIES += ["deepseek_v3", "deepseek_v3_fp8", "glm4_moe", "glm4_moe_lite"]
CONFIGS = {
    name: json.loads(((DEMO if name == "demo" else FIXTURES / name) / "config.json").read_text())
    for name in FAMILIES
}

SMALL = 1 << 20  # files up to this size are compared by content, larger ones by size and mtime
RUN_TIMEOUT_S = 60  # one CLI run; a run this long is a hang (a huge value not refused)

FUZZ = int(os.environ.get("MOESHARD_FUZZ", "0"))


def _settings(examples: int):
    return settings(
        max_examples=FUZZ or examples,
        deadline=None,
        derandomize=not FUZZ,
        database=None,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


# -- the work area ----------------------------------------------------------------------------


@dataclass
class Area:
    """Everything the runs may read, under one root (snapshotted around every run)."""

    root: Path
    model: Path  # the demo converted once: an input, never an output
    checkpoints: dict[str, Path]  # family -> checkpoint copy (demo + the test fixtures)
    inputs: Path  # real files the commands read: a trace, a profile, a key, a shard set
    examples: Path  # one fresh directory per example, removed after it


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    repo_before = snapshot([DEMO, FIXTURES])
    root = tmp_path_factory.mktemp("cli-properties")
    checkpoints = {"demo": copy_checkpoint(DEMO, root / "checkpoints" / "demo")}
    for name in FAMILIES[1:]:
        checkpoints[name] = copy_checkpoint(FIXTURES / name, root / "checkpoints" / name)
    model = root / "model"
    inputs = root / "inputs"
    inputs.mkdir()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["convert", str(checkpoints["demo"]), str(model), "--quiet"]) == 0
        ids = ["--prompt-ids", "1,2,3", "--max-tokens", "3", "--json"]
        assert main(["generate", str(model), *ids, "--trace", str(inputs / "trace.npz")]) == 0
        profile = ["--ram", "60M", "--profile-out", str(inputs / "profile.json")]
        assert main(["generate", str(model), *ids, *profile]) == 0
        assert main(["keygen", str(inputs / "key.pem")]) == 0
        shards = ["--nodes", "2", "--replicas", "1", "--out", str(inputs / "shards")]
        assert main(["shard", str(model), *shards]) == 0
    examples = root / "examples"
    examples.mkdir()
    yield Area(root, model, checkpoints, inputs, examples)
    assert snapshot([DEMO, FIXTURES]) == repo_before, "the repository's checkpoints changed"


# -- snapshots --------------------------------------------------------------------------------


def snapshot(roots: list[Path]) -> dict[str, tuple]:
    """path -> what it is: ("dir",), ("link", target) or (size, mtime_ns, sha256 or None)."""
    found: dict[str, tuple] = {}
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            found[dirpath] = ("dir",)
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st_ = os.lstat(path)
                if os.path.islink(path):
                    found[path] = ("link", os.readlink(path))
                elif name in filenames:
                    digest = None
                    if st_.st_size <= SMALL:
                        with open(path, "rb") as f:
                            digest = hashlib.sha256(f.read()).hexdigest()
                    found[path] = (st_.st_size, st_.st_mtime_ns, digest)
    return found


def changed_outside(before: dict, after: dict, allowed: Path | None) -> list[str]:
    """The paths that were added, removed or changed, other than `allowed`, what is in it and
    the directories made to hold it."""
    prefix = None if allowed is None else str(allowed)
    changes = []
    for path in sorted(set(before) | set(after)):
        if before.get(path) == after.get(path):
            continue
        if prefix is not None and (path == prefix or path.startswith(prefix + os.sep)):
            continue
        made_parent = before.get(path) is None and after.get(path) == ("dir",)
        if made_parent and prefix is not None and prefix.startswith(path + os.sep):
            continue  # the output's missing parent directories, made for it
        changes.append(f"{path}: {before.get(path)} -> {after.get(path)}")
    return changes


# -- one run ----------------------------------------------------------------------------------

ERROR_LINE = re.compile(r"^moeshard(?: [\w-]+)*: error: ")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


class RunTimeout(BaseException):
    """A run took more than RUN_TIMEOUT_S (not an Exception: the CLI must not swallow it)."""


def _alarm(signum, frame):
    raise RunTimeout(f"no answer within {RUN_TIMEOUT_S} s")


def run(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in process: (exit code, stdout, stderr), checked: 0 or 2, no traceback, and
    on 2 an error line last. An exception main lets out fails the test with its traceback."""
    out, err = io.StringIO(), io.StringIO()
    records = _Records()
    logging.getLogger().addHandler(records)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(RUN_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: usage errors (2)
                code = 0 if exc.code is None else exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        logging.getLogger().removeHandler(records)
    stdout, stderr = out.getvalue(), err.getvalue()
    if currently_in_test_context():  # (pytest --hypothesis-show-statistics)
        event(f"{argv[0] if argv else '-'}: exit {code}")
    shown = f"argv: {argv}\nexit {code}\nstderr:\n{stderr[-3000:]}"
    assert code in (0, 2), shown
    assert "Traceback" not in stderr and "Traceback" not in stdout, shown
    logged = [r for r in records.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not logged, f"{shown}\nlogged: {[r.getMessage() for r in logged]}"
    if code == 2:
        lines = [line for line in stderr.splitlines() if line.strip()]
        verdict = argv[:1] == ["ledger"] and lines and lines[-1].startswith(argv[-1] + ": ")
        # `ledger verify|summary` end with their verdict naming the ledger (by design) instead
        assert lines and (ERROR_LINE.match(lines[-1]) or verdict), shown
    return code, stdout, stderr


# -- generated argument lists -----------------------------------------------------------------

# Tokens in a generated argv, replaced by the example's paths before the run.
#   @MODEL@   the shared converted demo (an input)     @SRC@     this example's checkpoint copy
#   @OUT@     this example's output path               @WORK@    this example's directory
#   @GARBAGE@ a generated input file                   @MISSING@ a path that does not exist
#   @TRACE@ @PROFILE@ @KEY@ @SHARDS@: real inputs (a trace, a usage profile, a key, a shard set)


@dataclass
class Case:
    argv: list[str]
    out: str | None = None  # the output the command may write (a token path), if any
    out_state: str = "absent"  # what is at @OUT@ before: absent empty junk file model shards
    garbage: tuple = ("bytes", b"")  # how @GARBAGE@ is made


def opt(name: str, values) -> st.SearchStrategy[list[str]]:
    """[] or [name, value]."""
    return st.one_of(st.just([]), st.builds(lambda v: [name, v], values))


def flag(name: str) -> st.SearchStrategy[list[str]]:
    return st.sampled_from([[], [name]])


def weighted(common, rare, odds: int = 3) -> st.SearchStrategy[str]:
    """One of `common` about `odds` times as often as one of `rare` (pathological values)."""
    return st.one_of(*[st.sampled_from(common)] * odds, st.sampled_from(rare))


BAD_INTS = ["0", "-1", "x", "", "1.5", "1e3", "0x10", " 7 ", "99999999999999999999999"]
BAD_FLOATS = ["nan", "-nan", "inf", "-inf", "-1", "x", "", "1e400", "-0"]

GARBAGE_TEXT = [
    b"",
    b"\x00" * 16,
    b"{}",
    b"[]",
    b"null",
    b"42",
    b'"text"',
    b'{"model_id": 7}',
    b'{"a": 1}\n{"b": [1, 2]}\n',
    b"not json at all\n",
    b"\xff\xfe\xfd",
    b"PK\x03\x04garbage",  # a zip header and nothing after it
    b"\x93NUMPY\x01\x00",  # an .npy header cut short
    b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    b'{"0:1": 5, "bad": "x"}',
    b'{"counts": {"0:1": -5}, "model_id": "0000"}',
]
REAL_INPUTS = ["trace.npz", "profile.json", "key.pem"]

garbage_spec = st.one_of(
    st.tuples(st.just("bytes"), st.sampled_from(GARBAGE_TEXT)),
    st.tuples(st.just("bytes"), st.binary(max_size=64)),
    st.tuples(st.just("truncate"), st.sampled_from(REAL_INPUTS), st.floats(0, 0.99)),
    st.tuples(st.just("flip"), st.sampled_from(REAL_INPUTS), st.floats(0, 0.99)),
)

OUT_STATES = ["absent", "empty", "junk", "file"]


def out_file(name: str) -> st.SearchStrategy[str]:
    """Where `generate` is told to write a file (--trace, --dump-logits, --profile-out, ...)."""
    return st.sampled_from([f"@OUT@/{name}", f"@OUT@/none/{name}", "@OUT@"])


# generate's options: (good values, pathological values). A case draws each option it gives
# from the good ones, except for up to two "faults" drawn from the pathological ones, so that
# both the runs that must work and each way of getting one option wrong are reached.
HUGE = ["1000000000000", "1000000000000000000", str(2**63), str(10**40)]
GENERATE_OPTIONS = {
    "--max-tokens": (["1", "2", "3"], ["300", *BAD_INTS, *HUGE]),
    "--temperature": (["0", "0.7", "1"], [*BAD_FLOATS, "1e308", "warm"]),
    "--top-k": (["0", "1", "5"], [*BAD_INTS, "1000000000"]),
    "--top-p": (["0.5", "1", "0.9"], [*BAD_FLOATS, "0", "1.5", "1e-300"]),
    "--seed": (["0", "42", str(2**64)], ["x", "1.5", "", "-1"]),
    "--ram": (
        ["60M", "64MiB", "1G"],
        ["banana", "0", "1K", "-5M", "1e3", "", " 64m ", "nan", "9" * 30, "1.5T"],
    ),
    "--context": (["8", "300"], [*BAD_INTS, "1", "1000000000000"]),
    "--read-depth": (["1", "4"], [*BAD_INTS, "1000000"]),
    "--cache-policy": (["lru", "lfu", "none"], ["pin", "x", ""]),
    "--prefetch-top": (["1", "4"], [*BAD_INTS, "5"]),
    "--profile-in": (["@PROFILE@"], ["@GARBAGE@", "@MISSING@", "@WORK@"]),
}
STREAMING = ("--context", "--read-depth", "--cache-policy", "--prefetch-top", "--profile-in")


@st.composite
def generate_case(draw) -> Case:
    faults = draw(st.sets(st.sampled_from(["model", "prompt", *GENERATE_OPTIONS]), max_size=2))

    def value(name: str) -> str:
        good, bad = GENERATE_OPTIONS[name]
        return draw(st.sampled_from(bad if name in faults else good))

    def maybe(name: str) -> list[str]:
        """[name, value] always for a fault, else sometimes."""
        return [name, value(name)] if name in faults or draw(st.booleans()) else []

    model = "@MODEL@"
    if "model" in faults:
        model = draw(st.sampled_from(["@SRC@", "@GARBAGE@", "@MISSING@", "@WORK@", "@SHARDS@"]))
    if "prompt" in faults:
        source = draw(
            st.one_of(
                st.sampled_from(
                    [[], ["--prompt", "a", "--prompt-ids", "1"]]  # neither, both: usage errors
                ),
                st.builds(
                    lambda v: ["--prompt-ids", v],
                    st.sampled_from(
                        ["", ",", ",,,", "a,b", "1,,2", "-1", "4096", "1.5", "0x10", "1_000"]
                        + ["1,2,99999999999999999999", " 1 , 2 ", "\u0661,\u0662", "7," * 300]
                    ),
                ),
                st.builds(
                    lambda v: ["--prompt", v],
                    st.one_of(
                        st.sampled_from(["", " ", "\n", "\x00", "\udcff", "\u202e\u200b"]),
                        st.sampled_from(["😀" * 5, "x" * 3000]),
                    ),
                ),
            )
        )
    else:
        ids = st.lists(st.integers(0, 4095), min_size=1, max_size=6)
        source = draw(
            st.one_of(
                st.builds(lambda v: ["--prompt-ids", ",".join(map(str, v))], ids),
                st.builds(
                    lambda v: ["--prompt", v],
                    st.one_of(
                        st.sampled_from(["hello", "The function returns", "def f(x):"]),
                        st.text(min_size=1, max_size=12),
                    ),
                ),
            )
        )
    max_tokens = value("--max-tokens")
    # Real generations stay short (1..3 tokens); past the model's context (256) only values so
    # large that the run must be refused before anything is allocated.
    beyond = draw(flag("--beyond-context")) if max_tokens != "300" else []
    args = ["generate", model, *source, "--max-tokens", max_tokens, *beyond]
    for name in ("--temperature", "--top-k", "--top-p", "--seed"):
        args += maybe(name)
    args += draw(flag("--json"))
    args += draw(opt("--dump-logits", out_file("l.npy")))
    args += draw(opt("--trace", out_file("t.npz")))
    streaming = "--ram" in faults or any(n in faults for n in STREAMING) or draw(st.booleans())
    if streaming:
        args += ["--ram", value("--ram")]
        for name in STREAMING:
            args += maybe(name)
        if "--cache-policy" in args and "pin" in args and "--profile-in" not in args:
            args += ["--profile-in", "@PROFILE@"]
        args += draw(flag("--no-prefetch"))
        args += draw(opt("--profile-out", out_file("p.json")))
        args += draw(opt("--stats-json", out_file("s.jsonl")))
    else:
        # without --ram --context is not used; a bad one is refused all the same
        args += draw(opt("--context", st.sampled_from(["0", "8", "1000000000000"])))
    return Case(args, out="@OUT@", out_state="empty", garbage=draw(garbage_spec))


@st.composite
def inspect_case(draw) -> Case:
    target = draw(
        st.sampled_from(
            ["@MODEL@", "@SRC@", "@GARBAGE@", "@MISSING@", "@WORK@", "@KEY@", "@SHARDS@"]
            + ["@SHARDS@/node-00", "@TRACE@"]
        )
    )
    return Case(["inspect", target, *draw(flag("--verify"))], garbage=draw(garbage_spec))


@st.composite
def convert_case(draw) -> Case:
    src = draw(weighted(["@SRC@"], ["@MODEL@", "@GARBAGE@", "@MISSING@", "@WORK@"]))
    out = draw(
        weighted(
            ["@OUT@"],
            # (an earlier model directory as OUT: out_state "model", not the shared one)
            ["@SRC@", "@WORK@", "@SRC@/sub", "@OUT@/a/b", "@SRC@/config.json"],
        )
    )
    experts = draw(opt("--experts", st.sampled_from(["f32", "bf16", "q8_0", "q4_0", "f16", ""])))
    trunk = draw(opt("--trunk", st.sampled_from(["f32", "bf16", "q8_0", "q4_0"])))
    args = ["convert", src, out, *experts, *trunk, *draw(flag("--force")), *draw(flag("--quiet"))]
    state = draw(st.sampled_from([*OUT_STATES, "model"]))
    return Case(args, out=out, out_state=state, garbage=draw(garbage_spec))


def with_faults(draw, table: dict, faults: set, required: tuple = ()) -> list[str]:
    """[name, value, ...] for the options of `table` (name -> (good, pathological values)):
    a fault's from its pathological values, a required one's or (sometimes) another's from its
    good ones."""
    args = []
    for name, (good, bad) in table.items():
        if name in faults:
            args += [name, draw(st.sampled_from(bad))]
        elif name in required or draw(st.booleans()):
            args += [name, draw(st.sampled_from(good))]
    return args


SHARD_OPTIONS = {
    "--nodes": (["1", "2", "3"], ["0", "-1", "x", "", "1000000"]),
    "--replicas": (["1"], ["0", "-1", "4", "x", "2"]),
    "--trace": (
        ["@TRACE@", "@PROFILE@", '{"0:1": 5}'],
        ["@GARBAGE@", "@MISSING@", "{}", "{bad", '{"9:99": 1}', '{"0:1": -3}', '{"0:1": "x"}']
        + ["[]", "@WORK@"],
    ),
}


@st.composite
def shard_case(draw) -> Case:
    kinds = ["model", "out", "out_state", "no --out", *SHARD_OPTIONS]
    faults = draw(st.sets(st.sampled_from(kinds), max_size=2))
    model, out, state = "@MODEL@", "@OUT@", draw(st.sampled_from(["absent", "empty"]))
    if "model" in faults:
        model = draw(st.sampled_from(["@SRC@", "@GARBAGE@", "@MISSING@", "@SHARDS@"]))
    if "out" in faults:
        out = draw(st.sampled_from(["@MODEL@", "@WORK@", "@MODEL@/sub", "@SHARDS@", "@OUT@/a"]))
    if "out_state" in faults:
        state = draw(st.sampled_from(["junk", "file", "shards", "model"]))
    args = ["shard", model, *with_faults(draw, SHARD_OPTIONS, faults, ("--nodes",))]
    if "no --out" not in faults:  # --out is required: a usage error without it
        args += ["--out", out]
    args += draw(flag("--force"))
    return Case(args, out=out, out_state=state, garbage=draw(garbage_spec))


SIMULATE_OPTIONS = {
    "--geometry": (["@MODEL@", "k2"], ["banana", "@GARBAGE@", "@SRC@", "@WORK@"]),
    "--ram": (["8G", "64M"], ["banana", "0", "-1G", "1K", ""]),
    "--disk": (["this-machine", "pcie4-nvme"], ["@GARBAGE@", "banana", "@MISSING@"]),
    "--depth": (["1", "8"], ["0", "-1", "x", "100000"]),
    "--kernel-gbps": (["7", "1"], ["-1", "nan", "inf", "x", "0"]),
    "--memory-gbps": (["20", "1"], ["-1", "nan", "inf", "x", "0"]),
    "--prefetch-recall": (["0.5", "0.8"], ["2", "-1", "nan", "x"]),
}


@st.composite
def small_command_case(draw) -> Case:
    """keygen, id, ledger, merge-traces, coact, simulate, pack: their failure paths are cheap."""
    inputs = st.sampled_from(["@MISSING@", "@WORK@", "@TRACE@", "@TRACE@", "@GARBAGE@"])
    which = draw(st.sampled_from(["keygen", "id", "ledger", "merge", "coact", "simulate", "pack"]))
    out, state = None, "absent"
    if which == "keygen":
        out = draw(st.sampled_from(["@OUT@", "@OUT@/key.pem", "@OUT@/none/key.pem"]))
        target = draw(st.sampled_from([out, out, "@KEY@", "@GARBAGE@"]))
        args = ["keygen", target]
        state = draw(st.sampled_from(["absent", "empty"]))
    elif which == "id":
        args = ["id", draw(st.sampled_from(["@KEY@", "@GARBAGE@", "@MISSING@", "@WORK@"]))]
    elif which == "ledger":
        verb = draw(st.sampled_from([["verify"], ["summary"], ["summary", "--json"]]))
        args = ["ledger", *verb, draw(st.sampled_from(["@GARBAGE@", "@MISSING@", "@WORK@"]))]
    elif which == "merge":
        out = target = draw(
            st.sampled_from(["@OUT@/m.npz", "@OUT@", "@OUT@/none/m.npz", "@TRACE@"])
        )
        traces = draw(st.lists(inputs, min_size=1, max_size=3))
        args = ["merge-traces", target, *traces]
        state = "empty"
    elif which == "coact":
        # a coact of a readable trace draws 11 plots (seconds): only unreadable traces here
        unreadable = st.sampled_from(["@MISSING@", "@WORK@", "@GARBAGE@"])
        traces = draw(st.lists(unreadable, min_size=1, max_size=3))
        sizes = draw(opt("--cache-sizes", st.sampled_from(["1,2", "0", "-1", "x", "", "9" * 20])))
        out = "@OUT@"
        args = ["coact", "--out", out, *sizes, *traces]
        state = draw(st.sampled_from(OUT_STATES))
    elif which == "simulate":
        # (the default geometry, k3, takes seconds to simulate: the model's or k2 instead)
        faults = draw(st.sets(st.sampled_from(["traces", *SIMULATE_OPTIONS]), max_size=2))
        traces = ["@TRACE@"]
        if "traces" in faults:
            traces = draw(st.lists(inputs, min_size=1, max_size=2))
        args = ["simulate", *traces]
        args += with_faults(draw, SIMULATE_OPTIONS, faults, ("--geometry",))
    else:  # pack, always to a new directory (without --out it rewrites MODEL in place)
        model = draw(st.sampled_from(["@MODEL@", "@MODEL@", "@GARBAGE@", "@SRC@"]))
        traces = draw(st.lists(inputs, min_size=1, max_size=2))
        out = draw(st.sampled_from(["@OUT@", "@OUT@", "@MODEL@", "@WORK@"]))
        args = ["pack", model, "--trace", *traces, "--out", out]
        state = draw(st.sampled_from(OUT_STATES))
    return Case(args, out=out, out_state=state, garbage=draw(garbage_spec))


def usage_case() -> st.SearchStrategy[Case]:
    junk = st.sampled_from(
        ["", "-", "--", "--nope", "-x", "generate", "@MODEL@", "-v", "=", "\x00"]
    )
    return st.builds(lambda a: Case(a), st.lists(junk, max_size=4))


any_case = st.one_of(
    generate_case(),
    generate_case(),
    inspect_case(),
    convert_case(),
    shard_case(),
    small_command_case(),
    small_command_case(),
    usage_case(),
)


# -- preparing and checking one example -------------------------------------------------------


def make_garbage(area: Area, spec: tuple, path: Path) -> None:
    if spec[0] == "bytes":
        data = spec[1]
    else:
        real = (area.inputs / spec[1]).read_bytes()
        cut = int(len(real) * spec[2])
        if spec[0] == "truncate":
            data = real[:cut]
        else:
            data = real[:cut] + bytes([real[cut] ^ 0xFF]) + real[cut + 1 :]
    path.write_bytes(data)


def prepare(area: Area, case: Case) -> tuple[Path, list[str], Path | None, list[Path]]:
    """The example's directory, its argv with paths, the output it may write and its inputs."""
    work = Path(tempfile.mkdtemp(dir=area.examples))
    src = work / "src"  # a checkpoint this example may be handed as input (or, wrongly, output)
    src.mkdir()
    for f in area.checkpoints["demo"].iterdir():
        if f.suffix == ".json":
            shutil.copyfile(f, src / f.name)
        else:
            (src / f.name).symlink_to(f)
    garbage = work / "inputs" / "garbage"
    garbage.parent.mkdir()
    make_garbage(area, case.garbage, garbage)
    tokens = {
        "@MODEL@": str(area.model),
        "@SRC@": str(src),
        "@OUT@": str(work / "out"),
        "@WORK@": str(work),
        "@GARBAGE@": str(garbage),
        "@MISSING@": str(work / "missing"),
        "@TRACE@": str(area.inputs / "trace.npz"),
        "@PROFILE@": str(area.inputs / "profile.json"),
        "@KEY@": str(area.inputs / "key.pem"),
        "@SHARDS@": str(area.inputs / "shards"),
    }

    def fill(text: str) -> str:
        for token, path in tokens.items():
            text = text.replace(token, path)
        return text

    out_dir = work / "out"
    if case.out_state == "empty":
        out_dir.mkdir()
    elif case.out_state == "junk":
        out_dir.mkdir()
        (out_dir / "notes.txt").write_text("mine\n")
    elif case.out_state == "file":
        out_dir.write_text("a file, not a directory\n")
    elif case.out_state == "model":
        shutil.copytree(area.model, out_dir)
    elif case.out_state == "shards":
        shutil.copytree(area.inputs / "shards", out_dir)
    inputs = [src, area.model, area.inputs, garbage.parent]
    allowed = Path(fill(case.out)) if case.out else None
    if allowed is not None and any(
        allowed == p or allowed in p.parents or p in allowed.parents for p in inputs
    ):
        allowed = None  # an input (or what holds one) as the output: nothing may change
    return work, [fill(a) for a in case.argv], allowed, inputs


def roots(area: Area) -> list[Path]:
    return [area.root, Path(os.environ["MOESHARD_HOME"])]


@_settings(examples=250)
@given(case=any_case)
def test_generated_argument_lists(area, case):
    """Any argv: exit 0 or 2, no traceback, nothing changed outside the output."""
    work, argv, allowed, _ = prepare(area, case)
    try:
        before = snapshot(roots(area))
        run(argv)
        changes = changed_outside(before, snapshot(roots(area)), allowed)
        assert not changes, f"argv {argv} changed files outside {allowed}:\n" + "\n".join(changes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- generated config edits -------------------------------------------------------------------

JSON_VALUES = st.one_of(
    st.sampled_from(["banana", "", None, True, False, [], {}, [1, 2], {"a": 1}, "1", "64"]),
    st.sampled_from([0, -1, 1, 2, 3, 10**6, 10**12, 10**30, 0.5, -0.5, 1e-9, 1e308, -1e308]),
    st.integers(-10, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
)


def near(value) -> st.SearchStrategy:
    """Values close to a field's own: off by one, halved, as text, as a float, its negative."""
    if isinstance(value, bool) or value is None:
        return st.sampled_from([not value, 0, 1, "true", None])
    if isinstance(value, int | float):
        return st.sampled_from(
            [value + 1, value - 1, value * 2, value // 2, -value, float(value) + 0.5, str(value)]
            + [float(value), 0, [value]]
        )
    if isinstance(value, str):
        return st.sampled_from(["", value.upper(), value + "x", 1, [value]])
    if isinstance(value, list):
        return st.sampled_from([[], value + value, [-1], [10**6], ["x"], [[1]], value[:1]])
    return st.sampled_from([{}, [], "x", {k: None for k in value}])


@st.composite
def config_edit(draw, config: dict):
    """(kind, ...) — an edit of config.json, applied by `apply_edit`."""
    keys = sorted(config)
    nested = sorted(
        f"{k}.{n}" for k, v in config.items() if isinstance(v, dict) for n in v
    )  # rope_parameters.rope_theta, ...
    kind = draw(st.sampled_from(["set", "set", "set", "near", "near", "delete", "add", "raw"]))
    if kind in ("set", "near"):
        key = draw(st.sampled_from(keys + nested + ["rope_scaling", "rope_parameters"]))
        head, _, tail = key.partition(".")
        old = config.get(head)
        if tail and isinstance(old, dict):
            old = old.get(tail)
        value = draw(JSON_VALUES if kind == "set" else near(old))
        return ("set", key, value)
    if kind == "delete":
        return ("delete", draw(st.sampled_from(keys + nested)))
    if kind == "add":
        return ("set", draw(st.text(min_size=1, max_size=8)), draw(JSON_VALUES))
    return ("raw", draw(st.sampled_from(["truncate", "nan", "empty", "list", "utf8", "dup"])))


def apply_edit(path: Path, edit: tuple) -> None:
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return  # an earlier edit left no JSON object to edit
    if not isinstance(config, dict):
        return
    if edit[0] == "raw":
        text = json.dumps(config, indent=2)
        text = {
            "truncate": text[: len(text) // 2],
            "nan": text.replace('"vocab_size": ', '"vocab_size": NaN, "x": '),
            "empty": "",
            "list": json.dumps([config]),
            "utf8": None,
            "dup": text.replace("{", '{"num_experts_per_tok": "banana",', 1),
        }[edit[1]]
        if text is None:
            path.write_bytes(b'{"model_type": "\xff\xfe"}')
        else:
            path.write_text(text)
        return
    head, _, tail = edit[1].partition(".")
    target = config
    if tail:
        if not isinstance(config.get(head), dict):
            return
        target, head = config[head], tail
    if edit[0] == "delete":
        target.pop(head, None)
    else:
        target[head] = edit[2]
    path.write_text(json.dumps(config, indent=2))


@st.composite
def edited_checkpoint(draw):
    family = draw(st.sampled_from(FAMILIES))
    edits = draw(st.lists(config_edit(CONFIGS[family]), min_size=1, max_size=2))
    experts = draw(st.sampled_from(["f32", "f32", "q8_0"]))
    ram = draw(st.sampled_from([[], ["--ram", "256M"]]))  # in RAM, or streamed from disk
    return family, edits, experts, ram


GENERATE = ["--prompt-ids", "1,2,3", "--max-tokens", "2", "--json"]


@_settings(examples=120)
@given(case=edited_checkpoint())
def test_generated_config_edits_of_a_checkpoint(area, case):
    """An edited config.json in a checkpoint: `convert` refuses it (2) or converts it (0), and
    what it converts is inspected and generated from (0 or 2). Config validation
    (moe/model/config.py) is what stands between the edit and a traceback."""
    family, edits, experts, ram = case
    work = Path(tempfile.mkdtemp(dir=area.examples))
    try:
        src = work / "src"
        src.mkdir()
        for f in area.checkpoints[family].iterdir():
            if f.suffix == ".json":
                shutil.copyfile(f, src / f.name)
            else:
                (src / f.name).symlink_to(f)
        for edit in edits:
            apply_edit(src / "config.json", edit)
        out = work / "out"
        before = snapshot(roots(area))
        code, _, _ = run(["convert", str(src), str(out), "--quiet", "--experts", experts])
        after = snapshot(roots(area))
        assert not changed_outside(before, after, out), changed_outside(before, after, out)
        if code == 0:
            for argv in (["inspect", str(out)], ["generate", str(out), *GENERATE, *ram]):
                run(argv)
                changes = changed_outside(after, snapshot(roots(area)), None)
                assert not changes, f"{argv} changed:\n" + "\n".join(changes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@_settings(examples=40)
@given(edits=st.lists(config_edit(CONFIGS["demo"]), min_size=1, max_size=2))
def test_generated_config_edits_of_a_model(area, edits):
    """An edited config.json in a converted model (a copy): every command that opens it
    refuses it (the model id covers the config) or, for an edit that changes nothing as
    loaded, runs; 0 or 2 either way, and nothing is written."""
    work = Path(tempfile.mkdtemp(dir=area.examples))
    try:
        model = work / "model"
        model.mkdir()
        for f in area.model.iterdir():
            if f.suffix == ".json":
                shutil.copyfile(f, model / f.name)
            else:
                (model / f.name).symlink_to(f)
        for edit in edits:
            apply_edit(model / "config.json", edit)
        before = snapshot(roots(area))
        for argv in (["inspect", str(model)], ["generate", str(model), *GENERATE]):
            run(argv)
        changes = changed_outside(before, snapshot(roots(area)), None)
        assert not changes, "\n".join(changes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the config edits hypothesis found first, kept as plain cases -------------------------------

FOUND = [
    ("demo", "hidden_size", "banana"),
    ("demo", "num_experts_per_tok", 33),  # more than the 32 experts
    ("demo", "num_key_value_heads", 3),  # 4 heads are not a multiple of 3
    ("demo", "max_position_embeddings", None),
    ("demo", "mlp_only_layers", -1),
    ("demo", "num_hidden_layers", 10**12),
    ("demo", "rms_norm_eps", "banana"),
    ("demo", "tie_word_embeddings", "false"),  # bool("false") is True
    ("demo", "eos_token_id", ["banana"]),
    ("demo", "rope_parameters.rope_theta", float("nan")),
    ("qwen3_moe", "rope_scaling", "banana"),
    ("qwen3_moe", "rope_theta", 1),
    ("qwen3_moe_yarn", "rope_scaling.factor", -4.0),
    ("qwen3_moe_yarn", "rope_scaling.original_max_position_embeddings", "16"),
    ("olmoe", "clip_qkv", "banana"),
    ("deepseek_v3", "topk_group", 5),  # more than the 4 groups
    ("deepseek_v3", "qk_rope_head_dim", 7),  # rotary dims come in pairs
    ("deepseek_v3_fp8", "quantization_config.weight_block_size", [32]),
    ("glm4_moe", "partial_rotary_factor", 2.0),  # a share of the head
    ("glm4_moe", "use_qk_norm", "true"),
    ("glm4_moe", "head_dim", 7),
    ("glm4_moe", "n_group", 3),  # 8 experts in 3 groups
    ("glm4_moe_lite", "partial_rotary_factor", 0.5),  # the MLA rope slice turns whole
    ("glm4_moe_lite", "first_k_dense_replace", 9),  # more than the 3 layers
]


@pytest.mark.parametrize("family, key, value", FOUND, ids=[f"{f}-{k}" for f, k, _ in FOUND])
def test_a_bad_config_field_is_one_line_naming_file_and_field(area, tmp_path, family, key, value):
    """`convert` of a checkpoint whose config.json has the value: exit 2, one line naming the
    file and the field (moe/model/config.py check_fields), no traceback."""
    src = tmp_path / "src"
    src.mkdir()
    for f in area.checkpoints[family].iterdir():
        (src / f.name).symlink_to(f)
    (src / "config.json").unlink()
    shutil.copyfile(area.checkpoints[family] / "config.json", src / "config.json")
    apply_edit(src / "config.json", ("set", key, value))
    code, _, err = run(["convert", str(src), str(tmp_path / "out"), "--quiet"])
    line = err.strip().splitlines()[-1]
    assert code == 2 and str(src / "config.json") in line and key.split(".")[-1] in line, err
    assert not (tmp_path / "out").exists()
