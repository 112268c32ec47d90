"""NAT traversal messages (PROTOCOL.md section 18): each codec round-trips, and hostile bodies are refused."""

from __future__ import annotations

import msgpack
import pytest

from peerd.wire import Identity
from peerd.wire import messages as m
from peerd.wire.errors import WireError
from peerd.wire.seal import Sealer

IDENT = Identity.from_seed(bytes(range(32)))
TOKEN = 0x0123456789ABCDEF
V6 = m.pack_addr("2001:db8::1", 65535)
FROM_V6 = IDENT.bind_token(nonce=bytes(8)).sender(V6)
NONCE = bytes(16)
NID = bytes(range(32))
RID = 2**64 - 1
T = m.MsgType

BODIES = {
    T.OBSERVE: {},
    T.OBSERVED: {"seen": V6},
    T.REACH_PROBE: {"nonce": NONCE, "avoid": [NID] * m.MAX_AVOID},
    T.REACH_PROBED: {"ok": False},
    T.PROBE_ASK: {"target": m.pack_contact(NID, "2001:db8::2", 1), "nonce": NONCE},
    T.PROBE: {"nonce": NONCE},
    T.INTRO: {"target": NID},
    T.INTRO_OK: {"peer": m.pack_contact(NID, "2001:db8::2", 1)},
    T.CONNECT: {"peer": m.pack_contact(NID, "2001:db8::2", 1)},
    T.RELAY: {"to": NID, "data": bytes(m.MIN_RELAYED)},
    T.RELAYED: {"src": NID, "data": bytes(m.MIN_RELAYED)},
}


def body(mtype: m.MsgType, **over) -> dict:
    return {"rid": RID, "from": FROM_V6, **BODIES[mtype], **over}


@pytest.mark.parametrize("mtype", list(BODIES), ids=lambda t: t.name)
def test_round_trip_and_fits_the_mtu(mtype: m.MsgType) -> None:
    data = m.encode(mtype, body(mtype))
    out = m.decode(mtype, data)
    assert out["rid"] == RID and out["from"]["addr"] == ("2001:db8::1", 65535)
    sealed = Sealer(b"k" * 32, TOKEN).overhead + len(data)
    assert sealed <= 1200, (mtype.name, sealed)  # the largest form (IPv6, all lists full) fits the default MTU


@pytest.mark.parametrize("mtype", list(BODIES), ids=lambda t: t.name)
def test_missing_and_unknown_keys_are_malformed(mtype: m.MsgType) -> None:
    full = body(mtype)
    for key in BODIES[mtype]:
        raw = msgpack.packb({k: v for k, v in full.items() if k != key}, use_bin_type=True)
        with pytest.raises(WireError, match="malformed"):
            m.decode(mtype, raw)
    with pytest.raises(WireError, match="malformed"):
        m.decode(mtype, msgpack.packb({**full, "extra": 1}, use_bin_type=True))


@pytest.mark.parametrize(
    ("mtype", "field", "value"),
    [
        (T.OBSERVED, "seen", [bytes(4), 1]),  # unspecified: would point a reply at the sender's own host
        (T.OBSERVED, "seen", [b"\xff" * 4, 1]),  # broadcast
        (T.OBSERVED, "seen", ["198.51.100.7", 1]),  # text, not bin
        (T.REACH_PROBE, "avoid", [NID] * (m.MAX_AVOID + 1)),
        (T.REACH_PROBE, "nonce", bytes(17)),
        (T.PROBE_ASK, "target", [NID, bytes([239, 1, 1, 1]), 9]),  # multicast: a probe to many hosts
        (T.PROBE_ASK, "target", [NID, bytes([198, 51, 100, 7]), 65536]),
        (T.PROBE, "nonce", "x" * 16),
        (T.INTRO, "target", bytes(33)),
        (T.INTRO_OK, "peer", [NID, bytes(16), 7]),  # ::
        (T.CONNECT, "peer", [NID, bytes([198, 51, 100, 7])]),
        (T.RELAY, "data", bytes(m.MIN_RELAYED - 1)),
        (T.RELAY, "data", bytes(m.MAX_RELAYED + 1)),
        (T.RELAY, "to", bytes(31)),
        (T.RELAYED, "src", None),
        (T.REACH_PROBED, "ok", 1),
    ],
)
def test_hostile_values_are_malformed(mtype: m.MsgType, field: str, value: object) -> None:
    raw = msgpack.packb(body(mtype, **{field: value}), use_bin_type=True)
    with pytest.raises(WireError) as e:
        m.decode(mtype, raw)
    assert e.value.reason == "malformed"
    with pytest.raises(WireError):  # and the encoder refuses to send it
        m.encode(mtype, body(mtype, **{field: value}))


def test_requests_and_one_way_messages() -> None:
    assert m.REQUESTS[T.OBSERVE] is T.OBSERVED
    assert m.REQUESTS[T.REACH_PROBE] is T.REACH_PROBED
    assert m.REQUESTS[T.INTRO] is T.INTRO_OK
    for one_way in (T.PROBE_ASK, T.PROBE, T.CONNECT, T.RELAY, T.RELAYED):
        assert one_way not in m.REQUESTS
    assert all(0x20 <= t <= 0x2F for t in BODIES)


def test_relay_overhead_leaves_room_for_control_messages() -> None:
    """A RELAY of an inner datagram costs a bounded overhead: what the endpoint subtracts from the MTU."""
    inner = 900
    data = m.encode(T.RELAY, body(T.RELAY, data=bytes(inner)))
    overhead = Sealer(b"k" * 32, TOKEN).overhead + len(data) - inner
    assert overhead <= m.RELAY_OVERHEAD
