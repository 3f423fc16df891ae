"""The trunk's fused numba kernels (moe/model/fused.py) against their numpy twins in
moe/model/layers.py: RMSNorm and RoPE to the bit, attention and the router within float32
rounding (ties in router scores to the lower expert id, exactly)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from moeshard.moe.kernels import fixedmath
from moeshard.moe.model import fused
from moeshard.moe.model.layers import (
    apply_partial_rope,
    apply_rope,
    attend,
    rms_norm,
    rope_cos_sin,
    softmax,
    top_k_indices,
)

RNG = np.random.default_rng(17)


NO_SINKS = np.zeros(0, np.float32)  # attention without gpt-oss's sinks


def randn(*shape, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def cos_sin(start: int, t: int, dim: int, scale: float = 1.0):
    inv_freq = (10000.0 ** -(np.arange(0, dim, 2) / dim)).astype(np.float32)  # [dim/2]
    return rope_cos_sin(np.arange(start, start + t), inv_freq, scale)  # [T, dim/2] each


@pytest.mark.parametrize("d", [5, 8, 64, 100, 128, 256, 1000, 2048, 7168])
def test_rms_norm_is_bit_identical(d):
    x, w = randn(3, d, scale=3.0), randn(d)
    out = np.empty_like(x)
    fused.rms_norm_rows(x, w, 1e-6, out)
    np.testing.assert_array_equal(out, rms_norm(x, w, 1e-6))
    want = rms_norm(x, w, 1e-5)
    fused.rms_norm_rows(x, w, 1e-5, x)  # in place
    np.testing.assert_array_equal(x, want)


def test_rms_norm_per_head():
    t, heads, d = 4, 6, 64
    q, w = randn(t, heads * d, scale=2.0), randn(d)  # heads packed in rows
    want = rms_norm(q.reshape(t, heads, d), w, 1e-6)  # [T, heads, D]: per head
    fused.rms_norm_rows(q, w, 1e-6, q)
    np.testing.assert_array_equal(q.reshape(t, heads, d), want)


@pytest.mark.parametrize("t,h", [(1, 256), (5, 1024)])
def test_add_rms_norm_adds_the_residual(t, h):
    x, delta, w = randn(t, h), randn(t, h, scale=0.3), randn(h)
    want_x = x + delta
    want = rms_norm(want_x, w, 1e-6)
    out = np.empty_like(x)
    fused.add_rms_norm(x, delta, w, 1e-6, out)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("t,heads,dim,start", [(1, 4, 64, 0), (3, 2, 128, 41), (7, 1, 16, 5)])
def test_rope_in_place_is_bit_identical(interleave, t, heads, dim, start):
    x = randn(t, heads, dim)
    cos, sin = cos_sin(start, t, dim, scale=1.1)
    want = apply_rope(x, cos, sin, interleave)
    fused.rope_inplace(x.reshape(t, heads * dim), dim, cos, sin, interleave)
    np.testing.assert_array_equal(x, want)


ATTENTION_CASES = [
    # T, start, Hq, Hkv, D, window
    (1, 0, 4, 2, 64, None),
    (1, 37, 8, 2, 128, None),  # decode: one query against the cache
    (5, 0, 4, 4, 16, None),  # prefill, no grouping
    (6, 9, 6, 1, 32, None),  # multi-query
    (4, 11, 4, 2, 16, 3),  # sliding window smaller than the new tokens
    (1, 20, 4, 2, 16, 8),  # decode with a window
    (9, 0, 2, 1, 8, 4),  # prefill with a window
]


@pytest.mark.parametrize("t,start,hq,hkv,d,window", ATTENTION_CASES)
def test_attend_cache_matches_attend(t, start, hq, hkv, d, window):
    s = start + t
    q, k, v = randn(t, hq, d), randn(s + 3, hkv, d), randn(s + 3, hkv, d)  # unused tail
    k[s:] = np.nan  # positions past the queries' must not be read
    v[s:] = np.nan
    out = np.empty((t, hq * d), np.float32)
    fused.attend_cache(q.reshape(t, hq * d), k, v, start, d**-0.5, window or 0, NO_SINKS, out)
    want = attend(q, k[:s], v[:s], d**-0.5, window).reshape(t, hq * d)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("t,start,hq,hkv,d,window", ATTENTION_CASES + [(1, 70, 8, 2, 128, 0)])
def test_attention_split_by_heads_gives_the_same_bits(t, start, hq, hkv, d, window, sinks):
    """`attend_cache_parallel` (a prefill, a long context) and `attend_pair` (a decode layer's
    heads split in `fused_layer.decode_layers`) give each (query, head) pair exactly the
    bits `attend_cache` gives it."""
    s = start + t
    q, kc, vc = randn(t, hq * d), randn(s, hkv, d), randn(s, hkv, d)
    heads_sinks = randn(hq, scale=2.0) if sinks else NO_SINKS  # [Hq] or none
    want, split = np.empty((t, hq * d), np.float32), np.empty((t, hq * d), np.float32)
    fused.attend_cache(q, kc, vc, start, d**-0.5, window or 0, heads_sinks, want)
    fused.attend_cache_parallel(q, kc, vc, start, d**-0.5, window or 0, heads_sinks, split)
    np.testing.assert_array_equal(split, want)
    one = np.full((t, hq * d), np.nan, np.float32)
    for pair in reversed(range(t * hq)):  # each pair on its own, in any order
        fused.attend_pair(q, kc, vc, start, d**-0.5, window or 0, heads_sinks, one, pair)
    np.testing.assert_array_equal(one, want)


@pytest.mark.parametrize("t,start,window", [(1, 0, 0), (5, 3, 0), (4, 40, 8), (1, 200, 128)])
def test_attention_sinks_take_their_share_of_the_softmax(t, start, window):
    """gpt-oss: each head's sink is one more logit in the softmax, with no value (as
    transformers' eager attention: softmax over [scores, sink], the sink's column dropped)."""
    hq, hkv, d = 4, 2, 64
    s = start + t
    q, k, v = randn(t, hq, d), randn(s, hkv, d), randn(s, hkv, d)
    sinks = np.array([-1.0, 0.5, 3.0, 8.0], np.float32)  # [Hq]: up to most of the weight
    out = np.empty((t, hq * d), np.float32)
    fused.attend_cache(q.reshape(t, hq * d), k, v, start, d**-0.125, window, sinks, out)
    kk, vv = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)  # [S, Hq, D]
    scores = np.einsum("thd,shd->hts", q, kk).astype(np.float64) * d**-0.125  # [Hq, T, S]
    pos = start + np.arange(t)[:, None]  # [T, 1]
    keys = np.arange(s)[None, :]  # [1, S]
    seen = (keys <= pos) & ((pos - keys < window) if window else True)  # [T, S]
    scores = np.where(seen, scores, -np.inf)
    logits = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (hq, t, 1))], -1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = probs[..., :-1] / probs.sum(-1, keepdims=True)  # [Hq, T, S]: the sink dropped
    want = np.einsum("hts,shd->thd", probs, vv).reshape(t, hq * d)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
    plain = np.empty_like(out)
    fused.attend_cache(q.reshape(t, hq * d), k, v, start, d**-0.125, window, NO_SINKS, plain)
    assert np.abs(plain - out).max() > 1e-3  # the sinks changed the result


@njit
def attend_position_by_position(q, kc, vc, start, scale, window, out):
    """`attend_cache`'s arithmetic one key position at a time (`_dot`, `_add_scaled`): the
    order every score and output element must keep when positions go four at a time."""
    n_kv, d, dv = kc.shape[1], kc.shape[2], vc.shape[2]
    n_q = q.shape[1] // d
    scores = np.empty(start + q.shape[0], dtype=np.float32)
    for t in range(q.shape[0]):
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0
        for h in range(n_q):
            kv = h // (n_q // n_kv)
            best = np.float32(-np.inf)
            for s in range(lo, pos + 1):
                scores[s] = fused._dot(q[t], h * d, kc, s, kv, d) * np.float32(scale)
                best = max(best, scores[s])
            lanes = np.zeros(4)  # [4]: the softmax's sum, position lo + j in lane j mod 4
            n = pos + 1 - lo
            for s in range(lo, pos + 1):
                scores[s] = np.float32(fixedmath.exp(np.float64(scores[s] - best)))
                if s - lo < n - n % 4:
                    lanes[(s - lo) % 4] += scores[s]
            total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
            for s in range(lo + n - n % 4, pos + 1):
                total += scores[s]
            out[t, h * dv : (h + 1) * dv] = 0.0
            for s in range(lo, pos + 1):
                fused._add_scaled(out[t], h * dv, np.float32(scores[s] / total), vc, s, kv, dv)


@pytest.mark.parametrize(
    "t,start,d,window",
    [(1, 0, 64, 0), (1, 2, 64, 0), (1, 36, 64, 0), (1, 38, 128, 0), (1, 41, 40, 0),
     (7, 5, 64, 0), (6, 3, 128, 5), (3, 17, 24, 6), (1, 200, 64, 13)],
)  # fmt: skip
def test_attend_cache_keeps_the_one_position_order(t, start, d, window):
    """Head sizes 64 and 128 run a kernel compiled for them, others the general one; keys go
    four at a time and the rest (0-3) one at a time: the same bits as one at a time."""
    hq, hkv, s = 4, 2, start + t
    q, kc, vc = randn(t, hq * d), randn(s, hkv, d), randn(s, hkv, d)
    out, want = np.empty((t, hq * d), np.float32), np.empty((t, hq * d), np.float32)
    fused.attend_cache(q, kc, vc, start, d**-0.5, window, NO_SINKS, out)
    attend_position_by_position(q, kc, vc, start, d**-0.5, window, want)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize("clip", [0.0, 0.7])
def test_gqa_attention_matches_the_numpy_steps(qk_norm, clip):
    t, start, hq, hkv, d, eps, window = 3, 4, 4, 2, 16, 1e-6, 0
    q, k, v = randn(t, hq * d), randn(t, hkv * d), randn(t, hkv * d)
    kc, vc = randn(start + t + 2, hkv, d), randn(start + t + 2, hkv, d)  # [S, Hkv, D]
    qw = randn(d if qk_norm == "head" else hq * d)
    kw = randn(d if qk_norm == "head" else hkv * d)
    cos, sin = cos_sin(start, t, d)
    # the numpy steps, as the family file did them before the fused kernel
    rq, rk, rv = q.copy(), k.copy(), v.copy()
    if qk_norm == "full":
        rq, rk = rms_norm(rq, qw, eps), rms_norm(rk, kw, eps)
    if clip:
        rq, rk, rv = (np.clip(z, -clip, clip) for z in (rq, rk, rv))
    rq, rk, rv = rq.reshape(t, hq, d), rk.reshape(t, hkv, d), rv.reshape(t, hkv, d)
    if qk_norm == "head":
        rq, rk = rms_norm(rq, qw, eps), rms_norm(rk, kw, eps)
    rq, rk = apply_rope(rq, cos, sin, False), apply_rope(rk, cos, sin, False)
    rkc, rvc = kc.copy(), vc.copy()
    rkc[start : start + t], rvc[start : start + t] = rk, rv
    want = attend(rq, rkc[: start + t], rvc[: start + t], d**-0.5, None).reshape(t, hq * d)

    out = np.empty((t, hq * d), np.float32)
    code = fused.QK_NORM_CODES[qk_norm]
    if qk_norm == "none":
        qw = kw = np.zeros(0, np.float32)
    fused.gqa_attention(
        q, k, v, qw, kw, code, eps, clip, cos, sin, kc, vc, start, d**-0.5, window, NO_SINKS, out
    )
    np.testing.assert_array_equal(kc, rkc)  # the new keys and values, and nothing else
    np.testing.assert_array_equal(vc, rvc)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def route_reference(logits: np.ndarray, k: int, renorm: bool):
    """Transformer.route's numpy steps (softmax, stable top-k, optional renormalisation)."""
    probs = softmax(logits)  # [T, E]
    ids = top_k_indices(probs, k)  # [T, k]
    weights = np.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if renorm:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


@pytest.mark.parametrize("t,e,k", [(1, 32, 4), (5, 64, 8), (3, 128, 2), (2, 8, 8)])
@pytest.mark.parametrize("renorm", [False, True])
def test_router_matches_numpy(t, e, k, renorm):
    logits = randn(t, e, scale=2.0)
    ids, weights = fused.route_softmax_topk(logits, k, renorm)
    want_ids, want_weights = route_reference(logits, k, renorm)
    assert ids.dtype == np.int64 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("renorm", [False, True])
def test_router_ties_go_to_the_lower_expert(renorm):
    # scores from a handful of values: every row has ties inside and across the top k
    logits = RNG.integers(-2, 3, size=(64, 32)).astype(np.float32)
    logits[0] = 1.0  # all equal: experts 0..k-1
    ids, weights = fused.route_softmax_topk(logits, 6, renorm)
    want_ids, want_weights = route_reference(logits, 6, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(ids[0], np.arange(6))
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("t,heads,dim,rot,start", [(1, 4, 16, 8, 0), (3, 2, 128, 64, 41)])
def test_partial_rope_turns_only_the_first_dims(t, heads, dim, rot, start):
    """GLM-4.5's partial_rotary_factor 0.5: cos/sin narrower than the head turn its first
    rot dims (pairs i, i + rot/2), to the bit, and leave the rest alone."""
    x = randn(t, heads, dim)
    cos, sin = cos_sin(start, t, rot, scale=1.1)  # [T, rot/2]
    want = apply_partial_rope(x, cos, sin, False)
    np.testing.assert_array_equal(want[..., rot:], x[..., rot:])
    np.testing.assert_array_equal(want[..., :rot], apply_rope(x[..., :rot], cos, sin, False))
    fused.rope_inplace(x.reshape(t, heads * dim), dim, cos, sin, False)
    np.testing.assert_array_equal(x, want)
