"""DeepSeek-V3 and Kimi-K2 (same architecture): multi-head latent attention + sigmoid-routed MoE.

Attention (MLA). Per token, the KV cache keeps only the compressed latent c [kv_lora_rank]
(after kv_a_layernorm) and the shared rotary key k_rot [qk_rope_head_dim]. Keys and values are
never expanded: kv_b_proj [heads * (nope + v), rank] is split into W_uk [heads, nope, rank] and
W_uv [heads, v, rank], the query's no-rope part is absorbed into latent space
(q_lat = q_nope @ W_uk), scores are q_lat . c + q_rot . k_rot, and the context is mapped back
through W_uv. This is algebraically the same as transformers' expand-then-attend.

RoPE is applied to the last qk_rope_head_dim dims of each query head and to k_rot; with
rope_interleave the rotated pairs are (2i, 2i+1). YaRN scaling multiplies cos/sin by
mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax scale
1/sqrt(nope + rope) by mscale(factor, mscale_all_dim)^2.

Router: scores = sigmoid(x @ gate.T); choice = scores + e_score_correction_bias (selection
only); experts are grouped into n_group groups, each group scored by the sum of its top-2
choice values, the best topk_group groups kept, and the top k experts chosen among them. The
weights are the unbiased scores of the chosen experts, normalised (norm_topk_prob) and then
multiplied by routed_scaling_factor. Shared experts run on every token; the first
first_k_dense_replace layers are dense MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeshard.moe.errors import ConfigError
from moeshard.moe.experts.backend import ExpertsBackend
from moeshard.moe.model.config import (
    RopeConfig,
    SwigluExperts,
    decoder_shapes,
    parse_rope,
    require,
    yarn_mscale,
)
from moeshard.moe.model.decoder import prenorm_forward_batch
from moeshard.moe.model.layers import (
    Segments,
    apply_rope,
    causal_mask,
    next_layer_hint,
    rms_norm,
    rope_per_sequence,
    sigmoid,
    softmax,
    swiglu_mlp,
    top_k_indices,
)
from moeshard.moe.model.trunk import Trunk

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


@dataclass(frozen=True, kw_only=True)
class Config(SwigluExperts):
    """DeepSeek-V3's body: MLA attention and its router. Kimi Linear's config extends it
    (KDA layers, no positions), and Kimi K3's extends Kimi Linear's; `from_hf` of each reads
    its own dialect (keyword-only fields, so a subclass adds required ones)."""

    model_type: str  # "deepseek_v3" or "kimi_k2"
    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int
    num_attention_heads: int  # heads (MLA has no separate kv heads)
    q_lora_rank: int | None  # None: q_proj straight from hidden (Kimi-K2 style)
    kv_lora_rank: int  # latent size cached per token
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeConfig
    attention_bias: bool
    n_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    expert_intermediate: int  # moe_intermediate_size
    dense_intermediate: int  # intermediate_size of the first_k_dense_replace dense layers
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    max_position_embeddings: int = 4096
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_hidden_layers))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not DeepSeek-V3 style")
        scoring = raw.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"{source}: scoring_func '{scoring}' unsupported (need 'sigmoid')")
        if int(raw.get("moe_layer_freq", 1)) != 1:
            raise ConfigError(f"{source}: moe_layer_freq != 1 is not supported")
        n_experts = int(require(raw, "n_routed_experts", source))
        n_group = int(raw.get("n_group") or 1)
        if n_experts % n_group:
            raise ConfigError(f"{source}: n_routed_experts {n_experts} not divisible by n_group")
        q_lora = raw.get("q_lora_rank")
        eos = raw.get("eos_token_id")
        rope_dim = int(require(raw, "qk_rope_head_dim", source))
        return cls(
            model_type=model_type,
            vocab_size=int(require(raw, "vocab_size", source)),
            hidden_size=int(require(raw, "hidden_size", source)),
            num_hidden_layers=int(require(raw, "num_hidden_layers", source)),
            num_attention_heads=int(require(raw, "num_attention_heads", source)),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(require(raw, "kv_lora_rank", source)),
            qk_nope_head_dim=int(require(raw, "qk_nope_head_dim", source)),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(require(raw, "v_head_dim", source)),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=parse_rope(raw, rope_dim, source),
            attention_bias=bool(raw.get("attention_bias", False)),
            n_experts=n_experts,
            top_k=int(require(raw, "num_experts_per_tok", source)),
            expert_intermediate=int(require(raw, "moe_intermediate_size", source)),
            dense_intermediate=int(require(raw, "intermediate_size", source)),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            n_group=n_group,
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            eos_token_id=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    def trunk_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trunk tensor inference needs, by canonical name, with its shape."""
        return decoder_shapes(
            self,
            lambda i, p: (
                mla_shapes(self, p + "self_attn.")
                | mlp_shapes(self, p + "mlp.", i in self.moe_layers)
            ),
        )

    def kv_bytes_per_token(self) -> int:
        return self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * 4


def mla_shapes(c, a: str) -> dict[str, tuple[int, ...]]:
    """The MLA tensors under prefix `a` (a layer's "self_attn."), for any config with
    DeepSeek-V3's attention fields (Kimi Linear's MLA layers too)."""
    h, heads, r, rope = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (heads * c.qk_head_dim, h)
    else:
        shapes[a + "q_a_proj.weight"] = (c.q_lora_rank, h)
        shapes[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (heads * c.qk_head_dim, c.q_lora_rank)
        if c.attention_bias:
            shapes[a + "q_a_proj.bias"] = (c.q_lora_rank,)
    shapes[a + "kv_a_proj_with_mqa.weight"] = (r + rope, h)
    shapes[a + "kv_a_layernorm.weight"] = (r,)
    shapes[a + "kv_b_proj.weight"] = (heads * (c.qk_nope_head_dim + c.v_head_dim), r)
    shapes[a + "o_proj.weight"] = (h, heads * c.v_head_dim)
    if c.attention_bias:
        shapes[a + "kv_a_proj_with_mqa.bias"] = (r + rope,)
        shapes[a + "o_proj.bias"] = (h,)
    return shapes


def mlp_shapes(c, m: str, moe: bool) -> dict[str, tuple[int, ...]]:
    """A layer's router and shared experts (moe) or dense MLP under prefix `m`."""
    h = c.hidden_size
    if not moe:
        d = c.dense_intermediate
        return {
            m + "gate_proj.weight": (d, h),
            m + "up_proj.weight": (d, h),
            m + "down_proj.weight": (h, d),
        }
    shapes = {
        m + "gate.weight": (c.n_experts, h),
        m + "gate.e_score_correction_bias": (c.n_experts,),
    }
    if c.n_shared_experts:
        s = c.expert_intermediate * c.n_shared_experts
        shapes[m + "shared_experts.gate_proj.weight"] = (s, h)
        shapes[m + "shared_experts.up_proj.weight"] = (s, h)
        shapes[m + "shared_experts.down_proj.weight"] = (h, s)
    return shapes


def canonical_name(name: str) -> str:
    return name


class LatentCache:
    """Per layer: the compressed latent [max_len, kv_lora_rank] and rotary key [max_len, rope]."""

    def __init__(self, config: Config, max_len: int):
        n = config.num_hidden_layers
        self.latent = [np.zeros((max_len, config.kv_lora_rank), np.float32) for _ in range(n)]
        self.k_rot = [np.zeros((max_len, config.qk_rope_head_dim), np.float32) for _ in range(n)]
        self.length = 0  # tokens already in the cache
        self.max_len = max_len

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a rollback: they are computed again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length


class Transformer:
    """The trunk's forward pass; routed experts go to `experts` (local or remote)."""

    MLP = "mlp"  # the MoE / dense MLP modules' name in each layer (Kimi Linear: block_sparse_moe)

    def __init__(self, config: Config, trunk: Trunk, experts: ExpertsBackend):
        self.config, self.trunk, self.experts = config, trunk, experts
        self.inv_freq, self.rope_scale = config.rope.inv_freq_and_scale()
        scaling = config.qk_head_dim**-0.5
        if config.rope.rope_type != "default" and config.rope.mscale_all_dim:
            scaling *= yarn_mscale(config.rope.factor, config.rope.mscale_all_dim) ** 2
        self.scaling = scaling
        self._absorbed: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def new_cache(self, max_len: int) -> LatentCache:
        return LatentCache(self.config, max_len)

    def forward(self, ids: np.ndarray, cache: LatentCache, last_only: bool = False) -> np.ndarray:
        """Token ids [T] at positions cache.length.. -> logits [T, V] (last_only: the last
        token's alone, [1, V]); appends to the cache."""
        return self.forward_batch([(ids, cache)], last_only)[0]

    def forward_batch(self, batch, last_only: bool = False) -> list[np.ndarray]:
        """Several sequences in one pass (continuous batching), as the Qwen family's
        `forward_batch`: attention per sequence on its own cache, everything else (and one
        experts call per MoE layer) over every sequence's rows."""
        seq = Segments(batch)
        rope = rope_per_sequence(seq, self.inv_freq, self.rope_scale)  # cos, sin per sequence

        def mix(i: int, h: np.ndarray) -> np.ndarray:
            return seq.each(h, lambda s, hs, cache: self.attention(i, hs, *rope[s], cache))

        return self.decode_rows(seq, mix, last_only)

    def decode_rows(self, seq: Segments, mix, last_only: bool) -> list[np.ndarray]:
        """The pre-norm decoder over `seq` with `mix(i, h)` as layer i's token mixer: this
        family's norms, MLPs and experts (`decoder.prenorm_forward_batch`)."""
        c, w = self.config, self.trunk

        def norms(i: int) -> tuple[np.ndarray, np.ndarray]:
            p = f"model.layers.{i}."
            return w.vector(p + "input_layernorm.weight"), w.vector(
                p + "post_attention_layernorm.weight"
            )

        def mlp(i: int, h: np.ndarray) -> np.ndarray:
            return self.moe(i, h) if i in c.moe_layers else self.dense_mlp(i, h)  # [N, H]

        head = "model.embed_tokens" if c.tie_word_embeddings else "lm_head"
        return prenorm_forward_batch(self, seq, mix, mlp, norms, head, last_only)

    def absorbed_kv_b(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """kv_b_proj split per head: W_uk [heads, nope, rank], W_uv^T [heads, rank, v]."""
        if i not in self._absorbed:
            c = self.config
            kv_b = self.trunk.vector(f"model.layers.{i}.self_attn.kv_b_proj.weight")
            per_head = kv_b.reshape(
                c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
            )  # [heads, nope + v, rank]
            w_uk = np.ascontiguousarray(per_head[:, : c.qk_nope_head_dim])  # [heads, nope, rank]
            w_uv_t = np.ascontiguousarray(
                per_head[:, c.qk_nope_head_dim :].transpose(0, 2, 1)
            )  # [heads, rank, v]
            self._absorbed[i] = (w_uk, w_uv_t)
        return self._absorbed[i]

    def attention(self, i, h, cos, sin, cache: LatentCache) -> np.ndarray:
        c, w = self.config, self.trunk
        a = f"model.layers.{i}.self_attn."
        t, heads = h.shape[0], c.num_attention_heads
        if c.q_lora_rank is None:
            q = w.linear(a + "q_proj")(h)  # [T, heads * qk]
        else:
            q_low = w.linear(a + "q_a_proj")(h)  # [T, q_rank]
            q_low = rms_norm(q_low, w.vector(a + "q_a_layernorm.weight"), LATENT_NORM_EPS)
            q = w.linear(a + "q_b_proj")(q_low)  # [T, heads * qk]
        q = q.reshape(t, heads, c.qk_head_dim)  # [T, heads, nope + rope]
        q_nope, q_rot = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]

        compressed = w.linear(a + "kv_a_proj_with_mqa")(h)  # [T, rank + rope]
        latent = rms_norm(
            compressed[:, : c.kv_lora_rank], w.vector(a + "kv_a_layernorm.weight"), LATENT_NORM_EPS
        )  # [T, rank]
        k_rot = compressed[:, None, c.kv_lora_rank :]  # [T, 1, rope]
        if cos is not None:  # (Kimi Linear's MLA has no positions: cos and sin None)
            q_rot = apply_rope(q_rot, cos, sin, c.rope_interleave)  # [T, heads, rope]
            k_rot = apply_rope(k_rot, cos, sin, c.rope_interleave)
        k_rot = k_rot[:, 0]  # [T, rope]

        start, end = cache.length, cache.length + t
        cache.latent[i][start:end], cache.k_rot[i][start:end] = latent, k_rot
        lat_all, rot_all = cache.latent[i][:end], cache.k_rot[i][:end]  # [S, rank], [S, rope]

        w_uk, w_uv_t = self.absorbed_kv_b(i)
        q_lat = np.matmul(q_nope.transpose(1, 0, 2), w_uk)  # [heads, T, rank]
        scores = np.matmul(q_lat, lat_all.T) + np.matmul(
            q_rot.transpose(1, 0, 2), rot_all.T
        )  # [heads, T, S]
        probs = softmax(scores * np.float32(self.scaling) + causal_mask(t, end))  # [heads, T, S]
        context = np.matmul(probs, lat_all)  # [heads, T, rank]
        out = np.matmul(context, w_uv_t)  # [heads, T, v]
        out = out.transpose(1, 0, 2).reshape(t, heads * c.v_head_dim)  # [T, heads * v]
        return self.attention_output(i, h, out)  # [T, H]

    def attention_output(self, i: int, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The heads' outputs out [T, heads * v] back to the hidden size [T, H] (o_proj; Kimi
        K3 gates them first).  h [T, H] is the attention's input."""
        return self.trunk.linear(f"model.layers.{i}.self_attn.o_proj")(out)  # [T, H]

    def route(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Grouped sigmoid router of layer i: h [T, H] -> expert ids [T, k], weights [T, k]."""
        return grouped_sigmoid_route(
            self.config, self.trunk, f"model.layers.{i}.{self.MLP}.gate", h
        )

    def moe(self, i: int, h: np.ndarray) -> np.ndarray:
        ids, weights = self.route(i, h)  # [T, k] each
        hint = next_layer_hint(self, i, h)  # the next layer's experts, fetched meanwhile
        out = self.experts(i, h, ids, weights, hint=hint)  # [T, H]
        if self.config.n_shared_experts:
            m, w = f"model.layers.{i}.{self.MLP}.shared_experts.", self.trunk
            out = out + swiglu_mlp(
                h, w.linear(m + "gate_proj"), w.linear(m + "up_proj"), w.linear(m + "down_proj")
            )  # [T, H]
        return out

    def dense_mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        m, w = f"model.layers.{i}.{self.MLP}.", self.trunk
        return swiglu_mlp(
            h, w.linear(m + "gate_proj"), w.linear(m + "up_proj"), w.linear(m + "down_proj")
        )


def grouped_sigmoid_route(c, w: Trunk, gate: str, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's router (GLM-4.5's too) with its weights under `gate` (gate.weight [E, H],
    gate.e_score_correction_bias [E]): h [T, H] -> expert ids [T, k] best first, weights
    [T, k] (the module docstring has the steps)."""
    scores = sigmoid(w.linear(gate)(h))  # [T, E] (a kernel's: the same bits in any batch)
    choice = scores + w.vector(gate + ".e_score_correction_bias")  # [T, E]
    t, per_group = h.shape[0], c.n_experts // c.n_group
    grouped = choice.reshape(t, c.n_group, per_group)  # [T, G, E/G]
    group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)  # [T, G]
    keep_groups = top_k_indices(group_scores, c.topk_group)  # [T, topk_group]
    group_mask = np.zeros((t, c.n_group), dtype=bool)  # [T, G]
    np.put_along_axis(group_mask, keep_groups, True, axis=-1)
    expert_mask = np.repeat(group_mask, per_group, axis=-1)  # [T, E]
    masked = np.where(expert_mask, choice, np.float32(-np.inf))  # [T, E]
    ids = top_k_indices(masked, c.top_k)  # [T, k]
    weights = np.take_along_axis(scores, ids, axis=-1)  # [T, k]
    if c.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return ids, (weights * np.float32(c.routed_scaling_factor)).astype(np.float32)
