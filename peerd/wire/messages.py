"""Control message types and their msgpack schemas (PROTOCOL.md, "Messages").

Control bodies are msgpack maps with the keys in the order listed here (encoders must keep that
order so encodings are canonical). Every control message carries ``rid`` (request id; a response
echoes its request's) and ``from`` (the sender's public key, the signature binding the datagram's
token to that key, and optionally the address peers should use to reach it).
"""

from __future__ import annotations

import ipaddress
import socket
from enum import IntEnum
from typing import Any

import msgpack

from . import schema as s
from .errors import WireError
from .identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE


class MsgType(IntEnum):
    PING = 0x01
    PONG = 0x02
    FIND_NODE = 0x03
    NODES = 0x04
    FIND_VALUE = 0x05
    VALUE = 0x06
    STORE = 0x07
    STORED = 0x08
    ERROR = 0x0F
    REPORT = 0x10  # one-way: a receiver's account of one averaging phase, for the sender's pacing


# Control types are 0x01..0x3F (0x10..0x3F reserved for matchmaking and later control);
# 0x40..0x7F are reserved for tensor data, which is not msgpack.
CONTROL_MAX = 0x3F
REQUESTS = {
    MsgType.PING: MsgType.PONG,
    MsgType.FIND_NODE: MsgType.NODES,
    MsgType.FIND_VALUE: MsgType.VALUE,
    MsgType.STORE: MsgType.STORED,
}

ID_SIZE = 32
MAX_KEY = 128
MAX_SUBKEY = 64
MAX_VALUE = 640
MAX_TTL = 86400.0
MAX_TTL_S = MAX_TTL
MAX_CONTACTS = 20
MAX_RECORDS = 16
MAX_BODY = 65507  # the largest UDP payload; the MTU limits what a sender actually emits


def _port(v: Any) -> int:
    if type(v) is not int or not 1 <= v <= 65535:
        raise WireError("malformed", f"bad port {v!r:.20}")
    return v


def _ip(v: Any) -> str:
    if type(v) is not bytes or len(v) not in (4, 16):
        raise WireError("malformed", "an address is 4 (IPv4) or 16 (IPv6) bytes")
    return socket.inet_ntop(socket.AF_INET if len(v) == 4 else socket.AF_INET6, v)


ADDR = s.tuple_of(_ip, _port)  # decoded as ("host", port)
NODE_ID = s.binary(ID_SIZE, ID_SIZE)
CONTACT = s.tuple_of(NODE_ID, _ip, _port)  # (node id, host, port)
FROM = s.struct(
    {
        "pk": s.binary(PUBLIC_KEY_SIZE, PUBLIC_KEY_SIZE),
        "sig": s.binary(SIGNATURE_SIZE, SIGNATURE_SIZE),
        "addr": s.optional(ADDR),
    }
)
RECORD = s.tuple_of(
    s.binary(1, MAX_KEY),  # key
    s.binary(0, MAX_SUBKEY),  # subkey
    s.binary(0, MAX_VALUE),  # value
    s.number(0.0, 1e12),  # expires: absolute, in the writer's clock (signed; orders versions)
    s.number(0.0, MAX_TTL),  # ttl: seconds left to live, relative (not signed)
    s.binary(PUBLIC_KEY_SIZE, PUBLIC_KEY_SIZE),  # owner's public key
    s.binary(SIGNATURE_SIZE, SIGNATURE_SIZE),  # owner's signature
)

_COMMON = {"rid": s.uint(64), "from": FROM}
SCHEMAS: dict[MsgType, dict[str, s.Validator]] = {
    MsgType.PING: dict(_COMMON),
    MsgType.PONG: dict(_COMMON),
    MsgType.FIND_NODE: {**_COMMON, "target": NODE_ID},
    MsgType.NODES: {**_COMMON, "nodes": s.array_of(CONTACT, MAX_CONTACTS)},
    MsgType.FIND_VALUE: {**_COMMON, "key": s.binary(1, MAX_KEY), "offset": s.uint(16)},
    MsgType.VALUE: {
        **_COMMON,
        "records": s.array_of(RECORD, MAX_RECORDS),
        "total": s.uint(16),
        "nodes": s.array_of(CONTACT, MAX_CONTACTS),
    },
    MsgType.STORE: {**_COMMON, "records": s.array_of(RECORD, MAX_RECORDS)},
    MsgType.STORED: {**_COMMON, "ok": s.array_of(s.boolean, MAX_RECORDS)},
    MsgType.ERROR: {**_COMMON, "code": s.text(32), "detail": s.text(200)},
    MsgType.REPORT: {
        **_COMMON,
        "group": s.uint(32),
        "phase": s.uint(8),  # 0 reduce-scatter, 1 all-gather
        "expected": s.uint(32),  # datagrams this receiver expected from the sender in that phase
        "received": s.uint(32),
        "seconds": s.number(0.0, 86400.0),  # how long the phase took at the receiver
        "kernel_drops": s.uint(32),  # datagrams its kernel dropped at the socket during the phase
    },
}
_VALIDATORS = {t: s.struct(f) for t, f in SCHEMAS.items()}


def msg_type(value: int) -> MsgType:
    try:
        return MsgType(value)
    except ValueError:
        raise WireError("type", f"unknown message type {value:#04x}") from None


def pack_addr(host: str, port: int) -> list:
    return [ipaddress.ip_address(host).packed, port]


def pack_contact(node_id: bytes, host: str, port: int) -> list:
    return [node_id, ipaddress.ip_address(host).packed, port]


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict:
    """Duplicate keys are malformed: decoders disagree on which one wins."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate map key")
    return out


def encode(mtype: MsgType, body: dict[str, Any]) -> bytes:
    """Encode a control body with keys in schema order (canonical)."""
    fields = SCHEMAS[mtype]
    if body.keys() != fields.keys():
        raise ValueError(f"{mtype.name} takes exactly {list(fields)}, got {list(body)}")
    return msgpack.packb({k: body[k] for k in fields}, use_bin_type=True)


def decode(mtype: int, data: bytes) -> dict[str, Any]:
    """Decode and validate; raises WireError for anything that is not exactly the schema."""
    t = msg_type(mtype)
    if len(data) > MAX_BODY:
        raise WireError("malformed", "body too large")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=4096,
            max_bin_len=4096,
            max_array_len=256,
            max_map_len=32,
            max_ext_len=0,
            object_pairs_hook=_unique_map,
        )
    except Exception as e:  # msgpack raises a zoo of types for bad input
        raise WireError("malformed", f"not msgpack: {type(e).__name__}") from None
    return _VALIDATORS[t](raw)


def encode_fitting(mtype: MsgType, body: dict[str, Any], budget: int) -> bytes:
    """Encode, dropping trailing ``nodes`` then ``records`` entries until the body fits ``budget``.

    Lists are ordered best first (closest nodes, records in page order), so trimming the tail keeps
    the most useful part; VALUE's ``total`` lets the reader page for what was cut.
    """
    data = encode(mtype, body)
    for name in ("nodes", "records"):
        items = body.get(name)
        while len(data) > budget and items:
            body = {**body, name: items[:-1]}
            items = body[name]
            data = encode(mtype, body)
    if len(data) > budget:
        raise ValueError(f"{mtype.name} body of {len(data)} bytes does not fit {budget}")
    return data
