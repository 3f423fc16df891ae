"""What a node's arithmetic depends on, so a verifier knows when to expect equal bits.

The expert kernels' bits are fixed by `ARITHMETIC`: two nodes computing the same arithmetic
give bit-identical replies for the same request, on any CPU level (AVX-512, AVX2, baseline
x86-64) and for any weight format.  No kernel has a fast-math flag, every sum runs in an order
the source fixes, the q4_0/q8_0/mxfp4 block sums are exact integers, each FMA is IEEE's one
rounding wherever it is computed, float16 scales widen exactly with or without F16C, and the
gated unit's exp and tanh are `moeshard.moe.kernels.fixedmath`'s fixed sequences of IEEE operations,
not libm's (tests/test_kernel_isa.py compiles the kernels for generic, SSE2-only and native
CPUs and requires equal bits; docs/kernels.md).  Every node computes with 8-bit activations
(the default of `quant.use_activations`; the f32 mode is for `moeshard quality` and local runs
only).  Nothing in the arithmetic is left to the compiler or the C library, so kernel builds
of one arithmetic (`kernel_build`: the source and the numba and numpy versions) should agree as
well; that is not tested across numba versions here.  A node reports `kernel_build` and
`cpu_level` in its Info beside the arithmetic, for diagnosis.  The kernels assume the default
floating-point environment (no flush-to-zero or denormals-are-zero).
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
#   2: q4_0/q8_0 with 8-bit activations (`moeshard.moe.kernels.idots`); f32/bf16 in float32 lanes
#   3: as 2, bf16 rows' lanes taking even and odd columns (`moeshard.moe.kernels.fdots`)
#   4: q4_0/q8_0 rows in interleaved groups of eight, one exact integer sum per block and one
#      float32 accumulator per row (`moeshard.moe.kernels.idots`)
#   5: as 4, the gated unit's exp and tanh computed by moeshard's own fixed-operation float64
#      code (`moeshard.moe.kernels.fixedmath`), not libm
ARITHMETIC = 5

SOURCES = (
    "activations.py",
    "dots.py",
    "idots.py",
    "fdots.py",
    "tiles.py",
    "fixedmath.py",
    "entry.py",
    "layout.py",
    "quant.py",
)


@functools.cache
def kernel_build() -> str:
    """16 hex digits: the kernels' source and the numba and numpy versions they compile with."""
    digest = hashlib.sha256(f"numba {numba.__version__}; numpy {np.__version__};".encode())
    here = Path(__file__).parent
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def target_features() -> set[str]:
    """The features of the CPU numba compiles for ("+avx2", "+f16c", ...): the host's, or
    NUMBA_CPU_FEATURES when NUMBA_CPU_NAME names another CPU (a portable build, or
    `bench compare-llamacpp --isa avx2` playing an AVX2 machine)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host":
        return set((config.CPU_FEATURES or "").split(","))
    return set(llvm.get_host_cpu_features().flatten().split(","))


@functools.cache
def cpu_level() -> str:
    """The instruction-set level the kernels are compiled for: 'avx512', 'avx2' or
    'baseline' (from the features numba compiles for, `target_features`)."""
    features = target_features()
    if "+avx512f" in features and "+avx512vl" in features:
        return "avx512"
    if "+avx2" in features and "+fma" in features:
        return "avx2"
    return "baseline"
