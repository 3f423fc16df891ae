"""moeshard.moe.quant: ggml bit-exactness, the packed layout, and the kernels against numpy
twins."""

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from helpers import ROOT, positive

from moeshard.moe.kernels import quant

QTYPE = {
    "f32": GGMLQuantizationType.F32,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "mxfp4": GGMLQuantizationType.MXFP4,
}
# Max error of a kernel vs its float64 twin, relative to sum_j |x_j * w_j| for that output.
# All formats accumulate in float32 lanes (f32/bf16 with FMAs, so a little tighter); the twins
# take the activations as the kernels do (`quant.kernel_activations`).
RTOL = {"f32": 1e-6, "bf16": 1e-6, "q8_0": 2e-6, "q4_0": 2e-6, "mxfp4": 2e-6}


def awkward(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random float32 matrix with zero rows/blocks, huge and tiny magnitudes, ties, negatives."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)  # [rows, cols]
    w[0] = 0.0
    if rows > 2:
        w[1] *= np.float32(1e3)
        w[2] *= np.float32(1e-7)  # q8_0/q4_0 scales underflow to f16 subnormals / zero
    if rows > 3:
        w[3, :32] = 0.0  # one all-zero block
        w[3, 32:] = -np.abs(w[3, 32:])  # all-negative row
    if rows > 4:
        w[4] = np.float32(0.5)  # constant row: q8_0 rounding ties
    if rows > 5:
        w[5, ::7] = -w[5, ::7] * np.float32(300.0)
    return w


@pytest.fixture(params=["serial", "parallel"])
def threads(request, monkeypatch):
    """Run a test once on the calling thread and once through the prange drivers."""
    if request.param == "parallel":
        monkeypatch.setattr(quant, "PARALLEL_MIN_WEIGHTS", 0)
    else:
        monkeypatch.setattr(quant, "PARALLEL_MIN_WEIGHTS", 1 << 62)
    return request.param


def random_x(b: int, cols: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((b, cols)).astype(np.float32)  # [b, cols]


def abs_bound(data, fmt, rows, cols, x):
    """sum_j |x_j * w_j| per output: the scale float rounding errors are relative to."""
    w = quant.dequantize(quant.unpack_to_ggml(data, fmt, rows, cols), fmt, (rows, cols))
    return np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T  # [b, rows]


# ---------------------------------------------------------------------------------------------
# ggml bit-exactness


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("shape", [(7, 32), (9, 96), (33, 256)])
def test_quantize_dequantize_match_gguf(fmt, shape):
    w = awkward(*shape)
    ours = quant.quantize(w, fmt)
    ref = np.ascontiguousarray(quants.quantize(w, QTYPE[fmt])).view(np.uint8).reshape(shape[0], -1)
    assert ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, ref)

    back = quant.dequantize(ours, fmt, shape)
    ref_back = np.asarray(quants.dequantize(ref, QTYPE[fmt]), dtype=np.float32)
    if fmt == "f32":
        ref_back = ref.view(np.float32)
    assert back.dtype == np.float32 and back.shape == shape
    np.testing.assert_array_equal(back.view(np.uint32), ref_back.reshape(shape).view(np.uint32))


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("shape", [(5, 32), (37, 96), (16, 2080), (64, 256)])
def test_pack_is_ggml_bit_for_bit(fmt, shape):
    w = awkward(*shape)
    packed = quant.pack(w, fmt)
    assert packed.dtype == np.uint8 and packed.shape == (quant.packed_nbytes(fmt, *shape),)
    ref = np.ascontiguousarray(quants.quantize(w, QTYPE[fmt])).view(np.uint8).reshape(shape[0], -1)
    np.testing.assert_array_equal(quant.unpack_to_ggml(packed, fmt, *shape), ref)


def test_bf16_layout_is_four_row_groups_in_sixteen_column_pieces():
    """Format version 3's bf16 layout, pinned: w[4g + i, 16p + l] at [g, p, i, l], rows padded
    with zero rows to a multiple of four and columns with zeros to a multiple of sixteen, the
    matrix to a multiple of 64 bytes; the products and row lookups on such a shape agree with
    the row-major values."""
    rows, cols = 7, 40  # a partial last group, a partial last piece
    w = awkward(rows, cols)
    bits = quant.quantize(w, "bf16").view(np.uint16)  # [rows, cols]
    packed = quant.pack(w, "bf16")
    assert packed.size == quant.packed_nbytes("bf16", rows, cols) == 2 * 3 * 4 * 16 * 2
    pieces = packed.view(np.uint16).reshape(2, 3, 4, 16)  # [g, p, i, l]
    for r in range(8):
        for c in range(48):
            want = bits[r, c] if r < rows and c < cols else 0
            assert pieces[r // 4, c // 16, r % 4, c % 16] == want, (r, c)
    values = quant.dequantize(bits.view(np.uint8), "bf16", (rows, cols))  # [rows, cols]
    ids = np.array([6, 0, 3, 4], dtype=np.int64)
    np.testing.assert_array_equal(
        quant.dequantize_rows(packed, "bf16", rows, cols, ids), values[ids]
    )
    view = quant.float_rows_view(packed, "bf16", rows, cols)  # [2, 3, 4, 16]
    with pytest.raises(ValueError, match="larger than its table"):  # (it would read past it)
        quant.float_rows_at(view, 100, cols, np.array([50], dtype=np.int64))
    x = random_x(3, cols)
    y = quant.matmul(packed, "bf16", rows, cols, x)  # [3, rows]
    ref = x.astype(np.float64) @ values.astype(np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_packed_nbytes():
    for fmt in quant.FORMATS:
        assert quant.packed_nbytes(fmt, 3, 96) % 64 == 0
    # q4_0: 4.5 bits/weight, sections already 64-aligned
    assert quant.packed_nbytes("q4_0", 4096, 14336) == 4096 * 14336 * 9 // 16
    assert quant.packed_nbytes("q8_0", 4096, 14336) == 4096 * 14336 * 17 // 16
    assert quant.packed_nbytes("mxfp4", 4096, 14336) == 4096 * 14336 * 17 // 32  # 4.25 bits
    assert quant.packed_nbytes("bf16", 4, 32) == 256
    assert quant.packed_nbytes("bf16", 1, 16) == 128  # a row is a group of four: padded
    assert quant.packed_nbytes("f32", 1, 1) == 64


# ---------------------------------------------------------------------------------------------
# kernels vs numpy twins

# (rows, cols): tiny, odd q4_0 block count, an odd block count past one 2048-column tile,
# rows that are not a multiple of the 4-row tile / 16-row parallel work item.
MATMUL_SHAPES = [(5, 32), (37, 96), (41, 2080), (130, 512)]


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("b", [1, 3, 32])
def test_matmul_matches_twin(fmt, b, threads):
    for rows, cols in MATMUL_SHAPES:
        data = quant.pack(awkward(rows, cols), fmt)
        x = random_x(b, cols)
        y = quant.matmul(data, fmt, rows, cols, x)
        assert y.dtype == np.float32 and y.shape == (b, rows)
        ref = quant.matmul_reference(data, fmt, rows, cols, x)
        bound = abs_bound(data, fmt, rows, cols, x)
        err = np.abs(y - ref)
        assert np.all(err <= RTOL[fmt] * bound + 1e-30), (rows, cols, (err / bound).max())


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("b", [1, 3, 17])
def test_a_matrix_group_gives_each_matrix_its_own_bits(fmt, b, threads):
    """`PackedGroup` (a layer's q, k and v in one call): each output is the bits of its
    matrix alone, C-contiguous, whatever the thread split (rows of 24, not a multiple of the
    16-row work items, and a group of 8)."""
    rng = np.random.default_rng(b)
    mats = [
        quant.PackedMatrix(quant.pack(awkward(rows, 96, rows), fmt), fmt, rows, 96)
        for rows in (40, 24, 8)
    ]
    x = rng.standard_normal((b, 96)).astype(np.float32)  # [b, 96]
    outs = quant.PackedGroup(mats)(x)
    assert [y.shape for y in outs] == [(b, 40), (b, 24), (b, 8)]
    for y, m in zip(outs, mats, strict=True):
        assert y.flags.c_contiguous and y.tobytes() == m(x).tobytes()


def test_a_matrix_group_wants_one_format_and_width():
    a = quant.PackedMatrix(quant.pack(awkward(8, 64, 0), "bf16"), "bf16", 8, 64)
    b = quant.PackedMatrix(quant.pack(awkward(8, 64, 1), "f32"), "f32", 8, 64)
    with pytest.raises(ValueError, match="one format and one width"):
        quant.PackedGroup([a, b])


def test_matmul_accepts_views_and_odd_strides():
    rows, cols = 40, 256
    w = awkward(rows, cols)
    data = quant.pack(w, "q4_0")
    buf = np.zeros(data.size + 128, dtype=np.uint8)
    buf[64 : 64 + data.size] = data
    xs = random_x(6, cols)[::2]  # non-contiguous activations
    y = quant.matmul(buf[64 : 64 + data.size], "q4_0", rows, cols, xs)
    np.testing.assert_array_equal(y, quant.matmul(data, "q4_0", rows, cols, xs.copy()))


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_quantised_matmul_error_vs_float_weights(fmt):
    """End-to-end error against the unquantised float weights (quantisation error only)."""
    rows, cols = 64, 1024
    w = np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float32)
    x = random_x(4, cols)
    y = quant.matmul(quant.pack(w, fmt), fmt, rows, cols, x)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel < {"f32": 1e-6, "bf16": 1e-2, "q8_0": 2e-2, "q4_0": 1e-1, "mxfp4": 1.5e-1}[fmt]


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_nan_propagates(fmt):
    """The kernels' fastmath flags exclude nnan: a nan weight poisons exactly its row."""
    w = np.ones((8, 64), dtype=np.float32)
    w[3, 17] = np.nan
    y = quant.matmul(quant.pack(w, fmt), fmt, 8, 64, random_x(2, 64))
    assert np.isnan(y[:, 3]).all() and np.isfinite(np.delete(y, 3, axis=1)).all()


# (hidden, inter): odd block counts both ways; a larger one.
FFN_SHAPES = [(96, 160), (512, 256)]


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("b", [1, 3, 32])
def test_expert_ffn_matches_twin(fmt, b, threads):
    for hidden, inter in FFN_SHAPES:
        gate = awkward(inter, hidden, seed=10) * np.float32(0.1)
        up = awkward(inter, hidden, seed=11) * np.float32(0.1)
        down = awkward(hidden, inter, seed=12) * np.float32(0.1)
        rec = quant.pack_expert(gate, up, down, fmt)
        assert rec.shape == (quant.expert_record_nbytes(fmt, hidden, inter),)
        x = random_x(b, hidden)
        y = quant.expert_ffn(rec, fmt, hidden, inter, x)
        assert y.dtype == np.float32 and y.shape == (b, hidden)
        ref = quant.expert_ffn_reference(rec, fmt, hidden, inter, x)
        tol = 2e-5  # float32 sums twice over, and silu in between
        assert np.abs(y - ref).max() <= tol * np.abs(ref).max(), (hidden, inter)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_batched_experts_equal_one_call_each(fmt, threads):
    """experts_ffn_b1 (several experts, one parallel region) = expert_ffn per expert, bit for
    bit, with records at arbitrary arena offsets and a different x row per expert."""
    for hidden, inter in FFN_SHAPES:
        recs = [
            quant.pack_expert(
                awkward(inter, hidden, seed=20 + e) * np.float32(0.1),
                awkward(inter, hidden, seed=30 + e) * np.float32(0.1),
                awkward(hidden, inter, seed=40 + e) * np.float32(0.1),
                fmt,
            )
            for e in range(3)
        ]
        n = recs[0].size
        arena = np.zeros(5 * n + 64, dtype=np.uint8)
        offsets = [3 * n + 64, 0, n]  # out of order, one unaligned
        for off, rec in zip(offsets, recs, strict=True):
            arena[off : off + n] = rec
        x = random_x(3, hidden)
        y = quant.experts_ffn_b1(arena, offsets, fmt, hidden, inter, x)
        assert y.shape == (3, hidden) and y.dtype == np.float32
        for e in range(3):
            one = quant.expert_ffn(recs[e], fmt, hidden, inter, x[e : e + 1])[0]
            np.testing.assert_array_equal(y[e], one)
        with pytest.raises(ValueError, match="inside the arena"):
            quant.experts_ffn_b1(arena, [arena.size - n + 1], fmt, hidden, inter, x[:1])
        with pytest.raises(ValueError, match="rows for"):
            quant.experts_ffn_b1(arena, offsets, fmt, hidden, inter, x[:2])


def test_expert_record_layout():
    hidden, inter = 96, 160
    rng = np.random.default_rng(5)
    gate, up = rng.standard_normal((2, inter, hidden), dtype=np.float32)
    down = rng.standard_normal((hidden, inter), dtype=np.float32)
    for fmt in quant.FORMATS:
        rec = quant.pack_expert(gate, up, down, fmt)
        n_gu = quant.packed_nbytes(fmt, inter, hidden)
        assert n_gu % 64 == 0 and rec.size % 64 == 0
        np.testing.assert_array_equal(rec[:n_gu], quant.pack(gate, fmt))
        np.testing.assert_array_equal(rec[n_gu : 2 * n_gu], quant.pack(up, fmt))
        np.testing.assert_array_equal(rec[2 * n_gu :], quant.pack(down, fmt))
        # a record living inside a larger buffer works in place
        buf = np.zeros(3 * rec.size, dtype=np.uint8)
        buf[rec.size : 2 * rec.size] = rec
        x = random_x(2, hidden)
        np.testing.assert_array_equal(
            quant.expert_ffn(buf[rec.size : 2 * rec.size], fmt, hidden, inter, x),
            quant.expert_ffn(rec, fmt, hidden, inter, x),
        )


WARMUP_THEN_EVERY_FORMAT = """
import json
import numpy as np
from moeshard.moe.kernels import entry, quant
names = ("matmul_kernel", "expert_ffn_kernel", "experts_b1_kernel")  # every entry point
kernels = {name: getattr(entry, name) for name in names}
def signatures():
    return {name: [str(s) for s in k.signatures] for name, k in kernels.items()}
before = signatures()
seconds = quant.warmup()
warm = signatures()
hidden, inter = 64, 96
rng = np.random.default_rng(0)
for fmt in ("f32", "bf16", "q8_0", "q4_0", "mxfp4"):
    w = rng.standard_normal((inter, hidden)).astype(np.float32)
    record = quant.pack_expert(w, w, np.ascontiguousarray(w.T), fmt)
    for b in (1, 3):
        x = rng.standard_normal((b, hidden)).astype(np.float32)
        quant.matmul(quant.pack(w, fmt), fmt, inter, hidden, x)
        quant.expert_ffn(record, fmt, hidden, inter, x)
        arena = np.concatenate([record] * b)
        arena.flags.writeable = False  # as mmap'd weights are
        quant.experts_ffn_b1(arena, np.arange(b) * record.size, fmt, hidden, inter, x)
print(json.dumps({"seconds": seconds, "before": before, "warm": warm, "after": signatures()}))
"""


def test_warmup_compiles_the_one_signature_every_call_uses():
    """In a fresh interpreter, warmup() returns its duration and leaves each kernel entry point
    with one compiled signature; calls of every format, batch size and writability then run on
    it (a second signature would be a compile in the middle of a generation)."""
    out = subprocess.run(
        [sys.executable, "-c", WARMUP_THEN_EVERY_FORMAT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = json.loads(out.splitlines()[-1])
    assert isinstance(got["seconds"], float) and positive(got["seconds"])
    assert all(not sigs for sigs in got["before"].values())  # nothing compiled before warmup
    assert all(len(sigs) == 1 for sigs in got["warm"].values()), got["warm"]
    assert got["after"] == got["warm"], "a kernel compiled another signature after warmup"


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "mxfp4"])
def test_cols_not_multiple_of_32(fmt):
    w = np.zeros((4, 48), dtype=np.float32)
    for call in (
        lambda: quant.quantize(w, fmt),
        lambda: quant.pack(w, fmt),
        lambda: quant.packed_nbytes(fmt, 4, 48),
        lambda: quant.matmul(np.zeros(1024, np.uint8), fmt, 4, 48, np.zeros((1, 48), np.float32)),
        lambda: quant.expert_record_nbytes(fmt, 48, 64),
    ):
        with pytest.raises(ValueError, match="multiple of 32"):
            call()


def test_wrong_buffer_length():
    data = quant.pack(np.ones((8, 64), dtype=np.float32), "q4_0")
    x = np.ones((1, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="q4_0 8x64 matrix needs 320 bytes, got a buffer of 319"):
        quant.matmul(data[:-1], "q4_0", 8, 64, x)
    with pytest.raises(ValueError, match="needs 320 bytes"):
        quant.unpack_to_ggml(np.zeros(data.size + 64, np.uint8), "q4_0", 8, 64)
    with pytest.raises(ValueError, match="ggml bytes"):
        quant.dequantize(np.zeros(10, np.uint8), "q8_0", (1, 32))
    rec = quant.pack_expert(np.ones((32, 64)), np.ones((32, 64)), np.ones((64, 32)), "q8_0")
    with pytest.raises(ValueError, match="expert record .* needs .* bytes, got a buffer of"):
        quant.expert_ffn(rec[:-64], "q8_0", 64, 32, x)


def test_other_bad_input():
    data = quant.pack(np.ones((8, 64), dtype=np.float32), "f32")
    with pytest.raises(ValueError, match="x must have shape"):
        quant.matmul(data, "f32", 8, 64, np.ones((1, 32), np.float32))
    with pytest.raises(ValueError, match="unknown weight format"):
        quant.pack(np.ones((8, 64)), "q5_k")
    with pytest.raises(ValueError, match="2-D"):
        quant.pack(np.ones(64), "f32")
    with pytest.raises(ValueError, match="uint8"):
        quant.matmul(data.view(np.int8), "f32", 8, 64, np.ones((1, 64), np.float32))
    with pytest.raises(ValueError, match="expert shapes disagree"):
        quant.pack_expert(np.ones((32, 64)), np.ones((32, 64)), np.ones((32, 64)), "f32")
