"""Embedding lookups decode only the rows they need (`quant.dequantize_rows`): the values of
the whole table's decode, in every trunk format and any GGUF format a trunk tensor can keep,
and no float32 copy of the table left behind."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.bench.kernels import random_ggml
from moeshard.moe.kernels import quant
from moeshard.moe.model.trunk import Trunk
from moeshard.moe.storage.trunk_file import TrunkTensor

ROWS, COLS = 83, 256  # a partial last row group
IDS = np.array([0, 82, 7, 8, 7, 40, 81, 15], dtype=np.int64)  # repeats, both ends of groups


def packed(fmt: str) -> np.ndarray:
    rng = np.random.default_rng(3)
    if fmt in quant.GGML_FORMATS:
        return random_ggml(fmt, ROWS, COLS, rng)
    return quant.pack(rng.standard_normal((ROWS, COLS), dtype=np.float32), fmt)


@pytest.mark.parametrize("fmt", [*quant.FORMATS, "q4_K", "q6_K", "iq4_xs"])
def test_rows_equal_the_whole_tables_decode(fmt):
    data = packed(fmt)
    whole = TrunkTensor(fmt, (ROWS, COLS), data).to_f32()  # [ROWS, COLS]
    rows = quant.dequantize_rows(data, fmt, ROWS, COLS, IDS)  # [8, COLS]
    assert rows.dtype == np.float32 and rows.shape == (len(IDS), COLS)
    np.testing.assert_array_equal(rows, whole[IDS])
    with pytest.raises(IndexError, match="within 0..82"):
        quant.dequantize_rows(data, fmt, ROWS, COLS, [ROWS])


@pytest.mark.parametrize("fmt", ["bf16", "f32", "q8_0"])
def test_embed_keeps_no_float32_table(fmt):
    """`Trunk.embed` (float rows by `quant.float_rows_at`, in one kernel call) gives
    `dequantize_rows`' values, keeps no float32 copy of the table, and refuses a row id
    outside it."""
    data = packed(fmt)
    trunk = Trunk({"model.embed_tokens.weight": TrunkTensor(fmt, (ROWS, COLS), data)})
    got = trunk.embed("model.embed_tokens.weight", IDS)
    assert got.dtype == np.float32 and got.shape == (len(IDS), COLS)
    np.testing.assert_array_equal(got, quant.dequantize_rows(data, fmt, ROWS, COLS, IDS))
    one = trunk.embed("model.embed_tokens.weight", [IDS[1]])  # (a list, as a caller may give)
    np.testing.assert_array_equal(one, got[1:2])
    assert not trunk._cache  # (it kept a float32 copy of the whole table before)
    assert all(v[1].base is not None for v in trunk._row_views.values())  # views of the bytes
    for bad in (ROWS, -1):
        with pytest.raises(IndexError):
            trunk.embed("model.embed_tokens.weight", np.array([3, bad]))
