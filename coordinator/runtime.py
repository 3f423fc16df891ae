"""Wiring for one generation process: model directory, trunk, experts backend, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tokenizers import Tokenizer

from moe import quant
from moe.config import eos_ids, read_json
from moe.errors import StoreError
from moe.model import LocalExperts, ModelDir


class TextStreamer:
    """Writes generated text as it comes, holding back incomplete UTF-8 sequences."""

    def __init__(self, runtime: Runtime, out: TextIO):
        self.runtime, self.out = runtime, out
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.runtime.decode(self.tokens)
        if text.endswith("\ufffd"):
            return  # a multi-byte character is not complete yet
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text

    def finish(self) -> None:
        text = self.runtime.decode(self.tokens)
        self.out.write(text[len(self.printed) :] + "\n")
        self.out.flush()


@dataclass
class Runtime:
    model: ModelDir
    transformer: object  # the family's Transformer
    experts: object  # the experts backend
    tokenizer: Tokenizer | None
    eos_ids: list[int]
    warmup_s: float = 0.0  # JIT compile / numba cache load of every kernel, done at start-up
    startup_s: float = 0.0  # opening the model + warm-up, before the first token

    @property
    def config(self):
        return self.model.config

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise StoreError(f"{self.model.path}: no tokenizer.json; use --prompt-ids")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def text_streamer(self, out: TextIO) -> TextStreamer:
        return TextStreamer(self, out)

    def stats(self, result) -> dict:
        decode = sorted(result.decode_s)
        per_token = sum(decode) / len(decode) if decode else 0.0
        return {
            "prompt_tokens": len(result.prompt_ids),
            "generated_tokens": len(result.tokens),
            "prefill_s": result.prefill_s,
            "decode_s_per_token": per_token,
            "decode_s_per_token_median": decode[len(decode) // 2] if decode else 0.0,
            "tokens_per_s": 1.0 / per_token if per_token else 0.0,
            "expert_bytes_read": getattr(self.experts, "bytes_read", 0),
            "stopped_by": result.stopped_by,
            "startup_s": self.startup_s,
            "jit_warmup_s": self.warmup_s,
            **self.streaming_stats(),
        }

    def streaming_stats(self) -> dict:
        """ExpertStore counters, trunk streaming and peak RSS (single-node streaming only)."""
        snapshot = getattr(self.experts, "snapshot", None)
        if snapshot is None:
            return {}
        from moe.budget import peak_rss_bytes

        plan = getattr(self.experts, "plan", None)
        stats = {f"store_{k}": v for k, v in snapshot().as_dict().items()}
        stats["expert_bytes_read"] = stats["store_bytes_read"]
        stats["trunk_bytes_read"] = getattr(self.transformer.trunk, "bytes_read", 0)
        stats["trunk_stall_s"] = getattr(self.transformer.trunk, "stall_s", 0.0)
        stats["peak_rss_bytes"] = peak_rss_bytes()
        if plan is not None:
            stats["ram_budget_bytes"] = plan.budget
            stats["interpreter_overhead_bytes"] = plan.overhead
        return stats


def finish_runtime(model, transformer, experts, warmup_s: float, started: float) -> Runtime:
    """The parts every mode shares: tokenizer, end-of-sequence ids, start-up time."""
    tok_path = model.path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
    eos = eos_ids(read_json(model.path / "config.json"), model.generation_config())
    startup = time.perf_counter() - started
    return Runtime(model, transformer, experts, tokenizer, eos, warmup_s, startup)


def open_local(path: str | Path) -> Runtime:
    """Single process: trunk in RAM, experts read from this directory's shard files."""
    started = time.perf_counter()
    warmup_s = quant.warmup()  # compile (or load from numba's disk cache) before token one
    model = ModelDir(path)
    if not model.has_trunk:
        raise StoreError(f"{model.path}: has no trunk.gguf (a node shard directory?)")
    trunk = model.load_trunk()
    experts = LocalExperts(model)
    transformer = model.family.Transformer(model.config, trunk, experts)
    return finish_runtime(model, transformer, experts, warmup_s, started)


def open_streaming(path: str | Path, budget: int, context: int, **store_options) -> Runtime:
    """Single process under a hard RAM budget (`moe.budget`): O_DIRECT-streamed experts through
    an ExpertStore, the trunk resident or streamed layer by layer.

    store_options: policy, prefetch, prefetch_top, depth, profile (Counter), prefill_tokens.
    """
    from moe.blas import limit_blas_threads
    from moe.budget import measure_overhead, plan_budget
    from moe.streaming_trunk import StreamingTrunk, TrunkLayout
    from node.expert_store import ExpertStore

    started = time.perf_counter()
    limit_blas_threads(1)  # decode's small BLAS products stall on busy helper threads
    t0 = time.perf_counter()
    overhead = measure_overhead()  # includes the numba warm-up
    warmup_s = time.perf_counter() - t0
    model = ModelDir(path)
    if not model.has_trunk:
        raise StoreError(f"{model.path}: has no trunk.gguf (a node shard directory?)")
    prefetch = store_options.pop("prefetch", True)
    layout = TrunkLayout(model.path / "trunk.gguf", model.model_id)
    plan = plan_budget(
        model,
        budget,
        context,
        store_options.pop("prefill_tokens", None),
        prefetch,
        layout,
        store_options.get("prefetch_top"),
    )
    plan.overhead = overhead
    trunk = StreamingTrunk(layout, plan.trunk_prefix)
    experts = ExpertStore(
        model,
        plan.expert_slots,
        prefetch=prefetch,
        prefetch_slots=plan.prefetch_slots,
        **store_options,
    )
    experts.plan = plan
    transformer = model.family.Transformer(model.config, trunk, experts)
    return finish_runtime(model, transformer, experts, warmup_s, started)


def resolve_peers(
    model_id: str, peers: str | None, discover: bool, discover_timeout: float = 2.0
) -> list[str]:
    """HOST:PORT addresses of the expert nodes: from a comma-separated list or zeroconf."""
    if peers:
        addrs = [a.strip() for a in peers.split(",") if a.strip()]
        bad = [a for a in addrs if not a.rpartition(":")[2].isdigit()]
        if bad:
            raise StoreError(f"--peers: '{bad[0]}' is not HOST:PORT")
        return addrs
    if discover:
        from coordinator.discovery import discover as browse

        addrs = [n.addr for n in browse(model_id, discover_timeout)]
        if not addrs:
            raise StoreError(
                f"zeroconf found no node serving model {model_id[:16]} in {discover_timeout} s"
            )
        return addrs
    raise StoreError("no expert nodes: give --peers or --discover")


def open_remote(
    path: str | Path,
    peers: str | None = None,
    discover: bool = False,
    discover_timeout: float = 2.0,
    remote_config=None,
) -> Runtime:
    """Trunk in RAM from `path`; routed experts computed by nodes (a peer list or zeroconf)."""
    from coordinator.remote import RemoteExperts

    started = time.perf_counter()
    warmup_s = quant.warmup()  # the trunk's kernels run here
    model = ModelDir(path)
    if not model.has_trunk:
        raise StoreError(f"{model.path}: has no trunk.gguf (a node shard directory?)")
    addrs = resolve_peers(model.model_id, peers, discover, discover_timeout)
    experts = RemoteExperts(model.model_id, model.config.hidden_size, addrs, remote_config)
    if discover and not peers:  # keep browsing: nodes that start later join the generation
        from coordinator.discovery import Watcher

        experts.watcher = Watcher(model.model_id, lambda node: experts.add_peer(node.addr))
    trunk = model.load_trunk()
    transformer = model.family.Transformer(model.config, trunk, experts)
    return finish_runtime(model, transformer, experts, warmup_s, started)
