"""Matchmaking in virtual time: leader choice, closing, disbanding, stale and differing DHT views.

A tiny synchronous network delivers each matchmaker's actions to the others after a fixed latency;
the "DHT" each peer reads is a function the test controls, so peers can see different contents.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.moshpit.matchmaking import PROBE_S, Begin, Candidate, Group, Join, Matchmaker, Probe, State

from .support.matchmaking import BoardNet, cand  # noqa: E402


def test_earliest_peer_leads_and_group_closes_at_target():
    peers = [cand(i, 10.0 + i * 0.01) for i in range(4)]
    net = BoardNet(peers, target=4)
    net.run()
    groups = net.groups()
    assert len(groups) == 1
    (members,) = groups.values()
    assert len(members) == 4
    assert {net.mm[c.node_id].group.leader for c in members} == {peers[0].node_id}
    assert net.now < 1.0, "closing at the target must not wait for the deadline"


def test_many_peers_one_key_fill_groups_of_target():
    peers = [cand(i, 10.0 + i * 0.01) for i in range(16)]
    net = BoardNet(peers, target=4)
    net.run()
    sizes = sorted(len(m) for m in net.groups().values())
    assert sizes == [4, 4, 4, 4]
    assert net.now < 10.0


def test_group_closes_at_deadline_with_min_size_or_disbands():
    peers = [cand(i, 3.0 + i * 0.01) for i in range(3)]
    net = BoardNet(peers, target=4, min_size=2, settle=None)
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 3
    assert net.now >= 3.0  # the leader waited for its expiry: the group never reached 4

    lone = [cand(1, 2.0)]
    net = BoardNet(lone, target=4, min_size=2)
    net.run()
    assert net.groups() == {} and net.mm[lone[0].node_id].group is None


def test_min_size_not_reached_disbands_followers():
    peers = [cand(i, 2.0 + i * 0.01) for i in range(2)]
    net = BoardNet(peers, target=4, min_size=3)
    net.run()
    assert net.groups() == {}
    assert all(mm.group is None for mm in net.mm.values())


def test_dead_leader_is_skipped():
    peers = [cand(i, 5.0 + i * 0.01) for i in range(5)]
    net = BoardNet(peers, target=4, dead={0})  # its DHT record is still there, it is not
    net.run()
    (members,) = net.groups().values()
    assert peers[0].node_id not in {c.node_id for c in members}
    assert len(members) == 4


def test_leader_that_dies_after_accepting_releases_its_followers():
    peers = [cand(i, 3.0 + i * 0.01) for i in range(4)]
    net = BoardNet(peers, target=8, min_size=2, settle=None)
    # kill the leader just after it accepted followers
    net.at(0.5, lambda: net.kill(0))
    net.run()
    survivors = [mm for nid, mm in net.mm.items()]
    assert all(mm.done for mm in survivors)
    # nobody averages with the dead leader; survivors either regroup or say they are alone
    for mm in survivors:
        if mm.group is not None:
            assert peers[0].node_id not in {c.node_id for c in mm.group.members}


def test_followers_of_a_leader_that_died_before_closing_regroup_before_their_expiry():
    """The leader waits for the target (8) and dies at 0.5 s holding 3 followers. They probe it every PROBE_S;
    no answer for 0.75 s, and they matchmake again among themselves, well before their expiry (3 s). Without
    probes they waited for BEGIN until the leader's expiry plus 2.5 s, past their own, and were all alone."""
    peers = [cand(i, 3.0 + i * 0.01) for i in range(4)]
    net = BoardNet(peers, target=8, min_size=2, settle=None)
    net.at(0.5, lambda: net.kill(0))
    net.run()
    (members,) = net.groups().values()
    assert {c.node_id for c in members} == {p.node_id for p in peers[1:]}
    assert all(mm.group is not None for mm in net.mm.values())
    assert net.now <= 3.0 + 0.1  # closed at the new leader's expiry (no target, no settle), not later
    assert net.probes >= 3 * 2  # each follower probed, at least once before and once after the death


def test_a_live_leader_is_probed_and_followed_until_it_closes():
    peers = [cand(i, 2.0 + i * 0.01) for i in range(3)]
    net = BoardNet(peers, target=8, min_size=2, settle=None)
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 3 and net.now == pytest.approx(2.0, abs=0.05)  # the leader's expiry
    # each follower probed about every PROBE_S plus a round trip while it waited, and none left its leader
    assert 2 * (1.5 / (PROBE_S + 0.02)) <= net.probes <= 2 * (2.0 / PROBE_S) + 2


def test_peers_that_see_different_dht_contents_never_mix_lists():
    peers = [cand(i, 5.0 + i * 0.01) for i in range(8)]

    def view(i: int, now: float) -> list[Candidate]:
        # the first half sees only the first half for a while; the rest see everyone, but late
        if now < 1.0:
            return peers[:4] if i < 4 else peers[4:]
        return peers

    net = BoardNet(peers, target=8, view=view, settle=None)  # the partition outlasts any settle time
    net.run()
    groups = net.groups()  # asserts every member agrees on one list
    assert sum(len(m) for m in groups.values()) == 8
    assert len(groups) == 1, "once views converge, the later leader hands its followers to the earlier one"


def test_late_candidate_earlier_than_current_leader_takes_over_before_close():
    peers = [cand(i, 5.0 + i * 0.01) for i in range(3)]
    net = BoardNet(peers, target=3, view=lambda i, now: peers if now >= 0.5 else peers[1:], settle=None)
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 3


def test_join_request_answers():
    me = cand(1, 5.0)
    mm = Matchmaker(me, target=3, now=0.0)
    assert mm.on_join_request(me, 0.0) == (False, "self")
    assert mm.on_join_request(cand(2, 6.0), 0.0) == (True, "ok")
    assert mm.on_join_request(cand(2, 6.0), 0.0) == (True, "ok")  # a retried JOIN is idempotent
    assert mm.state is State.LEADING and len(mm.followers) == 1
    assert mm.on_join_request(cand(3, 6.0), 0.0) == (True, "ok")
    assert mm.done and len(mm.group.members) == 3
    (begin,) = mm.take_actions()
    assert isinstance(begin, Begin) and len(begin.to) == 2
    assert mm.on_join_request(cand(4, 6.0), 0.0) == (False, "disbanded")  # not in the group: look again
    assert mm.on_join_request(cand(2, 6.0), 0.0) == (False, "closed")  # a member: its BEGIN is on the way


def test_a_lost_disband_is_found_by_the_next_probe():
    """A leader that hands its follower over (to join an earlier peer) sends one MM_DISBAND; here it is lost. The
    follower's next probe hears ``following`` and looks again at once, instead of waiting out the leader's expiry
    plus FOLLOW_SLACK_S and ending alone (what 10 % loss did to 1 round in 20 of `peerd bench moshpit`)."""
    early, leader, follower = cand(1, 3.0), cand(2, 3.1), cand(3, 3.2)
    mm = Matchmaker(follower, target=3, now=0.0)
    mm.on_entries([leader, follower], 0.0)  # the earliest peer's announce has not reached this view yet
    (join,) = mm.take_actions()
    assert isinstance(join, Join) and join.leader == leader
    mm.on_join_response(leader.node_id, True, "ok", 0.01)
    assert mm.state is State.FOLLOWING
    mm.on_entries([early, leader, follower], 0.2)  # now it shows, but the leader's DISBAND never comes
    mm.handle_timer(0.01 + PROBE_S)
    (probe,) = mm.take_actions()
    assert isinstance(probe, Probe) and probe.leader == leader
    mm.on_probe_answered(leader.node_id, "following", 0.52)
    (join,) = mm.take_actions()
    assert isinstance(join, Join) and join.leader == early and mm.state is State.JOINING
    # ``ok`` and ``closed`` (a member whose BEGIN is on the way) keep it waiting, as before
    for reason in ("ok", "closed"):
        other = Matchmaker(follower, target=3, now=0.0)
        other.on_entries([leader, follower], 0.0)
        other.take_actions()
        other.on_join_response(leader.node_id, True, "ok", 0.01)
        other.on_probe_answered(leader.node_id, reason, 0.52)
        assert other.state is State.FOLLOWING and other.take_actions() == []


def test_a_join_answered_closed_waits_for_its_begin():
    """The leader accepted my JOIN and closed at the target, but its answer was lost; my retransmitted JOIN hears
    ``closed`` (I am in the group). I wait for the BEGIN and take it, rather than lead and refuse it."""
    leader, follower = cand(1, 3.0), cand(2, 3.1)
    lead = Matchmaker(leader, target=2, now=0.0)
    assert lead.on_join_request(follower, 0.01) == (True, "ok")
    (begin,) = lead.take_actions()
    assert lead.on_join_request(follower, 0.03) == (False, "closed")  # the retransmission
    mm = Matchmaker(follower, target=2, now=0.0)
    mm.on_entries([leader, follower], 0.0)
    mm.take_actions()
    mm.on_join_response(leader.node_id, False, "closed", 0.04)
    assert mm.state is State.FOLLOWING and mm.take_actions() == []
    assert mm.on_begin(leader.node_id, begin.group.group_id, list(begin.group.members))
    assert mm.done and mm.group == Group(begin.group.group_id, begin.group.members, 1, leader.node_id)


@settings(max_examples=150, deadline=None)
@given(st.integers(3, 12), st.integers(2, 6), st.integers(0, 10**6))
def test_lost_disbands_cost_no_lone_peer(n, target, seed):
    """Every MM_DISBAND lost (one datagram each), peers' DHT views arriving one by one in random order: the
    probes' answers still regroup every follower a leader handed over, so no peer that could join a group ends
    alone, and every peer finishes before its own expiry plus the slack (not by a follower's 5.5 s wait)."""
    rng = random.Random(seed)
    target = min(target, n)
    peers = [cand(i, 3.0 + rng.uniform(0, 0.3)) for i in range(n)]
    shown = {i: rng.uniform(0, 0.6) for i in range(n)}  # when each peer's announce becomes visible to all

    def view(i: int, now: float) -> list[Candidate]:
        return [p for j, p in enumerate(peers) if shown[j] <= now or j == i]

    net = BoardNet(peers, target=target, min_size=2, view=view, seed=seed, settle=None)
    net.deliver_disband = lambda follower, leader: None  # every DISBAND is lost
    net.run(until=12.0)
    groups = net.groups()
    grouped = sum(len(m) for m in groups.values())
    assert n - grouped < 2 or all(len(m) == target for m in groups.values()), (n, target, groups)
    assert net.now <= max(p.expiry for p in peers) + 0.5


def test_begin_from_a_stranger_is_refused():
    me = cand(2, 6.0)
    mm = Matchmaker(me, target=3, now=0.0)
    mm.on_entries([cand(1, 5.0), me], 0.0)
    assert mm.state is State.JOINING
    members = [cand(9, 1.0), me]
    assert not mm.on_begin(cand(9, 1.0).node_id, 7, members)
    assert not mm.on_begin(cand(1, 5.0).node_id, 7, [cand(1, 5.0)])  # a list without me
    assert mm.on_begin(cand(1, 5.0).node_id, 7, [cand(1, 5.0), me])
    assert mm.group.index == 1


def test_bad_sizes_rejected():
    with pytest.raises(ValueError):
        Matchmaker(cand(1, 1.0), target=4, min_size=1, now=0.0)
    with pytest.raises(ValueError):
        Matchmaker(cand(1, 1.0), target=3, min_size=4, now=0.0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 14), target=st.integers(2, 6), seed=st.integers(0, 10_000),
       skew=st.floats(0.0, 2.0), ndead=st.integers(0, 2))
def test_random_swarms_always_agree_and_finish(n, target, seed, skew, ndead):
    rng = random.Random(seed)
    peers = [cand(i, 4.0 + rng.random() * skew) for i in range(n)]
    dead = set(rng.sample(range(n), min(ndead, n - 1)))
    start = {i: rng.random() * 0.5 for i in range(n)}

    def view(i: int, now: float) -> list[Candidate]:
        # each peer's DHT read misses a random subset early on
        r = random.Random(hash((seed, i, round(now, 1))))
        return [c for c in peers if now > 1.5 or r.random() < 0.7]

    net = BoardNet(peers, target=target, dead=dead, view=view, start=start, seed=seed)
    net.run(until=30.0)
    groups = net.groups()
    for members in groups.values():
        assert 2 <= len(members) <= target
    in_groups = sum(len(m) for m in groups.values())
    live = n - len(dead)
    assert in_groups <= n
    if live >= 2 and not dead:
        assert in_groups >= 2  # with nobody dead, at least one group forms


def test_leader_closes_early_when_everyone_looking_has_joined():
    peers = [cand(i, 10.0 + i * 0.01) for i in range(3)]
    net = BoardNet(peers, target=8)
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 3
    assert net.now < 2.0, "three of a target of eight, all in: no need to wait for the 10 s deadline"


def test_exact_grid_mode_waits_for_the_target():
    peers = [cand(i, 4.0 + i * 0.01) for i in range(3)]
    net = BoardNet(peers, target=4, min_size=2, settle=None)
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 3 and net.now >= 4.0


def test_a_newcomer_in_the_dht_delays_the_early_close():
    peers = [cand(i, 10.0 + i * 0.01) for i in range(4)]
    # peer 3 shows up in the DHT at 0.1 s but only starts asking at 1.0 s: the leader must not close without it
    net = BoardNet(peers, target=8, view=lambda i, now: peers if now >= 0.1 else peers[:3], start={3: 1.0})
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 4


def test_a_peer_the_run_expects_is_waited_for_a_little_longer():
    peers = [cand(i, 10.0 + i * 0.01) for i in range(4)]
    # peer 3 finished the last round (the run expects it) but is slow to look this round
    net = BoardNet(peers, target=8, view=lambda i, now: peers if now >= 1.0 else peers[:3], start={3: 1.0})
    for mm in net.mm.values():
        mm.set_expected(frozenset(c.node_id for c in peers), 0.0)
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 4 and net.now < 3.0
    # with everyone expected in, the close is quick
    net = BoardNet(peers[:3], target=8)
    for mm in net.mm.values():
        mm.set_expected(frozenset(c.node_id for c in peers[:3]), 0.0)
    net.run()
    assert len(next(iter(net.groups().values()))) == 3 and net.now < 1.0


def test_a_follower_joining_restarts_the_pause_when_nobody_is_expected():
    """Nobody is expected (a run's first round, or rounds far apart): each JOIN is a newcomer too, so a peer
    half a second behind the second still gets in, though the DHT never showed either before they asked."""
    peers = [cand(i, 10.0 + i * 0.01) for i in range(3)]
    starts = {1: 2.0, 2: 2.5}
    net = BoardNet(peers, target=8, start=starts,
              view=lambda i, now: [p for j, p in enumerate(peers) if starts.get(j, 0.0) + 0.15 <= now])
    net.run()
    (members,) = net.groups().values()
    assert len(members) == 3 and 4.0 <= net.now < 4.5


def test_seen_rank_is_my_place_among_the_most_peers_one_read_showed():
    me = cand(5, 10.0)
    mm = Matchmaker(me, target=4, now=0.0)
    assert (mm.seen, mm.seen_rank()) == (1, 0)
    mm.on_entries([cand(2, 9.0), cand(7, 11.0), me], 0.0)
    assert (mm.seen, mm.seen_rank()) == (3, 1)  # ids 2, 5, 7
    mm.on_entries([cand(7, 11.0)], 0.1)  # a later, smaller read does not shrink what was seen
    assert (mm.seen, mm.seen_rank()) == (3, 1)
    mm.on_entries([cand(1, 9.0), cand(3, 9.5), cand(7, 11.0)], 0.2)
    assert (mm.seen, mm.seen_rank()) == (4, 2)  # ids 1, 3, 5, 7
