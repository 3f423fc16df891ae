"""Kimi Linear (model_type kimi_linear): Kimi Delta Attention and position-free MLA layers,
with DeepSeek-V3's sigmoid-routed MoE.

Each layer is either KDA (`moeshard.moe.model.kda`: a recurrent state per sequence instead of a KV
cache) or MLA as in `moeshard.moe.model.deepseek_v3` without any rotary embedding (the shared k_rot
part of the keys is cached and used as it is).  The first `first_k_dense_replace` layers have a
dense MLP, the others DeepSeek-V3's router (sigmoid scores, `e_score_correction_bias` for
selection only, expert groups, renormalised and scaled weights), routed experts and shared
experts.  The checkpoint layout is the released one (`block_sparse_moe`, experts w1/w2/w3,
separate q/k/v short convolutions); transformers' `save_pretrained` writes the same names (it
renames them back from its own on the way out).

config.json comes in two dialects.  The released one says which layers are KDA in
`linear_attn_config` (one-based ``kda_layers`` and ``full_attn_layers``, with the KDA sizes) and
how many leading layers are dense in `first_k_dense_replace`; transformers' `KimiLinearConfig`
writes `layer_types`, `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim` and
`mlp_layer_types` instead (and keeps the released fields only when it loaded them).  Either form
is read in full, and where both are present they must agree (`LinearAttention`, `dense_layers`).

Every field the model needs is read with `require`: a missing one is an error naming it,
never a default (transformers' own config would quietly make every fourth layer MLA).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeshard.moe.errors import ConfigError
from moeshard.moe.model import deepseek_v3
from moeshard.moe.model.config import RopeConfig, check_int, decoder_shapes, require
from moeshard.moe.model.kda import KdaState, KdaWeights, RecurrentStates, kda_forward
from moeshard.moe.model.layers import Segments

MODEL_TYPES = ("kimi_linear",)
MAX_KDA_WIDTH = 1 << 16


def _require_any(raw: dict[str, Any], names: tuple[str, ...], source: str) -> Any:
    """The value of `names` (spellings of one field: transformers accepts each), required in
    one of them; spellings present with different values are refused."""
    present = {name: raw[name] for name in names if raw.get(name) is not None}
    if len(set(map(json.dumps, present.values()))) > 1:
        shown = ", ".join(f"'{k}' {v!r}" for k, v in present.items())
        raise ConfigError(f"{source}: {shown} spell one field with different values")
    if present:
        return next(iter(present.values()))
    return require(raw, names[0], source)


# transformers' names (what `KimiLinearConfig.save_pretrained` writes) for what the released
# config.json says in `linear_attn_config` and `first_k_dense_replace`
TRANSFORMERS_ATTENTION = ("layer_types", "linear_num_heads", "linear_head_dim",
                          "linear_conv_kernel_dim")  # fmt: skip
LAYER_TYPES = {"linear_attention": True, "full_attention": False}  # -> is KDA
MLP_LAYER_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class LinearAttention:
    """Which layers are KDA (zero-based) and the KDA sizes, from either dialect of config.json:
    the released `linear_attn_config` (one-based `kda_layers` and `full_attn_layers`, with
    `num_heads`, `head_dim`, `short_conv_kernel_size`) or transformers' `layer_types`,
    `linear_num_heads`, `linear_head_dim` and `linear_conv_kernel_dim`.  Each form present
    is read in full; when both are, they must agree.  `raw` is `linear_attn_config` ({} when
    only transformers' names are there)."""

    layers: tuple[int, ...]
    heads: int
    head_dim: int
    kernel: int
    raw: dict[str, Any]

    @classmethod
    def from_hf(cls, raw: dict[str, Any], layers: int, source: str) -> LinearAttention:
        forms = []
        if raw.get("linear_attn_config") is not None:
            forms.append(cls._released(raw, layers, source))
        if any(raw.get(k) is not None for k in TRANSFORMERS_ATTENTION):
            forms.append(cls._transformers(raw, layers, source))
        if not forms:
            raise ConfigError(
                f"{source}: missing required field 'linear_attn_config' (or transformers' "
                f"{', '.join(map(repr, TRANSFORMERS_ATTENTION))})"
            )
        if len(forms) == 2 and forms[0].sizes() != forms[1].sizes():
            raise ConfigError(
                f"{source}: linear_attn_config and transformers' layer_types/linear_* "
                f"describe different models ({forms[0].sizes()} vs {forms[1].sizes()}: "
                "KDA layers, heads, head_dim, kernel)"
            )
        return forms[0]

    def sizes(self) -> tuple[tuple[int, ...], int, int, int]:
        return self.layers, self.heads, self.head_dim, self.kernel

    @classmethod
    def _released(cls, raw: dict[str, Any], layers: int, source: str) -> LinearAttention:
        linear = require(raw, "linear_attn_config", source)
        where = f"{source}: linear_attn_config"
        kda, full = (require(linear, k, where) for k in ("kda_layers", "full_attn_layers"))
        for name, value in (("kda_layers", kda), ("full_attn_layers", full)):
            if not isinstance(value, list):
                raise ConfigError(f"{where}: '{name}' must be a list of layer numbers")
        one_based = [check_int(i, "linear_attn_config layer", source, 1, layers) for i in kda]
        mla = [check_int(i, "linear_attn_config layer", source, 1, layers) for i in full]
        if sorted(one_based + mla) != list(range(1, layers + 1)):
            raise ConfigError(
                f"{where}: kda_layers and full_attn_layers must name each of the "
                f"{layers} layers (one-based) exactly once"
            )

        def size(key: str, most: int = MAX_KDA_WIDTH) -> int:
            return check_int(require(linear, key, where), key, where, 1, most)

        return cls(
            layers=tuple(sorted(i - 1 for i in one_based)),
            heads=size("num_heads"),
            head_dim=size("head_dim"),
            kernel=size("short_conv_kernel_size", 64),
            raw=linear,
        )

    @classmethod
    def _transformers(cls, raw: dict[str, Any], layers: int, source: str) -> LinearAttention:
        kinds = per_layer(raw, "layer_types", tuple(LAYER_TYPES), layers, source)

        def size(key: str, most: int = MAX_KDA_WIDTH) -> int:
            return check_int(require(raw, key, source), key, source, 1, most)

        return cls(
            layers=tuple(i for i, kind in enumerate(kinds) if LAYER_TYPES[kind]),
            heads=size("linear_num_heads"),
            head_dim=size("linear_head_dim"),
            kernel=size("linear_conv_kernel_dim", 64),
            raw={},
        )


def per_layer(raw: dict[str, Any], key: str, allowed: tuple[str, ...], layers: int, source: str):
    """A list field naming one of `allowed` per layer (transformers' layer_types)."""
    kinds = require(raw, key, source)
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(allowed):
        raise ConfigError(
            f"{source}: '{key}' must list one of {', '.join(map(repr, allowed))} for each of "
            f"the {layers} layers, not {json.dumps(kinds)[:60]}"
        )
    return kinds


def dense_layers(raw: dict[str, Any], layers: int, source: str) -> int:
    """How many leading layers have a dense MLP: the released `first_k_dense_replace`, or
    transformers' `mlp_layer_types` ("dense"/"sparse" per layer; moeshard runs its dense
    layers as a leading run, as every released Kimi Linear has them); both must agree."""
    forms = []
    if raw.get("first_k_dense_replace") is not None:
        first = require(raw, "first_k_dense_replace", source)
        forms.append(check_int(first, "first_k_dense_replace", source, 0, layers))
    if raw.get("mlp_layer_types") is not None:
        kinds = per_layer(raw, "mlp_layer_types", MLP_LAYER_TYPES, layers, source)
        dense = kinds.count("dense")
        if kinds != ["dense"] * dense + ["sparse"] * (layers - dense):
            raise ConfigError(
                f"{source}: 'mlp_layer_types' {kinds}: moeshard runs dense MLP layers only "
                "before the MoE layers (first_k_dense_replace)"
            )
        forms.append(dense)
    if not forms:
        raise ConfigError(
            f"{source}: missing required field 'first_k_dense_replace' (or transformers' "
            "'mlp_layer_types')"
        )
    if len(set(forms)) > 1:
        raise ConfigError(
            f"{source}: first_k_dense_replace {forms[0]} and mlp_layer_types' {forms[1]} "
            "leading dense layers disagree"
        )
    return forms[0]


@dataclass(frozen=True, kw_only=True)
class Config(deepseek_v3.Config):
    """DeepSeek-V3's fields (MLA without positions here), and the KDA layers'."""

    kda_layers: tuple[int, ...]  # zero-based
    kda_heads: int
    kda_head_dim: int
    kda_kernel: int
    rope: RopeConfig | None = None  # no rotation: MLA without positions, KDA's convolutions
    attention_bias: bool = False
    rope_interleave: bool = False  # unused: no rotation
    max_position_embeddings: int = 1 << 20

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.kda_layers)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not Kimi Linear")
        layers = int(require(raw, "num_hidden_layers", source))
        kda = LinearAttention.from_hf(raw, layers, source)
        n_experts = int(_require_any(raw, ("num_experts", "num_local_experts"), source))
        n_group = int(_require_any(raw, ("num_expert_group", "n_group"), source))
        if n_experts % n_group:
            raise ConfigError(f"{source}: num_experts {n_experts} not divisible by its groups")
        if require(raw, "hidden_act", source) != "silu":
            raise ConfigError(
                f"{source}: hidden_act {raw['hidden_act']!r} unsupported (need 'silu')"
            )
        activation = raw.get("moe_router_activation_func", "sigmoid")
        if activation != "sigmoid":
            raise ConfigError(f"{source}: moe_router_activation_func {activation!r} unsupported")
        if "q_lora_rank" not in raw:
            raise ConfigError(f"{source}: missing required field 'q_lora_rank' (null: none)")
        q_lora = raw["q_lora_rank"]
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(require(raw, "vocab_size", source)),
            hidden_size=int(require(raw, "hidden_size", source)),
            num_hidden_layers=layers,
            num_attention_heads=int(require(raw, "num_attention_heads", source)),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(require(raw, "kv_lora_rank", source)),
            qk_nope_head_dim=int(require(raw, "qk_nope_head_dim", source)),
            qk_rope_head_dim=int(require(raw, "qk_rope_head_dim", source)),
            v_head_dim=int(require(raw, "v_head_dim", source)),
            rms_norm_eps=float(require(raw, "rms_norm_eps", source)),
            tie_word_embeddings=bool(require(raw, "tie_word_embeddings", source)),
            n_experts=n_experts,
            top_k=int(_require_any(raw, ("num_experts_per_token", "num_experts_per_tok"), source)),
            expert_intermediate=int(require(raw, "moe_intermediate_size", source)),
            dense_intermediate=int(require(raw, "intermediate_size", source)),
            n_shared_experts=int(
                _require_any(raw, ("num_shared_experts", "n_shared_experts"), source)
            ),
            n_group=n_group,
            topk_group=int(require(raw, "topk_group", source)),
            norm_topk_prob=bool(_require_any(raw, ("moe_renormalize", "norm_topk_prob"), source)),
            routed_scaling_factor=float(require(raw, "routed_scaling_factor", source)),
            first_k_dense_replace=dense_layers(raw, layers, source),
            kda_layers=kda.layers,
            kda_heads=kda.heads,
            kda_head_dim=kda.head_dim,
            kda_kernel=kda.kernel,
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("model_max_length") or 1 << 20),
            eos_token_id=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    def trunk_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trunk tensor inference needs, by canonical (released) name, with its shape."""
        return decoder_shapes(self, self._layer_shapes)

    def _layer_shapes(self, i: int, p: str) -> dict[str, tuple[int, ...]]:
        h, kh, kd, kk = self.hidden_size, self.kda_heads, self.kda_head_dim, self.kda_kernel
        a = p + "self_attn."
        shapes = deepseek_v3.mlp_shapes(self, p + "block_sparse_moe.", i in self.moe_layers)
        if i not in self.kda_layers:
            return shapes | deepseek_v3.mla_shapes(self, a)
        for x in ("q", "k", "v"):
            shapes[a + f"{x}_proj.weight"] = (kh * kd, h)
            shapes[a + f"{x}_conv1d.weight"] = (kh * kd, 1, kk)
        shapes[a + "f_a_proj.weight"] = (kd, h)
        shapes[a + "f_b_proj.weight"] = (kh * kd, kd)
        shapes[a + "dt_bias"] = (kh * kd,)
        shapes[a + "A_log"] = (1, 1, kh, 1)
        shapes[a + "b_proj.weight"] = (kh, h)
        shapes[a + "g_a_proj.weight"] = (kd, h)
        shapes[a + "g_b_proj.weight"] = (kh * kd, kd)
        shapes[a + "o_norm.weight"] = (kd,)
        shapes[a + "o_proj.weight"] = (h, kh * kd)
        return shapes

    def kv_bytes_per_token(self) -> int:
        """The MLA layers' latent cache per token (KDA layers keep `state_bytes` instead)."""
        return len(self.mla_layers) * (self.kv_lora_rank + self.qk_rope_head_dim) * 4

    def state_bytes(self) -> int:
        """One sequence's fixed-size KDA state: per layer the S matrices and the conv tail
        (and as much again per kept rollback step: `HybridCache.keep_rollback`)."""
        kd, kh = self.kda_head_dim, self.kda_heads
        per_layer = kh * kd * kd + (self.kda_kernel - 1) * 3 * kh * kd
        return len(self.kda_layers) * per_layer * 4


def canonical_name(name: str) -> str:
    return name


class HybridCache(RecurrentStates):
    """Per MLA layer the latent cache (as `deepseek_v3.LatentCache`), per KDA layer its state
    (`kda`), which rolls back as `RecurrentStates` says."""

    def __init__(self, config: Config, max_len: int):
        mla, n = set(config.mla_layers), config.num_hidden_layers
        rank, rope = config.kv_lora_rank, config.qk_rope_head_dim

        def rows(width: int) -> list[np.ndarray | None]:
            return [np.zeros((max_len, width), np.float32) if i in mla else None for i in range(n)]

        self.latent, self.k_rot = rows(rank), rows(rope)
        # (None for the KDA layers: `deepseek_v3.Transformer.attention` runs on MLA layers only)
        sizes = (config.kda_heads, config.kda_head_dim, config.kda_kernel)
        super().__init__({i: KdaState.empty(*sizes) for i in config.kda_layers}, max_len)

    @property
    def kda(self) -> dict[int, KdaState]:
        return self.states


class Transformer(deepseek_v3.Transformer):
    """The trunk's forward pass: DeepSeek-V3's MLA (without positions), router, MoE and dense
    MLP, plus the KDA layers; routed experts go to `experts` (local or remote)."""

    MLP = "block_sparse_moe"

    def __init__(self, config: Config, trunk, experts):
        self.config, self.trunk, self.experts = config, trunk, experts
        self.scaling = config.qk_head_dim**-0.5
        self._absorbed: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def kda_weights(self, i: int) -> KdaWeights:
        """Layer i's KDA weights from the trunk (looked up per call: a streamed trunk may have
        replaced them since)."""
        w = self.trunk
        a = f"model.layers.{i}.self_attn."
        chain = KdaWeights.chain
        return self._kda_weights(
            i,
            f=chain(w.linear(a + "f_a_proj"), w.linear(a + "f_b_proj")),
            g=chain(w.linear(a + "g_a_proj"), w.linear(a + "g_b_proj")),
            lower_bound=None,
        )

    def _kda_weights(self, i: int, f, g, lower_bound: float | None) -> KdaWeights:
        """Layer i's KDA weights around the given gate projections."""
        c, w = self.config, self.trunk
        a = f"model.layers.{i}.self_attn."
        conv = np.concatenate(
            [w.vector(a + f"{x}_conv1d.weight").reshape(-1, c.kda_kernel) for x in "qkv"]
        )  # [3 * heads * dk, kernel]
        lin = {x: w.linear(a + x) for x in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj")}
        a_log = w.vector(a + "A_log").reshape(-1)[: c.kda_heads]  # (K3 pads it: first heads)
        return KdaWeights(
            q=lin["q_proj"], k=lin["k_proj"], v=lin["v_proj"], f=f, b=lin["b_proj"], g=g,
            o=lin["o_proj"], conv=conv, dt_bias=w.vector(a + "dt_bias"), a_log=a_log,
            o_norm=w.vector(a + "o_norm.weight"), heads=c.kda_heads, eps=c.rms_norm_eps,
            lower_bound=lower_bound,
        )  # fmt: skip

    def new_cache(self, max_len: int) -> HybridCache:
        return HybridCache(self.config, max_len)

    def forward_batch(self, batch, last_only: bool = False) -> list[np.ndarray]:
        """Several sequences in one pass (continuous batching): KDA and attention per
        sequence on its own cache, everything else over every sequence's rows."""
        seq = Segments(batch)
        for cache in seq.caches():
            cache.snapshot()

        def mix(i: int, h: np.ndarray) -> np.ndarray:
            return seq.each(h, lambda s, hs, cache: self.mixer(i, hs, cache))  # [N, H]

        return self.decode_rows(seq, mix, last_only)

    def mixer(self, i: int, h: np.ndarray, cache: HybridCache) -> np.ndarray:
        """Layer i's token mixing for one sequence: KDA on its state, or MLA on its cache."""
        if i in cache.kda:
            return kda_forward(self.kda_weights(i), h, cache.kda[i])  # [T, H]
        return self.attention(i, h, None, None, cache)  # [T, H]
