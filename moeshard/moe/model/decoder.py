"""The batched pass of a pre-norm decoder, shared by every family of that shape (Qwen-MoE,
Mixtral, OLMoE, DeepSeek-V3 / Kimi-K2, Kimi Linear; Kimi K3's attention residuals are a shape
of their own): embed; per layer RMSNorm, the family's token mixer (attention, MLA, KDA), the
residual add and RMSNorm fused into one kernel, the family's MLP or experts; the final norm and
the head on the rows that are sampled from.

The residual stream stays in one float32 array updated in place: each block's output is added
by the next norm (`fused.add_rms_norm`), so no [N, H] temporary is made per add. Every kernel
computes a row the same way whatever other rows are in the call, so a sequence's logits are the
same bits alone or batched (tests/test_batching.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moeshard.moe.model.fused import add_rms_norm, rms_norm_rows
from moeshard.moe.model.layers import Segments

Block = Callable[[int, np.ndarray], np.ndarray]  # (layer, h [N, H]) -> output [N, H]


def prenorm_forward_batch(
    model,
    seq: Segments,
    mix: Block,
    mlp: Block,
    norms: Callable[[int], tuple[np.ndarray, np.ndarray]],
    head: str,
    last_only: bool,
    fused: Callable[[int, np.ndarray, np.ndarray | None], np.ndarray | None] | None = None,
    final_norm: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Every sequence of `seq` through `model`'s trunk: `mix(i, h)` and `mlp(i, h)` are layer
    i's token mixer and MLP over all N rows, `norms(i)` its (input, post-attention) norm
    weights, `head` the output matrix's name. -> each sequence's logits [T_s, V] (last_only:
    its last row's, [1, V]); the caches advanced.  `fused(i, x, delta)`, if given, may run
    layer i, and the layers after it, in fewer calls (the same bits): x += delta, the layers
    on x (in place) -> (the last one's MLP output, the next delta; the next layer to run);
    None where it does not apply (then the steps run).  `enter_layer` is called for the
    layer a call starts at: a model whose trunk streams takes one layer per call.
    `final_norm`: the final norm's weight when it is not model.norm.weight as stored (Qwen3-Next
    stores 1 + w as w)."""
    c, w = model.config, model.trunk
    eps = c.rms_norm_eps
    x = w.embed("model.embed_tokens.weight", seq.ids)  # [N, H], the residual, in place
    delta = None  # the last block's output, added to x by the next norm
    i = 0
    while i < c.num_hidden_layers:
        w.enter_layer(i)  # a streamed trunk makes layer i resident and starts reading i + 1
        done = fused(i, x, delta) if fused is not None else None
        if done is not None:
            delta, i = done
            continue
        before, after = norms(i)
        h = _add_norm(x, delta, before, eps)  # x += delta; h = norm(x)  [N, H]
        h = _add_norm(x, mix(i, h), after, eps)  # [N, H]
        delta = mlp(i, h)  # [N, H]
        i += 1
    seq.advance()
    if final_norm is None:
        final_norm = w.vector("model.norm.weight")
    h = _add_norm(x, delta, final_norm, eps)  # [N, H]
    return seq.logits(h, w.linear(head), last_only)  # [T_s, V] (or [1, V]) each


def norm_rows(x: np.ndarray, weight, eps: float) -> np.ndarray:
    """RMSNorm of every row of x [N, H] float32 with `weight` [H], by the fused kernel."""
    return _add_norm(np.ascontiguousarray(x, dtype=np.float32), None, weight, eps)


def _add_norm(x: np.ndarray, delta: np.ndarray | None, weight, eps: float) -> np.ndarray:
    """x += delta (when there is one), then RMSNorm(x) with `weight`: [N, H] float32."""
    out = np.empty_like(x)  # [N, H]
    if delta is None:
        rms_norm_rows(x, weight, eps, out)
    else:
        delta = np.ascontiguousarray(delta, dtype=np.float32)  # (no copy when it is already)
        add_rms_norm(x, delta, weight, eps, out)
    return out
