"""ggml's formats kept as GGUF files hold them (issue 39): q4_K, q5_K, q6_K, iq4_nl, iq4_xs,
and the older q4_1, q5_0 and q5_1.

gguf-py cannot make K-quant blocks, so these tests build random valid ones (every byte
pattern of the codes and 6-bit scales is a valid block; d and dmin finite float16) and check:
the layout keeps every bit (`unpack_to_ggml` gives the file's bytes back), its reading of the
scales is gguf's (`gguf.quants.dequantize`), and the kernels equal, bit for bit, a numpy
emulation of the arithmetic `moeshard.moe.kernels.idots` documents for q4_K, in any batch, on
any number of threads and in either activation mode.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from moeshard.moe.kernels import layout, quant
from tests.test_kernel_determinism import (
    BATCHES,
    activations,
    check_rows_independent,
    fma32,
    quantize_x,
    run,  # noqa: F401  (a fixture)
    same_bits,
)

# (rows, cols): one super-block; rows not a multiple of 8; several super-blocks
SHAPES = [(1, 256), (5, 512), (19, 768), (40, 2048)]


LEGACY = {
    "q4_1": GGMLQuantizationType.Q4_1,
    "q5_0": GGMLQuantizationType.Q5_0,
    "q5_1": GGMLQuantizationType.Q5_1,
}


def random_blocks(fmt: str, rows: int, cols: int, seed: int) -> np.ndarray:
    if fmt in LEGACY:  # gguf-py quantises these: Gaussian rows over four decades, one zero
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w *= (10.0 ** rng.uniform(-4, 0, (rows, 1))).astype(np.float32)
        w[rows // 2] = 0.0
        return np.asarray(quants.quantize(w, LEGACY[fmt])).view(np.uint8).reshape(rows, -1)
    make = {"q4_K": random_q4k, "q5_K": random_q5k, "q6_K": random_q6k, "iq4_nl": random_iq4nl}
    return make.get(fmt, random_iq4xs)(rows, cols, seed)


def legacy_parts(packed: np.ndarray, fmt: str, rows: int, cols: int):
    """(q int [rows, cols]: 0..15, or 0..31 with the top bit of column j bit j of qh; d, m
    float32 [rows, cols // 32], m 0 for q5_0) from the file's bytes by ggml's block layout."""
    nb = cols // 32
    raw = quant.unpack_to_ggml(packed, fmt, rows, cols).reshape(rows, nb, -1)
    d = raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = np.zeros_like(d)
    if fmt != "q5_0":
        m = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = raw[:, :, -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64)  # [rows, nb, 32]
    if fmt != "q4_1":
        at = 2 if fmt == "q5_0" else 4
        qh = raw[:, :, at : at + 4].copy().view("<u4")[..., 0].astype(np.int64)  # [rows, nb]
        q |= ((qh[..., None] >> np.arange(32)) & 1) << 4
    return q.reshape(rows, cols), d, m


def legacy_emulation(fmt: str, q, d, m, x: np.ndarray) -> np.ndarray:
    """Per block k: t = sum q xq, s = sum xq exactly; q5_0 a = fma(d dx, t - 16 s, a); q4_1
    and q5_1 a = fma(d dx, t, a) then a = fma(m dx, s, a)."""
    xq, dx = quantize_x(x)
    acc = np.zeros((x.shape[0], q.shape[0]), dtype=np.float32)  # [b, rows]
    for k in range(x.shape[1] // 32):
        cs = slice(32 * k, 32 * k + 32)
        t = (xq[:, None, cs] * q[None, :, cs]).sum(axis=-1)  # [b, rows] int
        s = xq[:, cs].sum(axis=-1)[:, None]  # [b, 1]
        with np.errstate(invalid="ignore"):
            if fmt == "q5_0":
                acc = fma32(d[None, :, k] * dx[:, None, k], (t - 16 * s).astype(np.float32), acc)
            else:
                acc = fma32(d[None, :, k] * dx[:, None, k], t.astype(np.float32), acc)
                acc = fma32(m[None, :, k] * dx[:, None, k], s.astype(np.float32), acc)
    return acc


def test_gguf_dequantises_the_older_formats_as_read_here():
    for fmt, qtype in LEGACY.items():
        for rows, cols in SHAPES:
            packed = quant.pack_ggml(random_blocks(fmt, rows, cols, cols), fmt, rows, cols)
            q, d, m = legacy_parts(packed, fmt, rows, cols)
            ggml = quant.unpack_to_ggml(packed, fmt, rows, cols)
            want = quants.dequantize(ggml, qtype).reshape(rows, cols)
            qf = (q - 16 if fmt == "q5_0" else q).astype(np.float32)
            mine = d.repeat(32, axis=1) * qf
            if fmt != "q5_0":  # (adding q5_0's zero m would turn its -0s into 0s)
                mine = mine + m.repeat(32, axis=1)
            assert same_bits(mine.astype(np.float32), np.asarray(want, dtype=np.float32)), fmt


def random_q5k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid ggml q5_K bytes: q4_K's d, dmin and scales (`random_q4k`), random top bits."""
    rng = np.random.default_rng(seed + 1)
    q4 = random_q4k(rows, cols, seed).reshape(rows, cols // 256, 144)
    qh = rng.integers(0, 256, (rows, cols // 256, 32), dtype=np.uint8)
    return np.concatenate([q4[:, :, :16], qh, q4[:, :, 16:]], axis=2).reshape(rows, -1)


def random_iq4nl(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid ggml iq4_nl bytes [rows, cols // 32 * 18]: float16 d over four decades (one
    row's zero), random codes."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
    d = (10.0 ** rng.uniform(-4, 0, (rows, cols // 32, 1))).astype(np.float16)
    d[rows // 2] = 0.0
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks.reshape(rows, -1)


def random_iq4xs(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid ggml iq4_xs bytes [rows, cols // 256 * 136]: float16 d over four decades (one
    row's zero), random 6-bit scales and codes."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 136), dtype=np.uint8)
    d = (10.0 ** rng.uniform(-4, 0, (rows, cols // 256, 1))).astype(np.float16)
    d[rows // 2] = 0.0
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def random_q6k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid ggml q6_K bytes [rows, cols // 256 * 210]: random codes and int8 scales, d
    float16 over four decades (one row's zero)."""
    rng = np.random.default_rng(seed)
    nsup = cols // 256
    blocks = rng.integers(0, 256, (rows, nsup, 210), dtype=np.uint8)  # [rows, nsup, 210]
    d = (10.0 ** rng.uniform(-4, 0, (rows, nsup, 1))).astype(np.float16)
    d[rows // 2] = 0.0
    blocks[:, :, 208:210] = d.view(np.uint8).reshape(rows, nsup, 2)
    return blocks.reshape(rows, -1)


def random_q4k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid ggml q4_K bytes [rows, cols // 256 * 144]: random codes and 6-bit scales and
    mins, d and dmin float16 over four decades (one row's d zero, one block's dmin zero)."""
    rng = np.random.default_rng(seed)
    nsup = cols // 256
    blocks = rng.integers(0, 256, (rows, nsup, 144), dtype=np.uint8)  # [rows, nsup, 144]
    mags = 10.0 ** rng.uniform(-4, 0, (rows, nsup, 2))
    d = (mags * rng.choice([1.0, -1.0], (rows, nsup, 2))).astype(np.float16)  # d, dmin
    d[rows // 2, :, 0] = 0.0
    d[-1, 0, 1] = 0.0
    blocks[:, :, :4] = d.view(np.uint8).reshape(rows, nsup, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("fmt", quant.GGML_FORMATS)
def test_the_layout_keeps_every_bit_of_the_file(fmt):
    for rows, cols in SHAPES:
        ggml = random_blocks(fmt, rows, cols, seed=rows)
        packed = quant.pack_ggml(ggml, fmt, rows, cols)
        assert packed.size == quant.packed_nbytes(fmt, rows, cols)
        assert packed.size % 64 == 0
        assert np.array_equal(quant.unpack_to_ggml(packed, fmt, rows, cols), ggml)


def q4k_parts(packed: np.ndarray, rows: int, cols: int):
    """(q int [rows, cols] 0..15, d*sc float32 [rows, nb], dmin*m float32 [rows, nb]) read
    from the file's bytes by ggml's block description (not by moeshard's layout code)."""
    raw = quant.unpack_to_ggml(packed, "q4_K", rows, cols).reshape(rows, cols // 256, 144)
    d = raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nsup]
    dmin = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = raw[:, :, 4:16].astype(np.int64)  # ggml's get_scale_min_k4, written out per index
    sc, m = np.zeros((rows, cols // 256, 8)), np.zeros((rows, cols // 256, 8))
    for j in range(8):
        if j < 4:
            sc[..., j], m[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4)
            m[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    qs = raw[:, :, 16:].reshape(rows, cols // 256, 4, 32)  # chunk j: sub-blocks 2j, 2j + 1
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, cols).astype(np.int64)
    ds = (d[..., None] * sc.astype(np.float32)).reshape(rows, -1).astype(np.float32)
    dm = (dmin[..., None] * m.astype(np.float32)).reshape(rows, -1).astype(np.float32)
    return q, ds, dm


def q5k_parts(packed: np.ndarray, rows: int, cols: int):
    """q4k_parts of q5_K: its scales and low nibbles are q4_K's, the top bit of column
    32i + l is bit i of qh[l]."""
    raw = quant.unpack_to_ggml(packed, "q5_K", rows, cols).reshape(rows, cols // 256, 176)
    as_q4 = np.concatenate([raw[:, :, :16], raw[:, :, 48:]], axis=2).reshape(rows, -1)
    q, ds, dm = q4k_parts(quant.pack_ggml(as_q4, "q4_K", rows, cols), rows, cols)
    qh = raw[:, :, 16:48].astype(np.int64)  # [rows, nsup, 32]
    top = np.stack([(qh >> i) & 1 for i in range(8)], axis=2).reshape(rows, cols)
    return q | top << 4, ds, dm


def test_gguf_dequantises_q5k_as_read_here():
    for rows, cols in SHAPES:
        packed = quant.pack_ggml(random_q5k(rows, cols, seed=cols), "q5_K", rows, cols)
        q, ds, dm = q5k_parts(packed, rows, cols)
        ggml = quant.unpack_to_ggml(packed, "q5_K", rows, cols)
        want = quants.dequantize(ggml, GGMLQuantizationType.Q5_K).reshape(rows, cols)
        mine = ds.repeat(32, axis=1) * q.astype(np.float32) - dm.repeat(32, axis=1)
        assert same_bits(mine.astype(np.float32), np.asarray(want, dtype=np.float32))


def test_gguf_dequantises_the_blocks_as_read_here():
    for rows, cols in SHAPES:
        packed = quant.pack_ggml(random_q4k(rows, cols, seed=cols), "q4_K", rows, cols)
        q, ds, dm = q4k_parts(packed, rows, cols)
        ggml = quant.unpack_to_ggml(packed, "q4_K", rows, cols)
        want = quants.dequantize(ggml, GGMLQuantizationType.Q4_K).reshape(rows, cols)
        mine = ds.repeat(32, axis=1) * q.astype(np.float32) - dm.repeat(32, axis=1)
        assert same_bits(mine.astype(np.float32), np.asarray(want, dtype=np.float32))
        assert same_bits(quant.dequantize(ggml, "q4_K", (rows, cols)), mine.astype(np.float32))


def q6k_parts(packed: np.ndarray, rows: int, cols: int):
    """(q int [rows, cols] 0..63, d*sc float32 [rows, cols // 16]) from the file's bytes by
    ggml's block description: ql's byte 64h + l holds columns 128h + l and 128h + 64 + l in
    its nibbles, qh's byte 32h + l the high bit pairs of 128h + 32i + l, i = 0..3."""
    nsup = cols // 256
    raw = quant.unpack_to_ggml(packed, "q6_K", rows, cols).reshape(rows, nsup, 210)
    ql, qh = raw[:, :, :128].astype(np.int64), raw[:, :, 128:192].astype(np.int64)
    q = np.zeros((rows, nsup, 256), dtype=np.int64)
    for col in range(256):
        h, l = divmod(col, 128)
        low = ql[:, :, 64 * h + l % 64] >> (4 * (l // 64)) & 15
        high = qh[:, :, 32 * h + l % 32] >> (2 * (l // 32)) & 3
        q[:, :, col] = low | high << 4
    d = raw[:, :, 208:210].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nsup]
    sc = raw[:, :, 192:208].view(np.int8).astype(np.float32)  # [rows, nsup, 16]
    return q.reshape(rows, cols), (d[..., None] * sc).reshape(rows, -1)


def test_gguf_dequantises_q6k_as_read_here():
    for rows, cols in SHAPES:
        packed = quant.pack_ggml(random_q6k(rows, cols, seed=cols), "q6_K", rows, cols)
        q, ds = q6k_parts(packed, rows, cols)
        ggml = quant.unpack_to_ggml(packed, "q6_K", rows, cols)
        want = quants.dequantize(ggml, GGMLQuantizationType.Q6_K).reshape(rows, cols)
        mine = ds.repeat(16, axis=1) * (q - 32).astype(np.float32)
        assert same_bits(mine.astype(np.float32), np.asarray(want, dtype=np.float32))


def q6k_emulation(q, ds, x: np.ndarray) -> np.ndarray:
    """The q6_K integer path in numpy: per 16 columns j (two per 32-column block k, whose
    activation scale dx_k they share), t = sum (q - 32) xq exactly, a = fma(ds_j dx_k, t, a),
    j in order."""
    xq, dx = quantize_x(x)
    acc = np.zeros((x.shape[0], q.shape[0]), dtype=np.float32)  # [b, rows]
    for j in range(x.shape[1] // 16):
        cs = slice(16 * j, 16 * j + 16)
        t = (xq[:, None, cs] * (q[None, :, cs] - 32)).sum(axis=-1).astype(np.float32)
        with np.errstate(invalid="ignore"):
            acc = fma32(ds[None, :, j] * dx[:, None, j // 2], t, acc)
    return acc


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def iq4_parts(packed: np.ndarray, fmt: str, rows: int, cols: int):
    """(v int [rows, cols], the IQ4_VALUES of the codes; scale float32 [rows, cols // 32]) from
    the file's bytes by ggml's block description: iq4_nl's is q4_0's with d; iq4_xs per 256
    columns d, scales_h, scales_l[4] and sub-block s's codes in bytes 16s.. of the rest, its
    scale d * (ls - 32), ls = low nibble s % 2 of scales_l[s // 2] | bit pair s of scales_h."""
    raw = quant.unpack_to_ggml(packed, fmt, rows, cols)
    if fmt == "iq4_nl":
        blocks = raw.reshape(rows, cols // 32, 18)
        scale = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[:, :, 2:]
    else:
        blocks = raw.reshape(rows, cols // 256, 136)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        high = blocks[:, :, 2:4].copy().view(np.uint16)[..., 0].astype(np.int64)
        low = blocks[:, :, 4:8].astype(np.int64)
        s = np.arange(8)
        ls = ((low[..., s // 2] >> (4 * (s % 2))) & 15) | (((high[..., None] >> (2 * s)) & 3) << 4)
        scale = (d[..., None] * (ls - 32).astype(np.float32)).reshape(rows, -1)
        qs = blocks[:, :, 8:].reshape(rows, -1, 16)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, cols)
    return IQ4_VALUES[q], scale.astype(np.float32)


def test_gguf_dequantises_iq4_as_read_here():
    for fmt in ("iq4_nl", "iq4_xs"):
        for rows, cols in SHAPES:
            packed = quant.pack_ggml(random_blocks(fmt, rows, cols, cols), fmt, rows, cols)
            v, scale = iq4_parts(packed, fmt, rows, cols)
            ggml = quant.unpack_to_ggml(packed, fmt, rows, cols)
            qtype = GGMLQuantizationType.IQ4_NL if fmt == "iq4_nl" else GGMLQuantizationType.IQ4_XS
            want = quants.dequantize(ggml, qtype).reshape(rows, cols)
            mine = scale.repeat(32, axis=1) * v.astype(np.float32)
            assert same_bits(mine.astype(np.float32), np.asarray(want, dtype=np.float32)), fmt


def iq4_emulation(v, scale, x: np.ndarray) -> np.ndarray:
    """The iq4 integer path in numpy: per 32-column block k, t = sum v xq exactly, then
    a = fma(scale_k dx_k, t, a), k in order."""
    xq, dx = quantize_x(x)
    acc = np.zeros((x.shape[0], v.shape[0]), dtype=np.float32)  # [b, rows]
    for k in range(x.shape[1] // 32):
        cs = slice(32 * k, 32 * k + 32)
        t = (xq[:, None, cs] * v[None, :, cs]).sum(axis=-1).astype(np.float32)  # [b, rows]
        with np.errstate(invalid="ignore"):
            acc = fma32(scale[None, :, k] * dx[:, None, k], t, acc)
    return acc


def emulate(fmt: str, packed: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    if fmt == "q4_K":
        return q4k_emulation(*q4k_parts(packed, rows, cols), x)
    if fmt in LEGACY:
        return legacy_emulation(fmt, *legacy_parts(packed, fmt, rows, cols), x)
    if fmt == "q5_K":
        return q4k_emulation(*q5k_parts(packed, rows, cols), x)
    if fmt == "q6_K":
        return q6k_emulation(*q6k_parts(packed, rows, cols), x)
    return iq4_emulation(*iq4_parts(packed, fmt, rows, cols), x)


def q4k_emulation(q, ds, dm, x: np.ndarray) -> np.ndarray:
    """The q4_K integer path in numpy: per 32-column block k, t = sum q xq and s = sum xq
    exactly; a = fma(ds_k dx_k, t, a) then a = fma((-dm_k) dx_k, s, a), k in order."""
    xq, dx = quantize_x(x)
    acc = np.zeros((x.shape[0], q.shape[0]), dtype=np.float32)  # [b, rows]
    for k in range(x.shape[1] // 32):
        cs = slice(32 * k, 32 * k + 32)
        t = (xq[:, None, cs] * q[None, :, cs]).sum(axis=-1).astype(np.float32)  # [b, rows]
        s = xq[:, cs].sum(axis=-1).astype(np.float32)[:, None]  # [b, 1]
        with np.errstate(invalid="ignore"):
            acc = fma32(ds[None, :, k] * dx[:, None, k], t, acc)
            acc = fma32((-dm[None, :, k]) * dx[:, None, k], s, acc)
    return acc


@pytest.mark.parametrize("fmt", quant.GGML_FORMATS)
@pytest.mark.parametrize("mode", quant.ACTIVATIONS)
def test_matmul_equals_numpy_emulation(fmt, mode, run):  # noqa: F811
    """Either activation mode: the K-quants have only the integer kernels."""
    quant.use_activations(mode)
    try:
        for rows, cols in SHAPES:
            packed = quant.pack_ggml(random_blocks(fmt, rows, cols, rows * cols), fmt, rows, cols)
            for b in (1, 2, 3, 4, 17):
                x = activations(b, cols, seed=b)
                if b == 3:
                    x[1, 40] = np.nan  # poisons its row only
                want = emulate(fmt, packed, rows, cols, x)
                for n_threads in (0, 2):
                    got = run(n_threads, quant.matmul, packed, fmt, rows, cols, x)
                    assert same_bits(got, want), (rows, cols, b, n_threads)
    finally:
        quant.use_activations("q8")


@pytest.mark.parametrize("fmt", quant.GGML_FORMATS)
@pytest.mark.parametrize("n_threads", (0, 2))
def test_rows_do_not_depend_on_the_batch(fmt, n_threads, run):  # noqa: F811
    rows, cols = 19, 768
    packed = quant.pack_ggml(random_blocks(fmt, rows, cols, seed=3), fmt, rows, cols)
    x = activations(max(BATCHES) + 3, cols, seed=4)  # [36, cols]
    singles = np.concatenate(
        [run(0, quant.matmul, packed, fmt, rows, cols, x[i : i + 1]) for i in range(len(x))]
    )

    def call(xb):
        return run(n_threads, quant.matmul, packed, fmt, rows, cols, xb)

    check_rows_independent(call, singles, x, n_threads)


def expert_record(fmt: str, hidden: int, inter: int, seed: int) -> np.ndarray:
    mats = [(inter, hidden), (inter, hidden), (hidden, inter)]  # gate, up, down
    return np.concatenate(
        [
            quant.pack_ggml(random_blocks(fmt, r, c, seed + i), fmt, r, c)
            for i, (r, c) in enumerate(mats)
        ]
    )


@pytest.mark.parametrize("fmt", quant.GGML_FORMATS)
def test_experts_equal_their_reference_and_each_other(fmt):
    """The expert FFN on a K-quant record: its float64 twin, and the batch-1 and per-rows
    kernels give each row the bits `expert_ffn` gives it."""
    hidden, inter = 512, 256
    recs = [expert_record(fmt, hidden, inter, seed) for seed in (1, 5)]
    assert recs[0].size == quant.expert_record_nbytes(fmt, hidden, inter)
    x = activations(6, hidden, seed=9) * np.float32(0.05)  # [6, hidden]
    y = quant.expert_ffn(recs[0], fmt, hidden, inter, x)  # [6, hidden]
    ref = quant.expert_ffn_reference(recs[0], fmt, hidden, inter, x)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()
    arena = np.concatenate(recs)
    offsets = np.array([0, recs[0].size])
    b1 = quant.experts_ffn_b1(arena, offsets, fmt, hidden, inter, x[:2])
    for e in range(2):
        one = quant.expert_ffn(recs[e], fmt, hidden, inter, x[e : e + 1])
        assert same_bits(b1[e : e + 1], one)
    rows = quant.experts_ffn_rows(arena, offsets, fmt, hidden, inter, x, [0, 4, 6])
    assert same_bits(rows[:4], y[:4])
    assert same_bits(rows[4:], quant.expert_ffn(recs[1], fmt, hidden, inter, x[4:]))


def test_q4k_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.pack_ggml(np.zeros((8, 144), np.uint8), "q4_K", 8, 128)
    with pytest.raises(ValueError, match="cannot be made from floats"):
        quant.pack(np.zeros((8, 256), np.float32), "q4_K")
    with pytest.raises(ValueError, match="ggml bytes"):
        quant.pack_ggml(np.zeros((8, 143), np.uint8), "q4_K", 8, 256)
    assert "q4_K" in layout.ALL_FORMATS and "q4_K" not in quant.FORMATS


def test_a_record_format_is_checked_against_the_widths_of_its_own_matrices(tmp_path):
    """Gate and up have expert_hidden columns, down expert_intermediate: a 256-wide model
    whose experts are 64 wide takes q4_K gate/up with a 32-column down format (llama-quantize's
    Q4_K_M of the demo model), not the other way round."""
    from types import SimpleNamespace

    from moeshard.moe.convert.converter import _check_block_dims
    from moeshard.moe.errors import ConfigError

    config = SimpleNamespace(expert_hidden=256, expert_intermediate=64)
    _check_block_dims(config, "q4_K/q5_0,q4_K/q8_0", tmp_path)
    with pytest.raises(ConfigError, match="expert width 64 is not a multiple of 256"):
        _check_block_dims(config, "q5_0/q4_K", tmp_path)
    with pytest.raises(ValueError, match="not a weight format"):
        quant.expert_format_entries("q4_K/q3_K")
    assert quant.record_format("q4_K,-,q4_K/q6_K", 2) == "q4_K/q6_K"
    with pytest.raises(ValueError, match="no experts for layer 1"):
        quant.record_format("q4_K,-,q4_K/q6_K", 1)
