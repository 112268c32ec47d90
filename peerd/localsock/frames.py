"""The local socket's frame format, shared by the daemon and every client (CLI, trainer).

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. Requests are maps
with an ``op``; responses are maps with ``ok`` and either the op's fields or ``error``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

LENGTH = struct.Struct("!I")
MAX_FRAME = 16 * 1024 * 1024


class FrameError(Exception):
    """A peer on the local socket sent something that is not a frame; the connection is closed."""


class FrameTooLarge(FrameError):
    """A message to send encodes to more than MAX_FRAME bytes (the receiver would refuse it)."""


def encode_frame(message: dict[str, Any]) -> bytes:
    """Length prefix + msgpack; raises FrameTooLarge over MAX_FRAME (msgpack's own errors pass through)."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return LENGTH.pack(len(payload)) + payload


class FrameDecoder:
    """Sans-I/O: feed bytes as they arrive, take whole messages out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while len(self._buf) >= LENGTH.size:
            (size,) = LENGTH.unpack_from(self._buf)
            if size > MAX_FRAME:
                raise FrameError(f"frame of {size} bytes exceeds {MAX_FRAME}")
            if len(self._buf) < LENGTH.size + size:
                break
            payload = bytes(self._buf[LENGTH.size : LENGTH.size + size])
            del self._buf[: LENGTH.size + size]
            try:
                message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
            except Exception as e:
                raise FrameError(f"frame is not msgpack: {type(e).__name__}") from None
            if not isinstance(message, dict):
                raise FrameError("a frame must hold a map")
            out.append(message)
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)
