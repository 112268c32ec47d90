"""Keep freed block buffers in the process's heap instead of handing them back to the kernel (glibc only).

The data path allocates a few hundred KB per block (packed bodies, sealed datagrams, opened bodies), about 200 MB
per 100 MB average. glibc serves such sizes by ``mmap`` at first, or from the heap top, which it trims back to the
kernel as soon as more than ~1 MB is free there; either way every block's buffer is fresh pages, faulted in and
zeroed by the kernel: ~45k page faults per daemon per average, each a point where a loaded machine preempts it.
Raising the two thresholds keeps those pages: the next block reuses warm memory. The cost is that up to
``trim_bytes`` of freed memory stays with the process (a daemon averaging 100 MB holds that much anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_BYTES = 32 << 20  # allocations below this come from the heap (glibc's largest dynamic threshold)
TRIM_BYTES = 256 << 20  # free memory the heap keeps at its top before giving it back


def keep_freed_memory(mmap_bytes: int = MMAP_BYTES, trim_bytes: int = TRIM_BYTES) -> bool:
    """Set glibc's mmap and trim thresholds (process-wide: call it once, from a daemon's startup, not from a
    library). False, and nothing changed, where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    if not (0 < mmap_bytes <= 1 << 30 and 0 < trim_bytes <= 1 << 34):
        raise ValueError(f"thresholds out of range: mmap_bytes={mmap_bytes}, trim_bytes={trim_bytes}")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))
