"""FIND_VALUE's ``held`` / VALUE's ``have`` (records the asker holds are not sent again) and the wide start of a
full lookup from a table that holds every node it heard of near the target."""

from __future__ import annotations

import random

import pytest

from peerd.dht.core import HELD_ON_WIRE, HELD_PREFIX, MAX_HELD, DhtCore, had, held_prefixes
from peerd.dht.records import Record, location
from peerd.dht.routing import Contact, RoutingTable
from peerd.wire import messages as m
from peerd.wire.identity import Identity

KEY = b"held/key"


def records(n: int, *, seed: int = 0) -> list[Record]:
    rng = random.Random(seed)
    ident = Identity.from_seed(rng.randbytes(32))
    return [Record.create(ident, KEY, b"s%02d" % i, b"v", 60.0, wall=1e9, now=0.0) for i in range(n)]


def holder(rs: list[Record]) -> DhtCore:
    core = DhtCore(bytes(32))
    for r in rs:
        assert core.store.store(r, 0.0) is None
    return core


def test_held_records_are_left_out_of_every_page_and_of_the_total() -> None:
    rs = records(40)
    core = holder(rs)
    held = held_prefixes(rs[::3])  # the asker holds every third
    want = [r for i, r in enumerate(rs) if i % 3]
    got: list[list] = []
    offset = 0
    while True:
        page, total, _ = core.find_value(KEY, offset, held, 1.0)
        assert total == len(want)
        if not page:
            break
        got += page
        offset += len(page)
    assert [fields[1] for fields in got] == [r.subkey for r in want]
    # without held: everything, as before
    assert core.find_value(KEY, 0, (), 1.0)[1] == 40


def test_have_marks_exactly_the_held_records_the_responder_holds() -> None:
    rs = records(12)
    core = holder(rs[:6])
    other = records(3, seed=1)  # records the responder never saw
    held = held_prefixes([rs[0], other[0], rs[5], rs[7], other[1]])
    have = core.have(KEY, held, 1.0)
    assert len(have) == 1
    assert had(held, have) == [0, 2]  # rs[0] and rs[5]; rs[7] and the others it does not hold
    assert core.have(KEY, [], 1.0) == b""
    assert had(held, b"\xff") == list(range(len(held)))  # bits past held are ignored
    assert had([], b"\xff") == []


def test_held_prefixes_are_distinct_and_bounded() -> None:
    rs = records(MAX_HELD + 10)
    held = held_prefixes(rs + rs[:5])
    assert len(held) == MAX_HELD and len(set(held)) == MAX_HELD
    assert all(len(p) == HELD_PREFIX for p in held)
    assert held[0] == rs[0].signature[:HELD_PREFIX]


@pytest.mark.skipif(not HELD_ON_WIRE, reason="FIND_VALUE has no held field yet (patch dht-messages.py.diff)")
def test_find_value_on_the_wire_carries_held_and_have() -> None:
    rs = records(5)
    core = holder(rs)
    body = {"key": KEY, "offset": 0, "held": held_prefixes(rs[:2])}
    out = core.handle(m.MsgType.FIND_VALUE, body, 1.0)
    assert out["total"] == 3 and [f[1] for f in out["records"]] == [r.subkey for r in rs[2:]]
    assert had(body["held"], out["have"]) == [0, 1]


# -- wide start ------------------------------------------------------------------------------------------------
def contacts(n: int, seed: int) -> list[Contact]:
    rng = random.Random(seed)
    return [Contact(rng.randbytes(32), "10.0.0.1", 4000 + i) for i in range(n)]


def test_a_full_read_starts_wide_only_from_a_table_that_is_complete_near_the_target() -> None:
    target = location(KEY)
    small = DhtCore(bytes(32), wide_start=True)
    for c in contacts(31, 1):  # a 32-node swarm: no bucket is full
        small.heard(c)
    assert small.table.complete_near(target)
    full = small.start_lookup(target, 0.0, alpha=3)
    assert len(full.next_queries()) == 20  # one round trip: all k closest at once
    early = small.start_lookup(target, 0.0, alpha=3, early=True)
    assert len(early.next_queries()) == 3  # reads that may end early still go alpha at a time
    settle = small.start_lookup(target, 0.0, alpha=3, settle=True)
    assert len(settle.next_queries()) == 3

    few = DhtCore(bytes(32), wide_start=True)
    for c in contacts(5, 2):  # fewer than k known: its first answers may well bring closer nodes
        few.heard(c)
    assert not few.table.complete_near(target)
    assert len(few.start_lookup(target, 0.0, alpha=3).next_queries()) == 3

    big = RoutingTable(bytes(32))
    for c in contacts(400, 3):  # the far half of the id space holds 200: that bucket is full
        big.observe(c)
    far = bytes([0x80]) + bytes(31)  # in the full bucket's range
    assert not big.complete_near(far)
    off = DhtCore(bytes(32))  # the default
    for c in contacts(31, 1):
        off.heard(c)
    assert len(off.start_lookup(target, 0.0, alpha=3).next_queries()) == 3
