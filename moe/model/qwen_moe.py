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

from moe.errors import ConfigError
from moe.experts.backend import ExpertsBackend
from moe.model.config import RopeConfig, parse_rope, require
from moe.model.layers import (
    apply_rope,
    attend,
    next_layer_hint,
    rms_norm,
    rope_cos_sin,
    sigmoid,
    softmax,
    swiglu_mlp,
    top_k_indices,
)
from moe.model.trunk import Trunk

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@dataclass(frozen=True)
class Config:
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
        h, d = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (q_out, h)
            shapes[a + "k_proj.weight"] = (kv_out, h)
            shapes[a + "v_proj.weight"] = (kv_out, h)
            shapes[a + "o_proj.weight"] = (h, q_out)
            if self.qkv_bias:
                shapes[a + "q_proj.bias"] = (q_out,)
                shapes[a + "k_proj.bias"] = (kv_out,)
                shapes[a + "v_proj.bias"] = (kv_out,)
            if self.qk_norm == "head":
                shapes[a + "q_norm.weight"] = (d,)
                shapes[a + "k_norm.weight"] = (d,)
            elif self.qk_norm == "full":
                shapes[a + "q_norm.weight"] = (q_out,)
                shapes[a + "k_norm.weight"] = (kv_out,)
            m = p + "mlp."
            if i in self.moe_layers:
                shapes[m + "gate.weight"] = (self.n_experts, h)
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


class Transformer:
    """The trunk's forward pass; routed experts go to `experts` (local or remote)."""

    def __init__(self, config: Config, trunk: Trunk, experts: ExpertsBackend):
        self.config, self.trunk, self.experts = config, trunk, experts
        self.inv_freq, self.rope_scale = config.rope.inv_freq_and_scale()
        self.scaling = config.head_dim**-0.5

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config, max_len)

    def forward(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Token ids [T] at positions cache.length.. -> logits [T, V]; appends to the cache."""
        c, w = self.config, self.trunk
        positions = np.arange(cache.length, cache.length + len(ids))  # [T]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)  # [T, D/2] each
        x = w.embed("model.embed_tokens.weight", ids)  # [T, H]
        for i in range(c.num_hidden_layers):
            w.enter_layer(i)  # a streamed trunk makes layer i resident and starts reading i + 1
            p = f"model.layers.{i}."
            h = rms_norm(x, w.vector(p + "input_layernorm.weight"), c.rms_norm_eps)  # [T, H]
            x = x + self.attention(i, h, cos, sin, cache)  # [T, H]
            h = rms_norm(x, w.vector(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            x = x + (self.moe(i, h) if i in c.moe_layers else self.dense_mlp(i, h))  # [T, H]
        cache.length += len(ids)
        x = rms_norm(x, w.vector("model.norm.weight"), c.rms_norm_eps)  # [T, H]
        head = "model.embed_tokens" if c.tie_word_embeddings else "lm_head"
        return w.linear(head)(x)  # [T, V]

    def attention(self, i, h, cos, sin, cache: KVCache) -> np.ndarray:
        c, w = self.config, self.trunk
        a = f"model.layers.{i}.self_attn."
        t, d = h.shape[0], c.head_dim
        q = w.linear(a + "q_proj")(h)  # [T, Hq*D]
        k = w.linear(a + "k_proj")(h)  # [T, Hkv*D]
        v = w.linear(a + "v_proj")(h)  # [T, Hkv*D]
        if c.qk_norm == "full":
            q = rms_norm(q, w.vector(a + "q_norm.weight"), c.rms_norm_eps)  # [T, Hq*D]
            k = rms_norm(k, w.vector(a + "k_norm.weight"), c.rms_norm_eps)  # [T, Hkv*D]
        if c.clip_qkv is not None:
            q, k, v = (np.clip(z, -c.clip_qkv, c.clip_qkv) for z in (q, k, v))
        q = q.reshape(t, c.num_attention_heads, d)  # [T, Hq, D]
        k = k.reshape(t, c.num_key_value_heads, d)  # [T, Hkv, D]
        v = v.reshape(t, c.num_key_value_heads, d)  # [T, Hkv, D]
        if c.qk_norm == "head":
            q = rms_norm(q, w.vector(a + "q_norm.weight"), c.rms_norm_eps)  # [T, Hq, D]
            k = rms_norm(k, w.vector(a + "k_norm.weight"), c.rms_norm_eps)  # [T, Hkv, D]
        q = apply_rope(q, cos, sin, interleave=False)  # [T, Hq, D]
        k = apply_rope(k, cos, sin, interleave=False)  # [T, Hkv, D]
        start, end = cache.length, cache.length + t
        cache.k[i][start:end], cache.v[i][start:end] = k, v
        out = attend(q, cache.k[i][:end], cache.v[i][:end], self.scaling, c.sliding_window)
        return w.linear(a + "o_proj")(out.reshape(t, -1))  # [T, H]

    def route(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax top-k router of layer i: h [T, H] -> expert ids [T, k], weights [T, k]."""
        c = self.config
        logits = h @ self.trunk.vector(f"model.layers.{i}.mlp.gate.weight").T  # [T, E]
        probs = softmax(logits)  # [T, E]
        ids = top_k_indices(probs, c.top_k)  # [T, k]
        weights = np.take_along_axis(probs, ids, axis=-1)  # [T, k]
        if c.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)  # [T, k]
        return ids, weights.astype(np.float32)

    def moe(self, i: int, h: np.ndarray) -> np.ndarray:
        ids, weights = self.route(i, h)  # [T, k] each
        hint = next_layer_hint(self, i, h)  # the next layer's experts, fetched meanwhile
        out = self.experts(i, h, ids, weights, hint=hint)  # [T, H]
        if self.config.shared_expert_intermediate:
            m, w = f"model.layers.{i}.mlp.", self.trunk
            shared = swiglu_mlp(
                h,
                w.linear(m + "shared_expert.gate_proj"),
                w.linear(m + "shared_expert.up_proj"),
                w.linear(m + "shared_expert.down_proj"),
            )  # [T, H]
            out = out + sigmoid(w.linear(m + "shared_expert_gate")(h)) * shared  # [T, H]
        return out

    def dense_mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        m, w = f"model.layers.{i}.mlp.", self.trunk
        return swiglu_mlp(
            h, w.linear(m + "gate_proj"), w.linear(m + "up_proj"), w.linear(m + "down_proj")
        )
