"""Virtual time for trio tests, reading a Prometheus counter, and a digest."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing


def run_virtual(fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Run ``fn(*args)`` under a MockClock that jumps whenever every task waits: seconds of protocol time take
    milliseconds, and the schedule is the same on every run: trio shuffles the tasks it wakes together, so its
    scheduler's generator is seeded here (and put back after, for the real-time tests in the same process)."""
    shuffler = trio._core._run._r  # trio's own, private: the only source of ordering a test's seeds do not fix
    state = shuffler.getstate()
    shuffler.seed(0)
    try:
        trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        shuffler.setstate(state)


def counter_value(counter: Any, **labels: str) -> float:
    """The sum of ``counter``'s ``_total`` samples whose labels include ``labels``."""
    return sum(s.value for family in counter.collect() for s in family.samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def sha(b: bytes) -> bytes:
    """SHA-256 of ``b`` (the digest records and snapshots name their contents by)."""
    return hashlib.sha256(b).digest()
