"""heap.keep_freed_memory: the daemon's glibc thresholds that keep freed block buffers warm."""

from __future__ import annotations

import platform
import resource

import numpy as np
import pytest

from peerd._dataplane.heap import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_block_buffers_are_reused_not_faulted_in_again() -> None:
    assert keep_freed_memory() is True
    for _ in range(3):  # warm the heap up
        batch = [np.ones((448, 1237), np.uint8) for _ in range(8)]
        del batch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # batches of 8 blocks of 550 KB, as a send window: ~21,000 fresh pages without it
        batch = [np.ones((448, 1237), np.uint8) for _ in range(8)]
        del batch
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1000


def test_thresholds_are_bounded() -> None:
    with pytest.raises(ValueError):
        keep_freed_memory(mmap_bytes=0)
    with pytest.raises(ValueError):
        keep_freed_memory(trim_bytes=1 << 40)
