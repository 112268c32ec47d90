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
from .identity import BINDING_SIZE, PUBLIC_KEY_SIZE, SIGNATURE_SIZE


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
    MM_JOIN = 0x11  # Moshpit matchmaking: ask a leader to take me into its group
    MM_JOINED = 0x12
    MM_BEGIN = 0x13  # the leader closed its group: here is the authoritative member list
    MM_BEGUN = 0x14
    MM_DISBAND = 0x15  # one-way: the leader will not close this group; look again
    REPORT = 0x10  # one-way: a receiver's account of an interval of one sender's stream, for its pacing
    STATE_GET = 0x18  # state sync: ask a donor for a byte range of a training-state snapshot
    STATE_CHUNK = 0x19  # state sync: the bytes of that range
    OUTER_RECORD = 0x1A  # DiLoCo outer agreement: a member's record of an outer round, pushed to its group
    OUTER_RECORDED = 0x1B
    # NAT traversal (PROTOCOL.md section 18): 0x20..0x2F
    OBSERVE = 0x20  # where do you see me? (answered with the request's source address)
    OBSERVED = 0x21
    REACH_PROBE = 0x22  # have a third node probe me unsolicited, at the address you see
    REACH_PROBED = 0x23
    PROBE_ASK = 0x24  # one-way, helper -> prober: send a PROBE to this contact
    PROBE = 0x25  # one-way, prober -> target: the unsolicited datagram
    INTRO = 0x26  # introducer, tell this node to punch towards me
    INTRO_OK = 0x27
    CONNECT = 0x28  # one-way, introducer -> target: punch towards this peer now
    RELAY = 0x29  # one-way: relay, pass this sealed datagram on to that node
    RELAYED = 0x2A  # one-way, relay -> destination: a sealed datagram from that node


# Control types are 0x01..0x3F (0x10..0x3F reserved for matchmaking and later control);
# 0x40..0x7F are reserved for tensor data, which is not msgpack.
CONTROL_MAX = 0x3F
REQUESTS = {
    MsgType.PING: MsgType.PONG,
    MsgType.FIND_NODE: MsgType.NODES,
    MsgType.FIND_VALUE: MsgType.VALUE,
    MsgType.STORE: MsgType.STORED,
    MsgType.MM_JOIN: MsgType.MM_JOINED,
    MsgType.MM_BEGIN: MsgType.MM_BEGUN,
    MsgType.STATE_GET: MsgType.STATE_CHUNK,
    MsgType.OUTER_RECORD: MsgType.OUTER_RECORDED,
    MsgType.OBSERVE: MsgType.OBSERVED,
    MsgType.REACH_PROBE: MsgType.REACH_PROBED,
    MsgType.INTRO: MsgType.INTRO_OK,
}

ID_SIZE = 32
MAX_KEY = 128
MAX_SUBKEY = 64
MAX_VALUE = 640
HELD_PREFIX = 8  # FIND_VALUE held: signature prefix bytes
MAX_HELD = 64  # FIND_VALUE held: entries
MAX_TTL = 86400.0
MAX_TTL_S = MAX_TTL
MAX_CONTACTS = 20
MAX_RECORDS = 16
MAX_RUN = 64  # bytes of a run id
MAX_GROUP = 64  # members of one Moshpit group (the MTU may allow fewer: the leader checks)
MAX_BODY = 65507  # the largest UDP payload; the MTU limits what a sender actually emits
MAX_STATE_RUN = 96  # state sync: a run key (a run id of at most 64 bytes, "/", the layout hash)
MAX_CHUNK = 4096  # state sync: bytes in one STATE_CHUNK (the decoder's binary limit; the MTU is lower)
SHA256_SIZE = 32
MAX_OUTER_RECORD = MAX_VALUE  # bytes of a pushed outer record: what the DHT would hold of it
NONCE_SIZE = 16  # NAT traversal: a reachability probe's nonce
MAX_AVOID = 16  # NAT traversal: node ids a REACH_PROBE asks the helper not to use as prober
MIN_RELAYED = 37  # a sealed datagram: 21-byte header and 16-byte tag, at least
MAX_RELAYED = 4096  # NAT traversal: bytes of one relayed datagram (the MTU keeps it lower)
# What a RELAY (or RELAYED) adds around its inner datagram, sealed, at most: header and tag (37), ``rid`` and
# ``from`` with an IPv6 ``addr`` (at most 162 - 1 for the map header), the keys, a node id and a bin16 header.
RELAY_OVERHEAD = 248


def _port(v: Any) -> int:
    if type(v) is not int or not 1 <= v <= 65535:
        raise WireError("malformed", f"bad port {v!r:.20}")
    return v


def unusable_ip(packed: bytes) -> str:
    """Why a peer's address (4 or 16 raw bytes) must not be used as a destination, or "" when it may.

    Refused: unspecified and "this network" (0.0.0.0/8, ``::``: a datagram sent there reaches the sender's own
    host, so a member could turn a peer's traffic onto the peer's local services), the limited broadcast
    255.255.255.255 and multicast (224.0.0.0/4, ff00::/8: one datagram to many hosts, or a send that fails),
    also when written as IPv4-mapped IPv6. Loopback, private and link-local addresses are allowed (labs, LANs).
    """
    if len(packed) == 16 and packed[:12] == _V4_MAPPED:
        packed = packed[12:]
    if len(packed) == 4:
        if packed[0] == 0:
            return "unspecified"
        if packed == b"\xff\xff\xff\xff":
            return "broadcast"
        if 224 <= packed[0] <= 239:
            return "multicast"
        return ""
    if packed == bytes(16):
        return "unspecified"
    if packed[0] == 0xFF:
        return "multicast"
    return ""


_V4_MAPPED = bytes(10) + b"\xff\xff"


def _ip(v: Any) -> str:
    if type(v) is not bytes or len(v) not in (4, 16):
        raise WireError("malformed", "an address is 4 (IPv4) or 16 (IPv6) bytes")
    why = unusable_ip(v)
    if why:
        raise WireError("malformed", f"a peer address must not be {why}")
    return socket.inet_ntop(socket.AF_INET if len(v) == 4 else socket.AF_INET6, v)


ADDR = s.tuple_of(_ip, _port)  # decoded as ("host", port)
NODE_ID = s.binary(ID_SIZE, ID_SIZE)
CONTACT = s.tuple_of(NODE_ID, _ip, _port)  # (node id, host, port)

# Usable addresses already decoded (packed -> text): the same few hundred peers come back in every NODES and
# VALUE answer, and decoding 20 contacts through the generic validators cost ~8 us each, twice per answer (the
# encoder validates what it sends). Bounded: a peer sending many distinct addresses only empties it.
_HOSTS: dict[bytes, str] = {}
_HOSTS_MAX = 4096


def contacts(hi: int) -> s.Validator:
    """An array of at most ``hi`` CONTACTs, decoded exactly as ``s.array_of(CONTACT, hi)`` (same values, same
    errors: anything the fast path does not accept goes through the generic validators, which raise)."""
    generic = s.array_of(CONTACT, hi)
    hosts = _HOSTS

    def check(v: Any) -> list:
        if type(v) is not list or len(v) > hi:
            return generic(v)
        out = []
        for c in v:
            if type(c) is not list or len(c) != 3:
                return generic(v)
            node_id, ip, port = c
            host = hosts.get(ip) if type(ip) is bytes else None
            if type(node_id) is not bytes or len(node_id) != ID_SIZE or type(port) is not int or not 1 <= port <= 65535:
                return generic(v)
            if host is None:
                try:
                    host = _ip(ip)
                except WireError:
                    return generic(v)  # raises, with the first error in the generic order
                if len(hosts) >= _HOSTS_MAX:
                    hosts.clear()
                hosts[ip] = host
            out.append((node_id, host, port))
        return out

    return check


FROM = s.struct(
    {
        "pk": s.binary(PUBLIC_KEY_SIZE, PUBLIC_KEY_SIZE),
        "sig": s.binary(BINDING_SIZE, BINDING_SIZE),  # the token's nonce, then its signature (section 7.2)
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
    MsgType.NODES: {**_COMMON, "nodes": contacts(MAX_CONTACTS)},
    # held: the first 8 bytes of the signatures of records the asker holds under key (left out of the answer);
    # have: a bitmap over held (bit i of byte i // 8, least significant first) of those the responder holds
    MsgType.FIND_VALUE: {
        **_COMMON,
        "key": s.binary(1, MAX_KEY),
        "offset": s.uint(16),
        "held": s.array_of(s.binary(HELD_PREFIX, HELD_PREFIX), MAX_HELD),
    },
    MsgType.VALUE: {
        **_COMMON,
        "records": s.array_of(RECORD, MAX_RECORDS),
        "total": s.uint(16),
        "nodes": contacts(MAX_CONTACTS),
        "have": s.binary(0, (MAX_HELD + 7) // 8),
    },
    MsgType.STORE: {**_COMMON, "records": s.array_of(RECORD, MAX_RECORDS)},
    MsgType.STORED: {**_COMMON, "ok": s.array_of(s.boolean, MAX_RECORDS)},
    MsgType.ERROR: {**_COMMON, "code": s.text(32), "detail": s.text(200)},
    MsgType.REPORT: {
        **_COMMON,
        "group": s.uint(32),
        "phase": s.uint(8),  # 0 reduce-scatter, 1 all-gather: the phase of the latest data in the interval
        "expected": s.uint(32),  # data datagrams the sender sent in the interval, as far as the receiver can tell
        "received": s.uint(32),  # data datagrams that arrived in the interval
        "bytes": s.uint(64),  # datagram bytes that arrived in the interval (delivered rate = bytes / seconds)
        "seconds": s.number(0.0, 86400.0),  # the interval, at the receiver
        "kernel_drops": s.uint(32),  # datagrams its kernel dropped at the socket in the interval (all senders)
        "position": s.uint(32),  # one past the highest position of the sender's stream (RS, then AG) that arrived
        # when the datagram at position - 1 arrived (the receiver's clock, unix seconds; 0: unknown)
        "arrived": s.number(0.0, 1e12),
    },
    MsgType.STATE_GET: {
        **_COMMON,
        "run": s.binary(1, MAX_STATE_RUN),  # the run key the snapshot belongs to
        "sha": s.binary(SHA256_SIZE, SHA256_SIZE),  # SHA-256 of the whole snapshot: names it exactly
        "offset": s.uint(64),
        "length": s.uint(16),  # bytes wanted; the donor may send fewer (to fit its MTU), never more
    },
    MsgType.STATE_CHUNK: {
        **_COMMON,
        "sha": s.binary(SHA256_SIZE, SHA256_SIZE),
        "offset": s.uint(64),
        "total": s.uint(64),  # the snapshot's size in bytes
        "data": s.binary(0, MAX_CHUNK),
    },
    MsgType.OUTER_RECORD: {
        **_COMMON,
        "run": s.binary(1, MAX_STATE_RUN),  # the run key the outer round belongs to
        "round": s.uint(32),  # the outer round (the trainers' step of the outer sync)
        "seq": s.uint(32),  # the sender's count of records it pushed for this round: the highest is its newest
        "record": s.binary(1, MAX_OUTER_RECORD),  # the record, as the DHT value (attributed to the sender)
    },
    MsgType.OUTER_RECORDED: {**_COMMON, "ok": s.boolean},  # false: not held (a run this node does not train)
}
SCHEMAS.update({
    MsgType.MM_JOIN: {**_COMMON, "run": s.text(MAX_RUN), "round": s.uint(32), "key": s.text(MAX_KEY),
                      "expiry": s.number(0.0, 1e12)},
    MsgType.MM_JOINED: {**_COMMON, "ok": s.boolean, "reason": s.text(32)},
    MsgType.MM_BEGIN: {
        **_COMMON,
        "run": s.text(MAX_RUN),
        "round": s.uint(32),
        "group": s.uint(32),
        # [pk, ip, port, capped?]: capped true for a member whose record advertised caps (PROTOCOL.md 16, Begin)
        "members": s.array_of(s.tuple_of(s.binary(PUBLIC_KEY_SIZE, PUBLIC_KEY_SIZE), _ip, _port, s.boolean,
                                         optional=1), MAX_GROUP),
    },
    MsgType.MM_BEGUN: {**_COMMON, "ok": s.boolean},
    MsgType.MM_DISBAND: {**_COMMON, "run": s.text(MAX_RUN), "round": s.uint(32)},
})
SCHEMAS.update({
    MsgType.OBSERVE: dict(_COMMON),
    MsgType.OBSERVED: {**_COMMON, "seen": ADDR},  # the OBSERVE's source address, as the responder saw it
    MsgType.REACH_PROBE: {**_COMMON, "nonce": s.binary(NONCE_SIZE, NONCE_SIZE),
                          "avoid": s.array_of(NODE_ID, MAX_AVOID)},
    MsgType.REACH_PROBED: {**_COMMON, "ok": s.boolean},  # true: a prober was asked
    MsgType.PROBE_ASK: {**_COMMON, "target": CONTACT, "nonce": s.binary(NONCE_SIZE, NONCE_SIZE)},
    MsgType.PROBE: {**_COMMON, "nonce": s.binary(NONCE_SIZE, NONCE_SIZE)},
    MsgType.INTRO: {**_COMMON, "target": NODE_ID},
    MsgType.INTRO_OK: {**_COMMON, "peer": s.optional(CONTACT)},  # the target as the introducer reached it
    MsgType.CONNECT: {**_COMMON, "peer": CONTACT},  # the requester as the introducer saw it
    MsgType.RELAY: {**_COMMON, "to": NODE_ID, "data": s.binary(MIN_RELAYED, MAX_RELAYED)},
    MsgType.RELAYED: {**_COMMON, "src": NODE_ID, "data": s.binary(MIN_RELAYED, MAX_RELAYED)},
})
_VALIDATORS = {t: s.struct(f) for t, f in SCHEMAS.items()}


_MSG_TYPES = {int(t): t for t in MsgType}  # (a dict lookup: MsgType(value) costs an enum call per datagram)


def msg_type(value: int) -> MsgType:
    t = _MSG_TYPES.get(value)
    if t is None:
        raise WireError("type", f"unknown message type {value:#04x}")
    return t


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


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")


# Per message type: the map header, and (name, the name packed, its validator) in schema order. A body is
# packed field by field (header, then each name and value: the bytes msgpack packs the whole map to), so that
# the check before sending can validate each field's bytes on their own (see _check_fields).
_LAYOUTS: dict[MsgType, tuple[bytes, tuple[tuple[str, bytes, s.Validator], ...]]] = {
    t: (_map_header(len(f)), tuple((k, msgpack.packb(k), v) for k, v in f.items())) for t, f in SCHEMAS.items()
}
# (validator, a field's packed bytes) the check before sending passed: a node sends the same ``from``, the same
# contacts and the same records over and over, and validating them again was half of what sending a NODES or
# VALUE cost. Validators are pure functions of the bytes, so a hit passes exactly what a full decode passes.
# Bounded: emptied once it holds _SENDABLE_MAX; fields under _SENDABLE_MIN bytes (ids, counts) are not kept.
_SENDABLE: dict[tuple[s.Validator, bytes], None] = {}
_SENDABLE_MAX = 1024
_SENDABLE_MIN = 16


def _unpack(data: bytes) -> Any:
    """msgpack with the decoder's limits; WireError for anything it refuses."""
    try:
        return msgpack.unpackb(
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


# One packer for every field (msgpack.packb makes one per call, which cost more than packing a small field). The C
# packer holds the GIL while it packs, so a call is never interleaved with another thread's.
_PACKER = msgpack.Packer(use_bin_type=True)


def _pack_value(mtype: MsgType, value: Any) -> bytes:
    try:
        return _PACKER.pack(value)
    except (TypeError, ValueError, OverflowError) as e:  # an int past 64 bits, a type msgpack has no form for
        raise WireError("malformed", f"{mtype.name} cannot be encoded: {e}") from None


def _pack_fields(mtype: MsgType, body: dict[str, Any]) -> list[bytes]:
    """Each field's value packed, in schema order (ValueError unless ``body`` has exactly the schema's keys)."""
    fields = SCHEMAS[mtype]
    if body.keys() != fields.keys():
        raise ValueError(f"{mtype.name} takes exactly {list(fields)}, got {list(body)}")
    return [_pack_value(mtype, body[name]) for name, _, _ in _LAYOUTS[mtype][1]]


def _join(mtype: MsgType, parts: list[bytes]) -> bytes:
    header, layout = _LAYOUTS[mtype]
    out = [header]
    for (_, key, _), part in zip(layout, parts, strict=True):
        out += (key, part)
    return b"".join(out)


def encode(mtype: MsgType, body: dict[str, Any], *, check: bool = True) -> bytes:
    """Encode a control body with keys in schema order (canonical).

    ``check``: run the decoder's validation on the result and raise its WireError for anything a peer
    would refuse (a round past uint32, an unusable address, a string too long), so a node never sends what
    its peers drop. Only tests that build refused bodies on purpose pass False."""
    parts = _pack_fields(mtype, body)
    data = _join(mtype, parts)
    if check:
        _check_sendable(mtype, data, parts)
    return data


def _check_sendable(mtype: MsgType, data: bytes, parts: list[bytes]) -> None:
    try:
        _check_fields(mtype, data, parts)
    except WireError as e:
        raise WireError(e.reason, f"refusing to send a {mtype.name} its peers would drop: {e.detail}") from None


def _check_fields(mtype: MsgType, data: bytes, parts: list[bytes]) -> None:
    """What ``decode(mtype, data)`` checks, for ``data`` made by ``_join(mtype, parts)``: the size, then each
    field's bytes unpacked with the decoder's limits and validated by its validator (the map itself, the
    schema's keys in order, is valid by construction). A field's bytes that passed before pass at once."""
    if len(data) > MAX_BODY:
        raise WireError("malformed", "body too large")
    sendable = _SENDABLE
    for (_, _, validator), part in zip(_LAYOUTS[mtype][1], parts, strict=True):
        if len(part) < _SENDABLE_MIN:  # an id, a count, a short key: not worth a place in the cache
            validator(_unpack(part))
            continue
        key = (validator, part)
        if key in sendable:
            continue
        validator(_unpack(part))
        if len(sendable) >= _SENDABLE_MAX:
            sendable.clear()
        sendable[key] = None


def decode(mtype: int, data: bytes) -> dict[str, Any]:
    """Decode and validate; raises WireError for anything that is not exactly the schema."""
    t = msg_type(mtype)
    if len(data) > MAX_BODY:
        raise WireError("malformed", "body too large")
    return _VALIDATORS[t](_unpack(data))


def encode_fitting(mtype: MsgType, body: dict[str, Any], budget: int) -> bytes:
    """Encode, dropping trailing ``nodes`` then ``records`` entries until the body fits ``budget``.

    Lists are ordered best first (closest nodes, records in page order), so trimming the tail keeps
    the most useful part; VALUE's ``total`` lets the reader page for what was cut. Only the trimmed field
    is packed again.
    """
    parts = _pack_fields(mtype, body)
    data = _join(mtype, parts)
    names = list(SCHEMAS[mtype])
    for name in ("nodes", "records"):
        items = body.get(name)
        while len(data) > budget and items:
            items = items[:-1]
            parts[names.index(name)] = _pack_value(mtype, items)
            data = _join(mtype, parts)
    if len(data) > budget:
        raise ValueError(f"{mtype.name} body of {len(data)} bytes does not fit {budget}")
    _check_sendable(mtype, data, parts)  # once, on what goes out
    return data
