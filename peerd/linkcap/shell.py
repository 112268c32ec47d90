"""The caps' trio shell: a socket wrapper that waits where the core says before each send, and the task that ticks
the core and hands its limits to the averaging pacer. Neither decides anything (peerd/linkcap/core.py does)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from ..transport.caps import SocketCaps, plain_caps
from .core import LinkCap

log = logging.getLogger("peerd.linkcap")
Address = tuple[str, int]


class CappedSocket:
    """Wraps the daemon's datagram socket: every send (averaging data, DHT, state sync, relaying) waits for the
    upload bucket first; receives are counted for the download side. Everything else is the wrapped socket's."""

    def __init__(self, sock: Any, core: LinkCap, clock: Callable[[], float] = trio.current_time) -> None:
        self.inner = sock
        self.core = core
        self.clock = clock
        self.family = getattr(sock, "family", None)
        self.caps: SocketCaps = getattr(sock, "caps", None) or plain_caps()

    def __getattr__(self, name: str) -> Any:  # receives, statistics, kernel_drops, fileno ...: the wrapped socket's
        return getattr(self.inner, name)

    async def _wait(self, nbytes: int, datagrams: int) -> None:
        wait = self.core.send(nbytes, datagrams, self.clock())
        if wait > 0:
            await trio.sleep(wait)

    async def sendto(self, data: bytes, address: Address, /) -> None:
        await self._wait(len(data), 1)
        await self.inner.sendto(data, address)

    async def send_many(self, datagrams: list[bytes], address: Address, /) -> None:
        await self._wait(sum(map(len, datagrams)), len(datagrams))
        await self.inner.send_many(datagrams, address)

    async def send_block(self, datagrams: Any, address: Address, /) -> None:
        await self._wait(int(datagrams.size), len(datagrams))
        await self.inner.send_block(datagrams, address)


class CapTicker:
    """Ticks the core every TICK_S: what arrived (``received()``: cumulative payload bytes and datagrams) and the
    limits in force, handed to ``on_limits(core)`` (the daemon points the pacer's ceiling and its records at them)."""

    def __init__(self, core: LinkCap, received: Callable[[], tuple[int, int]],
                 on_limits: Callable[[LinkCap], None]) -> None:
        self.core = core
        self.received = received
        self.on_limits = on_limits

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.core.start(trio.current_time())
        self.on_limits(self.core)
        task_status.started()
        while True:
            at = self.core.get_timer()
            if at is not None:
                await trio.sleep_until(at)
            now = trio.current_time()
            try:
                self.core.receive_total(*self.received(), now)
                before = (self.core.upload_limit, self.core.download_limit)
                self.core.handle_timer(now)
                if (self.core.upload_limit, self.core.download_limit) != before:
                    self.on_limits(self.core)
            except Exception:  # never fatal: the caps keep their last limits
                log.exception("link caps: tick failed")
                await trio.sleep(1.0)


def clamp_pacer(pacer: Any, ceiling: float | None) -> None:
    """The averaging pacer never goes above ``ceiling`` (payload bytes/s; None: lifts nothing it had)."""
    if ceiling is None:
        return
    pacer.max_rate = ceiling
    pacer.min_rate = min(pacer.min_rate, ceiling)
    pacer.rate = min(pacer.rate, ceiling)
    if pacer.btl is not None:
        pacer.btl = min(pacer.btl, ceiling)


def limit_senders(pacer: Any, members: list[Any], peer_caps: Any, datagram: int) -> None:
    """Before a group's average: send to each member that published a download cap at most its share of it
    (``advert.sender_rate``), so that the group's senders together stay under it."""
    from .advert import sender_rate

    for mb in members:
        rate = sender_rate(peer_caps.get(mb.node_id), len(members), datagram)
        if rate is not None:
            pacer.limit(mb.node_id, ("cap", mb.node_id), rate, 0.05 * rate)
