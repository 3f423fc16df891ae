"""llama.cpp for `moeshard bench compare-llamacpp`: built from the sources vendored in the
`llama-cpp-python` sdist, its own converter and quantizer, and its two benchmark tools
(`llama-bench`, `test-backend-ops perf`), with parsers for what they print.

Everything is kept in a cache directory outside the repository (default
`~/.cache/moeshard`, or `$MOESHARD_CACHE`, or `--cache DIR`):

    llama_cpp_python-0.3.36.tar.gz   the sdist (`pip download` fetches it when it is missing)
    llama.cpp-0.3.36/                sources (src/), binaries (build/bin/), build-info.json
    llama.cpp-0.3.36.build.log       cmake's output, for when the build fails

A build happens in a temporary sibling directory that is renamed when it is complete, so an
interrupted build is never mistaken for a finished one. The binaries are linked statically:
the build tree is renamed after the build, which would break the absolute run paths of
shared libraries.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moeshard.moe.errors import MoeshardError

LLAMA_CPP_PYTHON = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
TARGETS = ("llama-bench", "test-backend-ops", "llama-quantize", "llama-batched-bench")
# The native build segfaults in ggml-cpu's AMX path on Q4_0 models on some CPUs. With
# GGML_NATIVE=ON the instruction sets come from -march=native (the GGML_AMX_* switches only
# act on non-native builds), so AMX is switched off with the compiler's own flags; GCC and
# Clang give an explicit -mno-X precedence over -march=native whatever their order.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# ggml block sizes: bytes per block of 32 weights
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34}


def cache_root(explicit: str | None) -> Path:
    """--cache DIR, else $MOESHARD_CACHE, else ~/.cache/moeshard."""
    root = explicit or os.environ.get("MOESHARD_CACHE") or "~/.cache/moeshard"
    return Path(root).expanduser().resolve()


def run_logged(cmd: Sequence[str | Path], log: Path, what: str, **kwargs) -> None:
    """Run cmd with its output appended to `log`; a failure is one MoeshardError line naming
    what failed, the last line the tool printed, and the log."""
    cmd = [str(c) for c in cmd]
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        kwargs.setdefault("env", tool_env())
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kwargs)
    if proc.returncode != 0:
        raise MoeshardError(
            f"{what} failed (exit {proc.returncode}): {last_line(log)} (full log: {log})"
        )


def tool_env() -> dict[str, str]:
    """The environment llama.cpp's tools run in: this process's, less the OMP_WAIT_POLICY
    that moeshard's kernels set for themselves (`moeshard.moe.kernels.dots`). llama.cpp is built
    with OpenMP and synchronises its threads many times per token; made to sleep at every barrier
    it decoded the demo model 3x slower (457 instead of 1390 tok/s). A policy the user set
    is kept."""
    from moeshard.moe.kernels import dots

    env = dict(os.environ)
    if dots.OMP_WAIT_POLICY_DEFAULTED:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def last_line(path: Path) -> str:
    """The last non-empty line of a text file (a failed tool's error, usually)."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    return next((line for line in reversed(lines) if line), "(no output)")


# --- the sdist and the build ---------------------------------------------------------------


def find_sdist(cache: Path, explicit: str | None, log: Path) -> Path:
    """The llama-cpp-python sdist: --sdist, else the one in the cache, else `pip download`
    into the cache (run there, not in the repository)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise MoeshardError(f"--sdist {explicit}: no such file")
        return path
    path = cache / SDIST_NAME
    if path.is_file():
        return path
    print(f"downloading {SDIST_NAME} with pip into {cache}", file=sys.stderr)
    run_logged(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        + [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", cache],
        log,
        "pip download of the llama-cpp-python sdist",
        cwd=cache,
    )
    if not path.is_file():
        raise MoeshardError(f"pip download did not leave {path} (log: {log})")
    return path


def upstream_commit(changelog: str, version: str = LLAMA_CPP_PYTHON) -> str:
    """The llama.cpp commit a llama-cpp-python release vendors, from its CHANGELOG.md: the first
    `ggml-org/llama.cpp@<hash>` of the release's section ("unknown" when absent)."""
    section = changelog.split(f"## [{version}]", 1)
    if len(section) < 2:
        return "unknown"
    body = section[1].split("\n## [", 1)[0]
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", body)
    return m.group(1) if m else "unknown"


# `--isa avx2`: what an AVX2 machine's build compiles (GGML_NATIVE=OFF), nothing newer
AVX2_ARGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX_VNNI=OFF",
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX512_VBMI=OFF",
    "-DGGML_AVX512_VNNI=OFF",
    "-DGGML_AVX512_BF16=OFF",
)
ISAS = ("native", "avx2")


def cmake_args(src: Path, build: Path, commit: str, isa: str = "native") -> list[str]:
    """Configure a Release, AMX-free, static build of only what the bench needs: for this
    CPU (native) or for any AVX2 CPU (avx2)."""
    level = ["-DGGML_NATIVE=ON"] if isa == "native" else list(AVX2_ARGS)
    args = [
        "-S",
        str(src),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        *level,
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=ON",  # test-backend-ops
        "-DLLAMA_BUILD_TOOLS=ON",  # llama-bench, llama-quantize
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_OPENSSL=OFF",
        f"-DLLAMA_BUILD_COMMIT={commit}",  # no .git in an sdist: say which commit it is
        "-DLLAMA_BUILD_NUMBER=0",
    ]
    if platform.machine().lower() in ("x86_64", "amd64"):
        args += [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
    return args


@dataclass(frozen=True)
class LlamaCpp:
    """A finished build in the cache."""

    root: Path

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def info(self) -> dict:
        return json.loads((self.root / "build-info.json").read_text())

    def bin(self, name: str) -> Path:
        return self.root / "build" / "bin" / name


def ensure_built(cache: Path, sdist: str | None, isa: str = "native") -> LlamaCpp:
    """The cached build for `isa` (`ISAS`), building it first when it is not there (a few
    minutes)."""
    if isa not in ISAS:
        raise MoeshardError(f"llama.cpp build {isa!r}: expected one of {', '.join(ISAS)}")
    final = cache / f"llama.cpp-{LLAMA_CPP_PYTHON}{'' if isa == 'native' else '-' + isa}"
    built = LlamaCpp(final)
    if (final / "build-info.json").is_file():
        missing = missing_targets(built)
        if not missing:
            return built
        # a build from before a target was added: made again (its object files are not kept)
        print(
            f"llama.cpp build {final} lacks {', '.join(missing)}: building it again",
            file=sys.stderr,
        )
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / f"{final.name}.build.log"
    log.write_text("")
    archive = find_sdist(cache, sdist, log)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.partial-", dir=cache))
    try:
        _build(archive, tmp, log, isa)
        if final.exists():  # a leftover without build-info.json
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return built


def missing_targets(build: LlamaCpp) -> list[str]:
    """The TARGETS a finished build has no binary for."""
    return [t for t in TARGETS if not build.bin(t).is_file()]


def _build(archive: Path, root: Path, log: Path, isa: str) -> None:
    """Extract the vendored llama.cpp into root/src, build TARGETS into root/build, and write
    root/build-info.json (version, upstream commit, flags, build time)."""
    started = time.perf_counter()
    print(f"building llama.cpp from {archive} (a few minutes; log: {log})", file=sys.stderr)
    changelog = _extract_vendored(archive, root / "src")
    commit = upstream_commit(changelog)
    build = root / "build"
    configure = cmake_args(root / "src", build, commit, isa)
    run_logged(["cmake", *configure], log, "cmake configure of llama.cpp")
    jobs = str(os.cpu_count() or 1)
    run_logged(
        ["cmake", "--build", build, "--config", "Release", "-j", jobs, "--target", *TARGETS],
        log,
        "cmake build of llama.cpp",
    )
    version = subprocess.run(
        [build / "bin" / "llama-bench", "--version"], capture_output=True, text=True
    )
    info = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "llama_cpp_commit": commit,
        "version": (version.stdout + version.stderr).strip().splitlines()[:1],
        "cmake_args": [a for a in configure if a.startswith("-D")],
        "build_s": round(time.perf_counter() - started, 1),
        "sdist": str(archive),
    }
    (root / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    for objects in list(build.rglob("CMakeFiles")):  # not needed once linked (static)
        shutil.rmtree(objects, ignore_errors=True)


def _extract_vendored(archive: Path, dest: Path) -> str:
    """Unpack the sdist's vendor/llama.cpp into dest; returns the sdist's CHANGELOG.md."""
    staging = dest.parent / "sdist"
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")
    (top,) = staging.iterdir()
    vendored = top / "vendor" / "llama.cpp"
    if not (vendored / "CMakeLists.txt").is_file():
        raise MoeshardError(f"{archive}: no vendor/llama.cpp/CMakeLists.txt in the sdist")
    changelog = (top / "CHANGELOG.md").read_text() if (top / "CHANGELOG.md").is_file() else ""
    os.rename(vendored, dest)
    shutil.rmtree(staging)
    return changelog


# --- conversion and quantization ----------------------------------------------------------

# Runs llama.cpp's convert_hf_to_gguf.py with one change, written next to the outputs.
CONVERT_WRAPPER = '''\
"""llama.cpp's convert_hf_to_gguf.py, declaring a plain byte-level BPE tokenizer "gpt-2".

The converter names a BPE tokenizer's pre-tokenizer by hashing the tokens of a fixed text and
refuses a hash it does not know (it knows published models' tokenizers only). moeshard's demo
model has a tokenizer trained on this machine (tools/train_demo_lib/tokenizer.py): a ByteLevel
pre-tokenizer with GPT-2's regex and nothing else, which is what llama.cpp's "gpt-2"
pre-tokenizer implements (the converter's name for openai-community/gpt2's). So an unknown
hash with that tokenizer.json is declared "gpt-2"; any other unknown tokenizer still fails
as upstream would. Usage: wrapper.py LLAMA_SRC converter-args...
"""
import json
import runpy
import sys
from pathlib import Path

src = Path(sys.argv.pop(1))
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion.base import TextModel  # noqa: E402

upstream = TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return upstream(self, tokenizer)
    except NotImplementedError:
        spec = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())
        pre = spec.get("pre_tokenizer") or {}
        if pre == {**pre, "type": "ByteLevel", "add_prefix_space": False, "use_regex": True}:
            print("convert wrapper: unknown BPE pre-tokenizer hash; tokenizer.json has a plain "
                  "GPT-2 ByteLevel pre-tokenizer: declaring it 'gpt-2'", file=sys.stderr)
            return "gpt-2"
        raise


TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = str(src / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def convert_hf(
    llama: LlamaCpp, python: Path, hf_dir: Path, out: Path, log: Path, outtype: str = "bf16"
) -> None:
    """HF checkpoint -> GGUF (`outtype`: bf16, f32, ...) with llama.cpp's converter (run by
    `python`, which has torch and transformers); written to a temporary name and renamed
    when complete."""
    wrapper = out.parent / "convert_hf_to_gguf_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER)
    tmp = out.with_name(out.name + ".partial")
    env = {k: v for k, v in tool_env().items() if k not in ("PYTHONPATH", "NO_LOCAL_GGUF")}
    run_logged(
        [python, wrapper, llama.src, hf_dir, "--outtype", outtype, "--outfile", tmp],
        log,
        f"llama.cpp's convert_hf_to_gguf.py on {hf_dir}",
        env=env,
    )
    os.rename(tmp, out)


# llama.cpp's names of every 2-D tensor outside the routed experts that a Qwen3-MoE / Qwen2-MoE
# model can have; llama-quantize leaves 1-D tensors (norms) in f32 and routers unquantized.
TRUNK_TENSORS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate_inp",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "ffn_gate_inp_shexp",
)


def same_formats_args(trunk: str = "bf16") -> list[str]:
    """llama-quantize options keeping every non-expert tensor in `trunk` (moeshard's default
    conversion: q4_0 experts, bf16 trunk)."""
    args = ["--token-embedding-type", trunk, "--output-tensor-type", trunk]
    for name in TRUNK_TENSORS:
        args += ["--tensor-type", f"{name}={trunk}"]
    return args


def quantize(
    llama: LlamaCpp,
    src: Path,
    out: Path,
    options: Sequence[str],
    threads: int,
    log: Path,
    ftype: str = "Q4_0",
) -> None:
    """llama-quantize src -> out as `ftype` with extra options (temporary name, then
    renamed)."""
    tmp = out.with_name(out.name + ".partial")
    run_logged(
        [llama.bin("llama-quantize"), *options, src, tmp, ftype, str(threads)],
        log,
        f"llama-quantize of {src.name}",
    )
    os.rename(tmp, out)


def tensor_group(name: str, dims: int) -> str:
    """Which part of the model a tensor (llama.cpp's naming) belongs to, for a formats check."""
    if "_exps." in name:  # blk.N.ffn_{gate,up,down}_exps.weight: the routed experts
        return "experts"
    if ".ffn_gate_inp." in name:
        return "routers"
    return "1-D" if dims == 1 else "other 2-D"


def tensor_formats(path: Path) -> dict[str, dict[str, int]]:
    """{"experts" | "routers" | "other 2-D" | "1-D": {ggml type name: bytes}} of a GGUF file."""
    from gguf import GGUFReader

    groups: dict[str, dict[str, int]] = {}
    for t in GGUFReader(path).tensors:
        kinds = groups.setdefault(tensor_group(t.name, len(t.shape)), {})
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return groups


def check_same_formats(path: Path) -> None:
    """Refuse a 'same formats' file that is not moeshard's default conversion: q4_0 experts,
    bf16 for every other matrix but the routers, which both keep in f32 (as the norms)."""
    groups = tensor_formats(path)
    if (
        set(groups.get("experts", {})) != {"Q4_0"}
        or set(groups.get("other 2-D", {})) != {"BF16"}
        or set(groups.get("routers", {})) - {"F32"}
    ):
        raise MoeshardError(f"{path}: not q4_0 experts with a bf16 trunk: {groups}")


# --- running the benchmark tools ----------------------------------------------------------


@dataclass
class LlamaBenchResult:
    """One llama-bench test: pp (n_prompt > 0) or tg (n_gen > 0)."""

    n_prompt: int
    n_gen: int
    tokens_per_s: float  # the median of samples_ts over the repetitions (avg_ts if absent)
    model_size: int  # bytes of weights
    model_type: str  # e.g. "qwen3moe 30B.A3B Q4_0"
    n_threads: int
    build_commit: str


def parse_llama_bench_json(text: str) -> list[LlamaBenchResult]:
    """llama-bench `-o json` output (a JSON list of test records)."""
    return [
        LlamaBenchResult(
            n_prompt=int(r["n_prompt"]),
            n_gen=int(r["n_gen"]),
            tokens_per_s=float(statistics.median(r.get("samples_ts") or [r["avg_ts"]])),
            model_size=int(r["model_size"]),
            model_type=str(r["model_type"]),
            n_threads=int(r["n_threads"]),
            build_commit=str(r["build_commit"]),
        )
        for r in json.loads(text)
    ]


def llama_bench_cmd(
    llama: LlamaCpp,
    model: Path,
    threads: int,
    n_prompt: int,
    n_gen: int,
    extra: Sequence[str] = (),
    repetitions: int = 1,
) -> list[str]:
    """`repetitions` of a pp{n_prompt} and/or a tg{n_gen} test (a 0 leaves one out), JSON
    out. llama-bench runs a short warm-up of its own first, but its first repetitions are
    still slower (measured on the demo model: 813, 982, then 1377-1421 tok/s): take the
    median of several."""
    cmd = [str(llama.bin("llama-bench")), "-m", str(model), "-t", str(threads)]
    cmd += ["-r", str(repetitions)]
    cmd += ["-p", str(n_prompt), "-n", str(n_gen), "-o", "json", *extra]
    return cmd


def run_tool(cmd: Sequence[str], timeout: float | None = None) -> str:
    """Run one of llama.cpp's tools -> its stdout; a clear error with its last line of output
    (stderr's, else stdout's) when it fails."""
    cmd = [str(c) for c in cmd]
    name = os.path.basename(cmd[0])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=tool_env())
    except subprocess.TimeoutExpired:
        raise MoeshardError(f"{name} did not finish in {timeout:g} s (stopped)") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines()
        tail = lines[-1] if lines else "(no output)"
        raise MoeshardError(f"{name} failed (exit {proc.returncode}): {tail}")
    return proc.stdout


def run_llama_bench(cmd: Sequence[str], timeout: float | None = None) -> list[LlamaBenchResult]:
    return parse_llama_bench_json(run_tool(cmd, timeout))


def backend_ops_threads() -> int:
    """The threads test-backend-ops gives the CPU backend: fixed at max(1, cores / 2)
    (std::thread::hardware_concurrency() / 2 in tests/test-backend-ops.cpp)."""
    return max(1, (os.cpu_count() or 1) // 2)


def mul_mat_filter(formats: Sequence[str], cols: Sequence[int], m: int, k: int) -> str:
    """test-backend-ops -p regex (searched in a case's parameter string) selecting MUL_MAT of
    an m x k weight in each format times n f32 columns: its perf cases 4096 x 14336 at
    n = 1, 2, 3, 4, 5, 8, 512 for every type."""
    return (
        f"type_a=({'|'.join(formats)}),type_b=f32,m={m},n=({'|'.join(str(c) for c in cols)}),k={k},"
    )


def parse_params(op_params: str) -> dict[str, str]:
    """'type_a=q4_0,type_b=f32,m=4096,n=1,k=14336,bs=[1,1],...' -> {name: value}."""
    return dict(re.findall(r"(\w+)=(\[[^\]]*\]|[^,]*)", op_params))


# test-backend-ops perf's console line of a case (its --output csv has no timings):
#   MUL_MAT(type_a=q4_0,...,k=14336,...):   207 runs -  4889.79 us/run - 117.44 MFLOP/run - ...
_PERF_LINE = re.compile(r"^\s*(?P<op>\w+)\((?P<params>.*)\):\s+\d+ runs -\s+(?P<us>[0-9.]+) us/run")


def parse_backend_ops_perf(text: str) -> dict[tuple[str, int], float]:
    """test-backend-ops `perf -o MUL_MAT` output -> {(type_a, n): microseconds per run}.
    Cases that did not run ("not supported") have no us/run and are left out."""
    out = {}
    for line in text.splitlines():
        m = _PERF_LINE.match(line)
        if m and m["op"] == "MUL_MAT":
            params = parse_params(m["params"])
            out[(params["type_a"], int(params["n"]))] = float(m["us"])
    return out


def run_backend_ops(llama: LlamaCpp, filter_regex: str) -> dict[tuple[str, int], float]:
    cmd = [llama.bin("test-backend-ops"), "perf", "-o", "MUL_MAT", "-b", "CPU", "-p", filter_regex]
    return parse_backend_ops_perf(run_tool(cmd))


def packed_bytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of an rows x cols matrix in a ggml block format."""
    return rows * cols // 32 * BLOCK_BYTES[fmt]
