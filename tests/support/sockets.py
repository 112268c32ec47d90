"""Real loopback sockets for the socket-level tests."""

from __future__ import annotations

import socket


def bind_loopback(family: int) -> socket.socket:
    """A UDP socket bound to a free port on the loopback address of ``family``."""
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
    return s
