"""The caps' trio shell: a socket wrapper that waits where the core says before each send, the gate state sync calls
before it answers or asks, the task that ticks the core and hands its limits to the averaging pacer, and the budget's
state file. None of them decides anything (peerd/linkcap/core.py does)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import trio

from ..transport.caps import SocketCaps, plain_caps
from .budget import MAX_SAVED_BYTES, SavedBudget
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


class CapGate:
    """What state sync calls at the point of send: ``admit_serving`` before it answers another node's request (False:
    stay silent), ``wait_fetch`` before it asks for a chunk (sleeps while the download limit says)."""

    def __init__(self, core: LinkCap, clock: Callable[[], float] = trio.current_time) -> None:
        self.core = core
        self.clock = clock

    def admit_serving(self, nbytes: int) -> bool:
        return self.core.admit_serving(nbytes, self.clock())

    async def wait_fetch(self, nbytes: int) -> None:
        wait = self.core.fetch(nbytes, self.clock())
        if wait > 0:
            await trio.sleep(wait)


def load_budget(path: str | None) -> SavedBudget | None:
    """The budget's count a previous run saved at ``path``; None when there is none, or (with a warning) when the
    file is not one peerd wrote: the period is then counted from zero."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SAVED_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("budget state %s cannot be read (%s): counting this period's bytes from zero", path, e)
        return None
    try:
        return SavedBudget.decode(data)
    except ValueError as e:
        log.warning("budget state %s is corrupt (%s): counting this period's bytes from zero", path, e)
        return None


def save_budget(path: str, saved: SavedBudget) -> bool:
    """Write ``saved`` to ``path`` atomically (a temporary file beside it, synced, then renamed over it): a crash
    leaves the old count or the new one, never half of one. Returns False (with a warning) where it cannot."""
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, saved.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("budget state %s cannot be written (%s): the count will not survive a restart", path, e)
        return False
    return True


class CapTicker:
    """Ticks the core every TICK_S: what arrived (``received()``: cumulative payload bytes and datagrams) and the
    limits in force, handed to ``on_limits(core)`` (the daemon points the pacer's ceiling and its records at them);
    reads the budget's saved count when it starts and writes it when the core says and when it stops."""

    def __init__(self, core: LinkCap, received: Callable[[], tuple[int, int]],
                 on_limits: Callable[[LinkCap], None], *, wall: Callable[[], float] = time.time) -> None:
        self.core = core
        self.received = received
        self.on_limits = on_limits
        self.wall = wall
        self.path = core.config.budget_state

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        now = trio.current_time()
        self.core.start(now)
        if self.core.budget is not None:
            saved = await trio.to_thread.run_sync(load_budget, self.path)
            if self.core.receive_wall(self.wall(), saved, now) and saved is not None:
                log.info("budget: %.0f bytes of this %s's used before this start (%s)", saved.used_bytes,
                         saved.period, self.path)
            if self.path is None:
                log.warning("budget: its count starts again when the daemon restarts (give --identity, whose "
                            "directory keeps it, or --budget-state FILE)")
        self.on_limits(self.core)
        task_status.started()
        try:
            await self._tick()
        finally:
            saved_now = self.core.saved_budget()
            if self.path is not None and saved_now is not None:
                save_budget(self.path, saved_now)  # (at exit, cancelled: a small file, written at once)

    async def _tick(self) -> None:
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
                for action in self.core.take_actions():
                    if self.path is not None:
                        await trio.to_thread.run_sync(save_budget, self.path, action.saved)
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
