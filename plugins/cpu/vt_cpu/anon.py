"""Large host arrays on their own anonymous mappings.

Pages of a private anonymous mapping are zero when first touched and count toward the
process's memory only then, and they go back to the OS when the array is freed. numpy
takes large arrays from malloc, whose heap keeps what is freed (and ``calloc`` zeroes a
reused chunk whole, every page resident at once): a second runner's buffers stayed
resident beside the first's (``vt bench``: +13 MiB on a 1B model).
"""

from __future__ import annotations

import mmap

import numpy as np

#: Arrays of at least this many bytes are mapped on their own.
MMAP_MIN_BYTES = 1 << 20
_MAP_PRIVATE: int | None = getattr(mmap, "MAP_PRIVATE", None)  # None on Windows


def zeros(nbytes: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """A zeroed 1-D array of ``nbytes`` bytes (a whole number of ``dtype`` items): its own
    mapping from :data:`MMAP_MIN_BYTES` on, else ``np.zeros``."""
    if nbytes >= MMAP_MIN_BYTES and _MAP_PRIVATE is not None:
        # Private: a forked child must not share the memory (mmap's default is shared).
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=_MAP_PRIVATE), dtype=dtype)
    return np.zeros(nbytes // np.dtype(dtype).itemsize, dtype=dtype)
