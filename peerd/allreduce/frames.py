"""Framing of tensor datagram bodies: the 19-byte header and blocks of bodies (protocol/allreduce.md, "Body").

The codecs that encode the values inside a body live in ``peerd.compress``; this module only frames them.

A body is a fixed 19-byte little-endian header followed by a codec body (protocol/codecs.md): for codec 0,
raw little-endian float32 values, so the fp32 data path never encodes per element; for codecs 1..4 (fp16,
bf16, int8, int4) a self-contained body that ``peerd.compress`` encodes and validates. 19 bytes is what the
56-byte overhead budget leaves after the 21-byte envelope and the 16-byte AEAD tag; it also puts the values
at byte 40 of the datagram, 8-byte aligned.
"""

from __future__ import annotations

import math
import struct
from enum import IntEnum
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..compress import NAMES as CODEC_NAMES
from ..compress import Codec
from ..wire.errors import WireError

# group id u32, codec u8, stream's data datagram count u32, element offset u32, element count u16,
# weight f32 (RS: the sender's weight; AG: the total weight that arrived at the owner for this range).
HEADER = struct.Struct("<IBIIHf")
HEADER_SIZE = HEADER.size  # 19
MAX_COUNT = 0xFFFF
F32_DTYPE = np.dtype("<f4")  # the numpy dtype of float32 values on the wire (little-endian)
FP32_WIRE_ID = 0  # the header's codec byte for plain float32 bodies (compress.Float32Codec.wire_id)
KNOWN_CODECS = frozenset(range(len(CODEC_NAMES)))  # fp32, fp16, bf16, int8, int4; 5..255 are reserved
END_REPEATS = 3  # the driver sends each END body this many times (it is the only loss protection it has)


class BodyType(IntEnum):
    """The envelope's type byte for tensor data (0x40..0x7F are reserved for tensor data)."""

    RS_DATA = 0x40
    RS_END = 0x41
    AG_DATA = 0x42
    AG_END = 0x43
    AG_NACK = 0x44  # member -> owner: the all-gather ranges it lacks (or, with none, that it needs nothing more)


# the stream bodies (``check_header``); AG_NACK has its own layout (``parse_nack``)
TYPES = frozenset(int(t) for t in (BodyType.RS_DATA, BodyType.RS_END, BodyType.AG_DATA, BodyType.AG_END))
DATA_TYPES = frozenset({int(BodyType.RS_DATA), int(BodyType.AG_DATA)})
RS_TYPES = frozenset({int(BodyType.RS_DATA), int(BodyType.RS_END)})


class BodyHeader(NamedTuple):
    group: int
    codec: int
    total: int
    offset: int
    count: int
    weight: float


def pack_data(group: int, total: int, offset: int, weight: float, values: np.ndarray | memoryview) -> bytes:
    """A DATA body: header then the values' bytes (one copy: the join)."""
    count = len(values)
    header = HEADER.pack(group, FP32_WIRE_ID, total, offset, count, weight)
    return b"".join((header, values))


def pack_end(group: int, total: int, offset: int, weight: float, codec: int = FP32_WIRE_ID) -> bytes:
    """An END body: the stream's header with count 0 and no values; offset is the shard start."""
    return HEADER.pack(group, codec, total, offset, 0, weight)


def peek_group(body: bytes | memoryview) -> int:
    """The group id, for a driver that routes bodies to the right GroupAverage."""
    if len(body) < 4:
        raise WireError("malformed", f"tensor body of {len(body)} bytes has no group id")
    return int.from_bytes(body[:4], "little")


def parse_header(mtype: int, body: bytes | memoryview) -> BodyHeader:
    """Decode and check what can be checked without the group's layout.

    Raises WireError("type") for a type that is not tensor data and WireError("malformed") for a short or
    inconsistent body, an unknown codec, or a weight that is not finite (RS: not > 0; AG: negative).
    """
    return BodyHeader._make(check_header(mtype, body))


def check_header(mtype: int, body: bytes | memoryview, codec: Codec | None = None
                 ) -> tuple[int, int, int, int, int, float]:
    """``parse_header`` as a plain tuple, for the per-datagram path (no NamedTuple to build).

    ``codec``: the group's codec (None: fp32). A body in another known codec raises WireError("codec"): the
    members disagree on the run's configuration, which an operator must be able to tell from corruption."""
    if mtype not in TYPES:
        raise WireError("type", f"{mtype:#04x} is not an all-reduce body type")
    size = len(body)
    if size < HEADER_SIZE:
        raise WireError("malformed", f"tensor body of {size} bytes is shorter than its {HEADER_SIZE}-byte header")
    h = HEADER.unpack_from(body)
    _, cid, _, _, count, w = h
    want = FP32_WIRE_ID if codec is None else codec.wire_id
    if cid != want:
        if cid not in KNOWN_CODECS:
            raise WireError("malformed", f"unknown codec {cid}")
        raise WireError("codec", f"a body in codec {CODEC_NAMES[cid]}; this group averages in {CODEC_NAMES[want]}")
    if mtype in DATA_TYPES:
        need = 4 * count if codec is None or want == FP32_WIRE_ID else codec.body_size(count)
        if count == 0 or size != HEADER_SIZE + need:
            raise WireError("malformed", f"data body of {size} bytes says it holds {count} values in codec {want}")
    elif count != 0 or size != HEADER_SIZE:
        raise WireError("malformed", f"end body of {size} bytes with count {count}; it must be a bare header")
    if not (w > 0.0 if mtype in RS_TYPES else w >= 0.0) or w == math.inf:  # NaN fails both comparisons
        raise WireError("malformed", f"weight {w!r} out of range")
    return h


# AG_NACK: group id u32, repair round u8 (0: done, no ranges follow), the owner's stream length u32 (``total``), the
# range index of the bitmap's first bit u32, then a bitmap of missing ranges (bit i of byte b: range first + 8b + i)
NACK = struct.Struct("<IBII")
NACK_SIZE = NACK.size  # 13
NACK_DONE = 0  # the round byte of a member that needs nothing more of the owner's stream


class Nack(NamedTuple):
    group: int
    round: int
    total: int
    first: int
    missing: np.ndarray  # the range indices asked for, ascending (empty for a done message)


def pack_nack(group: int, round_: int, total: int, first: int, bitmap: bytes | np.ndarray = b"") -> bytes:
    """An AG_NACK body: ``bitmap`` (LSB first) marks the missing ranges from range ``first`` on."""
    return NACK.pack(group, round_, total, first) + bytes(bitmap)


def nack_bodies(group: int, round_: int, missing: np.ndarray, total: int, max_body: int) -> list[bytes]:
    """AG_NACK bodies asking for ranges ``missing`` (ascending indices < total) of a stream of ``total``: one
    bitmap per body of at most ``max_body`` bytes, as few bodies as the ranges' spread needs."""
    span = 8 * max(1, max_body - NACK_SIZE)
    out = []
    i = 0
    while i < len(missing):
        first = int(missing[i])
        j = int(np.searchsorted(missing, first + span))
        bits = np.zeros(int(missing[j - 1]) - first + 1, dtype=bool)
        bits[missing[i:j] - first] = True
        out.append(pack_nack(group, round_, total, first, np.packbits(bits, bitorder="little").tobytes()))
        i = j
    return out


def parse_nack(body: bytes | memoryview, max_rounds: int) -> Nack:
    """Decode and check an AG_NACK body (protocol/allreduce.md, "Repair"): WireError("malformed") for a body
    shorter than its header, a round above ``max_rounds``, a done message with a bitmap or a ``first`` other than
    0, a request with no bit set, a ``first`` at or past ``total``, a last byte with no range of the stream, or a bit
    set past the stream's end. The indices stay bounded by ``total`` and the body's size."""
    size = len(body)
    if size < NACK_SIZE:
        raise WireError("malformed", f"nack of {size} bytes is shorter than its {NACK_SIZE}-byte header")
    group, round_, total, first = NACK.unpack_from(body)
    if round_ > max_rounds:
        raise WireError("malformed", f"nack round {round_}; this owner repairs {max_rounds} rounds")
    if round_ == NACK_DONE:
        if size != NACK_SIZE or first != 0:
            raise WireError("malformed", "a done nack is a bare header with first 0")
        return Nack(group, round_, total, first, np.empty(0, dtype=np.int64))
    nbytes = size - NACK_SIZE
    if nbytes == 0 or first >= total or first + 8 * (nbytes - 1) >= total:
        raise WireError("malformed", f"nack of {nbytes} bitmap bytes from range {first}; the stream has {total}")
    bits = np.unpackbits(np.frombuffer(body, np.uint8, nbytes, NACK_SIZE), bitorder="little")
    missing = np.flatnonzero(bits)
    if not len(missing) or first + int(missing[-1]) >= total:
        raise WireError("malformed", "nack asks for no range, or for one past the stream's end")
    return Nack(group, round_, total, first, missing + first)


def values(body: bytes | memoryview, count: int) -> np.ndarray:
    """The body's values as a read-only float32 view (no copy)."""
    return np.frombuffer(body, dtype=F32_DTYPE, count=count, offset=HEADER_SIZE)


@lru_cache(maxsize=64)
def block_dtype(count: int) -> np.dtype:
    """The body layout as a packed numpy record holding ``count`` values: a block of bodies is built and
    checked column by column instead of datagram by datagram. Same bytes as ``HEADER`` + values."""
    return np.dtype(
        [("group", "<u4"), ("codec", "u1"), ("total", "<u4"), ("offset", "<u4"), ("count", "<u2"),
         ("weight", "<f4"), ("values", F32_DTYPE, (count,))]
    )


def pack_block(group: int, total: int, offset: int, weight: float | np.ndarray, values: np.ndarray) -> np.ndarray:
    """DATA bodies for consecutive ranges of equal length: ``values`` is (rows, count) float32, row i
    starting at element ``offset + i * count``; ``weight`` is one value or one per row. Returns
    (rows, body bytes) uint8."""
    rows, count = values.shape
    width = HEADER_SIZE + 4 * count
    out = np.empty((rows, width), dtype=np.uint8)
    out[:, :HEADER_SIZE] = np.frombuffer(HEADER.pack(group, FP32_WIRE_ID, total, offset, count, 0.0), np.uint8)
    out[:, 9:13] = np.arange(offset, offset + rows * count, count, dtype="<u4").view(np.uint8).reshape(rows, 4)
    out[:, 15:19] = np.asarray(weight, dtype="<f4").reshape(-1, 1).view(np.uint8)
    out[:, HEADER_SIZE:] = np.ascontiguousarray(values, dtype=F32_DTYPE).view(np.uint8)
    return out


def pack_coded(group: int, codec: int, total: int, offset: int, count: int, weight: float | np.ndarray,
               bodies: np.ndarray) -> np.ndarray:
    """DATA bodies of a compressed codec: ``bodies`` is (rows, codec body bytes) uint8, row i the range at
    element ``offset + i * count`` (``Codec.encode_block``); ``weight`` is one value or one per row. Returns
    (rows, header + body bytes) uint8: the tensor header is the same as fp32's but for the codec byte."""
    rows, width = bodies.shape
    out = np.empty((rows, HEADER_SIZE + width), dtype=np.uint8)
    out[:, :HEADER_SIZE] = np.frombuffer(HEADER.pack(group, codec, total, offset, count, 0.0), np.uint8)
    out[:, 9:13] = np.arange(offset, offset + rows * count, count, dtype="<u4").view(np.uint8).reshape(rows, 4)
    out[:, 15:19] = np.asarray(weight, dtype="<f4").reshape(-1, 1).view(np.uint8)
    out[:, HEADER_SIZE:] = bodies
    return out


@lru_cache(maxsize=64)
def coded_dtype(width: int) -> np.dtype:
    """``block_dtype`` for a compressed codec: the header's fields, then ``width`` body bytes."""
    return np.dtype(
        [("group", "<u4"), ("codec", "u1"), ("total", "<u4"), ("offset", "<u4"), ("count", "<u2"),
         ("weight", "<f4"), ("body", "u1", (width,))]
    )


def view_coded(bodies: np.ndarray) -> np.ndarray | None:
    """``view_block`` for a compressed codec: records of header fields and body bytes (None: not 2-D rows)."""
    if bodies.ndim != 2 or bodies.shape[1] <= HEADER_SIZE or bodies.strides[1] != 1:
        return None
    return bodies.view(coded_dtype(bodies.shape[1] - HEADER_SIZE)).reshape(len(bodies))


def view_block(bodies: np.ndarray) -> np.ndarray | None:
    """A (rows, body bytes) uint8 block as records, or None when its rows are not whole DATA bodies."""
    rows, size = bodies.shape
    count, rest = divmod(size - HEADER_SIZE, 4)
    if rest or not 1 <= count <= MAX_COUNT or bodies.strides[1] != 1:
        return None
    # Rows need not be adjacent (bodies cut out of datagrams, past their envelope): numpy views each
    # contiguous row as one record.
    return bodies.view(block_dtype(count)).reshape(rows)
