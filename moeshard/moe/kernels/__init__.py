"""The numba kernels (docs/kernels.md).  Importing the package first points numba's cache at a
directory of this version of the kernels' sources (`numba_cache`: numba alone would keep a
kernel compiled against an older version of a function in another file), and has numba read
and write that cache under a lock (`lock_cache_files`: numba's own files are not safe for
several processes at once)."""

from moeshard.moe.kernels.numba_cache import lock_cache_files, use_source_keyed_cache

lock_cache_files()
use_source_keyed_cache()
