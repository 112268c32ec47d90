"""A service's own nursery, for work that outlives the call that starts it (retries, records, background queries)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import trio


class HoldsNursery(Protocol):
    _nursery: trio.Nursery | None


@asynccontextmanager
async def service_nursery(owner: HoldsNursery) -> AsyncIterator[trio.Nursery]:
    """Open a nursery and keep it on ``owner._nursery`` while it is open, and None once it has closed: a stopping
    daemon's task that starts work after its service ended (a lookup in a bootstrap cut short by SIGTERM) then runs it
    in its own nursery instead of raising "Nursery is closed to new arrivals"."""
    try:
        async with trio.open_nursery() as nursery:
            owner._nursery = nursery
            yield nursery
    finally:
        owner._nursery = None
