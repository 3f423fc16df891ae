"""A decode row's way through a GQA model's layers, in one kernel call.

A small model's decode token was mostly calls, not arithmetic: per layer the residual add and
norm, the q/k/v group, the attention, o_proj, the second add and norm, the router's product and
its top-k are seven kernel calls of a few microseconds each, and each cost 4-5 us more in
numba's dispatch and the Python around it (fused, the embedded demo model's token took 715-739
against 796-820 us).

* `attention_route` runs them as one call of the very same kernels on the same inputs, where
  every one would run on the calling thread anyway (products below the pool's measured
  threshold, attention below PARALLEL_MIN_WORK: `FusedPlan.products_serial`); the experts
  stay behind the experts interface (local, --ram, nodes), called once per layer as before.
* Where the backend holds the layers' records in arenas in RAM (`ExpertsBackend.resident`:
  `LocalExperts`), `decode_layers` runs the experts too, in the same call, by the kernel
  `LocalExperts` would call, split across the pool's threads; it also splits the products'
  rows and the attention's heads where the step-by-step path would have (a big model's
  layer: up to four parallel regions instead of about ten calls); and it runs every layer
  of the model in that one call (the layers as a numba typed list, `layer_entry`), so a
  token is one call, not one per layer: per layer that was 4-5 us of Python and 8 of
  dispatch, return and launch on the embedded model.

In every case the hidden state, the KV cache and the routing are the same bits as the
step-by-step path (tests/test_fused_layer.py). The router's product stays on the calling
thread (a model's router is a few hundred KB at most; its bits do not depend on the split).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange
from numba.typed import List

from moeshard.moe.experts.backend import ResidentExperts
from moeshard.moe.kernels import quant
from moeshard.moe.kernels.dots import prefetch_span
from moeshard.moe.kernels.entry import (
    ROWS_PER_ITEM,
    _activations,
    _expert_b1,
    _group_item,
    _group_items,
    _group_out,
    _group_rows,
    _halves,
    _item,
    _matrix_views,
    _rows,
    _weighted_total,
    matmul_group_serial_kernel,
    matmul_serial_kernel,
)
from moeshard.moe.model.fused import (
    add_rms_norm,
    attend_pair,
    gqa_attention,
    gqa_prepare,
    prefetch_cached,
    rms_norm_rows,
    route_softmax_topk,
)
from moeshard.moe.model.fused_prefill import prefill_layers


@njit(cache=True, nogil=True)
def attention_route(
    x, delta, has_delta, in_norm, post_norm, eps, int8, lut,
    qkv, q_norm, k_norm, qk_norm, clip, cos, sin, kc, vc, start, scaling, window,
    o, gate, top_k, renorm,
):  # fmt: skip
    """One row: x += delta (if has_delta); h = norm(x); q, k, v = h's products (`qkv`: fmt,
    datas, rows, cols, row_bytes, scale_offs); attention over the cache (k, v appended at
    `start`); x += o_proj(attention); h2 = norm(x); the router's top-k of h2 (`gate`: fmt,
    data, rows, cols, row_bytes, scale_off, like `o`).  x [1, H] float32 is updated in place;
    -> (h2 [1, H], expert ids int64 [1, k], weights float32 [1, k])."""
    h = _norm_in(x, delta, has_delta, in_norm, eps)  # [1, H]
    fmt, datas, rows, cols, row_bytes, scale_offs = qkv
    flat = matmul_group_serial_kernel(fmt, int8, datas, rows, cols, row_bytes, scale_offs, lut, h)
    q, k, v = _qkv_views(flat, rows)
    att = np.empty_like(q)  # [1, Hq*D]
    gqa_attention(
        q,
        k,
        v,
        q_norm,
        k_norm,
        qk_norm,
        eps,
        clip,
        cos,
        sin,
        kc,
        vc,
        start,
        scaling,
        window,
        np.empty(0, dtype=np.float32),
        att,
    )  # fmt: skip (no attention sinks: a layer with them has no fused plan)
    fmt, data, rows_o, cols_o, rb, so = o
    mixed = matmul_serial_kernel(fmt, int8, data, rows_o, cols_o, rb, so, lut, att)  # [1, H]
    return _route(x, mixed, post_norm, eps, int8, lut, gate, top_k, renorm)


@njit(cache=True, nogil=True)
def _norm_in(x, delta, has_delta, in_norm, eps):
    """x += delta (if has_delta) in place -> norm(x) [1, H]."""
    h = np.empty_like(x)  # [1, H]
    if has_delta:
        add_rms_norm(x, delta, in_norm, eps, h)
    else:
        rms_norm_rows(x, in_norm, eps, h)
    return h


@njit(cache=True, nogil=True)
def _qkv_views(flat, rows):
    """The q, k and v rows [1, rows[m]] of a q/k/v group's flat product [sum(rows)]."""
    nq, nk = rows[0], rows[1]
    q = flat[:nq].reshape((1, nq))  # [1, Hq*D]
    k = flat[nq : nq + nk].reshape((1, nk))  # [1, Hkv*D]
    v = flat[nq + nk : nq + nk + rows[2]].reshape((1, rows[2]))  # [1, Hkv*D]
    return q, k, v


@njit(cache=True, nogil=True)
def _route(x, mixed, post_norm, eps, int8, lut, gate, top_k, renorm):
    """x += mixed in place; h2 = norm(x); the router's top-k of h2 -> (h2, ids, weights)."""
    h2 = np.empty_like(x)  # [1, H]
    add_rms_norm(x, mixed, post_norm, eps, h2)
    fmt, data, rows_g, cols_g, rb, so = gate
    logits = matmul_serial_kernel(fmt, int8, data, rows_g, cols_g, rb, so, lut, h2)  # [1, E]
    ids, weights = route_softmax_topk(logits, top_k, renorm)  # [1, k] each
    return h2, ids, weights


@njit(cache=True, nogil=True)
def _held_offsets(ids, weights, table):
    """A decode row's routed experts as the expert kernels take them: (byte offsets int64
    [k], weights float32 [k]) in ascending expert order, the order `combine` adds them in;
    None's stand-in, k = 0 arrays, where one is absent from `table` or routed twice."""
    k = ids.shape[1]
    order = np.argsort(ids[0])
    offsets = np.empty(k, dtype=np.int64)  # [k]
    w = np.empty(k, dtype=np.float32)  # [k]
    previous = -1
    for j in range(k):
        e = ids[0, order[j]]
        if e <= previous or e >= table.shape[0] or table[e] < 0:
            return offsets[:0], w[:0]
        offsets[j], w[j], previous = table[e], weights[0, order[j]], e
    return offsets, w


@njit(cache=True, nogil=True)
def _rounded(total):
    """float64 [H] -> float32 [1, H], rounded once (as `decode_weighted_sum`'s astype)."""
    out = np.empty((1, total.shape[0]), dtype=np.float32)  # [1, H]
    for j in range(total.shape[0]):
        out[0, j] = total[j]
    return out


# How much of the router's matrix `decode_layers` asks for ahead of use (and of the KV
# cache's rows: `fused.PREFETCH_KV_BYTES`): the attention and the router's product are a big
# layer's phases that wait on memory with the bus idle (a few reads in flight, one thread for
# the router), so their data is fetched while the bandwidth-bound products before them
# stream. Beyond this the phases stream well enough themselves.  See docs/results.md ("a
# decode token in one kernel call, and what a layer waits for").
PREFETCH_BYTES = 1 << 18


def layer_entry(held: ResidentExperts, in_norm, post_norm, plan, q_norm, k_norm, window):
    """One layer as `decode_layers` takes it from its typed list: its experts' arena and
    offset table (`ResidentExperts`), norms, `FusedPlan` products and attention window (all
    the entries of one list must have one numba type: layers of one model in the same
    formats).  Its KV cache comes in lists of their own: the entries are a model's, made
    once, the caches a sequence's."""
    return (
        held.table, held.arena, held.kernel_args, in_norm, post_norm, plan.qkv, q_norm, k_norm,
        window, plan.o, plan.gate,
    )  # fmt: skip


@njit(cache=True, nogil=True, parallel=True)
def decode_layers(
    layers, kcs, vcs, first, last, splits, x, delta, has_delta, consts, cos, sin, start
):
    """A decode row through layers[first:last] of a numba typed list of `layer_entry`s
    (their KV caches kcs[i], vcs[i] [S, Hkv, D], filled to `start`), in one call, each
    layer as the step-by-step path computes it: x += delta (if has_delta); h = norm(x); q,
    k, v; attention over the cache (k, v appended at `start`); x += o_proj; h2 = norm(x);
    the router's top-k of h2; the routed experts' weighted sum, the next delta.  x [1, H]
    float32 is updated in place.  `consts`: (eps, int8, lut, qk_norm, clip, scaling, top_k,
    renorm), the model's; splits [n, 2] bool: per layer whether its q/k/v
    and o_proj rows and its attention's heads go across the pool's threads (as
    `entry.matmul_group_kernel`, `matmul_kernel` and `fused.attend_cache_parallel` split
    them: the same row kernels on the same inputs, so the same bits; the loops are repeated
    here because a prange cannot be called, and an njit function calling a parallel one
    breaks numba's cache).  The experts always go across the threads the call runs on.

    -> (stop, h2 [1, H], ids [1, k], weights [1, k], delta [1, H]): stop == last and the
    last layer's experts' output; or stop < last, the layer one of whose routed experts is
    not in its arena (`table[e]` -1) or is routed twice, with its h2, ids and weights, for
    the caller to run them through the experts backend and go on from stop + 1.

    A small model's decode token was mostly calls and the Python between them: one call for
    all its layers instead of one per layer (the embedded model's token: see docs/results.md).
    Where the pool's threads spin (`generate`), one call also keeps them awake throughout."""
    eps, int8, lut, qk_norm, clip, scaling, top_k, renorm = consts
    no_sinks = np.empty(0, dtype=np.float32)  # (a layer with sinks has no plan: `FusedPlan`)
    h2 = np.empty_like(x)  # [1, H]
    ids = np.empty((1, top_k), dtype=np.int64)  # [1, k]
    weights = np.empty((1, top_k), dtype=np.float32)  # [1, k]
    for i in range(first, last):
        table, arena, experts, in_norm, post_norm, qkv, q_norm, k_norm = layers[i][:8]
        window, o, gate = layers[i][8:]
        kc, vc = kcs[i], vcs[i]  # [S, Hkv, D] each
        split_products, split_attention = splits[i, 0], splits[i, 1]
        if split_products:  # (a layer this big was read from DRAM; a small one is in cache)
            prefetch_cached(kc, vc, start, window)  # (while q, k and v stream in)
        h = _norm_in(x, delta, has_delta, in_norm, eps)  # [1, H]
        fmt, datas, rows, cols, row_bytes, scale_offs = qkv
        if split_products:
            flat = np.empty(_group_rows(rows), dtype=np.float32)  # [sum(rows)]
            act = _activations(fmt, int8, h)
            for it in prange(_group_items(rows)):
                m, r0, r1 = _group_item(rows, np.int64(it))  # (prange counts in uint64)
                wq, ws = _matrix_views(fmt, datas[m], rows[m], cols, row_bytes[m], scale_offs[m])
                _rows(fmt, wq, ws, lut, h, act, _group_out(flat, rows, m, 1), r0, r1)
        else:
            flat = matmul_group_serial_kernel(
                fmt, int8, datas, rows, cols, row_bytes, scale_offs, lut, h
            )  # [sum(rows)]
        q, k, v = _qkv_views(flat, rows)
        att = np.empty_like(q)  # [1, Hq*D]
        if split_products:
            prefetch_span(gate[1], 0, PREFETCH_BYTES)  # the router's rows, while attention runs
        if split_attention:
            gqa_prepare(q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, kc, vc, start)
            for it in prange(q.shape[1] // kc.shape[2]):
                attend_pair(q, kc, vc, start, scaling, window, no_sinks, att, np.int64(it))
        else:
            gqa_attention(
                q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, kc, vc, start, scaling,
                window, no_sinks, att,
            )  # fmt: skip
        fmt, data, rows_o, cols_o, rb, so = o
        if split_products:
            mixed = np.empty((1, rows_o), dtype=np.float32)  # [1, H]
            wq, ws = _matrix_views(fmt, data, rows_o, cols_o, rb, so)
            act_o = _activations(fmt, int8, att)
            for it in prange((rows_o + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
                r0, r1 = _item(np.int64(it), rows_o)
                _rows(fmt, wq, ws, lut, att, act_o, mixed, r0, r1)
        else:
            mixed = matmul_serial_kernel(fmt, int8, data, rows_o, cols_o, rb, so, lut, att)
        h2, ids, weights = _route(x, mixed, post_norm, eps, int8, lut, gate, top_k, renorm)
        offsets, w = _held_offsets(ids, weights, table)  # [k], [k]
        if offsets.shape[0] == 0:
            return i, h2, ids, weights, delta
        code, nbytes, layout, glu, inter = experts
        hidden = h2.shape[1]
        y = np.empty((offsets.shape[0], hidden), dtype=np.float32)  # [k, H]
        act_e = _activations(_halves(code)[0], int8, h2)  # h2 quantised once for every expert
        for e in prange(offsets.shape[0]):
            record = arena[offsets[e] : offsets[e] + nbytes]
            _expert_b1(code, int8, record, hidden, inter, layout, lut, h2, act_e, y[e], glu)
        delta = _rounded(_weighted_total(y, w))  # [1, H]
        has_delta = True
    return last, h2, ids, weights, delta


@dataclass(frozen=True)
class FusedPlan:
    """A layer's matrices as `attention_route` takes them, or why it cannot (a bias, a
    shared expert, a dense MLP, q/k/v in mixed formats: then the step-by-step path runs)."""

    qkv: tuple  # (fmt code, datas, rows, cols, row_bytes, scale_offs)
    o: tuple  # (fmt code, data, rows, cols, row_bytes, scale_off)
    gate: tuple  # the router's, likewise
    works: tuple[int, int, int]  # multiply-adds of one row through qkv, o, gate

    @staticmethod
    def of(qkv_group, o, gate) -> FusedPlan | None:
        """From a layer's `trunk.LinearGroup` (q, k, v), o_proj and router `trunk.Linear`s."""
        if qkv_group.packed is None or len(qkv_group.layers) != 3:
            return None
        if any(ly.bias is not None for ly in (*qkv_group.layers, o, gate)):
            return None
        group = qkv_group.packed
        works = (sum(group.rows) * group.cols, o.rows * o.cols, gate.rows * gate.cols)
        return FusedPlan(group.fused_args(), o.packed.fused_args(), gate.packed.fused_args(), works)

    def products_serial(self) -> bool:
        """Whether each of the layer's products would run on the calling thread now (the
        largest does exactly when all do: the rule is a threshold on the work)."""
        return quant.matmul_runs_serial(max(self.works))


def warmup() -> None:
    """Compile (or load from numba's cache) `attention_route`, `decode_layers` and
    `fused_prefill.prefill_layers` for the argument types a forward pass gives them
    (`fused.warmup` calls this): a 16-wide bf16 layer, one step."""
    h, d, heads_kv = 16, 8, 2
    norm = np.ones(h, np.float32)  # [H]
    none = np.zeros(0, np.float32)
    w = quant.pack(np.ones((h, h), np.float32), "bf16")
    matrix = quant.PackedMatrix(w, "bf16", h, h)  # [H, H]
    qkv = quant.PackedGroup([matrix] * 3).fused_args()
    cos, sin = np.ones((1, d // 2), np.float32), np.zeros((1, d // 2), np.float32)
    kc, vc = (np.zeros((4, heads_kv, d), np.float32) for _ in range(2))  # [L, Hkv, D]
    x = np.ones((1, h), np.float32)  # [1, H]
    args = (
        x, x.copy(), True, norm, norm, 1e-6, quant._int8(), quant.dots.F16_LUT,
        qkv, none, none, 0, 0.0, cos, sin, kc, vc, 0, 0.5, 0,
        matrix.fused_args(), matrix.fused_args(), 2, True,
    )  # fmt: skip
    attention_route(*args)
    # decode_layers' types do not depend on the record format: no expert held, it compiles
    arena = np.zeros(64, np.uint8)
    arena.flags.writeable = False
    absent = np.full(h, -1, dtype=np.int64)  # [E]
    held = ResidentExperts.of(arena, absent, "q4_0", 32, 32, quant.SWIGLU)
    plan = FusedPlan(qkv, matrix.fused_args(), matrix.fused_args(), (h * h,) * 3)
    layers = List([layer_entry(held, norm, norm, plan, none, none, 0)])
    kcs, vcs = List([kc]), List([vc])
    consts = (1e-6, quant._int8(), quant.dots.F16_LUT, 0, 0.0, 0.5, 2, True)
    for split in (False, True):  # (one compiled signature; each way run once)
        splits = np.full((1, 2), split)  # [1, 2]
        decode_layers(layers, kcs, vcs, 0, 1, splits, x, x.copy(), True, consts, cos, sin, 0)
    rows = np.ones((2, h), np.float32)  # [2, H]: a prefill's rows (`fused_prefill`)
    cos2, sin2 = np.ones((2, d // 2), np.float32), np.zeros((2, d // 2), np.float32)
    prefill_layers(layers, kcs, vcs, 0, 1, rows, rows, False, consts, cos2, sin2, 0, 1)
