"""What a node's arithmetic depends on, so a verifier knows when to expect equal bits.

Two nodes give bit-identical replies for the same request only when they run the same kernel
source with the same numba and numpy, compiled for the same CPU features (LLVM vectorises the
float sums differently for AVX2 and AVX-512). `kernel_build` names the first, `cpu_level` the
second; a node reports both in its Info.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numba
import numpy as np

SOURCES = ("dots.py", "tiles.py", "entry.py", "quant.py")


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
