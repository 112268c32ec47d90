"""The fixed datagram header every peerd datagram starts with (PROTOCOL.md, "Envelope")."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .errors import WireError

MAGIC = b"PD"
VERSION = 1
# magic(2) version(u8) type(u8) flags(u8) token(u64) sequence(u64), network byte order.
HEADER = struct.Struct("!2sBBBQQ")
HEADER_SIZE = HEADER.size  # 21
# The same header as a numpy record, to build and check a whole block of datagrams at once.
HEADER_DTYPE = np.dtype(
    [("magic", "S2"), ("version", "u1"), ("type", "u1"), ("flags", "u1"), ("token", ">u8"), ("seq", ">u8")]
)
SEQ_OFFSET = 13  # where the big-endian sequence starts: the AEAD nonce's last 8 bytes
FLAG_SEALED = 0x01
KNOWN_FLAGS = FLAG_SEALED
MAX_SEQUENCE = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Header:
    type: int
    flags: int
    token: int
    seq: int

    @property
    def sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.type, self.flags, self.token, self.seq)


def parse_header(datagram: bytes | memoryview) -> Header:
    """Validate and decode the header; the body starts at ``HEADER_SIZE``."""
    if len(datagram) < HEADER_SIZE:
        raise WireError("malformed", f"datagram of {len(datagram)} bytes is shorter than the header")
    magic, version, mtype, flags, token, seq = HEADER.unpack_from(datagram)
    if magic != MAGIC:
        raise WireError("malformed", "bad magic")
    if version != VERSION:
        raise WireError("version", f"protocol version {version}, this node speaks {VERSION}")
    if flags & ~KNOWN_FLAGS:
        raise WireError("malformed", f"reserved flag bits set: {flags:#x}")
    return Header(mtype, flags, token, seq)
