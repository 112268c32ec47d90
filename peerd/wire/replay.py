"""Sliding replay window over one sealer's sequence numbers (RFC 4303 style)."""

from __future__ import annotations

DEFAULT_WINDOW = 8192  # datagrams; a GSO burst of a 100 MB average can reorder by thousands


class ReplayWindow:
    """Accepts each sequence number at most once, and none older than ``size`` behind the newest."""

    __slots__ = ("size", "highest", "_mask")

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        self.size = size
        self.highest = -1
        self._mask = 0  # bit i set: sequence (highest - i) was seen

    def would_accept(self, seq: int) -> bool:
        if seq > self.highest:
            return True
        offset = self.highest - seq
        return offset < self.size and not (self._mask >> offset) & 1

    def accept(self, seq: int) -> None:
        """Record ``seq``; call only after the datagram authenticated and ``would_accept`` said yes."""
        if seq > self.highest:
            shift = seq - self.highest
            self._mask = ((self._mask << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.highest = seq
        else:
            self._mask |= 1 << (self.highest - seq)
