"""The integer q4_0/q8_0 dot products give the same bits whichever instructions compute them.

`moe.kernels.idots` compiles its exact integer step with AVX2's vpmaddubsw/vpmaddwd where the
CPU has them and with plain LLVM vector code elsewhere.  This machine runs the AVX2 form in
the test process and the portable form in a child forced with MOESHARD_KERNEL_ISA=generic (and
its own numba cache, since numba's cache does not know about that switch); both must give
equal bits for every batch size, odd block counts, a partial row group and non-finite activations.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moe.kernels import idots, quant
from moe.kernels.entry import _matrix_views

SHAPES = [(5, 96), (9, 2080), (13, 256)]  # (rows, cols): odd and even block counts
BATCHES = (1, 2, 3)

CHILD = """
import json, sys
import numpy as np
from moe.kernels import idots
sys.path.insert(0, {tests!r})
from test_kernel_isa import int_rows_all
assert idots.ISA == "generic", idots.ISA
out = {{key: y.view(np.uint32).tolist() for key, y in int_rows_all().items()}}
json.dump(out, sys.stdout)
"""


def int_rows_all() -> dict[str, np.ndarray]:
    """`idots.int_rows` on fixed weights and activations, for every format, shape and batch."""
    results = {}
    for fmt in ("q4_0", "q8_0", "mxfp4"):
        for rows, cols in SHAPES:
            rng = np.random.default_rng(rows * cols)
            w = rng.standard_normal((rows, cols)).astype(np.float32)  # [rows, cols]
            data = quant._readonly(quant.pack(w, fmt))
            _, row_bytes, scale_off = quant._matrix_layout(fmt, rows, cols)
            wq, ws = _matrix_views(quant._FMT_CODE[fmt], data, rows, cols, row_bytes, scale_off)
            for b in BATCHES:
                x = rng.standard_normal((b, cols)).astype(np.float32) * 3  # [b, cols]
                if b == 3:
                    x[1, 40] = np.inf
                xq, xd, xc = idots.activation_buffers(b, cols)
                idots.quantize_activations(x, xq, xd, xc)
                out = np.empty((b, rows), dtype=np.float32)  # [b, rows]
                idots.int_rows(quant._FMT_CODE[fmt], wq, ws, xq, xd, xc, out, 0, rows)
                results[f"{fmt} {rows}x{cols} b{b}"] = out
    return results


@pytest.mark.skipif(idots.ISA != "avx2", reason="this CPU has no AVX2: only one form to test")
def test_portable_form_equals_avx2_bit_for_bit(tmp_path):
    here = {key: y.view(np.uint32) for key, y in int_rows_all().items()}
    env = dict(os.environ, MOESHARD_KERNEL_ISA="generic", NUMBA_CACHE_DIR=str(tmp_path))
    tests = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(tests=tests)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr
    there = json.loads(child.stdout)
    assert sorted(there) == sorted(here)
    for key, bits in here.items():
        assert np.array_equal(np.asarray(there[key], dtype=np.uint32), bits), key


def test_forced_isa_must_be_known(tmp_path):
    env = dict(os.environ, MOESHARD_KERNEL_ISA="avx9", NUMBA_CACHE_DIR=str(tmp_path))
    child = subprocess.run(
        [sys.executable, "-c", "import moe.kernels.idots"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode != 0 and "MOESHARD_KERNEL_ISA='avx9'" in child.stderr
