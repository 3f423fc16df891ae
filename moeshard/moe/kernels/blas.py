"""Keep numpy's OpenBLAS on one thread.

Why: decode multiplies vectors ([1, H] @ [H, E] routers, f32 trunk matrices); OpenBLAS splits
even those over its threads, and on a small or shared machine (2 cores, a background job,
our own I/O and numba threads) a helper thread that is not scheduled at once stalls the
call. Measured here under load: a [1, 2048] @ [2048, 896] router product took 5.1 ms median
(p90 16 ms) with the default threads and 0.1 ms (p90 0.14 ms) on one thread, which halves
`bench stream`'s s/token. The heavy matmuls run in our numba kernels, not in BLAS.

Setting OPENBLAS_NUM_THREADS=1 before numpy is imported does the same; this does it at run
time through the OpenBLAS bundled with numpy, and does nothing when that library is absent.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os

import numpy as np

log = logging.getLogger(__name__)

_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def limit_blas_threads(n: int = 1) -> bool:
    """Set numpy's OpenBLAS thread count; returns whether a bundled OpenBLAS was found."""
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "lib*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                log.debug("OpenBLAS threads set to %d via %s", n, name)
                return True
    log.debug("no bundled OpenBLAS found; BLAS threads left as they are")
    return False
