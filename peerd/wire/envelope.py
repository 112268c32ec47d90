"""The fixed datagram header every peerd datagram starts with (PROTOCOL.md, "Envelope")."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .errors import WireError

MAGIC = b"PD"
VERSION = 2  # 2: the receiver's node id is part of the AEAD's associated data (PROTOCOL.md 4.1)
# magic(2) version(u8) type(u8) flags(u8) token(u64) sequence(u64), network byte order.
HEADER = struct.Struct("!2sBBBQQ")
HEADER_SIZE = HEADER.size  # 21
# The same header as a numpy record, to build and check a whole block of datagrams at once.
HEADER_DTYPE = np.dtype(
    [("magic", "S2"), ("version", "u1"), ("type", "u1"), ("flags", "u1"), ("token", ">u8"), ("seq", ">u8")]
)
SEQ_OFFSET = 13  # where the big-endian sequence starts: the AEAD nonce's last 8 bytes
FLAG_SEALED = 0x01
# Sealed without the receiver's node id in the associated data: only a PING to an address whose node id the
# sender does not know yet (a bootstrap address) may carry it, so a receiver never tries two openings.
FLAG_NO_RECEIVER = 0x02
KNOWN_FLAGS = FLAG_SEALED | FLAG_NO_RECEIVER
PING_TYPE = 0x01  # the one type that may carry FLAG_NO_RECEIVER (messages.MsgType.PING)
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

    @property
    def to_anyone(self) -> bool:
        """Sealed for whoever receives it (FLAG_NO_RECEIVER): not bound to a receiver's node id."""
        return bool(self.flags & FLAG_NO_RECEIVER)

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
    if flags & FLAG_NO_RECEIVER and mtype != PING_TYPE:
        raise WireError("malformed", f"type {mtype:#04x} sealed for no receiver: only a PING may be")
    return Header(mtype, flags, token, seq)


_LEAD = MAGIC + bytes([VERSION])
_PREFIX = struct.Struct("!3sBBQ")  # magic and version together, type, flags, token


def peek(datagram: bytes | memoryview) -> tuple[int, int, int] | str:
    """(type, flags, token) of a datagram whose header is valid, else the drop reason ``parse_header`` would
    give ("malformed" or "version"). No exception and no object: the receive path sorts a flood of junk with
    this before anything is built for it (one unpack of the first 13 bytes)."""
    if len(datagram) < HEADER_SIZE:
        return "malformed"
    lead, mtype, flags, token = _PREFIX.unpack_from(datagram)
    if lead != _LEAD:
        return "malformed" if lead[:2] != MAGIC else "version"
    if flags & ~KNOWN_FLAGS or (flags & FLAG_NO_RECEIVER and mtype != PING_TYPE):
        return "malformed"
    return mtype, flags, token
