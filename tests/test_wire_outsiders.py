"""What an outsider (no swarm key) can do to the sealed wire (issue 12): replay a datagram sealed for one
receiver to another, reflect responses at a victim, burn CPU with forged tokens, and outlive a sealer."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from peerd.metrics import Metrics
from peerd.transport.endpoint import Endpoint
from peerd.transport.guard import AmplificationGuard, AuthLimiter
from peerd.wire import Header, Identity, Opener, Sealer, WireError
from peerd.wire import messages as m
from peerd.wire import seal as seal_module

from .support.memnet import MemNet, run_on_memnet
from .support.virtual import counter_value  # noqa: E402

SECRET = bytes(range(32))
VICTIM = ("127.0.0.1", 9)






def node(net: MemNet, i: int) -> Endpoint:
    ep = Endpoint(net.socket("127.0.0.1", 20000 + i), Identity.generate(), SECRET, Metrics())
    contacts = [m.pack_contact(bytes([k]) * 32, "127.0.0.1", 30000 + k) for k in range(20)]
    ep.on_request(m.MsgType.PING, lambda inc: {})
    ep.on_request(m.MsgType.FIND_NODE, lambda inc: {"nodes": contacts})  # a NODES about 5x the request
    return ep


def sent_to(net: MemNet, dst: tuple[str, int]) -> list[bytes]:
    assert net.captured is not None
    return [d for _, to, d in net.captured if to == dst]


# ---- 1: a datagram sealed for one receiver opens at no other ------------------------------------------------


def test_sealed_for_one_receiver_only() -> None:
    a, b, c = (Identity.generate() for _ in range(3))
    sealer = Sealer(SECRET)
    to_b = sealer.seal(m.MsgType.FIND_NODE, b"body", b.node_id)
    assert Opener(SECRET, b.node_id).open(to_b)[1] == b"body"
    for opener in (Opener(SECRET, c.node_id), Opener(SECRET, a.node_id), Opener(SECRET)):
        try:
            opener.open(to_b)
        except WireError as e:
            assert e.reason == "auth"
        else:
            raise AssertionError("a datagram sealed for B opened elsewhere")
    ping = sealer.seal(m.MsgType.PING, b"hello")  # the one type that may go to an unknown node
    assert Opener(SECRET, c.node_id).open(ping)[1] == b"hello"


def test_cross_receiver_replay_is_refused_and_counted() -> None:
    """A's FIND_NODE to B, captured on path and replayed to C (and to B) from a spoofed source, gets no
    answer anywhere: C cannot open it (auth), B has seen it (replay)."""

    async def main(net: Any, nursery: trio.Nursery) -> None:
        net.captured = []
        a, b, c = (node(net, i) for i in range(3))
        for ep in (a, b, c):
            nursery.start_soon(ep.serve)
        await c.request(b.sock.addr, m.MsgType.PING, {})  # C is a member B knows: nothing is unknown
        reply = await a.request(b.sock.addr, m.MsgType.FIND_NODE, {"target": bytes(32)})
        assert len(reply.body["nodes"]) == 20
        find = [d for s, to, d in net.captured if s == a.sock.addr and to == b.sock.addr and d[3] == 0x03]
        assert len(find) == 1
        auth, replay = (counter_value(ep.metrics.datagrams_dropped, reason=r) for ep, r in ((c, "auth"),
                                                                                           (b, "replay")))
        net.deliver(VICTIM, c.sock.addr, find[0])
        net.deliver(VICTIM, b.sock.addr, find[0])
        await trio.sleep(1.0)
        assert counter_value(c.metrics.datagrams_dropped, reason="auth") == auth + 1
        assert counter_value(b.metrics.datagrams_dropped, reason="replay") == replay + 1
        assert sent_to(net, VICTIM) == []

    run_on_memnet(main)


def test_a_request_to_an_unknown_address_pings_it_first() -> None:
    """Only a PING may be sealed for no receiver: a FIND_NODE to an address whose node is unknown is sent
    after a PING learned who is there, and sealed for that node."""

    async def main(net: Any, nursery: trio.Nursery) -> None:
        net.captured = []
        a, b = node(net, 0), node(net, 1)
        for ep in (a, b):
            nursery.start_soon(ep.serve)
        await a.request(b.sock.addr, m.MsgType.FIND_NODE, {"target": bytes(32)})
        types = [(d[3], d[4]) for s, _, d in net.captured if s == a.sock.addr]
        # PING for no receiver, FIND_NODE for B, then the PONG to B's PING that validated A's address
        assert types == [(0x01, 0x03), (0x03, 0x01), (0x02, 0x01)]
        assert a.node_id_at(b.sock.addr) == b.identity.node_id
        assert b.node_id_at(a.sock.addr) == a.identity.node_id  # learned from the FIND_NODE, not the PING

    run_on_memnet(main)




# ---- 3: what a forged datagram costs before it fails ---------------------------------------------------------


def test_auth_limiter_per_source_and_per_node() -> None:
    lim = AuthLimiter(failure_rate=10.0, failure_burst=5, derive_rate=100.0, derive_burst=20)
    src, other = ("192.0.2.1", 1), ("192.0.2.2", 1)
    for _ in range(5):
        assert lim.may_derive(src, 0.0)
        lim.failed(src, 1, 0.0)
    assert not lim.may_derive(src, 0.0)  # its failures are spent: no crypto for its unknown tokens
    assert lim.may_derive(other, 0.0)  # another source is not
    assert lim.may_derive(src, 0.125)  # one failure's worth refilled after 0.125 s
    lim.failed(src, 1, 0.125)
    assert not lim.may_derive(src, 0.125)
    # the node's derivations: 20 at once whatever the (spoofable) source, then 100 a second
    fresh = AuthLimiter(derive_rate=100.0, derive_burst=20)
    assert sum(fresh.may_derive(("198.51.100.1", i), 5.0) for i in range(50)) == 20
    assert sum(fresh.may_derive(("198.51.100.1", i), 5.125) for i in range(50)) == 12


def test_opener_asks_before_deriving_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    derived = []
    real = seal_module.derive_key
    monkeypatch.setattr(seal_module, "derive_key", lambda s, t: derived.append(t) or real(s, t))
    opener = Opener(SECRET, bytes(32))
    forged = Header(0x03, 1, 0xBAD, 1).pack() + bytes(100)
    with pytest.raises(WireError) as e:
        opener.open(forged, lambda: False)
    assert e.value.reason == "auth_limited" and derived == []
    with pytest.raises(WireError) as e:
        opener.open(forged, lambda: True)
    assert e.value.reason == "auth" and derived == [0xBAD]
    known = Sealer(SECRET)
    opener.open(known.seal(m.MsgType.PING, b""))
    opener.open(known.seal(m.MsgType.FIND_NODE, b"x", bytes(32)), lambda: False)  # a known token: never asked


def test_a_flood_of_random_tokens_costs_a_bounded_number_of_key_derivations() -> None:
    async def main(net: Any, nursery: trio.Nursery) -> None:
        a, b = node(net, 0), node(net, 1)
        attacker = ("192.0.2.66", 4444)
        rng = random.Random(5)
        for ep in (a, b):
            nursery.start_soon(ep.serve)
        for _ in range(500):
            forged = Header(0x03, 1, rng.getrandbits(64), rng.getrandbits(64)).pack() + rng.randbytes(200)
            net.deliver(attacker, b.sock.addr, forged)
        await trio.sleep(0.5)
        auth = counter_value(b.metrics.datagrams_dropped, reason="auth")
        limited = counter_value(b.metrics.datagrams_dropped, reason="auth_limited")
        assert auth + limited == 500
        assert auth <= b.auth_limiter.failure_burst + 10  # a burst, then 10 a second (0.5 s of protocol time)
        await a.request(b.sock.addr, m.MsgType.FIND_NODE, {"target": bytes(32)})  # members are still served

    run_on_memnet(main)


def test_a_block_whose_every_row_fails_leaves_the_token_order_alone() -> None:
    me = bytes(32)
    opener = Opener(SECRET, me, max_tokens=2)
    old, new = Sealer(SECRET), Sealer(SECRET)
    opener.open(old.seal(0x40, b"a" * 40, me))
    opener.open(new.seal(0x40, b"b" * 40, me))  # ``old`` is now the least recently used
    block = old.seal_block(0x40, np.zeros((4, 40), np.uint8), me)
    block[:, -1] ^= 1  # every tag broken: what an outsider replaying ``old``'s header with junk makes
    opened = opener.open_block(block)
    assert opened is not None and opened.auth_failures == 4 and len(opened.bodies) == 0
    opener.open(Sealer(SECRET).seal(0x40, b"c" * 40, me))  # a third token evicts the least recently used
    assert opener.token_state(old.token) is None and opener.token_state(new.token) is not None


def test_a_merged_run_of_junk_is_refused_at_once_as_each_row_would_be() -> None:
    """A receive block whose rows share one header up to the token (one forger's run under a token the node has no
    key for): refused together for the reason each row would get (``auth_limited`` once its source is out of
    failures, ``malformed`` for a bad header), without a round of ``_datagram`` per row; rows with different
    headers, and a member's block under a known token, still go row by row."""
    net = MemNet()
    ep = node(net, 0)
    calls: list[int] = []
    datagram = ep._datagram

    def counting(data, source, now):  # type: ignore[no-untyped-def]
        calls.append(len(data))
        datagram(data, source, now)

    ep._datagram = counting  # type: ignore[method-assign]
    forger = ("192.0.2.7", 7)
    ep.auth_limiter.failed(forger, 100, 0.0)  # out of failures
    junk = Header(0x03, 1, 0xDEAD, 0).pack()[:13]
    rows = [junk + bytes([i]) * 8 + bytes(40) for i in range(6)]  # same size, sequence and body differ
    ep.receive_batch([(b"".join(rows), forger, len(rows[0]))], 0.0)
    assert calls == [] and ep.core.receiving.drops.get("auth_limited") == 6
    bad = [b"PD\xff" + row[3:] for row in rows[:3]]  # another version: refused as each row would be
    ep.receive_batch([(b"".join(bad), forger, len(bad[0]))], 0.0)
    assert calls == [] and ep.core.receiving.drops.get("version") == 3
    mixed = [rows[0], Header(0x03, 1, 0xBEEF, 0).pack()[:13] + rows[1][13:]]  # two tokens: row by row
    ep.receive_batch([(b"".join(mixed), forger, len(mixed[0]))], 0.0)
    assert len(calls) == 2 and ep.core.receiving.drops.get("auth_limited") == 8
    member = Sealer(SECRET)
    to = ep.identity.node_id
    known = [member.seal(0x03, bytes(40), to) for _ in range(2)]
    ep.opener.open(known[0])  # the token is known now (its replayed datagram is a row like any)
    ep.receive_batch([(b"".join(known), forger, len(known[0]))], 0.0)
    assert len(calls) == 4  # a known token: opened row by row (no block handler for this type)


# ---- 2: no more than 3x the bytes to an address that has not proven it is there ------------------------------


def test_a_reflection_gets_at_most_three_times_its_bytes() -> None:
    """A's FIND_NODE to B, captured while B was down, is replayed from the victim's address once B is back
    (restarted, same identity: a fresh replay window opens it). B's NODES is ~5x the request: the victim gets
    only B's small validating PING, which it cannot answer."""

    async def main(net: Any, nursery: trio.Nursery) -> None:
        net.captured = []
        a, b = node(net, 0), node(net, 1)
        nursery.start_soon(a.serve)
        a.learn(b.sock.addr, b.identity.node_id)  # from a DHT contact
        with trio.move_on_after(0.1):
            await a.request(b.sock.addr, m.MsgType.FIND_NODE, {"target": bytes(32)}, attempts=1)
        request = [d for s, to, d in net.captured if s == a.sock.addr and to == b.sock.addr][0]
        b2 = Endpoint(net.socket(*b.sock.addr), b.identity, SECRET, Metrics())
        b2.on_request(m.MsgType.FIND_NODE, lambda inc: {"nodes": [m.pack_contact(bytes([k]) * 32, "127.0.0.1",
                                                                                  30000 + k) for k in range(20)]})
        nursery.start_soon(b2.serve)
        await trio.sleep(0.01)
        net.deliver(VICTIM, b.sock.addr, request)
        await trio.sleep(2.0)
        reflected = sum(map(len, sent_to(net, VICTIM)))
        assert 0 < reflected <= 3 * len(request), (reflected, len(request))
        assert counter_value(b2.metrics.datagrams_dropped, reason="unvalidated") == 1
        assert not b2.guard.is_validated(VICTIM)
        # A itself is answered in full: B's PING validates A's address, then the held NODES goes out
        reply = await a.request(b.sock.addr, m.MsgType.FIND_NODE, {"target": bytes(32)})
        assert len(reply.body["nodes"]) == 20 and b2.guard.is_validated(a.sock.addr)

    run_on_memnet(main)


def test_amplification_guard_budget() -> None:
    g = AmplificationGuard()
    addr = ("192.0.2.9", 9)
    assert g.allowance(addr) == 0 and not g.may_send(addr, 1)
    g.received(addr, 100)
    assert g.may_send(addr, 250) and not g.may_send(addr, 51) and g.may_send(addr, 50)
    g.received(addr, 10)
    assert g.allowance(addr) == 30
    g.validate(addr)
    assert g.allowance(addr) is None and g.may_send(addr, 10**6)


def test_a_lost_validating_pong_costs_a_retransmission_not_the_answer() -> None:
    """B's PING to A (or A's PONG) is lost: A's retransmitted request brings budget for another PING."""

    class LosePong(MemNet):
        lost = 0

        def deliver(self, src, dst, data) -> None:
            if data[3] == 0x02 and not self.lost:
                self.lost += 1
                return
            super().deliver(src, dst, data)

    async def main(net: Any, nursery: trio.Nursery) -> None:
        a, b = node(net, 0), node(net, 1)
        for ep in (a, b):
            nursery.start_soon(ep.serve)
        a.learn(b.sock.addr, b.identity.node_id)
        reply = await a.request(b.sock.addr, m.MsgType.FIND_NODE, {"target": bytes(32)})
        assert net.lost == 1 and len(reply.body["nodes"]) == 20  # (the retransmission's budget, or a new PING)

    run_on_memnet(main, net=LosePong())
