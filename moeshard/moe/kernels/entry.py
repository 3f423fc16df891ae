"""Numba kernels: the entry points behind `moeshard.moe.kernels.quant`.

Matmul and fused expert FFN on packed weight bytes.  The row kernels these drive live in
`moeshard.moe.kernels.idots` (q4_0/q8_0 with 8-bit activations and integer dot products: the
default),
`moeshard.moe.kernels.dots` (shared constants, vector primitives, the batch-1 q4_0/q8_0 dots with
float32 activations, notes for editing the loops), `moeshard.moe.kernels.tiles` (their batch >= 2
tiles) and `moeshard.moe.kernels.fdots` (f32/bf16 rows).

Entry points (called by `moeshard.moe.kernels.quant` only): `matmul_kernel`, `expert_ffn_kernel` and
`experts_b1_kernel`.  They take the packed bytes as one read-only uint8 array plus its layout
numbers, and slice each matrix into two 2-D views (`_matrix_views`; `moeshard.moe.kernels.quant`'s
docstring has the byte layout):

* ``wq`` uint8: f32 [rows, row_bytes], the raw rows; bf16 [groups of four rows, group bytes],
  the rows interleaved sixteen columns at a time; q4_0/q8_0/mxfp4 [groups of eight rows, group
  bytes], the interleaved codes;
* ``ws`` uint16: the block scales, [groups, cols // 32 * 8] float16 (mxfp4: its one-byte
  E8M0 scales two to a uint16), or [rows, 0] for f32/bf16.

The row kernels, picked per row range by `_rows`:

* q4_0/q8_0/mxfp4, 8-bit activations (`int8`): `idots.int_rows`, any batch (x is quantised
  once per call, by `_activations`), one row group at a time;
* q4_0/q8_0/mxfp4, float32 activations: `tiles._tile_rows` (four rows' codes unpacked,
  4x2 tiles), any batch;
* f32/bf16: `fdots.float_rows` (float32 lanes and FMAs in a fixed order).

Each of them performs the same operations, in the same order, for every (activation row,
weight row) pair whatever else is in the batch and however rows are split across threads, and
without fast-math flags, so a row's result is the same bits in any batch and on any CPU (the
modules define their arithmetic; tests/test_kernel_determinism.py pins it).  The expert FFN's
gated unit (`_glu_mul`: SwiGLU, or K3's SiTU) is computed in float64 and rounded to float32,
with `moeshard.moe.kernels.fixedmath`'s exp and tanh: fdlibm's exp and an expm1-based tanh written
as fixed sequences of IEEE operations, because libm's differ by CPU and C library (glibc picks
its exp at run time) and a coordinator requires a node's expert output bit for bit.  Against
libm the float32 gated unit changed 0 of 104,857,600 values of each kind, and it runs 2-6.5x
faster alone (vectorised: no libm call in the loop); docs/kernels.md has the measurements.
"""

import numpy as np
from numba import njit, prange

from moeshard.moe.kernels import fixedmath
from moeshard.moe.kernels.activations import activation_buffers, quantize_activations
from moeshard.moe.kernels.dots import (
    BF16_GROUP,
    BF16_PIECE,
    FMT_BF16,
    FMT_F32,
    FMT_IQ4_XS,
    FMT_MXFP4,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_1,
    FMT_Q5_K,
    FMT_Q6_K,
    QK,
    ROW_GROUP,
    ROWS_PER_ITEM,
)
from moeshard.moe.kernels.fdots import even_odd, float_rows
from moeshard.moe.kernels.idots import int_rows
from moeshard.moe.kernels.tiles import _tile_rows

# ---------------------------------------------------------------------------------------------
# drivers
#
# No njit function in moe.kernels calls a parallel=True function: with cache=True that
# combination segfaults when loaded from numba's cache (numba issues #4807, #8578; reproduced
# here).  So the three parallel=True entry points are called from Python only, and share the
# serial helpers below (and those in `dots` and `tiles`).


@njit(cache=True, nogil=True)
def _rows(fmt, wq, ws, lut, x, act, out, r0, r1):
    """Compute out[:, r0:r1] on the calling thread (the choice of kernel changes no bits).

    act is what `_activations` prepared from x once per call: its 8-bit codes for the
    integer q4_0/q8_0 path, x reordered for the bf16 lanes, or nothing (f32 and the float
    q4_0/q8_0 path read x itself)."""
    xq, xd, xc, xp = act
    if fmt == FMT_F32 or fmt == FMT_BF16:
        float_rows(fmt, wq, x, xp, out, r0, r1)
    elif xq.shape[0] > 0:
        int_rows(fmt, wq, ws, xq, xd, xc, out, r0, r1)
    else:
        _tile_rows(fmt, wq, ws, lut, x, out, r0, r1)


@njit(cache=True, nogil=True)
def _matrix_views(fmt, data, rows, cols, row_bytes, scale_off):
    """The payload and scale views of one packed matrix (`moeshard.moe.kernels.quant` has the
    layout): f32 (scale_off < 0): uint8 [rows, row_bytes] and empty scales; bf16 the same with
    [groups of 4 rows, row_bytes]; q4_0/q8_0/mxfp4:
    uint8 [groups of 8 rows, row_bytes] and the scales as uint16 [groups, cols // 32 * 8]
    (float16) or [groups, cols // 32 * 4] (mxfp4: one-byte E8M0 scales, two to a uint16)."""
    if scale_off < 0:
        n = (rows + BF16_GROUP - 1) // BF16_GROUP if fmt == FMT_BF16 else rows
        wq = data[: n * row_bytes].reshape((n, row_bytes))
        return wq, np.empty((rows, 0), dtype=np.uint16)
    groups, nb = (rows + ROW_GROUP - 1) // ROW_GROUP, cols // QK
    wq = data[: groups * row_bytes].reshape((groups, row_bytes))
    per_group = nb * ROW_GROUP if fmt != FMT_MXFP4 else nb * ROW_GROUP // 2  # uint16 each
    if fmt == FMT_Q4_K or fmt == FMT_Q5_K:  # 160 bytes per super-block (`_q4k_group_scales`)
        per_group = nb // 8 * 80
    elif fmt == FMT_Q6_K:  # 144 bytes per super-block (`layout._q6k_group_scales`)
        per_group = nb // 8 * 72
    elif fmt == FMT_IQ4_XS:  # 80 bytes per super-block (`layout._iq4xs_group_scales`)
        per_group = nb // 8 * 40
    elif fmt == FMT_Q4_1 or fmt == FMT_Q5_1:  # d and m of the eight rows per block
        per_group = nb * ROW_GROUP * 2
    ws = data[scale_off : scale_off + groups * per_group * 2].view(np.uint16)
    return wq, ws.reshape((groups, per_group))


@njit(cache=True, nogil=True)
def _activations(fmt, int8, x):
    """What the row kernels of `fmt` need besides x, made once per kernel call: (xq, xd, xc)
    x quantised to 8 bits per block for the integer q4_0/q8_0 path (`moeshard.moe.kernels.idots`,
    when int8 is set), and xp, x reordered for the bf16 lanes (`fdots.even_odd`); the parts
    a format does not use are empty."""
    b, cols = x.shape
    xp = even_odd(x) if fmt == FMT_BF16 else np.empty((0, cols), dtype=np.float32)
    if fmt == FMT_F32 or fmt == FMT_BF16 or not (int8 or fmt >= FMT_Q4_K):
        xq, xd, xc = activation_buffers(0, cols)
        return xq, xd, xc, xp
    xq, xd, xc = activation_buffers(b, cols)
    quantize_activations(x, xq, xd, xc)
    return xq, xd, xc, xp


@njit(cache=True, nogil=True)
def _item(it, rows):
    """Row range of parallel work item `it`."""
    r0 = it * ROWS_PER_ITEM
    return r0, min(rows, r0 + ROWS_PER_ITEM)


@njit(cache=True, nogil=True, error_model="numpy")
def _glu_mul(g, u, glu):
    """The gated unit elementwise, float32 [b, inter] (computed in float64): glu = (kind,
    beta, linear_beta); kind 0 is SwiGLU, silu(g) * u; kind 1 is Kimi K3's SiTU-GLU,
    [beta tanh(g / beta) sigmoid(g)] * [linear_beta tanh(u / linear_beta)]; kind 2 is
    gpt-oss's clamped SwiGLU (beta = alpha, linear_beta = limit), g' = min(g, limit),
    (clip(u, -limit, limit) + 1) * g' sigmoid(alpha g') (a nan stays nan).  exp and tanh are
    `moeshard.moe.kernels.fixedmath`'s, not libm's: the same bits on every CPU
    (`quant.glu_reference` is the numpy twin)."""
    kind, beta, linear_beta = glu
    h = np.empty_like(g)  # [b, inter]
    for i in range(g.shape[0]):
        for j in range(g.shape[1]):
            gv, uv = np.float64(g[i, j]), np.float64(u[i, j])
            if kind == 1:
                gate = beta * fixedmath.tanh(gv / beta) / (1.0 + fixedmath.exp(-gv))
                h[i, j] = gate * (linear_beta * fixedmath.tanh(uv / linear_beta))
            elif kind == 2:
                limit = linear_beta
                gv = limit if gv > limit else gv
                uv = limit if uv > limit else (-limit if uv < -limit else uv)
                h[i, j] = (uv + 1.0) * (gv / (1.0 + fixedmath.exp(-(beta * gv))))
            else:
                h[i, j] = gv / (1.0 + fixedmath.exp(-gv)) * uv
    return h


@njit(cache=True, nogil=True, parallel=True)
def matmul_kernel(fmt, int8, data, rows, cols, row_bytes, scale_off, lut, x):
    """x float32 [b, cols] -> float32 [b, rows] = x @ W.T for the packed matrix in data.

    Rows are split across numba's threads in ROWS_PER_ITEM work items (the caller sets
    `quant._run` runs matrices too small to pay for waking the pool on one thread).
    """
    wq, ws = _matrix_views(fmt, data, rows, cols, row_bytes, scale_off)
    out = np.empty((x.shape[0], rows), dtype=np.float32)  # [b, rows]
    act = _activations(fmt, int8, x)
    for it in prange((rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
        r0, r1 = _item(it, rows)
        _rows(fmt, wq, ws, lut, x, act, out, r0, r1)
    return out


@njit(cache=True, nogil=True)
def matmul_serial_kernel(fmt, int8, data, rows, cols, row_bytes, scale_off, lut, x):
    """`matmul_kernel` on the calling thread (the same bits): for matrices too small to wake
    numba's pool, which costs a parallel kernel 2-6 us per call even on one thread."""
    wq, ws = _matrix_views(fmt, data, rows, cols, row_bytes, scale_off)
    out = np.empty((x.shape[0], rows), dtype=np.float32)  # [b, rows]
    _rows(fmt, wq, ws, lut, x, _activations(fmt, int8, x), out, 0, rows)
    return out


@njit(cache=True, nogil=True)
def _group_item(rows, it):
    """(matrix, its first row, one past its last) of work item `it` of a matrix group whose
    matrices have `rows` rows each, numbered matrix by matrix in ROWS_PER_ITEM items."""
    for m in range(len(rows)):
        n = (rows[m] + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
        if it < n:
            r0 = it * ROWS_PER_ITEM
            return m, r0, min(rows[m], r0 + ROWS_PER_ITEM)
        it -= n
    return -1, 0, 0


@njit(cache=True, nogil=True)
def _group_out(out, rows, m, b):
    """Matrix m's block of the group's flat output: a C-contiguous float32 [b, rows[m]]."""
    start = 0
    for i in range(m):
        start += b * rows[i]
    return out[start : start + b * rows[m]].reshape((b, rows[m]))


@njit(cache=True, nogil=True)
def _group_rows(rows):
    total = 0
    for m in range(len(rows)):
        total += rows[m]
    return total


@njit(cache=True, nogil=True)
def _group_items(rows):
    total = 0
    for m in range(len(rows)):
        total += (rows[m] + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    return total


@njit(cache=True, nogil=True, parallel=True)
def matmul_group_kernel(fmt, int8, datas, rows, cols, row_bytes, scale_offs, lut, x):
    """Several packed matrices of one format and width applied to the same x [b, cols] in one
    call (a layer's q, k and v projections): -> float32 [b * sum(rows)], matrix m's product
    [b, rows[m]] as a C-contiguous block after those of the matrices before it.

    x is prepared once (`_activations`) and the work items of all the matrices are split
    across the threads together, so small products (k and v: a quarter of q's rows) share the
    pool's wake-up with a big one instead of paying their own.  Every row's bits are those of
    `matmul_kernel` on its own matrix (the same `_rows` on the same activations)."""
    b = x.shape[0]
    out = np.empty(b * _group_rows(rows), dtype=np.float32)  # [b * sum(rows)]
    act = _activations(fmt, int8, x)
    for it in prange(_group_items(rows)):
        m, r0, r1 = _group_item(rows, np.int64(it))  # (prange counts in uint64)
        wq, ws = _matrix_views(fmt, datas[m], rows[m], cols, row_bytes[m], scale_offs[m])
        _rows(fmt, wq, ws, lut, x, act, _group_out(out, rows, m, b), r0, r1)
    return out


@njit(cache=True, nogil=True)
def matmul_group_serial_kernel(fmt, int8, datas, rows, cols, row_bytes, scale_offs, lut, x):
    """`matmul_group_kernel` on the calling thread (the same bits)."""
    b = x.shape[0]
    out = np.empty(b * _group_rows(rows), dtype=np.float32)  # [b * sum(rows)]
    act = _activations(fmt, int8, x)
    for m in range(len(rows)):
        wq, ws = _matrix_views(fmt, datas[m], rows[m], cols, row_bytes[m], scale_offs[m])
        _rows(fmt, wq, ws, lut, x, act, _group_out(out, rows, m, b), 0, rows[m])
    return out


@njit(cache=True, nogil=True)
def _expert_views(fmt, record, hidden, inter, layout):
    """The gate, up and down views of an expert record whose format code is fmt (gate-up's
    code + 16 x down's: `quant._record_code`)."""
    n_gu, rb_gu, s_gu, rb_d, s_d = layout[0], layout[1], layout[2], layout[3], layout[4]
    fu, fd = _halves(fmt)
    gq, gs = _matrix_views(fu, record[:n_gu], inter, hidden, rb_gu, s_gu)
    uq, us = _matrix_views(fu, record[n_gu : 2 * n_gu], inter, hidden, rb_gu, s_gu)
    dq, ds = _matrix_views(fd, record[2 * n_gu :], hidden, inter, rb_d, s_d)
    return gq, gs, uq, us, dq, ds


@njit(cache=True, nogil=True)
def _gate_up_bias(record, layout, g, u):
    """g, u float32 [b, inter] += the record's gate and up biases, when it has them
    (layout[5]: their offset, or -1; float32 gate bias [inter], up bias [inter], then the
    down bias [hidden])."""
    off = layout[5]
    if off < 0:
        return
    inter = g.shape[1]
    bias = record[off : off + 8 * inter].view(np.float32)  # [2 * inter]
    for i in range(g.shape[0]):
        for j in range(inter):
            g[i, j] += bias[j]
            u[i, j] += bias[inter + j]


@njit(cache=True, nogil=True)
def _down_bias(record, layout, inter, y):
    """y float32 [b, hidden] += the record's down bias, when it has one (`_gate_up_bias`)."""
    off = layout[5]
    if off < 0:
        return
    hidden = y.shape[1]
    start = off + 8 * inter
    bias = record[start : start + 4 * hidden].view(np.float32)  # [hidden]
    for i in range(y.shape[0]):
        for j in range(hidden):
            y[i, j] += bias[j]


@njit(cache=True, nogil=True)
def _halves(fmt):
    """An expert format code -> (gate and up's format code, down's)."""
    return fmt % 16, fmt // 16


@njit(cache=True, nogil=True, parallel=True)
def expert_ffn_kernel(fmt, int8, record, hidden, inter, layout, lut, x, glu):
    """glu(x @ gate.T, x @ up.T) @ down.T for x float32 [b, hidden] -> [b, hidden] (`_glu_mul`).

    layout = (gate/up matrix bytes, their row bytes, their scale offset, down row bytes,
    down scale offset), as computed by `moeshard.moe.quant`.  Gate and up rows share one parallel
    region, down rows a second; the [b, inter] activation stays float32.
    """
    gq, gs, uq, us, dq, ds = _expert_views(fmt, record, hidden, inter, layout)
    fu, fd = _halves(fmt)
    b = x.shape[0]
    act = _activations(fu, int8, x)
    g = np.empty((b, inter), dtype=np.float32)  # [b, inter]
    u = np.empty((b, inter), dtype=np.float32)  # [b, inter]
    n_items = (inter + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    for it in prange(2 * n_items):
        if it < n_items:
            r0, r1 = _item(it, inter)
            _rows(fu, gq, gs, lut, x, act, g, r0, r1)
        else:
            r0, r1 = _item(it - n_items, inter)
            _rows(fu, uq, us, lut, x, act, u, r0, r1)
    _gate_up_bias(record, layout, g, u)
    h = _glu_mul(g, u, glu)  # [b, inter]
    h_act = _activations(fd, int8, h)
    y = np.empty((b, hidden), dtype=np.float32)  # [b, hidden]
    for it in prange((hidden + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
        r0, r1 = _item(it, hidden)
        _rows(fd, dq, ds, lut, h, h_act, y, r0, r1)
    _down_bias(record, layout, inter, y)
    return y


@njit(cache=True, nogil=True)
def _expert_serial(fmt, int8, record, hidden, inter, layout, lut, x, y, glu):
    """One expert on its rows x float32 [n, hidden] on the calling thread -> y [n, hidden]
    (each row the bits `expert_ffn_kernel` gives it: the same row kernels, whole ranges)."""
    gq, gs, uq, us, dq, ds = _expert_views(fmt, record, hidden, inter, layout)
    fu, fd = _halves(fmt)
    n = x.shape[0]
    act = _activations(fu, int8, x)
    g = np.empty((n, inter), dtype=np.float32)  # [n, inter]
    u = np.empty((n, inter), dtype=np.float32)  # [n, inter]
    _rows(fu, gq, gs, lut, x, act, g, 0, inter)
    _rows(fu, uq, us, lut, x, act, u, 0, inter)
    _gate_up_bias(record, layout, g, u)
    h = _glu_mul(g, u, glu)  # [n, inter]
    _rows(fd, dq, ds, lut, h, _activations(fd, int8, h), y, 0, hidden)
    _down_bias(record, layout, inter, y)


@njit(cache=True, nogil=True, parallel=True)
def experts_rows_kernel(
    fmt, int8, arena, offsets, nbytes, hidden, inter, layout, lut, x, starts, glu, shares
):
    """Several experts, each on its own rows, in one parallel region: expert e (the record at
    arena[offsets[e]:][:nbytes]) applied to x[starts[e] : starts[e + 1]] (float32 [N, hidden],
    the experts' rows one after another) -> y [N, hidden] in the same rows; `shares`: the
    threads it runs on (numba's `get_num_threads` here would keep it out of numba's cache).

    A batched decode step routes a few rows to each of many experts; one call per expert
    would wake numba's pool twice per expert for a few rows each.  The experts are dealt to
    the threads by their rows (`_deal`), not in index order: a prefill's routing is uneven,
    and numba gives each thread one contiguous share of a prange, so the busiest half of the
    experts had 1.1-1.9x the mean rows."""
    y = np.empty_like(x)  # [N, hidden]
    order, bounds = _deal(starts, min(shares, offsets.shape[0]))
    for b in prange(bounds.shape[0] - 1):
        mine = order[bounds[b] : bounds[b + 1]]
        _experts_share(fmt, int8, arena, offsets, nbytes, hidden, inter, layout, lut, x, starts,
                       glu, mine, y)  # fmt: skip
    return y


@njit(cache=True, nogil=True)
def _experts_share(
    fmt, int8, arena, offsets, nbytes, hidden, inter, layout, lut, x, starts, glu, mine, y
):
    """One thread's share of `experts_rows_kernel`: the experts `mine` (indices into
    offsets and starts), each on its rows of x, into the same rows of y."""
    for e in mine:
        r0, r1 = starts[e], starts[e + 1]
        if r1 > r0:
            record = arena[offsets[e] : offsets[e] + nbytes]
            xe, ye = x[r0:r1], y[r0:r1]
            _expert_serial(fmt, int8, record, hidden, inter, layout, lut, xe, ye, glu)


@njit(cache=True, nogil=True)
def _deal(starts, bins):
    """Experts e (rows starts[e]:starts[e + 1]) dealt into `bins` shares of about equal work,
    rows + 1 each (an expert's weights cost about one row's products to read): the largest
    first, each to the least loaded share so far. -> (order [m], bounds [bins + 1]): share b
    runs the experts order[bounds[b]:bounds[b + 1]], ascending.  Where each expert runs
    changes no bits: its rows are its alone."""
    bins = max(bins, 1)
    cost = np.diff(starts) + 1  # [m]
    owner = np.empty(cost.shape[0], dtype=np.int64)  # [m]: each expert's share
    load = np.zeros(bins, dtype=np.int64)  # [bins]
    for e in np.argsort(-cost, kind="mergesort"):
        b = np.argmin(load)
        owner[e] = b
        load[b] += cost[e]
    order = np.argsort(owner, kind="mergesort")  # [m]: by share, ascending within one
    bounds = np.zeros(bins + 1, dtype=np.int64)  # [bins + 1]
    bounds[1:] = np.cumsum(np.bincount(owner, minlength=bins))
    return order, bounds


@njit(cache=True, nogil=True)
def _expert_b1(fmt, int8, record, hidden, inter, layout, lut, x, act, y, glu):
    """One expert on the calling thread, batch 1: x float32 [1, hidden] -> y [hidden]; act
    is `_activations(gate-up's format, int8, x)` (made once for all the experts of a row)."""
    gq, gs, uq, us, dq, ds = _expert_views(fmt, record, hidden, inter, layout)
    fu, fd = _halves(fmt)
    g = np.empty((1, inter), dtype=np.float32)  # [1, inter]
    u = np.empty((1, inter), dtype=np.float32)  # [1, inter]
    _rows(fu, gq, gs, lut, x, act, g, 0, inter)
    _rows(fu, uq, us, lut, x, act, u, 0, inter)
    _gate_up_bias(record, layout, g, u)
    h = _glu_mul(g, u, glu)  # [1, inter]
    out = np.empty((1, hidden), dtype=np.float32)  # [1, hidden]
    _rows(fd, dq, ds, lut, h, _activations(fd, int8, h), out, 0, hidden)
    _down_bias(record, layout, inter, out)
    y[:] = out[0]


@njit(cache=True, nogil=True, parallel=True)
def experts_b1_kernel(fmt, int8, arena, offsets, nbytes, hidden, inter, layout, lut, x, glu):
    """Several experts at batch 1 in one parallel region: expert e is the record at
    arena[offsets[e] : offsets[e] + nbytes], applied to x[e] (float32 [m, hidden]) -> [m, hidden].

    Whole experts are split across the threads, so a decode layer pays for one wake-up of
    numba's pool instead of two per expert (`expert_ffn_kernel`), and each thread streams
    its own records: measured 1.33x faster for 16 cold 2.65 MB experts on 2 threads.
    Each expert's row gets the bits `expert_ffn_kernel` gives it in any batch (see the top).
    """
    m = offsets.shape[0]
    y = np.empty((m, hidden), dtype=np.float32)  # [m, hidden]
    for e in prange(m):
        record = arena[offsets[e] : offsets[e] + nbytes]
        xe = x[e : e + 1]
        act = _activations(_halves(fmt)[0], int8, xe)
        _expert_b1(fmt, int8, record, hidden, inter, layout, lut, xe, act, y[e], glu)
    return y


@njit(cache=True, nogil=True, parallel=True)
def experts_b1_sum_kernel(fmt, int8, arena, offsets, nbytes, hidden, inter, layout, lut, x, w, glu):
    """The weighted sum of several experts on one decode row: sum_e w[e] * expert_e(x[0]) for
    x float32 [1, hidden], the record of expert e at arena[offsets[e]:][:nbytes] and w float32
    [m] -> float64 [hidden].

    The experts run in parallel (as `experts_b1_kernel`, the same bits per expert); then each
    weighted output is rounded to float32 and they are added in float64 in the given order,
    exactly as `moeshard.moe.experts.compute.combine` adds the parts of `run_experts`, so the result
    has the same bits, without the Python work between (a decode step of a small model spent
    more time there than in the kernels)."""
    m = offsets.shape[0]
    y = np.empty((m, hidden), dtype=np.float32)  # [m, hidden]
    act = _activations(_halves(fmt)[0], int8, x)  # x quantised once for every expert
    for e in prange(m):
        record = arena[offsets[e] : offsets[e] + nbytes]
        _expert_b1(fmt, int8, record, hidden, inter, layout, lut, x, act, y[e], glu)
    return _weighted_total(y, w)


@njit(cache=True, nogil=True)
def experts_b1_sum_serial_kernel(
    fmt, int8, arena, offsets, nbytes, hidden, inter, layout, lut, x, w, glu
):
    """`experts_b1_sum_kernel` on the calling thread (the same bits), for small experts."""
    m = offsets.shape[0]
    y = np.empty((m, hidden), dtype=np.float32)  # [m, hidden]
    act = _activations(_halves(fmt)[0], int8, x)
    for e in range(m):
        record = arena[offsets[e] : offsets[e] + nbytes]
        _expert_b1(fmt, int8, record, hidden, inter, layout, lut, x, act, y[e], glu)
    return _weighted_total(y, w)


@njit(cache=True, nogil=True)
def group_by_expert(ids, weights, hidden):
    """The (row, slot) pairs of ids/weights [T, k] (ids < 0: no expert) ordered by expert,
    rows ascending within one (a counting sort), for `experts_rows_kernel`: (experts [m]
    ascending, starts [m + 1], rows [P], x [P, H] = hidden's rows in that order, w [P])."""
    t, k = ids.shape
    top = -1
    for r in range(t):
        for s in range(k):
            top = max(top, ids[r, s])
    counts = np.zeros(top + 2, dtype=np.int64)  # [E + 1]: pairs per expert, shifted by one
    for r in range(t):
        for s in range(k):
            if ids[r, s] >= 0:
                counts[ids[r, s] + 1] += 1
    at = np.cumsum(counts)  # [E + 1]: expert e's first pair at at[e]
    pairs = at[-1]
    rows = np.empty(pairs, dtype=np.int64)  # [P]
    w = np.empty(pairs, dtype=np.float32)  # [P]
    x = np.empty((pairs, hidden.shape[1]), dtype=np.float32)  # [P, H]
    fill = at[:-1].copy()  # [E]: the next free place of each expert
    for r in range(t):
        for s in range(k):
            e = ids[r, s]
            if e >= 0:
                j = fill[e]
                fill[e] += 1
                rows[j], w[j] = r, weights[r, s]
                x[j] = hidden[r]
    m = 0
    for e in range(top + 1):
        m += counts[e + 1] > 0
    experts = np.empty(m, dtype=np.int64)  # [m]
    starts = np.zeros(m + 1, dtype=np.int64)  # [m + 1]
    i = 0
    for e in range(top + 1):
        if counts[e + 1] > 0:
            experts[i] = e
            starts[i + 1] = at[e + 1]
            i += 1
    return experts, starts, rows, x, w


@njit(cache=True, nogil=True)
def accumulate_rows(out, rows, y, w):
    """out[rows[j]] += float64(float32(y[j] * w[j])) for j = 0, 1, ... in order: out float64
    [T, H], y float32 [N, H], w float32 [N] (what `moeshard.moe.experts.compute.combine` does with
    parts given expert by expert, the same bits, in one call)."""
    for j in range(rows.shape[0]):
        r, wj = rows[j], w[j]
        for c in range(y.shape[1]):
            out[r, c] += np.float64(y[j, c] * wj)


@njit(cache=True, nogil=True)
def _weighted_total(y, w):
    """sum_e float64(float32(y[e] * w[e])) in order e = 0, 1, ...: y [m, hidden] -> [hidden]."""
    total = np.zeros(y.shape[1], dtype=np.float64)  # [hidden]
    for e in range(y.shape[0]):
        for j in range(y.shape[1]):
            total[j] += np.float64(y[e, j] * w[e])
    return total


@njit(cache=True, nogil=True)
def f32_rows_at(table, ids):
    """Rows `ids` (int64 [n]) of a table of float32 bits (uint32 [R, C]) -> float32 [n, C]
    (`layout.float_rows_at`, and `Trunk.embed`'s: a decode step's embedding row, where a
    dozen numpy calls ran cold after a big model's layers)."""
    rows, cols = table.shape
    out = np.empty((ids.shape[0], cols), dtype=np.float32)  # [n, C]
    for i in range(ids.shape[0]):
        r = ids[i]
        if r < 0 or r >= rows:
            raise IndexError("row ids must be within the table")
        for j in range(cols):
            out[i, j] = np.uint32(table[r, j]).view(np.float32)
    return out


@njit(cache=True, nogil=True)
def bf16_rows_at(table, rows, cols, ids):
    """Rows `ids` (int64 [n]) of a rows x cols bf16 matrix in the kernel layout (uint16
    [groups, pieces, 4, 16]: `layout.float_rows_view`) -> float32 [n, cols], exactly."""
    if rows > BF16_GROUP * table.shape[0] or cols > BF16_PIECE * table.shape[1]:
        raise ValueError("the matrix is larger than its table")
    out = np.empty((ids.shape[0], cols), dtype=np.float32)  # [n, cols]
    for i in range(ids.shape[0]):
        r = ids[i]
        if r < 0 or r >= rows:
            raise IndexError("row ids must be within the table")
        g, k = r // BF16_GROUP, r % BF16_GROUP
        for j in range(cols):
            bits = np.uint32(table[g, j // BF16_PIECE, k, j % BF16_PIECE]) << 16
            out[i, j] = np.uint32(bits).view(np.float32)
    return out
