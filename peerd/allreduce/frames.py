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


TYPES = frozenset(int(t) for t in BodyType)
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
