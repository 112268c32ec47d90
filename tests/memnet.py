"""An in-memory datagram network for tests: deterministic drop, duplication and reordering.

Runs under trio's MockClock, so seconds of protocol time take milliseconds.
"""

from __future__ import annotations

import math
import random
import socket

import trio


class MemNet:
    def __init__(self, *, seed: int = 0, drop: float = 0.0, duplicate: float = 0.0, jitter: float = 0.0,
                 latency: float = 0.002) -> None:
        self.rng = random.Random(seed)
        self.drop = drop
        self.duplicate = duplicate
        self.jitter = jitter
        self.latency = latency
        self.sockets: dict[tuple[str, int], MemSocket] = {}
        self.sent = self.dropped = self.duplicated = 0
        self.nursery: trio.Nursery | None = None
        # (source, destination, datagram) of every datagram sent, when a test wants to replay or measure them
        self.captured: list[tuple[tuple[str, int], tuple[str, int], bytes]] | None = None

    def socket(self, host: str, port: int) -> MemSocket:
        sock = MemSocket(self, (host, port))
        self.sockets[(host, port)] = sock
        return sock

    def partition(self, addr: tuple[str, int]) -> None:
        """The host at ``addr`` dies: nothing reaches it and it sends nothing."""
        sock = self.sockets.pop(addr, None)
        if sock is not None:
            sock.dead = True

    def deliver(self, src: tuple[str, int], dst: tuple[str, int], data: bytes) -> None:
        """Send ``data`` from ``src`` to ``dst`` (a test may call it with any ``src``: a spoofed source)."""
        self.sent += 1
        if self.captured is not None:
            self.captured.append((src, dst, data))
        if self.rng.random() < self.drop:
            self.dropped += 1
            return
        copies = 1
        if self.rng.random() < self.duplicate:
            copies = 2
            self.duplicated += 1
        for _ in range(copies):
            delay = self.latency + self.rng.random() * self.jitter  # jitter reorders datagrams
            assert self.nursery is not None
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
