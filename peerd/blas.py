"""The daemon's BLAS on one thread.

numpy's OpenBLAS starts a worker per core and splits even a small product between them (a robust average's Gram
matrix, 8 x 100k values). In a daemon that shares its machine with a trainer (and, on a small machine, with other
daemons), the worker is often not on a core when the product needs it, so the event loop waits for it in the middle
of an average: at 8 peers on a 2-core machine, a step was 1.58-1.66 s with the default threads against 1.50-1.53 s
with one (`peerd bench step --peers 8 --link 10mbit`). The daemon's products are small; one thread is what they
need, and the trainer keeps the other cores.

OpenBLAS reads its thread count when numpy loads it, so this finds the loaded library and sets it at run time
(``OPENBLAS_NUM_THREADS`` in the daemon's environment still wins: an owner who sets it gets what they asked for).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

# (setter, getter) pairs: numpy's wheels bundle scipy-openblas (64-bit integer interface, suffixed symbols); a
# distribution's numpy links the system OpenBLAS
SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)
ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def _loaded_blas() -> list[str]:
    """Paths of the BLAS libraries mapped into this process (Linux: /proc/self/maps; elsewhere none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return []
    paths = {parts[5].strip() for parts in fields if len(parts) == 6}  # (anonymous mappings have no path)
    return sorted(p for p in paths if "openblas" in os.path.basename(p).lower())


def _functions() -> list[tuple[Any, Any]]:
    """(set, get) thread-count functions of each OpenBLAS loaded."""
    found = []
    for path in _loaded_blas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for setter, getter in SYMBOLS:
            if hasattr(lib, setter) and hasattr(lib, getter):
                get = getattr(lib, getter)
                get.restype, get.argtypes = ctypes.c_int, []
                found.append((getattr(lib, setter), get))
                break
    return found


def blas_threads() -> list[int]:
    """The thread count of each OpenBLAS loaded in this process (empty: none found)."""
    return [int(get()) for _, get in _functions()]


def one_blas_thread() -> bool:
    """Run numpy's OpenBLAS on one thread in this process, unless the environment names a count. Whether a
    library was set (False: none found, or the environment decides)."""
    import numpy  # noqa: F401 - loads the BLAS this sets

    if any(os.environ.get(name) for name in ENV):
        return False
    done = False
    for setter, _ in _functions():
        setter.argtypes, setter.restype = [ctypes.c_int], None  # (an int in every interface, 64-bit ones too)
        setter(1)
        done = True
    if done:
        log.debug("BLAS: one thread")
    return done
