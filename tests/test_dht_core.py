"""The DHT's sans-I/O cores with injected time: routing table, iterative lookup, records, request handling.

Everything here is deterministic: fixed seeds, plain float clocks, and hypothesis derandomized.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from peerd.dht.core import HELD_ON_WIRE, DhtCore, pack_contacts, unpack_contacts
from peerd.dht.lookup import Lookup
from peerd.dht.records import Record, RecordStore, location, merge_newest, signed_message
from peerd.dht.routing import ID_BITS, Contact, RoutingTable, bucket_index, distance
from peerd.tools.sim.net import Link, Network
from peerd.wire import messages as m
from peerd.wire.errors import WireError
from peerd.wire.identity import Identity

from .support.properties import repeatable

FAST = repeatable(60)

node_ids = st.binary(min_size=32, max_size=32)


def as_id(value: int) -> bytes:
    return value.to_bytes(32, "big")


def as_int(node_id: bytes) -> int:
    return int.from_bytes(node_id, "big")


def contact(node_id: bytes, port: int = 4000) -> Contact:
    return Contact(node_id, "10.0.0.1", port)


OWN = as_id(random.Random(1).getrandbits(256))


def in_bucket(index: int, count: int, *, own: bytes = OWN, seed: int = 0) -> list[bytes]:
    """``count`` distinct ids in bucket ``index`` of ``own``."""
    rng = random.Random(seed * 1000 + index)
    offsets: list[int] = []
    while len(offsets) < count:
        offset = (1 << index) | rng.getrandbits(index)
        if offset not in offsets:
            offsets.append(offset)
    return [as_id(as_int(own) ^ off) for off in offsets]


# -- routing table: metric and buckets ---------------------------------------------------------


@FAST
@given(node_ids, node_ids, node_ids)
def test_distance_is_xor_and_bucket_index_matches_it(a: bytes, b: bytes, c: bytes) -> None:
    assert distance(a, a) == 0
    assert distance(a, b) == distance(b, a)
    assert distance(a, b) ^ distance(b, c) == distance(a, c)
    assert bucket_index(a, a) == -1
    if a != b:
        i = bucket_index(a, b)
        assert 0 <= i < ID_BITS
        assert 2**i <= distance(a, b) < 2 ** (i + 1)
        assert bucket_index(b, a) == i


def test_bucket_index_extremes() -> None:
    zero = as_id(0)
    assert bucket_index(zero, as_id(1)) == 0
    assert bucket_index(zero, as_id(3)) == 1
    assert bucket_index(zero, as_id(1 << 255)) == 255
    assert bucket_index(zero, b"\xff" * 32) == 255


# -- routing table: k-buckets and least-recently-seen eviction ----------------------------------


def test_full_bucket_pings_least_recently_seen_and_newcomer_waits() -> None:
    t = RoutingTable(OWN, k=3)
    a, b, c, d, e, f = (contact(x) for x in in_bucket(255, 6))
    for x in (a, b, c):
        assert t.observe(x) is None
    assert len(t) == 3

    assert t.observe(d) == a  # the bucket is full: ping its least recently seen contact
    assert d.node_id not in t and len(t) == 3
    assert t.observe(e) is None  # one ping per bucket in flight
    assert t.observe(d) is None
    assert e.node_id not in t

    t.ping_result(a, alive=True)  # a stays, now the most recently seen
    assert {x.node_id for x in t.contacts()} == {a.node_id, b.node_id, c.node_id}
    assert t.observe(f) == b  # so the next newcomer gets b pinged, not a

    t.ping_result(b, alive=False)  # b is dead: evicted, the freshest replacement (f) takes its place
    assert b.node_id not in t
    assert f.node_id in t
    assert len(t) == 3 == len(t.contacts())

    assert t.observe(d) == c  # d heard again: it becomes the freshest replacement; c is now the oldest
    t.ping_result(c, alive=False)
    assert d.node_id in t and e.node_id not in t
    assert {x.node_id for x in t.contacts()} == {a.node_id, f.node_id, d.node_id}


def test_pings_are_per_bucket() -> None:
    t = RoutingTable(OWN, k=1)
    x, x2 = (contact(n) for n in in_bucket(255, 2))
    y, y2 = (contact(n) for n in in_bucket(254, 2))
    assert t.observe(x) is None and t.observe(y) is None
    assert t.observe(x2) == x
    assert t.observe(y2) == y  # bucket 255's ping in flight does not hold back bucket 254's


def test_observe_refreshes_address_and_recency() -> None:
    t = RoutingTable(OWN, k=2)
    a, b, c = (contact(x) for x in in_bucket(200, 3))
    t.observe(a)
    t.observe(b)
    moved = Contact(a.node_id, "10.0.0.9", 5000)
    assert t.observe(moved) is None
    assert moved in t.contacts() and a not in t.contacts()
    assert len(t) == 2
    assert t.observe(c) == b  # a was heard from last


def test_ping_result_for_unknown_or_unpinged_contact_is_harmless() -> None:
    t = RoutingTable(OWN, k=2)
    a, b, stranger = (contact(x) for x in in_bucket(255, 3))
    t.observe(a)
    t.observe(b)
    t.ping_result(stranger, alive=True)
    t.ping_result(stranger, alive=False)
    assert len(t) == 2
    t.ping_result(a, alive=True)  # an unsolicited "alive" only refreshes a
    assert t.observe(stranger) == b


def test_own_id_is_never_added() -> None:
    t = RoutingTable(OWN, k=2)
    me = contact(OWN)
    assert t.observe(me) is None
    assert len(t) == 0 and OWN not in t and t.contacts() == []
    t.remove(OWN)
    t.ping_result(me, alive=False)
    t.ping_result(me, alive=True)
    others = [contact(x) for x in in_bucket(255, 2)]
    for o in others:
        t.observe(o)
    t.observe(me)
    assert OWN not in {c.node_id for c in t.closest(OWN, 10)}
    assert len(t) == 2


def test_remove() -> None:
    t = RoutingTable(OWN, k=2)
    a, b, c, d = (contact(x) for x in in_bucket(255, 4))
    far = contact(in_bucket(10, 1)[0])
    for x in (a, b, far):
        t.observe(x)
    t.remove(far.node_id)
    assert far.node_id not in t and len(t) == 2
    t.remove(far.node_id)  # unknown: nothing happens
    t.remove(in_bucket(3, 1)[0])
    assert len(t) == 2
    assert t.observe(c) == a  # c waits, then d (fresher)
    t.observe(d)
    t.remove(b.node_id)
    assert b.node_id not in t and d.node_id in t and c.node_id not in t
    assert len(t) == 2 == len(t.contacts())
    t.remove(a.node_id)
    assert c.node_id in t and len(t) == 2
    t.remove(c.node_id)  # no replacement left
    assert len(t) == 1 == len(t.contacts())


def test_remove_forgets_a_waiting_replacement_too() -> None:
    t = RoutingTable(OWN, k=1)
    a, b = (contact(x) for x in in_bucket(255, 2))
    t.observe(a)
    assert t.observe(b) == a  # b waits as a replacement
    t.remove(b.node_id)  # b failed to answer a lookup query: forget it
    t.ping_result(a, alive=False)  # a is dead too
    assert b.node_id not in t


# A pool of ids concentrated in a few buckets so that, with k=3, buckets overflow.
POOL = [x for index, count in ((255, 7), (254, 6), (250, 5), (4, 6), (1, 2), (0, 1)) for x in in_bucket(index, count)]


class RoutingMachine(RuleBasedStateMachine):
    K = 3

    def __init__(self) -> None:
        super().__init__()
        self.table = RoutingTable(OWN, k=self.K)
        self.pending: dict[int, Contact] = {}  # bucket -> contact the table asked us to ping

    def bucket_size(self, index: int) -> int:
        return sum(1 for c in self.table.contacts() if bucket_index(OWN, c.node_id) == index)

    @rule(i=st.integers(0, len(POOL) - 1), port=st.integers(1, 3))
    def observe(self, i: int, port: int) -> None:
        c = Contact(POOL[i], "10.0.0.1", port)
        b = bucket_index(OWN, c.node_id)
        was_in = c.node_id in self.table
        full = self.bucket_size(b) >= self.K
        before = len(self.table)
        oldest = self.table.observe(c)
        if was_in or not full:
            assert oldest is None
            assert c in self.table.contacts()
            assert len(self.table) == before + (0 if was_in else 1)
        else:
            assert c.node_id not in self.table and len(self.table) == before
        if oldest is not None:
            assert b not in self.pending, "a second ping in flight for one bucket"
            assert bucket_index(OWN, oldest.node_id) == b and oldest.node_id in self.table
            lrs = [x for x in self.table.buckets[b].contacts.values()][0]
            assert oldest == lrs
            self.pending[b] = oldest

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), alive=st.booleans())
    def answer_ping(self, data: st.DataObject, alive: bool) -> None:
        b = data.draw(st.sampled_from(sorted(self.pending)))
        c = self.pending.pop(b)
        present = c.node_id in self.table
        waiting = len(self.table.buckets[b].replacements)
        before = len(self.table)
        self.table.ping_result(c, alive)
        if alive:
            assert (c.node_id in self.table) == present
            assert len(self.table) == before
        else:
            assert c.node_id not in self.table
            assert len(self.table) == before - (1 if present and not waiting else 0)

    @rule(i=st.integers(0, len(POOL) - 1))
    def remove(self, i: int) -> None:
        node_id = POOL[i]
        present = node_id in self.table
        waiting = len(self.table.buckets[bucket_index(OWN, node_id)].replacements)
        before = len(self.table)
        self.table.remove(node_id)
        assert node_id not in self.table
        assert len(self.table) == before - (1 if present and not waiting else 0)

    @invariant()
    def consistent(self) -> None:
        contacts = self.table.contacts()
        held = [c.node_id for c in contacts]
        assert len(self.table) == len(contacts) == len(set(held))
        assert OWN not in held
        for node_id in POOL:
            assert (node_id in self.table) == (node_id in held)
        for index, bucket in enumerate(self.table.buckets):
            assert len(bucket.contacts) <= self.K
            assert len(bucket.replacements) <= self.K
            assert all(bucket_index(OWN, n) == index for n in bucket.contacts)
            assert not set(bucket.contacts) & set(bucket.replacements)
            if bucket.replacements:  # nobody waits while there is room
                assert len(bucket.contacts) == self.K


TestRoutingMachine = RoutingMachine.TestCase
TestRoutingMachine.settings = settings(FAST, max_examples=50, stateful_step_count=40)


@FAST
@given(st.lists(node_ids, max_size=250, unique=True), node_ids, st.integers(0, 40))
def test_closest_is_the_true_closest_by_xor(ids: list[bytes], target: bytes, count: int) -> None:
    t = RoutingTable(OWN, k=20)
    for n in ids:
        t.observe(contact(n))
    held = t.contacts()
    assert OWN not in {c.node_id for c in held}
    brute = sorted(held, key=lambda c: as_int(c.node_id) ^ as_int(target))
    assert t.closest(target, count) == brute[:count]
    assert t.closest(target) == brute[:20]


@FAST
@given(st.lists(st.tuples(st.integers(0, ID_BITS - 1), st.integers(0, 2**64)), max_size=120), node_ids,
       st.integers(0, 45))
def test_closest_across_many_buckets(picks: list[tuple[int, int]], target: bytes, count: int) -> None:
    # ids spread over every bucket (random ids fill only the top few): closest() reads buckets in XOR order
    t = RoutingTable(OWN, k=4)
    for index, bits in picks:
        t.observe(contact(as_id(as_int(OWN) ^ ((1 << index) | (bits % (1 << index) if index else 0)))))
    for aim in (target, OWN, t.contacts()[0].node_id if len(t) else target):
        brute = sorted(t.contacts(), key=lambda c: as_int(c.node_id) ^ as_int(aim))
        assert t.closest(aim, count) == brute[:count]


def test_closest_when_everything_fits() -> None:
    rng = random.Random(5)
    ids = [as_id(rng.getrandbits(256)) for _ in range(30)]
    t = RoutingTable(OWN, k=20)  # 30 random ids never fill a bucket of 20, so the table holds all
    for n in ids:
        t.observe(contact(n))
    for _ in range(20):
        target = as_id(rng.getrandbits(256))
        truth = sorted(ids, key=lambda n: distance(n, target))[:20]
        assert [c.node_id for c in t.closest(target)] == truth


@FAST
@given(node_ids, st.integers(0, ID_BITS - 1), st.integers(0, 2**32))
def test_random_id_in_bucket_falls_in_that_bucket(own: bytes, index: int, seed: int) -> None:
    t = RoutingTable(own)
    rid = t.random_id_in_bucket(index, random.Random(seed))
    assert len(rid) == 32
    assert bucket_index(own, rid) == index


def test_random_id_in_bucket_is_random() -> None:
    t = RoutingTable(OWN)
    rng = random.Random(3)
    assert len({t.random_id_in_bucket(200, rng) for _ in range(50)}) == 50
    assert all(bucket_index(OWN, t.random_id_in_bucket(i, rng)) == i for i in range(ID_BITS))


def test_buckets_to_refresh() -> None:
    t = RoutingTable(OWN, k=20)
    assert t.buckets_to_refresh(1000.0, 60.0) == []
    t.observe(contact(in_bucket(250, 1)[0]))
    t.observe(contact(in_bucket(255, 1)[0]))
    assert t.buckets_to_refresh(100.0, 60.0) == [250, 251, 252, 253, 254, 255]
    t.touch(in_bucket(252, 1, seed=9)[0], 90.0)
    t.touch(OWN, 90.0)  # own id lies in no bucket: touches nothing
    assert t.buckets_to_refresh(100.0, 60.0) == [250, 251, 253, 254, 255]
    assert t.buckets_to_refresh(149.0, 60.0) == [250, 251, 253, 254, 255]
    assert t.buckets_to_refresh(150.0, 60.0) == [250, 251, 252, 253, 254, 255]
    # refreshing with a random id in each stale bucket touches exactly that bucket
    rng = random.Random(0)
    for i in t.buckets_to_refresh(200.0, 60.0):
        t.touch(t.random_id_in_bucket(i, rng), 200.0)
    assert t.buckets_to_refresh(200.0, 60.0) == []
    assert t.buckets_to_refresh(200.0, 0.0) == list(range(250, 256))
    t.observe(contact(in_bucket(3, 1)[0]))  # a closer contact: refresh starts from its bucket
    assert t.buckets_to_refresh(230.0, 60.0) == list(range(3, 250))


# -- iterative lookup ---------------------------------------------------------------------------


class Swarm:
    """A simulated id space: every node answers FIND_NODE from a Kademlia routing table of its own (over the
    in-memory network: see ``drive``)."""

    def __init__(self, n: int, seed: int, *, k: int = 20, dead_fraction: float = 0.0, stale: bool = False):
        rng = random.Random(seed)
        ids: set[bytes] = set()
        while len(ids) < n:
            ids.add(as_id(rng.getrandbits(256)))
        self.ids = sorted(ids)
        rng.shuffle(self.ids)
        self.me = self.ids[0]  # the querier, alive
        self.dead = set(rng.sample(self.ids[1:], int(n * dead_fraction)))
        self.live = [i for i in self.ids if i not in self.dead]
        self.k = k
        self.stale = stale  # whether other nodes' tables still hold the dead nodes
        self._tables: dict[bytes, RoutingTable] = {}
        self.asked: list[bytes] = []

    def table(self, node_id: bytes) -> RoutingTable:
        if node_id not in self._tables:
            t = RoutingTable(node_id, self.k)
            known = list(self.ids if self.stale or node_id == self.me else self.live)
            random.Random(node_id).shuffle(known)
            for other in known:
                t.observe(contact(other))  # pings are never answered: first come, first kept
            self._tables[node_id] = t
        return self._tables[node_id]

    def answer(self, node_id: bytes, target: bytes) -> list[Contact]:
        assert node_id not in self.dead
        self.asked.append(node_id)
        return self.table(node_id).closest(target)

    def truth(self, target: bytes, k: int) -> list[bytes]:
        return sorted((i for i in self.live if i != self.me), key=lambda i: distance(i, target))[:k]


def drive(
    lookup: Lookup, swarm: Swarm, rng: random.Random, outstanding: list[Contact] | None = None
) -> tuple[list[Contact], set[bytes]]:
    """Runs a lookup to the end over the in-memory network (peerd/tools/sim/net.py): every live node answers
    FIND_NODE from its table, jitter delivers answers in an order drawn from ``rng``, and a query to a dead
    node (attached nowhere) fails when its timer runs out. Returns (result, seen ids)."""
    net = Network(rng, default=Link(latency=0.010, jitter=0.030))
    flying: set[bytes] = set()
    queried: set[bytes] = set()
    seen: set[bytes] = set()
    timeout = 1.0  # far beyond any round trip here (at most 0.08 s)

    def answer_from(node_id: bytes):
        def handle(src: bytes, target: bytes) -> None:
            net.send(node_id, src, (node_id, swarm.answer(node_id, target)))
        return handle

    def timed_out(node_id: bytes) -> None:
        if node_id in flying:
            flying.discard(node_id)
            lookup.on_failure(node_id)
            pump()

    def send(c: Contact) -> None:
        assert c.node_id not in queried, "queried twice"
        assert c.node_id != swarm.me
        queried.add(c.node_id)
        flying.add(c.node_id)
        if c.node_id not in swarm.dead and not net.alive(c.node_id):
            net.attach(c.node_id, answer_from(c.node_id))
        net.send(swarm.me, c.node_id, lookup.target)
        net.call_later(timeout, timed_out, c.node_id)

    def pump() -> None:
        for c in lookup.next_queries():
            send(c)
        assert len(flying) <= lookup.width
        assert lookup.in_flight() == len(flying)
        if lookup.finished:
            assert not flying
        else:
            assert flying, "stalled: nothing in flight, nothing to ask, yet not finished"

    def on_answer(src: bytes, payload: tuple[bytes, list[Contact]]) -> None:
        node_id, nodes = payload
        flying.discard(node_id)
        seen.update(x.node_id for x in nodes)
        lookup.on_reply(node_id, nodes)
        pump()

    net.attach(swarm.me, on_answer)
    for c in outstanding or []:
        send(c)
    pump()
    net.run(max_events=100 * len(swarm.ids))
    assert lookup.finished, "lookup did not terminate"
    return lookup.result(), seen


def start(swarm: Swarm, target: bytes, *, k: int = 20, alpha: int = 3) -> tuple[Lookup, set[bytes]]:
    seeds = swarm.table(swarm.me).closest(target)
    return Lookup(target, seeds, own_id=swarm.me, k=k, alpha=alpha), {s.node_id for s in seeds}


@pytest.mark.parametrize("seed", range(4))
def test_lookup_finds_exactly_the_k_closest(seed: int) -> None:
    swarm = Swarm(500, seed)
    rng = random.Random(seed)
    for _ in range(3):
        target = as_id(rng.getrandbits(256))
        lookup, _ = start(swarm, target)
        result, _ = drive(lookup, swarm, rng)
        assert [c.node_id for c in result] == swarm.truth(target, 20)
        assert lookup.closest_distance() == distance(result[0].node_id, target)
    assert len(swarm.asked) < 3 * 120  # a lookup asks a few dozen nodes, not the whole swarm


@pytest.mark.parametrize("seed", range(2))
def test_lookup_for_own_id(seed: int) -> None:
    swarm = Swarm(500, seed + 10)
    lookup, _ = start(swarm, swarm.me)
    lookup.add([contact(swarm.me)])  # own id offered again: ignored
    result, _ = drive(lookup, swarm, random.Random(seed))
    assert swarm.me not in swarm.asked
    assert [c.node_id for c in result] == swarm.truth(swarm.me, 20)


@pytest.mark.parametrize(("k", "alpha"), [(5, 1), (8, 2), (20, 5)])
def test_lookup_respects_alpha_and_k(k: int, alpha: int) -> None:
    swarm = Swarm(300, 20 + k, k=k)
    target = as_id(random.Random(k).getrandbits(256))
    lookup, _ = start(swarm, target, k=k, alpha=alpha)
    first = lookup.next_queries()
    assert len(first) == alpha
    assert lookup.next_queries() == []  # nothing more until something comes back
    lookup.on_reply(first[0].node_id, swarm.answer(first[0].node_id, target))
    more = lookup.next_queries()
    assert len(more) <= 1
    result, _ = drive(lookup, swarm, random.Random(k), outstanding=first[1:] + more)
    assert [c.node_id for c in result] == swarm.truth(target, k)


@pytest.mark.parametrize("seed", range(3))
def test_lookup_routes_around_dead_nodes(seed: int) -> None:
    # Our own table is stale (it holds the dead nodes); the rest of the swarm has evicted them.
    swarm = Swarm(500, seed + 30, dead_fraction=0.3)
    rng = random.Random(seed)
    for _ in range(3):
        target = as_id(rng.getrandbits(256))
        lookup, seeds = start(swarm, target)
        assert seeds & swarm.dead
        result, _ = drive(lookup, swarm, rng)
        assert [c.node_id for c in result] == swarm.truth(target, 20)


@pytest.mark.parametrize("seed", range(3))
def test_lookup_with_stale_tables_everywhere(seed: int) -> None:
    # Every table still holds dead nodes: the lookup ends with the k closest live nodes it heard of.
    swarm = Swarm(500, seed + 40, dead_fraction=0.2, stale=True)
    rng = random.Random(seed)
    target = as_id(rng.getrandbits(256))
    lookup, seeds = start(swarm, target)
    result, seen = drive(lookup, swarm, rng)
    got = [c.node_id for c in result]
    assert not set(got) & swarm.dead
    heard = (seen | seeds) - swarm.dead - {swarm.me}
    assert got == sorted(heard, key=lambda i: distance(i, target))[:20]
    assert len(got) == 20


def test_lookup_edge_cases() -> None:
    target = as_id(12345)
    empty = Lookup(target, [], own_id=OWN)
    assert empty.finished and empty.next_queries() == [] and empty.result() == []
    assert empty.closest_distance() is None

    only_me = Lookup(target, [contact(OWN)], own_id=OWN)
    assert only_me.finished and only_me.result() == []

    dead = [contact(x) for x in in_bucket(255, 5)]
    lk = Lookup(target, dead, own_id=OWN, k=3, alpha=2)
    for _ in range(10):
        for c in lk.next_queries():
            lk.on_failure(c.node_id)
        if lk.finished:
            break
    assert lk.finished and lk.result() == []

    # a late reply from a node already given up on does not bring it back
    a, b = (contact(x) for x in in_bucket(100, 2))
    lk = Lookup(target, [a, b], own_id=OWN, k=2, alpha=2)
    assert set(lk.next_queries()) == {a, b}
    lk.on_failure(a.node_id)
    lk.on_reply(a.node_id, [])
    lk.on_reply(b.node_id, [a, b, contact(OWN)])
    lk.on_reply(b.node_id, [])  # duplicate reply
    assert lk.finished and lk.result() == [b]


def test_lookup_waits_for_a_query_that_fell_out_of_the_top_k() -> None:
    target = as_id(0)
    x1, x2 = (contact(as_id((1 << 200) + i)) for i in range(2))
    y1, y2 = (contact(as_id(i + 1)) for i in range(2))
    lk = Lookup(target, [x1, x2], own_id=OWN, k=2, alpha=2)
    assert set(lk.next_queries()) == {x1, x2}
    lk.on_reply(x1.node_id, [y1, y2])  # closer nodes push x2 out of the top 2 while it is asked
    assert lk.next_queries() == [y1]  # x2 still counts against alpha
    lk.on_reply(y1.node_id, [])
    assert lk.next_queries() == [y2]
    lk.on_reply(y2.node_id, [])
    assert lk.in_flight() == 1 and not lk.finished
    assert lk.next_queries() == []
    lk.on_reply(x2.node_id, [])
    assert lk.finished and lk.result() == [y1, y2]


def test_small_swarm_gives_everyone() -> None:
    swarm = Swarm(10, 7)
    target = as_id(99)
    lookup, _ = start(swarm, target)
    result, _ = drive(lookup, swarm, random.Random(0))
    assert sorted(c.node_id for c in result) == sorted(swarm.ids[1:])


# -- records ------------------------------------------------------------------------------------

ALICE = Identity.from_seed(b"\x01" * 32)
BOB = Identity.from_seed(b"\x02" * 32)
FROM = {"pk": ALICE.public_key, "sig": bytes(72), "addr": None}


@functools.cache
def make(
    identity: Identity = ALICE,
    key: bytes = b"key",
    subkey: bytes = b"sub",
    value: bytes = b"value",
    *,
    expires: float = 1000.0,
    ttl: float = 10.0,
    now: float = 0.0,
) -> Record:
    """A record created by ``identity``; ``now`` is this node's clock, ``expires`` the signed expiry."""
    record = Record.create(identity, key, subkey, value, ttl, wall=expires - ttl, now=now)
    assert record.expires == expires and record.deadline == now + ttl
    return record


def wire_fields(record: Record, now: float) -> tuple:
    """What a STORE's decoder hands the core: to_wire, through the message schema."""
    data = m.encode(m.MsgType.STORE, {"rid": 1, "from": FROM, "records": [record.to_wire(now)]})
    body = m.decode(m.MsgType.STORE, data)
    return body["records"][0]


def test_record_round_trip_through_the_wire() -> None:
    r = make(now=5.0, ttl=30.0, expires=2000.0)
    fields = wire_fields(r, now=15.0)
    assert fields[4] == 20.0  # ttl left, relative
    back = Record.from_wire(fields, now=1000.0)
    assert back == dataclasses.replace(r, deadline=1020.0)
    assert back.owner == ALICE.public_key


@FAST
@given(
    key=st.binary(min_size=1, max_size=m.MAX_KEY),
    subkey=st.binary(max_size=m.MAX_SUBKEY),
    value=st.binary(max_size=m.MAX_VALUE),
    ttl=st.floats(0.01, m.MAX_TTL),
    wall=st.floats(0.0, 1e10),
    now=st.floats(0.0, 1e6),
    later=st.floats(0.0, 1e6),
)
def test_record_round_trip_property(
    key: bytes, subkey: bytes, value: bytes, ttl: float, wall: float, now: float, later: float
) -> None:
    r = Record.create(ALICE, key, subkey, value, ttl, wall=wall, now=now)
    fields = wire_fields(r, now)
    back = Record.from_wire(fields, later)
    assert (back.key, back.subkey, back.value, back.expires, back.owner, back.signature) == (
        key, subkey, value, r.expires, r.owner, r.signature,
    )
    assert back.deadline == pytest.approx(later + ttl, abs=1.01e-3)  # ttl goes up to the next ms (float: +1 ms)


def test_bad_signature_is_rejected() -> None:
    fields = list(make().to_wire(0.0))
    fields[6] = bytes([fields[6][0] ^ 1]) + fields[6][1:]
    with pytest.raises(WireError) as e:
        Record.from_wire(tuple(fields), 0.0)
    assert e.value.reason == "signature"


@pytest.mark.parametrize(
    ("index", "tampered"),
    [(0, b"other key"), (1, b"other sub"), (2, b"other value"), (3, 1000.5), (5, BOB.public_key)],
    ids=["key", "subkey", "value", "expires", "owner"],
)
def test_tampered_record_is_rejected(index: int, tampered: object) -> None:
    fields = list(make().to_wire(0.0))
    fields[index] = tampered
    with pytest.raises(WireError) as e:
        Record.from_wire(tuple(fields), 0.0)
    assert e.value.reason == "signature"


def test_ttl_is_not_signed_but_must_be_positive() -> None:
    fields = list(make().to_wire(0.0))
    fields[4] = 3.0
    assert Record.from_wire(tuple(fields), 50.0).deadline == 53.0
    fields[4] = 0.0
    with pytest.raises(WireError) as e:
        Record.from_wire(tuple(fields), 50.0)
    assert e.value.reason == "malformed"


@FAST
@given(expires=st.one_of(st.floats(0.0, 1e12), st.sampled_from([0.0, 1.0, 99.0, 1e12])))
def test_local_expiry_is_relative_whatever_the_writer_clock(expires: float) -> None:
    # The writer's clock may be far behind or far ahead of ours: only the relative ttl counts here.
    sig = ALICE.sign(signed_message(b"key", b"sub", b"value", expires))
    fields = (b"key", b"sub", b"value", expires, 10.0, ALICE.public_key, sig)
    record = Record.from_wire(fields, now=100.0)
    assert record.deadline == 110.0
    store = RecordStore()
    assert store.store(record, 100.0) is None
    assert store.get(b"key", 109.999) == [record]
    assert store.get(b"key", 110.0) == []


@pytest.mark.parametrize(
    ("key", "subkey", "value", "ttl"),
    [
        (b"k", b"", b"", 0.0),
        (b"k", b"", b"", -1.0),
        (b"k", b"", b"", m.MAX_TTL + 1),
        (b"k", b"", b"", float("nan")),
        (b"", b"", b"", 1.0),
        (b"k" * (m.MAX_KEY + 1), b"", b"", 1.0),
        (b"k", b"s" * (m.MAX_SUBKEY + 1), b"", 1.0),
        (b"k", b"", b"v" * (m.MAX_VALUE + 1), 1.0),
    ],
)
def test_record_create_checks_its_arguments(key: bytes, subkey: bytes, value: bytes, ttl: float) -> None:
    with pytest.raises(ValueError):
        Record.create(ALICE, key, subkey, value, ttl, wall=0.0, now=0.0)


def test_to_wire_ttl_counts_down() -> None:
    r = make(ttl=10.0, now=100.0)
    assert r.to_wire(100.0)[4] == 10.0
    assert r.to_wire(107.5)[4] == 2.5
    assert r.to_wire(200.0)[4] == 0.0
    assert r.ttl(200.0) == 0.0


# -- record store -------------------------------------------------------------------------------


def test_newest_expiry_wins() -> None:
    s = RecordStore()
    old = make(value=b"old", expires=1000.0)
    new = make(value=b"new", expires=1001.0)
    assert s.store(old, 0.0) is None
    assert s.store(new, 1.0) is None
    assert s.get(b"key", 2.0) == [new] and len(s) == 1
    assert s.store(old, 2.0) == "stale"
    assert s.get(b"key", 2.0) == [new]
    same_expiry = make(value=b"rival", expires=1001.0)
    assert s.store(same_expiry, 2.0) == "stale"  # same expiry, another value: the first one stays
    assert s.get(b"key", 2.0) == [new]


def test_same_record_again_extends_but_never_shortens_its_life() -> None:
    s = RecordStore()
    r = make(ttl=10.0, now=0.0)
    assert s.store(r, 0.0) is None
    again = dataclasses.replace(r, deadline=50.0)
    assert s.store(again, 5.0) is None
    assert s.get(b"key", 40.0) == [again]
    assert s.store(dataclasses.replace(r, deadline=20.0), 6.0) is None
    assert s.get(b"key", 40.0) == [again]
    assert len(s) == 1


def test_only_the_owner_writes_a_live_subkey() -> None:
    s = RecordStore()
    mine = make(ALICE, ttl=10.0, now=0.0, expires=1000.0)
    theirs = make(BOB, value=b"bob", ttl=10.0, now=5.0, expires=5000.0)
    assert s.store(mine, 0.0) is None
    assert s.store(theirs, 5.0) == "owner"
    assert s.get(b"key", 5.0) == [mine]
    assert s.store(dataclasses.replace(theirs, deadline=30.0), 10.0) is None  # alice's has expired
    assert [r.owner for r in s.get(b"key", 10.0)] == [BOB.public_key]
    assert len(s) == 1
    other_subkey = make(ALICE, subkey=b"alice's", now=10.0)
    assert s.store(other_subkey, 10.0) is None  # subkeys of one key have different owners
    assert len(s) == 2


def test_get_sorts_by_subkey_and_skips_expired() -> None:
    s = RecordStore()
    records = [make(subkey=sk, ttl=ttl) for sk, ttl in ((b"c", 10.0), (b"a", 20.0), (b"b", 5.0), (b"", 30.0))]
    for r in records:
        assert s.store(r, 0.0) is None
    s.store(make(key=b"elsewhere"), 0.0)
    assert [r.subkey for r in s.get(b"key", 0.0)] == [b"", b"a", b"b", b"c"]
    assert [r.subkey for r in s.get(b"key", 5.0)] == [b"", b"a", b"c"]  # b's deadline is 5.0
    assert [r.subkey for r in s.get(b"key", 15.0)] == [b"", b"a"]
    assert s.get(b"missing", 0.0) == []
    assert len(s) == 5  # expired records are kept until expire()
    assert len(s.records(15.0)) == 2
    s.expire(15.0)
    assert len(s) == 2
    s.expire(100.0)
    assert len(s) == 0 and s.records(0.0) == [] and s.get(b"key", 0.0) == []


def test_max_subkeys() -> None:
    s = RecordStore(max_subkeys=3)
    for i, ttl in enumerate((10.0, 20.0, 20.0)):
        assert s.store(make(subkey=b"%d" % i, ttl=ttl), 0.0) is None
    assert s.store(make(subkey=b"x"), 1.0) == "full"
    assert s.store(make(subkey=b"0", expires=1001.0), 1.0) is None  # a subkey already held may be renewed
    assert s.store(make(key=b"other", subkey=b"x"), 1.0) is None  # the bound is per key
    assert s.store(make(subkey=b"y", ttl=30.0, now=15.0), 15.0) is None  # "0" expired at 10: room again
    assert s.store(make(subkey=b"z", ttl=30.0, now=15.0), 15.0) == "full"
    assert [r.subkey for r in s.get(b"key", 15.0)] == [b"1", b"2", b"y"]
    s2 = RecordStore(max_subkeys=2)
    s2.store(make(subkey=b"a", ttl=10.0), 0.0)
    s2.store(make(subkey=b"b", ttl=20.0), 0.0)
    assert s2.store(make(subkey=b"c", now=10.0), 10.0) is None  # a's expiry made room
    assert [r.subkey for r in s2.get(b"key", 10.0)] == [b"b", b"c"]
    assert len(s2) == 2


def test_max_records_keeps_the_keys_nearest_own_id() -> None:
    s = RecordStore(OWN, max_records=2)
    near, mid, far = sorted((b"a", b"b", b"c", b"d", b"e"), key=s.distance)[:3]
    assert s.store(make(key=mid, ttl=10.0), 0.0) is None
    assert s.store(make(key=far, ttl=20.0), 0.0) is None
    assert s.store(make(key=near, ttl=30.0), 1.0) is None  # nearer than the farthest: evicts it
    assert sorted(r.key for r in s.records(1.0)) == sorted([near, mid]) and len(s) == 2
    assert s.store(make(key=far, ttl=20.0), 1.0) == "full"  # farther than every key held: refused
    assert s.store(make(key=mid, expires=1001.0), 1.0) is None  # replacing does not grow the store
    assert len(s) == 2
    assert s.store(make(key=far, now=35.0), 35.0) is None  # both expired: room again
    assert len(s) == 1
    assert [r.key for r in s.records(35.0)] == [far]


@pytest.mark.parametrize("bound", ["max_subkeys", "max_records"])
def test_store_at_a_bound_after_the_key_expired_keeps_the_record(bound: str) -> None:
    s = RecordStore(**{bound: 1})
    assert s.store(make(subkey=b"a", ttl=10.0), 0.0) is None
    fresh = make(subkey=b"b", ttl=10.0, now=20.0)
    assert s.store(fresh, 20.0) is None
    assert s.get(b"key", 20.0) == [fresh]
    assert len(s) == 1 == len(s.records(20.0))


# A small world for random store operations, checked against a dict model.
OWNERS = (ALICE, BOB)


@functools.cache
def _signed(owner: int, key: bytes, subkey: bytes, value: bytes, expires: float) -> Record:
    ident = OWNERS[owner]
    sig = ident.sign(signed_message(key, subkey, value, expires))
    return Record(key, subkey, value, expires, ident.public_key, sig, 0.0)


store_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.integers(0, 1),
            st.sampled_from([b"k1", b"k2"]),
            st.sampled_from([b"a", b"b", b"c"]),
            st.sampled_from([b"v1", b"v2"]),
            st.sampled_from([100.0, 200.0, 300.0]),
            st.sampled_from([3.0, 10.0, 30.0]),
        ),
        st.tuples(st.just("tick"), st.floats(0.0, 12.0)),
        st.tuples(st.just("expire")),
    ),
    max_size=60,
)


@FAST
@given(store_ops)
def test_store_matches_a_model(ops: list[tuple]) -> None:
    s = RecordStore()
    model: dict[tuple[bytes, bytes], Record] = {}
    now = 0.0
    for op in ops:
        if op[0] == "tick":
            now += op[1]
        elif op[0] == "expire":
            s.expire(now)
            model = {slot: r for slot, r in model.items() if r.deadline > now}
            assert len(s) == len(model)
        else:
            _, owner, key, subkey, value, expires, ttl = op
            record = dataclasses.replace(_signed(owner, key, subkey, value, expires), deadline=now + ttl)
            cur = model.get((key, subkey))
            if cur is not None and cur.deadline <= now:
                cur = None
            want: str | None = None
            if cur is not None:
                if cur.owner != record.owner:
                    want = "owner"
                elif record.expires < cur.expires or (
                    record.expires == cur.expires and record.signature != cur.signature
                ):
                    want = "stale"
                elif record.expires == cur.expires and record.deadline <= cur.deadline:
                    record = cur
            assert s.store(record, now) == want
            if want is None:
                model[(key, subkey)] = record
        for key in (b"k1", b"k2"):
            live = sorted((r for (k, _), r in model.items() if k == key and r.deadline > now), key=lambda r: r.subkey)
            assert s.get(key, now) == live
        assert len(s) >= len(s.records(now))


def test_merge_newest() -> None:
    a1 = make(ALICE, subkey=b"x", value=b"1", expires=100.0)
    a2 = make(ALICE, subkey=b"x", value=b"2", expires=200.0)
    a3 = make(ALICE, subkey=b"x", value=b"3", expires=150.0)
    b1 = make(BOB, subkey=b"x", value=b"b", expires=50.0)
    c = make(ALICE, subkey=b"a", expires=10.0)
    other = make(ALICE, key=b"aaa", subkey=b"z", expires=10.0)
    for order in ([a1, a2, a3, b1, c, other], [other, c, b1, a3, a2, a1], [a3, b1, a2, other, a1, c, a2]):
        merged = merge_newest(order)
        assert [(r.key, r.subkey) for r in merged] == [(b"aaa", b"z"), (b"key", b"a"), (b"key", b"x"), (b"key", b"x")]
        assert a2 in merged and b1 in merged and a1 not in merged and a3 not in merged
    assert merge_newest([]) == []


@FAST
@given(st.permutations(list(range(8))))
def test_merge_newest_ignores_arrival_order(perm: list[int]) -> None:
    # slots (owner, subkey): i and i + 4 share one; the later, with the larger expiry, wins
    records = [make(OWNERS[i % 2], subkey=b"s%d" % (i // 2 % 2), expires=100.0 + i) for i in range(8)]
    merged = merge_newest([records[i] for i in perm])
    assert sorted(merged, key=lambda r: r.expires) == records[4:]
    assert [r.subkey for r in merged] == sorted(r.subkey for r in merged)


# -- request handling ---------------------------------------------------------------------------


def encoded(mtype: m.MsgType, response: dict) -> dict:
    """The response as a peer decodes it: checks it fits the message schema."""
    return m.decode(mtype, m.encode(mtype, {"rid": 7, "from": FROM, **response}))


def populated_core(n: int = 100, seed: int = 0) -> DhtCore:
    core = DhtCore(OWN)
    rng = random.Random(seed)
    for i in range(n):
        core.table.observe(Contact(as_id(rng.getrandbits(256)), f"10.0.{i // 250}.{i % 250 + 1}", 4000 + i))
    return core


def test_handle_ping_and_find_node() -> None:
    core = populated_core()
    assert core.handle(m.MsgType.PING, {}, 0.0) == {}
    target = as_id(random.Random(9).getrandbits(256))
    response = core.handle(m.MsgType.FIND_NODE, {"target": target}, 0.0)
    expect = core.table.closest(target)
    assert len(expect) == 20
    assert response == {"nodes": pack_contacts(expect)}
    assert unpack_contacts(encoded(m.MsgType.NODES, response)["nodes"]) == expect


@FAST
@given(st.lists(st.tuples(st.sampled_from(["observe", "move", "remove", "ask", "evict"]), st.integers(0, 63),
                          st.integers(0, 7)), max_size=80))
def test_kept_answers_are_what_the_table_answers_now(ops: list[tuple[str, int, int]]) -> None:
    """The contacts a FIND_NODE or FIND_VALUE answer carries, kept per target (DhtCore.wire_closest), are always
    what the table answers at that moment: after contacts enter, leave, change address or are evicted."""
    core = DhtCore(OWN, k=4)  # small buckets: full ones, replacements and evictions come quickly
    rng = random.Random(3)
    ids = [as_id(rng.getrandbits(256)) for _ in range(64)]
    targets = [as_id(rng.getrandbits(256)) for _ in range(8)]
    for op, i, j in ops:
        if op == "observe":
            core.heard(Contact(ids[i], "10.0.0.1", 7000 + i))
            for ping in core.take_actions():
                if j % 2:
                    core.pinged(ping, None)  # the oldest did not answer: the newcomer takes its place
        elif op == "move":
            core.heard(Contact(ids[i], "10.0.0.2", 9000 + j))
            core.take_actions()
        elif op == "remove":
            held = [c for c in core.table.contacts() if c.node_id == ids[i]]
            core.failed(held[0] if held else Contact(ids[i], "10.0.0.1", 7000 + i))
        elif op == "evict":
            core.table.remove(ids[i])
        for target in (targets[j], location(b"key%d" % j)):
            want = pack_contacts(core.table.closest(target))
            assert core.handle(m.MsgType.FIND_NODE, {"target": target}, 0.0) == {"nodes": want}
        response = core.handle(m.MsgType.FIND_VALUE, {"key": b"key%d" % j, "offset": 0}, 0.0)
        assert response["nodes"] == pack_contacts(core.table.closest(location(b"key%d" % j)))


def test_kept_answers_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("peerd.dht.core.WIRE_NODES_MAX", 5)
    core = populated_core()
    for i in range(40):
        core.handle(m.MsgType.FIND_NODE, {"target": as_id(i)}, 0.0)
        assert len(core._wire_nodes) <= 5


def test_handle_rejects_non_requests() -> None:
    core = DhtCore(OWN)
    for mtype in (m.MsgType.PONG, m.MsgType.NODES, m.MsgType.VALUE, m.MsgType.STORED, m.MsgType.ERROR):
        with pytest.raises(WireError) as e:
            core.handle(mtype, {}, 0.0)
        assert e.value.reason == "type"


def test_find_value_pages_with_offset_and_total() -> None:
    core = populated_core()
    records = [make(subkey=b"%03d" % i, value=b"v%d" % i, ttl=100.0 if i % 10 else 5.0) for i in range(45)]
    for r in reversed(records):
        assert core.store.store(r, 0.0) is None
    core.store.store(make(key=b"neighbour"), 0.0)
    now = 10.0  # the 5 records with ttl 5 have expired
    live = [r for r in records if r.deadline > now]
    assert len(live) == 40

    pages, offset = [], 0
    while True:
        response = core.handle(m.MsgType.FIND_VALUE, {"key": b"key", "offset": offset}, now)
        body = encoded(m.MsgType.VALUE, response)
        assert body["total"] == 40
        if offset == 0:
            assert unpack_contacts(body["nodes"]) == core.table.closest(location(b"key"))
        else:
            assert body["nodes"] == []
        if not body["records"]:
            break
        assert len(body["records"]) <= m.MAX_RECORDS
        pages.append(len(body["records"]))
        offset += len(body["records"])
        for fields in body["records"]:
            got = Record.from_wire(fields, 1000.0)  # every record still verifies at the reader
            assert got.deadline == 1000.0 + 90.0
    assert pages == [16, 16, 8]

    everything = []
    for off in (0, 16, 32):
        everything += core.handle(m.MsgType.FIND_VALUE, {"key": b"key", "offset": off}, now)["records"]
    assert [f[1] for f in everything] == [r.subkey for r in live]  # sorted by subkey, no gaps or repeats

    beyond = core.handle(m.MsgType.FIND_VALUE, {"key": b"key", "offset": 500}, now)
    assert beyond == {"records": [], "total": 40, "nodes": [], **({"have": b""} if HELD_ON_WIRE else {})}
    missing = core.handle(m.MsgType.FIND_VALUE, {"key": b"nothing here", "offset": 0}, now)
    assert missing["records"] == [] and missing["total"] == 0
    assert missing["nodes"] == pack_contacts(core.table.closest(location(b"nothing here")))


def test_store_answers_ok_per_record_and_counts_refusals() -> None:
    core = DhtCore(OWN, store=RecordStore(max_subkeys=3))
    held = make(ALICE, subkey=b"held", expires=500.0, ttl=100.0)
    assert core.store.store(held, 0.0) is None

    good = make(ALICE, subkey=b"new", expires=900.0, ttl=100.0)
    forged = list(make(ALICE, subkey=b"forged").to_wire(0.0))
    forged[2] = b"not what alice signed"
    older = make(ALICE, subkey=b"held", expires=400.0, ttl=100.0)
    bobs = make(BOB, subkey=b"held", expires=600.0, ttl=100.0)
    body = {"records": [wire_fields(good, 0.0), tuple(forged), wire_fields(older, 0.0), wire_fields(bobs, 0.0)]}
    response = core.handle(m.MsgType.STORE, body, 1.0)
    assert response == {"ok": [True, False, False, False]}
    assert encoded(m.MsgType.STORED, response)["ok"] == [True, False, False, False]
    assert core.refused == {"signature": 1, "stale": 1, "owner": 1}
    assert [r.subkey for r in core.store.get(b"key", 1.0)] == [b"held", b"new"]
    assert core.store.get(b"key", 1.0)[1].deadline == 101.0  # the ttl counts from when it arrived

    newer = make(ALICE, subkey=b"held", expires=700.0, ttl=100.0)
    third = make(ALICE, subkey=b"third")
    fourth = make(ALICE, subkey=b"fourth")
    no_time = list(make(ALICE, subkey=b"x").to_wire(0.0))
    no_time[4] = 0.0
    body = {"records": [wire_fields(newer, 0.0), wire_fields(third, 0.0), wire_fields(fourth, 0.0), tuple(no_time)]}
    assert core.handle(m.MsgType.STORE, body, 2.0) == {"ok": [True, True, False, False]}
    assert core.refused == {"signature": 1, "stale": 1, "owner": 1, "full": 1, "malformed": 1}
    assert core.store.get(b"key", 2.0)[0].expires == 700.0
    assert core.handle(m.MsgType.STORE, {"records": []}, 3.0) == {"ok": []}


_ANY_IP = st.one_of(
    st.sampled_from([bytes([127, 0, 0, 1]), bytes([10, 1, 2, 3]), bytes(4), b"\xff" * 4, bytes([224, 0, 0, 1]),
                     bytes(16), b"\xff" + bytes(15), bytes(10) + b"\xff\xff" + bytes([0, 1, 2, 3])]),
    st.binary(min_size=0, max_size=17),
    st.integers(),
    st.none(),
)
_ANY_CONTACT = st.one_of(
    st.tuples(st.one_of(st.binary(min_size=31, max_size=33), st.text(max_size=2)), _ANY_IP,
              st.one_of(st.integers(-1, 70000), st.booleans(), st.floats(allow_nan=False))).map(list),
    st.lists(st.binary(max_size=4), max_size=4),
    st.binary(max_size=3),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.lists(_ANY_CONTACT, max_size=22), st.binary(max_size=2), st.none()))
def test_the_fast_contact_decoder_is_the_generic_one(raw) -> None:
    """NODES/VALUE ``nodes`` decode through a fast path with an address cache (issue 20: 8 us per contact, twice
    per answer, was most of an RPC's CPU): same values, and the same first error, as the generic validators."""

    def outcome(check):
        try:
            return check(raw)
        except WireError as e:
            return ("error", e.reason, e.detail)

    generic = m.s.array_of(m.CONTACT, m.MAX_CONTACTS)
    fast = m.contacts(m.MAX_CONTACTS)
    assert outcome(fast) == outcome(generic)
    assert outcome(fast) == outcome(generic)  # the second time from the cache


def test_the_fast_contact_decoder_decodes_good_contacts_and_refuses_bad_ones() -> None:
    good = [[bytes([i]) * 32, bytes([127, 0, 0, i + 1]), 4000 + i] for i in range(20)]
    fast = m.contacts(m.MAX_CONTACTS)
    want = [(bytes([i]) * 32, f"127.0.0.{i + 1}", 4000 + i) for i in range(20)]
    assert fast(good) == want and fast(good) == want
    for bad in ([*good[:5], [bytes(32), bytes(4), 1]], [*good, good[0]], [[bytes(32), bytes([127, 0, 0, 1]), 0]]):
        with pytest.raises(WireError):
            fast(bad)


def _one_bucket(count: int) -> list[Contact]:
    """``count`` contacts that all fall in OWN's farthest bucket (the top bit differs from OWN's)."""
    rng = random.Random(9)
    top = 1 << (ID_BITS - 1)
    own = int.from_bytes(OWN, "big")
    out = []
    for i in range(count):
        num = (own ^ top) & ~(top - 1) | rng.getrandbits(ID_BITS - 1)
        out.append(Contact(as_id(num), "10.0.0.3", 7000 + i))
    assert len({bucket_index(OWN, c.node_id) for c in out}) == 1
    return out


def test_a_full_bucket_pings_its_oldest_at_most_once_per_evict_check() -> None:
    """Each newcomer heard by a full bucket asked for a PING of its oldest contact (once the last one ended):
    at 64 daemons, one more daemon woken for about every third DHT request. Given the time, a bucket asks at most
    once per EVICT_CHECK_S; without it (the old callers), as before."""
    from peerd.dht.routing import EVICT_CHECK_S

    table = RoutingTable(OWN, k=4)
    first, *rest = _one_bucket(8)
    for c in [first, *rest[:3]]:
        assert table.observe(c, now=0.0) is None
    assert table.observe(rest[3], now=1.0) == first  # full: ping the oldest
    table.ping_result(first, True)
    assert table.observe(rest[4], now=2.0) is None  # checked a second ago
    assert table.observe(rest[5], now=1.0 + EVICT_CHECK_S - 0.01) is None
    oldest = next(iter(table.buckets[bucket_index(OWN, first.node_id)].contacts.values()))
    assert table.observe(rest[6], now=1.0 + EVICT_CHECK_S) == oldest
    table.ping_result(oldest, False)  # it did not answer: the freshest replacement takes its place
    assert rest[6].node_id in table and oldest.node_id not in table
    untimed = RoutingTable(OWN, k=4)
    for c in [first, *rest[:3]]:
        untimed.observe(c)
    assert untimed.observe(rest[3]) == first
    untimed.ping_result(first, True)
    assert untimed.observe(rest[4]) is not None


def test_a_request_from_a_waiting_replacement_is_not_verified_again() -> None:
    """A sender that answered before and waits as a replacement (its bucket is full) is heard, not PINGed to
    verify it on every request; at another address it is verified again."""
    core = DhtCore(OWN, k=4)
    contacts = _one_bucket(6)
    for c in contacts[:4]:
        core.heard(c, 0.0)
    newcomer = contacts[4]
    core.request_from(newcomer, 0.0)
    [ping] = core.take_actions()
    assert ping.why == "verify"
    core.pinged(ping, newcomer, 0.0)  # it answered: a replacement, and the oldest is checked
    [evict] = core.take_actions()
    assert evict.why == "evict"
    core.pinged(evict, evict.contact, 0.0)
    assert core.take_actions() == []
    assert core.table.waiting(newcomer) and newcomer.node_id not in core.table
    core.request_from(newcomer, 1.0)
    assert core.take_actions() == []  # no verify PING, and no second evict PING yet
    moved = Contact(newcomer.node_id, "10.0.0.9", 9999)
    core.request_from(moved, 2.0)
    [again] = core.take_actions()
    assert again.why == "verify"
    stats = core.statistics()
    assert (stats.contacts, stats.verifying, stats.refused) == (4, 1, {})


def test_a_record_lookup_looks_for_the_replicas_and_only_the_others_when_this_node_is_one() -> None:
    core = DhtCore(OWN, k=20, replicas=5)
    rng = random.Random(4)
    for i in range(40):
        core.heard(Contact(as_id(rng.getrandbits(256)), "10.0.0.4", 7000 + i))
    assert core.start_lookup(as_id(rng.getrandbits(256)), 0.0, alpha=3).k == 20
    far = as_id(int.from_bytes(OWN, "big") ^ (1 << (ID_BITS - 1)))  # every contact in that half is closer
    assert core.table.closer_than_me(far, 5) == 5
    assert core.start_lookup(far, 0.0, alpha=3, record=True).k == 5
    assert core.start_lookup(OWN, 0.0, alpha=3, record=True).k == 4  # its own id: this node is the closest


def _ids(n: int) -> list[bytes]:
    """``n`` node ids at increasing distance from the all-zero target."""
    return [(i + 1).to_bytes(32, "big") for i in range(n)]


@pytest.mark.parametrize("retry_slow", [True, False])
def test_a_record_lookup_asks_a_slow_close_contact_once_more_before_it_ends(retry_slow: bool) -> None:
    """A record lives only at the few closest: a holder whose query (or answer) was lost once turns slow, and a
    record's lookup asks it again before ending rather than end without it; a plain lookup passes over it."""
    target = bytes(32)
    ids = _ids(4)
    lookup = Lookup(target, [contact(i) for i in ids], own_id=OWN, k=3, alpha=3, retry_slow=retry_slow)
    first = lookup.next_queries()
    assert [c.node_id for c in first] == ids[:3]
    lookup.on_slow(ids[0])  # the closest holder's datagram was lost
    assert [c.node_id for c in lookup.next_queries()] == [ids[3]]
    for node_id in ids[1:]:
        lookup.on_reply(node_id, [])
    again = lookup.next_queries()
    if not retry_slow:
        assert again == [] and lookup.finished and ids[0] not in {c.node_id for c in lookup.result()}
        return
    assert [c.node_id for c in again] == [ids[0]] and not lookup.finished
    lookup.on_slow(ids[0])  # slow again: asked once only, then the lookup ends without it
    assert lookup.next_queries() == [] and lookup.finished
    lookup2 = Lookup(target, [contact(i) for i in ids], own_id=OWN, k=3, alpha=3, retry_slow=True)
    lookup2.next_queries()
    lookup2.on_slow(ids[0])
    lookup2.next_queries()
    for node_id in ids[1:]:
        lookup2.on_reply(node_id, [])
    lookup2.next_queries()
    lookup2.on_reply(ids[0], [])  # the second ask answered: the holder is among the result
    assert lookup2.finished and ids[0] in {c.node_id for c in lookup2.result()}
