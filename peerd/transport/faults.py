"""Fault injection for benchmarks and tests (``--loss P --loss-seed S``): a socket wrapper that drops received
datagrams, so the endpoint above it has no fault code on its receive path.

It wraps any socket of the endpoint's interface and declares the same capabilities. A GRO block loses single
rows: the rows it keeps are moved together, in order, into one block (in place where the block is writable, as the
receive arena is), so a consumer sees exactly the datagrams a lossy network would have delivered, in as many blocks
as without loss. (Cutting a block into its runs of surviving rows made ~7 blocks of 64 rows at 10 % loss, and the
per-block work above it made `bench allreduce --loss 0.1` several times slower than the loss alone explains.)
Where the wrapped socket has the native receive screen, the loss runs after it (``recv_screened``): the screen
reads the socket below this wrapper, so the wrapper cannot run first. Deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .caps import SocketCaps, plain_caps

Address = tuple[str, int]
POOL = 4096  # uniform draws fetched from the generator at once


class LossySocket:
    """Drops each received datagram with probability ``loss`` (``rng``: a numpy Generator; seed it for a
    reproducible pattern). ``on_drop(n)`` is told how many datagrams each receive dropped (for a counter)."""

    def __init__(self, sock: Any, loss: float, rng: np.random.Generator,
                 on_drop: Callable[[int], None] | None = None) -> None:
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss!r}")
        self.inner = sock
        self.loss = loss
        self.rng = rng
        self.on_drop = on_drop
        self.dropped = 0
        self._pool = np.empty(0)  # uniform draws taken from ``rng`` ahead, a block at a time (one call per block
        self._at = 0  # or single datagram cost about as much as the copy of the block it decides about)
        self.family = getattr(sock, "family", None)
        self.caps: SocketCaps = getattr(sock, "caps", None) or plain_caps()

    @property
    def screens(self) -> bool:
        """The wrapped socket's native receive screen, with the loss after it (``recv_screened``)."""
        return bool(getattr(self.inner, "screens", False))

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

    async def recv_screened(self, max_datagrams: int, screen: tuple, limiter: object = None, *,
                            shedding: bool = False, protected: dict[int, object] | None = None) -> tuple:
        """The wrapped socket's screened receive (UdpSocket.recv_screened), less the datagrams lost: its blocks
        thinned as ``recv_blocks`` does, and its single datagrams under unknown tokens dropped alike. What the
        screen refused is counted there, not here (it never reached the consumer)."""
        more = {"protected": protected} if protected is not None else {}  # (inner sockets without it still work)
        result = await self.inner.recv_screened(max_datagrams, screen, limiter, shedding=shedding, **more)
        blocks, unknown = result[0], result[1]
        out: list[tuple[memoryview, Address, int]] = []
        for data, source, segment in blocks:
            out.extend(self._thin(data, source, segment))
        if unknown:
            keep = self.rng.random(len(unknown)) >= self.loss
            self._count(len(unknown) - int(np.count_nonzero(keep)))
            unknown = [u for u, k in zip(unknown, keep.tolist(), strict=True) if k]
        return (out, unknown, *result[2:])

    def _draws(self, n: int) -> np.ndarray:
        """The next ``n`` uniform draws of ``rng``, in order (fetched POOL at a time)."""
        if self._at + n > len(self._pool):
            self._pool = np.concatenate((self._pool[self._at :], self.rng.random(max(POOL, n))))
            self._at = 0
        out = self._pool[self._at : self._at + n]
        self._at += n
        return out

    def _thin(self, data: memoryview, source: Address, segment: int) -> list[tuple[memoryview, Address, int]]:
        """One block less its lost rows, the survivors moved together in order (a block's last row may be short:
        it stays last)."""
        if not segment:
            if self._draws(1)[0] < self.loss:
                self._count(1)
                return []
            return [(data, source, 0)]
        n = len(data)
        rows = -(-n // segment)
        keep = self._draws(rows) >= self.loss
        kept = int(np.count_nonzero(keep))
        self._count(rows - kept)
        if kept == rows:
            return [(data, source, segment)]
        if kept == 0:
            return []
        flat = np.frombuffer(data, np.uint8)
        in_place = flat.flags.writeable
        if in_place:
            out = flat
        else:
            out = np.empty(n, np.uint8)
            data = memoryview(out)  # type: ignore[assignment]
        # Each run of surviving rows moves forward in one copy (in place, the rows before the first loss stay
        # where they are), the runs found from the few lost rows: a gather of every kept row, and then numpy's
        # run edges (``diff``), were most of the lossy bench's extra CPU. A memoryview moves overlapping bytes
        # like memmove (numpy's overlapping slice assignment copies through a temporary).
        src, dst = memoryview(flat), memoryview(out)  # the same bytes when in place
        lost = np.flatnonzero(~keep).tolist()
        lost.append(rows)
        size = a = 0
        for b in lost:
            if b > a:
                start, stop = a * segment, min(n, b * segment)  # (a short last row ends the block)
                if start != size or not in_place:
                    dst[size : size + stop - start] = src[start:stop]
                size += stop - start
            a = b + 1
        return [(data[:size], source, segment if kept > 1 else 0)]
