"""Wiring for one generation process: model directory, trunk, experts backend, tokenizer.

Three modes, one `Runtime`: `open_local` (trunk and experts in RAM), `open_streaming` (a hard
RAM budget: experts through the ExpertStore cache, the trunk resident or streamed) and
`open_remote` (experts computed by nodes). The generation loop only sees `rt.transformer`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from moeshard.coordinator.tokenizer import TOKENIZER_FILES, IncrementalText, TextTokenizer
from moeshard.coordinator.tokenizer import load as load_text_tokenizer
from moeshard.moe.errors import StoreError
from moeshard.moe.experts.backend import ExpertsBackend
from moeshard.moe.experts.local import LocalExperts
from moeshard.moe.experts.store import ExpertStore
from moeshard.moe.kernels import quant
from moeshard.moe.kernels.blas import limit_blas_threads
from moeshard.moe.model.config import eos_ids, read_json
from moeshard.moe.model.model_dir import ModelDir
from moeshard.moe.model.streaming_trunk import StreamingTrunk
from moeshard.moe.storage.budget import (
    BudgetPlan,
    available_memory,
    measure_overhead,
    peak_rss_bytes,
    plan_budget,
)
from moeshard.moe.units import fmt_bytes

log = logging.getLogger(__name__)
# what to do with a directory without expert records (a coordinator directory) where a mode
# computes the experts here; the commands name their own options first
LOCAL_REMEDY = "run it with nodes (--peers or --discover), or use the full model directory"


class TextStreamer:
    """Writes generated text as it comes, holding back incomplete UTF-8 sequences."""

    def __init__(self, runtime: Runtime, out: TextIO):
        self.runtime, self.out = runtime, out
        self.text = IncrementalText(runtime.decode)

    def __call__(self, token: int) -> None:
        delta = self.text.push(token)
        if delta:
            self.out.write(delta)
            self.out.flush()

    def rollback(self, kept: int) -> None:
        """Tokens from `kept` on were undone (a node was caught lying): text already printed
        cannot be taken back, so the corrected text so far is printed again on a new line."""
        tokens = self.text.ids[:kept]
        self.text = IncrementalText(self.runtime.decode)
        for token in tokens:
            self.text.push(token)
        self.out.write("\n" + self.text.text)
        self.out.flush()

    def finish(self) -> None:
        self.out.write(self.text.flush() + "\n")
        self.out.flush()


@dataclass
class Runtime:
    model: ModelDir
    transformer: object  # the family's Transformer
    experts: ExpertsBackend
    tokenizer: TextTokenizer | None
    eos_ids: list[int]
    warmup_s: float = 0.0  # JIT compile / numba cache load of every kernel, done at start-up
    startup_s: float = 0.0  # opening the model + warm-up, before the first token
    plan: BudgetPlan | None = None  # the RAM budget's split (streaming mode)
    store: ExpertStore | None = None  # the expert cache (streaming mode; also `experts`)
    watcher: object | None = None  # zeroconf browse feeding late nodes (remote mode)
    verifier: object | None = None  # audits of the nodes' work (remote mode; generate.Verifier)
    wide: object | None = None  # the registry's p2p daemon and tunnels (--bootstrap): closed last

    @property
    def config(self):
        return self.model.config

    def trace_meta(self) -> dict:
        """What a routing trace of this model records about it (`TraceRecorder`)."""
        c = self.config
        return {
            "model_id": self.model.model_id,
            "model_type": c.model_type,
            "n_experts": c.n_experts,
            "top_k": c.top_k,
            "moe_layers": list(c.moe_layers),
            "hidden_size": c.hidden_size,
            "expert_intermediate": c.expert_intermediate,
        }

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise StoreError(f"{self.model.path}: no {TOKENIZER_FILES}; use --prompt-ids")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids)

    def text_streamer(self, out: TextIO) -> TextStreamer:
        return TextStreamer(self, out)

    def stats(self, result) -> dict:
        decode = sorted(result.decode_s)
        per_token = sum(decode) / len(decode) if decode else 0.0
        experts = self.experts.stats()
        stats = {
            "prompt_tokens": len(result.prompt_ids),
            "generated_tokens": len(result.tokens),
            "prefill_s": result.prefill_s,
            "decode_s_per_token": per_token,
            "decode_s_per_token_median": decode[len(decode) // 2] if decode else 0.0,
            "tokens_per_s": 1.0 / per_token if per_token else 0.0,
            "expert_bytes_read": experts.get("expert_bytes_read", 0),
            "stopped_by": result.stopped_by,
            "rollbacks": result.rollbacks,
            "startup_s": self.startup_s,
            "jit_warmup_s": self.warmup_s,
        }
        if self.store is not None:
            stats.update(self.streaming_stats())
        if "audit" in experts:
            stats["audit"] = experts["audit"]
        dropped = experts.get("dropped_per_layer") or {}
        stats["degraded"] = bool(dropped)  # --degrade dropped experts: not the model's output
        stats["dropped_expert_slots"] = {str(layer): n for layer, n in dropped.items()}
        if self.wide is not None:  # how each node was reached: "direct" or "relayed"
            stats["p2p_paths"] = self.wide.paths()
        return stats

    def streaming_stats(self) -> dict:
        """ExpertStore counters, trunk streaming and peak RSS (single-node streaming)."""
        stats = {f"store_{k}": v for k, v in self.store.snapshot().as_dict().items()}
        trunk = self.transformer.trunk
        stats["trunk_bytes_read"] = trunk.bytes_read
        stats["trunk_stall_s"] = trunk.stall_s
        stats["peak_rss_bytes"] = peak_rss_bytes()
        stats["ram_budget_bytes"] = self.plan.budget
        stats["interpreter_overhead_bytes"] = self.plan.overhead
        return stats

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.experts.close()  # (its last calls, settlements included, may use the tunnels)
        if self.wide is not None:
            self.wide.close()
        self.transformer.trunk.close()
        self.model.close()


def load_tokenizer(model: ModelDir) -> TextTokenizer | None:
    """The model directory's tokenizer, or None when it has none (--prompt-ids only)."""
    return load_text_tokenizer(model.path)


def _model_dir(path: str | Path | ModelDir) -> ModelDir:
    """An opened ModelDir as given, else the directory at `path` opened (and checked)."""
    return path if isinstance(path, ModelDir) else ModelDir(path)


def _finish(model, transformer, experts, warmup_s: float, started: float, **fields) -> Runtime:
    """The parts every mode shares: tokenizer, end-of-sequence ids, start-up time."""
    tokenizer = load_tokenizer(model)
    eos = eos_ids(read_json(model.path / "config.json"), model.generation_config())
    startup = time.perf_counter() - started
    return Runtime(model, transformer, experts, tokenizer, eos, warmup_s, startup, **fields)


def open_local(path: str | Path | ModelDir) -> Runtime:
    """Single process: trunk and every expert it uses in RAM."""
    started = time.perf_counter()
    warmup_s = quant.warmup()  # compile (or load from numba's disk cache) before token one
    model = _model_dir(path)
    model.require_trunk()
    model.require_experts(LOCAL_REMEDY)
    experts = LocalExperts(model.shard_set)
    transformer = model.family.Transformer(model.config, model.load_trunk(), experts)
    return _finish(model, transformer, experts, warmup_s, started)


def open_streaming(
    path: str | Path | ModelDir, budget: int, context: int, **store_options
) -> Runtime:
    """Single process under a hard RAM budget (`moeshard.moe.storage.budget`): O_DIRECT-streamed
    experts through an ExpertStore, the trunk resident or streamed layer by layer.

    store_options: policy, prefetch, prefetch_top, depth, profile (Counter), prefill_tokens,
    on_layer (progress callback).
    """
    started = time.perf_counter()
    limit_blas_threads(1)  # decode's small BLAS products stall on busy helper threads
    t0 = time.perf_counter()
    overhead = measure_overhead()  # includes the numba warm-up
    warmup_s = time.perf_counter() - t0
    model = _model_dir(path)
    model.require_trunk()
    model.require_experts(LOCAL_REMEDY)
    prefetch = store_options.pop("prefetch", True)
    layout = model.trunk_layout()
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
    store = ExpertStore(
        model.shard_set,
        plan.expert_slots,
        model.config.top_k,
        prefetch=prefetch,
        prefetch_slots=plan.prefetch_slots,
        **store_options,
    )
    transformer = model.family.Transformer(model.config, trunk, store)
    return _finish(model, transformer, store, warmup_s, started, plan=plan, store=store)


def find_nodes(
    model_id: str,
    peers: str | None,
    discover: bool,
    discover_timeout: float,
    identity,
    expect: int | None = None,
    bootstrap: list[str] | None = None,
    insecure: bool = False,
    settle: bool = False,
):
    """(the nodes' specs, the registry's directory or None): from `--peers`, zeroconf
    (`discover`, see `resolve_peers`) or the wide-area registry (`bootstrap`). The directory's
    tunnels carry the calls: the caller closes it when done with the nodes."""
    from moeshard.coordinator.remote.discovery import resolve_peers

    if not bootstrap:
        specs = resolve_peers(
            model_id, peers, discover, discover_timeout, insecure, expect, settle, identity
        )
        return specs, None
    from moeshard.coordinator.remote.wide import find_wide
    from moeshard.moe.identity.tls import client_tls

    if insecure or identity is None:
        raise StoreError("--bootstrap needs identities: the calls' TLS is what a relay cannot read")
    tls = client_tls(identity)  # also pin-checks the TCP endpoints records list
    wide, specs = find_wide(model_id, bootstrap, max(discover_timeout, 10.0), expect, tls)
    return specs, wide


def open_remote(
    path: str | Path | ModelDir,
    peers: str | None = None,
    discover: bool = False,
    discover_timeout: float = 2.0,
    remote_config=None,
    expect: int | None = None,
    bootstrap: list[str] | None = None,
) -> Runtime:
    """Trunk in RAM from `path`; routed experts computed by nodes (a peer list, zeroconf, or
    the wide-area registry through `bootstrap` peers: `expect` nodes, see `resolve_peers`),
    judged by a `Trust` built from the model directory (its roots; its records, if any)."""
    from moeshard.coordinator.remote.config import RemoteConfig
    from moeshard.coordinator.remote.discovery import Watcher
    from moeshard.coordinator.remote.experts import RemoteExperts
    from moeshard.moe.identity.tls import client_tls

    started = time.perf_counter()
    warmup_s = quant.warmup()  # the trunk's kernels (and the audits') run here
    model = _model_dir(path)
    model.require_trunk()
    insecure = remote_config is not None and remote_config.identity is None
    if remote_config is None:
        remote_config = RemoteConfig()
    identity = remote_config.identity
    watcher = None
    specs, wide = find_nodes(
        model.model_id, peers, discover, discover_timeout, identity, expect, bootstrap, insecure
    )
    try:
        experts = RemoteExperts.for_model(model, specs, remote_config)
    except BaseException:
        if wide is not None:
            wide.close()
        raise
    if wide is not None:  # keep looking: nodes that join later, or come back, join the generation
        wide.watch(experts.add_peer)
    if discover and not peers:  # keep browsing: nodes that start later join the generation
        tls = None if identity is None else client_tls(identity)
        watcher = Watcher(model.model_id, lambda node: experts.add_peer(node.spec), tls)
    transformer = model.family.Transformer(model.config, model.load_trunk(), experts)
    return _finish(
        model,
        transformer,
        experts,
        warmup_s,
        started,
        watcher=watcher,
        verifier=experts.verifier,
        wide=wide,
    )


def open_serving_runtime(
    path,
    ram: int | None,
    context_tokens: int,
    peers=None,
    discover=False,
    discover_timeout: float = 2.0,
    remote_config=None,
    expect: int | None = None,
    bootstrap: list[str] | None = None,
) -> Runtime:
    """The runtime a server puts behind its engine: experts in RAM, streamed from SSD under
    `ram` bytes (planned for `context_tokens` of KV cache: every running sequence has its
    own), or computed by nodes (`peers`, `discover`, `bootstrap`).  `moeshard serve` and
    `bench serve --engine-only` open it the same way."""
    if peers or discover or bootstrap:
        return open_remote(
            path, peers, discover, discover_timeout, remote_config, expect, bootstrap
        )
    if ram:
        return open_streaming(path, ram, context_tokens)
    rt = open_local(path)
    _preload_experts(rt.experts)
    return rt


def _preload_experts(experts: LocalExperts) -> None:
    """A server reads every expert at start, as llama.cpp loads its model: read on first
    use, the first requests paid for the SSD.  Where they would not fit the memory left,
    they stay read on first use (with a warning: `--ram` is the way to serve such a model)."""
    shards = experts.shards
    need = len(shards.locations) * experts.slot_bytes
    free = available_memory()
    if free is not None and need > free:
        log.warning(
            "the experts (%s) exceed the memory available (%s): read on first use; "
            "serve with --ram to stream them within a budget",
            fmt_bytes(need),
            fmt_bytes(free),
        )
        return
    t0 = time.perf_counter()
    experts.preload()
    log.info("%s of experts read into RAM in %.2f s", fmt_bytes(need), time.perf_counter() - t0)
