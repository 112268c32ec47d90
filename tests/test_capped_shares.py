"""A capped member's smaller shard (PROTOCOL.md 16, Begin; allreduce/shards.py ``capped_shares``): the shares rule,
the layout it gives, and group averages over it that stay exact while the capped member carries less."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from peerd.allreduce import GroupAverage, Layout
from peerd.allreduce.group import GROUP_OPTIONS
from peerd.allreduce.options import AverageOptions
from peerd.allreduce.phase import Sending, State
from peerd.allreduce.shards import MAX_SHARE, capped_shares

from .support.groups import AG_DATA, GROUP, RS_DATA, GroupNet, inputs, payload_for


@pytest.mark.parametrize("capped", [
    (False, False, False, True), (True, False, True, False), (True, True, True, False),
    (True, False), (True,) + (False,) * 7, (True,) * 6 + (False,) * 2, (False, True, False),
])
def test_capped_members_get_less_and_no_member_more_than_max_share(capped):
    shares = capped_shares(capped)
    assert shares is not None and len(shares) == len(capped)
    n, total = len(capped), sum(shares)
    for cap, s in zip(capped, shares, strict=True):
        assert s * n <= MAX_SHARE * total  # the bound a leader's flags can win
        if cap:
            assert s * n < total  # less than an equal share
    assert min(s for s, c in zip(shares, capped, strict=True) if not c) > max(
        s for s, c in zip(shares, capped, strict=True) if c)


@pytest.mark.parametrize("capped", [(), (False,), (True,), (False,) * 4, (True,) * 4])
def test_all_or_none_capped_is_equal(capped):
    assert capped_shares(capped) is None


@pytest.mark.parametrize("length", [0, 1, 3, 1000, 10007])
@pytest.mark.parametrize("shares", [None, (4, 4, 4, 0), (0, 8, 0, 8), (2, 2, 2, 6), (1, 1, 1, 1)])
def test_shards_partition_the_vector(length, shares):
    lay = Layout(length, 4, 7, shares)
    bounds = [lay.shard(j) for j in range(4)]
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert lay.largest() == max(b - a for a, b in bounds)
    if shares is None or len(set(shares)) == 1:  # equal shares are the equal layout, element for element
        assert bounds == [((j * length) // 4, ((j + 1) * length) // 4) for j in range(4)]
    else:
        total = sum(shares)
        for (a, b), s in zip(bounds, shares, strict=True):
            assert abs((b - a) - s * length / total) <= 1


@pytest.mark.parametrize("shares", [(1, 2, 3), (0, 0, 0, 0), (1, -1, 1, 1), (1.0, 1, 1, 1), (2**32, 1, 1, 1)])
def test_bad_shares_are_refused(shares):
    with pytest.raises(ValueError, match="shares"):
        Layout(100, 4, 7, shares)


def test_options_and_group_check_the_shares():
    with pytest.raises(ValueError, match="shares"):
        AverageOptions(shares=(1, -2))
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="shares"):
        GroupAverage(GROUP, 4, 0, x, 1.0, 0.0, options=replace(GROUP_OPTIONS, shares=(1, 1)),
                     max_payload=payload_for(3))


def _group(xs, ws, per, shares):
    return [GroupAverage(GROUP, len(xs), i, xs[i], ws[i], 0.0, options=replace(GROUP_OPTIONS, shares=shares),
                         max_payload=payload_for(per)) for i in range(len(xs))]


def test_a_capped_member_without_a_shard_sends_its_vector_once_and_nothing_in_the_all_gather():
    length, per = 12000, 100
    xs, ws = inputs(4, length, seed=5)
    equal, capped = GroupNet(_group(xs, ws, per, None)), GroupNet(_group(xs, ws, per, capped_shares(
        (False, False, False, True))))
    equal.run()
    capped.run()

    def sent(net: GroupNet, src: int, mtype: int) -> int:
        return sum(1 for w in net.sent_bodies if w.src == src and w.mtype == mtype and w.copy == 0)

    # equal shards: 3/4 of the vector in each phase; no shard: the whole vector in the reduce-scatter, then nothing
    assert sent(equal, 3, RS_DATA) == sent(equal, 3, AG_DATA) == 3 * length // 4 // per
    assert sent(capped, 3, RS_DATA) == length // per and sent(capped, 3, AG_DATA) == 0
    # so 1.5x less for it in all; each other member carries 1/9 more than with equal shards (12/9 against 12/8)
    for j in range(3):
        assert sent(capped, j, RS_DATA) + sent(capped, j, AG_DATA) <= 1.12 * (
            sent(equal, j, RS_DATA) + sent(equal, j, AG_DATA))


def test_a_member_without_a_shard_waits_for_the_all_gather_after_its_own_slow_contributions():
    """An upload-capped member owns no shard, so its all-gather starts at once; the owners answer only once its
    contributions, slow at its cap, have reached them. Its all-gather's silence counts from when its driver says
    they are out, so it gets the average, not its own vector back."""
    length, per = 12000, 100
    xs, ws = inputs(4, length, seed=5)
    m = _group(xs, ws, per, capped_shares((False, False, False, True)))
    capped = m[3]
    outgoing = {i: core.datagrams_to_send(0.0, 10**6) for i, core in enumerate(m)}  # all handed out at once
    capped.note_sent(5.0)  # ... and 5 s on the capped uplink
    capped.handle_timer(5.0)
    assert not capped.result_ready  # without note_sent: ended at once, nothing received
    now = 5.0
    while any(outgoing.values()):
        for i, out in outgoing.items():
            for o in out:
                m[o.to].receive(i, o.type, o.body, now)
        now += 0.01
        outgoing = {i: core.datagrams_to_send(now, 10**6) for i, core in enumerate(m)}
    exact = sum(w * x.astype(np.float64) for x, w in zip(xs, ws, strict=True)) / sum(ws)
    assert capped.result_ready and capped.statistics().all_gather.datagrams_received == length // per
    np.testing.assert_allclose(capped.result(), exact, rtol=0, atol=1e-5 * float(np.abs(exact).max()))


def test_a_member_without_a_shard_keeps_its_all_gather_open_while_its_contributions_are_handed_out():
    """The driver hands a capped member's contributions out a batch at a time over seconds (its pacer at the cap);
    its all-gather, running since the round began, must not end by silence meanwhile (no owner can answer before
    they arrive), however often the timer fires, and counts its silence from the last batch on: a round with the
    phase cap far off, as a daemon's, where a probe's answer once moved the deadline to 3 s into a 3.5 s send."""
    length, per = 12000, 100
    xs, ws = inputs(4, length, seed=5)
    m = [GroupAverage(GROUP, 4, i, xs[i], ws[i], 0.0, max_payload=payload_for(per), options=replace(
        GROUP_OPTIONS, shares=capped_shares((False, False, False, True)), floor_s=0.5, owner_lag_s=1.0,
        max_phase_s=8.5)) for i in range(4)]
    capped = m[3]
    outgoing = {i: m[i].blocks_to_send(16, 10**6, 0.0) for i in range(3)}
    now, mine = 0.0, []
    while capped.sending is Sending.REDUCE_SCATTER:  # 4 rows each 0.1 s: 3 s of sending
        mine += capped.blocks_to_send(4, 4, now)
        capped.handle_timer(now)
        assert capped.state is State.ALL_GATHER and not capped.result_ready, now
        now += 0.1
    assert 2.5 < now < 3.5 and capped.get_timer() >= now - 0.1 + 1.5  # (lag + floor from the last batch)
    outgoing[3] = mine
    while any(outgoing.values()):
        for i, out in outgoing.items():
            for b in out:
                for row in b.whole():
                    for _ in range(b.repeat):
                        m[b.to].receive(i, b.type, bytes(row), now)
        outgoing = {i: m[i].blocks_to_send(16, 10**6, now) for i in range(4)}
        now += 0.01
    exact = sum(w * x.astype(np.float64) for x, w in zip(xs, ws, strict=True)) / sum(ws)
    assert capped.result_ready and capped.statistics().all_gather.datagrams_received == length // per
    np.testing.assert_allclose(capped.result(), exact, rtol=0, atol=1e-5 * float(np.abs(exact).max()))
    assert capped.get_timer() is None or capped.get_timer() > now  # (serving: nothing ended it early)


# ---- matchmaking: who is marked capped, and who refuses ---------------------------------------------------------


def test_the_leader_marks_the_followers_whose_records_carried_caps():
    from peerd.moshpit.matchmaking import Matchmaker

    from .support.matchmaking import BoardNet, cand

    peers = [cand(i, 10.0 + i * 0.01) for i in range(4)]
    peers[2] = replace(peers[2], capped=True)  # its record carried a cap (what every peer's read shows)
    net = BoardNet(peers, target=4)
    join = net.deliver_join
    net.deliver_join = lambda follower, leader: join(replace(follower, capped=False), leader)  # (a JOIN has no cap)
    net.run()
    (members,) = net.groups().values()
    groups = {nid: mm.group for nid, mm in net.mm.items() if isinstance(mm, Matchmaker)}
    flags = {g.members[g.index].node_id: tuple(c.capped for c in g.members) for g in groups.values()}
    assert len(set(flags.values())) == 1  # every member holds the same marks: the same layout
    (marks,) = set(flags.values())
    assert [c.node_id for c, f in zip(next(iter(groups.values())).members, marks, strict=True) if f] == [
        peers[2].node_id]
    assert capped_shares(marks) is not None


def test_a_member_marked_capped_that_announced_no_cap_refuses_the_begin_hostile():
    """A leader that marks an uncapped member capped takes that member's shard for the others (itself among them):
    the member refuses the BEGIN (and is averaged out as silent) instead of handing its shard over."""
    from peerd.moshpit.matchmaking import Matchmaker, State

    from .support.matchmaking import cand

    leader, me = cand(1, 5.0), cand(2, 6.0)
    mm = Matchmaker(me, target=3, now=0.0)
    mm.on_entries([leader, me], 0.0)
    assert mm.state is State.JOINING
    assert not mm.on_begin(leader.node_id, 7, [leader, replace(me, capped=True)])
    assert mm.on_begin(leader.node_id, 7, [replace(leader, capped=True), me])  # the leader's own mark is its own
    capped_me = Matchmaker(replace(me, capped=True), target=3, now=0.0)
    capped_me.on_entries([leader, me], 0.0)
    assert capped_me.on_begin(leader.node_id, 8, [leader, me])  # unmarked though capped: an equal shard, harmless


# ---- a round over the real services (virtual time, in-memory network) ------------------------------------------


def test_a_capped_member_carries_the_vector_once_and_the_average_stays_exact() -> None:
    import trio

    from peerd.linkcap.advert import CapAdvert

    from .support.memnet import MemNet, run_on_memnet
    from .support.moshpit_swarm import lockstep, swarm

    length = 30000

    async def main(net: MemNet, nursery: trio.Nursery) -> None:
        nodes = await swarm(nursery, net, 4)
        nodes[2].moshpit.cap_ad = CapAdvert(up=50_000_000, down=0)  # (as peerd join --max-upload sets it)
        for n in nodes:
            await n.moshpit.open("capped", window_s=2.0, keep_rounds=10)
        rng = np.random.default_rng(3)
        vectors = [rng.standard_normal(length).astype(np.float32) for _ in nodes]
        exact = np.mean(np.stack(vectors).astype(np.float64), axis=0)
        for _ in range(3):  # (the first round's leader may not have read every record before it closed)
            results = await lockstep(nodes, "capped", vectors)
            for r in results:
                assert r.outcome == "averaged" and r.group_size == 4 and r.received_fraction == 1
                assert np.abs(r.vector - exact).max() < 1e-5
                assert not r.silent  # (a member without a shard has no all-gather stream: it is not silent)
        assert all(r.kept for r in results)  # so the group is kept
        sent = [r.bytes_sent for r in results]
        vector_bytes = 4 * length
        assert vector_bytes <= sent[2] < 1.1 * vector_bytes  # its contributions once, no shard to hand out
        for j in (0, 1, 3):  # the others take its shard: 1/9 more than the 1.5 vectors of equal shards
            assert 1.6 * vector_bytes < sent[j] < 1.8 * vector_bytes, sent
        # a run that asks for equal shards (DiLoCo's outer steps) keeps them, caps or not
        for n in nodes:
            await n.moshpit.open("equal", window_s=2.0)
        outs = [None] * 4

        async def one(i: int) -> None:
            outs[i] = await nodes[i].moshpit.average("equal", vectors[i], 1.0, timeout_s=30.0, shares="equal")

        async with trio.open_nursery() as inner:
            for i in range(4):
                inner.start_soon(one, i)
        for r in outs:
            assert r.outcome == "averaged" and 1.4 * vector_bytes < r.bytes_sent < 1.6 * vector_bytes

    run_on_memnet(main, seed=2)


def test_a_follower_whose_record_this_matchmaking_did_not_show_is_marked_from_earlier_records():
    from peerd.moshpit.matchmaking import Matchmaker

    from .support.matchmaking import cand

    leader, f1, f2 = cand(1, 5.0), cand(2, 5.1), cand(3, 5.2)
    lead = Matchmaker(leader, target=3, now=0.0, capped_of=lambda n: n == f2.node_id)
    lead.on_entries([leader], 0.0)  # (its read showed nobody else yet)
    lead.on_join_request(f1, 0.01)
    lead.on_join_request(f2, 0.02)
    (begin,) = lead.take_actions()
    assert [c.capped for c in begin.group.members] == [False, False, True]
