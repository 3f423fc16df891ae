"""Per-row bit-determinism of the packed-weight kernels: a row's result never depends on the batch.

A node's reply for one expert and one activation row must be the same bits whatever else was
in the call (how many rows, in which order, how many threads), so the sharded network's logits
equal one machine's and an auditor can re-run a call elsewhere and expect equal bits.  For
q4_0/q8_0 the kernels must also equal, bit for bit, a numpy float32 emulation of the arithmetic
documented in `moeshard.moe.kernels.dots` (8 lanes, per-block sums scaled once, never an FMA, a
fixed halving tree): that pins the arithmetic itself, not just its consistency.  Both ways of taking
activations are pinned: the default 8-bit one with integer dot products
(`moeshard.moe.kernels.idots`) and exact float32 (`quant.use_activations("f32")`); and the
f32/bf16 rows of `moeshard.moe.kernels.fdots`.
See docs/kernels.md.
"""

import numba
import numpy as np
import pytest

from moeshard.moe.kernels import entry, quant

BATCHES = (1, 2, 3, 4, 5, 7, 8, 17, 33)
# (rows, cols): one block; odd block counts (3, 5, 65, 129: the q4_0 tail block, also after
# several column tiles of the batched kernel); rows that are not multiples of 4 or 16.
MATMUL_SHAPES = [
    (1, 32),
    (5, 96),
    (7, 160),
    (19, 64),
    (37, 2080),
    (130, 512),
    (21, 4128),
    (9, 2048),
]
# (hidden, inter): odd block counts both ways, and one odd count past several column tiles.
FFN_SHAPES = [(96, 160), (160, 96), (2080, 96)]
THREADS = (1, 2)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 bit patterns (so -0.0 != 0.0 and nan == nan of the same payload)."""
    a, b = np.asarray(a), np.asarray(b)
    return (
        a.dtype == b.dtype == np.float32
        and a.shape == b.shape
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian weights, rows scaled over four decades (block scales of every size), a zero
    row and a zero block."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)  # [rows, cols]
    w *= (10.0 ** rng.uniform(-2, 2, rows)).astype(np.float32)[:, None]
    w[rows // 2] = 0.0
    w[-1, :32] = 0.0
    return w


def activations(b: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, cols)).astype(np.float32)  # [b, cols]
    return x * (10.0 ** rng.uniform(-1, 1, b)).astype(np.float32)[:, None]


@pytest.fixture(params=quant.ACTIVATIONS, autouse=True)
def mode(request):
    """Every test runs with each way of taking q4_0/q8_0 activations (f32/bf16 ignore it)."""
    quant.use_activations(request.param)
    yield request.param
    quant.use_activations("q8")


@pytest.fixture
def run(monkeypatch):
    """run(n_threads, fn, *args): fn through the parallel drivers on n numba threads
    (n_threads=0: on the calling thread, the way `quant` runs small matrices)."""

    def call(n_threads, fn, *args):
        if n_threads > numba.config.NUMBA_NUM_THREADS:
            pytest.skip(f"numba has only {numba.config.NUMBA_NUM_THREADS} threads")
        monkeypatch.setattr(quant, "PARALLEL_MIN_WEIGHTS", 0 if n_threads else 1 << 62)
        quant.set_threads(max(1, n_threads))
        try:
            return fn(*args)
        finally:
            quant.set_threads(0)

    return call


def check_rows_independent(call, singles: np.ndarray, x: np.ndarray, n_threads: int) -> None:
    """call(x') for every batch size, two windows and a permutation of each: row i of every
    result must be singles[i] (the row computed alone) bit for bit."""
    rng = np.random.default_rng(7)
    for b in BATCHES:
        for start in {0, x.shape[0] - b}:
            want = singles[start : start + b]  # [b, out]
            got = call(x[start : start + b])
            assert same_bits(got, want), (b, start, n_threads, np.abs(got - want).max())
            perm = rng.permutation(b)
            got = call(x[start : start + b][perm])
            assert same_bits(got, want[perm]), (b, start, n_threads, "permuted")


def check_matmul_rows_independent(fmt, shapes, n_threads: int, run) -> None:
    """`check_rows_independent` for `quant.matmul` on a packed matrix of each (rows, cols)."""
    for rows, cols in shapes:
        data = quant.pack(weights(rows, cols, seed=rows + cols), fmt)
        x = activations(max(BATCHES) + 3, cols, seed=cols)  # [36, cols]
        singles = np.concatenate(
            [run(0, quant.matmul, data, fmt, rows, cols, x[i : i + 1]) for i in range(len(x))]
        )  # [36, rows]

        def call(xb, data=data, rows=rows, cols=cols):
            return run(n_threads, quant.matmul, data, fmt, rows, cols, xb)

        check_rows_independent(call, singles, x, n_threads)


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_matmul_row_does_not_depend_on_batch(fmt, n_threads, run):
    check_matmul_rows_independent(fmt, MATMUL_SHAPES, n_threads, run)


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_float_rows_with_a_column_tail_do_not_depend_on_batch(fmt, n_threads, run):
    """f32/bf16 rows of any width: columns past the last 16 (summed one by one), and widths
    on both sides of `fdots.NARROW_COLS` (four activation rows at a time at or below it)."""
    from moeshard.moe.kernels.fdots import NARROW_COLS

    shapes = [(5, 40), (3, 264), (9, NARROW_COLS), (6, NARROW_COLS + 8), (4, 8)]
    check_matmul_rows_independent(fmt, shapes, n_threads, run)


def expert_record(fmt: str, hidden: int, inter: int, seed: int) -> np.ndarray:
    gate = weights(inter, hidden, seed) * np.float32(0.05)
    up = weights(inter, hidden, seed + 1) * np.float32(0.05)
    down = weights(hidden, inter, seed + 2) * np.float32(0.05)
    return quant.pack_expert(gate, up, down, fmt)


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_expert_ffn_row_does_not_depend_on_batch(fmt, n_threads, run):
    for hidden, inter in FFN_SHAPES:
        rec = expert_record(fmt, hidden, inter, seed=hidden + inter)
        x = activations(max(BATCHES) + 3, hidden, seed=inter)  # [36, hidden]
        singles = np.concatenate(
            [run(0, quant.expert_ffn, rec, fmt, hidden, inter, x[i : i + 1]) for i in range(len(x))]
        )  # [36, hidden]

        def call(xb, rec=rec, hidden=hidden, inter=inter):
            return run(n_threads, quant.expert_ffn, rec, fmt, hidden, inter, xb)

        check_rows_independent(call, singles, x, n_threads)


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_experts_ffn_b1_equals_expert_ffn_in_any_batch(fmt, n_threads, run):
    """The decode kernel (several experts, one row each) gives each expert's row the bits that
    expert_ffn gives the same row inside a batch of other rows."""
    for hidden, inter in FFN_SHAPES:
        recs = [expert_record(fmt, hidden, inter, seed=10 * e) for e in range(5)]
        n = recs[0].size
        arena = np.concatenate(recs)
        x = activations(5, hidden, seed=hidden)  # [5, hidden]: expert e gets x[e]
        y = run(n_threads, quant.experts_ffn_b1, arena, np.arange(5) * n, fmt, hidden, inter, x)
        for e, rec in enumerate(recs):
            batch = np.concatenate([activations(6, hidden, seed=e), x[e : e + 1]])  # [7, hidden]
            in_batch = run(n_threads, quant.expert_ffn, rec, fmt, hidden, inter, batch)[-1]
            alone = run(0, quant.expert_ffn, rec, fmt, hidden, inter, x[e : e + 1])[0]
            assert same_bits(y[e], in_batch) and same_bits(y[e], alone), (e, hidden, inter)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_non_finite_row_poisons_only_itself(fmt, run):
    """A nan or inf in one activation row makes that row's outputs non-finite and leaves the
    other rows' bits alone (no fast-math flag lets the kernels assume finite values)."""
    rows, cols = 37, 2080
    data = quant.pack(weights(rows, cols, seed=3), fmt)
    x = activations(5, cols, seed=4)  # [5, cols]
    clean = run(0, quant.matmul, data, fmt, rows, cols, x)
    x[1, 100] = np.nan
    x[3, 7] = np.inf
    for n_threads in (0, 2):
        y = run(n_threads, quant.matmul, data, fmt, rows, cols, x)
        assert np.isnan(y[1]).all() and not np.isfinite(y[3]).any()
        assert same_bits(y[[0, 2, 4]], clean[[0, 2, 4]])


# ---------------------------------------------------------------------------------------------
# the arithmetic itself, emulated in numpy float32

LANES = 8


# OCP MX v1.0 E2M1: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (here doubled: integers)
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float32)


def codes_and_scales(data: np.ndarray, fmt: str, rows: int, cols: int):
    """(e float32 [rows, cols], d float32 [rows, cols // 32]) read from ggml's bytes: e = q - 8
    (q4_0), q (q8_0) or twice the E2M1 value (mxfp4) per weight, d the block scales (mxfp4:
    half of 2^(E8M0 - 127); 255 is 2^127 in ggml, not the spec's nan), so that d * e is
    gguf's dequantisation."""
    nb = cols // 32
    raw = quant.unpack_to_ggml(data, fmt, rows, cols).reshape(rows, nb, -1)  # [rows, nb, bytes]
    if fmt == "mxfp4":
        d = np.ldexp(np.float64(1.0), raw[:, :, 0].astype(np.int64) - 128).astype(np.float32)
        qs = raw[:, :, 1:]
        q = np.concatenate([qs & 15, qs >> 4], axis=2)  # [rows, nb, 32], ggml nibble order
        e = np.where(q & 8, -1, 1) * E2M1_DOUBLED[q & 7]
        return e.astype(np.float32).reshape(rows, cols), d
    d = raw[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [rows, nb]
    qs = raw[:, :, 2:]
    if fmt == "q8_0":
        e = qs.view(np.int8).astype(np.float32)  # [rows, nb, 32]
    else:  # ggml q4_0: byte j = q[j] | q[j + 16] << 4
        e = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float32) - 8  # [rows, nb, 32]
    return e.reshape(rows, cols), d


def emulation(e: np.ndarray, d: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x float32 [b, cols] times the rows of codes e [rows, cols] and scales d [rows, nb], the
    way the float-activation q4_0/q8_0 kernels compute it (`moeshard.moe.kernels.dots`): lane l
    holds columns l, l + 8, ...; per block, t = ((p0 + p1) + p2) + p3 over the lane's four products,
    then acc = acc + d * t; finally the 8 lanes are halved, (l, l + 4), (l, l + 2), (l, l + 1).
    Every numpy operation here rounds to float32 on its own, so nothing is fused."""
    b, cols = x.shape
    acc = np.zeros((b, e.shape[0], LANES), dtype=np.float32)  # [b, rows, 8]
    for k in range(cols // 32):
        p = x[:, None, 32 * k : 32 * k + 32] * e[None, :, 32 * k : 32 * k + 32]  # [b, rows, 32]
        t = p[..., 0:8] + p[..., 8:16]
        t = t + p[..., 16:24]
        t = t + p[..., 24:32]  # [b, rows, 8]
        acc = acc + d[None, :, k, None] * t
    return halve(acc)


def halve(acc: np.ndarray) -> np.ndarray:
    """acc [..., 8] -> [...]: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))."""
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c with one rounding: the float32 product is exact in float64, and the
    float64 sum rounds onto a float32 tie (the one case where rounding twice differs) with
    probability about 2^-29 per operation, which the fixed data here does not hit."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 of `moeshard.moe.kernels.idots`: x float32 [b, cols] -> int codes [b, cols] and
    float32 block scales [b, nb], written from the module's description, in numpy."""
    b, cols = x.shape
    xb = x.reshape(b, cols // 32, 32)  # [b, nb, 32]
    amax = np.abs(xb).max(axis=2)  # [b, nb]; nan if the block holds a nan
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        dx = amax / np.float32(127.0)  # [b, nb]
        q = np.clip(np.rint(xb * (np.float32(1.0) / dx)[..., None]), -127, 127)  # [b, nb, 32]
    zero, bad = dx == 0, ~np.isfinite(amax)  # (zero: amax 0, or below 127 x 2^-149)
    q[zero | bad] = 0
    dx[zero] = 0.0
    dx[bad] = np.nan
    return q.astype(np.int64).reshape(b, cols), dx.astype(np.float32)


def test_activation_quantisation_equals_numpy_emulation():
    """Step 1 alone, codes, scales and the codes' sums, on blocks of every kind: ordinary,
    all zero (either sign), holding a nan or an inf, so small that the scale rounds to 0 (such
    a block once raised ZeroDivisionError), subnormal, and codes that round half to even."""
    from moeshard.moe.kernels.activations import activation_buffers, quantize_activations

    rng = np.random.default_rng(11)
    b, nb = 7, 24
    scale = 10.0 ** rng.uniform(-38, 30, (b, nb, 1))  # [b, nb, 1]: a magnitude per block
    x = (rng.standard_normal((b, nb, 32)) * scale).astype(np.float32)  # [b, nb, 32]
    x[0, 0], x[0, 1] = 0.0, -0.0
    x[1, 2, 5], x[1, 3, 31], x[1, 4, 0] = np.nan, np.inf, -np.inf
    x[2, 5] = np.float32(1e-44)  # 7 x 2^-149: its scale rounds to 0
    x[2, 6] = rng.standard_normal(32) * np.float32(1e-39)  # subnormal, with a scale
    x[3, 7] = rng.integers(-127, 128, 32)  # amax 127: scale 1, codes the values
    x[3, 8] = rng.integers(-127, 128, 32) + np.float32(0.5)  # ties, to even
    x = x.reshape(b, nb * 32)  # [b, cols]
    xq, xd, xc = activation_buffers(b, nb * 32)
    quantize_activations(x, xq, xd, xc)
    q, dx = quantize_x(x)  # [b, cols], [b, nb]
    assert np.array_equal(xq.astype(np.int64), q)
    assert xd.tobytes() == dx.tobytes()
    blocks = q.reshape(b, nb, 32)  # [b, nb, 32]
    assert np.array_equal(xc[:, 0::2], 8 * blocks.sum(axis=2))
    assert np.array_equal(xc[:, 1::2], blocks[:, :, :16].sum(axis=2))
    assert xd[2, 5] == 0 and not xq[2, 160:192].any() and np.isnan(xd[1, 2:5]).all()


def int_emulation(e: np.ndarray, d: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The integer path (`moeshard.moe.kernels.idots`): x quantised per block, each block's products
    summed exactly as integers, then acc = fma(dw * dx, sum, acc) per block in order; one
    accumulator per row."""
    xq, dx = quantize_x(x)
    b, cols = x.shape
    ei = e.astype(np.int64)  # [rows, cols]
    acc = np.zeros((b, e.shape[0]), dtype=np.float32)  # [b, rows]
    for k in range(cols // 32):
        cs = slice(32 * k, 32 * k + 32)
        t = (xq[:, None, cs] * ei[None, :, cs]).sum(axis=-1).astype(np.float32)  # [b, rows]
        scale = d[None, :, k] * dx[:, None, k]  # [b, rows] float32
        with np.errstate(invalid="ignore"):
            acc = fma32(scale, t, acc)
    return acc


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "mxfp4"])
def test_quantised_matmul_equals_numpy_emulation(fmt, run, mode):
    """The codes and scales from ggml's bytes, then the documented arithmetic in numpy: equal
    bits, so the kernels' result is defined by that arithmetic alone, whatever the CPU,
    compiler, batch or thread count."""
    for rows, cols in MATMUL_SHAPES:
        data = quant.pack(weights(rows, cols, seed=rows * cols), fmt)
        e, d = codes_and_scales(data, fmt, rows, cols)
        w = quant.dequantize(quant.unpack_to_ggml(data, fmt, rows, cols), fmt, (rows, cols))
        assert same_bits(d.repeat(32, axis=1) * e, w)  # d * e is gguf's dequantisation
        for b in (1, 3, 17):
            x = activations(b, cols, seed=b)
            want = (int_emulation if mode == "q8" else emulation)(e, d, x)
            for n_threads in (0, 2):
                got = run(n_threads, quant.matmul, data, fmt, rows, cols, x)
                assert same_bits(got, want), (rows, cols, b, n_threads)


def float_emulation(w: np.ndarray, x: np.ndarray, fmt: str) -> np.ndarray:
    """The f32/bf16 rows of `moeshard.moe.kernels.fdots` in numpy: two sets of 8 lanes over
    16-column
    steps (f32: set s lane l takes column 8s + l of the step; bf16: column 2l + s), each step
    one FMA; the sets added, the lanes halved; the last cols % 16 columns FMA'd in order onto
    the sum."""
    b, cols = x.shape
    c16 = cols - cols % 16

    def sets(a: np.ndarray) -> np.ndarray:  # [..., 16] -> [..., set, lane]
        if fmt == "bf16":
            return np.swapaxes(a.reshape(*a.shape[:-1], LANES, 2), -1, -2)
        return a.reshape(*a.shape[:-1], 2, LANES)

    acc = np.zeros((b, w.shape[0], 2, LANES), dtype=np.float32)  # [b, rows, set, lane]
    for j in range(0, c16, 16):
        ws = sets(w[None, :, j : j + 16])  # [1, rows, 2, 8]
        xs = sets(x[:, None, j : j + 16])  # [b, 1, 2, 8]
        acc = fma32(ws, xs, acc)
    y = halve(acc[..., 0, :] + acc[..., 1, :])  # [b, rows]
    for c in range(c16, cols):
        y = fma32(w[None, :, c], x[:, c, None], y)
    return y


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_float_matmul_equals_numpy_emulation(fmt, run, mode):
    if mode != "q8":
        pytest.skip("f32/bf16 do not depend on the activation mode")
    for rows, cols in MATMUL_SHAPES + [(6, 40), (3, 7)]:
        data = quant.pack(weights(rows, cols, seed=rows * cols), fmt)
        w = quant.dequantize(quant.unpack_to_ggml(data, fmt, rows, cols), fmt, (rows, cols))
        for b in (1, 3, 17):
            x = activations(b, cols, seed=b)
            want = float_emulation(w.astype(np.float32), x, fmt)
            for n_threads in (0, 2):
                got = run(n_threads, quant.matmul, data, fmt, rows, cols, x)
                assert same_bits(got, want), (fmt, rows, cols, b, n_threads)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_decode_weighted_sum_equals_the_parts_combined(fmt, run):
    """One decode row through `decode_weighted_sum` (one fused kernel call) gives the bits of
    `run_experts` + `weighted_sum` (per-expert outputs, weighted, added in float64)."""
    from moeshard.moe.experts.compute import decode_weighted_sum, run_experts, weighted_sum

    hidden, inter, n = 160, 96, 6
    recs = [expert_record(fmt, hidden, inter, seed=s) for s in range(n)]
    size = recs[0].size
    arena = np.concatenate(recs)
    x = activations(1, hidden, seed=9)  # [1, hidden]
    ids = np.array([[4, 0, 5, 2]], dtype=np.int64)  # [1, k], not sorted
    w = np.array([[0.4, 0.3, 0.2, 0.1]], dtype=np.float32)  # [1, k]
    for n_threads in (0, 2):
        for dtype in (np.float32, np.float64):
            want = weighted_sum(
                run_experts(arena, {e: e * size for e in range(n) if e in ids}, fmt, hidden,
                            inter, x, ids, w),
                x.shape,
                dtype,
            )  # fmt: skip
            got = run(
                n_threads,
                decode_weighted_sum,
                arena, lambda es: [e * size for e in es], fmt, hidden, inter, x, ids, w, dtype,
            )  # fmt: skip
            assert got.dtype == want.dtype and np.array_equal(
                got.view(np.uint8), want.view(np.uint8)
            )
    repeated = np.array([[1, 1, 3, -1]])  # an expert twice: the general path must take it
    assert (
        decode_weighted_sum(
            arena,
            lambda es: [e * size for e in es],
            fmt,
            hidden,
            inter,
            x,
            repeated,
            w,
            np.float32,
        )
        is None
    )


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "mxfp4", "bf16", "f32"])
def test_experts_on_their_rows_equal_expert_ffn(fmt):
    """experts_ffn_rows (several experts, each on its own rows, one parallel region) gives each
    row the bits expert_ffn gives it, with either gated unit."""
    rng = np.random.default_rng(11)
    hidden, inter, m = 64, 96, 4
    recs = [
        quant.pack_expert(
            rng.standard_normal((inter, hidden)).astype(np.float32) * 0.1,
            rng.standard_normal((inter, hidden)).astype(np.float32) * 0.1,
            rng.standard_normal((hidden, inter)).astype(np.float32) * 0.1,
            fmt,
        )
        for _ in range(m)
    ]
    arena = np.concatenate(recs)
    starts = np.array([0, 3, 3, 4, 9])  # expert 1 has no rows
    x = rng.standard_normal((9, hidden)).astype(np.float32)
    for glu in (quant.SWIGLU, quant.situ(4.0, 25.0)):
        y = quant.experts_ffn_rows(
            arena, np.arange(m) * recs[0].size, fmt, hidden, inter, x, starts, glu
        )
        for e in range(m):
            rows = slice(starts[e], starts[e + 1])
            if starts[e + 1] > starts[e]:
                want = quant.expert_ffn(recs[e], fmt, hidden, inter, x[rows], glu)
                np.testing.assert_array_equal(y[rows], want)
        # on every thread numba has (this call is below the pool's threshold): the experts
        # dealt to the threads by their rows (`entry._deal`), the same bits
        code, nbytes, layout, glu_code = quant.experts_args(fmt, hidden, inter, glu)
        pooled = quant._launch(
            entry.experts_rows_kernel,
            numba.config.NUMBA_NUM_THREADS,
            (code, quant._int8(), arena, np.arange(m) * recs[0].size, nbytes, hidden, inter,
             layout, quant.dots.F16_LUT, x, starts, glu_code, numba.config.NUMBA_NUM_THREADS),
        )  # fmt: skip
        np.testing.assert_array_equal(pooled, y)


def test_experts_are_dealt_to_threads_by_rows():
    """`entry._deal`: every expert in exactly one share, each share ascending, and no share
    more than one expert's work above another's (largest first, to the least loaded)."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        m, bins = int(rng.integers(0, 40)), int(rng.integers(1, 6))
        rows = rng.integers(0, 30, m) * (rng.random(m) < 0.8)  # [m], some experts without rows
        starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)  # [m + 1]
        order, bounds = entry._deal(starts, bins)
        assert sorted(order.tolist()) == list(range(m))
        assert bounds[0] == 0 and bounds[-1] == m and len(bounds) == bins + 1
        loads = []
        for b in range(bins):
            share = order[bounds[b] : bounds[b + 1]]
            assert (np.diff(share) > 0).all()
            loads.append(int((rows[share] + 1).sum()))
        if m:
            assert max(loads) - min(loads) <= int(rows.max()) + 1


@pytest.mark.parametrize("fmt", ["q4_0", "bf16"])
def test_rows_weighted_sum_equals_the_parts_combined(fmt, run):
    """Several rows through `rows_weighted_sum` (pairs grouped by expert in one kernel, the
    experts on their rows in another, summed in a third) give the bits of `run_experts` +
    `weighted_sum`, with unused slots (-1) and experts some rows share and some skip."""
    from moeshard.moe.experts.compute import rows_weighted_sum, run_experts, weighted_sum

    hidden, inter, n = 160, 96, 7
    recs = [expert_record(fmt, hidden, inter, seed=s) for s in range(n)]
    size = recs[0].size
    arena = np.concatenate(recs)
    x = activations(5, hidden, seed=3)  # [5, hidden]
    ids = np.array([[4, 0, 5], [6, -1, 0], [0, 4, 2], [-1, -1, -1], [2, 6, 4]])  # [5, 3]
    w = np.random.default_rng(2).random(ids.shape).astype(np.float32)  # [5, 3]
    offsets = {e: e * size for e in range(n) if e in ids}
    for n_threads in (0, 2):
        want = weighted_sum(
            run_experts(arena, offsets, fmt, hidden, inter, x, ids, w), x.shape, np.float32
        )
        got = run(
            n_threads,
            rows_weighted_sum,
            arena, lambda es: [e * size for e in es], fmt, hidden, inter, x, ids, w, np.float32,
        )  # fmt: skip
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    experts, starts, rows, xs, ws = quant.group_by_expert(ids, w, x)
    assert experts.tolist() == [0, 2, 4, 5, 6] and starts.tolist() == [0, 3, 5, 8, 9, 11]
    assert rows.tolist() == [0, 1, 2, 2, 4, 0, 2, 4, 0, 1, 4]
    np.testing.assert_array_equal(xs, x[rows])


WORKQUEUE_PROBE = """
import threading, numpy as np
from moeshard.moe.kernels import quant
rng = np.random.default_rng(0)
data = quant.pack(rng.standard_normal((1024, 1024)).astype(np.float32), "q4_0")
xs = [rng.standard_normal((4, 1024)).astype(np.float32) for _ in range(4)]
want = [quant.matmul(data, "q4_0", 1024, 1024, x) for x in xs]
wrong = []
def work(i):
    for _ in range(100):
        wrong.append(not np.array_equal(quant.matmul(data, "q4_0", 1024, 1024, xs[i]), want[i]))
threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
import numba
print(numba.threading_layer(), sum(wrong))
"""


def test_parallel_kernels_from_many_threads_under_numbas_own_pool():
    """Where neither OpenMP nor TBB is installed numba uses its "workqueue" pool, which
    aborts the process (or worse) when two threads launch kernels at once: a node computes
    from several gRPC threads. The launches take turns there: all results right, no abort."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    out = subprocess.run(
        [sys.executable, "-c", WORKQUEUE_PROBE], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["workqueue", "0"], out.stdout
