"""Repair of lost all-gather ranges (protocol/allreduce.md, "Repair"): in virtual time, with exact loss patterns."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from peerd.allreduce import GroupAverage, Outcome
from peerd.allreduce.frames import HEADER_SIZE, NACK_SIZE, nack_bodies, pack_nack, parse_nack
from peerd.allreduce.group import GROUP_OPTIONS
from peerd.allreduce.phase import IN_ORDER_GRACE_S, REPAIR_FLOOR_S
from peerd.allreduce.repair import NACK_REPEATS, SERVE_S
from peerd.wire.errors import WireError

from .support.groups import AG_DATA, AG_NACK, GROUP, RS_DATA, GroupNet, inputs, payload_for

PER = 50
REPAIR = replace(GROUP_OPTIONS, repair_rounds=2)


def cores(n: int, length: int, options=REPAIR, seed: int = 3) -> tuple[list[GroupAverage], list[np.ndarray]]:
    xs, ws = inputs(n, length, seed=seed)
    return [GroupAverage(GROUP, n, i, xs[i], ws[i], 0.0, options=options, max_payload=payload_for(PER))
            for i in range(n)], xs


def first_copies(pick):
    """A drop rule that loses the first transmission of each body ``pick`` selects (a resend of it gets through)."""
    seen: set[tuple[int, int, int, int]] = set()

    def drop(w) -> bool:
        key = (w.src, w.dst, w.mtype, w.offset)
        if w.mtype != AG_DATA or w.copy or key in seen:
            return False
        seen.add(key)
        return pick(w)
    return drop


def assert_repaired(members: list[GroupAverage], drop) -> int:
    """Run ``members`` under ``drop``: every member ends bit-identical and every range asked for arrived and was
    resent once; returns how many were asked for."""
    GroupNet(members, drop=drop).run()
    results = [m.result() for m in members]
    for r in results[1:]:
        assert np.array_equal(r, results[0])
    asked = sum(m.statistics().repair_asked for m in members)
    assert asked == sum(m.statistics().repair_received for m in members)
    assert asked == sum(m.statistics().repair_resent for m in members)
    return asked


def test_a_lost_all_gather_datagram_is_repaired_and_every_member_ends_bit_identical():
    members, xs = cores(4, 4000)
    net = GroupNet(members, drop=first_copies(lambda w: w.src == 1 and w.dst == 2 and w.offset == 1000 + 3 * PER))
    net.run()
    results = [m.result() for m in members]
    for r in results[1:]:
        assert np.array_equal(r, results[0])
    s2, s1 = members[2].statistics(), members[1].statistics()
    assert (s2.repair_asked, s2.repair_received) == (1, 1)
    assert s1.repair_resent == 1
    assert s2.all_gather.ended_by == "completion"
    assert all(m.statistics().complete for m in members)  # repaired: every member holds the group's result
    # without repair the range keeps member 2's own values
    plain, _ = cores(4, 4000, options=GROUP_OPTIONS)
    GroupNet(plain, drop=first_copies(lambda w: w.src == 1 and w.dst == 2 and w.offset == 1000 + 3 * PER)).run()
    lo = 1000 + 3 * PER
    assert np.array_equal(plain[2].result()[lo : lo + PER], xs[2][lo : lo + PER])
    assert not np.array_equal(plain[2].result(), plain[0].result())
    assert [m.statistics().complete for m in plain] == [True, True, False, True]


def test_a_resend_that_arrived_last_leaves_the_reports_arrival_time_unknown():
    """The socket's time for a sender's latest datagram dates the stream's top in a REPORT (the sender's queue
    estimate): not where that datagram was a resend, sent after the top and arriving after it."""
    members, _ = cores(4, 4 * 200 * PER)
    m = members[2]
    ag = m._ag
    for k in (0, 2, 3):
        ag.note_data(1, k, 0.01 * k)
    assert not m.latest_behind(1)
    ag.note_data(1, 1, 0.05)  # the resend of range 1
    assert m.latest_behind(1)
    ag.note_block(1, 2, 5, 0.06)  # ranges 4 and 5
    assert not m.latest_behind(1)
    ag.note_block(1, 1, 1, 0.07)  # range 1 again, as a block
    assert m.latest_behind(1)


def test_ten_percent_all_gather_loss_is_repaired_everywhere():
    rng = np.random.default_rng(7)
    members, _ = cores(4, 20000)
    assert assert_repaired(members, first_copies(lambda w: rng.random() < 0.1)) > 20


def test_a_round_at_loss_is_complete_on_every_member_after_repair_and_bit_identical():
    """5 % of every data datagram lost: reduce-scatter contributions are gone for good (the received share is below
    1), all-gather ranges are asked for again; every member reports a complete result and all of them are equal."""
    rng = np.random.default_rng(5)
    members, _ = cores(4, 20000)
    ag = first_copies(lambda w: rng.random() < 0.05)

    def drop(w) -> bool:
        return rng.random() < 0.05 if w.mtype == RS_DATA else ag(w)

    GroupNet(members, drop=drop).run()
    stats = [m.statistics() for m in members]
    assert sum(s.reduce_scatter.datagrams_expected - s.reduce_scatter.datagrams_received for s in stats) > 0
    assert sum(s.repair_asked for s in stats) > 0
    assert [s.complete for s in stats] == [True] * 4
    results = [m.result() for m in members]
    for r in results[1:]:
        assert np.array_equal(r, results[0])


def test_repair_is_bounded_when_the_owner_is_gone():
    """The owner never hears the requests (nor the done messages): the member asks its rounds and gives up with its own
    values; the owner stops serving after SERVE_S."""
    members, xs = cores(3, 3000)
    lo = 1000 + 2 * PER

    def drop(w) -> bool:
        if w.mtype == AG_NACK and w.dst == 1:
            return True
        return w.mtype == AG_DATA and w.src == 1 and w.dst == 2 and w.offset == lo

    net = GroupNet(members, drop=drop)
    net.run()
    s2 = members[2].statistics()
    assert s2.repair_asked == 1 and s2.repair_received == 0 and not s2.complete
    assert np.array_equal(members[2].result()[lo : lo + PER], xs[2][lo : lo + PER])
    asks = [w for w in net.sent_bodies if w.mtype == AG_NACK and w.src == 2 and w.dst == 1
            and len(w.body) > NACK_SIZE]
    assert len(asks) == REPAIR.repair_rounds * NACK_REPEATS
    # each round waits its floor and a little more (the stream's rate): bounded, and far below the phase floor
    ag = s2.all_gather
    assert ag.ended_at - ag.started_at < REPAIR.repair_rounds * (REPAIR_FLOOR_S + 0.01) + 0.05
    assert net.now < ag.ended_at + SERVE_S + 0.05


def test_repair_when_the_all_gather_deadline_fires_without_an_end():
    """Every END copy and each stream's last datagram are lost: at its deadline each member asks for what is missing
    (its owner, itself waiting, still serves)."""
    members, _ = cores(2, 2000)
    seen = set()

    def rule(w) -> bool:
        if w.mtype == AG_DATA + 1:
            return True  # every END copy
        if w.mtype == AG_DATA and w.offset in (950, 1950) and w.offset not in seen:
            seen.add(w.offset)
            return True  # the last range's first transmission
        return False

    GroupNet(members, drop=rule).run()
    assert np.array_equal(members[0].result(), members[1].result())
    for m in members:
        s = m.statistics()
        assert s.repair_received == 1 and s.all_gather.ended_by == "deadline"


# ---- the owner's bounds (members are hostile) ----------------------------------------------------------------


def serving_owner(options=REPAIR) -> tuple[GroupAverage, GroupAverage]:
    """Member 0 done with its phases and serving; member 1's messages to it are the test's to make."""
    members, _ = cores(2, 2000, options=options)
    m0, m1 = members
    for _ in range(4):
        for o in m0.datagrams_to_send(0.0, 1000):
            m1.receive(0, o.type, o.body, 0.0)
        for o in m1.datagrams_to_send(0.0, 1000):
            if o.type != AG_NACK:
                m0.receive(1, o.type, o.body, 0.0)
    assert m0.result_ready and not m0.wants_to_send
    return m0, m1


def resent(core: GroupAverage) -> list[int]:
    return [int.from_bytes(o.body[9:13], "little") for o in core.datagrams_to_send(0.1, 10_000) if o.type == AG_DATA]


def test_an_owner_serves_until_its_members_are_done_or_serve_s_passes():
    m0, _ = serving_owner()
    assert not m0.finished and m0.get_timer() == pytest.approx(SERVE_S)
    assert m0.receive(1, AG_NACK, pack_nack(GROUP, 0, 20, 0), 0.01) is Outcome.ACCEPTED
    assert m0.finished and m0.get_timer() is None
    m0, _ = serving_owner()
    m0.handle_timer(SERVE_S)
    assert m0.finished


def test_an_owner_reads_at_once_for_requests_only_once_its_own_phases_ended():
    """A member's repair request comes only after the owner's stream ended: while the owner's own phases run, only
    their tails make the receive loop read at once (awaits_tail), not the serving it will do; once its phases ended
    it serves at once until its members are done."""
    from peerd.allreduce.phase import TAIL_DATAGRAMS

    stream = TAIL_DATAGRAMS + 60
    members, _ = cores(2, 2 * PER * stream)
    m0, m1 = members
    rs = [o for o in m1.datagrams_to_send(0.0, 10**6) if o.type == RS_DATA]
    assert len(rs) == stream
    for o in rs[:20]:  # mid-stream: data from the member it will serve has arrived
        m0.receive(1, o.type, o.body, 0.0)
    assert not m0.awaits_tail
    m0, _ = serving_owner()
    assert m0.awaits_tail  # its phases ended, member 1 not done: a request may come
    assert m0.receive(1, AG_NACK, pack_nack(GROUP, 0, 20, 0), 0.01) is Outcome.ACCEPTED
    assert not m0.awaits_tail


@pytest.mark.parametrize("spare", [False, True])
def test_an_owner_that_handed_its_result_on_resends_from_its_kept_shard(spare):
    """The driver hands the result on while the owner still serves (AveragingHost.release), and its caller may
    reuse the buffer at once: resends carry the final values kept at hand-over, not what the buffer holds now. The
    copy may go into a spare buffer of the host's (larger, holding an earlier group's values); the group hands back
    what it copied into as ``kept_buffer`` (the spare, or its fresh copy: the next group's spare)."""
    m0, _ = serving_owner()
    final = m0.result().copy()
    buffer = np.full(10_000, 7.0, np.float32)
    asked: list[int] = []
    m0.keep_shard((lambda n: asked.append(n) or buffer) if spare else None)
    if spare:
        assert m0.kept_buffer is buffer
    else:
        assert m0.kept_buffer is not None and m0.kept_buffer.size == 1000
        assert not np.shares_memory(m0.kept_buffer, m0.result())
    assert asked == ([1000] if spare else [])  # the own shard's elements
    m0.result()[:] = np.nan
    assert m0.receive(1, AG_NACK, pack_nack(GROUP, 1, 20, 0, b"\x05\x00\x08"), 0.01) is Outcome.ACCEPTED
    bodies = [o.body for o in m0.datagrams_to_send(0.1, 10_000) if o.type == AG_DATA]
    offsets = sorted(int.from_bytes(b[9:13], "little") for b in bodies)
    assert offsets == [0, 2 * PER, 19 * PER]
    for body in bodies:
        off = int.from_bytes(body[9:13], "little")
        values = np.frombuffer(bytes(body[HEADER_SIZE:]), np.float32)
        np.testing.assert_array_equal(values, final[off : off + len(values)])


def test_forged_nacks_are_dropped_hostile():
    m0, _ = serving_owner()
    ask = pack_nack(GROUP, 1, 20, 3, b"\x01")
    assert m0.receive(5, AG_NACK, ask, 0.01) is Outcome.UNKNOWN_SENDER
    assert m0.receive(0, AG_NACK, ask, 0.01) is Outcome.UNKNOWN_SENDER
    assert m0.receive(1, AG_NACK, pack_nack(GROUP + 1, 1, 20, 3, b"\x01"), 0.01) is Outcome.OTHER_GROUP
    for bad in (ask[:12], pack_nack(GROUP, 3, 20, 3, b"\x01"), pack_nack(GROUP, 1, 21, 3, b"\x01"),
                pack_nack(GROUP, 1, 20, 3, b"\x00"), pack_nack(GROUP, 1, 20, 19, b"\x02"),
                pack_nack(GROUP, 1, 20, 20, b"\x01"), pack_nack(GROUP, 1, 20, 0, b"\xff\xff\xff\x01"),
                pack_nack(GROUP, 0, 20, 0, b"\x01"), pack_nack(GROUP, 1, 20, 3)):
        with pytest.raises(WireError) as e:
            m0.receive(1, AG_NACK, bad, 0.01)
        assert e.value.reason == "malformed"
    assert not m0.wants_to_send
    s = m0.statistics()
    assert s.drops["malformed"] == 9 and s.drops["sender"] == 2 and s.drops["group"] == 1 and s.repair_resent == 0


def test_oversized_nacks_are_bounded_by_the_stream_hostile():
    m0, _ = serving_owner()
    huge = pack_nack(GROUP, 1, 20, 0, b"\xff" * 1100)  # bits far past the stream's 20 ranges
    with pytest.raises(WireError):
        m0.receive(1, AG_NACK, huge, 0.01)
    assert not m0.wants_to_send


def test_a_nack_flood_does_not_amplify_hostile():
    """Each range goes once per requester and round, for the owner's rounds only: never more than the shard a round."""
    m0, _ = serving_owner()
    everything = pack_nack(GROUP, 1, 20, 0, b"\xff\xff\x0f")
    for _ in range(1000):
        m0.receive(1, AG_NACK, everything, 0.01)
    first = resent(m0)
    assert sorted(first) == list(range(0, 1000, PER))
    for _ in range(1000):
        m0.receive(1, AG_NACK, everything, 0.02)
    assert resent(m0) == []
    again = pack_nack(GROUP, 2, 20, 0, b"\xff\xff\x0f")
    for _ in range(1000):
        m0.receive(1, AG_NACK, again, 0.03)
        m0.receive(1, AG_NACK, everything, 0.03)  # an earlier round: ignored
    assert sorted(resent(m0)) == list(range(0, 1000, PER))
    with pytest.raises(WireError):
        m0.receive(1, AG_NACK, pack_nack(GROUP, 3, 20, 0, b"\xff\xff\x0f"), 0.04)
    assert resent(m0) == []
    assert m0.statistics().repair_resent == 2 * 20
    # a member that said it is done asks no more
    m0.receive(1, AG_NACK, pack_nack(GROUP, 0, 20, 0), 0.05)
    assert m0.receive(1, AG_NACK, again, 0.05) is Outcome.DUPLICATE and resent(m0) == []


def test_an_owner_that_does_not_repair_refuses_nacks_hostile():
    m0, _ = serving_owner(options=GROUP_OPTIONS)
    assert m0.finished
    assert m0.receive(1, AG_NACK, pack_nack(GROUP, 1, 20, 0, b"\x01"), 0.01) is Outcome.REFUSED
    assert m0.statistics().drops["nack"] == 1 and not m0.wants_to_send


def test_nack_bodies_split_a_wide_spread_and_parse_back():
    missing = np.array([0, 5, 9000, 9001, 40000])
    bodies = nack_bodies(GROUP, 1, missing, 50000, 1163)
    assert all(len(b) <= 1163 for b in bodies) and len(bodies) == 2  # 9,200 ranges a body
    got = np.concatenate([parse_nack(b, 2).missing for b in bodies])
    assert got.tolist() == missing.tolist()


def test_a_host_never_holds_a_nack_hostile():
    """A request for a group this node does not run is dropped at once (held data is for data that may come
    before its group starts; a request for an average that is not running here has nothing to wait for)."""
    from peerd.allreduce.actions import Dropped
    from peerd.allreduce.host import AveragingHost

    host = AveragingHost(max_body=1163, mtu=1200)
    for i in range(100):
        host.receive_data(b"\x01" * 32, 7, AG_NACK, pack_nack(GROUP + i, 1, 20, 0, b"\xff"), 0.0)
    assert host.held.count == 0 and host.get_timer() is None
    assert sum(a.count for a in host.take_actions() if isinstance(a, Dropped) and a.reason == "nack") == 100


@pytest.mark.parametrize("name", ["int8", "fp16"])
def test_lost_all_gather_ranges_of_a_compressed_codec_are_repaired(name):
    """A quantized codec's resent range is the owner's same bytes: every member ends bit-identical, and no stream is
    left waiting out its repair rounds without loss."""
    from peerd.compress import codec

    c = codec(name, rounding="nearest") if name.startswith("int") else codec(name)
    options = replace(REPAIR, codec=c, run=0x5EED)
    xs, ws = inputs(4, 20000, seed=5)
    members = [GroupAverage(GROUP, 4, i, xs[i], ws[i], 0.0, options=options, max_payload=payload_for(PER))
               for i in range(4)]
    rng = np.random.default_rng(11)
    assert assert_repaired(members, first_copies(lambda w: rng.random() < 0.1)) > 0
    clean = [GroupAverage(GROUP, 4, i, xs[i], ws[i], 0.0, options=options, max_payload=payload_for(PER))
             for i in range(4)]
    GroupNet(clean).run()
    for m in clean:
        s = m.statistics()
        assert s.repair_asked == 0 and s.all_gather.ended_by == "completion"


# ---- repair while the driver is still sending the group's data ------------------------------------------------


def exchange(members: list[GroupAverage], keep) -> None:
    """Pump the members' datagrams to each other at time 0, delivering only those ``keep(src, dst, type, body)``
    allows, until nobody has anything more to send."""
    for _ in range(20):
        for i, core in enumerate(members):
            for o in core.datagrams_to_send(0.0, 10_000):
                if keep(i, o.to, o.type, o.body):
                    members[o.to].receive(i, o.type, o.body, 0.0)


def test_take_repair_asks_for_an_ended_stream_mid_send_and_leaves_the_phase_deadline_alone():
    """A driver busy sending its blocks asks ``take_repair`` every few ms: an owner's stream that ended with a range
    missing is asked for once the END's grace is over (not after the driver's whole block), the owner's resend
    comes out of its own ``take_repair`` at once, and no phase ends by deadline there (that waits until the
    member's own data is out)."""
    members, _ = cores(3, 3000, options=replace(REPAIR, end_grace_s=0.05))  # (the driver's default grace)
    m0, m1, _m2 = members
    lost = 1000 + 3 * PER  # a range of member 1's shard, on its way to member 0

    def keep(src: int, dst: int, mtype: int, body: bytes) -> bool:
        if dst == 0 and src == 2 and mtype in (AG_DATA, AG_DATA + 1):
            return False  # member 2's stream to member 0 stays open
        if dst == 0 and src == 1 and mtype == AG_DATA and int.from_bytes(body[9:13], "little") == lost:
            return False
        return mtype != AG_NACK

    exchange(members, keep)
    assert m0.repair_timer == pytest.approx(IN_ORDER_GRACE_S)
    assert m0.take_repair(0.0) == []  # the END's grace is not over
    # a driver whose receive loop has not read its socket up to the grace's end does not end it
    assert m0.take_repair(IN_ORDER_GRACE_S + 1e-4, expire=False) == []
    asks = m0.take_repair(IN_ORDER_GRACE_S + 1e-4)
    assert [(b.to, b.type) for b in asks] == [(1, AG_NACK)]
    nack = parse_nack(bytes(asks[0].bodies[0]), REPAIR.repair_rounds)
    assert nack.round == 1 and nack.missing.tolist() == [3]
    assert m0.take_repair(IN_ORDER_GRACE_S + 2e-4) == []  # asked once a round
    assert m1.receive(0, AG_NACK, bytes(asks[0].bodies[0]), 0.01) is Outcome.ACCEPTED
    resends = m1.take_repair(0.01)
    assert [(b.to, b.type, int.from_bytes(bytes(b.bodies[0][9:13]), "little")) for b in resends] == [
        (0, AG_DATA, lost)]
    late = 1e3  # far past every phase deadline: take_repair still ends nothing by deadline
    m0.take_repair(late)
    assert m0.statistics().all_gather.ended_by is None
    m0.handle_timer(late)
    assert m0.statistics().all_gather.ended_by is not None


def test_take_repair_is_empty_without_repair_rounds():
    members, _ = cores(3, 3000, options=GROUP_OPTIONS)
    exchange(members, lambda src, dst, mtype, body: not (dst == 0 and mtype == AG_DATA
                                                         and int.from_bytes(body[9:13], "little") == 1150))
    assert members[0].take_repair(1.0) == []


def test_a_round_whose_last_resend_is_lost_ends_soon_after_the_others_arrive():
    """The owner resends a round in index order: once one of its ranges arrived, the rest come within the safety
    margin at the stream's rate. Where the last one asked for is lost, the round ends after that and the grace,
    not after REPAIR_FLOOR_S (a round of which nothing came still waits that)."""
    members, _ = cores(4, 4 * 200 * PER, options=replace(REPAIR, end_grace_s=0.05))
    ag = members[2]._ag
    rate = 10_000.0  # datagrams a second
    for k in range(200):
        if k not in (10, 20):
            ag.note_data(1, k, k / rate)
    end = 199 / rate
    ag.note_end(1, end)
    ag.expire_ending(end + IN_ORDER_GRACE_S)
    asked_at = end + IN_ORDER_GRACE_S
    assert ag.round[1] == 1 and ag.repairing[1] > asked_at + REPAIR_FLOOR_S
    ag.want_last[1] = 20  # (what the core's request asked for: ranges 10 and 20)
    arrived = asked_at + 0.003
    assert ag.note_data(1, 10, arrived)  # the wait moved earlier
    stream_rate = 198 / (arrived - 0.0)
    assert ag.repairing[1] == pytest.approx(arrived + IN_ORDER_GRACE_S + ag.safety * 1 / stream_rate)
    ag.expire_repairs(ag.repairing[1])
    assert ag.round[1] == 2  # range 20 asked for again, well before the first round's floor
