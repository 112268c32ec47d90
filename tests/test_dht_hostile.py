"""The DHT against hostile members (issue 11): every member holds the swarm key and mints ids at will.

Sans-I/O store and core tests with injected time, then a few swarms over the in-memory network
(virtual time) with one member that answers FIND_VALUE the way an attacker would.
"""

from __future__ import annotations

import functools
import random
import time

import pytest
import trio

from peerd.dht.core import DhtCore
from peerd.dht.records import Record, RecordStore, location, named_node, slot_allows
from peerd.dht.routing import Contact, RoutingTable, distance
from peerd.dht.service import MAX_READ
from peerd.transport.endpoint import Incoming
from peerd.wire import messages as m
from peerd.wire.identity import Identity

from .support.dht_swarm import start_swarm
from .support.memnet import MemNet, run_on_memnet
from .support.virtual import counter_value

ALICE = Identity.from_seed(b"\x01" * 32)
BOB = Identity.from_seed(b"\x02" * 32)
MALLORY = Identity.from_seed(b"\x03" * 32)
FROM = {"pk": MALLORY.public_key, "sig": bytes(72), "addr": None}
OWN = random.Random(1).randbytes(32)


@functools.cache
def make(identity: Identity = ALICE, key: bytes = b"key", subkey: bytes = b"sub", *, ttl: float = 10.0,
         now: float = 0.0, expires: float = 1000.0) -> Record:
    return Record.create(identity, key, subkey, b"value", ttl, wall=expires - ttl, now=now)


def fake(key: bytes, owner: bytes, *, subkey: bytes = b"", deadline: float = 1e9) -> Record:
    """A record put straight into a store (the store never checks signatures: its callers do)."""
    return Record(key, subkey, b"v" * 100, 1e9, owner, bytes(64), deadline)


def store_body(records: list[Record], now: float) -> dict:
    """A STORE body as the core gets it: through the message schema."""
    data = m.encode(m.MsgType.STORE, {"rid": 1, "from": FROM, "records": [r.to_wire(now) for r in records]})
    return m.decode(m.MsgType.STORE, data)


class NoScan(dict):
    """A key map that fails the test when anything walks all of it."""

    def __iter__(self):
        raise AssertionError("the store scanned every key")

    keys = values = items = __iter__


# -- finding 3: a full store is no CPU sink -------------------------------------------------------


def test_refused_store_at_a_full_store_costs_no_scan_and_no_signature_check(verify_calls: list[int]) -> None:
    rng = random.Random(3)
    store = RecordStore(OWN, max_records=100_000)
    owners = [rng.randbytes(32) for _ in range(200)]
    for i in range(100_000):
        assert store.store(fake(b"fill/%d" % i, owners[i % 200]), 0.0) is None
    store._by_key = NoScan(store._by_key)
    core = DhtCore(OWN, store=store)
    for i in range(300):
        core.table.observe(Contact(rng.randbytes(32), f"10.0.{i // 250}.{i % 250 + 1}", 4000))
    keys = [k for k in (b"attack/%d" % i for i in range(400)) if not core.responsible(k)]
    body = store_body([make(MALLORY, key) for key in keys[:16]], 1.0)
    verify_calls[0] = 0
    times = []
    for rep in range(5):
        start = time.perf_counter()
        assert core.handle(m.MsgType.STORE, body, 1.0 + rep) == {"ok": [False] * 16}
        times.append(time.perf_counter() - start)
    assert verify_calls[0] == 0  # refused before any Ed25519 check
    assert core.refused == {"far": 80}
    # Was about 174 ms (a scan of 100k records per refused record); now tens of microseconds. The bound
    # leaves a wide margin for a loaded CI machine.
    assert min(times) < 0.025, times
    assert len(store) == 100_000


def test_per_owner_quota() -> None:
    s = RecordStore(OWN, max_per_owner=3)
    for i in range(3):
        assert s.store(make(ALICE, b"k%d" % i, ttl=10.0 + i), 0.0) is None
    assert s.store(make(ALICE, b"k3"), 0.0) == "quota"
    assert s.store(make(ALICE, b"k0", subkey=b"other"), 0.0) == "quota"  # per owner, whatever the key
    assert s.store(make(ALICE, b"k1", expires=2000.0, ttl=50.0), 1.0) is None  # renewing a held slot is fine
    assert s.store(make(BOB, b"k4", ttl=30.0), 1.0) is None  # another owner has its own quota
    assert s.store(make(ALICE, b"k3", now=10.0), 10.0) is None  # k0 expired at 10: room again
    assert len(s) == 4


@pytest.mark.parametrize("seed", range(4))
def test_a_full_store_keeps_the_keys_nearest_its_id(seed: int) -> None:
    rng = random.Random(seed)
    own = rng.randbytes(32)
    s = RecordStore(own, max_records=50)
    keys = [b"key/%d/%d" % (seed, i) for i in range(400)]
    owners = [rng.randbytes(32) for _ in range(8)]
    for i, key in enumerate(keys):
        why = s.store(fake(key, owners[i % 8], subkey=b"s"), 0.0)
        assert why in (None, "full")
        assert len(s) == min(i + 1, 50)
    held = sorted(r.key for r in s.records(0.0))
    nearest = sorted(sorted(keys, key=lambda k: distance(location(k), own))[:50])
    assert held == nearest


def test_expiry_is_incremental_and_its_heaps_stay_bounded() -> None:
    s = RecordStore(OWN, max_records=10_000, max_per_owner=10_000)
    for i in range(2000):
        assert s.store(fake(b"k%d" % i, b"o" * 32, deadline=float(i + 1)), 0.0) is None
    s._by_key = NoScan(s._by_key)
    s.expire(500.0)  # pops the 500 due records, walks nothing else
    assert len(s) == 1500
    assert s.get(b"k499", 0.0) == [] and len(s.get(b"k500", 0.0)) == 1
    s.expire(500.0)
    assert len(s) == 1500
    # A member renewing one record over and over (the ttl is not signed) leaves no trail behind.
    s = RecordStore(OWN)
    r = make(MALLORY, b"renewed", ttl=5.0)
    for i in range(5000):
        assert s.store(Record(r.key, r.subkey, r.value, r.expires, r.owner, r.signature, 10.0 + i), 1.0) is None
    assert len(s) == 1 and s.get(b"renewed", 1.0)[0].deadline == 5009.0
    assert len(s._deadlines) <= 2 * len(s) + 1025
    s.expire(5009.0)
    assert len(s) == 0


def test_far_keys_are_refused_once_over_half_full(verify_calls: list[int]) -> None:
    rng = random.Random(5)
    core = DhtCore(OWN, k=2, store=RecordStore(OWN, max_records=20))
    for _ in range(200):
        core.table.observe(Contact(rng.randbytes(32), "10.0.0.1", 4000))
    keys = [b"k%d" % i for i in range(2000)]
    near = [k for k in keys if core.responsible(k)]
    far = [k for k in keys if not core.responsible(k)]
    assert len(near) >= 12 and len(far) > 1000
    for key in far[:9]:  # under half full: any key is taken
        assert core.handle(m.MsgType.STORE, store_body([make(ALICE, key)], 0.0), 0.0) == {"ok": [True]}
    assert core.handle(m.MsgType.STORE, store_body([make(BOB, near[0])], 0.0), 0.0) == {"ok": [True]}
    assert core.store.loaded
    verify_calls[0] = 0
    body = store_body([make(MALLORY, key) for key in far[9:25]], 0.0)
    assert core.handle(m.MsgType.STORE, body, 0.0) == {"ok": [False] * 16}
    assert verify_calls[0] == 0 and core.refused == {"far": 16}
    renewal = make(ALICE, far[0], expires=2000.0)  # a slot already held may be renewed
    assert core.handle(m.MsgType.STORE, store_body([renewal], 0.0), 0.0) == {"ok": [True]}
    body = store_body([make(BOB, key) for key in near[1:11]], 0.0)  # keys it is responsible for still go in
    assert core.handle(m.MsgType.STORE, body, 0.0) == {"ok": [True] * 10}
    assert len(core.store) == 20


@pytest.mark.parametrize("seed", range(6))
def test_closer_than_me_counts_what_a_scan_would(seed: int) -> None:
    rng = random.Random(seed)
    own = rng.randbytes(32)
    table = RoutingTable(own, k=4)
    ids = [rng.randbytes(32) for _ in range(60)]
    # ids sharing long prefixes with own, so that low buckets are occupied too
    ids += [(int.from_bytes(own, "big") ^ rng.getrandbits(rng.randrange(1, 40))).to_bytes(32, "big")
            for _ in range(40)]
    for node_id in ids:
        table.observe(Contact(node_id, "10.0.0.1", 4000))
    for _ in range(2):
        for _ in range(200):
            target = rng.randbytes(32) if rng.random() < 0.5 else rng.choice(ids)
            mine = distance(own, target)
            truth = sum(1 for c in table.contacts() if distance(c.node_id, target) < mine)
            for limit in (1, 3, 8, 1000):
                assert table.closer_than_me(target, limit) == min(truth, limit)
        for c in table.contacts()[::2]:  # removals empty some buckets
            table.remove(c.node_id)


# -- finding 7: a subkey that names a node is that node's alone -------------------------------------


def test_named_node() -> None:
    node = ALICE.node_id
    assert named_node(node) == node
    assert named_node(node.hex().encode()) == node
    assert named_node(node.hex().upper().encode()) is None  # only lowercase hex names a node
    assert named_node(b"grid") is None and named_node(b"") is None and named_node(b"x" * 64) is None
    assert named_node(bytes(31)) is None and named_node(b"a" * 63) is None
    assert slot_allows(node, ALICE.public_key) and slot_allows(node.hex().encode(), ALICE.public_key)
    assert not slot_allows(node, MALLORY.public_key)
    assert not slot_allows(node.hex().encode(), MALLORY.public_key)
    assert slot_allows(b"grid", MALLORY.public_key)


def test_slots_naming_a_node_refuse_every_other_owner(verify_calls: list[int]) -> None:
    victim = ALICE.node_id
    s = RecordStore(OWN)
    for subkey in (victim, victim.hex().encode()):
        assert s.store(make(MALLORY, b"run/progress", subkey), 0.0) == "slot"
        assert s.store(make(ALICE, b"run/progress", subkey), 0.0) is None  # the victim writes its own
    assert s.store(make(MALLORY, b"run/progress", MALLORY.node_id), 0.0) is None
    core = DhtCore(OWN, on_refused=(refusals := []).append)
    body = store_body([make(MALLORY, b"peerd/state/run", victim.hex().encode()), make(MALLORY, b"k", victim)], 0.0)
    verify_calls[0] = 0
    assert core.handle(m.MsgType.STORE, body, 0.0) == {"ok": [False, False]}
    assert verify_calls[0] == 0 and core.refused == {"slot": 2} and refusals == ["slot", "slot"]
    body = store_body([make(ALICE, b"peerd/state/run", victim.hex().encode())], 0.0)
    assert core.handle(m.MsgType.STORE, body, 0.0) == {"ok": [True]}


# -- swarms with one hostile member --------------------------------------------------------------


@functools.cache
def attacker_record(key: bytes, index: int) -> Record:
    return make(MALLORY, key, b"%08d" % index, ttl=600.0)


def serve_hostile_values(node, handler) -> list[int]:
    """Make ``node`` answer FIND_VALUE with ``handler(body) -> (records, total)``; returns the offsets asked."""
    asked: list[int] = []

    def on_find_value(incoming: Incoming) -> dict:
        now = trio.current_time()
        honest = node.dht.core.handle(incoming.mtype, incoming.body, now)
        asked.append(incoming.body["offset"])
        records, total = handler(incoming.body)
        return {**honest, "records": [r.to_wire(now) for r in records], "total": total}

    node.endpoint.on_request(m.MsgType.FIND_VALUE, on_find_value)
    return asked


def test_get_reads_a_hostile_responder_for_max_read_records_and_no_longer() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await start_swarm(nursery, net, 6, replicas=6)  # every node holds: the hostile one is read
        asked = serve_hostile_values(nodes[5], lambda b: (
            [attacker_record(b["key"], b["offset"] + i) for i in range(m.MAX_RECORDS)], 65535))
        await nodes[1].dht.put(b"big", b"honest", b"1", ttl=600)
        records = await nodes[0].dht.get(b"big")
        assert (b"honest", b"1") in [(r.subkey, r.value) for r in records]
        pages = len(asked)
        assert max(asked) < MAX_READ, asked  # it claims 65535 records: at most MAX_READ are read
        await trio.sleep(60)
        assert len(asked) == pages
        # One record a page: a reader would page for seconds. It does no longer than its lookup runs.
        asked = serve_hostile_values(nodes[5], lambda b: ([attacker_record(b["key"], b["offset"])], 65535))
        await nodes[0].dht.get(b"big")
        pages = len(asked)
        assert pages < MAX_READ, pages
        await trio.sleep(60)
        assert len(asked) == pages  # nothing went on reading after the get returned

    run_on_memnet(main, seed=21)


def test_readers_ignore_forged_slots_and_stop_reading_that_responder() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await start_swarm(nursery, net, 6, replicas=6)  # every node holds: the hostile one is read
        victim = nodes[2].identity.node_id
        forged = [make(MALLORY, b"run/progress", victim, ttl=600.0)]
        forged += [attacker_record(b"run/progress", i) for i in range(m.MAX_RECORDS - 1)]
        asked = serve_hostile_values(nodes[5], lambda b: (forged, 65535))
        await nodes[2].dht.put(b"run/progress", victim, b"7", ttl=600)
        records = await nodes[0].dht.get(b"run/progress")
        assert [(r.subkey, r.owner) for r in records] == [(victim, nodes[2].identity.public_key)]
        assert counter_value(nodes[0].metrics.ignored_records, kind="dht", reason="slot") >= 1
        assert asked == [0]  # the first page gave it away: no second page is asked

    run_on_memnet(main, seed=22)


def test_a_member_cannot_squat_another_nodes_subkey() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await start_swarm(nursery, net, 6, replicas=6)  # every node holds: the hostile one is read
        victim, mallory = nodes[2], nodes[4]
        slot = victim.identity.node_id.hex().encode()
        with pytest.raises(ValueError, match="names another node"):
            await mallory.dht.put(b"peerd/state/run", slot, b"evil", ttl=600)
        # ... and past its own checks, straight to every node: all refuse it
        squat = Record.create(mallory.identity, b"peerd/state/run", slot, b"evil", 600.0,
                              wall=time.time(), now=trio.current_time())
        for node in nodes:
            if node is not mallory:
                reply = await mallory.endpoint.request(node.addr, m.MsgType.STORE,
                                                       {"records": [squat.to_wire(trio.current_time())]})
                assert reply.body["ok"] == [False]
                assert counter_value(node.metrics.dht_store_refused, reason="slot") == 1
        result = await victim.dht.put(b"peerd/state/run", slot, b"mine", ttl=600)
        await result.finished()
        assert result.stored >= 5, result
        records = await nodes[0].dht.get(b"peerd/state/run")
        assert [(r.subkey, r.value) for r in records] == [(slot, b"mine")]

    run_on_memnet(main, seed=23)


def test_honest_keys_of_many_subkeys_are_read_in_full() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await start_swarm(nursery, net, 6, replicas=6)  # every node holds: the hostile one is read
        writers = [Identity.from_seed(bytes([i + 10]) * 32) for i in range(40)]
        now = trio.current_time()
        records = [Record.create(w, b"run/progress", w.node_id, b"%d" % i, 600.0, wall=time.time(), now=now)
                   for i, w in enumerate(writers)]
        for node in nodes[1:]:  # every other node holds them (as the k closest would)
            for r in records:
                assert node.dht.core.store.store(r, now) is None
        got = await nodes[0].dht.get(b"run/progress")
        assert sorted((r.subkey, r.value) for r in got) == sorted((r.subkey, r.value) for r in records)

    run_on_memnet(main, seed=24, drop=0.05, jitter=0.01)


def test_a_key_written_to_between_pages_is_still_read_in_full() -> None:
    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await start_swarm(nursery, net, 6, replicas=6)  # every node holds: the hostile one is read
        holder = nodes[5]
        now = trio.current_time()
        writers = [Identity.from_seed(bytes([i + 10]) * 32) for i in range(30)]
        records = [Record.create(w, b"run/progress", b"%03d" % (i + 1), b"%d" % i, 600.0, wall=time.time(),
                                 now=now) for i, w in enumerate(writers)]
        for r in records:
            assert holder.dht.core.store.store(r, now) is None
        late = Record.create(BOB, b"run/progress", b"000", b"late", 600.0, wall=time.time(), now=now)

        def on_find_value(incoming: Incoming) -> dict:
            t = trio.current_time()
            response = holder.dht.core.handle(incoming.mtype, incoming.body, t)
            if incoming.body["offset"] == 0:  # a new subkey sorts first: every later page shifts by one
                assert holder.dht.core.store.store(late, t) is None
            return response

        holder.endpoint.on_request(m.MsgType.FIND_VALUE, on_find_value)
        got = await nodes[0].dht.get(b"run/progress")
        assert {(r.subkey, r.value) for r in records} <= {(r.subkey, r.value) for r in got}

    run_on_memnet(main, seed=25)


def test_a_request_sender_enters_the_table_only_once_it_answers() -> None:
    """Identities that send requests but never answer (free to mint) must not crowd the routing table: bench soak
    saw 64 of them fill every table (5 -> 56 contacts) and every lookup stall on them."""
    from peerd.wire import messages as wm

    from .support.dht_swarm import DhtNode

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        a, honest, mute = DhtNode(net, 0), DhtNode(net, 1), DhtNode(net, 2)
        for node in (a, honest, mute):
            await nursery.start(node.run)
        mute.endpoint.on_request(wm.MsgType.PING, lambda incoming: None)  # it asks, and never answers
        for sender in (honest, mute):
            await sender.endpoint.request(a.addr, wm.MsgType.FIND_NODE, {"target": bytes(32)},
                                          node_id=a.identity.node_id)
        await trio.sleep(10)
        assert honest.identity.node_id in a.dht.core.table
        assert mute.identity.node_id not in a.dht.core.table
        assert len(a.dht._verifying) == 0

    run_on_memnet(main)
