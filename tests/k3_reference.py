"""A plain float64 Kimi K3 forward pass, written from the definitions (torchtitan's Kimi K3
model at 9f8bcf0c and the released modeling code, as moe/model/kimi_k3.py's docstring lists
them), for tests/test_kimi_k3.py to hold moeshard's runtime against.

It shares no code with moeshard's model: whole sequences at once, no cache, MLA with its keys
and values expanded per head (moeshard absorbs them into latent space), the short convolution
and the delta rule as loops over time, the experts as dense matrices decoded from the
checkpoint's MXFP4 bits, every token's experts one by one.
"""

from __future__ import annotations

import numpy as np

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the RMSNorm default in the release


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def situ(g, u, beta, linear_beta):
    return beta * np.tanh(g / beta) * sigmoid(g) * (linear_beta * np.tanh(u / linear_beta))


class Reference:
    """The model from a checkpoint's tensors: `weights` maps released names to float64
    arrays (experts decoded), `text` is config.json's text_config."""

    def __init__(self, weights: dict[str, np.ndarray], text: dict):
        self.w, self.t = weights, text
        lin = text["linear_attn_config"]
        self.kda_layers = {i - 1 for i in lin["kda_layers"]}
        self.heads, self.dk, self.kernel = (
            lin["num_heads"],
            lin["head_dim"],
            lin["short_conv_kernel_size"],
        )
        self.bound = lin["gate_lower_bound"]
        self.eps = text["rms_norm_eps"]

    def p(self, name):
        return self.w["language_model.model." + name]

    def lin(self, name, x):
        return x @ self.p(name + ".weight").T

    def residual(self, partial, blocks, prefix):
        values = np.stack([*blocks, partial], axis=1)  # [T, N, H]
        keys = values / np.sqrt((values**2).mean(-1, keepdims=True) + self.eps)
        weight = self.p(prefix + "_norm.weight") * self.p(prefix + "_proj.weight")[0]
        probs = softmax((keys * weight).sum(-1))  # [T, N]
        return (probs[:, :, None] * values).sum(1)

    def mla(self, i, h):
        t = self.t
        n, nope, rope, v = (t[k] for k in ("num_attention_heads", "qk_nope_head_dim",
                                            "qk_rope_head_dim", "v_head_dim"))  # fmt: skip
        a = f"layers.{i}.self_attn."
        q_low = rms(
            self.lin(a + "q_a_proj", h), self.p(a + "q_a_layernorm.weight"), LATENT_NORM_EPS
        )
        q = self.lin(a + "q_b_proj", q_low).reshape(len(h), n, nope + rope)
        kv = self.lin(a + "kv_a_proj_with_mqa", h)
        latent, k_rope = kv[:, : t["kv_lora_rank"]], kv[:, t["kv_lora_rank"] :]
        latent = rms(latent, self.p(a + "kv_a_layernorm.weight"), LATENT_NORM_EPS)
        expanded = self.lin(a + "kv_b_proj", latent).reshape(len(h), n, nope + v)
        k = np.concatenate([expanded[..., :nope], np.repeat(k_rope[:, None], n, 1)], -1)
        values = expanded[..., nope:]  # [T, n, v]
        out = np.zeros((len(h), n, v))
        for s in range(len(h)):  # causal: query s sees keys 0..s
            scores = np.einsum("nd,tnd->nt", q[s], k[: s + 1]) * (nope + rope) ** -0.5
            out[s] = np.einsum("nt,tnv->nv", softmax(scores), values[: s + 1])
        out = out.reshape(len(h), n * v) * sigmoid(self.lin(a + "g_proj", h))
        return self.lin(a + "o_proj", out)

    def kda(self, i, h):
        a, n, d, kk = f"layers.{i}.self_attn.", self.heads, self.dk, self.kernel
        streams = []
        for x in "qkv":
            proj = self.lin(a + f"{x}_proj", h)  # [T, n * d]
            taps = self.p(a + f"{x}_conv1d.weight")[:, 0, :]  # [C, kernel]
            conv = np.zeros_like(proj)
            for s in range(len(h)):  # y[s] = sum_j w[j] x[s - (kernel - 1) + j]
                for j in range(kk):
                    src = s - (kk - 1) + j
                    if src >= 0:
                        conv[s] += taps[:, j] * proj[src]
            streams.append((conv * sigmoid(conv)).reshape(len(h), n, d))
        q, k, v = streams
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * d**-0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        f = self.lin(a + "f_b_proj", self.lin(a + "f_a_proj", h)) + self.p(a + "dt_bias")
        rate = np.exp(self.p(a + "A_log")[:n])  # (published padded: the heads' first)
        g = self.bound * sigmoid(rate[None, :, None] * f.reshape(len(h), n, d))
        beta = sigmoid(self.lin(a + "b_proj", h))  # [T, n]
        out = np.zeros((len(h), n, d))
        for head in range(n):
            state = np.zeros((d, d))  # [dk, dv]
            for s in range(len(h)):
                state = np.exp(g[s, head])[:, None] * state
                u = beta[s, head] * (v[s, head] - state.T @ k[s, head])
                state = state + np.outer(k[s, head], u)
                out[s, head] = state.T @ q[s, head]
        gate = sigmoid(self.lin(a + "g_proj", h)).reshape(len(h), n, d)
        out = rms(out, self.p(a + "o_norm.weight"), self.eps) * gate
        return self.lin(a + "o_proj", out.reshape(len(h), n * d))

    def mlp(self, m, h):
        t = self.t
        g, u = self.lin(m + "gate_proj", h), self.lin(m + "up_proj", h)
        beta, linear_beta = t["activation_situ_beta"], t["activation_situ_linear_beta"]
        return self.lin(m + "down_proj", situ(g, u, beta, linear_beta))

    def moe(self, i, h):
        t, m = self.t, f"layers.{i}.block_sparse_moe."
        scores = sigmoid(self.lin(m + "gate", h))  # [T, E]
        choice = scores + self.p(m + "gate.e_score_correction_bias")
        latent = self.lin(m + "routed_expert_down_proj", h)  # [T, L]
        routed = np.zeros_like(latent)
        beta, linear_beta = t["activation_situ_beta"], t["activation_situ_linear_beta"]
        for s in range(len(h)):
            top = np.argsort(-choice[s], kind="stable")[: t["num_experts_per_token"]]
            weights = scores[s, top] / (scores[s, top].sum() + 1e-20) * t["routed_scaling_factor"]
            for e, wt in zip(top, weights, strict=True):
                x = f"{m}experts.{e}."
                gate, up = self.p(x + "w1") @ latent[s], self.p(x + "w3") @ latent[s]
                routed[s] += wt * (self.p(x + "w2") @ situ(gate, up, beta, linear_beta))
        routed = rms(routed, self.p(m + "routed_expert_norm.weight"), self.eps)
        return self.lin(m + "routed_expert_up_proj", routed) + self.mlp(m + "shared_experts.", h)

    def logits(self, ids) -> np.ndarray:
        t, size = self.t, self.t["attn_res_block_size"]
        partial = self.p("embed_tokens.weight")[ids]
        blocks = []
        for i in range(t["num_hidden_layers"]):
            x = (
                self.residual(partial, blocks, f"layers.{i}.self_attention_res")
                if blocks
                else partial
            )
            if i % size == 0:
                blocks.append(partial)
            h = rms(x, self.p(f"layers.{i}.input_layernorm.weight"), self.eps)
            a = self.kda(i, h) if i in self.kda_layers else self.mla(i, h)
            partial = a if i % size == 0 else partial + a
            x = self.residual(partial, blocks, f"layers.{i}.mlp_res")
            h = rms(x, self.p(f"layers.{i}.post_attention_layernorm.weight"), self.eps)
            dense = i < t["first_k_dense_replace"]
            partial = partial + (self.mlp(f"layers.{i}.mlp.", h) if dense else self.moe(i, h))
        x = self.residual(partial, blocks, "output_attn_res")
        x = rms(x, self.p("norm.weight"), self.eps)
        return x @ self.w["language_model.lm_head.weight"].T
