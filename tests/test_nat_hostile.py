"""What a member can make a node do with NAT traversal messages (PROTOCOL.md 18): no probes, CONNECTs or relaying on
behalf of peers the node has not reached, no relaying by a node that is not public, no forged RELAYED senders."""

from __future__ import annotations

import random

import trio
import trio.testing

from peerd.metrics import Metrics
from peerd.nat.service import NatService
from peerd.transport import Endpoint
from peerd.wire import messages as m
from peerd.wire.identity import Identity

from .memnet import MemNet

SECRET = bytes(range(32))


def dropped(node, reason: str) -> float:
    return sum(s.value for mt in node.metrics.datagrams_dropped.collect() for s in mt.samples
               if s.name.endswith("_total") and s.labels.get("reason") == reason)


class Node:
    def __init__(self, net: MemNet, i: int) -> None:
        self.addr = (f"203.0.113.{i + 1}", 7000)
        self.metrics = Metrics()
        self.identity = Identity.from_seed(bytes([i + 1]) * 32)
        self.endpoint = Endpoint(net.socket(*self.addr), self.identity, SECRET, self.metrics, rng=random.Random(i))
        self.nat = NatService(self.endpoint, self.metrics, rng=random.Random(i))
        self.sent: list[tuple] = []
        inner = self.endpoint._send_datagram

        async def spy(addr, mtype, datagram, _inner=inner):
            self.sent.append((addr, int(mtype)))
            await _inner(addr, mtype, datagram)

        self.endpoint._send_datagram = spy  # type: ignore[method-assign]

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            await n.start(self.endpoint.serve)
            await n.start(self.nat.run)
            task_status.started()


def test_members_cannot_steer_probes_connects_or_relays() -> None:
    async def main() -> None:
        net = MemNet(seed=1, latency=0.002)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            a, b, c = (Node(net, i) for i in range(3))
            for n in (a, b, c):
                await nursery.start(n.run)
            victim = ("198.51.100.77", 9)
            # b has not reached a: a's PROBE_ASK and CONNECT are refused, nothing goes to the victim
            await a.endpoint.request(b.addr, m.MsgType.PING, {})
            await a.endpoint.notify(b.addr, m.MsgType.PROBE_ASK,
                                    {"target": m.pack_contact(bytes(32), *victim), "nonce": bytes(16)})
            await a.endpoint.notify(b.addr, m.MsgType.CONNECT, {"peer": m.pack_contact(bytes(32), *victim)})
            await trio.sleep(1)
            assert not [s for s in b.sent if s[0] == victim]
            assert dropped(b, "unreached") == 2
            # once b reached a: one PROBE per PROBE_ASK, at most 2 per target IP per 10 s
            await b.endpoint.request(a.addr, m.MsgType.PING, {})
            for _ in range(5):
                await a.endpoint.notify(b.addr, m.MsgType.PROBE_ASK,
                                        {"target": m.pack_contact(bytes(32), *victim), "nonce": bytes(16)})
            await trio.sleep(1)
            assert len([s for s in b.sent if s[0] == victim and s[1] == m.MsgType.PROBE]) == 2
            # INTRO for a node b never reached: no CONNECT, peer nil
            reply = await a.endpoint.request(b.addr, m.MsgType.INTRO, {"target": c.identity.node_id})
            assert reply.body["peer"] is None
            assert not [s for s in b.sent if s[0] == c.addr]
            # OBSERVE: the source address, nothing else
            reply = await a.endpoint.request(b.addr, m.MsgType.OBSERVE, {})
            assert tuple(reply.body["seen"]) == a.addr
            # RELAY: b is not public (undecided): refused
            datagram = bytes(60)
            await a.endpoint.notify(b.addr, m.MsgType.RELAY, {"to": c.identity.node_id, "data": datagram})
            await trio.sleep(1)
            assert b.nat.relay.refused.get("relay_off") == 1
            # b public: a RELAY to a node b has not reached is refused, one to a reached node goes, once
            b.nat.reach.verdict = "public"
            await a.endpoint.notify(b.addr, m.MsgType.RELAY, {"to": c.identity.node_id, "data": datagram})
            await trio.sleep(1)
            assert b.nat.relay.refused.get("relay_unreached") == 1
            await b.endpoint.request(c.addr, m.MsgType.PING, {})
            await a.endpoint.notify(b.addr, m.MsgType.RELAY, {"to": c.identity.node_id, "data": datagram})
            await trio.sleep(1)
            assert [s for s in b.sent if s[0] == c.addr and s[1] == m.MsgType.RELAYED] != []
            assert b.nat.relay.relayed == 1 and b.nat.relay.relayed_bytes == len(datagram)
            # a RELAYED whose src is not the identity bound to the inner datagram's token is dropped
            await c.endpoint.request(b.addr, m.MsgType.PING, {})
            inner = a.endpoint.sealer.seal(m.MsgType.PING, m.encode(m.MsgType.PING, {
                "rid": 5, "from": a.endpoint._from}), c.identity.node_id)
            await a.endpoint.request(c.addr, m.MsgType.PING, {})  # c now knows a's token and its identity
            await b.endpoint.notify(c.addr, m.MsgType.RELAYED, {"src": bytes(range(32)), "data": inner})
            await trio.sleep(1)
            assert dropped(c, "identity") == 1
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
