"""Several new rows of one sequence (a prompt's prefill) through a GQA model's layers, in one
kernel call: `decode_layers`' counterpart for T rows.

Step by step, a layer of a 100-token prefill is about a dozen kernel calls with Python
between them, and half of them ran on the calling thread while the pool's other threads
waited: the residual adds and norms, RoPE and the cache writes, the router's top-k, the
grouping of rows by expert and their weighted sum.  On the embedded demo model those serial
parts and the Python were about a fifth of the prefill (perf: the pool's threads spun in
libgomp for 22% of the samples).  Here every one of them is split across the threads, by
rows, and the whole run of layers is one call.

Each row gets the bits the step-by-step path gives it (tests/test_fused_prefill.py): every
part runs the same serial kernel on the same inputs, only over other rows at a time, and
each of those kernels computes a row the same way whatever other rows are in its call.  The
products are split by weight rows as `entry.matmul_group_kernel` and `matmul_kernel` split
them, the router's by activation rows; the attention's (query, head) pairs as
`fused.attend_cache_parallel` folds them; the experts dealt by their rows as
`entry.experts_rows_kernel` deals them; and each row's weighted sum is added in float64 in
ascending expert order, as `entry.accumulate_rows` adds it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from moeshard.moe.kernels.entry import (
    ROWS_PER_ITEM,
    _activations,
    _deal,
    _experts_share,
    _group_item,
    _group_items,
    _group_out,
    _group_rows,
    _item,
    _matrix_views,
    _rows,
    group_by_expert,
)
from moeshard.moe.model.fused import (
    add_rms_norm,
    attend_pair,
    gqa_prepare,
    rms_norm_rows,
    route_softmax_topk,
)


@njit(cache=True, nogil=True, parallel=True)
def prefill_layers(
    layers, kcs, vcs, first, last, x, delta, has_delta, consts, cos, sin, start, shares
):
    """T new rows of one sequence through layers[first:last] of a numba typed list of
    `fused_layer.layer_entry`s (KV caches kcs[i], vcs[i] [S, Hkv, D], filled to `start`;
    the rows go to start..start+T-1), each layer as the step-by-step path computes it, in
    `shares` parts (the threads the call runs on): x += delta (if has_delta); h = norm(x);
    q, k, v; RoPE and the cache writes; attention; x += o_proj; h2 = norm(x); the router's
    top-k; the routed experts' weighted sum, the next delta.  x [T, H] float32 is updated
    in place; cos, sin [T, D/2] are the rows' RoPE angles; `consts` as `decode_layers`'.

    -> (stop, h2 [T, H], ids [T, k], weights [T, k], delta [T, H]): stop == last and the
    last layer's experts' output; or stop < last, the layer one of whose routed experts is
    not in its arena (`table[e]` -1), with its h2, ids and weights, for the caller to run
    them through the experts backend and go on from stop + 1."""
    eps, int8, lut, qk_norm, clip, scaling, top_k, renorm = consts
    no_sinks = np.empty(0, dtype=np.float32)  # (a layer with sinks has no plan: `FusedPlan`)
    t, hidden = x.shape
    parts = max(1, min(shares, t))  # contiguous runs of rows, one a thread
    h = np.empty_like(x)  # [T, H]
    h2 = np.empty_like(x)  # [T, H]
    ids = np.empty((t, top_k), dtype=np.int64)  # [T, k]
    weights = np.empty((t, top_k), dtype=np.float32)  # [T, k]
    for i in range(first, last):
        table, arena, experts, in_norm, post_norm, qkv, q_norm, k_norm = layers[i][:8]
        window, o, gate = layers[i][8:]
        kc, vc = kcs[i], vcs[i]  # [S, Hkv, D] each
        for it in prange(parts):
            r0, r1 = _part(t, parts, np.int64(it))  # (prange counts in uint64)
            if has_delta:
                add_rms_norm(x[r0:r1], delta[r0:r1], in_norm, eps, h[r0:r1])
            else:
                rms_norm_rows(x[r0:r1], in_norm, eps, h[r0:r1])
        fmt, datas, rows, cols, row_bytes, scale_offs = qkv
        flat = np.empty(t * _group_rows(rows), dtype=np.float32)  # [T * sum(rows)]
        act = _activations(fmt, int8, h)
        for it in prange(_group_items(rows)):
            m, r0, r1 = _group_item(rows, np.int64(it))
            wq, ws = _matrix_views(fmt, datas[m], rows[m], cols, row_bytes[m], scale_offs[m])
            _rows(fmt, wq, ws, lut, h, act, _group_out(flat, rows, m, t), r0, r1)
        q = _group_out(flat, rows, 0, t)  # [T, Hq*D]
        k = _group_out(flat, rows, 1, t)  # [T, Hkv*D]
        v = _group_out(flat, rows, 2, t)  # [T, Hkv*D]
        for it in prange(parts):
            r0, r1 = _part(t, parts, np.int64(it))
            gqa_prepare(
                q[r0:r1], k[r0:r1], v[r0:r1], q_norm, k_norm, qk_norm, eps, clip, cos[r0:r1],
                sin[r0:r1], kc, vc, start + r0,
            )  # fmt: skip
        att = np.empty_like(q)  # [T, Hq*D]
        n = t * (q.shape[1] // kc.shape[2])  # (query, head) pairs
        for it in prange(n):
            j = np.int64(it)
            pair = j // 2 if j % 2 == 0 else n - 1 - j // 2  # (`attend_cache_parallel`'s fold)
            attend_pair(q, kc, vc, start, scaling, window, no_sinks, att, pair)
        fmt, data, rows_o, cols_o, rb, so = o
        mixed = np.empty((t, rows_o), dtype=np.float32)  # [T, H]
        wq, ws = _matrix_views(fmt, data, rows_o, cols_o, rb, so)
        act_o = _activations(fmt, int8, att)
        for it in prange((rows_o + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
            r0, r1 = _item(np.int64(it), rows_o)
            _rows(fmt, wq, ws, lut, att, act_o, mixed, r0, r1)
        for it in prange(parts):  # the residual, its norm, and the router, by rows
            r0, r1 = _part(t, parts, np.int64(it))
            add_rms_norm(x[r0:r1], mixed[r0:r1], post_norm, eps, h2[r0:r1])
            _route_rows(h2[r0:r1], int8, lut, gate, top_k, renorm, ids[r0:r1], weights[r0:r1])
        e_ids, starts, pair_rows, xe, w = group_by_expert(ids, weights, h2)  # by expert
        offsets = np.empty(e_ids.shape[0], dtype=np.int64)  # [m]
        for j in range(e_ids.shape[0]):
            e = e_ids[j]
            offsets[j] = table[e] if e < table.shape[0] else -1
            if offsets[j] < 0:  # not read yet (or not held): the backend's own call
                return i, h2, ids, weights, delta
        code, nbytes, layout, glu, inter = experts
        y = np.empty_like(xe)  # [P, H]
        order, bounds = _deal(starts, min(shares, e_ids.shape[0]))
        for it in prange(bounds.shape[0] - 1):
            b = np.int64(it)
            _experts_share(
                code, int8, arena, offsets, nbytes, hidden, inter, layout, lut, xe, starts,
                glu, order[bounds[b] : bounds[b + 1]], y,
            )  # fmt: skip
        pair_at, count = _pairs_of_rows(pair_rows, t, top_k)
        delta = np.empty((t, hidden), dtype=np.float32)  # [T, H]
        for it in prange(parts):
            r0, r1 = _part(t, parts, np.int64(it))
            _weighted_rows(y, w, pair_at, count, r0, r1, delta)
        has_delta = True
    return last, h2, ids, weights, delta


@njit(cache=True, nogil=True)
def _part(n, parts, b):
    """Rows [r0, r1) of part b of range(n) cut into `parts` nearly equal runs."""
    return b * n // parts, (b + 1) * n // parts


@njit(cache=True, nogil=True)
def _route_rows(h2, int8, lut, gate, top_k, renorm, ids, weights):
    """The router's product and top-k of some rows h2 [n, H] -> ids, weights [n, k] (the
    product split by activation rows: each row's logits are the bits of any batch)."""
    fmt, data, rows_g, cols_g, rb, so = gate
    wq, ws = _matrix_views(fmt, data, rows_g, cols_g, rb, so)
    logits = np.empty((h2.shape[0], rows_g), dtype=np.float32)  # [n, E]
    _rows(fmt, wq, ws, lut, h2, _activations(fmt, int8, h2), logits, 0, rows_g)
    top, top_w = route_softmax_topk(logits, top_k, renorm)  # [n, k] each
    for r in range(h2.shape[0]):
        for s in range(top_k):
            ids[r, s], weights[r, s] = top[r, s], top_w[r, s]


@njit(cache=True, nogil=True)
def _pairs_of_rows(pair_rows, t, k):
    """`group_by_expert`'s pairs listed by row: pair_at [T, k], row r's pairs in
    pair_at[r, :count[r]], ascending (the pairs go by expert, so by expert)."""
    pair_at = np.empty((t, k), dtype=np.int64)  # [T, k]
    count = np.zeros(t, dtype=np.int64)  # [T]
    for j in range(pair_rows.shape[0]):
        r = pair_rows[j]
        pair_at[r, count[r]] = j
        count[r] += 1
    return pair_at, count


@njit(cache=True, nogil=True)
def _weighted_rows(y, w, pair_at, count, r0, r1, out):
    """out[r] = float32(sum over row r's pairs j, in order, of float64(float32(y[j] * w[j])))
    for rows r0..r1-1: `entry.accumulate_rows` into zeros, then rounded, a row at a time."""
    acc = np.empty(out.shape[1], dtype=np.float64)  # [H]
    for r in range(r0, r1):
        acc[:] = 0.0
        for s in range(count[r]):
            j = pair_at[r, s]
            wj = w[j]
            for c in range(out.shape[1]):
                acc[c] += np.float64(y[j, c] * wj)
        for c in range(out.shape[1]):
            out[r, c] = acc[c]
