"""Step 1 of the integer kernels (`moeshard.moe.kernels.idots` has all the steps): the
activations quantised to 8 bits per 32-column block, with each block's scale, 8 x the sum of
its codes and the sum of its first 16 (q6_K's scales cover 16 columns), once per call for
every row group that multiplies them."""

import numpy as np
from numba import njit

from moeshard.moe.kernels.dots import QK


@njit(cache=True, nogil=True)
def quantize_activations(x, xq, xd, xc):
    """x float32 [b, cols] -> codes xq int8 [b, cols], block scales xd float32 [b, cols // 32]
    and xc int32 [b, 2 * (cols // 32)]: xc[u, 2k] = 8 * the sum of block k's codes, xc[u,
    2k + 1] the sum of its first 16 (step 1 of the module doc)."""
    for u in range(x.shape[0]):
        for k in range(x.shape[1] // QK):
            c0 = QK * k
            amax = np.float32(0.0)
            finite = True
            for c in range(c0, c0 + QK):
                v = abs(x[u, c])
                if v > amax:
                    amax = v
                elif not (v == v):
                    finite = False
            if not finite or amax == np.inf:
                xd[u, k] = np.float32(np.nan)
                for c in range(c0, c0 + QK):
                    xq[u, c] = 0
            elif amax == 0:
                xd[u, k] = np.float32(0.0)
                for c in range(c0, c0 + QK):
                    xq[u, c] = 0
            else:
                d = amax / np.float32(127.0)
                inv = np.float32(1.0) / d
                xd[u, k] = d
                for c in range(c0, c0 + QK):
                    q = np.rint(x[u, c] * inv)
                    xq[u, c] = np.int8(min(max(q, np.float32(-127.0)), np.float32(127.0)))
            first = 0
            for c in range(c0, c0 + QK // 2):
                first += np.int32(xq[u, c])
            s = first
            for c in range(c0 + QK // 2, c0 + QK):
                s += np.int32(xq[u, c])
            xc[u, 2 * k] = 8 * s
            xc[u, 2 * k + 1] = first


@njit(cache=True, nogil=True)
def activation_buffers(b, cols):
    """Empty (xq, xd, xc) for `quantize_activations` of a [b, cols] activation."""
    nb = cols // QK
    xq = np.empty((b, cols), dtype=np.int8)  # [b, cols]
    xd = np.empty((b, nb), dtype=np.float32)  # [b, nb]
    xc = np.empty((b, 2 * nb), dtype=np.int32)  # [b, 2 nb]: 8 x block sums, first halves
    return xq, xd, xc
