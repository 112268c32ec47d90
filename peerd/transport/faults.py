"""Fault injection for benchmarks and tests (``--loss P --loss-seed S``): a socket wrapper that drops received
datagrams, so the endpoint above it has no fault code on its receive path.

It wraps any socket of the endpoint's interface and declares the same capabilities. A GRO block loses single
rows: the rows it keeps come out as runs of consecutive rows (views into the block, no copy), each run a block of
its own, so a consumer sees exactly what a lossy network would have delivered. Deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .caps import SocketCaps, plain_caps

Address = tuple[str, int]


class LossySocket:
    """Drops each received datagram with probability ``loss`` (``rng``: a numpy Generator; seed it for a
    reproducible pattern). ``on_drop(n)`` is told how many datagrams each receive dropped (for a counter)."""

    # The native receive screen (UdpSocket.recv_screened) reads the wrapped socket itself: through __getattr__ it
    # would bypass the loss. Off here, so every datagram passes through recv_blocks and its loss.
    screens = False

    def __init__(self, sock: Any, loss: float, rng: np.random.Generator,
                 on_drop: Callable[[int], None] | None = None) -> None:
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss!r}")
        self.inner = sock
        self.loss = loss
        self.rng = rng
        self.on_drop = on_drop
        self.dropped = 0
        self.family = getattr(sock, "family", None)
        self.caps: SocketCaps = getattr(sock, "caps", None) or plain_caps()

    def __getattr__(self, name: str) -> Any:  # sends, statistics, kernel_drops, fileno ...: the wrapped socket's
        return getattr(self.inner, name)

    def _count(self, n: int) -> None:
        if n:
            self.dropped += n
            if self.on_drop is not None:
                self.on_drop(n)

    async def recv_batch(self, max_datagrams: int = 64, /) -> list[tuple[bytes, Address]]:
        """The wrapped socket's receive, less the datagrams lost; waits again if it lost them all."""
        while True:
            batch = await self.inner.recv_batch(max_datagrams)
            keep = self.rng.random(len(batch)) >= self.loss
            self._count(len(batch) - int(np.count_nonzero(keep)))
            out = [d for d, k in zip(batch, keep.tolist(), strict=True) if k]
            if out:
                return out

    async def recv_blocks(self, max_datagrams: int = 64, /) -> list[tuple[memoryview, Address, int]]:
        """Blocks as the wrapped socket gives them, each cut into the runs of rows that were not lost."""
        while True:
            out: list[tuple[memoryview, Address, int]] = []
            for data, source, segment in await self.inner.recv_blocks(max_datagrams):
                out.extend(self._thin(data, source, segment))
            if out:
                return out

    def _thin(self, data: memoryview, source: Address, segment: int) -> list[tuple[memoryview, Address, int]]:
        if not segment:
            if self.rng.random() < self.loss:
                self._count(1)
                return []
            return [(data, source, 0)]
        n = len(data)
        rows = -(-n // segment)
        keep = self.rng.random(rows) >= self.loss
        self._count(rows - int(np.count_nonzero(keep)))
        runs: list[tuple[memoryview, Address, int]] = []
        row = 0
        flags = keep.tolist()
        while row < rows:
            if not flags[row]:
                row += 1
                continue
            end = row
            while end < rows and flags[end]:
                end += 1
            a, b = row * segment, min(n, end * segment)
            runs.append((data[a:b], source, segment if end - row > 1 else 0))
            row = end
        return runs
