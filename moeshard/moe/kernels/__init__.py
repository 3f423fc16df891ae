"""The numba kernels (docs/kernels.md).  Importing the package first points numba's cache at a
directory of this version of the kernels' sources (`numba_cache`: numba alone would keep a
kernel compiled against an older version of a function in another file)."""

from moeshard.moe.kernels.numba_cache import use_source_keyed_cache

use_source_keyed_cache()
