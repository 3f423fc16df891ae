"""Kimi K3 (model_type kimi_k3): Kimi Linear's hybrid of KDA and position-free MLA layers, plus
K3's own parts.  The released config nests the language model under `text_config` (model_type
kimi_linear) beside a `vision_config`; moeshard runs the text model and leaves the vision tower
out (convert lists its tensors as skipped).  Tensor names carry a ``language_model.`` prefix,
dropped here (`canonical_name`).

What K3 adds to `moeshard.moe.model.kimi_linear` (read from torchtitan's Kimi K3 model and the
released modeling code; each is checked against its definition in tests/test_kimi_k3.py):

* **KDA** with a bounded decay, ``g = gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``,
  and a full-rank output gate ``sigmoid(g_proj(x))`` (`moeshard.moe.model.kda`); A_log is published
  padded (to head_dim) and only its first `heads` entries are used.
* **Gated MLA**: the heads' output is multiplied by ``sigmoid(g_proj(x))`` before o_proj; no
  rotary embedding, scale (nope + rope)^-1/2.
* **Attention residuals** (`attn_res_block_size`): layers are grouped in blocks.  Instead of one
  residual stream, every attention input, FFN input and the final output is a per-token
  softmax mix (`attention_residual`) over the summaries of the blocks so far plus the running
  partial sum of the current block; a layer that opens a block (i % size == 0) files the
  partial sum as the last block's summary and starts a new one from its attention output.
* **SiTU-GLU** in every MLP and expert: ``[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]`` with
  `activation_situ_beta` b1 and `activation_situ_linear_beta` b2.
* **LatentMoE**: DeepSeek-V3's sigmoid router (selection bias, renormalised weights) on the
  full hidden state; the routed experts run in latent space: h is projected down to
  `routed_expert_hidden_size`, the experts' weighted sum is RMS-normalised and projected back
  up; the shared experts run at full width.  So the experts backend (and every node) takes and
  returns latent rows (`Config.expert_hidden`): half of K3's hidden width on the wire.

Norm epsilons follow the released code: rms_norm_eps everywhere except q_a_layernorm and
kv_a_layernorm, which keep the RMSNorm default 1e-6 (`deepseek_v3.LATENT_NORM_EPS`).

Every field the model needs is read with `require`: a missing one is an error naming it, never
a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moeshard.moe.errors import ConfigError
from moeshard.moe.kernels import quant
from moeshard.moe.model import deepseek_v3, kimi_linear
from moeshard.moe.model.config import check_float, check_int, decoder_shapes, require
from moeshard.moe.model.decoder import norm_rows
from moeshard.moe.model.kda import KdaWeights
from moeshard.moe.model.layers import Segments, next_layer_hint, rms_norm, sigmoid, softmax

MODEL_TYPES = ("kimi_k3",)
TEXT_MODEL_TYPE = "kimi_linear"
PREFIX = "language_model."  # the language model's tensors; the vision tower's are elsewhere
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
MAX_WIDTH = 1 << 20


def _flag(raw: dict[str, Any], key: str, source: str) -> None:
    """A required switch that must be on: K3 without it is another model."""
    value = require(raw, key, source)
    if value is not True:
        raise ConfigError(f"{source}: '{key}' is {value!r}; Kimi K3 needs true")


def _choice(raw: dict[str, Any], key: str, allowed: str, source: str) -> None:
    value = require(raw, key, source)
    if value != allowed:
        raise ConfigError(f"{source}: '{key}' {value!r} unsupported (Kimi K3 uses {allowed!r})")


@dataclass(frozen=True, kw_only=True)
class Config(kimi_linear.Config):
    """Kimi Linear's fields (K3's text model is one), and what K3 adds: KDA's decay bound,
    LatentMoE's latent width, attention residuals, SiTU."""

    model_type: str  # kimi_k3 (the text model's own type is kimi_linear)
    gate_lower_bound: float  # KDA's decay bound (log space), in [-5, 0)
    latent_size: int  # routed_expert_hidden_size: the routed experts' width L
    attn_res_block_size: int
    situ_beta: float
    situ_linear_beta: float
    has_vision: bool = False  # a vision tower in the checkpoint (not run)

    @property
    def expert_hidden(self) -> int:
        """The routed experts' rows are latent: L, not H."""
        return self.latent_size

    @property
    def expert_glu(self) -> quant.Glu:
        return quant.situ(self.situ_beta, self.situ_linear_beta)

    @property
    def a_log_size(self) -> int:
        """A_log's published length: the heads' rates, padded with zeros to head_dim."""
        return max(self.kda_heads, self.kda_head_dim)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> Config:
        model_type = require(raw, "model_type", source)
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type '{model_type}' is not Kimi K3")
        text, where = text_config(raw, source)
        if require(text, "model_type", where) != TEXT_MODEL_TYPE:
            raise ConfigError(f"{where}: model_type {text['model_type']!r}, expected 'kimi_linear'")
        _choice(text, "hidden_act", "situ", where)
        _choice(text, "moe_router_activation_func", "sigmoid", where)
        for key in ("mla_use_nope", "mla_use_output_gate", "latent_moe_use_norm"):
            _flag(text, key, where)
        layers = int(require(text, "num_hidden_layers", where))
        kda = kimi_linear.LinearAttention.from_hf(text, layers, where)
        _flag(kda.raw, "use_full_rank_gate", f"{where}: linear_attn_config")
        bound = check_float(
            require(kda.raw, "gate_lower_bound", f"{where}: linear_attn_config"),
            "linear_attn_config.gate_lower_bound", where, -5.0, False,
        )  # fmt: skip
        if bound >= 0:
            raise ConfigError(f"{where}: 'gate_lower_bound' {bound} must be below 0")
        n_experts = int(require(text, "num_experts", where))
        n_group = check_int(
            require(text, "num_expert_group", where), "num_expert_group", where, 1, n_experts
        )
        if n_experts % n_group:
            raise ConfigError(f"{where}: num_experts {n_experts} not divisible by its groups")

        def width(key: str) -> int:
            return check_int(require(text, key, where), key, where, 1, MAX_WIDTH)

        def positive(key: str) -> float:
            return check_float(require(text, key, where), key, where, 0.0, True)

        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=int(require(text, "vocab_size", where)),
            hidden_size=int(require(text, "hidden_size", where)),
            num_hidden_layers=layers,
            num_attention_heads=int(require(text, "num_attention_heads", where)),
            q_lora_rank=width("q_lora_rank"),
            kv_lora_rank=int(require(text, "kv_lora_rank", where)),
            qk_nope_head_dim=int(require(text, "qk_nope_head_dim", where)),
            qk_rope_head_dim=int(require(text, "qk_rope_head_dim", where)),
            v_head_dim=int(require(text, "v_head_dim", where)),
            rms_norm_eps=float(require(text, "rms_norm_eps", where)),
            tie_word_embeddings=bool(require(text, "tie_word_embeddings", where)),
            n_experts=n_experts,
            top_k=int(require(text, "num_experts_per_token", where)),
            expert_intermediate=int(require(text, "moe_intermediate_size", where)),
            dense_intermediate=int(require(text, "intermediate_size", where)),
            n_shared_experts=int(require(text, "num_shared_experts", where)),
            n_group=n_group,
            topk_group=check_int(
                require(text, "topk_group", where), "topk_group", where, 1, n_group
            ),  # fmt: skip
            norm_topk_prob=bool(require(text, "moe_renormalize", where)),
            routed_scaling_factor=float(require(text, "routed_scaling_factor", where)),
            first_k_dense_replace=int(require(text, "first_k_dense_replace", where)),
            kda_layers=kda.layers,
            kda_heads=kda.heads,
            kda_head_dim=kda.head_dim,
            kda_kernel=kda.kernel,
            gate_lower_bound=bound,
            latent_size=width("routed_expert_hidden_size"),
            attn_res_block_size=check_int(
                require(text, "attn_res_block_size", where),
                "attn_res_block_size",
                where,
                1,
                layers + 1,
            ),  # fmt: skip
            situ_beta=positive("activation_situ_beta"),
            situ_linear_beta=positive("activation_situ_linear_beta"),
            has_vision=raw.get("vision_config") is not None,
            max_position_embeddings=int(text.get("max_position_embeddings") or 1 << 20),
            eos_token_id=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    def trunk_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trunk tensor inference needs, by canonical name (the released name without
        ``language_model.``), with its shape."""
        h = self.hidden_size
        shapes = decoder_shapes(self, self._layer_shapes)
        shapes["model.output_attn_res_norm.weight"] = (h,)
        shapes["model.output_attn_res_proj.weight"] = (1, h)
        return shapes

    def _layer_shapes(self, i: int, p: str) -> dict[str, tuple[int, ...]]:
        h, kh, kd, kk = self.hidden_size, self.kda_heads, self.kda_head_dim, self.kda_kernel
        shapes: dict[str, tuple[int, ...]] = {
            p + "mlp_res_norm.weight": (h,),
            p + "mlp_res_proj.weight": (1, h),
        }
        if i > 0:  # (layer 0's are published too, but never used: no block precedes it)
            shapes[p + "self_attention_res_norm.weight"] = (h,)
            shapes[p + "self_attention_res_proj.weight"] = (1, h)
        a = p + "self_attn."
        if i in self.kda_layers:
            for x in ("q", "k", "v"):
                shapes[a + f"{x}_proj.weight"] = (kh * kd, h)
                shapes[a + f"{x}_conv1d.weight"] = (kh * kd, 1, kk)
            shapes[a + "f_a_proj.weight"] = (kd, h)
            shapes[a + "f_b_proj.weight"] = (kh * kd, kd)
            shapes[a + "dt_bias"] = (kh * kd,)
            shapes[a + "A_log"] = (self.a_log_size,)
            shapes[a + "b_proj.weight"] = (kh, h)
            shapes[a + "g_proj.weight"] = (kh * kd, h)
            shapes[a + "o_norm.weight"] = (kd,)
            shapes[a + "o_proj.weight"] = (h, kh * kd)
        else:
            shapes |= deepseek_v3.mla_shapes(self, a)
            shapes[a + "g_proj.weight"] = (self.num_attention_heads * self.v_head_dim, h)
        if i not in self.moe_layers:
            return shapes | deepseek_v3.mlp_shapes(self, p + "mlp.", False)
        m = p + "block_sparse_moe."
        shapes |= deepseek_v3.mlp_shapes(self, m, True)
        shapes[m + "routed_expert_down_proj.weight"] = (self.latent_size, h)
        shapes[m + "routed_expert_norm.weight"] = (self.latent_size,)
        shapes[m + "routed_expert_up_proj.weight"] = (h, self.latent_size)
        return shapes

    def kv_bytes_per_token(self) -> int:
        """The MLA layers' latent cache per token (KDA layers keep `state_bytes` instead)."""
        return len(self.mla_layers) * (self.kv_lora_rank + self.qk_rope_head_dim) * 4

    def state_bytes(self) -> int:
        """One sequence's fixed-size KDA state (as Kimi Linear's)."""
        kd, kh = self.kda_head_dim, self.kda_heads
        per_layer = kh * kd * kd + (self.kda_kernel - 1) * 3 * kh * kd
        return len(self.kda_layers) * per_layer * 4


def text_config(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """A multimodal wrapper's language model config (`text_config`, required, an object) and
    where to say it is, for error messages (Kimi K3's, Kimi K2.5's)."""
    text = require(raw, "text_config", source)
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: 'text_config' must be an object")
    return text, f"{source}: text_config"


def canonical_name(name: str) -> str:
    """The released name without the language model's prefix (the vision tower's keep
    theirs, and are skipped)."""
    return name[len(PREFIX) :] if name.startswith(PREFIX) else name


def skip_reason(name: str) -> str | None:
    """Why convert leaves a checkpoint tensor out, where it is not the generic reason."""
    if name.startswith(VISION_PREFIXES):
        return "the vision tower (moeshard runs the text model)"
    return None


def situ(x: np.ndarray, beta: float, linear_beta: float, up: np.ndarray) -> np.ndarray:
    """SiTU-GLU of gate x and up, float32 (with the expert kernels' code: the same bits)."""
    return quant.gated_unit(x, up, quant.situ(beta, linear_beta))


def attention_residual(
    partial: np.ndarray, blocks: list[np.ndarray], norm: np.ndarray, proj: np.ndarray, eps: float
) -> np.ndarray:
    """A per-token softmax mix of the block summaries and the running partial sum.

    partial [T, H], blocks N x [T, H] -> [T, H]: each value is scored by the projection of its
    RMS-normalised form (norm [H] times proj [H]), and the values themselves are mixed."""
    values = np.stack([*blocks, partial], axis=1)  # [T, N + 1, H]
    variance = np.mean(np.square(values), axis=-1, keepdims=True)  # [T, N + 1, 1]
    keys = values / np.sqrt(variance + np.float32(eps))  # [T, N + 1, H]
    scores = (keys * (norm * proj)).sum(axis=-1)  # [T, N + 1] (row by row: no BLAS blocking)
    probs = softmax(scores, axis=-1)  # [T, N + 1]
    return (probs[:, :, None] * values).sum(axis=1).astype(np.float32)  # [T, H]


class Transformer(kimi_linear.Transformer):
    """Kimi K3's forward pass over the trunk; routed experts go to `experts` (local or remote)
    with latent rows."""

    MLP = "block_sparse_moe"

    def kda_weights(self, i: int) -> KdaWeights:
        a, w = f"model.layers.{i}.self_attn.", self.trunk
        f = KdaWeights.chain(w.linear(a + "f_a_proj"), w.linear(a + "f_b_proj"))
        g = w.linear(a + "g_proj")
        return self._kda_weights(i, f=f, g=g, lower_bound=self.config.gate_lower_bound)

    def attention_output(self, i: int, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        a, w = f"model.layers.{i}.self_attn.", self.trunk
        gate = sigmoid(w.linear(a + "g_proj")(h))  # [T, heads * v]
        return w.linear(a + "o_proj")(out * gate)  # [T, H]

    def _residual(self, partial, blocks, prefix: str) -> np.ndarray:
        w = self.trunk
        norm, proj = w.vector(prefix + "_norm.weight"), w.vector(prefix + "_proj.weight")
        return attention_residual(partial, blocks, norm, proj.reshape(-1), self.config.rms_norm_eps)

    def _mlp(self, m: str, h: np.ndarray) -> np.ndarray:
        c, w = self.config, self.trunk
        g, u = w.linear(m + "gate_proj")(h), w.linear(m + "up_proj")(h)  # [T, I] each
        return w.linear(m + "down_proj")(situ(g, c.situ_beta, c.situ_linear_beta, u))  # [T, H]

    def dense_mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        return self._mlp(f"model.layers.{i}.mlp.", h)

    def moe(self, i: int, h: np.ndarray) -> np.ndarray:
        c, w = self.config, self.trunk
        m = f"model.layers.{i}.{self.MLP}."
        ids, weights = self.route(i, h)  # [T, k] each
        hint = next_layer_hint(self, i, h)  # the next layer's experts, fetched meanwhile
        latent = w.linear(m + "routed_expert_down_proj")(h)  # [T, L]
        routed = self.experts(i, latent, ids, weights, hint=hint)  # [T, L]
        routed = rms_norm(routed, w.vector(m + "routed_expert_norm.weight"), c.rms_norm_eps)
        out = w.linear(m + "routed_expert_up_proj")(routed)  # [T, H]
        if c.n_shared_experts:
            out = out + self._mlp(m + "shared_experts.", h)  # [T, H]
        return out

    def forward_batch(self, batch, last_only: bool = False) -> list[np.ndarray]:
        """Several sequences in one pass (continuous batching): KDA and MLA per sequence on
        its own cache; the attention residuals, norms, MLPs and experts over every row."""
        c, w = self.config, self.trunk
        seq = Segments(batch)
        for cache in seq.caches():
            cache.snapshot()
        partial = w.embed("model.embed_tokens.weight", seq.ids)  # [N, H]: the block's sum
        blocks: list[np.ndarray] = []  # the finished blocks' summaries, each [N, H]
        for i in range(c.num_hidden_layers):
            w.enter_layer(i)  # a streamed trunk makes layer i resident and starts reading i + 1
            p = f"model.layers.{i}."
            x = self._residual(partial, blocks, p + "self_attention_res") if blocks else partial
            if i % c.attn_res_block_size == 0:  # this layer opens a block
                blocks.append(partial)
            h = norm_rows(x, w.vector(p + "input_layernorm.weight"), c.rms_norm_eps)  # [N, H]
            a = seq.each(h, lambda s, hs, cache, i=i: self.mixer(i, hs, cache))  # [N, H]
            partial = a if i % c.attn_res_block_size == 0 else partial + a
            x = self._residual(partial, blocks, p + "mlp_res")  # [N, H]
            h = norm_rows(x, w.vector(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            partial = partial + (self.moe(i, h) if i in c.moe_layers else self.dense_mlp(i, h))
        seq.advance()
        x = self._residual(partial, blocks, "model.output_attn_res")  # [N, H]
        x = norm_rows(x, w.vector("model.norm.weight"), c.rms_norm_eps)  # [N, H]
        head = "model.embed_tokens" if c.tie_word_embeddings else "lm_head"
        return seq.logits(x, w.linear(head), last_only)  # [T_s, V] (or [1, V]) each


HybridCache = kimi_linear.HybridCache
