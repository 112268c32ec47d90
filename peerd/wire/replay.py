"""Sliding replay window over one sealer's sequence numbers (RFC 4303 style), per datagram or per block.

The window is a ring of ``size`` flags: sequence s lives in slot s % size. Advancing the newest sequence
clears the slots it passes over, so a slot's flag always belongs to the one sequence in the window that
maps to it. A numpy ring (not a Python int bit mask) lets a whole GRO block be checked in a few
vectorized calls, and accepting one sequence costs O(1), not a shift of an 8192-bit integer.
"""

from __future__ import annotations

import numpy as np

DEFAULT_WINDOW = 8192  # datagrams; a GSO burst of a 100 MB average can reorder by thousands


class ReplayWindow:
    """Accepts each sequence number at most once, and none ``size`` or more behind the newest."""

    __slots__ = ("size", "highest", "_seen")

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self.highest = -1
        self._seen = np.zeros(size, dtype=bool)

    @property
    def ring(self) -> np.ndarray:
        """The flags themselves (slot s % size for sequence s), for the native block operations (replay.c), which
        read and write them in place and hand back the new ``highest``."""
        return self._seen

    def restore_floor(self, floor: int) -> None:
        """Refuse every sequence up to ``floor`` (the highest an evicted window of this token had accepted): a
        token that comes back after eviction opens only what is newer than anything it sent before."""
        self.highest = max(self.highest, floor)
        self._seen[:] = True

    def would_accept(self, seq: int) -> bool:
        if seq > self.highest:
            return True
        if self.highest - seq >= self.size:
            return False
        return not self._seen[seq % self.size]

    def accept(self, seq: int) -> None:
        """Record ``seq``; call only after the datagram authenticated and ``would_accept`` said yes."""
        if seq > self.highest:
            self._advance(seq)
        self._seen[seq % self.size] = True

    def _advance(self, newest: int) -> None:
        """Make ``newest`` the highest sequence, clearing the slots of the sequences it skips."""
        first, size = self.highest + 1, self.size
        if newest - first + 1 >= size or self.highest < 0:
            self._seen[:] = False
        else:
            a, b = first % size, (newest + 1) % size
            if a < b:
                self._seen[a:b] = False
            else:
                self._seen[a:] = False
                self._seen[:b] = False
        self.highest = newest

    def would_accept_block(self, seqs: np.ndarray) -> np.ndarray:
        """Per sequence (uint64 array): would it be accepted? A repeat within the block counts once."""
        highest = self.highest
        if int(seqs[0]) > highest and (len(seqs) == 1 or (seqs[1:] > seqs[:-1]).all()):
            return np.ones(len(seqs), dtype=bool)  # the common case: a fresh, ordered burst
        if highest < 0:
            ok = np.ones(len(seqs), dtype=bool)
        else:
            h = np.uint64(highest)
            newer = seqs > h
            in_window = (h - np.minimum(seqs, h)) < np.uint64(self.size)
            ok = newer | (in_window & ~self._seen[(seqs % np.uint64(self.size)).astype(np.intp)])
        if len(seqs) > 1 and not (seqs[1:] > seqs[:-1]).all():
            _, first = np.unique(seqs, return_index=True)
            once = np.zeros(len(seqs), dtype=bool)
            once[first] = True
            ok &= once
        return ok

    def accept_block(self, seqs: np.ndarray) -> None:
        """Record authenticated sequences that ``would_accept_block`` passed."""
        if len(seqs) == 0:
            return
        newest = int(seqs.max())
        if newest > self.highest:
            self._advance(newest)
        if newest - int(seqs.min()) >= self.size:
            # A sequence the advance pushed out of the window must not mark the newer one in its slot.
            seqs = seqs[(np.uint64(newest) - seqs) < np.uint64(self.size)]
        self._seen[(seqs % np.uint64(self.size)).astype(np.intp)] = True
