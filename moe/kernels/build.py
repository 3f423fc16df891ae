"""What a node's arithmetic depends on, so a verifier knows when to expect equal bits.

Two nodes give bit-identical replies for the same request when they run the same kernel source
with the same numba and numpy (`kernel_build`). The q4_0/q8_0 kernels use no fast-math and no
FMA, with explicit 8-lane sums, so their bits do not depend on the CPU either (checked against
generic and SSE2-only builds, docs/kernels.md; the integer path's AVX2 and portable forms are
compared in tests/test_kernel_isa.py).  Every node computes with 8-bit activations (the
default of `quant.use_activations`; the f32 mode is for `moeshard quality` and local runs
only).  The f32/bf16 kernels' float64 sums are still
vectorised per CPU, and silu calls the C library's exp, so `cpu_level` is reported too and a
verifier expects equal bits only when both match. A node reports both in its Info.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numba
import numpy as np

# What the kernels compute, as a number a node reports in its Info and a coordinator requires to
# equal its own: kernels of another arithmetic differ by far more than an auditor's tolerance
# between builds, so such a node is refused rather than audited (and accused).
#   0: not reported (moeshard before this number existed: float32 activations, float64 sums)
#   2: q4_0/q8_0 with 8-bit activations (`moe.kernels.idots`); f32/bf16 in float32 lanes
#   3: as 2, bf16 rows' lanes taking even and odd columns (`moe.kernels.fdots`)
#   4: q4_0/q8_0 rows in interleaved groups of eight, one exact integer sum per block and one
#      float32 accumulator per row (`moe.kernels.idots`)
ARITHMETIC = 4

SOURCES = ("dots.py", "idots.py", "fdots.py", "tiles.py", "entry.py", "quant.py")


@functools.cache
def kernel_build() -> str:
    """16 hex digits: the kernels' source and the numba and numpy versions they compile with."""
    digest = hashlib.sha256(f"numba {numba.__version__}; numpy {np.__version__};".encode())
    here = Path(__file__).parent
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_level() -> str:
    """The instruction-set level the kernels are compiled for on this CPU: 'avx512', 'avx2'
    or 'baseline' (from LLVM's view of the host, which is what numba compiles for)."""
    import llvmlite.binding as llvm

    features = set(str(llvm.get_host_cpu_features().flatten()).split(","))
    if "+avx512f" in features and "+avx512vl" in features:
        return "avx512"
    if "+avx2" in features and "+fma" in features:
        return "avx2"
    return "baseline"
