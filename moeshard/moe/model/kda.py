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

Qwen3-Next's and Qwen3.5's Gated DeltaNet (`moeshard.moe.model.qwen3_next`) is the same layer
with one decay per head instead of one per key channel (g [T, h, 1]: every row of S decays
alike), grouped value heads, a SiLU output gate and its own projections; it shares the
convolution (`causal_conv`), the recurrence (`delta_rule`), the gated norm (`gated_rms_norm`),
the state (`KdaState`) and its rollback (`RecurrentStates`) with KDA.

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
    """A sequence's state in one delta-rule layer (KDA, or Gated DeltaNet: `zeros`)."""

    conv_tail: np.ndarray  # [kernel - 1, channels]: the previous tokens' projections
    s: np.ndarray  # [heads, dk, dv]

    @classmethod
    def empty(cls, heads: int, head_dim: int, kernel: int) -> KdaState:
        """A KDA layer's state before a sequence's first token (zeros; only the sizes are
        needed, not the layer's weights: a streamed trunk need not be read to make a cache)."""
        return cls.zeros(3 * heads * head_dim, kernel, heads, head_dim, head_dim)

    @classmethod
    def zeros(cls, channels: int, kernel: int, heads: int, dk: int, dv: int) -> KdaState:
        """The zero state of a layer convolving `channels` projections, with `heads` [dk, dv]
        matrices."""
        tail = np.zeros((kernel - 1, channels), dtype=np.float32)
        return cls(tail, np.zeros((heads, dk, dv), dtype=np.float32))

    def copy(self) -> KdaState:
        return KdaState(self.conv_tail.copy(), self.s.copy())


class RecurrentStates:
    """The delta-rule layers' states of one sequence's cache (`states`: layer -> KdaState),
    for a cache that also holds attention layers' rows (Kimi Linear's, Qwen3-Next's).

    A recurrent state cannot be cut back like a KV cache.  When rollbacks may come (a network
    run whose nodes are audited: `keep_rollback`), the cache keeps a copy of the states at the
    start of each of the last `rollback_steps` forward calls, and `truncate` goes back to any
    of those lengths; otherwise, and further back, it refuses.  (Each copy costs the config's
    `state_bytes`; the RAM plan counts them.)"""

    def __init__(self, states: dict[int, KdaState], max_len: int):
        self.states = states
        self.length = 0
        self.max_len = max_len
        self.rollback_steps = 0
        self._snapshots: list[tuple[int, dict[int, KdaState]]] = []

    def keep_rollback(self, steps: int) -> None:
        """Keep the states of the last `steps` step starts, for `truncate`."""
        self.rollback_steps = steps

    def snapshot(self) -> None:
        """Keep the states at the current length (called at the start of a forward)."""
        if not self.rollback_steps:
            return
        copies = {i: s.copy() for i, s in self.states.items()}
        self._snapshots = [(n, s) for n, s in self._snapshots if n < self.length]
        self._snapshots = (self._snapshots + [(self.length, copies)])[-self.rollback_steps :]

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a rollback: they are computed again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if length == self.length:
            return
        kept = dict(self._snapshots).get(length)
        if kept is None:
            raise ValueError(
                f"cannot roll a recurrent state back to {length} positions: only the "
                f"starts of the last {self.rollback_steps} steps are kept"
            )
        self.states = {i: s.copy() for i, s in kept.items()}
        self._snapshots = [(n, s) for n, s in self._snapshots if n <= length]
        self.length = length


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(x))).astype(np.float32)


def l2norm(x: np.ndarray) -> np.ndarray:
    """x scaled to unit length over its last axis (1e-6 under the root, as fla does)."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + np.float32(1e-6))


def causal_conv(mixed: np.ndarray, taps: np.ndarray, state: KdaState) -> np.ndarray:
    """The short convolution: mixed [T, C] (this call's projections) -> SiLU of a causal
    depthwise convolution (taps [C, kernel], oldest first) over them and the previous
    kernel - 1 tokens' [T, C]; updates `state.conv_tail`."""
    t_n = mixed.shape[0]
    window = np.concatenate([state.conv_tail, mixed], axis=0)  # [kernel - 1 + T, C]
    conv = np.zeros_like(mixed)  # [T, C]
    for j in range(taps.shape[1]):  # tap j reads the token kernel - 1 - j back
        conv += window[j : j + t_n] * taps[:, j]
    state.conv_tail = window[t_n:].copy()  # the last kernel - 1 projections
    return silu(conv)


def delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: KdaState
) -> np.ndarray:
    """The gated delta rule, token by token, on `state.s` [h, dk, dv] (updated).

    q, k [T, h, dk] (normalised; q scaled), v [T, h, dv], beta [T, h]; g [T, h, dk] the
    log-decay per key channel (KDA) or [T, h, 1] one per head (Gated DeltaNet: the same
    recurrence with every row of S decayed alike).  -> o [T, h, dv]."""
    t_n, h, dv = v.shape
    out = np.empty((t_n, h, dv), dtype=np.float32)  # [T, h, dv]
    s = state.s  # [h, dk, dv]
    for t in range(t_n):
        s = s * np.exp(g[t])[:, :, None]  # decay row c by channel c's gate (or the head's)
        kv = np.einsum("hc,hcv->hv", k[t], s)  # [h, dv]: what S recalls for k
        delta = (v[t] - kv) * beta[t][:, None]  # [h, dv]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hc,hcv->hv", q[t], s)
    state.s = s.astype(np.float32, copy=False)
    return out


def gated_rms_norm(o: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
    """o [T, h, dv] RMS-normalised per head, times `weight` [dv] and the activated gate
    [T, h, dv]."""
    variance = (o * o).mean(axis=-1, keepdims=True)  # [T, h, 1]
    return o / np.sqrt(variance + np.float32(eps)) * weight * gate  # [T, h, dv]


def kda_forward(w: KdaWeights, x: np.ndarray, state: KdaState) -> np.ndarray:
    """x float32 [T, H] (the next T tokens of the sequence) -> [T, H]; updates `state`."""
    t_n = x.shape[0]
    h, d = w.heads, w.head_dim
    x = x.astype(np.float32, copy=False)
    mixed = np.concatenate([w.q(x), w.k(x), w.v(x)], axis=1)  # [T, 3 * h * d]
    conv = causal_conv(mixed, w.conv, state)  # [T, 3hd]
    q, k, v = (conv[:, i * h * d : (i + 1) * h * d].reshape(t_n, h, d) for i in range(3))
    q = l2norm(q) * np.float32(d**-0.5)  # [T, h, d]
    k = l2norm(k)  # [T, h, d]
    gate_in = (w.f(x) + w.dt_bias).reshape(t_n, h, d)  # [T, h, d]
    rate = np.exp(w.a_log)[None, :, None]  # [1, h, 1]
    if w.lower_bound is None:
        g = -rate * softplus(gate_in)  # [T, h, d]
    else:
        g = np.float32(w.lower_bound) * sigmoid(rate * gate_in)  # [T, h, d]
    beta = sigmoid(w.b(x))  # [T, h]
    out = delta_rule(q, k, v, g, beta, state)  # [T, h, dv]
    gate = sigmoid(w.g(x).reshape(t_n, h, d))  # [T, h, dv]
    normed = gated_rms_norm(out, w.o_norm, gate, w.eps)  # [T, h, dv]
    return w.o(np.ascontiguousarray(normed.reshape(t_n, h * d)))  # [T, H]
