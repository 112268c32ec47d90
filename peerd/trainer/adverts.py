"""State advertisements a trainer does not wait for (``state_publish`` with ``wait`` false).

A trainer publishes a snapshot for joiners every few steps (every outer step in DiLoCo). Keeping the blob costs
the daemon a copy and a hash; advertising it is a DHT put, round trips that grow under loss, and a trainer that
waited for it lost that time at every publish. Its periodic publishes therefore only hand the blob over, and the
put happens here in the background: per run, only the newest advertisement still waiting is put (an older one
would only be overwritten), so what waits is bounded by the daemon's runs, whatever a trainer sends.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingAdvert:
    """One snapshot's advertisement, as statesync's ``advertise_state`` takes it."""

    run: str
    run_key: str
    layout: str
    step: int
    size: int
    sha: bytes


class LaterAdverts:
    """Puts advertisements in the background, the newest per run first-come; ``put`` is statesync's
    ``advertise_state``. Failures are logged and counted, never raised: a joiner reads an older advert until the
    next publish."""

    def __init__(self, put: Callable[..., Awaitable[bool]]) -> None:
        self._put = put
        self._waiting: dict[tuple[str, str], PendingAdvert] = {}
        self._wake = trio.Event()
        self.running = False  # the loop runs (else a publish advertises inline)
        self.stored = self.failed = self.replaced = 0

    def submit(self, advert: PendingAdvert) -> None:
        """Queue ``advert``, replacing the one of its run still waiting."""
        key = (advert.run, advert.run_key)
        if key in self._waiting:
            self.replaced += 1
            del self._waiting[key]  # (re-inserted last: runs take turns)
        self._waiting[key] = advert
        self._wake.set()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def run(self) -> None:
        """Put what is submitted, one advert at a time, until cancelled."""
        self.running = True
        try:
            while True:
                if not self._waiting:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                key = next(iter(self._waiting))
                a = self._waiting.pop(key)
                try:
                    ok = await self._put(a.run, a.run_key, a.layout, step=a.step, size=a.size, sha=a.sha)
                except Exception as e:  # a background put never takes the daemon down
                    log.warning("advertising the state of run %s (step %d) failed: %s", a.run, a.step, e)
                    ok = False
                if ok:
                    self.stored += 1
                else:
                    self.failed += 1
        finally:
            self.running = False
