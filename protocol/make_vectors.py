#!/usr/bin/env python3
"""Generate the golden wire-protocol vectors in protocol/vectors/*.json from fixed inputs.

    python protocol/make_vectors.py            # (re)write protocol/vectors/*.json
    python protocol/make_vectors.py --check    # exit 1 if a checked-in file differs

Everything here is deterministic: fixed Ed25519 seeds (the first two from RFC 8032, section 7.1),
a fixed swarm secret, fixed tokens, sequence numbers and request ids. Ed25519 signatures are
deterministic and AES-GCM with a fixed key and nonce is too, so the output never changes unless the
protocol (or peerd.wire) does. protocol/vectors/README.md describes the JSON conventions.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from peerd.wire import messages as m  # noqa: E402
from peerd.wire.envelope import FLAG_NO_RECEIVER, FLAG_SEALED, HEADER_SIZE, MAGIC, VERSION, Header  # noqa: E402
from peerd.wire.errors import WireError  # noqa: E402
from peerd.wire.identity import TOKEN_BINDING_DOMAIN, TOKEN_DOMAIN, Identity, token_of  # noqa: E402
from peerd.wire.replay import DEFAULT_WINDOW, ReplayWindow  # noqa: E402
from peerd.wire.seal import KDF_INFO, KDF_SALT, Opener, Sealer, derive_key, nonce_for  # noqa: E402

VECTORS = ROOT / "protocol" / "vectors"

# ---- fixed inputs -------------------------------------------------------------------------------

SWARM_SECRET = bytes(range(32))  # 000102..1f
OTHER_SECRET = bytes(range(32, 64))  # a different swarm
# RFC 8032 section 7.1, TEST 1 and TEST 2 secret keys (so an implementation can cross-check Ed25519).
SEED_A = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
SEED_B = bytes.fromhex("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb")
SEED_C = bytes(32)  # all zero

RECORD_DOMAIN = "peerd-v1 record"

IDENT_A = Identity.from_seed(SEED_A)  # the sender of every control message in the vectors
IDENT_B = Identity.from_seed(SEED_B)  # the owner of the records
IDENT_C = Identity.from_seed(SEED_C)
RECEIVER = IDENT_B.node_id  # every datagram in the vectors is sealed for B unless it says otherwise
NONCE_A = bytes.fromhex("a0a1a2a3a4a5a6a7")  # the nonce of A's token in every vector
NONCE_A2 = bytes.fromhex("0000000000000001")
BINDING_A = IDENT_A.bind_token(nonce=NONCE_A)
TOKEN = BINDING_A.token  # A's token: SHA-256("peerd-v1 token" || pk_A || NONCE_A)[:8]


def hx(b: bytes) -> str:
    return b.hex()


def tok(t: int) -> str:
    return f"{t:016x}"


# ---- helpers that are part of the protocol but not (yet) of peerd.wire ----------------------------


def record_message(key: bytes, subkey: bytes, value: bytes, expires: float) -> bytes:
    """The bytes an owner signs for a DHT record (PROTOCOL.md, "Records")."""
    return msgpack.packb([RECORD_DOMAIN, key, subkey, value, float(expires)], use_bin_type=True)


def make_record(ident: Identity, key: bytes, subkey: bytes, value: bytes, expires: float, ttl: float) -> list:
    sig = ident.sign(record_message(key, subkey, value, expires))
    return [key, subkey, value, float(expires), float(ttl), ident.public_key, sig]


def seal_at(
    secret: bytes | None,
    token: int,
    seq: int,
    mtype: int,
    body: bytes,
    flags: int | None = None,
    receiver: bytes | None = RECEIVER,
) -> bytes:
    """Seal one datagram at an arbitrary sequence number (a Sealer always starts at 1), for ``receiver``
    (its node id is the AAD after the header) or, with ``receiver=None``, for no receiver (FLAG_NO_RECEIVER).

    Built from peerd.wire's own pieces (Header, derive_key, nonce_for); the tests check that it agrees
    with Sealer byte for byte.
    """
    if flags is None:
        flags = (FLAG_SEALED if secret is not None else 0) | (FLAG_NO_RECEIVER if receiver is None else 0)
    header = Header(mtype, flags, token, seq).pack()
    if secret is None:
        return header + body
    return header + AESGCM(derive_key(secret, token)).encrypt(nonce_for(seq), body, header + (receiver or b""))


def from_field(ident: Identity, token: int, addr: tuple[str, int] | None) -> dict:
    binding = ident.bind_token(nonce=NONCE_A)
    assert binding.token == token, "every control message in the vectors is A's, under A's token"
    return binding.sender(None if addr is None else m.pack_addr(*addr))


def jsonable(v: Any) -> Any:
    """The decoded (semantic) view of a message as JSON: bytes -> hex, tuples -> lists."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def wire_json(v: Any) -> Any:
    """The msgpack data model as JSON: bytes -> {"bin": hex}, so the exact structure is visible."""
    if isinstance(v, bytes):
        return {"bin": v.hex()}
    if isinstance(v, dict):
        return {k: wire_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [wire_json(x) for x in v]
    return v


# ---- the messages -----------------------------------------------------------------------------------

NODE_ID_X = hashlib.sha256(b"peerd test target").digest()
DHT_KEY = b"run/demo/peers"
RECORD_EXPIRES = 1767225600.0  # 2026-01-01T00:00:00Z in the writer's clock
RECORD_TTL = 600.0


def records() -> list[list]:
    return [
        make_record(IDENT_B, DHT_KEY, b"\x00\x01", b"192.0.2.10:7400", RECORD_EXPIRES, RECORD_TTL),
        make_record(IDENT_B, DHT_KEY, b"peer-b", b"\x82\xa1n\x01\xa1s\xc3", RECORD_EXPIRES + 0.5, 86400.0),
    ]


def contacts() -> list[list]:
    return [
        m.pack_contact(IDENT_B.node_id, "192.0.2.10", 7400),
        m.pack_contact(IDENT_C.node_id, "2001:db8::c", 65535),
        m.pack_contact(NODE_ID_X, "198.51.100.255", 1),
    ]


NAT_NONCE = bytes(range(0xA0, 0xB0))
# a relayed datagram is an opaque sealed datagram: here a header (type PING, sealed) and 37 bytes after it
NAT_INNER = bytes.fromhex("50440201010000000000000007000000000000000b") + bytes(range(37))


def control_messages() -> list[tuple[str, m.MsgType, dict]]:
    """(name, type, body) in the order they are sealed (sequence numbers 1, 2, ...)."""
    a4 = ("203.0.113.7", 7400)
    a6 = ("2001:db8::a", 7401)
    recs = records()
    return [
        ("ping", m.MsgType.PING, {"rid": 1, "from": from_field(IDENT_A, TOKEN, a4)}),
        ("pong", m.MsgType.PONG, {"rid": 1, "from": from_field(IDENT_A, TOKEN, None)}),
        (
            "find_node",
            m.MsgType.FIND_NODE,
            {"rid": 0xFEDCBA9876543210, "from": from_field(IDENT_A, TOKEN, a6), "target": NODE_ID_X},
        ),
        (
            "nodes",
            m.MsgType.NODES,
            {"rid": 0xFEDCBA9876543210, "from": from_field(IDENT_A, TOKEN, a4), "nodes": contacts()},
        ),
        (
            "nodes_empty",
            m.MsgType.NODES,
            {"rid": 2**64 - 1, "from": from_field(IDENT_A, TOKEN, a4), "nodes": []},
        ),
        (
            "find_value",
            m.MsgType.FIND_VALUE,
            {"rid": 300, "from": from_field(IDENT_A, TOKEN, a4), "key": DHT_KEY, "offset": 0, "held": []},
        ),
        (
            "value",
            m.MsgType.VALUE,
            {
                "rid": 300,
                "from": from_field(IDENT_A, TOKEN, a4),
                "records": recs,
                "total": 2,
                "nodes": contacts()[:1],
                "have": b"",
            },
        ),
        (
            "find_value_page",
            m.MsgType.FIND_VALUE,
            {"rid": 301, "from": from_field(IDENT_A, TOKEN, a4), "key": DHT_KEY, "offset": 1, "held": []},
        ),
        (
            "value_page",
            m.MsgType.VALUE,
            {"rid": 301, "from": from_field(IDENT_A, TOKEN, a4), "records": recs[1:], "total": 2, "nodes": [],
             "have": b""},
        ),
        ("store", m.MsgType.STORE, {"rid": 65536, "from": from_field(IDENT_A, TOKEN, a4), "records": recs}),
        ("stored", m.MsgType.STORED, {"rid": 65536, "from": from_field(IDENT_A, TOKEN, a4), "ok": [True, False]}),
        (
            "error",
            m.MsgType.ERROR,
            {
                "rid": 302,
                "from": from_field(IDENT_A, TOKEN, a4),
                "code": "busy",
                "detail": "too many requests, retry later ✓",
            },
        ),
        (
            "report",
            m.MsgType.REPORT,
            {
                "rid": 303,
                "from": from_field(IDENT_A, TOKEN, a4),
                "group": 0xDEADBEEF,
                "phase": 0,
                "expected": 128,
                "received": 117,
                "bytes": 140400,
                "seconds": 0.025,
                "kernel_drops": 0,
                "position": 4096,
                "arrived": 1795000000.125,
            },
        ),
        (
            "mm_join",
            m.MsgType.MM_JOIN,
            {"rid": 305, "from": from_field(IDENT_A, TOKEN, a4), "run": "demo", "round": 7, "key": "2.0",
             "expiry": 1767225600.25},
        ),
        ("mm_joined", m.MsgType.MM_JOINED, {"rid": 305, "from": from_field(IDENT_A, TOKEN, a4), "ok": False,
                                            "reason": "following"}),
        (
            "mm_begin",
            m.MsgType.MM_BEGIN,
            {"rid": 306, "from": from_field(IDENT_A, TOKEN, a4), "run": "demo", "round": 7, "group": 0x1234ABCD,
             "members": [[IDENT_A.public_key, ipaddress.ip_address("192.0.2.1").packed, 7411],
                         [IDENT_A.public_key[::-1], ipaddress.ip_address("2001:db8::1").packed, 7412]]},
        ),
        (  # a member that announced caps is marked (section 16, Begin): it owns a smaller shard
            "mm_begin_capped",
            m.MsgType.MM_BEGIN,
            {"rid": 309, "from": from_field(IDENT_A, TOKEN, a4), "run": "demo", "round": 8, "group": 0x0BADCAFE,
             "members": [[IDENT_A.public_key, ipaddress.ip_address("192.0.2.1").packed, 7411],
                         [IDENT_A.public_key[::-1], ipaddress.ip_address("192.0.2.2").packed, 7412, True],
                         [bytes(32), ipaddress.ip_address("192.0.2.3").packed, 7413, False]]},
        ),
        ("mm_begun", m.MsgType.MM_BEGUN, {"rid": 306, "from": from_field(IDENT_A, TOKEN, a4), "ok": True}),
        ("mm_disband", m.MsgType.MM_DISBAND, {"rid": 307, "from": from_field(IDENT_A, TOKEN, a4), "run": "demo",
                                              "round": 7}),
        (
            "state_get",
            m.MsgType.STATE_GET,
            {
                "rid": 304,
                "from": from_field(IDENT_A, TOKEN, a4),
                "run": b"demo/3f2a9c0d11e4b7a5",
                "sha": hashlib.sha256(b"peerd state snapshot").digest(),
                "offset": 1800,
                "length": 900,
            },
        ),
        (
            "state_chunk",
            m.MsgType.STATE_CHUNK,
            {
                "rid": 304,
                "from": from_field(IDENT_A, TOKEN, a4),
                "sha": hashlib.sha256(b"peerd state snapshot").digest(),
                "offset": 1800,
                "total": 2000,
                "data": bytes(range(200)),
            },
        ),
        # NAT traversal (section 18)
        ("observe", m.MsgType.OBSERVE, {"rid": 401, "from": from_field(IDENT_A, TOKEN, None)}),
        ("observed", m.MsgType.OBSERVED, {"rid": 401, "from": from_field(IDENT_A, TOKEN, a4),
                                          "seen": m.pack_addr("198.51.100.7", 40312)}),
        ("reach_probe", m.MsgType.REACH_PROBE, {"rid": 402, "from": from_field(IDENT_A, TOKEN, None),
                                                "nonce": NAT_NONCE, "avoid": [IDENT_A.node_id[::-1]]}),
        ("reach_probed", m.MsgType.REACH_PROBED, {"rid": 402, "from": from_field(IDENT_A, TOKEN, a4), "ok": True}),
        ("probe_ask", m.MsgType.PROBE_ASK, {"rid": 403, "from": from_field(IDENT_A, TOKEN, a4),
                                            "target": m.pack_contact(IDENT_A.node_id[::-1], "198.51.100.7", 40312),
                                            "nonce": NAT_NONCE}),
        ("probe", m.MsgType.PROBE, {"rid": 404, "from": from_field(IDENT_A, TOKEN, a4), "nonce": NAT_NONCE}),
        ("intro", m.MsgType.INTRO, {"rid": 405, "from": from_field(IDENT_A, TOKEN, None),
                                    "target": IDENT_A.node_id[::-1]}),
        ("intro_ok", m.MsgType.INTRO_OK, {"rid": 405, "from": from_field(IDENT_A, TOKEN, a4),
                                          "peer": m.pack_contact(IDENT_A.node_id[::-1], "198.51.100.9", 20001)}),
        ("intro_ok unknown", m.MsgType.INTRO_OK, {"rid": 406, "from": from_field(IDENT_A, TOKEN, a4),
                                                  "peer": None}),
        ("connect", m.MsgType.CONNECT, {"rid": 407, "from": from_field(IDENT_A, TOKEN, a4),
                                        "peer": m.pack_contact(IDENT_A.node_id, "198.51.100.7", 40312)}),
        ("relay", m.MsgType.RELAY, {"rid": 408, "from": from_field(IDENT_A, TOKEN, None),
                                    "to": IDENT_A.node_id[::-1], "data": NAT_INNER}),
        ("relayed", m.MsgType.RELAYED, {"rid": 409, "from": from_field(IDENT_A, TOKEN, a4),
                                        "src": IDENT_A.node_id, "data": NAT_INNER}),
        # the asker holds recs[0] and a record the responder does not: it gets recs[1] alone, have = 0b01
        ("find_value_held", m.MsgType.FIND_VALUE, {"rid": 302, "from": from_field(IDENT_A, TOKEN, a4),
                                                   "key": DHT_KEY, "offset": 0,
                                                   "held": [bytes(recs[0][6][:8]), bytes(8)]}),
        ("value_held", m.MsgType.VALUE, {"rid": 302, "from": from_field(IDENT_A, TOKEN, a4), "records": recs[1:],
                                         "total": 1, "nodes": [], "have": b"\x01"}),
        # DiLoCo outer records pushed to the group (section 15)
        (
            "outer_record",
            m.MsgType.OUTER_RECORD,
            {
                "rid": 308,
                "from": from_field(IDENT_A, TOKEN, a4),
                "run": b"demo/3f2a9c0d11e4b7a5",
                "round": 12,
                "seq": 2,
                "record": msgpack.packb({"g": "1a2b3c4d", "n": 2, "i": 0, "s": bytes(32), "a": bytes(range(32)),
                                         "f": b"", "t": b"", "l": 1000, "d": ["192.0.2.1", 7411]}, use_bin_type=True),
            },
        ),
        ("outer_recorded", m.MsgType.OUTER_RECORDED, {"rid": 308, "from": from_field(IDENT_A, TOKEN, a4), "ok": True}),
        # a record that tells its member's wait for the group (section 15.1, ``w``)
        (
            "outer_record_waited",
            m.MsgType.OUTER_RECORD,
            {
                "rid": 309,
                "from": from_field(IDENT_A, TOKEN, a4),
                "run": b"demo/3f2a9c0d11e4b7a5",
                "round": 12,
                "seq": 3,
                "record": msgpack.packb({"g": "1a2b3c4d", "n": 2, "i": 1, "s": bytes(32), "a": bytes(range(32)),
                                         "f": bytes(range(32)), "t": b"", "l": 1000, "d": ["192.0.2.2", 7411],
                                         "w": 2.875}, use_bin_type=True),
            },
        ),
    ]


# ---- the files ---------------------------------------------------------------------------------------


def envelope_vectors() -> dict:
    valid = [
        ("sealed ping", 0x01, FLAG_SEALED, TOKEN, 1),
        ("sealed ping for no receiver", 0x01, FLAG_SEALED | FLAG_NO_RECEIVER, TOKEN, 1),
        ("insecure pong", 0x02, 0, TOKEN, 2),
        ("tensor type, large values", 0x40, FLAG_SEALED, 2**64 - 1, 2**64 - 1),
        ("token 1, sequence 256", 0x3F, FLAG_SEALED, 1, 256),
    ]
    out_valid = []
    for name, mtype, flags, token, seq in valid:
        out_valid.append(
            {
                "name": name,
                "type": mtype,
                "flags": flags,
                "token": tok(token),
                "seq": seq,
                "header": hx(Header(mtype, flags, token, seq).pack()),
            }
        )
    good = Header(0x01, FLAG_SEALED, TOKEN, 1).pack()
    invalid = [
        ("empty", b"", "malformed"),
        ("20 bytes: shorter than the header", good[:20], "malformed"),
        ("bad magic", b"PE" + good[2:], "malformed"),
        ("lowercase magic", b"pd" + good[2:], "malformed"),
        ("version 0", good[:2] + b"\x00" + good[3:], "version"),
        ("version 1", good[:2] + b"\x01" + good[3:], "version"),
        ("version 3", good[:2] + b"\x03" + good[3:], "version"),
        ("reserved flag bit 2", good[:4] + b"\x05" + good[5:], "malformed"),
        ("no-receiver flag on a FIND_NODE", Header(0x03, FLAG_SEALED | FLAG_NO_RECEIVER, TOKEN, 1).pack(), "malformed"),
        ("no-receiver flag on tensor data", Header(0x40, FLAG_SEALED | FLAG_NO_RECEIVER, TOKEN, 1).pack(), "malformed"),
        ("reserved flag bit 7", good[:4] + b"\x80" + good[5:], "malformed"),
    ]
    return {
        "description": "The 21-byte datagram header: magic 'PD', version 2, type u8, flags u8 (0x01 sealed, "
        "0x02 no receiver: PING only), token u64, sequence u64, network byte order (PROTOCOL.md, 'Datagram "
        "envelope').",
        "header_size": HEADER_SIZE,
        "magic": hx(MAGIC),
        "version": VERSION,
        "valid": out_valid,
        "invalid": [{"name": n, "header": hx(b), "reason": r} for n, b, r in invalid],
    }


def kdf_vectors() -> dict:
    keys = []
    for secret, token in [(SWARM_SECRET, TOKEN), (SWARM_SECRET, 1), (SWARM_SECRET, 2**64 - 1), (OTHER_SECRET, TOKEN)]:
        info = KDF_INFO + token.to_bytes(8, "big")
        keys.append({"secret": hx(secret), "token": tok(token), "info": hx(info), "key": hx(derive_key(secret, token))})
    nonces = [{"seq": seq, "nonce": hx(nonce_for(seq))} for seq in (1, 2, 256, 2**32 + 5, 2**64 - 1)]
    return {
        "description": "Per-token datagram keys: HKDF-SHA256(ikm=swarm secret, salt='peerd-v1', "
        "info='peerd v1 datagram key' || token u64 BE, L=32); AES-GCM nonce = 4 zero bytes || sequence u64 BE.",
        "salt": hx(KDF_SALT),
        "info_prefix": hx(KDF_INFO),
        "keys": keys,
        "nonces": nonces,
    }


def identity_vectors() -> dict:
    idents = []
    for name, seed in [("A (RFC 8032 TEST 1)", SEED_A), ("B (RFC 8032 TEST 2)", SEED_B), ("C (zero seed)", SEED_C)]:
        ident = Identity.from_seed(seed)
        idents.append({"name": name, "seed": hx(seed), "pk": hx(ident.public_key), "node_id": hx(ident.node_id)})
    bindings = []
    for ident, seed, nonce in [(IDENT_A, SEED_A, NONCE_A), (IDENT_A, SEED_A, NONCE_A2), (IDENT_B, SEED_B, NONCE_A)]:
        b = ident.bind_token(nonce=nonce)
        assert b.token == token_of(ident.public_key, nonce)
        bindings.append(
            {
                "seed": hx(seed),
                "pk": hx(ident.public_key),
                "nonce": hx(nonce),
                "token_input": hx(TOKEN_DOMAIN + ident.public_key + nonce),
                "token": tok(b.token),
                "message": hx(TOKEN_BINDING_DOMAIN + b.token.to_bytes(8, "big")),
                "sig": hx(b.sig),
                "proof": hx(b.proof),
            }
        )
    other = IDENT_A.bind_token(nonce=NONCE_A2).token
    sig_a = IDENT_A.sign_token(TOKEN)
    forged = [
        {
            "name": "A's binding presented with B's key",
            "pk": hx(IDENT_B.public_key),
            "token": tok(TOKEN),
            "proof": hx(NONCE_A + sig_a),
            "reason": "identity",
        },
        {
            "name": "B squats A's token: B's own valid signature over it",
            "pk": hx(IDENT_B.public_key),
            "token": tok(TOKEN),
            "proof": hx(NONCE_A + IDENT_B.sign_token(TOKEN)),
            "reason": "identity",
        },
        {
            "name": "A's token with the nonce of A's other token",
            "pk": hx(IDENT_A.public_key),
            "token": tok(TOKEN),
            "proof": hx(NONCE_A2 + sig_a),
            "reason": "identity",
        },
        {
            "name": "A's signature for its other token presented for this one",
            "pk": hx(IDENT_A.public_key),
            "token": tok(TOKEN),
            "proof": hx(NONCE_A + IDENT_A.sign_token(other)),
            "reason": "identity",
        },
        {
            "name": "signature with one bit flipped",
            "pk": hx(IDENT_A.public_key),
            "token": tok(TOKEN),
            "proof": hx(NONCE_A + bytes([sig_a[0] ^ 1]) + sig_a[1:]),
            "reason": "identity",
        },
    ]
    return {
        "description": "Ed25519 identities (node id = SHA-256(pk)) and token bindings: "
        "token = first 8 bytes (u64 BE) of SHA-256('peerd-v1 token' || pk || nonce); "
        "sig = Ed25519(sk, 'peerd-v1 token binding' || token u64 BE); a from's sig carries proof = nonce || sig.",
        "domain": hx(TOKEN_BINDING_DOMAIN),
        "token_domain": hx(TOKEN_DOMAIN),
        "identities": idents,
        "bindings": bindings,
        "forged": forged,
    }


def record_vectors() -> dict:
    out = []
    cases = [
        ("typical", DHT_KEY, b"\x00\x01", b"192.0.2.10:7400", RECORD_EXPIRES, RECORD_TTL),
        ("empty subkey and value, integral expires", b"k", b"", b"", 1.0, 0.25),
        ("maximum sizes", b"K" * m.MAX_KEY, b"S" * m.MAX_SUBKEY, bytes(range(256)) * 2 + b"V" * 128, 1e12, m.MAX_TTL),
    ]
    for name, key, subkey, value, expires, ttl in cases:
        rec = make_record(IDENT_B, key, subkey, value, expires, ttl)
        out.append(
            {
                "name": name,
                "seed": hx(SEED_B),
                "pk": hx(IDENT_B.public_key),
                "key": hx(key),
                "location": hx(hashlib.sha256(key).digest()),
                "subkey": hx(subkey),
                "value": hx(value),
                "expires": expires,
                "ttl": ttl,
                "signed_message": hx(record_message(key, subkey, value, expires)),
                "sig": hx(rec[6]),
                "record": hx(msgpack.packb(rec, use_bin_type=True)),
            }
        )
    return {
        "description": "Signed DHT records: record = [key, subkey, value, expires, ttl, pk, sig]; "
        "sig = Ed25519 over msgpack(['peerd-v1 record', key, subkey, value, expires]) with expires "
        "as float64; DHT location = SHA-256(key).",
        "domain": RECORD_DOMAIN,
        "records": out,
    }


def announce_vectors() -> dict:
    """Matchmaking record values (section 16.1): written by hand here from the text, decoded by peerd in the tests."""
    ip4, ip6 = ipaddress.ip_address("192.0.2.10").packed, ipaddress.ip_address("2001:db8::7").packed
    good = [
        ("no verdict, no caps", [1700000000.5, ip4, 7400], 2, None),
        ("public", [1700000000.5, ip4, 7400, 0], 0, None),
        ("ipv6, symmetric NAT", [1700000000.5, ip6, 7400, 3], 3, None),
        ("upload cap 2.5 MB/s, reach unknown written out", [1700000000.5, ip4, 7400, 2, [2500000, 0]], 2,
         [2500000, 0]),
        ("both caps, cone NAT", [1700000000.5, ip4, 7400, 1, [2500000, 6250000]], 1, [2500000, 6250000]),
    ]
    bad = [
        ("cap without two elements", [1700000000.5, ip4, 7400, 2, [2500000]]),
        ("negative cap", [1700000000.5, ip4, 7400, 2, [-1, 0]]),
        ("cap above 2**40", [1700000000.5, ip4, 7400, 2, [0, 2**40 + 1]]),
        ("float cap", [1700000000.5, ip4, 7400, 2, [2.5e6, 0]]),
        ("six elements", [1700000000.5, ip4, 7400, 2, [1, 1], 0]),
        ("reach out of range", [1700000000.5, ip4, 7400, 4]),
    ]
    return {
        "description": "Matchmaking record values: msgpack [expiry: float64, ip: bin[4|16], port, reach?, "
        "cap?: [up, down]]; reach absent = 2 (unknown); cap rates in bytes/s on the wire, 0 = none, at most 2**40.",
        "good": [{"name": n, "value": hx(msgpack.packb(v, use_bin_type=True)), "reach": r, "cap": c}
                 for n, v, r, c in good],
        "malformed": [{"name": n, "value": hx(msgpack.packb(v, use_bin_type=True))} for n, v in bad],
    }


def message_vectors() -> dict:
    sealer = Sealer(SWARM_SECRET, token=TOKEN)
    out = []
    for seq, (name, mtype, body) in enumerate(control_messages(), start=1):
        raw = m.encode(mtype, body)
        datagram = sealer.seal(mtype, raw, RECEIVER)
        assert datagram[HEADER_SIZE - 8 : HEADER_SIZE] == seq.to_bytes(8, "big")
        out.append(
            {
                "name": name,
                "type": int(mtype),
                "type_name": mtype.name,
                "seq": seq,
                "fields": jsonable(m.decode(mtype, raw)),
                "msgpack": wire_json(body),
                "body": hx(raw),
                "datagram": hx(datagram),
            }
        )
    high_seq = 2**32 + 5
    ping = m.encode(m.MsgType.PING, {"rid": 7, "from": from_field(IDENT_A, TOKEN, None)})
    return {
        "description": "Every control message type: msgpack body and the whole sealed datagram. One Sealer "
        "(token below) sealed them in this order for the receiver below (AAD = header || receiver node id), "
        "so entry i has sequence number i. 'high_sequence' and 'no_receiver' are PINGs sealed apart.",
        "swarm_secret": hx(SWARM_SECRET),
        "token": tok(TOKEN),
        "sender_seed": hx(SEED_A),
        "receiver_seed": hx(SEED_B),
        "receiver": hx(RECEIVER),
        "messages": out,
        "high_sequence": {
            "description": "A PING sealed at a sequence number above 2**32 (nonce layout check).",
            "type": int(m.MsgType.PING),
            "seq": high_seq,
            "body": hx(ping),
            "datagram": hx(seal_at(SWARM_SECRET, TOKEN, high_seq, m.MsgType.PING, ping)),
        },
        "no_receiver": {
            "description": "A PING sealed for no receiver (flags 0x03, AAD = the header alone), as sent to a "
            "bootstrap address whose node id is unknown; any member opens it.",
            "type": int(m.MsgType.PING),
            "seq": 3,
            "body": hx(ping),
            "datagram": hx(seal_at(SWARM_SECRET, TOKEN, 3, m.MsgType.PING, ping, receiver=None)),
        },
    }


def insecure_vectors() -> dict:
    sealer = Sealer(None, token=TOKEN)
    out = []
    for seq, (name, mtype, body) in enumerate(control_messages()[:4], start=1):
        raw = m.encode(mtype, body)
        datagram = sealer.seal(mtype, raw, RECEIVER)
        out.append({"name": name, "type": int(mtype), "seq": seq, "body": hx(raw), "datagram": hx(datagram)})
    return {
        "description": "--insecure mode (benchmarks only): flags bit 0 clear, no AEAD, the body follows the "
        "header in the clear. Sealed in this order by one insecure Sealer with the token below.",
        "token": tok(TOKEN),
        "datagrams": out,
    }


def replay_vectors() -> dict:
    w = DEFAULT_WINDOW
    # fmt: off
    stream = [
        5, 5, 1, 2, 3, 4, 3, 7, 6, 6, 8,  # in order, reordered, duplicates
        100, 99, 50, 100,  # jumps and fill-in
        100 + w - 1, 100, 101,  # 100 is still inside the window (offset w-1) but seen; 101 was never seen
        100 + w, 100, 101, 102,  # 100 is now at offset w: too old; 101 (offset w-1) seen; 102 new
        102 + 3 * w, 103 + 2 * w, 102 + 2 * w + 1, 102 + 2 * w + 2, 102 + 3 * w - 1,  # a jump of several windows
        2**64 - 1, 2**64 - 2, 2**64 - 1 - w, 2**64 - w,  # the top of the sequence space
    ]
    # fmt: on
    win = ReplayWindow(w)
    out = []
    for seq in stream:
        ok = win.would_accept(seq)
        if ok:
            win.accept(seq)
        out.append([seq, ok])
    return {
        "description": "Replay window of one token (size 8192, RFC 4303 style). Feed 'stream' in order to a "
        "fresh window; each entry is [sequence, accepted]. Accepted sequences are recorded.",
        "window": w,
        "stream": out,
    }


def _pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def invalid_vectors() -> dict:
    ping = m.encode(m.MsgType.PING, {"rid": 1, "from": from_field(IDENT_A, TOKEN, None)})
    good = seal_at(SWARM_SECRET, TOKEN, 10, m.MsgType.PING, ping)

    def flip(b: bytes, i: int) -> bytes:
        return b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1 :]

    datagrams: list[tuple[str, str, list[bytes], bytes, str]] = [
        ("wrong swarm secret", "sealed", [], seal_at(OTHER_SECRET, TOKEN, 10, 1, ping), "auth"),
        ("unsealed datagram to a sealed node", "sealed", [], seal_at(None, TOKEN, 10, 1, ping), "auth"),
        ("sealed datagram to an --insecure node", "insecure", [], good, "auth"),
        ("body byte flipped", "sealed", [], flip(good, HEADER_SIZE + 3), "auth"),
        ("tag byte flipped", "sealed", [], flip(good, len(good) - 1), "auth"),
        ("type byte changed (header is AAD)", "sealed", [], good[:3] + b"\x02" + good[4:], "auth"),
        ("token changed", "sealed", [], flip(good, 12), "auth"),
        ("sequence changed", "sealed", [], flip(good, HEADER_SIZE - 1), "auth"),
        ("sealed flag set, no AEAD applied", "sealed", [], seal_at(None, TOKEN, 10, 1, ping, FLAG_SEALED), "auth"),
        ("truncated: header + 15 bytes", "sealed", [], good[: HEADER_SIZE + 15], "malformed"),
        ("truncated: last byte missing", "sealed", [], good[:-1], "auth"),
        ("truncated: header only", "sealed", [], good[:HEADER_SIZE], "malformed"),
        ("truncated: 20 bytes", "sealed", [], good[:20], "malformed"),
        ("version 1", "sealed", [], good[:2] + b"\x01" + good[3:], "version"),
        ("reserved flag", "sealed", [], good[:4] + b"\x05" + good[5:], "malformed"),
        ("sealed for another receiver (C)", "sealed", [],
         seal_at(SWARM_SECRET, TOKEN, 10, 1, ping, receiver=IDENT_C.node_id), "auth"),
        ("sealed for B, no-receiver flag set", "sealed", [], good[:4] + b"\x03" + good[5:], "auth"),
        ("sealed for no receiver, flag clear", "sealed", [],
         seal_at(SWARM_SECRET, TOKEN, 10, 1, ping, flags=FLAG_SEALED, receiver=None), "auth"),
        ("no-receiver flag on a FIND_NODE", "sealed", [],
         seal_at(SWARM_SECRET, TOKEN, 10, 3, ping, receiver=None), "malformed"),
        ("exact replay", "sealed", [good], good, "replay"),
        (
            "older than the window",
            "sealed",
            [seal_at(SWARM_SECRET, TOKEN, 10 + DEFAULT_WINDOW, 1, ping)],
            good,
            "replay",
        ),
    ]
    ok_cases = [
        (
            "oldest sequence still inside the window",
            "sealed",
            [seal_at(SWARM_SECRET, TOKEN, 9 + DEFAULT_WINDOW, 1, ping)],
            good,
        ),
        ("reordered: a lower sequence after a higher one", "sealed", [seal_at(SWARM_SECRET, TOKEN, 11, 1, ping)], good),
        ("same sequence under another token", "sealed", [seal_at(SWARM_SECRET, TOKEN + 1, 10, 1, ping)], good),
        ("insecure", "insecure", [], seal_at(None, TOKEN, 10, 1, ping)),
        ("a PING sealed for no receiver", "sealed", [], seal_at(SWARM_SECRET, TOKEN, 10, 1, ping, receiver=None)),
    ]

    frm = BINDING_A.sender()
    rec = records()[0]
    contact = contacts()[0]
    P = int(m.MsgType.PING)
    bodies: list[tuple[str, int, bytes, str]] = [
        ("unknown type 0x00", 0x00, ping, "type"),
        ("unassigned control type 0x09", 0x09, ping, "type"),
        ("reserved control type 0x3f", 0x3F, ping, "type"),
        ("tensor type 0x40 is not a control message", 0x40, ping, "type"),
        ("empty body", P, b"", "malformed"),
        ("not msgpack (0xc1)", P, b"\xc1", "malformed"),
        ("truncated msgpack", P, ping[:-1], "malformed"),
        ("trailing byte after the map", P, ping + b"\x00", "malformed"),
        ("array instead of map", P, _pack([1, frm]), "malformed"),
        ("missing key", P, _pack({"rid": 1}), "malformed"),
        ("unknown extra key", P, _pack({"rid": 1, "from": frm, "x": 0}), "malformed"),
        ("bin map key", P, _pack({b"rid": 1, "from": frm}), "malformed"),
        ("integer map key", P, _pack({1: 1, "from": frm}), "malformed"),
        ("rid negative", P, _pack({"rid": -1, "from": frm}), "malformed"),
        ("rid as string", P, _pack({"rid": "1", "from": frm}), "malformed"),
        ("rid as float", P, _pack({"rid": 1.0, "from": frm}), "malformed"),
        ("rid as bool", P, _pack({"rid": True, "from": frm}), "malformed"),
        ("pk of 31 bytes", P, _pack({"rid": 1, "from": {**frm, "pk": frm["pk"][:31]}}), "malformed"),
        ("pk as str", P, _pack({"rid": 1, "from": {**frm, "pk": "x" * 32}}), "malformed"),
        ("sig of 65 bytes", P, _pack({"rid": 1, "from": {**frm, "sig": frm["sig"] + b"\0"}}), "malformed"),
        ("from without addr", P, _pack({"rid": 1, "from": {"pk": frm["pk"], "sig": frm["sig"]}}), "malformed"),
        ("sig of 64 bytes (no nonce)", P, _pack({"rid": 1, "from": {**frm, "sig": frm["sig"][8:]}}), "malformed"),
        ("addr of 5 bytes", P, _pack({"rid": 1, "from": {**frm, "addr": [b"\x01" * 5, 7400]}}), "malformed"),
        ("addr as text", P, _pack({"rid": 1, "from": {**frm, "addr": ["192.0.2.1", 7400]}}), "malformed"),
        ("port 0", P, _pack({"rid": 1, "from": {**frm, "addr": [b"\xc0\x00\x02\x01", 0]}}), "malformed"),
        ("port 65536", P, _pack({"rid": 1, "from": {**frm, "addr": [b"\xc0\x00\x02\x01", 65536]}}), "malformed"),
        ("addr with 3 items", P, _pack({"rid": 1, "from": {**frm, "addr": [b"\xc0\x00\x02\x01", 1, 1]}}), "malformed"),
        (
            "target of 33 bytes",
            int(m.MsgType.FIND_NODE),
            _pack({"rid": 1, "from": frm, "target": bytes(33)}),
            "malformed",
        ),
        (
            "MM_BEGIN member of 5 items",
            int(m.MsgType.MM_BEGIN),
            _pack({"rid": 1, "from": frm, "run": "demo", "round": 1, "group": 1,
                   "members": [[frm["pk"], b"\xc0\x00\x02\x01", 7411, True, True]]}),
            "malformed",
        ),
        (
            "MM_BEGIN capped flag as int",
            int(m.MsgType.MM_BEGIN),
            _pack({"rid": 1, "from": frm, "run": "demo", "round": 1, "group": 1,
                   "members": [[frm["pk"], b"\xc0\x00\x02\x01", 7411, 1]]}),
            "malformed",
        ),
        (
            "21 contacts",
            int(m.MsgType.NODES),
            _pack({"rid": 1, "from": frm, "nodes": [contact] * 21}),
            "malformed",
        ),
        (
            "contact id of 20 bytes",
            int(m.MsgType.NODES),
            _pack({"rid": 1, "from": frm, "nodes": [[bytes(20), contact[1], contact[2]]]}),
            "malformed",
        ),
        ("empty key", int(m.MsgType.FIND_VALUE), _pack({"rid": 1, "from": frm, "key": b"", "offset": 0}), "malformed"),
        (
            "key of 129 bytes",
            int(m.MsgType.FIND_VALUE),
            _pack({"rid": 1, "from": frm, "key": b"k" * 129, "offset": 0}),
            "malformed",
        ),
        (
            "offset 65536",
            int(m.MsgType.FIND_VALUE),
            _pack({"rid": 1, "from": frm, "key": b"k", "offset": 65536}),
            "malformed",
        ),
        ("17 records", int(m.MsgType.STORE), _pack({"rid": 1, "from": frm, "records": [rec] * 17}), "malformed"),
        (
            "record value of 641 bytes",
            int(m.MsgType.STORE),
            _pack({"rid": 1, "from": frm, "records": [rec[:2] + [b"v" * 641] + rec[3:]]}),
            "malformed",
        ),
        (
            "record subkey of 65 bytes",
            int(m.MsgType.STORE),
            _pack({"rid": 1, "from": frm, "records": [rec[:1] + [b"s" * 65] + rec[2:]]}),
            "malformed",
        ),
        (
            "record ttl above 86400",
            int(m.MsgType.STORE),
            _pack({"rid": 1, "from": frm, "records": [rec[:4] + [86400.5] + rec[5:]]}),
            "malformed",
        ),
        (
            "record ttl negative",
            int(m.MsgType.STORE),
            _pack({"rid": 1, "from": frm, "records": [rec[:4] + [-1.0] + rec[5:]]}),
            "malformed",
        ),
        (
            "record expires NaN",
            int(m.MsgType.STORE),
            _pack({"rid": 1, "from": frm, "records": [rec[:3] + [float("nan")] + rec[4:]]}),
            "malformed",
        ),
        (
            "record expires above 1e12",
            int(m.MsgType.STORE),
            _pack({"rid": 1, "from": frm, "records": [rec[:3] + [1.5e12] + rec[4:]]}),
            "malformed",
        ),
        (
            "record with 6 items",
            int(m.MsgType.STORE),
            _pack({"rid": 1, "from": frm, "records": [rec[:6]]}),
            "malformed",
        ),
        (
            "total as negative",
            int(m.MsgType.VALUE),
            _pack({"rid": 1, "from": frm, "records": [], "total": -1, "nodes": []}),
            "malformed",
        ),
        ("ok as integers", int(m.MsgType.STORED), _pack({"rid": 1, "from": frm, "ok": [1, 0]}), "malformed"),
        (
            "error code of 33 characters",
            int(m.MsgType.ERROR),
            _pack({"rid": 1, "from": frm, "code": "c" * 33, "detail": ""}),
            "malformed",
        ),
        (
            "error detail as bin",
            int(m.MsgType.ERROR),
            _pack({"rid": 1, "from": frm, "code": "busy", "detail": b"x"}),
            "malformed",
        ),
        (
            "invalid UTF-8 in a str",
            int(m.MsgType.ERROR),
            _pack({"rid": 1, "from": frm, "code": "busy", "detail": ""})[:-1] + b"\xa1\xff",
            "malformed",
        ),
        ("ext type", P, _pack({"rid": msgpack.ExtType(1, b"\x01"), "from": frm}), "malformed"),
        # NAT traversal (section 18)
        ("observed without seen", int(m.MsgType.OBSERVED), _pack({"rid": 1, "from": frm}), "malformed"),
        ("observed seen unspecified", int(m.MsgType.OBSERVED),
         _pack({"rid": 1, "from": frm, "seen": [bytes(4), 7000]}), "malformed"),
        ("observed seen port 0", int(m.MsgType.OBSERVED),
         _pack({"rid": 1, "from": frm, "seen": [bytes([198, 51, 100, 7]), 0]}), "malformed"),
        ("reach_probe short nonce", int(m.MsgType.REACH_PROBE),
         _pack({"rid": 1, "from": frm, "nonce": bytes(15), "avoid": []}), "malformed"),
        ("reach_probe 17 avoided", int(m.MsgType.REACH_PROBE),
         _pack({"rid": 1, "from": frm, "nonce": NAT_NONCE, "avoid": [bytes(32)] * 17}), "malformed"),
        ("probe_ask multicast target", int(m.MsgType.PROBE_ASK),
         _pack({"rid": 1, "from": frm, "target": [bytes(32), bytes([224, 0, 0, 1]), 7000], "nonce": NAT_NONCE}),
         "malformed"),
        ("intro target of 31 bytes", int(m.MsgType.INTRO), _pack({"rid": 1, "from": frm, "target": bytes(31)}),
         "malformed"),
        ("connect without peer", int(m.MsgType.CONNECT), _pack({"rid": 1, "from": frm, "peer": None}), "malformed"),
        ("relay data shorter than a sealed datagram", int(m.MsgType.RELAY),
         _pack({"rid": 1, "from": frm, "to": bytes(32), "data": bytes(36)}), "malformed"),
        ("relay data over 4096 bytes", int(m.MsgType.RELAY),
         _pack({"rid": 1, "from": frm, "to": bytes(32), "data": bytes(4097)}), "malformed"),
        ("relayed data as str", int(m.MsgType.RELAYED),
         _pack({"rid": 1, "from": frm, "src": bytes(32), "data": "x" * 40}), "malformed"),
    ]
    # Self-check: every case fails (or passes) exactly as documented.
    for name, mode, prior, dgram, reason in datagrams:
        opener = Opener(SWARM_SECRET if mode == "sealed" else None, RECEIVER)
        for p in prior:
            opener.open(p)
        try:
            opener.open(dgram)
        except WireError as e:
            assert e.reason == reason, (name, e)
        else:
            raise AssertionError(f"datagram vector {name!r} was accepted")
    for _name, mode, prior, dgram in ok_cases:
        opener = Opener(SWARM_SECRET if mode == "sealed" else None, RECEIVER)
        for p in prior:
            opener.open(p)
        opener.open(dgram)
    for name, mtype, body, reason in bodies:
        try:
            m.decode(mtype, body)
        except WireError as e:
            assert e.reason == reason, (name, e)
        else:
            raise AssertionError(f"body vector {name!r} was accepted")
    return {
        "description": "Input that must be dropped, with the drop reason. 'datagrams' go through an opener "
        "(mode 'sealed': swarm_secret below; 'insecure': no secret), run by the receiver below (B), after the "
        "'prior' datagrams were "
        "opened successfully by the same opener; 'accepted' lists datagrams that must open. 'bodies' "
        "are control message bodies for messages.decode(type, body).",
        "swarm_secret": hx(SWARM_SECRET),
        "receiver": hx(RECEIVER),
        "datagrams": [
            {"name": n, "mode": mo, "prior": [hx(p) for p in pr], "datagram": hx(d), "reason": r}
            for n, mo, pr, d, r in datagrams
        ],
        "accepted": [
            {"name": n, "mode": mo, "prior": [hx(p) for p in pr], "datagram": hx(d)} for n, mo, pr, d in ok_cases
        ],
        "bodies": [{"name": n, "type": t, "body": hx(b), "reason": r} for n, t, b, r in bodies],
    }


GENERATORS = {
    "envelope.json": envelope_vectors,
    "kdf.json": kdf_vectors,
    "identity.json": identity_vectors,
    "records.json": record_vectors,
    "announce.json": announce_vectors,
    "messages.json": message_vectors,
    "insecure.json": insecure_vectors,
    "replay.json": replay_vectors,
    "invalid.json": invalid_vectors,
}


def render(obj: dict) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=False, allow_nan=False) + "\n"


def build() -> dict[str, str]:
    return {name: render(gen()) for name, gen in GENERATORS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the checked-in files, write nothing")
    args = ap.parse_args(argv)
    files = build()
    if args.check:
        stale = [n for n, text in files.items() if not (VECTORS / n).is_file() or (VECTORS / n).read_text() != text]
        for n in stale:
            print(f"stale: protocol/vectors/{n} (run python protocol/make_vectors.py)", file=sys.stderr)
        return 1 if stale else 0
    VECTORS.mkdir(parents=True, exist_ok=True)
    for n, text in files.items():
        (VECTORS / n).write_text(text, encoding="utf-8")
        print(f"wrote protocol/vectors/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
