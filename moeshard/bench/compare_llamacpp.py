"""`moeshard bench compare-llamacpp`: moeshard against llama.cpp on this machine, in one run.

The table measured rather than quoted: llama.cpp is built from the sources vendored in the
llama-cpp-python sdist (`moeshard.bench.llamacpp`, cached outside the repository),
the embedded demo model and a 706 MB `tools/make_big_checkpoint.py` model are converted with
llama.cpp's own converter and with `moeshard convert`, and then both tools run the same work
in interleaved rounds (llama.cpp, then moeshard, then the next round), so a shared machine's
drift hits both alike. Each row prints the median and the range over the rounds, and the
moeshard/llama.cpp ratio of each round's pair.

- decode: llama-bench `tg` (one token at a time from an empty context) against moeshard's
  in-process greedy generation (`open_local`), tokens / sum of decode-step seconds;
- prefill: llama-bench `pp` (one batch) against moeshard's prefill of a prompt as long;
- kernels: a 4096 x 14336 matrix (4096 outputs, 14336 inputs) in q4_0 and q8_0 times 1 and 4
  columns, GB/s of packed weights: test-backend-ops' `perf` MUL_MAT cases of that shape
  against `quant.matmul`, at the thread count test-backend-ops fixes for itself;
- memory-capped (when a cgroup memory controller is writable): the big model under a hard
  memory limit below its size, llama-bench (its defaults, and mmap without repacking) against
  `moeshard generate --ram`, each in a fresh child cgroup, the model's pages dropped from the
  page cache before each run (pages already cached would not be charged to the cgroup);
- batched: the big model with 1 and `--sequences` sequences decoding together,
  llama-batched-bench against moeshard's batched pass, and each side's scaling
  (`compare_batched`).

The last lines compare the ratios with the goals (`compare_table.GOALS`). Unmet goals are results,
not failures: the exit code is 0 unless the build, a conversion or a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numba

from moeshard.bench import llamacpp
from moeshard.bench.compare_bandwidth import Bandwidth
from moeshard.bench.compare_batched import PROMPT_TOKENS, Batched
from moeshard.bench.compare_sides import MATRIX, REPETITIONS, RUN_TIMEOUT_S, InRam, Kernels
from moeshard.bench.compare_table import GOALS, Row, goal_line, relative_goal_line, table
from moeshard.bench.kernels import POOL_BYTES, _cpu_name
from moeshard.bench.llamacpp import LlamaCpp
from moeshard.bench.memory_cgroup import (
    CappedRun,
    MemoryCgroup,
    drop_page_cache,
    find_memory_cgroup,
    model_files,
)
from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import dots, idots, quant
from moeshard.moe.kernels.build import cpu_level, target_features
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.storage.manifest import FORMAT_VERSION, MANIFEST
from moeshard.moe.units import fmt_bytes, parse_size

REPO = Path(__file__).resolve().parents[2]
DEMO_HF = REPO / "models" / "demo-hf"
BIG_ARGS = ["--layers", "8", "--experts", "64", "--hidden", "1024", "--inter", "768"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PARTS = ("kernels", "bandwidth", "demo", "big", "capped", "kquants", "batched")
K_MIX = "Q4_K_M experts"  # the big model's llama-quantize Q4_K_M experts, bf16 trunk
CAP_MARGIN = (
    256 << 20
)  # the interpreter with numpy, numba and the kernels (~245 MB RSS) beside --ram


# --- preparing the models ------------------------------------------------------------------


def moeshard_cli() -> list[str]:
    """This interpreter running the `moeshard` command line."""
    return [sys.executable, "-m", "moeshard"]


@dataclass
class Workspace:
    """The converted models in <cache>/compare-llamacpp, each made once and reused."""

    root: Path
    llama: LlamaCpp
    threads: int
    convert_python_arg: str | None = None  # --convert-python
    _convert_python: Path | None = None

    @property
    def log(self) -> Path:
        return self.root / "prepare.log"

    @property
    def convert_python(self) -> Path:
        """An interpreter with torch and transformers for llama.cpp's converter:
        --convert-python, else the repository's reference venv (`make ref-venv` when missing)."""
        if self._convert_python is None:
            self._convert_python = Path(self.convert_python_arg or REPO / ".venv-ref/bin/python")
            if not self.convert_python_arg and not (REPO / ".venv-ref" / ".stamp").is_file():
                self.step("make ref-venv (torch and transformers, for llama.cpp's converter)")
                llamacpp.run_logged(["make", "ref-venv"], self.log, "make ref-venv", cwd=REPO)
        return self._convert_python

    def step(self, what: str) -> None:
        print(f"compare-llamacpp: {what}", file=sys.stderr, flush=True)

    def moeshard_convert(self, hf: Path, out: Path) -> Path:
        """moeshard's conversion of hf, cached in `out` (made again when this build's store
        format differs from the cached one's)."""
        if _format_version(out) != FORMAT_VERSION:
            self.step(f"moeshard convert {hf} -> {out}")
            cmd = [*moeshard_cli(), "convert", hf, out, "--force"]
            llamacpp.run_logged(cmd, self.log, f"moeshard convert {hf}", cwd=REPO)
        return out

    def llama_variants(
        self, hf: Path, name: str, default_too: bool, k_mix: bool = False
    ) -> dict[str, Path]:
        """{"same formats": q4_0 experts + bf16 trunk, "Q4_0" (if default_too): llama-quantize's
        own Q4_0 mix, "Q4_K_M experts" (if k_mix): its Q4_K_M mix of the experts (Q4_K, some
        layers' down projections Q6_K) + bf16 trunk} GGUF files of an HF checkpoint (via a
        bf16 GGUF, deleted afterwards)."""
        wanted = {"same formats": self.root / f"{name}-q4_0-bf16trunk.gguf"}
        if default_too:
            wanted["Q4_0"] = self.root / f"{name}-Q4_0.gguf"
        if k_mix:
            wanted[K_MIX] = self.root / f"{name}-q4_k_m-bf16trunk.gguf"
        if all(p.is_file() for p in wanted.values()):
            return wanted
        bf16 = self.root / f"{name}-bf16.gguf"
        if not bf16.is_file():
            self.step(f"llama.cpp convert_hf_to_gguf.py {hf} -> {bf16}")
            llamacpp.convert_hf(self.llama, self.convert_python, hf, bf16, self.log)
        same = llamacpp.same_formats_args("bf16")
        options = {"same formats": (same, "Q4_0"), "Q4_0": ([], "Q4_0"), K_MIX: (same, "Q4_K_M")}
        for label, path in wanted.items():
            if not path.is_file():
                self.step(f"llama-quantize {bf16.name} -> {path.name}")
                args, ftype = options[label]
                llamacpp.quantize(self.llama, bf16, path, args, self.threads, self.log, ftype)
                self.check_loads(path)
        llamacpp.check_same_formats(wanted["same formats"])
        bf16.unlink()
        return wanted

    def check_loads(self, gguf: Path) -> None:
        """One token through llama-bench, so a file llama.cpp cannot load fails here, once,
        and is not kept in the cache."""
        cmd = llamacpp.llama_bench_cmd(self.llama, gguf, self.threads, 0, 1)
        try:
            llamacpp.run_llama_bench(cmd, timeout=RUN_TIMEOUT_S)
        except MoeshardError as exc:
            gguf.unlink()
            raise MoeshardError(f"{gguf.name} does not load in llama.cpp: {exc}") from None

    def big_hf(self) -> Path:
        """tools/make_big_checkpoint.py's 706 MB-as-q4_0 Qwen3-MoE, with the demo model's
        tokenizer (the same 4096-token vocabulary) because llama.cpp's converter needs one."""
        out = self.root / "big-hf"
        if not (out / "model.safetensors.index.json").is_file():
            self.step(f"tools/make_big_checkpoint.py {out} {' '.join(BIG_ARGS)}")
            tmp = self.root / "big-hf.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            tool = REPO / "tools" / "make_big_checkpoint.py"
            llamacpp.run_logged([sys.executable, tool, tmp, *BIG_ARGS], self.log, str(tool))
            for name in TOKENIZER_FILES:
                shutil.copy(DEMO_HF / name, tmp / name)
            shutil.rmtree(out, ignore_errors=True)
            os.rename(tmp, out)
        return out


def _format_version(model: Path) -> int | None:
    try:
        return json.loads((model / MANIFEST).read_text()).get("format_version")
    except (OSError, ValueError, AttributeError):
        return None


class Capped:
    """Decode under a memory cap below the model's size: llama-bench with its defaults and
    with mmap and no repacking (the weights then stay in the page cache, which the kernel can
    evict), against `moeshard generate --ram <cap - margin>`, each in a fresh cgroup."""

    LLAMA_MODES = {
        "defaults": [],
        "mmap": ["-lm", "mmap", "--repack", "0"],
    }

    def __init__(self, cgroup: tuple[str, Path], gguf: Path, moeshard_dir: Path, cfg) -> None:
        self.cgroup, self.gguf, self.moeshard_dir, self.cfg = cgroup, gguf, moeshard_dir, cfg
        self.ram = cfg.cap - CAP_MARGIN
        cap = fmt_bytes(cfg.cap)
        self.rows = {
            "defaults": Row(
                "capped defaults", f"memory cap {cap}, decode tok/s vs llama.cpp defaults"
            ),
            "mmap": Row(
                "capped mmap", f"memory cap {cap}, decode tok/s vs llama.cpp mmap, no repack"
            ),
        }

    def _capped(self, cmd: Sequence[str], env: dict | None = None) -> CappedRun:
        drop_page_cache(model_files(self.gguf) + model_files(self.moeshard_dir))
        with MemoryCgroup(*self.cgroup, self.cfg.cap) as cg:
            return cg.run(cmd, env)

    def _llama(self, mode: str) -> tuple[float | None, str | None]:
        cmd = llamacpp.llama_bench_cmd(
            self.cfg.llama, self.gguf, self.cfg.threads, 0, self.cfg.capped_tokens
        )
        run = self._capped(cmd + self.LLAMA_MODES[mode], llamacpp.tool_env())
        if run.returncode == 0:
            return llamacpp.parse_llama_bench_json(run.stdout)[0].tokens_per_s, None
        return None, _failure(run)

    def _moeshard(self) -> float:
        cmd = [*moeshard_cli(), "generate", str(self.moeshard_dir), "--ram", str(self.ram)]
        cmd += ["--prompt-ids", "1", "--max-tokens", str(self.cfg.capped_tokens + 1), "--json"]
        env = dict(os.environ, NUMBA_NUM_THREADS=str(self.cfg.threads))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        run = self._capped(cmd, env)
        if run.returncode != 0:
            tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise MoeshardError(f"moeshard generate under the memory cap: {_failure(run)}: {tail}")
        return float(json.loads(run.stdout.strip().splitlines()[-1])["stats"]["tokens_per_s"])

    def round(self) -> None:
        for mode, row in self.rows.items():
            value, failure = self._llama(mode)
            row.llama.append(value)
            if failure:
                row.failures.append(failure)
        tps = self._moeshard()
        for row in self.rows.values():
            row.moeshard.append(tps)


def _failure(run: CappedRun) -> str:
    if run.oom_killed:
        return "OOM-killed"
    return "timed out" if run.timed_out else f"exit {run.returncode}"


# --- the command -----------------------------------------------------------------------------


@dataclass
class Config:
    """What one run measures (resolved from the options)."""

    threads: int
    rounds: int
    tokens: int  # decode tokens per round
    prompt_tokens: int  # prefill length
    capped_tokens: int
    cap: int  # bytes
    kernel_samples: int
    parts: tuple[str, ...]
    sequences: int = 16  # the batched part's many
    llama: LlamaCpp | None = None  # the build, once it is there


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache",
        help="cache directory for the llama.cpp build and the converted models "
        "(default: $MOESHARD_CACHE, else ~/.cache/moeshard)",
    )
    p.add_argument(
        "--sdist",
        help=f"the {llamacpp.SDIST_NAME} to build from (default: the one in the cache; "
        "pip downloads it there when missing)",
    )
    p.add_argument(
        "--convert-python",
        help="python with torch + transformers for llama.cpp's converter "
        "(default: the repository's .venv-ref, made by `make ref-venv` when missing)",
    )
    p.add_argument("--threads", type=int, default=0, help="llama.cpp -t and numba threads (0: all)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default: 3, --quick 1)")
    p.add_argument("--tokens", type=int, help="decode tokens per round (default: 128, --quick 32)")
    p.add_argument("--prompt-tokens", type=int, default=100, help="prefill length in tokens")
    p.add_argument(
        "--cap", default="512M", help="memory cap of the capped rows (below the big model's size)"
    )
    p.add_argument(
        "--capped-tokens", type=int, help="decode tokens per capped run (default: 32, --quick 16)"
    )
    p.add_argument(
        "--sequences", type=int, default=16, help="batched part: sequences decoding together"
    )
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--quick", action="store_true", help="fewer rounds, tokens and samples")
    p.add_argument(
        "--isa",
        choices=llamacpp.ISAS,
        default="native",
        help="native: both sides built for this CPU; avx2: both as on an AVX2 machine "
        "(llama.cpp built with GGML_NATIVE=OFF and AVX2 flags, cached apart; moeshard's "
        "kernels compiled for a Haswell-level CPU with this one's AVX-512/VNNI/AMX off)",
    )


def _or(given: int | None, default: int) -> int:
    """An option's value, or its default when not given (0 is a value: it is refused)."""
    return default if given is None else given


def _config(args) -> Config:
    """The options checked, before anything is built or converted."""
    parts = tuple(p.strip() for p in args.only.split(",") if p.strip())
    unknown = set(parts) - set(PARTS)
    if unknown or not parts:
        raise MoeshardError(f"--only: choose from {','.join(PARTS)} (got {args.only!r})")
    threads = args.threads or os.cpu_count() or 1
    if not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
        raise MoeshardError(f"--threads: 1 to {numba.config.NUMBA_NUM_THREADS} on this machine")
    cfg = Config(
        threads=threads,
        rounds=_or(args.rounds, 1 if args.quick else 3),
        tokens=_or(args.tokens, 32 if args.quick else 128),
        prompt_tokens=args.prompt_tokens,
        capped_tokens=_or(args.capped_tokens, 16 if args.quick else 32),
        cap=parse_size(args.cap),
        kernel_samples=3 if args.quick else 7,
        parts=parts,
        sequences=args.sequences,
    )
    if cfg.sequences < 2:
        raise MoeshardError("--sequences: at least 2")
    if min(cfg.rounds, cfg.tokens, cfg.prompt_tokens, cfg.capped_tokens) < 1:
        raise MoeshardError("--rounds, --tokens, --prompt-tokens, --capped-tokens: at least 1")
    if cfg.cap <= CAP_MARGIN:
        raise MoeshardError(f"--cap must exceed {fmt_bytes(CAP_MARGIN)} (the process margin)")
    return cfg


def _cpu_line(threads: int) -> str:
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni") if f in flags]
    amx = sorted(f for f in flags if f.startswith("amx"))
    spin = os.environ.get("GOMP_SPINCOUNT", "0")
    return (
        f"cpu: {_cpu_name()} ({' '.join(isa + amx) or 'no AVX2'}), {os.cpu_count()} cores; "
        f"threads: {threads} (llama.cpp -t, numba); moeshard kernels: {cpu_level()} level, "
        f"integer dots {idots.ISA}, idle threads {quant.wait_policy()} (GOMP_SPINCOUNT {spin})"
    )


def _llama_line(llama: LlamaCpp) -> str:
    info = llama.info
    flags = " ".join(
        a for a in info["cmake_args"] if any(k in a for k in ("AMX", "NATIVE", "FLAGS", "AVX"))
    )
    return (
        f"llama.cpp: ggml-org/llama.cpp@{info['llama_cpp_commit']} from llama-cpp-python "
        f"{info['llama_cpp_python']} ({'; '.join(info['version'])}), Release, static, {flags}; "
        f"built in {info['build_s'] / 60:.1f} min"
    )


def _size(path: Path) -> str:
    return fmt_bytes(sum(p.stat().st_size for p in model_files(path)))


# `--isa avx2` runs the bench again in a child whose numba compiles for an AVX2 CPU: numba
# reads NUMBA_CPU_NAME/FEATURES when it is imported, which this process has done already
_PLAYING_AVX2 = "MOESHARD_BENCH_AS_AVX2"


def _as_avx2_machine() -> int:
    """Run this command again with numba compiling for a Haswell-level CPU: this CPU's
    features with everything past AVX2 (AVX-512, AVX10, AVX-VNNI, AMX) turned off."""
    features = target_features()
    if "+avx2" not in features or "+fma" not in features:
        raise MoeshardError("--isa avx2: this CPU has no AVX2 and FMA")
    newer = ("+avx512", "+avx10", "+avxvnni", "+amx", "+avxifma", "+avxneconvert")
    kept = sorted(f if not f.startswith(newer) else "-" + f[1:] for f in features if f)
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=",".join(kept))
    if dots.OMP_WAIT_POLICY_DEFAULTED:  # this process's default, not the user's setting
        env.pop("OMP_WAIT_POLICY", None)
    env[_PLAYING_AVX2] = "1"
    return subprocess.run([sys.executable, "-m", "moeshard", *sys.argv[1:]], env=env).returncode


def run(args) -> int:
    if args.isa == "avx2" and not os.environ.get(_PLAYING_AVX2):
        return _as_avx2_machine()
    started = time.perf_counter()
    cfg = _config(args)
    cache = llamacpp.cache_root(args.cache)
    llama = cfg.llama = llamacpp.ensure_built(cache, args.sdist, args.isa)
    quant.set_threads(cfg.threads)
    quant.spin_while_waiting()  # as `moeshard generate` waits (llama.cpp's threads spin too)
    work = Workspace(cache / "compare-llamacpp", llama, cfg.threads, args.convert_python)
    work.root.mkdir(parents=True, exist_ok=True)
    header = [_cpu_line(cfg.threads), _llama_line(llama)]
    suites: list = []
    if "kernels" in cfg.parts:
        work.step("kernels: packing the 4096x14336 matrices")
        suites.append(Kernels(llama, cfg.kernel_samples))
        header.append(
            f"kernels: test-backend-ops perf MUL_MAT m={MATRIX[0]} k={MATRIX[1]} n=1,4 "
            f"(its own {suites[-1].threads} thread(s)): llama.cpp's generic ggml path, not "
            f"the repacked Q4_0x8 rows its model runs use (judge by the model rows); moeshard "
            f"quant.matmul, same threads"
        )
    if "bandwidth" in cfg.parts:
        work.step("bandwidth: filling pools of twice the last-level cache")
        suites.append(Bandwidth())
        header.append(
            f"bandwidth: moeshard's batch-1 products with weights from DRAM (pools of "
            f"{fmt_bytes(POOL_BYTES)}) against all threads summing 1 GiB, same round"
        )
    if "demo" in cfg.parts:
        demo = work.moeshard_convert(DEMO_HF, work.root / "demo")
        variants = work.llama_variants(DEMO_HF, "demo", default_too=False)
        header.append(_models_line("demo model", demo, variants))
        work.step("demo model: opening and warming moeshard")
        suites.append(InRam("demo model", "demo", demo, variants, cfg))
    if {"big", "capped", "kquants", "batched"} & set(cfg.parts):
        hf = work.big_hf()
        big = work.moeshard_convert(hf, work.root / "big")
        variants = work.llama_variants(hf, "big", True, k_mix="kquants" in cfg.parts)
        k_file = variants.pop(K_MIX, None)
        header.append(_models_line("big model", big, variants))
        if "big" in cfg.parts:
            work.step("big model: opening and warming moeshard")
            suites.append(InRam("big model", "big", big, variants, cfg))
        if "capped" in cfg.parts:
            found = find_memory_cgroup()
            if isinstance(found, str):
                header.append(f"memory-capped rows skipped: {found}")
            else:
                suites.append(Capped(found, variants["same formats"], big, cfg))
                header.append(
                    f"memory cap: {fmt_bytes(cfg.cap)} (cgroup {found[0]} under {found[1]}); "
                    f"moeshard --ram {fmt_bytes(cfg.cap - CAP_MARGIN)}; {cfg.capped_tokens} "
                    f"decode tokens per run; page cache of the model files dropped before each"
                )
        if "batched" in cfg.parts:
            work.step("big model, batched: opening and warming moeshard")
            same = variants["same formats"]
            suites.append(Batched("big model", big, same, cfg, cfg.sequences))
            header.append(
                f"batched: llama-batched-bench -npp {PROMPT_TOKENS} -ntg {cfg.tokens} "
                f"-npl 1,{cfg.sequences} on {same.name} against moeshard's forward_batch, "
                f"random tokens on both sides"
            )
        if k_file is not None:  # the same GGUF file on both sides: its experts kept as they are
            big_k = work.moeshard_convert(k_file, work.root / "big-q4_k_m")
            header.append(
                f"big model, Q4_K_M experts: {k_file.name} ({_size(k_file)}) in llama.cpp and "
                f"`moeshard convert`ed ({_size(big_k)}: its Q4_K/Q6_K blocks and bf16 trunk "
                f"kept, expert format {ModelDir(big_k).expert_format})"
            )
            work.step("big model, Q4_K_M experts: opening and warming moeshard")
            label, variants_k = "big model, Q4_K_M experts", {"same formats": k_file}
            suites.append(InRam(label, "bigk", big_k, variants_k, cfg))
    header.append(
        f"{cfg.rounds} interleaved round(s), llama.cpp then moeshard, in RAM each the median of "
        f"{REPETITIONS} repetitions; decode {cfg.tokens} "
        f"tokens (greedy), prefill {cfg.prompt_tokens} tokens; cells: median [min-max]"
    )
    measuring = time.perf_counter()
    for r in range(cfg.rounds):
        for suite in suites:
            work.step(f"round {r + 1}/{cfg.rounds}: {type(suite).__name__}")
            suite.round()
    rows = [row for suite in suites for row in _rows(suite)]
    vs_dram = [row for suite in suites if isinstance(suite, Bandwidth) for row in _rows(suite)]
    print("\n".join(header))
    print()
    print("\n".join(table([row for row in rows if all(row is not v for v in vs_dram)])))
    print()
    if vs_dram:
        print("\n".join(table(vs_dram, against="DRAM read")))
        print()
    for suite in suites:
        if isinstance(suite, Batched):
            print(suite.scaling_line())
            print()
    by_key = {row.key: row for row in rows}
    print("goals:")
    for goal in GOALS:
        print("  " + goal_line(goal, by_key.get(goal.key)))
    if "bigk decode same" in by_key:  # issue 39: K-quants at least as close as q4_0
        print("  " + relative_goal_line(by_key["bigk decode same"], by_key.get("big decode same")))
    print(
        f"\nmeasuring {time.perf_counter() - measuring:.1f} s; whole run "
        f"{time.perf_counter() - started:.0f} s (cache: {cache})"
    )
    return 0


def _rows(suite) -> list[Row]:
    if isinstance(suite, InRam):
        return suite.all_rows()
    return list(suite.rows.values())


def _models_line(label: str, moeshard_dir: Path, variants: dict[str, Path]) -> str:
    sizes = ", ".join(f"{name} {_size(path)}" for name, path in variants.items())
    return f"{label}: moeshard {_size(moeshard_dir)} (q4_0 experts, bf16 trunk); llama.cpp {sizes}"
