"""Real loopback sockets for the socket-level tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def bind_loopback(family: int) -> socket.socket:
    """A UDP socket bound to a free port on the loopback address of ``family``."""
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
    return s


@contextmanager
def loopback_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two IPv4 loopback UDP sockets, a sender and a non-blocking receiver, closed when the block ends."""
    a, b = bind_loopback(socket.AF_INET), bind_loopback(socket.AF_INET)
    b.setblocking(False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def merge_prefix(mtype: int, token: int) -> bytes:
    """The first bytes of a datagram that receives merge rows on (magic, version, type, flags, token); a test
    fills the rest."""
    return b"PD" + bytes([1, mtype, 0]) + token.to_bytes(8, "big")
