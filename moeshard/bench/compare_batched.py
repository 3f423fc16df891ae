"""The `batched` part of `moeshard bench compare-llamacpp`: many sequences decoding together
(what a server does with concurrent requests) against one sequence, on both sides.

- llama.cpp: `llama-batched-bench -npp P -ntg T -npl 1,N`: the N prompts of P random tokens
  in one batch, then T steps that each feed every sequence one random token; its `speed_tg`
  is N T / (the T steps' seconds).
- moeshard: the same in-process, through the pass the server's engine steps with
  (`forward_batch`: every sequence's rows through each layer together, each its own cache);
  random tokens drawn uniformly from the vocabulary, as llama-batched-bench draws them.

Random tokens rather than generated text: each row is routed on its own. Greedy text from
similar prompts shares experts between sequences (the 706 MB model's 16-request `bench
serve` routes to about 21 experts a layer, not the ~41 of 64 that 16 independent rows would
pick), which flatters the many-sequence step.

Besides each side's tokens/s against the other, the part prints each side's N-against-1
scaling: what concurrency buys on this machine, with llama.cpp's as the yardstick for
issue 38's serve goal (16 concurrent >= 5x one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from moeshard.bench import llamacpp
from moeshard.bench.compare_sides import RUN_TIMEOUT_S
from moeshard.bench.compare_table import Row, spread
from moeshard.bench.llamacpp import LlamaCpp
from moeshard.coordinator.runtime import open_local

PROMPT_TOKENS = 32  # each sequence's prompt (llama-batched-bench -npp)


def llama_batched_cmd(
    llama: LlamaCpp, model: Path, threads: int, sequences: int, tokens: int
) -> list[str]:
    """llama-batched-bench at 1 and `sequences` parallel sequences, JSON lines out."""
    ctx = sequences * (PROMPT_TOKENS + tokens)
    return [
        str(llama.bin("llama-batched-bench")),
        "-m", str(model),
        "-c", str(ctx),
        "-b", "512",
        "-ub", "512",
        "-npp", str(PROMPT_TOKENS),
        "-ntg", str(tokens),
        "-npl", f"1,{sequences}",
        "-t", str(threads),
        "-tb", str(threads),
        "--output-format", "jsonl",
    ]  # fmt: skip


def parse_batched_jsonl(text: str) -> dict[int, float]:
    """{parallel sequences: decode tokens/s (speed_tg)} from llama-batched-bench's JSON lines
    (its other output goes to stderr)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            record = json.loads(line)
            out[int(record["pl"])] = float(record["speed_tg"])
    return out


def run_llama_batched(cmd: list[str]) -> dict[int, float]:
    return parse_batched_jsonl(llamacpp.run_tool(cmd, timeout=RUN_TIMEOUT_S))


def batched_decode_tps(model, vocab: int, sequences: int, tokens: int, seed: int) -> float:
    """moeshard's side: `sequences` caches, their random prompts in one pass, then `tokens`
    passes of one random token each; sequences x tokens / the passes' seconds."""
    rng = np.random.default_rng(seed)
    caches = [model.new_cache(PROMPT_TOKENS + tokens) for _ in range(sequences)]
    prompts = rng.integers(0, vocab, (sequences, PROMPT_TOKENS))  # [S, P]
    model.forward_batch(list(zip(prompts, caches, strict=True)), last_only=True)
    fed = rng.integers(0, vocab, (tokens, sequences, 1))  # [T, S, 1]
    started = time.perf_counter()
    for step in fed:
        model.forward_batch(list(zip(step, caches, strict=True)), last_only=True)
    return sequences * tokens / (time.perf_counter() - started)


class Batched:
    """One sequence and `sequences` sequences decoding, llama.cpp then moeshard each round."""

    def __init__(self, label: str, moeshard_dir: Path, gguf: Path, cfg, sequences: int):
        self.cfg, self.gguf, self.sequences = cfg, gguf, sequences
        self.rt = open_local(moeshard_dir)
        self.rt.experts.preload()  # every record in RAM, as llama.cpp has loaded its model
        self.vocab = self.rt.config.vocab_size
        self.rounds = 0
        for n in (1, sequences):  # warm: first touches, caches, anything lazy
            batched_decode_tps(self.rt.transformer, self.vocab, n, 4, seed=1)
        self.rows = {
            n: Row(
                f"batched {n}",
                f"{label}, {n} sequence{'s' if n > 1 else ''} decoding, tok/s (random tokens)",
            )
            for n in (1, sequences)
        }

    def round(self) -> None:
        cmd = llama_batched_cmd(
            self.cfg.llama, self.gguf, self.cfg.threads, self.sequences, self.cfg.tokens
        )
        speeds = run_llama_batched(cmd)
        self.rounds += 1
        for n, row in self.rows.items():
            row.llama.append(speeds.get(n))
            if n not in speeds:
                row.failures.append("not printed")
            tps = batched_decode_tps(
                self.rt.transformer, self.vocab, n, self.cfg.tokens, self.rounds
            )
            row.moeshard.append(tps)

    def scaling_line(self) -> str:
        """Each side's N-sequence tokens/s over its own one-sequence tokens/s, per round."""
        one, many = self.rows[1], self.rows[self.sequences]

        def side(a: list, b: list) -> str:
            ratios = [m / o for o, m in zip(a, b, strict=True) if o and m]
            return spread(ratios, lambda v: f"{v:.2f}x") if ratios else "not measured"

        return (
            f"{self.sequences} sequences against 1, aggregate decode tok/s: "
            f"moeshard {side(one.moeshard, many.moeshard)}, "
            f"llama.cpp {side(one.llama, many.llama)} "
            f"(issue 38's goal for `bench serve`: 16 concurrent >= 5x one)"
        )
