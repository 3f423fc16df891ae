"""Building blocks of the dense trunk, in float32 numpy, matching transformers' float32 math.

T = tokens in this forward call, S = tokens in the KV cache (past + current), H = hidden size.
"""

from __future__ import annotations

import numpy as np

from moeshard.moe.experts.backend import ExpertsBase, PrefetchHint


def uses_hints(experts) -> bool:
    """False for a backend whose `prefetch` is `ExpertsBase`'s no-op (in-RAM experts): it has
    nothing to fetch, so the next layer's router need not run for it. A wrapper that forwards
    attribute lookups to its backend answers for that backend."""
    prefetch = getattr(experts, "prefetch", None)
    return getattr(prefetch, "__func__", None) is not ExpertsBase.prefetch


def next_layer_hint(transformer, layer: int, h: np.ndarray) -> PrefetchHint | None:
    """Next-layer prefetch: the next MoE layer's router applied to the current hidden state
    h [T, H] predicts its experts; the experts backend starts fetching them once this layer's
    own reads are under way. None when `layer` is the last MoE layer.

    Each row of the prediction is ordered best first: the router's top few picks survive the
    layer in between far more often than its last ones (k3-mini: 99% of the top 8 of 16 are
    used, 87% of all 16), so a backend can fetch only each token's best few.

    None as well for a backend that does nothing with hints (`uses_hints`)."""
    later = [j for j in transformer.config.moe_layers if j > layer]
    if not later or not uses_hints(transformer.experts):
        return None
    predicted, _ = transformer.route(later[0], h)  # [T, k], highest score first
    return PrefetchHint(later[0], predicted)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * weight, over the last axis."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)  # [..., 1]
    normed = x / np.sqrt(variance + np.float32(eps))  # [..., D]
    return (weight * normed).astype(np.float32, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32, copy=False)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for x below -88: the sigmoid is 0
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32, copy=False)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(np.float32, copy=False)


def rope_cos_sin(
    positions: np.ndarray, inv_freq: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, dim/2] for absolute positions [T] (times yarn's attention factor)."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    return (np.cos(freqs) * np.float32(scale)).astype(np.float32), (
        np.sin(freqs) * np.float32(scale)
    ).astype(np.float32)


def rope_per_sequence(seq, inv_freq: np.ndarray, scale: float) -> list[tuple]:
    """cos, sin [T_s, dim/2] for each sequence of `seq` (`Segments`) at its own positions."""
    return [
        rope_cos_sin(np.arange(cache.length, cache.length + len(ids)), inv_freq, scale)
        for ids, cache in seq.batch
    ]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """Rotate x [T, heads, dim] by per-position angles (cos/sin [T, dim/2]).

    Non-interleaved (Llama/Qwen): pairs are (i, i + dim/2). Interleaved (DeepSeek): pairs are
    (2i, 2i+1), and, as in transformers, the output is de-interleaved: [rotated evens, rotated
    odds]. Queries and keys go through the same permutation, so attention scores are unchanged.
    """
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, dim/2]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, heads, dim/2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # [T, heads, dim/2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def apply_partial_rope(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool
) -> np.ndarray:
    """`apply_rope` on the first rot = 2 * cos.shape[-1] dims of each head of x [T, heads,
    dim]; the other dims pass unchanged (transformers' partial_rotary_factor: GLM-4.5 turns
    the first half of each head)."""
    rot = 2 * cos.shape[-1]
    turned = apply_rope(x[..., :rot], cos, sin, interleave)  # [T, heads, rot]
    return np.concatenate([turned, x[..., rot:]], axis=-1).astype(np.float32)


def causal_mask(t: int, s: int, window: int | None = None) -> np.ndarray:
    """Additive mask [t, s]: query i (absolute position s - t + i) sees keys 0 .. s - t + i,
    and with a sliding window only the last `window` of them (as transformers: q - k < window)."""
    q_pos = np.arange(s - t, s)[:, None]  # [t, 1]
    k_pos = np.arange(s)[None, :]  # [1, s]
    visible = k_pos <= q_pos  # [t, s]
    if window:
        visible &= q_pos - k_pos < window
    return np.where(visible, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scaling: float, window: int | None = None
) -> np.ndarray:
    """Causal softmax attention. q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [T, Hq, Dv].

    Grouped-query attention: query head h reads kv head h // (Hq / Hkv).
    """
    t, n_q = q.shape[0], q.shape[1]
    s, n_kv = k.shape[0], k.shape[1]
    group = n_q // n_kv
    qg = q.reshape(t, n_kv, group, q.shape[2]).transpose(1, 2, 0, 3)  # [Hkv, g, T, D]
    kt = k.transpose(1, 2, 0)[:, None]  # [Hkv, 1, D, S]
    scores = np.matmul(qg, kt) * np.float32(scaling)  # [Hkv, g, T, S]
    probs = softmax(scores + causal_mask(t, s, window))  # [Hkv, g, T, S]
    out = np.matmul(probs, v.transpose(1, 0, 2)[:, None])  # [Hkv, g, T, Dv]
    return out.transpose(2, 0, 1, 3).reshape(t, n_q, v.shape[2])  # [T, Hq, Dv]


def swiglu_mlp(x: np.ndarray, gate, up, down) -> np.ndarray:
    """down(silu(gate(x)) * up(x)) for Linear callables: x [T, H] -> [T, H]."""
    return down(silu(gate(x)) * up(x))


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, highest first; ties go to the lower index.

    scores [T, E] -> [T, k]. A stable descending sort matches torch.topk on distinct values.
    """
    order = np.argsort(-scores, axis=-1, kind="stable")  # [T, E]
    return order[:, :k]


class Segments:
    """Several sequences' rows stacked for one batched pass (continuous batching): sequence
    s is rows bounds[s]:bounds[s + 1] of every [N, ...] array, with its own cache."""

    def __init__(self, batch):
        self.batch = list(batch)  # (ids [T_s], cache) per sequence
        for ids, cache in self.batch:
            if cache.length + len(ids) > cache.max_len:
                raise ValueError(
                    f"{cache.length + len(ids)} positions do not fit a cache of {cache.max_len}"
                )
        if len(self.batch) == 1:  # (a decode step of one sequence: a few us less)
            ids = self.batch[0][0]
            self.bounds = np.array([0, len(ids)], dtype=np.int64)
            self.ids = np.array(ids, dtype=np.int64).reshape(-1)  # (a copy, as concatenate's)
            return
        self.bounds = np.cumsum([0] + [len(ids) for ids, _ in self.batch]).astype(np.int64)
        self.ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in self.batch])

    def __len__(self) -> int:
        return len(self.batch)

    def rows(self, s: int) -> slice:
        return slice(int(self.bounds[s]), int(self.bounds[s + 1]))

    def caches(self):
        return [cache for _, cache in self.batch]

    def each(self, h: np.ndarray, fn) -> np.ndarray:
        """fn(s, rows of h, cache) -> [T_s, ...] for each sequence, stacked back: [N, ...]."""
        if len(self.batch) == 1:
            return fn(0, h, self.batch[0][1])
        parts = [fn(s, h[self.rows(s)], cache) for s, (_, cache) in enumerate(self.batch)]
        return np.concatenate(parts, axis=0)

    def advance(self) -> None:
        """Every cache has taken its sequence's rows."""
        for ids, cache in self.batch:
            cache.length += len(ids)

    def split(self, out: np.ndarray) -> list[np.ndarray]:
        return [out[self.rows(s)] for s in range(len(self.batch))]

    def logits(self, x: np.ndarray, head, last_only: bool = False) -> list[np.ndarray]:
        """The LM head over the final hidden states x [N, H]: every row's logits ([T_s, V]
        each), or (last_only) each sequence's last row's alone ([1, V] each, the same bits:
        all a sampler reads; a prompt's other rows would cost the head for nothing, and the
        head of a large vocabulary costs more than a layer)."""
        if not last_only:
            return self.split(head(x))
        last = np.ascontiguousarray(x[self.bounds[1:] - 1])  # [B, H]
        out = head(last)  # [B, V]
        return [out[s : s + 1] for s in range(len(self.batch))]
