"""Numba kernels for the trunk's small operations: one call where numpy needs a dozen, and
no temporaries beyond a row.

Each kernel has a readable numpy twin in `moeshard.moe.model.layers` (`tests/test_fused_ops.py`
compares them; the families' files state the math with those):

* `rms_norm_rows`, `add_rms_norm`: bit-identical to `layers.rms_norm` (the same float32
  operations; the mean of squares is summed in numpy's own pairwise order, `_pairwise_sum`);
  `add_rms_norm` also does the residual add before it.
* `rope_inplace`: bit-identical to `layers.apply_partial_rope` (elementwise float32), in
  place.
* `attend_cache`: `layers.attend` against the KV cache without building a mask (a query at
  position p reads keys lo..p); the dot products are float32 in another order than BLAS's
  (last-bit differences): eight lanes (`_dot`, explicit vector lanes, as numba runs no SLP
  vectoriser: 2.3x faster than eight scalar sums for 64-wide heads), then summed pairwise.
  Keys go eight at a time for the scores (their lane sums in one transposed tree) and four
  at a time for the values (the output row loaded once for four value rows), each score and
  output element in the same order as one at a time, and head sizes 64 and 128 get the loops
  compiled for their size.  The softmax's exp is `fixedmath.exp` (the same bits on every
  CPU, where libm's is chosen by CPU at run time), in vectorised loops, its sum in four
  float64 chains (`_attend_head`; docs/kernels.md has the timings).
* `gqa_attention`: everything between a GQA layer's projections and its o_proj in one call:
  q/k norms, clip, RoPE, the KV-cache write and `attend_cache`; `gqa_attention_many` does
  it for several sequences (continuous batching), each on its own cache.
* `route_softmax_topk`: `Transformer.route`'s softmax, top-k (ties to the lower index, as a
  stable argsort) and renormalisation; libm's expf may differ from numpy's in the last bit.

Heads stay packed in rows: q [T, Hq*D], k and v [T, Hkv*D], as the projections make them;
the KV cache is [S, Hkv, D]. T = tokens in the call, S = positions, D = head size.

Kernels are serial (nogil; no parallel=True: with cache=True an njit function must not call
a parallel one, and these are microseconds of work), but for `gqa_attention_many` and
`attend_cache_parallel`, which Python calls: sequences, and a prefill's (query, head) pairs,
are independent, and at 16 sequences their attention is a sixth of a decode step, so they
share numba's threads. Compile time matters (the first run on a machine compiles them): no
array-to-array slice assignment, no reshape, and no constant passed to a helper (numba
compiles one variant per literal value). Loops index slices from 0 (`_norm_row` says why).
"""

from __future__ import annotations

import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.typed import List

from moeshard.moe.kernels import fixedmath
from moeshard.moe.kernels.dots import _V8F, F32X8, _splat, _vload, _vstore, _vzero, prefetch_span

QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_FULL = 0, 1, 2  # gqa_attention's qk_norm
QK_NORM_CODES = {"none": QK_NORM_NONE, "head": QK_NORM_HEAD, "full": QK_NORM_FULL}
PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE


@njit(cache=True, nogil=True)
def _block_sum(a, lo, n):
    """numpy's pairwise-sum leaf (n <= 128): eight interleaved partial sums, then the rest."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = lo + 8
    end = lo + n - n % 8
    while i < end:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        res += a[i]
        i += 1
    return res


@njit(cache=True, nogil=True)
def _pairwise_sum(a):
    """float32 sum of a 1-D float32 array in numpy's pairwise order, so it rounds exactly as
    `np.sum` of a float32 row does.

    numpy recurses: n <= 128 is a leaf (`_block_sum`), else the first n2 = n // 2 rounded down
    to a multiple of 8 and the rest are summed separately and added. Here the same tree is
    walked with an explicit stack (numba's cache and recursive functions do not mix). No
    constant is passed to a helper: numba would compile a variant per literal value.
    A tree of one leaf (every head, router and small row) or two (a row of 129-248 or 256)
    allocates nothing."""
    n = a.shape[0]
    if n <= PAIRWISE_BLOCK:  # the tree is one leaf
        return _block_sum(a, 0, n)
    half = n // 2 - n // 2 % 8
    if n - half <= PAIRWISE_BLOCK:  # two leaves
        return _block_sum(a, 0, half) + _block_sum(a, half, n - half)
    los = np.empty(64, dtype=np.int64)  # pending nodes: start, length, halves queued
    ns = np.empty(64, dtype=np.int64)
    queued = np.zeros(64, dtype=np.bool_)
    values = np.empty(64, dtype=np.float32)  # finished subtrees, left before right
    los[0], ns[0] = 0, a.shape[0]
    top, nv = 1, 0
    while top > 0:
        top -= 1
        start, m = los[top], ns[top]
        if m <= PAIRWISE_BLOCK:
            values[nv] = _block_sum(a, start, m)
            nv += 1
        elif queued[top]:
            values[nv - 2] = values[nv - 2] + values[nv - 1]
            nv -= 1
        else:
            m2 = m // 2
            m2 -= m2 % 8
            queued[top] = True  # added up once both halves are done
            los[top + 1], ns[top + 1], queued[top + 1] = start + m2, m - m2, False  # right
            los[top + 2], ns[top + 2], queued[top + 2] = start, m2, False  # left, done first
            top += 3
    return values[0]


@njit(cache=True, nogil=True)
def _norm_row(x, lo, d, weight, eps, out, squares):
    """out[lo:lo+d] = weight * (x / sqrt(mean(x^2) + eps)) for x = x[lo:lo+d] (out may be x);
    squares float32 [d] is scratch (the caller's, made once for all its rows).  The loops
    index slices from 0 (with x[lo + j] numba's negative-index check stayed in the loop and
    kept it scalar) and, in place, the result goes through the scratch (LLVM's vector loop
    is skipped when the arrays it writes and reads overlap): 2-3x faster, the same bits.
    out is x or disjoint from it (every caller's)."""
    xs, outs = x[lo : lo + d], out[lo : lo + d]  # [d] each
    for j in range(d):
        squares[j] = xs[j] * xs[j]
    variance = _pairwise_sum(squares) / np.float32(d)
    denom = np.sqrt(variance + eps)
    if xs.ctypes.data != outs.ctypes.data:
        for j in range(d):
            outs[j] = weight[j] * (xs[j] / denom)
        return
    for j in range(d):
        squares[j] = weight[j] * (xs[j] / denom)
    for j in range(d):
        outs[j] = squares[j]


@njit(cache=True, nogil=True)
def rms_norm_rows(x, weight, eps, out):
    """RMSNorm of every d-wide segment of every row: x [N, k*d] with weight [d] -> out (out
    may be x). weight [D] normalises whole rows; weight [D / heads] each head."""
    e = np.float32(eps)
    d = weight.shape[0]
    squares = np.empty(d, dtype=np.float32)  # [d], scratch
    for r in range(x.shape[0]):
        xr, outr = x[r], out[r]
        for lo in range(0, x.shape[1], d):
            _norm_row(xr, lo, d, weight, e, outr, squares)


@njit(cache=True, nogil=True)
def add_rms_norm(x, delta, weight, eps, out):
    """The residual add and the next norm: x += delta, then out = RMSNorm(x); x, delta, out
    [T, H] float32 (x is updated in place)."""
    for r in range(x.shape[0]):
        xr, dr = x[r], delta[r]
        for j in range(xr.shape[0]):
            xr[j] = xr[j] + dr[j]
    rms_norm_rows(x, weight, eps, out)


@njit(cache=True, nogil=True)
def rope_inplace(x, dim, cos, sin, interleave):
    """Rotate every dim-wide head of x [T, heads*dim] in place by cos/sin [T, rot/2]
    (`layers.apply_partial_rope` on x viewed as [T, heads, dim]): the first rot = 2 *
    cos.shape[1] dims of each head turn, the others pass (partial RoPE, GLM-4.5's
    partial_rotary_factor; rot = dim for every other family).

    Non-interleaved pairs (i, i + rot/2); interleaved pairs (2i, 2i+1), written de-interleaved
    ([rotated evens, rotated odds]) as transformers does for DeepSeek."""
    half = cos.shape[1]
    tmp = np.empty(2 * half, dtype=np.float32)  # [rot]
    for t in range(x.shape[0]):
        row, ct, st = x[t], cos[t], sin[t]
        for lo in range(0, x.shape[1], dim):
            head = row[lo : lo + 2 * half]  # [rot] (slices indexed from 0: see `_norm_row`)
            for j in range(2 * half):
                tmp[j] = head[j]
            if interleave:
                for i in range(half):
                    x1, x2 = tmp[2 * i], tmp[2 * i + 1]
                    head[i] = x1 * ct[i] - x2 * st[i]
                    head[i + half] = x2 * ct[i] + x1 * st[i]
            else:
                for i in range(half):
                    x1, x2 = tmp[i], tmp[i + half]
                    head[i] = x1 * ct[i] - x2 * st[i]
                    head[i + half] = x2 * ct[i] + x1 * st[i]


@intrinsic
def _vmuladd(typingctx, a, b, acc):
    """acc + a * b in eight float32 lanes: a multiply and an add, each rounded (no FMA)."""
    if not (a == b == acc == F32X8):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[2], builder.fmul(args[0], args[1]))

    return F32X8(a, b, acc), codegen


@intrinsic
def _vsplat(typingctx, x):
    """Eight copies of the float32 x."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, args[0])

    return F32X8(x), codegen


@intrinsic
def _pair_tree_sum(typingctx, v):
    """((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) of eight float32 lanes."""
    if v != F32X8:
        return None

    def codegen(context, builder, sig, args):
        lane = [builder.extract_element(args[0], ir.IntType(32)(i)) for i in range(8)]
        pairs = [builder.fadd(lane[i], lane[i + 1]) for i in range(0, 8, 2)]
        return builder.fadd(builder.fadd(pairs[0], pairs[1]), builder.fadd(pairs[2], pairs[3]))

    return types.float32(v), codegen


@intrinsic
def _pair_tree_sums8(typingctx, c0, c1, c2, c3, c4, c5, c6, c7):
    """`_pair_tree_sum` of eight vectors at once -> their eight sums in one vector's lanes,
    each added in the same order as alone: lane pairs first (two vectors' pairs per add),
    then pairs of pairs, then the two halves; 14 shuffles and 7 adds for 56 scalar adds."""
    if not all(c == F32X8 for c in (c0, c1, c2, c3, c4, c5, c6, c7)):
        return None

    def codegen(context, builder, sig, args):
        def pick(a, b, lanes):
            return builder.shuffle_vector(
                a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), lanes)
            )

        def pairs(a, b):  # [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
            return builder.fadd(
                pick(a, b, [0, 2, 8, 10, 4, 6, 12, 14]), pick(a, b, [1, 3, 9, 11, 5, 7, 13, 15])
            )

        c = args
        h01, h23, h45, h67 = (
            pairs(c[0], c[1]),
            pairs(c[2], c[3]),
            pairs(c[4], c[5]),
            pairs(c[6], c[7]),
        )
        g0, g1 = pairs(h01, h23), pairs(h45, h67)  # lane i: vector i's (01)+(23), or (45)+(67)
        return builder.fadd(
            pick(g0, g1, [0, 1, 2, 3, 8, 9, 10, 11]), pick(g0, g1, [4, 5, 6, 7, 12, 13, 14, 15])
        )

    return F32X8(c0, c1, c2, c3, c4, c5, c6, c7), codegen


@intrinsic
def _vscale(typingctx, v, x):
    """v * x in eight float32 lanes (each the scalar product's bits)."""
    if not (v == F32X8 and x == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], _splat(builder, args[1]))

    return F32X8(v, x), codegen


@intrinsic
def _vmax_gt(typingctx, a, b):
    """Lane by lane, b where b > a, else a: a running maximum that skips nan, as `>` does."""
    if not (a == b == F32X8):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[1], args[0]), args[1], args[0])

    return F32X8(a, b), codegen


@intrinsic
def _lane(typingctx, v, i):
    """Lane i of eight float32 lanes."""
    if not (v == F32X8 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float32(v, i), codegen


@intrinsic
def _vload_kv(typingctx, cache, s, h, j):
    """cache[s, h, j : j + 8] of a KV cache (float32 [S, H, D], C order), read in place: a
    view `cache[s, h]` per position cost two atomic reference-count updates, 28% of a prefill's
    attention at 128-wide heads."""
    if not (
        isinstance(cache, types.Array)
        and cache.ndim == 3
        and cache.layout == "C"
        and cache.dtype == types.float32
        and all(isinstance(i, types.Integer) for i in (s, h, j))
    ):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        _, heads, width = cgutils.unpack_tuple(builder, ary.shape, 3)
        s_, h_, j_ = (
            context.cast(builder, a, t, types.intp)
            for a, t in zip(args[1:], sig.args[1:], strict=True)
        )
        index = builder.add(builder.mul(builder.add(builder.mul(s_, heads), h_), width), j_)
        ptr = builder.bitcast(builder.gep(ary.data, [index]), _V8F.as_pointer())
        return builder.load(ptr, align=4)

    return F32X8(cache, s, h, j), codegen


@njit(cache=True, nogil=True)
def _dot(a, a0, kc, s, kv, n):
    """float32 dot product of a[a0:a0+n] and kc[s, kv, :n] (a 1-D C row, a KV cache): eight
    partial sums, lane l taking the products j = l mod 8 in order, added pairwise, then the
    tail in order."""
    acc = _vzero()
    m = n - n % 8
    for j in range(0, m, 8):
        acc = _vmuladd(_vload(a, a0 + j), _vload_kv(kc, s, kv, j), acc)
    total = _pair_tree_sum(acc)
    for j in range(m, n):
        total += a[a0 + j] * kc[s, kv, j]
    return total


@njit(cache=True, nogil=True)
def _add_scaled(out, o0, p, vc, s, kv, n):
    """out[o0:o0+n] += p * vc[s, kv, :n], elementwise (a multiply and an add each)."""
    m = n - n % 8
    ps = _vsplat(p)
    for j in range(0, m, 8):
        _vstore(out, o0 + j, _vmuladd(ps, _vload_kv(vc, s, kv, j), _vload(out, o0 + j)))
    for j in range(m, n):
        out[o0 + j] += p * vc[s, kv, j]


@njit(cache=True, nogil=True)
def _dots4(a, a0, kc, s, kv, n):
    """`_dot` of a[a0:a0+n] with the four positions s .. s + 3 at once, each the same bits as
    alone: four independent accumulator chains keep the adder busy where one chain waits on
    itself."""
    c0, c1, c2, c3 = _vzero(), _vzero(), _vzero(), _vzero()
    m = n - n % 8
    for j in range(0, m, 8):
        x = _vload(a, a0 + j)
        c0 = _vmuladd(x, _vload_kv(kc, s, kv, j), c0)
        c1 = _vmuladd(x, _vload_kv(kc, s + 1, kv, j), c1)
        c2 = _vmuladd(x, _vload_kv(kc, s + 2, kv, j), c2)
        c3 = _vmuladd(x, _vload_kv(kc, s + 3, kv, j), c3)
    t0, t1 = _pair_tree_sum(c0), _pair_tree_sum(c1)
    t2, t3 = _pair_tree_sum(c2), _pair_tree_sum(c3)
    for j in range(m, n):
        xj = a[a0 + j]
        t0 += xj * kc[s, kv, j]
        t1 += xj * kc[s + 1, kv, j]
        t2 += xj * kc[s + 2, kv, j]
        t3 += xj * kc[s + 3, kv, j]
    return t0, t1, t2, t3


@njit(cache=True, nogil=True)
def _dots8(a, a0, kc, s, kv, n):
    """`_dot` of a[a0:a0+n] with the eight positions s .. s + 7 -> their eight results in one
    vector, each the same bits as alone (n a multiple of 8: no tail): eight accumulator
    chains, and their lane sums in one transposed tree (`_pair_tree_sums8`)."""
    c0, c1, c2, c3 = _vzero(), _vzero(), _vzero(), _vzero()
    c4, c5, c6, c7 = _vzero(), _vzero(), _vzero(), _vzero()
    for j in range(0, n, 8):
        x = _vload(a, a0 + j)
        c0 = _vmuladd(x, _vload_kv(kc, s, kv, j), c0)
        c1 = _vmuladd(x, _vload_kv(kc, s + 1, kv, j), c1)
        c2 = _vmuladd(x, _vload_kv(kc, s + 2, kv, j), c2)
        c3 = _vmuladd(x, _vload_kv(kc, s + 3, kv, j), c3)
        c4 = _vmuladd(x, _vload_kv(kc, s + 4, kv, j), c4)
        c5 = _vmuladd(x, _vload_kv(kc, s + 5, kv, j), c5)
        c6 = _vmuladd(x, _vload_kv(kc, s + 6, kv, j), c6)
        c7 = _vmuladd(x, _vload_kv(kc, s + 7, kv, j), c7)
    return _pair_tree_sums8(c0, c1, c2, c3, c4, c5, c6, c7)


@njit(cache=True, nogil=True)
def _best(scores, lo, end):
    """The largest of scores[lo:end] (nan skipped, as a loop of `>` skips it), eight lanes
    at a time: a maximum is the same value in any order."""
    m = lo + (end - lo) // 8 * 8
    best = np.float32(-np.inf)
    if m > lo:
        lanes = _vload(scores, lo)
        for s in range(lo + 8, m, 8):
            lanes = _vmax_gt(lanes, _vload(scores, s))
        for i in range(8):
            if _lane(lanes, i) > best:
                best = _lane(lanes, i)
    for s in range(m, end):
        if scores[s] > best:
            best = scores[s]
    return best


@njit(cache=True, nogil=True, error_model="numpy")
def _exp_less(scores, lo, end, best):
    """scores[s] = exp(scores[s] - best) for s in lo..end-1: the float32 difference, exp in
    float64 by `fixedmath.exp` (the same bits on every CPU; libm's expf is picked by CPU at
    run time), rounded to float32.  A loop LLVM vectorises (no libm call in it)."""
    seg = scores[lo:end]  # (indexed from 0: see `_norm_row`)
    for j in range(seg.shape[0]):
        seg[j] = np.float32(fixedmath.exp(np.float64(seg[j] - best)))


@njit(cache=True, nogil=True)
def _total(scores, lo, end, first):
    """first + the sum of scores[lo:end] in float64: four running sums (position lo + j in
    sum j mod 4, the first starting from `first`), added as (s0 + s1) + (s2 + s3), then the
    last 0-3 in order.  Four chains, where one waited on its own adds."""
    seg = scores[lo:end]
    n = seg.shape[0]
    s0, s1, s2, s3 = first, 0.0, 0.0, 0.0
    for j in range(0, n - n % 4, 4):
        s0 += seg[j]
        s1 += seg[j + 1]
        s2 += seg[j + 2]
        s3 += seg[j + 3]
    total = (s0 + s1) + (s2 + s3)
    for j in range(n - n % 4, n):
        total += seg[j]
    return total


@njit(cache=True, nogil=True, error_model="numpy")
def _divide(scores, lo, end, total):
    """scores[s] = float32(scores[s] / total) (float64 division) for s in lo..end-1."""
    seg = scores[lo:end]
    for j in range(seg.shape[0]):
        seg[j] = np.float32(seg[j] / total)


@njit(cache=True, nogil=True)
def _add_scaled4(out, o0, p0, p1, p2, p3, vc, s, kv, n):
    """`_add_scaled` of the four positions s .. s + 3 in turn (out += p0 vc[s, kv], then p1
    vc[s + 1, kv], ...), the same bits, with out loaded and stored once instead of four
    times."""
    m = n - n % 8
    s0, s1, s2, s3 = _vsplat(p0), _vsplat(p1), _vsplat(p2), _vsplat(p3)
    for j in range(0, m, 8):
        acc = _vmuladd(s0, _vload_kv(vc, s, kv, j), _vload(out, o0 + j))
        acc = _vmuladd(s1, _vload_kv(vc, s + 1, kv, j), acc)
        acc = _vmuladd(s2, _vload_kv(vc, s + 2, kv, j), acc)
        _vstore(out, o0 + j, _vmuladd(s3, _vload_kv(vc, s + 3, kv, j), acc))
    for j in range(m, n):
        acc = out[o0 + j] + p0 * vc[s, kv, j]
        acc = (acc + p1 * vc[s + 1, kv, j]) + p2 * vc[s + 2, kv, j]
        out[o0 + j] = acc + p3 * vc[s + 3, kv, j]


@njit(cache=True, nogil=True, inline="always")
def _attend_head(qt, a0, kc, vc, kv, lo, pos, scale, sink, scores, ot, o0, d, dv):
    """One query head (q at qt[a0:a0+d]) against kv head kv of the cache at positions lo..pos
    -> ot[o0:o0+dv]; scores float32 [> pos] is scratch.  sink > -inf is the head's attention
    sink (gpt-oss): one more logit in the softmax's denominator, with no value.

    Scores go eight positions at a time where d is a multiple of 8 (`_dots8`), else four
    (`_dots4`), then one at a time; the weighted values four at a time (`_add_scaled4`),
    then one: every score and every output element gets the same operations in the same
    order either way.  The softmax: the largest score, exp(score - largest) (`_exp_less`),
    their sum in float64 (`_total`, the sink's term first), each divided by it in float64
    and rounded to float32 (`_divide`)."""
    end = pos + 1
    octs = lo + (end - lo) // 8 * 8 if d % 8 == 0 else lo  # lo..octs-1 go eight at a time
    for s in range(lo, octs, 8):
        _vstore(scores, s, _vscale(_dots8(qt, a0, kc, s, kv, d), scale))
    quads = octs + (end - octs) // 4 * 4  # then octs..quads-1 four at a time
    for s in range(octs, quads, 4):
        d0, d1, d2, d3 = _dots4(qt, a0, kc, s, kv, d)
        scores[s], scores[s + 1] = d0 * scale, d1 * scale
        scores[s + 2], scores[s + 3] = d2 * scale, d3 * scale
    for s in range(quads, end):
        scores[s] = _dot(qt, a0, kc, s, kv, d) * scale
    best = _best(scores, lo, end)
    if sink > best:
        best = sink
    first = 0.0  # the sink's term, or none
    if sink > -np.inf:
        first = np.float64(np.float32(fixedmath.exp(np.float64(sink - best))))
    _exp_less(scores, lo, end, best)
    _divide(scores, lo, end, _total(scores, lo, end, first))
    for j in range(dv):
        ot[o0 + j] = np.float32(0.0)
    quads = lo + (end - lo) // 4 * 4
    for s in range(lo, quads, 4):
        _add_scaled4(ot, o0, scores[s], scores[s + 1], scores[s + 2], scores[s + 3], vc, s, kv, dv)
    for s in range(quads, end):
        _add_scaled(ot, o0, scores[s], vc, s, kv, dv)


@njit(cache=True, nogil=True)
def attend_cache(q, kc, vc, start, scaling, window, sinks, out):
    """Causal GQA attention of T queries against the KV cache.

    q [T, Hq*D] at absolute positions start..start+T-1; kc [>= start+T, Hkv, D] and vc
    [>= start+T, Hkv, Dv] hold every position up to and including the queries'; out
    [T, Hq*Dv]. Query head h reads kv head h // (Hq / Hkv). The query at position p sees keys
    lo..p, lo = max(0, p - window + 1) when window > 0 (transformers: q - k < window).
    sinks float32 [Hq] are the heads' attention sinks (gpt-oss), or [0] for none.

    The usual head sizes (64, 128) get `_attend_head` compiled for that size: its loops with
    a known trip count ran 2-3x faster than the same loops over a size known only at run time."""
    t_n = q.shape[0]
    n_q = q.shape[1] // kc.shape[2]
    group = n_q // kc.shape[1]
    scale = np.float32(scaling)
    scores = np.empty(start + t_n, dtype=np.float32)  # [S]
    for t in range(t_n):
        pos = start + t
        lo = max(0, pos - window + 1) if window > 0 else 0
        for h in range(n_q):
            _attend_one(q[t], kc, vc, h, group, lo, pos, scale, sinks, scores, out[t])


@njit(cache=True, nogil=True)
def _attend_one(qt, kc, vc, h, group, lo, pos, scale, sinks, scores, ot):
    """Query head h of one row qt against kv head h // group at positions lo..pos -> ot's
    head h, by `_attend_head` compiled for the usual head sizes (see `attend_cache`)."""
    d, dv = kc.shape[2], vc.shape[2]
    a0, kv, o0 = h * d, h // group, h * dv
    sink = sinks[h] if sinks.shape[0] else np.float32(-np.inf)
    if d == 64 and dv == 64:
        _attend_head(qt, a0, kc, vc, kv, lo, pos, scale, sink, scores, ot, o0, 64, 64)
    elif d == 128 and dv == 128:
        _attend_head(qt, a0, kc, vc, kv, lo, pos, scale, sink, scores, ot, o0, 128, 128)
    else:
        _attend_head(qt, a0, kc, vc, kv, lo, pos, scale, sink, scores, ot, o0, d, dv)


@njit(cache=True, nogil=True)
def _clip(z, clip):
    """Clamp z [T, n] to [-clip, clip] in place (np.clip with a float32 bound)."""
    c = np.float32(clip)
    for r in range(z.shape[0]):
        for j in range(z.shape[1]):
            z[r, j] = min(max(z[r, j], -c), c)


@njit(cache=True, nogil=True, parallel=True)
def attend_cache_parallel(q, kc, vc, start, scaling, window, sinks, out):
    """`attend_cache` with its (query, head) pairs split across numba's threads (a prefill,
    a long context): each pair gets the same `_attend_head`, so the same bits.

    numba gives each thread one contiguous share of a prange, and a later query attends to
    more positions: in query order, the second of two threads had three times the first's
    work.  Iteration 2i runs pair i and 2i + 1 pair n - 1 - i, so every two iterations
    together attend to the same number of positions (without a window; about the same with
    one), whatever the shares."""
    n = q.shape[0] * (q.shape[1] // kc.shape[2])
    for it in prange(n):
        i = np.int64(it)  # (prange counts in uint64)
        pair = i // 2 if i % 2 == 0 else n - 1 - i // 2
        attend_pair(q, kc, vc, start, scaling, window, sinks, out, pair)


@njit(cache=True, nogil=True)
def attend_pair(q, kc, vc, start, scaling, window, sinks, out, i):
    """Pair i = t * heads + h of `attend_cache_parallel`: query row t's head h against the
    cache (`_attend_head`, as `attend_cache` gives it), into out[t]."""
    n_q = q.shape[1] // kc.shape[2]
    t, h = i // n_q, i % n_q
    pos = start + t
    lo = max(0, pos - window + 1) if window > 0 else 0
    scores = np.empty(pos + 1, dtype=np.float32)  # [S]: this pair's scratch
    group = n_q // kc.shape[1]
    _attend_one(q[t], kc, vc, h, group, lo, pos, np.float32(scaling), sinks, scores, out[t])


@njit(cache=True, nogil=True)
def gqa_attention(
    q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, kc, vc, start, scaling, window, sinks,
    out,
):  # fmt: skip
    """Everything between a GQA layer's projections and its o_proj, for T new tokens.

    q [T, Hq*D], k and v [T, Hkv*D] (modified in place): `gqa_prepare`, then `attend_cache`
    -> out [T, Hq*D]."""
    gqa_prepare(q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, kc, vc, start)
    attend_cache(q, kc, vc, start, scaling, window, sinks, out)


@njit(cache=True, nogil=True)
def gqa_prepare(q, k, v, q_norm, k_norm, qk_norm, eps, clip, cos, sin, kc, vc, start):
    """q [T, Hq*D], k and v [T, Hkv*D] (modified in place): qk_norm QK_NORM_FULL normalises
    the whole projections (q_norm [Hq*D], k_norm [Hkv*D]), then clip > 0 clamps q, k, v to
    [-clip, clip], QK_NORM_HEAD normalises each head (q_norm, k_norm [D]); then RoPE
    (non-interleaved, cos/sin [T, R/2]: the first R of each head's D dims, R = D but for a
    partial rotary factor), and k and v written to the cache kc, vc [S, Hkv, D] at
    start..start+T-1."""
    n_kv, d = kc.shape[1], kc.shape[2]
    if qk_norm == QK_NORM_FULL:
        rms_norm_rows(q, q_norm, eps, q)  # q_norm [Hq*D]: whole rows
        rms_norm_rows(k, k_norm, eps, k)
    if clip > 0:
        _clip(q, clip)
        _clip(k, clip)
        _clip(v, clip)
    if qk_norm == QK_NORM_HEAD:
        rms_norm_rows(q, q_norm, eps, q)  # q_norm [D]: every head
        rms_norm_rows(k, k_norm, eps, k)
    interleave = qk_norm < 0  # (always False: a variable, not a constant, see _pairwise_sum)
    rope_inplace(q, d, cos, sin, interleave)
    rope_inplace(k, d, cos, sin, interleave)
    for t in range(q.shape[0]):
        for h in range(n_kv):
            k_at, v_at = kc[start + t, h], vc[start + t, h]  # [D] each
            k_head, v_head = k[t, h * d : (h + 1) * d], v[t, h * d : (h + 1) * d]  # [D] each
            for j in range(d):
                k_at[j] = k_head[j]
                v_at[j] = v_head[j]


@njit(cache=True, nogil=True, parallel=True)
def gqa_attention_many(
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
    kcs,
    vcs,
    starts,
    bounds,
    scaling,
    window,
    sinks,
    out,
):
    """`gqa_attention` for several sequences in one call (continuous batching): sequence s
    is rows bounds[s]:bounds[s + 1] of q, k, v, cos, sin and out, with its own cache kcs[s],
    vcs[s] (numba typed lists) filled to starts[s].  Each sequence's rows get exactly what
    `gqa_attention` gives them alone: one call instead of one per sequence and layer, the
    sequences split among numba's threads (the caller sets how many).

    Each sequence's cache rows were last read a whole step ago, so they come from DRAM, a
    position at a time; the next sequence's are asked for (`prefetch_cached`) while this
    one's attention runs."""
    n = bounds.shape[0] - 1
    for it in prange(n):
        s = np.int64(it)  # (prange counts in uint64)
        if s + 1 < n:
            prefetch_cached(kcs[s + 1], vcs[s + 1], starts[s + 1], window)
        r0, r1 = bounds[s], bounds[s + 1]
        gqa_attention(
            q[r0:r1], k[r0:r1], v[r0:r1], q_norm, k_norm, qk_norm, eps, clip, cos[r0:r1],
            sin[r0:r1], kcs[s], vcs[s], starts[s], scaling, window, sinks, out[r0:r1],
        )  # fmt: skip


# How much of a KV cache (each of k and v) `prefetch_cached` asks for: the attention's
# first positions; beyond them the reads stream well enough on their own.
PREFETCH_KV_BYTES = 1 << 18


@njit(cache=True, nogil=True)
def prefetch_cached(kc, vc, start, window):
    """Ask for the cache rows kc, vc [S, Hkv, D] a decode row at position `start` attends
    to (from its window's first position), up to PREFETCH_KV_BYTES of each, and return at
    once: nothing changes but what is in cache."""
    row = kc.shape[1] * kc.shape[2] * 4  # bytes of one position's keys (or values)
    first = max(0, start - window + 1) * row if window > 0 else 0
    end = min(start * row, first + PREFETCH_KV_BYTES)
    prefetch_span(kc, first, end)
    prefetch_span(vc, first, end)


@njit(cache=True, nogil=True)
def route_softmax_topk(logits, k, renorm):
    """Softmax router: logits [T, E] -> (expert ids int64 [T, k] best first, weights float32
    [T, k]); ties go to the lower expert id; renorm: the k weights are divided by their sum."""
    t_n, n_e = logits.shape
    ids = np.empty((t_n, k), dtype=np.int64)  # [T, k]
    weights = np.empty((t_n, k), dtype=np.float32)  # [T, k]
    probs = np.empty(n_e, dtype=np.float32)  # [E]
    taken = np.zeros(n_e, dtype=np.bool_)  # [E]
    for t in range(t_n):
        row = logits[t]
        m = row[0]
        for j in range(1, n_e):
            if row[j] > m:
                m = row[j]
        for j in range(n_e):
            probs[j] = np.exp(row[j] - m)
        total = _pairwise_sum(probs)
        for j in range(n_e):
            probs[j] = probs[j] / total
            taken[j] = False
        for slot in range(k):
            best = -1
            for j in range(n_e):
                if not taken[j] and (best < 0 or probs[j] > probs[best]):
                    best = j
            taken[best] = True
            ids[t, slot] = best
            weights[t, slot] = probs[best]
        if renorm:
            s = _pairwise_sum(weights[t])
            for slot in range(k):
                weights[t, slot] = weights[t, slot] / s
    return ids, weights


_warm = False


def warmup() -> float:
    """Compile (or load from numba's cache) every kernel for the argument types the forward
    pass uses, once per process; returns seconds (0 after the first call)."""
    global _warm
    if _warm:
        return 0.0
    t0 = time.perf_counter()
    t, d, n_kv, n_q = 1, 8, 1, 2
    x, w = np.ones((t, 2 * d), np.float32), np.ones(2 * d, np.float32)  # [T, H], [H]
    out = np.empty_like(x)
    rms_norm_rows(x, w, 1e-6, out)
    add_rms_norm(x, out, w, 1e-6, out)
    q, k, v = (np.ones((t, n * d), np.float32) for n in (n_q, n_kv, n_kv))
    cos, sin = np.ones((t, d // 2), np.float32), np.zeros((t, d // 2), np.float32)
    kc, vc = np.zeros((4, n_kv, d), np.float32), np.zeros((4, n_kv, d), np.float32)
    none = np.zeros(0, np.float32)
    gqa_attention(
        q, k, v, none, none, QK_NORM_NONE, 1e-6, 0.0, cos, sin, kc, vc, 0, 0.5, 0, none,
        np.empty_like(q),
    )  # fmt: skip
    gqa_prepare(q, k, v, none, none, QK_NORM_NONE, 1e-6, 0.0, cos, sin, kc, vc, 0)
    attend_cache_parallel(q, kc, vc, 0, 0.5, 0, none, np.empty_like(q))
    kcs, vcs = List([kc]), List([vc])
    starts, bounds = np.zeros(1, np.int64), np.array([0, t], np.int64)
    gqa_attention_many(
        q, k, v, none, none, QK_NORM_NONE, 1e-6, 0.0, cos, sin, kcs, vcs, starts, bounds, 0.5, 0,
        none, np.empty_like(q),
    )  # fmt: skip
    route_softmax_topk(np.zeros((t, 4), np.float32), 2, True)
    from moeshard.moe.model import fused_layer  # (it builds on this module's kernels)

    fused_layer.warmup()  # a decode row's layer in one call
    _warm = True
    return time.perf_counter() - t0
