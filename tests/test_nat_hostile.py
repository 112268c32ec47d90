"""What a member can make a node do with NAT traversal messages (PROTOCOL.md 18): no probes, CONNECTs or relaying on
behalf of peers the node has not reached, no relaying by a node that is not public, no forged RELAYED senders."""

from __future__ import annotations

import random

import trio
import trio.testing

from peerd.dht import DhtService
from peerd.metrics import Metrics
from peerd.nat.service import NatService
from peerd.transport import Endpoint
from peerd.wire import messages as m
from peerd.wire.identity import Identity

from .support.memnet import MemNet, run_all, started

SECRET = bytes(range(32))


def dropped(node, reason: str) -> float:
    return sum(s.value for mt in node.metrics.datagrams_dropped.collect() for s in mt.samples
               if s.name.endswith("_total") and s.labels.get("reason") == reason)


class SpiedNatNode:
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
        await run_all(self.endpoint.serve, self.nat.run, task_status=task_status)


def test_members_cannot_steer_probes_connects_or_relays() -> None:
    async def main() -> None:
        net = MemNet(seed=1, latency=0.002)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            a, b, c = await started(nursery, [SpiedNatNode(net, i) for i in range(3)])
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


class DhtNode(SpiedNatNode):
    """A node with the DHT too, wired as the daemon wires it (the NAT service asks the DHT where a node is)."""

    def __init__(self, net: MemNet, i: int) -> None:
        super().__init__(net, i)
        self.dht = DhtService(self.endpoint, self.metrics, rng=random.Random(100 + i), refresh_interval=30.0)
        self.nat.contact_of = self.contact_of

    def contact_of(self, node_id: bytes):
        return next((c.addr for c in self.dht.core.table.contacts() if c.node_id == node_id), None)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await run_all(self.endpoint.serve, self.dht.run, self.nat.run, task_status=task_status)


def fresh_ping(node: SpiedNatNode, to: bytes, rid: int = 77) -> bytes:
    """A PING sealed for ``to`` under a token of ``node``'s that nobody has seen bound yet."""
    sealer = node.endpoint._new_sealer()
    body = m.encode(m.MsgType.PING, {"rid": rid, "from": node.endpoint._bindings[sealer.token]})
    return sealer.seal(m.MsgType.PING, body, to)


def test_an_unsolicited_relayed_naming_another_member_reroutes_nothing_hostile() -> None:
    """A member that a node reached sends it RELAYEDs naming another member B as ``src``: junk inside, then its own
    PING under a fresh token. The node's traffic to B still goes to B directly, and its DHT keeps B at B's address
    (on the old code the first RELAYED made the member B's relay, for good, and the DHT then dropped B)."""

    async def main() -> None:
        net = MemNet(seed=2, latency=0.002)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            a, b, mal = await started(nursery, [DhtNode(net, i) for i in range(3)])
            await b.dht.bootstrap([a.addr], timeout=5)
            await mal.dht.bootstrap([a.addr], timeout=5)
            await a.endpoint.request(b.addr, m.MsgType.PING, {})
            await a.endpoint.request(mal.addr, m.MsgType.PING, {})
            await trio.sleep(2)
            b_id = b.identity.node_id
            assert a.contact_of(b_id) == b.addr and a.nat.reached.get(mal.identity.node_id) == mal.addr
            await mal.endpoint.notify(a.addr, m.MsgType.RELAYED, {"src": b_id, "data": bytes(range(60))})
            own = fresh_ping(mal, a.identity.node_id)
            await mal.endpoint.notify(a.addr, m.MsgType.RELAYED, {"src": b_id, "data": own})
            await trio.sleep(1)
            assert a.endpoint.relay_of(b.addr) is None and a.nat.kind.get(b_id) is None
            assert dropped(a, "identity") == 1
            for _ in range(3):  # A's traffic to B, over the next 40 s (the DHT's checks included)
                reply = await a.endpoint.request(b.addr, m.MsgType.PING, {}, node_id=b_id)
                assert reply.peer.node_id == b_id and not reply.relayed
                await trio.sleep(20)
            assert not [s for s in a.sent if s[0] == mal.addr and s[1] == m.MsgType.RELAY]
            assert a.endpoint.path_counts["relayed"] == [0, 0]
            assert a.contact_of(b_id) == b.addr
            assert [c.node_id for c in a.dht.core.table.contacts() if c.addr == b.addr] == [b_id]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_connect_and_intro_do_not_make_a_node_a_reflector_hostile() -> None:
    """A member sends CONNECTs naming a victim address, and answers INTRO with it: the node punches only an address
    the DHT named that peer at, and at most ``TARGET_PUNCHES`` punches per address a minute (on the old code every
    CONNECT or INTRO_OK started 6 PINGs at whatever address it named)."""
    from peerd.nat.punch import PUNCH_PINGS, TARGET_PUNCHES

    async def main() -> None:
        net = MemNet(seed=3, latency=0.002)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            a, mal = await started(nursery, [SpiedNatNode(net, 0), SpiedNatNode(net, 1)])
            victim = ("198.51.100.77", 9)
            await a.endpoint.request(mal.addr, m.MsgType.PING, {})  # a reached the member: its CONNECTs count
            await mal.endpoint.request(a.addr, m.MsgType.PING, {})

            def at_victim() -> int:
                return len([s for s in a.sent if s[0] == victim])

            # a peer nobody named, "at" the victim: no PING goes there
            for i in range(10):
                peer = m.pack_contact(bytes([i]) * 32, *victim)
                await mal.endpoint.notify(a.addr, m.MsgType.CONNECT, {"peer": peer})
                await trio.sleep(0.5)
            await trio.sleep(5)
            assert at_victim() == 0 and a.nat.puncher.refused.get("unnamed") == 10
            # a peer the DHT named at the victim's address: the address's budget, however many CONNECTs name it
            named = bytes([99]) * 32
            a.nat.named_at[named] = victim
            for _ in range(10):
                await mal.endpoint.notify(a.addr, m.MsgType.CONNECT, {"peer": m.pack_contact(named, *victim)})
                await trio.sleep(0.5)
            await trio.sleep(5)
            assert 0 < at_victim() <= TARGET_PUNCHES * PUNCH_PINGS
            # a hostile introducer's INTRO_OK naming the victim for a target the DHT named elsewhere
            before = at_victim()
            target, target_addr = bytes([7]) * 32, ("203.0.113.50", 7000)
            mal.endpoint.on_request(m.MsgType.INTRO, lambda incoming: {"peer": m.pack_contact(target, *victim)})
            a.nat.introducer[target] = mal.identity.node_id
            a.nat.named_at[target] = target_addr
            a.nat.silent(target_addr, target, trio.current_time())
            await trio.sleep(5)
            assert at_victim() == before
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_minted_relay_senders_cannot_starve_an_honest_one_hostile() -> None:
    """Eight minted identities flood one relay as fast as their own budgets allow while an honest member sends a
    modest stream through it: the relay's total budget is shared max-min fairly, so the honest member's datagrams
    all go through (on the old code, one shared bucket: first come, and the honest share fell to a few percent)."""
    import hashlib

    from peerd.tools.sim.natnode import RELAYED, SimNatNode
    from peerd.tools.sim.net import Network

    net = Network(random.Random(9))

    def node(i: int) -> SimNatNode:
        return SimNatNode(net, (f"203.0.113.{i + 1}", 7000), hashlib.sha256(bytes([i])).digest(), random.Random(i))

    relay, target, honest = node(0), node(1), node(2)
    minted = [node(3 + i) for i in range(8)]
    relay.relay.rate, relay.relay.burst, relay.relay.total_rate = 100_000.0, 20_000.0, 120_000.0
    relay.reach.verdict = "public"
    for n in (target, honest, *minted):
        relay.ping(n.addr)
    target.ping(relay.addr)  # (a RELAYED counts only from a relay the receiver reached)
    net.run(until=1.0)
    for n in (honest, *minted):
        n.kind[target.node_id] = RELAYED
        n.client.use(target.node_id, relay.node_id, relay.addr)

    def stream(n: SimNatNode, gap: float, until: float) -> None:
        if net.now < until:
            n.send_app(target.node_id, target.addr, n.node_id)
            net.call_later(gap, stream, n, gap, until)

    # each RELAY is 300 bytes
    for n in minted:
        stream(n, 0.002, 7.0)  # 150 KB/s each, over the per-sender rate
    stream(honest, 0.025, 7.0)  # 12 KB/s: under an equal share of the total (13.3 KB/s)
    net.run(until=8.0)
    got = sum(1 for sender, _ in target.app if sender == honest.node_id)
    sent = honest.sent_by_kind[RELAYED]
    assert sent >= 230
    assert got >= 0.95 * sent, (got, sent)
    assert relay.relay.refused.get("relay_budget", 0) > 0  # the minted ones were held to their shares

    # 16 ids minted on one host split that host's share: an honest sender on another host asking a quarter of the
    # total gets it all (shared per id alone, it would get 1/17 of the total)
    from peerd.nat.relay import RelayServer

    r = RelayServer(rate=100_000.0, burst=20_000.0, total_rate=120_000.0)
    to, honest_id = b"t" * 32, b"h" * 32
    ids = [bytes([i]) * 32 for i in range(16)]
    r.reached(to, ("203.0.113.1", 7000), 0.0)
    r.reached(honest_id, ("198.51.100.2", 7000), 0.0)
    for i, k in enumerate(ids):
        r.reached(k, ("198.51.100.66", 7000 + i), 0.0)
    ok = sent = 0
    for step in range(1500):  # 3 s, 2 ms apart: each minted id offers 150 KB/s, the honest one 30 KB/s
        now = step / 500
        for k in ids:
            r.forward(k, to, 300, now)
        if step % 5 == 0:
            sent += 1
            ok += r.forward(honest_id, to, 300, now) == ("203.0.113.1", 7000)
    assert ok >= 0.95 * sent, (ok, sent)


class BlockingNet(MemNet):
    """MemNet where some (source, destination) pairs never arrive: two members that cannot reach each other."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.blocked: set[tuple[tuple[str, int], tuple[str, int]]] = set()

    def deliver(self, src, dst, data) -> None:
        if (src, dst) not in self.blocked:
            super().deliver(src, dst, data)


def test_a_relay_becomes_a_path_after_a_ping_through_it_and_goes_on_a_direct_answer() -> None:
    """The honest case the hostile ones must not break: two members that cannot reach each other relay through a
    third, each side once the other answered a PING through it; when they can reach each other again, a direct
    answer drops the relay."""

    async def main() -> None:
        net = BlockingNet(seed=4, latency=0.002)
        async with trio.open_nursery() as nursery:
            net.nursery = nursery
            a, b, r = await started(nursery, [SpiedNatNode(net, i) for i in range(3)])
            r.nat.reach.verdict = "public"
            for x, y in ((a, r), (b, r), (r, a), (r, b)):
                await x.endpoint.request(y.addr, m.MsgType.PING, {})
            net.blocked |= {(a.addr, b.addr), (b.addr, a.addr)}
            a_id, b_id = a.identity.node_id, b.identity.node_id
            b.nat.paths.target_addr[a_id] = a.addr  # (as after a punch an introducer vouched for, that failed)
            b.nat.paths.active.add(a_id)
            b.nat.paths.punch_failed(a_id, True, trio.current_time())
            b.nat._act()
            await trio.sleep(3)
            assert b.nat.kind.get(a_id) == "relayed" and b.endpoint.relay_of(a.addr) is not None
            assert a.nat.kind.get(b_id) == "relayed" and a.nat.relay_entry(b_id) is not None
            reply = await b.endpoint.request(a.addr, m.MsgType.PING, {}, node_id=a_id)
            assert reply.relayed and reply.peer.node_id == a_id
            # they reach each other again: a's next request goes to b directly (a relays b only at a reply address;
            # b's answer still comes through the relay), and that answer is direct enough for a
            net.blocked.clear()
            await a.endpoint.request(b.addr, m.MsgType.PING, {}, node_id=b_id)
            assert a.nat.relay_entry(b_id) is None and a.nat.kind.get(b_id) is None
            await trio.sleep(2)  # b heard a directly, PINGed it there, got the answer: b's relay is gone too
            assert b.nat.relay_entry(a_id) is None and b.nat.kind.get(a_id) is None
            assert b.endpoint.relay_of(a.addr) is None
            reply = await b.endpoint.request(a.addr, m.MsgType.PING, {}, node_id=a_id)
            assert not reply.relayed
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
