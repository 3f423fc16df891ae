"""Kimi Delta Attention (KDA), the linear attention of Kimi Linear and Kimi K3, in numpy.

One KDA layer keeps, per sequence, a fixed-size state instead of a KV cache: the last
``kernel - 1`` inputs of its short convolution and, per head, a [dk, dv] matrix S.  For each
token x [H] (transformers' kimi_linear `KimiLinearDeltaAttention`, which
`tests/test_kda.py` checks this against):

1. ``q, k, v`` = a causal depthwise convolution (width `kernel`) over the token's and the
   previous tokens' projections ``[Wq x, Wk x, Wv x]``, then SiLU; split into heads of `dk`;
2. q and k L2-normalised per head (``x / sqrt(sum x^2 + 1e-6)``), q scaled by dk^-1/2;
3. the log-decay gate, per head and key channel, from ``f = Wfb Wfa x + dt_bias``: Kimi
   Linear's ``g = -exp(A_log) * softplus(f)``, or with a lower bound (Kimi K3's
   `gate_lower_bound`, -5) ``g = lower_bound * sigmoid(exp(A_log) * f)``, which keeps every
   decay in (exp(lower_bound), 1); the write strength per head: ``beta = sigmoid(Wb x)``;
4. the delta rule: ``S = S * exp(g)`` (row c of S scaled by channel c's decay), then
   ``S = S + k (beta (v - k^T S))^T``; the head's output ``o = q^T S`` [dv];
5. ``o`` RMS-normalised per head (weight `o_norm`), times ``sigmoid(G x)``, then ``Wo`` back
   to H; G is low-rank ``Wgb Wga`` in Kimi Linear, one full-rank ``g_proj`` in Kimi K3.

Everything runs in float32, as transformers does.  Prefill runs the same recurrence token by
token: transformers' chunked form gives the same values (within float rounding), and the
recurrence is what decoding needs anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Projection = Callable[[np.ndarray], np.ndarray]  # x [T, in] -> x @ W.T [T, out]


@dataclass
class KdaWeights:
    """One KDA layer: its projections as callables (the trunk's packed matrices, or
    `matrices` for plain arrays) and its small tensors as float32 arrays."""

    q: Projection  # H -> heads * dk
    k: Projection  # H -> heads * dk
    v: Projection  # H -> heads * dv
    f: Projection  # H -> heads * dk: the forget gate's input (Wfb Wfa: through rank dk)
    b: Projection  # H -> heads
    g: Projection  # H -> heads * dv: the output gate's input (low rank or full)
    o: Projection  # heads * dv -> H
    conv: np.ndarray  # [3 * heads * dk, kernel]: q, k, v channels' taps, oldest first
    dt_bias: np.ndarray  # [heads * dk]
    a_log: np.ndarray  # [heads]
    o_norm: np.ndarray  # [dv]
    heads: int
    eps: float  # o_norm's
    lower_bound: float | None = None  # K3's bounded gate; None: Kimi Linear's softplus gate

    @property
    def head_dim(self) -> int:
        return self.conv.shape[0] // (3 * self.heads)

    @property
    def kernel(self) -> int:
        return self.conv.shape[1]

    @staticmethod
    def matrix(w: np.ndarray) -> Projection:
        """A projection by a float32 [out, in] array."""
        wt = np.ascontiguousarray(w.T)
        return lambda x: x @ wt

    @staticmethod
    def chain(first: Projection, second: Projection) -> Projection:
        """A low-rank projection: `second` after `first`."""
        return lambda x: second(first(x))


@dataclass
class KdaState:
    """A sequence's state in one KDA layer."""

    conv_tail: np.ndarray  # [kernel - 1, 3 * heads * dk]: the previous tokens' projections
    s: np.ndarray  # [heads, dk, dv]

    @classmethod
    def empty(cls, heads: int, head_dim: int, kernel: int) -> KdaState:
        """The state before a sequence's first token (zeros; only the sizes are needed, not
        the layer's weights: a streamed trunk need not be read to make a cache)."""
        tail = np.zeros((kernel - 1, 3 * heads * head_dim), dtype=np.float32)
        return cls(tail, np.zeros((heads, head_dim, head_dim), dtype=np.float32))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(x))).astype(np.float32)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + np.float32(1e-6))


def kda_forward(w: KdaWeights, x: np.ndarray, state: KdaState) -> np.ndarray:
    """x float32 [T, H] (the next T tokens of the sequence) -> [T, H]; updates `state`."""
    t_n = x.shape[0]
    h, d = w.heads, w.head_dim
    x = x.astype(np.float32, copy=False)
    mixed = np.concatenate([w.q(x), w.k(x), w.v(x)], axis=1)  # [T, 3 * h * d]
    window = np.concatenate([state.conv_tail, mixed], axis=0)  # [kernel - 1 + T, 3hd]
    conv = np.zeros_like(mixed)  # [T, 3hd]
    for j in range(w.kernel):  # tap j reads the token kernel - 1 - j back
        conv += window[j : j + t_n] * w.conv[:, j]
    state.conv_tail = window[t_n:].copy()  # the last kernel - 1 projections
    conv = _silu(conv)
    q, k, v = (conv[:, i * h * d : (i + 1) * h * d].reshape(t_n, h, d) for i in range(3))
    q = _l2norm(q) * np.float32(d**-0.5)  # [T, h, d]
    k = _l2norm(k)  # [T, h, d]
    gate_in = (w.f(x) + w.dt_bias).reshape(t_n, h, d)  # [T, h, d]
    rate = np.exp(w.a_log)[None, :, None]  # [1, h, 1]
    if w.lower_bound is None:
        g = -rate * _softplus(gate_in)  # [T, h, d]
    else:
        g = np.float32(w.lower_bound) * _sigmoid(rate * gate_in)  # [T, h, d]
    beta = _sigmoid(w.b(x))  # [T, h]
    out = np.empty((t_n, h, d), dtype=np.float32)  # [T, h, dv]
    s = state.s  # [h, dk, dv]
    for t in range(t_n):
        s = s * np.exp(g[t])[:, :, None]  # decay row c by channel c's gate
        kv = np.einsum("hc,hcv->hv", k[t], s)  # [h, dv]: what S recalls for k
        delta = (v[t] - kv) * beta[t][:, None]  # [h, dv]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hc,hcv->hv", q[t], s)
    state.s = s.astype(np.float32, copy=False)
    variance = (out * out).mean(axis=-1, keepdims=True)  # [T, h, 1]
    normed = out / np.sqrt(variance + np.float32(w.eps)) * w.o_norm
    gate = w.g(x).reshape(t_n, h, d)  # [T, h, dv]
    return w.o(np.ascontiguousarray((normed * _sigmoid(gate)).reshape(t_n, h * d)))  # [T, H]
