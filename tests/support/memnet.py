"""The in-memory network for trio tests: peerd/tools/sim/net.py's link model under trio's clock.

Each datagram's fate (lost, duplicated, its delay and so its order) is ``Link.fate`` of the one network the
simulator uses, drawn from one seeded ``random.Random`` in the same order as always, so a seed keeps its loss
pattern. Delivery waits on trio (run under trio's MockClock, seconds of protocol time take milliseconds),
since the services under test are trio code; ``peerd.tools.sim.net.Network`` is the same model on its own heap.
"""

from __future__ import annotations

import math
import random
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from peerd.tools.sim.net import Link

from .virtual import run_virtual


class MemNet:
    def __init__(self, *, seed: int = 0, drop: float = 0.0, duplicate: float = 0.0, jitter: float = 0.0,
                 latency: float = 0.002) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.link = Link(loss=drop, duplicate=duplicate, latency=latency, jitter=jitter)
        self.sockets: dict[tuple[str, int], MemSocket] = {}
        self.cut: set[tuple[str, int]] = set()  # hosts whose link is down for now (cut_off)
        self.sent = self.dropped = self.duplicated = 0
        self.nursery: trio.Nursery | None = None
        # (source, destination, datagram) of every datagram sent, when a test wants to replay or measure them
        self.captured: list[tuple[tuple[str, int], tuple[str, int], bytes]] | None = None

    @property
    def drop(self) -> float:
        return self.link.loss

    @property
    def duplicate(self) -> float:
        return self.link.duplicate

    @property
    def jitter(self) -> float:
        return self.link.jitter

    @property
    def latency(self) -> float:
        return self.link.latency

    def socket(self, host: str, port: int) -> MemSocket:
        sock = MemSocket(self, (host, port))
        self.sockets[(host, port)] = sock
        return sock

    def cut_off(self, addr: tuple[str, int], cut: bool = True) -> None:
        """The host at ``addr`` loses its link (``cut``) or gets it back: while cut nothing reaches it or leaves it,
        and it keeps running."""
        (self.cut.add if cut else self.cut.discard)(addr)

    def partition(self, addr: tuple[str, int]) -> None:
        """The host at ``addr`` dies: nothing reaches it and it sends nothing."""
        sock = self.sockets.pop(addr, None)
        if sock is not None:
            sock.dead = True

    def deliver(self, src: tuple[str, int], dst: tuple[str, int], data: bytes) -> None:
        """Send ``data`` from ``src`` to ``dst`` (a test may call it with any ``src``: a spoofed source)."""
        self.sent += 1
        if src in self.cut or dst in self.cut:
            self.dropped += 1
            return
        if self.captured is not None:
            self.captured.append((src, dst, data))
        delays = self.link.fate(self.rng)  # jitter reorders datagrams
        if not delays:
            self.dropped += 1
            return
        if len(delays) > 1:
            self.duplicated += 1
        assert self.nursery is not None
        for delay in delays:
            self.nursery.start_soon(self._arrive, delay, src, dst, data)

    async def _arrive(self, delay: float, src: tuple[str, int], dst: tuple[str, int], data: bytes) -> None:
        await trio.sleep(delay)
        sock = self.sockets.get(dst)
        if sock is not None:
            sock.inbox_send.send_nowait((data, src))


class MemSocket:
    family = socket.AF_INET

    def __init__(self, net: MemNet, addr: tuple[str, int]) -> None:
        self.net = net
        self.addr = addr
        self.dead = False
        self.inbox_send, self.inbox = trio.open_memory_channel[tuple[bytes, tuple[str, int]]](math.inf)

    async def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        await trio.lowlevel.checkpoint()
        if not self.dead:
            self.net.deliver(self.addr, (addr[0], addr[1]), bytes(data))

    async def send_many(self, datagrams: list[bytes], addr: tuple[str, int]) -> None:
        for d in datagrams:
            await self.sendto(d, addr)

    async def recv_batch(self, max_datagrams: int = 64) -> list[tuple[bytes, tuple[str, int]]]:
        batch = [await self.inbox.receive()]
        while len(batch) < max_datagrams:
            try:
                batch.append(self.inbox.receive_nowait())
            except trio.WouldBlock:
                break
        return batch

    def getsockname(self) -> tuple[str, int]:
        return self.addr

    def close(self) -> None:
        self.dead = True


def run_on_memnet(body: Callable[[Any, trio.Nursery], Awaitable[Any]], net: MemNet | None = None,
                  **options: Any) -> None:
    """Run ``body(net, nursery)`` in virtual time on ``net`` (default: a fresh ``MemNet(**options)``) whose sockets'
    tasks run in ``nursery``; what ``body`` leaves running there is cancelled when it returns."""

    async def main() -> None:
        mem = MemNet(**options) if net is None else net
        async with trio.open_nursery() as nursery:
            mem.nursery = nursery
            await body(mem, nursery)
            nursery.cancel_scope.cancel()

    run_virtual(main)


async def run_all(*runs: Callable[..., Awaitable[Any]], task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A node's ``run``: start each of ``runs`` (a service's ``run`` or an endpoint's ``serve``) in order, each up
    before the next, report started, and run them until cancelled."""
    async with trio.open_nursery() as nursery:
        for run in runs:
            await nursery.start(run)
        task_status.started()


async def started(nursery: trio.Nursery, nodes: list[Any]) -> list[Any]:
    """Start each node's ``run`` in ``nursery``, each up before the next: the nodes."""
    for node in nodes:
        await nursery.start(node.run)
    return nodes
