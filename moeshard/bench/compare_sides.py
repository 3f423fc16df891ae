"""The two sides of `moeshard bench compare-llamacpp` measured the same way: the kernel rows
(test-backend-ops against `quant.matmul`) and a model in RAM (llama-bench against moeshard's
own decode and prefill), one round at a time."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from moeshard.bench import llamacpp
from moeshard.bench.compare_table import Row
from moeshard.bench.kernels import _samples
from moeshard.bench.llamacpp import LlamaCpp
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.errors import MoeshardError
from moeshard.moe.kernels import quant

MATRIX = (4096, 14336)  # rows (outputs) x cols (inputs)
KERNEL_FORMATS = ("q4_0", "q8_0")
KERNEL_COLUMNS = (1, 4)
RUN_TIMEOUT_S = 900
REPETITIONS = 5  # per round and side in RAM: the median of these is the round's value


class Kernels:
    """The matrix rows: test-backend-ops perf against quant.matmul, GB/s of packed weights.

    Both sides use the same matrix over and over (test-backend-ops repeats its one op node on
    one weight tensor), and the same thread count: test-backend-ops fixes its own."""

    def __init__(self, llama: LlamaCpp, samples: int) -> None:
        self.llama, self.samples = llama, samples
        self.threads = llamacpp.backend_ops_threads()
        rows, cols = MATRIX
        rng = np.random.default_rng(0)
        w = rng.standard_normal((rows, cols), dtype=np.float32)  # [rows, cols]
        self.packed = {fmt: quant.pack(w, fmt) for fmt in KERNEL_FORMATS}
        self.x = {n: rng.standard_normal((n, cols), dtype=np.float32) for n in KERNEL_COLUMNS}
        self.rows = {
            (fmt, n): Row(
                f"kernel {fmt} {n}",
                f"{rows}x{cols} {fmt} x {n} col{'s' * (n > 1)}, GB/s ({self.threads} thr)",
            )
            for n in KERNEL_COLUMNS
            for fmt in KERNEL_FORMATS
        }

    def round(self) -> None:
        rows, cols = MATRIX
        regex = llamacpp.mul_mat_filter(KERNEL_FORMATS, KERNEL_COLUMNS, rows, cols)
        us = llamacpp.run_backend_ops(self.llama, regex)
        for (fmt, n), row in self.rows.items():
            if (fmt, n) not in us:
                raise MoeshardError(f"test-backend-ops printed no MUL_MAT {fmt} n={n} {regex}")
            row.llama.append(llamacpp.packed_bytes(fmt, rows, cols) / us[(fmt, n)] / 1e3)
        previous = quant.threads()
        quant.set_threads(self.threads)
        try:
            for (fmt, n), row in self.rows.items():
                row.moeshard.append(self._moeshard_gbs(fmt, n))
        finally:
            quant.set_threads(previous)

    def _moeshard_gbs(self, fmt: str, n: int) -> float:
        """Median GB/s of packed weights over `samples` timed samples of quant.matmul."""
        rows, cols = MATRIX
        data, x = self.packed[fmt], self.x[n]
        seconds = _samples(lambda: quant.matmul(data, fmt, rows, cols, x), self.samples, 0.05)
        return data.size / float(np.median(seconds)) / 1e9


class InRam:
    """One model in RAM: llama-bench (pp and tg in one invocation) on each llama.cpp variant,
    then moeshard's decode and prefill with the runtime opened once."""

    def __init__(self, label: str, key: str, moeshard_dir: Path, variants: dict[str, Path], cfg):
        self.label, self.key, self.variants, self.cfg = label, key, variants, cfg
        self.rt = open_local(moeshard_dir)
        self.rt.experts.preload()  # every record in RAM, as llama.cpp has loaded its model
        vocab = self.rt.config.vocab_size
        self.prompt = np.random.default_rng(0).integers(1, vocab, cfg.prompt_tokens).tolist()
        self.decode_tps()  # warm: first touches, caches, anything lazy
        self.prefill_tps()
        self.rows: dict[str, tuple[Row, Row]] = {}
        for variant in variants:
            what = "same formats" if variant == "same formats" else "default vs llama.cpp Q4_0"
            self.rows[variant] = (
                Row(f"{key} decode {_short(variant)}", f"{label}, decode tok/s, {what}"),
                Row(
                    f"{key} prefill {_short(variant)}",
                    f"{label}, prefill {cfg.prompt_tokens} tok, tok/s, {what}",
                ),
            )

    def decode_tps(self) -> float:
        """Greedy decode from a one-token prompt: tokens / sum of decode-step seconds."""
        result = generate(self.rt.transformer, [1], SamplingOptions(max_tokens=self.cfg.tokens + 1))
        return len(result.decode_s) / sum(result.decode_s)

    def prefill_tps(self) -> float:
        result = generate(self.rt.transformer, self.prompt, SamplingOptions(max_tokens=1))
        return len(self.prompt) / result.prefill_s

    def round(self) -> None:
        """Each side runs REPETITIONS times back to back and gives its median (llama-bench's
        first repetitions are slower; moeshard's are not, it was warmed at start)."""
        for variant, path in self.variants.items():
            cmd = llamacpp.llama_bench_cmd(
                self.cfg.llama, path, self.cfg.threads, self.cfg.prompt_tokens, self.cfg.tokens,
                repetitions=REPETITIONS,
            )  # fmt: skip
            results = llamacpp.run_llama_bench(cmd, timeout=RUN_TIMEOUT_S)
            decode, prefill = self.rows[variant]
            decode.llama.append(next(r.tokens_per_s for r in results if r.n_gen))
            prefill.llama.append(next(r.tokens_per_s for r in results if r.n_prompt))
        decode_tps = statistics.median(self.decode_tps() for _ in range(REPETITIONS))
        prefill_tps = statistics.median(self.prefill_tps() for _ in range(REPETITIONS))
        for decode, prefill in self.rows.values():
            decode.moeshard.append(decode_tps)
            prefill.moeshard.append(prefill_tps)

    def all_rows(self) -> list[Row]:
        return [row for pair in self.rows.values() for row in pair]


def _short(variant: str) -> str:
    return "same" if variant == "same formats" else "default"
