"""Qwen3-Next (model_type qwen3_next) and Qwen3.5 / Qwen3.6 MoE (qwen3_5_moe, its text model
qwen3_5_moe_text): Gated DeltaNet and gated full-attention layers with Qwen2-MoE's softmax
router, routed experts and sigmoid-gated shared expert.

Layers are `linear_attention` (Gated DeltaNet) or `full_attention`, from `layer_types`, or,
where a config has none (published Qwen3-Next), every `full_attention_interval`-th layer is
full attention.  Read from transformers 5.25's qwen3_next and qwen3_5_moe modeling code:

* **Gated DeltaNet** (`linear_attn.`): KDA's short convolution and delta rule
  (`moeshard.moe.model.kda`) with one decay per value head, ``g = -exp(A_log) *
  softplus(a + dt_bias)``, ``beta = sigmoid(b)``; q and k have `linear_num_key_heads` heads,
  each serving `linear_num_value_heads / linear_num_key_heads` consecutive value heads; the
  output is RMS-normalised per head (weight `norm`, as stored), times ``silu(z)``, then
  `out_proj`.
* **Gated attention** (`self_attn.`): q_proj gives each head's query and a gate side by side
  ([q | gate] per head); per-head RMSNorm of q and k; rotary embedding on the first
  ``head_dim * partial_rotary_factor`` dims of each head (pairs i, i + rot/2); GQA; the heads'
  output times ``sigmoid(gate)`` before o_proj.
* **(1 + w) norms**: input_layernorm, post_attention_layernorm, the final norm and q_norm /
  k_norm store w with 1 + w applied (transformers' `Qwen3NextRMSNorm`, zero-initialised); the
  Gated DeltaNet's own norm does not.
* **MoE**: softmax top-k (`norm_topk_prob`), and the shared expert scaled by
  ``sigmoid(shared_expert_gate(x))``.

What differs between the two (one switch each, here):

* **projections**: qwen3_next fuses them, ``in_proj_qkvz`` with, per key head, [q, k, the
  group's v, the group's z] side by side, and ``in_proj_ba`` with [b, a] per key head;
  qwen3_5_moe has ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``.  (`fused_projections`)
* **router**: qwen3_5_moe always renormalises the top-k weights (no `norm_topk_prob` field).
* **dense layers**: qwen3_next's `mlp_only_layers` / `decoder_sparse_step` may make some
  layers dense MLPs (`intermediate_size`); qwen3_5_moe has MoE everywhere.
* **the wrapper**: qwen3_5_moe is published as a vision-language model: its config nests the
  text model under `text_config` (model_type qwen3_5_moe_text) beside a `vision_config`, and
  tensor names carry ``model.language_model.``; moeshard runs the text model and skips the
  vision tower (``model.visual.``).  Its rotary embedding is multimodal (`mrope_section`), and
  for text every section sees the same position: it is the plain partial rotary embedding.

Both publish a multi-token-prediction head (``mtp.*``), which convert skips.

Every field the model needs is read with `require`: a missing one is an error naming it.
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
    check_float,
    check_int,
    decoder_shapes,
    parse_rope,
    require,
)
from moeshard.moe.model.decoder import prenorm_forward_batch
from moeshard.moe.model.fused import route_softmax_topk
from moeshard.moe.model.kda import (
    KdaState,
    RecurrentStates,
    causal_conv,
    delta_rule,
    gated_rms_norm,
    l2norm,
    silu,
    softplus,
)
from moeshard.moe.model.layers import (
    Segments,
    apply_rope,
    attend,
    next_layer_hint,
    rms_norm,
    rope_per_sequence,
    sigmoid,
    swiglu_mlp,
)
from moeshard.moe.model.trunk import Trunk

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
WRAPPER = "qwen3_5_moe"  # the vision-language checkpoint; its text model is TEXT_TYPE
TEXT_TYPE = "qwen3_5_moe_text"
PREFIX = "model.language_model."  # the wrapper's text model; the vision tower is model.visual.
SKIPPED = {
    "model.visual.": "the vision tower (moeshard runs the text model)",
    "mtp.": "the multi-token prediction head (not run)",
}
LAYER_KINDS = ("linear_attention", "full_attention")
MAX_WIDTH = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Config(SwigluExperts):
    """The text model's fields (transformers' names, from `text_config` for the wrapper)."""

    model_type: str  # one of MODEL_TYPES (the wrapper's: qwen3_5_moe)
    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int
    num_attention_heads: int  # Hq
    num_key_value_heads: int  # Hkv
    head_dim: int  # D
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v/o projections of full-attention layers carry a bias
    rope: RopeConfig  # dim: the rotated dims per head, head_dim * partial_rotary_factor
    linear_layers: tuple[int, ...]  # the Gated DeltaNet layers; the others are full attention
    linear_key_heads: int  # hk
    linear_value_heads: int  # hv (a multiple of hk)
    linear_key_dim: int  # dk
    linear_value_dim: int  # dv
    linear_kernel: int  # the short convolution's width
    fused_projections: bool  # qwen3_next's in_proj_qkvz / in_proj_ba
    n_experts: int  # num_experts
    top_k: int  # num_experts_per_tok
    expert_intermediate: int  # moe_intermediate_size
    shared_expert_intermediate: int  # shared_expert_intermediate_size
    norm_topk_prob: bool  # renormalise the top-k weights
    moe_layers: tuple[int, ...]
    dense_intermediate: int = 0  # intermediate_size of dense layers (qwen3_next; 0: none)
    has_vision: bool = False  # a vision tower in the checkpoint (not run)
    max_position_embeddings: int = 4096
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.linear_layers)

    @property
    def conv_channels(self) -> int:
        """The convolved projections: q and k (hk * dk each) and v (hv * dv)."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.value_width

    @property
    def value_width(self) -> int:
        return self.linear_value_heads * self.linear_value_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not Qwen3-Next / Qwen3.5")
        text, where = raw, source
        if model_type == WRAPPER:
            text = require(raw, "text_config", source)
            where = f"{source}: text_config"
            if require(text, "model_type", where) != TEXT_TYPE:
                raise ConfigError(
                    f"{where}: model_type {text['model_type']!r}, expected {TEXT_TYPE!r}"
                )

        def need(key: str) -> Any:
            return require(text, key, where)

        def width(key: str, most: int = MAX_WIDTH) -> int:
            return check_int(need(key), key, where, 1, most)

        if need("hidden_act") != "silu":
            raise ConfigError(f"{where}: hidden_act {text['hidden_act']!r} unsupported (silu)")
        layers = width("num_hidden_layers", 4096)
        head_dim = width("head_dim")
        hk, hv = width("linear_num_key_heads"), width("linear_num_value_heads")
        if hv % hk:
            raise ConfigError(
                f"{where}: linear_num_value_heads {hv} is not a multiple of "
                f"linear_num_key_heads {hk}"
            )
        n_experts = width("num_experts", 1 << 16)
        linear = _linear_layers(text, layers, where)
        next_style = model_type == "qwen3_next"
        if next_style:
            norm_topk = bool(need("norm_topk_prob"))
            step = check_int(need("decoder_sparse_step"), "decoder_sparse_step", where, 1, layers)
            dense = set(text.get("mlp_only_layers") or [])  # (absent in Qwen3-Coder-Next: none)
            moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        else:  # Qwen3.5's router always renormalises, and every layer is MoE
            if text.get("norm_topk_prob") is False:
                raise ConfigError(f"{where}: 'norm_topk_prob' false: Qwen3.5 renormalises")
            norm_topk, moe_layers = True, tuple(range(layers))
        dense_inter = 0
        if len(moe_layers) < layers:
            dense_inter = width("intermediate_size")
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        # (the wrapper says it at top level; transformers writes it in text_config too)
        tie_source = text if "tie_word_embeddings" in text else raw
        return cls(
            model_type=model_type,
            vocab_size=width("vocab_size", 1 << 24),
            hidden_size=width("hidden_size"),
            num_hidden_layers=layers,
            num_attention_heads=width("num_attention_heads", 4096),
            num_key_value_heads=width("num_key_value_heads", 4096),
            head_dim=head_dim,
            rms_norm_eps=float(need("rms_norm_eps")),
            tie_word_embeddings=bool(require(tie_source, "tie_word_embeddings", where)),
            attention_bias=bool(need("attention_bias")),
            rope=parse_rope(text, _rotary_dim(text, head_dim, where), where),
            linear_layers=linear,
            linear_key_heads=hk,
            linear_value_heads=hv,
            linear_key_dim=width("linear_key_head_dim"),
            linear_value_dim=width("linear_value_head_dim"),
            linear_kernel=width("linear_conv_kernel_dim", 64),
            fused_projections=next_style,
            n_experts=n_experts,
            top_k=check_int(
                need("num_experts_per_tok"), "num_experts_per_tok", where, 1, n_experts
            ),
            expert_intermediate=width("moe_intermediate_size"),
            shared_expert_intermediate=width("shared_expert_intermediate_size"),
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            dense_intermediate=dense_inter,
            has_vision=raw.get("vision_config") is not None,
            max_position_embeddings=width("max_position_embeddings", 1 << 30),
            eos_token_id=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    def trunk_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trunk tensor inference needs, by canonical name (without the wrapper's
        ``language_model.``), with its shape."""
        return decoder_shapes(self, self._layer_shapes)

    def _layer_shapes(self, i: int, p: str) -> dict[str, tuple[int, ...]]:
        h, shapes = self.hidden_size, {}
        if i in self.linear_layers:
            a, hv, width = p + "linear_attn.", self.linear_value_heads, self.value_width
            if self.fused_projections:
                shapes[a + "in_proj_qkvz.weight"] = (self.conv_channels + width, h)
                shapes[a + "in_proj_ba.weight"] = (2 * hv, h)
            else:
                shapes[a + "in_proj_qkv.weight"] = (self.conv_channels, h)
                shapes[a + "in_proj_z.weight"] = (width, h)
                shapes[a + "in_proj_b.weight"] = (hv, h)
                shapes[a + "in_proj_a.weight"] = (hv, h)
            shapes[a + "conv1d.weight"] = (self.conv_channels, 1, self.linear_kernel)
            shapes[a + "dt_bias"] = (hv,)
            shapes[a + "A_log"] = (hv,)
            shapes[a + "norm.weight"] = (self.linear_value_dim,)
            shapes[a + "out_proj.weight"] = (h, width)
        else:
            a, d = p + "self_attn.", self.head_dim
            q_out, kv_out = self.num_attention_heads * d, self.num_key_value_heads * d
            outs = {"q_proj": 2 * q_out, "k_proj": kv_out, "v_proj": kv_out, "o_proj": h}
            for name, rows in outs.items():
                shapes[a + name + ".weight"] = (rows, q_out if name == "o_proj" else h)
                if self.attention_bias:
                    shapes[a + name + ".bias"] = (rows,)
            shapes[a + "q_norm.weight"] = (d,)
            shapes[a + "k_norm.weight"] = (d,)
        m = p + "mlp."
        if i not in self.moe_layers:
            inter = self.dense_intermediate
            return shapes | {
                m + "gate_proj.weight": (inter, h),
                m + "up_proj.weight": (inter, h),
                m + "down_proj.weight": (h, inter),
            }
        s = self.shared_expert_intermediate
        shapes[m + "gate.weight"] = (self.n_experts, h)
        shapes[m + "shared_expert.gate_proj.weight"] = (s, h)
        shapes[m + "shared_expert.up_proj.weight"] = (s, h)
        shapes[m + "shared_expert.down_proj.weight"] = (h, s)
        shapes[m + "shared_expert_gate.weight"] = (1, h)
        return shapes

    def kv_bytes_per_token(self) -> int:
        """The full-attention layers' keys and values per token (the Gated DeltaNet layers keep
        `state_bytes` instead)."""
        return len(self.full_layers) * 2 * self.num_key_value_heads * self.head_dim * 4

    def state_bytes(self) -> int:
        """One sequence's fixed-size Gated DeltaNet state: per layer the S matrices and the
        convolution's tail (and as much again per kept rollback step)."""
        s = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim
        tail = (self.linear_kernel - 1) * self.conv_channels
        return len(self.linear_layers) * (s + tail) * 4


def _linear_layers(text: dict[str, Any], layers: int, where: str) -> tuple[int, ...]:
    """The Gated DeltaNet layers, from `layer_types` or else `full_attention_interval` (every
    interval-th layer, one-based, is full attention)."""
    kinds = text.get("layer_types")
    if kinds is None:
        interval = check_int(
            require(text, "full_attention_interval", where), "full_attention_interval", where,
            1, layers,
        )  # fmt: skip
        return tuple(i for i in range(layers) if (i + 1) % interval)
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ConfigError(f"{where}: 'layer_types' must list each of the {layers} layers")
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise ConfigError(
                f"{where}: layer_types[{i}] {kind!r} unsupported ({', '.join(LAYER_KINDS)})"
            )
    return tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")


def _rotary_dim(text: dict[str, Any], head_dim: int, where: str) -> int:
    """head_dim * partial_rotary_factor (in rope_parameters, or at top level as published)."""
    params = text.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    if factor is None:
        raise ConfigError(f"{where}: missing required field 'partial_rotary_factor'")
    factor = check_float(factor, "partial_rotary_factor", where, 0.0, True)
    if factor > 1:
        raise ConfigError(f"{where}: 'partial_rotary_factor' {factor} is above 1")
    return int(head_dim * factor)


def canonical_name(name: str) -> str:
    """The text model's names as transformers' text-only model has them (``model.layers.``):
    the wrapper's ``model.language_model.`` prefix dropped."""
    return "model." + name[len(PREFIX) :] if name.startswith(PREFIX) else name


def skip_reason(name: str) -> str | None:
    """Why convert leaves a checkpoint tensor out, where it is not the generic reason."""
    return next((why for prefix, why in SKIPPED.items() if name.startswith(prefix)), None)


class HybridCache(RecurrentStates):
    """Per full-attention layer its keys and values [max_len, Hkv, D], per Gated DeltaNet
    layer its state (`states`), which rolls back as `RecurrentStates` says."""

    def __init__(self, config: Config, max_len: int):
        shape = (max_len, config.num_key_value_heads, config.head_dim)
        self.k = {i: np.zeros(shape, np.float32) for i in config.full_layers}
        self.v = {i: np.zeros(shape, np.float32) for i in config.full_layers}
        sizes = (
            config.conv_channels, config.linear_kernel, config.linear_value_heads,
            config.linear_key_dim, config.linear_value_dim,
        )  # fmt: skip
        super().__init__({i: KdaState.zeros(*sizes) for i in config.linear_layers}, max_len)


def fused_columns(c: Config) -> tuple[np.ndarray, ...]:
    """Where qwen3_next's fused projections put each part: the columns of in_proj_qkvz's
    output holding q, k and v (in in_proj_qkv's order: all q, all k, all v) and z, and of
    in_proj_ba's holding b and a.  Per key head g the fused rows are [q, k, v, z] of g's
    group (v and z: its hv / hk value heads) and [b, a]."""
    hk, dk, dv = c.linear_key_heads, c.linear_key_dim, c.linear_value_dim
    group = c.linear_value_heads // hk
    width = 2 * dk + 2 * group * dv  # one key head's block of in_proj_qkvz
    parts: dict[str, list[np.ndarray]] = {"q": [], "k": [], "v": [], "z": [], "b": [], "a": []}
    sizes = {"q": dk, "k": dk, "v": group * dv, "z": group * dv}
    for g in range(hk):
        start = g * width
        for name, size in sizes.items():
            parts[name].append(np.arange(start, start + size))
            start += size
        parts["b"].append(np.arange(2 * g * group, (2 * g + 1) * group))
        parts["a"].append(np.arange((2 * g + 1) * group, (2 * g + 2) * group))
    cols = {name: np.concatenate(p) for name, p in parts.items()}
    qkv = np.concatenate([cols["q"], cols["k"], cols["v"]])
    return qkv, cols["z"], cols["b"], cols["a"]


class Transformer:
    """The trunk's forward pass; routed experts go to `experts` (local or remote).  Gated
    DeltaNet and attention run per sequence on its own cache, everything else over every
    sequence's rows (one experts call per MoE layer)."""

    def __init__(self, config: Config, trunk: Trunk, experts: ExpertsBackend):
        self.config, self.trunk, self.experts = config, trunk, experts
        self.inv_freq, self.rope_scale = config.rope.inv_freq_and_scale()
        self.scaling = config.head_dim**-0.5
        self._columns = fused_columns(config) if config.fused_projections else None

    def new_cache(self, max_len: int) -> HybridCache:
        return HybridCache(self.config, max_len)

    def forward(self, ids: np.ndarray, cache: HybridCache, last_only: bool = False) -> np.ndarray:
        """Token ids [T] at positions cache.length.. -> logits [T, V] (last_only: the last
        token's alone, [1, V]); advances the cache."""
        return self.forward_batch([(ids, cache)], last_only)[0]

    def forward_batch(self, batch, last_only: bool = False) -> list[np.ndarray]:
        """Several sequences in one pass (continuous batching): each (ids [T_s], its cache)
        -> its logits [T_s, V] (last_only: [1, V])."""
        c, seq = self.config, Segments(batch)
        for cache in seq.caches():
            cache.snapshot()
        rope = rope_per_sequence(seq, self.inv_freq, self.rope_scale)  # [T_s, rot/2] each

        def mix(i: int, h: np.ndarray) -> np.ndarray:
            return seq.each(h, lambda s, hs, cache: self.mixer(i, hs, cache, rope[s]))

        def norms(i: int) -> tuple[np.ndarray, np.ndarray]:
            p = f"model.layers.{i}."
            return self.norm(p + "input_layernorm"), self.norm(p + "post_attention_layernorm")

        def mlp(i: int, h: np.ndarray) -> np.ndarray:
            return self.moe(i, h) if i in c.moe_layers else self.dense_mlp(i, h)  # [N, H]

        head = "model.embed_tokens" if c.tie_word_embeddings else "lm_head"
        final = self.norm("model.norm")
        return prenorm_forward_batch(self, seq, mix, mlp, norms, head, last_only, final_norm=final)

    def norm(self, prefix: str) -> np.ndarray:
        """An RMSNorm's effective weight: 1 + w, w as stored (`Qwen3NextRMSNorm`)."""
        return np.float32(1.0) + self.trunk.vector(prefix + ".weight")  # [width]

    def mixer(self, i: int, h: np.ndarray, cache: HybridCache, rope) -> np.ndarray:
        """Layer i's token mixing for one sequence, h [T, H] -> [T, H]."""
        if i in cache.states:
            return self.deltanet(i, h, cache.states[i])
        return self.attention(i, h, cache, *rope)

    def projections(self, a: str, h: np.ndarray) -> tuple[np.ndarray, ...]:
        """The Gated DeltaNet's inputs from h [T, H]: q, k and v side by side [T, C] (to be
        convolved), z [T, hv * dv], b and a [T, hv]."""
        w = self.trunk
        if self._columns is None:
            return tuple(w.linear(a + n)(h) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                       "in_proj_a"))  # fmt: skip
        qkv, z, b, gate = self._columns
        qkvz = w.linear(a + "in_proj_qkvz")(h)  # [T, C + hv * dv], grouped per key head
        ba = w.linear(a + "in_proj_ba")(h)  # [T, 2 hv], grouped per key head
        return qkvz[:, qkv], qkvz[:, z], ba[:, b], ba[:, gate]

    def deltanet(self, i: int, h: np.ndarray, state: KdaState) -> np.ndarray:
        """Gated DeltaNet layer i on one sequence's state: h [T, H] -> [T, H]."""
        c, w = self.config, self.trunk
        a = f"model.layers.{i}.linear_attn."
        t_n, hk, hv = h.shape[0], c.linear_key_heads, c.linear_value_heads
        dk, dv, keys = c.linear_key_dim, c.linear_value_dim, c.linear_key_heads * c.linear_key_dim
        mixed, z, b, gate_in = self.projections(a, h)
        taps = w.vector(a + "conv1d.weight").reshape(c.conv_channels, c.linear_kernel)
        conv = causal_conv(np.ascontiguousarray(mixed), taps, state)  # [T, C]
        q = l2norm(conv[:, :keys].reshape(t_n, hk, dk)) * np.float32(dk**-0.5)  # [T, hk, dk]
        k = l2norm(conv[:, keys : 2 * keys].reshape(t_n, hk, dk))  # [T, hk, dk]
        v = conv[:, 2 * keys :].reshape(t_n, hv, dv)  # [T, hv, dv]
        q, k = np.repeat(q, hv // hk, axis=1), np.repeat(k, hv // hk, axis=1)  # [T, hv, dk]
        rate = np.exp(w.vector(a + "A_log"))  # [hv]
        g = -rate * softplus(gate_in + w.vector(a + "dt_bias"))  # [T, hv]: log-decay per head
        out = delta_rule(q, k, v, g[:, :, None], sigmoid(b), state)  # [T, hv, dv]
        gate = silu(z.reshape(t_n, hv, dv))  # [T, hv, dv]
        normed = gated_rms_norm(out, w.vector(a + "norm.weight"), gate, c.rms_norm_eps)
        return w.linear(a + "out_proj")(np.ascontiguousarray(normed.reshape(t_n, hv * dv)))

    def attention(self, i: int, h, cache: HybridCache, cos, sin) -> np.ndarray:
        """Gated full-attention layer i on one sequence: h [T, H] -> [T, H]; appends its keys
        and values to the cache."""
        c, w = self.config, self.trunk
        a = f"model.layers.{i}.self_attn."
        t_n, hq, hkv, d = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps, rot = c.rms_norm_eps, c.rope.dim
        both = w.linear(a + "q_proj")(h).reshape(t_n, hq, 2 * d)  # [T, Hq, 2D]: [q | gate]
        q = rms_norm(both[..., :d], self.norm(a + "q_norm"), eps)  # [T, Hq, D]
        k = rms_norm(w.linear(a + "k_proj")(h).reshape(t_n, hkv, d), self.norm(a + "k_norm"), eps)
        q = np.concatenate([apply_rope(q[..., :rot], cos, sin, False), q[..., rot:]], axis=-1)
        k = np.concatenate([apply_rope(k[..., :rot], cos, sin, False), k[..., rot:]], axis=-1)
        start, end = cache.length, cache.length + t_n
        cache.k[i][start:end] = k  # [T, Hkv, D]
        cache.v[i][start:end] = w.linear(a + "v_proj")(h).reshape(t_n, hkv, d)
        out = attend(q, cache.k[i][:end], cache.v[i][:end], self.scaling)  # [T, Hq, D]
        gate = sigmoid(both[..., d:].reshape(t_n, hq * d))  # [T, Hq * D]
        return w.linear(a + "o_proj")(np.ascontiguousarray(out.reshape(t_n, hq * d) * gate))

    def route(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax top-k router of layer i: h [T, H] -> expert ids [T, k], weights [T, k]."""
        logits = self.trunk.linear(f"model.layers.{i}.mlp.gate")(h)  # [T, E]
        return route_softmax_topk(logits, self.config.top_k, self.config.norm_topk_prob)

    def moe(self, i: int, h: np.ndarray) -> np.ndarray:
        """Layer i's routed experts plus its sigmoid-gated shared expert: h [T, H] -> [T, H]."""
        w, m = self.trunk, f"model.layers.{i}.mlp."
        ids, weights = self.route(i, h)  # [T, k] each
        hint = next_layer_hint(self, i, h)  # the next layer's experts, fetched meanwhile
        out = self.experts(i, h, ids, weights, hint=hint)  # [T, H]
        shared = swiglu_mlp(h, *(w.linear(m + "shared_expert." + n) for n in _SWIGLU))  # [T, H]
        out = out + sigmoid(w.linear(m + "shared_expert_gate")(h)) * shared  # [T, H]
        return np.ascontiguousarray(out, dtype=np.float32)

    def dense_mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        w, m = self.trunk, f"model.layers.{i}.mlp."
        return swiglu_mlp(h, *(w.linear(m + n) for n in _SWIGLU))  # [T, H]


_SWIGLU = ("gate_proj", "up_proj", "down_proj")
