"""Grouped-query-attention MoE families: qwen3_moe, qwen2_moe, mixtral, olmoe.

They share one trunk: RMSNorm -> GQA attention with RoPE -> RMSNorm -> softmax top-k MoE.
Differences, all switched by config fields (names as in transformers):
  * qwen3_moe: per-head q/k RMSNorm (over head_dim); norm_topk_prob usually true.
  * qwen2_moe: q/k/v bias (qkv_bias); a shared expert whose output is scaled by
    sigmoid(shared_expert_gate(x)).
  * mixtral:   router weights are always renormalised over the top k; names use
    block_sparse_moe and w1/w3/w2 (gate/up/down) in published checkpoints.
  * olmoe:     q/k RMSNorm over the whole projection (all heads at once); optional clip_qkv.
Dense (non-MoE) layers come from mlp_only_layers / decoder_sparse_step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba.typed import List

from moeshard.moe.errors import ConfigError
from moeshard.moe.experts.backend import ExpertsBackend, PrefetchHint, ResidentExperts
from moeshard.moe.kernels import quant
from moeshard.moe.model import fused
from moeshard.moe.model.config import RopeConfig, SwigluExperts, decoder_shapes, parse_rope, require
from moeshard.moe.model.decoder import prenorm_forward_batch
from moeshard.moe.model.fused import (
    QK_NORM_CODES,
    attend_cache_parallel,
    gqa_attention,
    gqa_attention_many,
    gqa_prepare,
    route_softmax_topk,
)
from moeshard.moe.model.fused_layer import FusedPlan, attention_route, decode_layers
from moeshard.moe.model.fused_prefill import prefill_layers
from moeshard.moe.model.layer_runs import LayerRuns, Run
from moeshard.moe.model.layers import Segments, rope_cos_sin, sigmoid, swiglu_mlp, uses_hints
from moeshard.moe.model.trunk import LinearGroup, Trunk

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@dataclass(frozen=True)
class Config(SwigluExperts):
    model_type: str  # one of MODEL_TYPES
    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # per-head size D
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    n_experts: int  # routed experts per MoE layer (num_experts / num_local_experts)
    top_k: int  # num_experts_per_tok
    expert_intermediate: int  # moe_intermediate_size (mixtral: intermediate_size)
    dense_intermediate: int  # intermediate_size of dense (non-MoE) layers
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...]  # indices of layers with a sparse MoE block
    shared_expert_intermediate: int = 0  # qwen2_moe shared expert size (0: none)
    qkv_bias: bool = False  # q/k/v projections carry a bias (qwen2_moe)
    qk_norm: str = "none"  # "head" (qwen3_moe), "full" (olmoe) or "none"
    clip_qkv: float | None = None  # olmoe: clamp q, k, v to [-clip, clip]
    sliding_window: int | None = None  # attention window (mixtral/qwen with use_sliding_window)
    max_position_embeddings: int = 4096
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    # gpt-oss (`moeshard.moe.model.gpt_oss`): a window per layer (0: full attention), each
    # head's attention sink, biases on o_proj and the router
    layer_windows: tuple[int, ...] = ()
    attention_sinks: bool = False
    o_bias: bool = False
    router_bias: bool = False

    def window(self, i: int) -> int:
        """Layer i's attention window (0: the whole context)."""
        if self.layer_windows:
            return self.layer_windows[i]
        return int(self.sliding_window or 0)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not a GQA MoE family")
        hidden = int(require(raw, "hidden_size", source))
        heads = int(require(raw, "num_attention_heads", source))
        layers = int(require(raw, "num_hidden_layers", source))
        head_dim = int(raw.get("head_dim") or hidden // heads)
        # transformers 5 writes num_local_experts where older Qwen/OLMoE configs say num_experts.
        experts_key = "num_experts" if raw.get("num_experts") else "num_local_experts"
        if model_type != "mixtral" and not raw.get(experts_key):
            experts_key = "num_experts"  # name the field published configs use in the error
        n_experts = int(require(raw, experts_key, source))
        norm_topk = model_type == "mixtral" or bool(raw.get("norm_topk_prob", False))
        # Mixtral and OLMoE size their experts with intermediate_size (they have no dense MLPs).
        inter_key = "moe_intermediate_size"
        if model_type in ("mixtral", "olmoe"):
            inter_key = "intermediate_size"
        expert_inter = int(require(raw, inter_key, source))
        sparse_step = int(raw.get("decoder_sparse_step") or 1)
        dense_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(
            i for i in range(layers) if i not in dense_only and (i + 1) % sparse_step == 0
        )
        window = raw.get("sliding_window")
        if model_type in ("qwen3_moe", "qwen2_moe") and not raw.get("use_sliding_window"):
            window = None
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(require(raw, "vocab_size", source)),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=parse_rope(raw, head_dim, source),
            n_experts=n_experts,
            top_k=int(require(raw, "num_experts_per_tok", source)),
            expert_intermediate=expert_inter,
            dense_intermediate=int(raw.get("intermediate_size") or 0),
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            shared_expert_intermediate=int(raw.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe"
            else 0,
            qkv_bias=bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else False,
            qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(model_type, "none"),
            clip_qkv=raw.get("clip_qkv") if model_type == "olmoe" else None,
            sliding_window=int(window) if window else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            eos_token_id=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    def trunk_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trunk tensor inference needs, by canonical name, with its shape."""
        return decoder_shapes(self, self._layer_shapes)

    def _layer_shapes(self, i: int, p: str) -> dict[str, tuple[int, ...]]:
        h = self.hidden_size
        shapes = gqa_shapes(self, p + "self_attn.")
        m = p + "mlp."
        if i in self.moe_layers:
            shapes[m + "gate.weight"] = (self.n_experts, h)
            if self.router_bias:
                shapes[m + "gate.bias"] = (self.n_experts,)
            if self.shared_expert_intermediate:
                s = self.shared_expert_intermediate
                shapes[m + "shared_expert.gate_proj.weight"] = (s, h)
                shapes[m + "shared_expert.up_proj.weight"] = (s, h)
                shapes[m + "shared_expert.down_proj.weight"] = (h, s)
                shapes[m + "shared_expert_gate.weight"] = (1, h)
        else:
            shapes[m + "gate_proj.weight"] = (self.dense_intermediate, h)
            shapes[m + "up_proj.weight"] = (self.dense_intermediate, h)
            shapes[m + "down_proj.weight"] = (h, self.dense_intermediate)
        return shapes

    def kv_bytes_per_token(self) -> int:
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * 4


def gqa_shapes(c, a: str) -> dict[str, tuple[int, ...]]:
    """The GQA attention tensors under prefix `a` (a layer's "self_attn."), for any config with
    this family's attention fields (head_dim, qkv_bias, qk_norm; GLM-4.5's too)."""
    h, d = c.hidden_size, c.head_dim
    q_out, kv_out = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[a + "q_proj.weight"] = (q_out, h)
    shapes[a + "k_proj.weight"] = (kv_out, h)
    shapes[a + "v_proj.weight"] = (kv_out, h)
    shapes[a + "o_proj.weight"] = (h, q_out)
    if c.o_bias:
        shapes[a + "o_proj.bias"] = (h,)
    if c.attention_sinks:
        shapes[a + "sinks"] = (c.num_attention_heads,)
    if c.qkv_bias:
        shapes[a + "q_proj.bias"] = (q_out,)
        shapes[a + "k_proj.bias"] = (kv_out,)
        shapes[a + "v_proj.bias"] = (kv_out,)
    if c.qk_norm == "head":
        shapes[a + "q_norm.weight"] = (d,)
        shapes[a + "k_norm.weight"] = (d,)
    elif c.qk_norm == "full":
        shapes[a + "q_norm.weight"] = (q_out,)
        shapes[a + "k_norm.weight"] = (kv_out,)
    return shapes


def canonical_name(name: str) -> str:
    """Published Mixtral names use block_sparse_moe; the trunk stores them under mlp."""
    return name.replace(".block_sparse_moe.", ".mlp.")


class KVCache:
    """Per layer: keys and values [max_len, Hkv, D], filled up to `length`."""

    def __init__(self, config: Config, max_len: int):
        shape = (max_len, config.num_key_value_heads, config.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.length = 0  # tokens already in the cache
        self.max_len = max_len

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a rollback: they are computed again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length


class _Layer:
    """Layer i's weights, looked up once: norm vectors, Linear handles, flags. Rebuilt only
    when a streamed trunk has read the layer again (`Transformer._layer`)."""

    __slots__ = (
        "marker", "input_norm", "post_norm", "qkv", "o", "q_norm", "k_norm", "sinks", "window",
        "moe", "mlp", "shared", "shared_gate", "fused",
    )  # fmt: skip

    def __init__(self, c: Config, w: Trunk, i: int):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        self.marker = w.tensors.get(a + "q_proj.weight")  # replaced when the layer is re-read
        self.input_norm = w.vector(p + "input_layernorm.weight")  # [H]
        self.post_norm = w.vector(p + "post_attention_layernorm.weight")  # [H]
        # q, k and v take the same input: one kernel call for the three
        self.qkv = LinearGroup([w.linear(a + n) for n in ("q_proj", "k_proj", "v_proj")])
        self.o = w.linear(a + "o_proj")
        none = np.zeros(0, np.float32)
        self.q_norm = w.vector(a + "q_norm.weight") if c.qk_norm != "none" else none  # [D|Hq*D]
        self.k_norm = w.vector(a + "k_norm.weight") if c.qk_norm != "none" else none
        self.sinks = w.vector(a + "sinks") if c.attention_sinks else none  # [Hq] or [0]
        self.window = c.window(i)  # 0: the whole context
        self.moe = i in c.moe_layers
        self.mlp = self.shared = self.shared_gate = self.fused = None
        if not self.moe:
            self.mlp = tuple(w.linear(m + n) for n in ("gate_proj", "up_proj", "down_proj"))
        else:
            self.moe_parts(c, w, m)

    def moe_parts(self, c: Config, w: Trunk, m: str) -> None:
        """A MoE layer's shared expert and its gate (qwen2_moe), or the fused decode plan."""
        if c.shared_expert_intermediate:
            s = m + "shared_expert."
            self.shared = tuple(w.linear(s + n) for n in ("gate_proj", "up_proj", "down_proj"))
            self.shared_gate = w.linear(m + "shared_expert_gate")
        elif not c.attention_sinks:  # a decode row's calls, fused (the fused kernels take
            # no sinks: gpt-oss's layers go step by step)
            self.fused = FusedPlan.of(self.qkv, self.o, w.linear(m + "gate"))


def _attention_work(rows: int, cached: int, q_cols: int) -> int:
    """Multiply-adds of `rows` new rows' attention over `cached` positions and themselves
    (q_cols = query heads x head size): what `_attention` and a fused decode layer compare
    with PARALLEL_MIN_WORK to split the heads across the threads."""
    return rows * (cached + rows) * q_cols * 2


class Transformer:
    """The trunk's forward pass; routed experts go to `experts` (local or remote).

    The small operations between the linear layers run as fused numba kernels
    (`moeshard.moe.model.fused`, whose numpy twins are in `moeshard.moe.model.layers`); each
    residual add is
    fused with the norm that follows it. Arrays handed to the experts backend are fresh for
    every call (a backend may keep them, e.g. to audit a node later)."""

    fused_decode = True  # one sequence's layers in one call where it applies (`fused_layer`,
    # `fused_prefill`)
    LAYER = _Layer  # a layer's weights (GLM-4.5's differ in their MoE parts)

    def __init__(self, config: Config, trunk: Trunk, experts: ExpertsBackend):
        self.config, self.trunk, self.experts = config, trunk, experts
        self.inv_freq, self.rope_scale = config.rope.inv_freq_and_scale()
        self.scaling = config.head_dim**-0.5
        self._layers: list[_Layer | None] = [None] * config.num_hidden_layers
        self._next_moe = [  # the next MoE layer after each layer, or None
            next((j for j in config.moe_layers if j > i), None)
            for i in range(config.num_hidden_layers)
        ]
        self._markers = [  # a tensor a streamed trunk replaces when it re-reads the layer
            f"model.layers.{i}.self_attn.q_proj.weight" for i in range(config.num_hidden_layers)
        ]
        self._head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        self._runs = LayerRuns()  # the resident layers `decode_layers` takes in one call
        self._lists_key: tuple = ()  # the caches whose typed lists `_lists` holds
        self._lists: dict[int, tuple] = {}
        self._qk_norm = QK_NORM_CODES[config.qk_norm]
        self._clip = float(config.clip_qkv or 0.0)
        fused.warmup()  # the kernels compiled (or loaded from numba's cache) before token one

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config, max_len)

    def _layer(self, i: int) -> _Layer:
        """Layer i's handles (a streamed trunk installs new tensors when it re-reads a layer:
        then they are looked up again)."""
        ly = self._layers[i]
        if ly is None or self.trunk.tensors.get(self._markers[i]) is not ly.marker:
            ly = self._layers[i] = self.LAYER(self.config, self.trunk, i)
        return ly

    def forward(self, ids: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
        """Token ids [T] at positions cache.length.. -> logits [T, V] (last_only: the last
        token's alone, [1, V]); appends to the cache."""
        return self.forward_batch([(ids, cache)], last_only)[0]

    def forward_batch(
        self, batch: list[tuple[np.ndarray, KVCache]], last_only: bool = False
    ) -> list[np.ndarray]:
        """Several sequences in one pass (continuous batching): each (ids [T_s] at positions
        cache.length.., its own cache) -> its logits [T_s, V] (last_only: its last row's,
        [1, V]), appended to its cache.

        The rows of every sequence go through each linear layer, norm and router together and
        the experts backend gets one call per layer with all of them; attention runs per
        sequence on its own cache.  Every kernel computes a row the same way whatever other
        rows are in the call, so a sequence's logits are the same bits as alone."""
        seq = Segments(batch)
        positions = np.concatenate(
            [np.arange(cache.length, cache.length + len(ids)) for ids, cache in seq.batch]
        )  # [N]: each row's position in its own sequence
        rope = rope_cos_sin(positions, self.inv_freq, self.rope_scale)  # cos, sin [N, D/2]
        caches, hints = seq.caches(), uses_hints(self.experts)

        def norms(i: int) -> tuple[np.ndarray, np.ndarray]:
            ly = self._layer(i)
            return ly.input_norm, ly.post_norm

        def mix(i: int, h: np.ndarray) -> np.ndarray:
            return self._attention(i, self._layer(i), h, rope, caches, seq.bounds)  # [N, H]

        def mlp(i: int, h: np.ndarray) -> np.ndarray:
            ly = self._layer(i)
            return self._moe(i, ly, h, hints) if ly.moe else self._dense_mlp(ly, h)  # [N, H]

        fused = None
        if len(seq) == 1 and self.fused_decode:  # one sequence: a layer's calls fused

            def fused(i: int, x: np.ndarray, delta: np.ndarray | None):
                return self._fused_layers(i, x, delta, rope, caches[0], hints)

        return prenorm_forward_batch(self, seq, mix, mlp, norms, self._head, last_only, fused)

    def _fused_layers(self, i: int, x, delta, rope, cache: KVCache, hints: bool):
        """Layer i of one decode row and as many after it as one kernel call can take (x +=
        delta first) -> (the last one's MLP output, the next layer to run); None when no fused
        form applies to layer i (then the step-by-step path runs).

        With the experts in RAM (`_resident`): `decode_layers` over layer i's run (the
        layers around it whose experts are resident, in one typed list: `layer_runs`), whose q/k/v
        and o products and attention split across the pool's threads where they would in the
        step-by-step path (`FusedPlan.products_serial`; `_attention`'s PARALLEL_MIN_WORK; the
        router's product stays on this thread, the same bits); a layer whose routed expert is
        not in RAM yet comes back here for the backend's own call, and the run goes on after
        it.  Else `attention_route` up to the router, where all of that runs on this thread
        anyway, and the experts backend's own call."""
        ly = self._layer(i)
        plan = ly.fused
        if plan is None:
            return None
        if x.shape[0] > 1:  # several rows (a prefill): all in one call, or step by step
            run = self._runs_of(cache).get(i)
            return None if run is None else self._fused_rows(i, x, delta, rope, cache, run, hints)
        q_cols = self.config.num_attention_heads * self.config.head_dim
        split_heads = _attention_work(1, cache.length, q_cols) >= quant.PARALLEL_MIN_WORK
        if delta is not None and not delta.flags.writeable:
            delta = delta.copy()  # (one compiled signature: a writable delta)
        cos, sin = rope
        run = self._runs_of(cache).get(i)
        if run is None:
            if split_heads or not plan.products_serial():
                return None  # (the steps split them; attention_route runs on this thread)
            args = (
                x, x if delta is None else delta, delta is not None, ly.input_norm,
                ly.post_norm, self.config.rms_norm_eps, quant._int8(), quant.dots.F16_LUT,
                plan.qkv, ly.q_norm, ly.k_norm, self._qk_norm, self._clip, cos, sin,
                cache.k[i], cache.v[i], cache.length, self.scaling, ly.window,
                plan.o, plan.gate, self.config.top_k, self.config.norm_topk_prob,
            )  # fmt: skip
            h, ids, weights = attention_route(*args)
            return self._routed(i, ly, h, ids, weights, hints), i + 1
        first, n = i - run.base, len(run.layers)
        splits = np.zeros((n, 2), dtype=np.bool_)  # [n, 2]: per layer of the call, are its
        # products and its attention's heads split? (rows before `first` unused)
        read = 0  # the most weights a layer of the call reads: what decides the threads
        for j in range(first, n):
            split_products = not run.layers[j].fused.products_serial()
            splits[j] = split_products, split_heads
            layer_read = self.config.top_k * run.helds[j].weights_per_expert
            split = split_products or split_heads
            read = max(read, quant.PARALLEL_MIN_WEIGHTS if split else layer_read)
        consts = (
            self.config.rms_norm_eps, quant._int8(), quant.dots.F16_LUT, self._qk_norm,
            self._clip, self.scaling, self.config.top_k, self.config.norm_topk_prob,
        )  # fmt: skip
        stop, h, ids, weights, out = quant.run_kernel(
            decode_layers, read, run.entries, run.kcs, run.vcs, first, n, splits, x,
            x if delta is None else delta, delta is not None, consts, cos, sin, cache.length,
        )  # fmt: skip
        if stop < n:  # an expert not read yet: the backend's own call reads it
            j = run.base + stop
            return self._routed(j, self._layer(j), h, ids, weights, hints), j + 1
        return out, run.base + n  # (a layer with a fused plan has no shared expert)

    def _fused_rows(self, i: int, x, delta, rope, cache: KVCache, run: Run, hints: bool):
        """Layer i of several new rows of one sequence (a prefill) and the rest of its run
        (`_fused_layers`), by `prefill_layers`, every part split across the pool's threads
        by rows where the call's work pays for the pool; a layer whose routed expert is not
        in RAM yet comes back here for the backend's own call."""
        c, t = self.config, x.shape[0]
        first, n = i - run.base, len(run.layers)
        per_row = sum(  # one row's multiply-adds in the call's layers
            sum(ly.fused.works) + c.top_k * 3 * held.weights_per_expert
            for ly, held in zip(run.layers[first:], run.helds[first:], strict=True)
        )
        shares = quant.parallel_threads(t, t * per_row)
        delta = x if delta is None else np.ascontiguousarray(delta, dtype=np.float32)
        consts = (
            c.rms_norm_eps, quant._int8(), quant.dots.F16_LUT, self._qk_norm, self._clip,
            self.scaling, c.top_k, c.norm_topk_prob,
        )  # fmt: skip
        cos, sin = rope
        stop, h, ids, weights, out = quant.run_parallel_on(
            prefill_layers, shares, run.entries, run.kcs, run.vcs, first, n, x, delta,
            delta is not x, consts, cos, sin, cache.length, shares,
        )  # fmt: skip
        if stop < n:  # an expert not read yet: the backend's own call reads it
            j = run.base + stop
            return self._routed(j, self._layer(j), h, ids, weights, hints), j + 1
        return out, run.base + n

    def _runs_of(self, cache: KVCache) -> dict[int, Run]:
        """Layer -> its `Run` (`layer_runs`): the layers whose decode rows `decode_layers` can
        take in one call, with `cache`'s arrays.  No runs for a trunk that streams its layers
        (under --ram, where the experts are not resident either)."""
        if getattr(self.trunk, "streamed", None):
            return {}  # (layer i + 1 is not in RAM before `enter_layer(i + 1)`: no runs)
        lys = tuple(self._layer(i) for i in range(self.config.num_hidden_layers))
        helds = tuple(self._resident(i) if ly.fused is not None else None for i, ly in
                      enumerate(lys))  # fmt: skip
        return self._runs.of(lys, helds, cache)

    def _resident(self, i: int) -> ResidentExperts | None:
        """Layer i's in-RAM experts, where a decode row's may run in `decode_layers`' call:
        the backend holds them in one arena (`ExpertsBackend.resident`) and a row routes to
        two or more (as `decode_weighted_sum`).  (The embedded model's four experts: 9 us in
        the pool, 12 on one thread, against 24 through `LocalExperts.__call__`'s Python; a
        2-core AMD EPYC, Zen 4.)"""
        resident = getattr(self.experts, "resident", None)  # (optional: a wrapper may lack it)
        held = resident(i) if resident is not None else None
        if held is None or self.config.top_k < 2:
            return None
        return held

    def _attention(self, i: int, ly: _Layer, h, rope, caches, bounds) -> np.ndarray:
        """h [N, H] (sequence s in rows bounds[s]:bounds[s + 1]; rope: cos, sin [N, D/2] at
        each row's position) -> the attention block's output [N, H]; appends each
        sequence's k, v to its cache."""
        q, k, v = ly.qkv(h)  # [N, Hq*D], [N, Hkv*D], [N, Hkv*D]
        out = np.empty_like(q)  # [N, Hq*D]
        window = ly.window
        cos, sin = rope
        args = (ly.q_norm, ly.k_norm, self._qk_norm, self.config.rms_norm_eps, self._clip)
        if len(caches) == 1:
            cache, n = caches[0], q.shape[0]
            # the new rows' query heads against the keys and values so far (a prefill, a long
            # context) split across the threads when that pays
            work = _attention_work(n, cache.length, q.shape[1])
            if work < quant.PARALLEL_MIN_WORK:
                gqa_attention(
                    q, k, v, *args, cos, sin, cache.k[i], cache.v[i], cache.length,
                    self.scaling, window, ly.sinks, out,
                )  # fmt: skip
            else:
                kc, vc = cache.k[i], cache.v[i]
                gqa_prepare(q, k, v, *args, cos, sin, kc, vc, cache.length)
                heads = q.shape[1] // kc.shape[2]
                quant.run_parallel(
                    attend_cache_parallel, n * heads, work,
                    q, kc, vc, cache.length, self.scaling, window, ly.sinks, out,
                )  # fmt: skip
        else:
            kcs, vcs = self._cache_lists(i, caches)
            starts = np.array([c.length for c in caches], dtype=np.int64)  # [B]
            rows = np.diff(bounds)  # [B]
            # each new row's query heads against its sequence's keys and values so far
            work = int(rows @ (starts + rows)) * q.shape[1] * 2
            quant.run_parallel(
                gqa_attention_many, len(caches), work,
                q, k, v, *args, cos, sin, kcs, vcs, starts, bounds, self.scaling, window,
                ly.sinks, out,
            )  # fmt: skip
        return ly.o(out)  # [N, H]

    def _cache_lists(self, i: int, caches) -> tuple:
        """Layer i's K and V caches of these sequences as numba typed lists.  Making them
        costs more than the attention of a decode step, and a batch keeps its sequences
        for many steps, so the lists of the last batch are kept (by the caches' identity)."""
        same = len(caches) == len(self._lists_key) and all(
            a is b for a, b in zip(caches, self._lists_key, strict=True)
        )  # (identity, not id(): a new cache may take a freed one's address)
        if not same:
            self._lists_key, self._lists = tuple(caches), {}
        if i not in self._lists:
            self._lists[i] = (List([c.k[i] for c in caches]), List([c.v[i] for c in caches]))
        return self._lists[i]

    def forget_caches(self) -> None:
        """Drop the typed lists of the last batch's caches, and of the last decoded
        sequence's (`layer_runs`) (the engine calls this when its batch empties: else those
        sequences' KV caches would live until the next batch)."""
        self._lists_key, self._lists = (), {}
        self._runs.forget_cache()

    def route(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax top-k router of layer i: h [T, H] -> expert ids [T, k], weights [T, k].
        (The router is always resident; its product is a kernel's, the same bits for a row
        in any batch.)"""
        logits = self.trunk.linear(f"model.layers.{i}.mlp.gate")(h)  # [T, E]
        return route_softmax_topk(logits, self.config.top_k, self.config.norm_topk_prob)

    def _moe(self, i: int, ly: _Layer, h: np.ndarray, hints: bool) -> np.ndarray:
        ids, weights = self.route(i, h)  # [T, k] each
        return self._routed(i, ly, h, ids, weights, hints)

    def _routed(self, i: int, ly: _Layer, h, ids, weights, hints: bool) -> np.ndarray:
        """Layer i's MLP output for h [T, H] routed to ids/weights [T, k]."""
        hint, nxt = None, self._next_moe[i]
        if hints and nxt is not None:  # the next layer's experts, fetched meanwhile
            hint = PrefetchHint(nxt, self.route(nxt, h)[0])
        out = self.experts(i, h, ids, weights, hint=hint)  # [T, H]
        if ly.shared is not None:
            shared = swiglu_mlp(h, *ly.shared)  # [T, H]
            if ly.shared_gate is not None:  # (qwen2_moe)
                shared = sigmoid(ly.shared_gate(h)) * shared  # [T, H]
            out = out + shared  # [T, H]
        return np.ascontiguousarray(out, dtype=np.float32)

    def _dense_mlp(self, ly: _Layer, h: np.ndarray) -> np.ndarray:
        return swiglu_mlp(h, *ly.mlp)  # [T, H]
