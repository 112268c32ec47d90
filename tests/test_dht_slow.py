"""Dead and slow DHT contacts: a lookup's wait per query follows measured round trips, and contacts that miss
queries in a row leave the routing table (virtual time)."""

from __future__ import annotations

import random

import pytest
import trio

from peerd.dht.core import DhtCore
from peerd.dht.lookup import SLOW_FLOOR_S, SLOW_QUERY_S, SLOW_RTOS, Lookup, slow_after
from peerd.dht.routing import MISSES, Contact, RoutingTable, distance
from peerd.transport.endpoint import RpcError
from peerd.transport.rto import RtoEstimator
from peerd.wire import messages as m

from .support.dht_swarm import DhtNode, start_swarm
from .support.memnet import MemNet, run_on_memnet

OWN = bytes(32)
ONE_WAY_S = 0.005  # a 10 ms round trip


def _id(rng: random.Random) -> bytes:
    return rng.getrandbits(256).to_bytes(32, "big")


def test_the_wait_follows_the_rto_between_a_floor_and_todays_cap() -> None:
    assert slow_after(None) == SLOW_QUERY_S  # nothing measured: as long as ever
    assert slow_after(float("nan")) == SLOW_QUERY_S
    assert slow_after(0.02) == SLOW_FLOOR_S  # the RTO's own floor: the wait's floor
    assert slow_after(0.1) == pytest.approx(SLOW_RTOS * 0.1)
    assert slow_after(5.0) == SLOW_QUERY_S  # never longer than before


def test_the_rto_of_a_dead_address_does_not_grow_with_its_backoff() -> None:
    est = RtoEstimator()
    a, b = ("10.0.0.1", 1), ("10.0.0.2", 1)
    assert est.rto(a) is None and est.typical_rto() is None
    for _ in range(20):
        est.sample(a, 0.010)
        est.sample(b, 0.030)
    before = est.rto(a)
    assert before is not None and est.min_rto <= before < 0.05
    for _ in range(5):
        est.timed_out(a)  # unanswered: the retransmission timeout backs off, the measured RTO stays
    assert est.rto(a) == before and est.timeout(a, 10.0) > 8 * before
    typical = est.typical_rto()  # every address's samples: between the two, with their spread
    assert typical is not None and est.rto(a) < typical < 0.2


def test_a_late_answer_still_counts() -> None:
    rng = random.Random(1)
    target = _id(rng)
    seeds = [Contact(_id(rng), "10.0.0.1", 1000 + i) for i in range(6)]
    lookup = Lookup(target, seeds, own_id=OWN, k=6, alpha=3)
    first = lookup.next_queries()
    slow = first[0]
    lookup.on_slow(slow.node_id)  # passed over: its slot goes to the next closest
    assert slow.node_id not in lookup.closest_ids()
    asked = first[1:] + lookup.next_queries()
    assert len(asked) == 3
    lookup.on_reply(slow.node_id, [])  # ... and then it answers
    assert slow.node_id in lookup.closest_ids()
    while asked:
        for c in asked:
            lookup.on_reply(c.node_id, [])
        asked = lookup.next_queries()
    assert lookup.finished and slow in lookup.result()


def test_contacts_that_miss_queries_in_a_row_leave_the_table() -> None:
    rng = random.Random(2)
    table = RoutingTable(OWN, k=20)
    dead, live = Contact(_id(rng), "10.0.0.1", 1), Contact(_id(rng), "10.0.0.2", 2)
    table.observe(dead)
    table.observe(live)
    for _ in range(MISSES - 1):
        assert not table.missed(dead)
        assert not table.missed(live)
    table.observe(live)  # it answered: its count starts again
    assert table.missed(dead) and dead.node_id not in table
    assert not table.missed(live) and live.node_id in table
    assert not table.missed(dead)  # gone: nothing more to count, nothing kept
    table.observe(dead)  # heard again (a late answer): it enters like any other
    assert dead.node_id in table
    assert set(table._misses) <= table.ids


def test_a_member_cannot_get_honest_contacts_evicted_hostile() -> None:
    """A member names honest nodes at addresses where nobody answers, and answers selectively itself: the
    queries that go unanswered count against the address asked only, so the honest contacts stay, and the
    member leaves only for its own misses in a row."""
    rng = random.Random(3)
    core = DhtCore(OWN, k=20)
    honest = [Contact(_id(rng), f"10.0.1.{i}", 4000) for i in range(10)]
    member = Contact(_id(rng), "10.0.2.1", 4000)
    for c in [*honest, member]:
        core.heard(c, 0.0)
    for _ in range(5):
        for c in honest:
            forged = Contact(c.node_id, "10.9.9.9", 9)  # the id, at an address the member made up
            core.missed(forged)
            core.failed(forged)
        core.missed(member)  # it lets one query go unanswered, then answers the next
        core.heard(member, 1.0)
    assert all(c.node_id in core.table for c in honest)
    assert member.node_id in core.table
    for _ in range(MISSES):
        core.missed(member)
    assert member.node_id not in core.table
    assert all(c.node_id in core.table for c in honest)


async def _warm(nodes: list[DhtNode], rng: random.Random) -> None:
    """A few lookups from every node: each has measured round trips to the others."""
    for _ in range(3):
        for node in nodes:
            await node.dht.find_nodes(_id(rng))


def _closest_others(nodes: list[DhtNode], target: bytes, reader: DhtNode, count: int) -> list[DhtNode]:
    others = [n for n in nodes if n is not reader and n is not nodes[0]]
    return sorted(others, key=lambda n: distance(n.identity.node_id, target))[:count]


def test_dead_contacts_cost_a_lookup_a_few_round_trips() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        rng = random.Random(4)
        nodes = await start_swarm(nursery, net, 12)
        await _warm(nodes, rng)
        reader = nodes[1]
        target = _id(rng)
        dead = _closest_others(nodes, target, reader, 3)  # the 3 closest to the target: asked first
        for victim in dead:
            victim.kill(net)
        dead_ids = {v.identity.node_id for v in dead}
        killed_at = trio.current_time()
        for attempt in range(2):
            start = trio.current_time()
            found = await reader.dht.find_nodes(target if attempt == 0 else _id(rng))
            took = trio.current_time() - start
            assert took < 0.2, (attempt, took)  # a 0.6 s wait per query would be >= 0.6 s
            assert not dead_ids & {c.node_id for c in found}
            assert len(found) == len(nodes) - 1 - len(dead)  # every live one
        # each dead contact missed a query in each lookup: gone from the table long before its retries end (3.5 s)
        assert trio.current_time() - killed_at < 1.0
        assert not dead_ids & reader.dht.core.table.ids

    run_on_memnet(main, seed=4, latency=ONE_WAY_S)


class _SlowSenders(MemNet):
    """The memnet with an extra delay on what some addresses send."""

    def __init__(self, **options: float) -> None:
        super().__init__(**options)
        self.extra: dict[tuple[str, int], float] = {}

    async def _arrive(self, delay: float, src: tuple[str, int], dst: tuple[str, int], data: bytes) -> None:
        await super()._arrive(delay + self.extra.get(src, 0.0), src, dst, data)


@pytest.mark.parametrize("rtts", [3, 10])
def test_a_slow_but_live_contact_still_counts(rtts: int) -> None:
    """A contact that turns slow (its answers take ``rtts`` round trips of the others) stays in the table and in
    the lookups' results: at 3 round trips it is within the wait; at 10 it is passed over at first, its late answers
    count and teach the wait its new round trip."""
    net = _SlowSenders(seed=5, latency=ONE_WAY_S)

    async def main(net: _SlowSenders, nursery: trio.Nursery) -> None:
        rng = random.Random(5)
        nodes = await start_swarm(nursery, net, 12)
        await _warm(nodes, rng)
        reader = nodes[1]
        slow = _closest_others(nodes, _id(rng), reader, 1)[0]
        net.extra[slow.addr] = (rtts - 1) * 2 * ONE_WAY_S
        results = []
        for _ in range(6):
            results.append({c.node_id for c in await reader.dht.find_nodes(_id(rng))})
            await trio.sleep(0.1)
            assert slow.identity.node_id in reader.dht.core.table  # (back in, if it ever left)
        assert slow.identity.node_id in results[-1]
        if rtts <= 3:
            assert all(slow.identity.node_id in r for r in results)

    run_on_memnet(main, net)


def test_a_forged_address_does_not_evict_the_honest_contact_hostile() -> None:
    """A request to an honest node's id at an address a member named fails after its retries: the honest contact,
    held at its own address, stays."""
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await start_swarm(nursery, net, 6)
        reader, honest = nodes[1], nodes[2]
        assert honest.identity.node_id in reader.dht.core.table
        forged = Contact(honest.identity.node_id, "127.0.0.1", 29999)  # nobody there
        with pytest.raises(RpcError):
            await reader.dht._rpc(forged, m.MsgType.FIND_NODE, {"target": bytes(32)})
        assert reader.dht.core.table.holds_at(Contact(honest.identity.node_id, *honest.addr))

    run_on_memnet(main, seed=6, latency=ONE_WAY_S)


def test_loss_does_not_cost_live_contacts_their_place() -> None:
    """At 5 % loss both ways, a lookup's query is sometimes passed over though its contact lives; a contact that
    leaves the table for that is heard again when it answers, so after many lookups every live node is held."""
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        rng = random.Random(7)
        nodes = await start_swarm(nursery, net, 16)
        reader = nodes[1]
        for _ in range(40):
            await reader.dht.find_nodes(_id(rng))
        await trio.sleep(5.0)  # late answers land, background retries end
        assert {n.identity.node_id for n in nodes if n is not reader} <= reader.dht.core.table.ids

    run_on_memnet(main, seed=7, drop=0.05, latency=ONE_WAY_S, jitter=0.002)
