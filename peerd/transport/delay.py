"""Propagation delay for benchmarks (``peerd join --delay MS``): a socket wrapper that holds what it receives for a
fixed time before the endpoint sees it, so a swarm on the link lab (which has no netem, hence no delay) pays the
round trips a wide-area path would. Every node holding its receives ``delay_s`` makes each round trip ``2 delay_s``
longer, for every message kind (DHT, matchmaking, data, repairs, REPORTs), which is what a WAN does.

It wraps any socket of the endpoint's interface and declares the same capabilities. Each receive of the wrapped
socket is copied (its blocks are views into an arena the next receive reuses) and queued with the time it falls
due; the wrapper keeps receiving (so the kernel's queue never fills while it waits) and gives each receive back,
in order, once due. What it holds is at most ``delay_s`` of the link's rate. The kernel's receive times of each
source's data (``arrivals``, which REPORTs carry) are the wrapped socket's plus the delay, and change as the receive
that brought them is given back: a REPORT must not date the data it counts by a datagram still held.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from .caps import SocketCaps, plain_caps

Address = tuple[str, int]
MAX_DELAY_S = 1.0  # a WAN's one-way delay is well under this; more would only hold memory


class DelaySocket:
    """Holds each receive of ``sock`` for ``delay_s`` seconds (``clock``: the time now; trio's by default)."""

    def __init__(self, sock: Any, delay_s: float, clock: Callable[[], float] = trio.current_time) -> None:
        if not 0.0 < delay_s <= MAX_DELAY_S:
            raise ValueError(f"delay must be in (0, {MAX_DELAY_S:g}] seconds, got {delay_s!r}")
        self.inner = sock
        self.delay_s = delay_s
        self.clock = clock
        self._held: dict[str, deque[tuple[float, Any, dict[Address, float]]]] = {}
        self._stamps = isinstance(getattr(sock, "arrivals", None), dict)
        if self._stamps:
            self.arrivals: dict[Address, float] = {}  # (UdpSocket.arrivals, as of what was given back)
        self.family = getattr(sock, "family", None)
        self.caps: SocketCaps = getattr(sock, "caps", None) or plain_caps()

    @property
    def screens(self) -> bool:
        """The wrapped socket's native receive screen (``recv_screened``)."""
        return bool(getattr(self.inner, "screens", False))

    @property
    def held(self) -> int:
        """Receives held now, not yet due."""
        return sum(len(q) for q in self._held.values())

    def __getattr__(self, name: str) -> Any:  # sends, statistics, kernel_drops, fileno ...: the wrapped socket's
        return getattr(self.inner, name)

    async def _delayed(self, kind: str, receive: Callable[[], Awaitable[Any]], copy: Callable[[Any], Any],
                       sources: Callable[[Any], Iterable[Address]], merge: Callable[[list[Any]], Any]) -> Any:
        """The held receives of ``kind`` that are due, merged into one (as one receive pass of the wrapped socket
        would have taken them: given back one by one, each would cost the endpoint a pass, and a busy endpoint
        would fall behind the delay); until one is due, the wrapped socket's receives go on and queue."""
        held = self._held.setdefault(kind, deque())
        while True:
            now = self.clock()
            if held and held[0][0] <= now:
                due = []
                while held and held[0][0] <= now:
                    _, got, stamps = held.popleft()
                    if stamps:
                        self.arrivals.update(stamps)
                    due.append(got)
                return due[0] if len(due) == 1 else merge(due)
            with trio.move_on_at(held[0][0] if held else math.inf):  # (the wrapped receives are cancelled only
                got = await receive()  # while they wait: nothing is lost)
                stamps: dict[Address, float] = {}
                if self._stamps:
                    table = self.inner.arrivals
                    for source in sources(got):
                        when = table.get(source)
                        if when is not None:
                            stamps[source] = when + self.delay_s
                held.append((self.clock() + self.delay_s, copy(got), stamps))

    async def recv_batch(self, max_datagrams: int = 64, /) -> list[tuple[bytes, Address]]:
        return await self._delayed("batch", lambda: self.inner.recv_batch(max_datagrams), list, _sources,
                                   _concat)

    async def recv_blocks(self, max_datagrams: int = 64, /) -> list[tuple[memoryview, Address, int]]:
        return await self._delayed("blocks", lambda: self.inner.recv_blocks(max_datagrams), _copy_blocks,
                                   _sources, _concat)

    async def recv_screened(self, max_datagrams: int, screen: tuple, limiter: object = None, *,
                            shedding: bool = False, protected: dict[int, object] | None = None) -> tuple:
        """The wrapped socket's screened receive (UdpSocket.recv_screened), held; its ``now`` is the time it is
        given back (the caller's decisions on the pass are taken then)."""
        more = {"protected": protected} if protected is not None else {}
        result = await self._delayed(
            "screened", lambda: self.inner.recv_screened(max_datagrams, screen, limiter, shedding=shedding, **more),
            _copy_screened, lambda result: _sources(result[0]), _merge_screened)
        return (*result[:7], self.clock(), *result[8:])


def _sources(received: list[tuple]) -> set[Address]:
    return {item[1] for item in received}


def _copy_blocks(blocks: list[tuple[memoryview, Address, int]]) -> list[tuple[memoryview, Address, int]]:
    """Blocks that outlive the wrapped socket's next receive (writable, as its arena's views are)."""
    return [(memoryview(bytearray(data)), source, segment) for data, source, segment in blocks]


def _copy_screened(result: tuple) -> tuple:
    unknown = [(bytes(data), source) for data, source in result[1]]
    return (_copy_blocks(result[0]), unknown, *result[2:])


def _concat(receives: list[list]) -> list:
    return [item for got in receives for item in got]


def _merge_screened(results: list[tuple]) -> tuple:
    """Screened receives as one: blocks and unknown datagrams in order, the counts summed, ``rationed`` if any was;
    ``now`` is set by the caller."""
    blocks = _concat([r[0] for r in results])
    unknown = _concat([r[1] for r in results])
    counts = [sum(r[i] for r in results) for i in (2, 3, 4, 5)]
    return (blocks, unknown, *counts, any(r[6] for r in results), 0.0, sum(r[8] for r in results))
