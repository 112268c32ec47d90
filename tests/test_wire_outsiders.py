"""What an outsider (no swarm key) can do to the sealed wire (issue 12): replay a datagram sealed for one
receiver to another, reflect responses at a victim, burn CPU with forged tokens, and outlive a sealer."""

from __future__ import annotations

import trio
import trio.testing

from peerd.metrics import Metrics
from peerd.transport.endpoint import Endpoint
from peerd.wire import Identity, Opener, Sealer, WireError
from peerd.wire import messages as m

from .memnet import MemNet

SECRET = bytes(range(32))
VICTIM = ("127.0.0.1", 9)


def counter_value(counter, **labels) -> float:
    return sum(s.value for mm in counter.collect() for s in mm.samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def run_virtual(fn) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


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

    async def main() -> None:
        net = MemNet()
        net.captured = []
        a, b, c = (node(net, i) for i in range(3))
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
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
            nursery.cancel_scope.cancel()

    run_virtual(main)


def test_a_request_to_an_unknown_address_pings_it_first() -> None:
    """Only a PING may be sealed for no receiver: a FIND_NODE to an address whose node is unknown is sent
    after a PING learned who is there, and sealed for that node."""

    async def main() -> None:
        net = MemNet()
        net.captured = []
        a, b = node(net, 0), node(net, 1)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            for ep in (a, b):
                nursery.start_soon(ep.serve)
            await a.request(b.sock.addr, m.MsgType.FIND_NODE, {"target": bytes(32)})
            types = [(d[3], d[4]) for s, _, d in net.captured if s == a.sock.addr]
            assert types == [(0x01, 0x03), (0x03, 0x01)]  # PING for no receiver, then FIND_NODE for B
            assert a.node_id_at(b.sock.addr) == b.identity.node_id
            assert b.node_id_at(a.sock.addr) == a.identity.node_id  # learned from the FIND_NODE, not the PING
            nursery.cancel_scope.cancel()

    run_virtual(main)


