"""Which sealing token seals what across a token rotation (PROTOCOL.md 4.2), sans-I/O.

A sealer may seal at most ``rotate_after`` datagrams (AES-GCM's confidentiality bound). At 3/4 of it the next
sealer is made and seals every control message at once (each carries its token's signed binding, so a receiver
binds the new token on the first one it opens); tensor data to a receiver moves to it once that receiver answered
a request sealed with it (it opened one, so it has bound it); and all data moves when the two sealers together
have sealed ``rotate_after``. Nothing here reads a clock or draws a token: ``make`` does, for the endpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Counted(Protocol):
    @property
    def sent(self) -> int: ...


S = TypeVar("S", bound=Counted)


class Rotation(Generic[S]):
    """The current sealer and, during a rotation, the next one and the receivers that have bound it."""

    def __init__(self, current: S, rotate_after: int, make: Callable[[], S]) -> None:
        if rotate_after < 4:
            raise ValueError(f"rotate_after must be >= 4 datagrams, got {rotate_after}")
        self.current = current
        self.next: S | None = None
        self.rotate_after = rotate_after
        self.rotations = 0
        self._make = make
        self._bound: set[bytes] = set()  # receivers that answered a request sealed by ``next``

    def step(self) -> bool:
        """Start or finish a rotation where the counts say so; True when the next sealer just became current."""
        if self.next is None:
            if self.current.sent >= self.rotate_after * 3 // 4:
                self.next = self._make()
                self._bound = set()
            return False
        if self.current.sent + self.next.sent >= self.rotate_after:
            self.current, self.next = self.next, None
            self._bound = set()
            self.rotations += 1
            return True
        return False

    def for_data(self, receiver: bytes) -> S:
        """The sealer for tensor data to ``receiver``: the next one only once the receiver has bound it."""
        if self.next is not None and receiver in self._bound:
            return self.next
        return self.current

    def for_control(self) -> S:
        """Control messages carry their token's binding: the next sealer as soon as there is one."""
        return self.next if self.next is not None else self.current

    def answered(self, sealed_by: S | None, receiver: bytes) -> None:
        """``receiver`` answered a request sealed by ``sealed_by``: if that is the next sealer, it has bound it."""
        if sealed_by is not None and sealed_by is self.next:
            self._bound.add(receiver)
