"""The Moshpit round machine (moshpit/rounds.py) driven by hand: exact inputs, exact actions, no I/O."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest

from peerd.moshpit.keys import Grid, KeyManager
from peerd.moshpit.matchmaking import Candidate, Group
from peerd.moshpit.records import PROGRESS_TTL_S, STRANGER_AHEAD, encode_announce
from peerd.moshpit.rounds import POLL_S, Average, Count, Get, Notify, Put, Request, RoundMachine
from peerd.moshpit.sticky import RENEW_KEY
from peerd.tools.sim.moshpit import SimRecord
from peerd.wire import messages as m
from peerd.wire.identity import node_id_of

T0 = 1_800_000_000.0
LINE = Grid(1, 4)


def peer(i: int) -> Candidate:
    pk = hashlib.sha256(b"pk%d" % i).digest()
    return Candidate(0.0, node_id_of(pk), pk, (f"10.0.0.{i + 1}", 7411))


def machine(i: int = 0, grid: Grid = LINE, **kw) -> RoundMachine:
    me = peer(i)
    rng = random.Random(i)
    return RoundMachine("run", grid, KeyManager(grid, me.node_id, rng=rng), me, rng=rng, **kw)


def announce(c: Candidate, expiry: float) -> SimRecord:
    return SimRecord(c.node_id, encode_announce(expiry, c.addr[0], c.addr[1]), expiry, c.public_key)


def progress(c: Candidate, round_no: int, stored: float) -> SimRecord:
    return SimRecord(c.node_id, msgpack.packb(round_no), stored + PROGRESS_TTL_S, c.public_key)


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def test_a_lonely_round_announces_polls_gives_up_at_its_expiry_and_publishes_progress() -> None:
    mc = machine(window_s=1.0)
    mc.synced = True
    mc.start_round(now=T0)
    acts = mc.take_actions()
    (put,) = of(acts, Put)
    assert put.key == b"run/0/-" and put.ttl == 11.0 and msgpack.unpackb(put.value)[0] == T0 + 1.0
    gets = of(acts, Get)
    assert [g.key for g in gets] == [b"run/0/-", b"run/progress"]  # the poll, and whom the run expects
    mc.on_records(gets[0].token, [announce(mc.me, T0 + 1.0)], T0 + 0.02)
    mc.on_records(gets[1].token, [], T0 + 0.02)
    assert mc.get_timer() - T0 == pytest.approx(0.02 + POLL_S[0], abs=1e-6)
    t = T0 + 0.02
    while not mc.done:  # every poll shows only this node until its expiry
        t = mc.get_timer()
        mc.handle_timer(t)
        for g in of(mc.take_actions(), Get):
            mc.on_records(g.token, [announce(mc.me, T0 + 1.0)], t)
    assert t - T0 == pytest.approx(1.0, abs=1e-6) and mc.outcome == "alone" and mc.round == 1


def test_join_outside_a_round_says_whether_the_sender_is_early_or_late() -> None:
    mc = machine()
    mc.round = 5
    other = peer(1)
    assert mc.on_join(other, 5, "-", T0) == (False, "not_ready")
    assert mc.on_join(other, 6, "-", T0) == (False, "not_ready")
    assert mc.on_join(other, 4, "-", T0) == (False, "disbanded")  # that round is over here: look again
    assert mc.on_join(other, 5, RENEW_KEY, T0) == (False, "closed")  # no kept group to renew
    assert mc.take_actions() == []


def test_a_group_forms_through_join_and_begin_and_the_key_moves_on() -> None:
    a, b = machine(0, Grid(2, 2)), machine(1, Grid(2, 2))
    for mc in (a, b):
        mc.keys.chunks = (1,)
        mc.synced = True
        mc.start_round(now=T0 if mc is a else T0 + 0.01)
    records = [announce(a.me, T0 + 3.0), announce(b.me, T0 + 3.01)]
    for mc in (a, b):
        for g in of(mc.take_actions(), Get):
            mc.on_records(g.token, records if g.key.startswith(b"run/0/") else [], T0 + 0.05)
    (join,) = of(b.take_actions(), Request)  # b is later: it asks a to lead it
    assert join.to.node_id == a.me.node_id and join.mtype is m.MsgType.MM_JOIN and join.fields["key"] == "1"
    ok, reason = a.on_join(Candidate(join.fields["expiry"], b.me.node_id, b.me.public_key, b.me.addr), 0, "1",
                           T0 + 0.06)
    assert ok and reason == "ok"
    acts = a.take_actions()
    (begin,) = of(acts, Request)
    (avg_a,) = of(acts, Average)  # the target (2) is reached: a closes at once
    assert begin.mtype is m.MsgType.MM_BEGIN and begin.detached and avg_a.group.leader == a.me.node_id
    b.on_reply(join.token, a.me.node_id, True, "ok", T0 + 0.07)
    assert b.on_begin(a.me.node_id, 0, begin.fields["group"], list(begin.fields["members"]), T0 + 0.08)
    (avg_b,) = of(b.take_actions(), Average)
    assert avg_b.group == Group(avg_a.group.group_id, avg_a.group.members, 1 - avg_a.group.index, a.me.node_id)
    # while a averages, a probe from its member hears ``closed`` (BEGIN is on its way), anyone else ``disbanded``
    member = Candidate(join.fields["expiry"], b.me.node_id, b.me.public_key, b.me.addr)
    assert a.on_join(member, 0, "1", T0 + 0.1) == (False, "closed")
    assert a.on_join(peer(7), 0, "1", T0 + 0.1) == (False, "disbanded")
    for mc, avg in ((a, avg_a), (b, avg_b)):
        mc.on_averaged(averaged=True, members=[c.node_id for c in avg.group.members], now=T0 + 0.2)
        assert mc.done and mc.outcome == "averaged" and mc.round == 1
        assert mc.keys.chunks == (avg.group.index,)  # its index in the group is its next key
        (put,) = of(mc.take_actions(), Put)
        assert put.key == b"run/progress" and msgpack.unpackb(put.value) == 0
    assert b.known == {a.me.node_id: 0}


def _kept(mc: RoundMachine, members: list[Candidate], leader: bytes) -> None:
    members = sorted(members, key=lambda c: c.node_id)
    index = next(i for i, c in enumerate(members) if c.node_id == mc.me.node_id)
    mc.sticky.keep_rounds = 4
    mc.sticky.after_matchmaking(Group(7, tuple(members), index, leader), 0, len(members),
                                frozenset(c.node_id for c in members))
    mc.round, mc.synced = 1, True


def test_a_kept_groups_leader_re_forms_it_when_a_newcomer_looks_under_its_key() -> None:
    """The renewal does not wait for the watch: the newcomer the watch finds breaks the group for the next
    round, which matchmakes through the DHT (the newcomer included)."""
    a, b, newcomer = peer(0), peer(1), peer(2)
    leader_id = min(a.node_id, b.node_id)
    mc = machine(0 if a.node_id == leader_id else 1, window_s=2.0)
    follower = b if mc.me.node_id == a.node_id else a
    _kept(mc, [a, b], leader_id)
    mc.start_round(now=T0)
    acts = mc.take_actions()
    assert mc.phase == "renew" and of(acts, Put) == []  # a renewal reads, it does not announce
    watch = of(acts, Get)
    assert [g.key for g in watch] == [b"run/progress", b"run/1/-", b"run/2/-"] and all(g.detached for g in watch)
    assert mc.on_join(follower, 1, RENEW_KEY, T0 + 0.01) == (True, "ok")
    acts = mc.take_actions()  # every follower asked: BEGIN at once, the reads still out
    assert mc.phase == "average" and [r.to.node_id for r in of(acts, Request)] == [follower.node_id]
    (avg,) = of(acts, Average)
    assert avg.kept
    mc.on_records(watch[0].token, [progress(follower, 0, T0 - 1)], T0 + 0.02)
    mc.on_records(watch[2].token, [], T0 + 0.02)
    mc.on_averaged(averaged=True, members=[a.node_id, b.node_id], now=T0 + 0.03)
    assert mc.done and mc.round == 2
    mc.take_actions()
    mc.start_round(now=T0 + 0.1)  # the last watch read is still out: no second watch, the renewal goes on
    acts = mc.take_actions()
    assert mc.phase == "renew" and of(acts, Get) == []
    mc.on_records(watch[1].token, [announce(newcomer, T0 + 2.5)], T0 + 0.11)  # read in round 1, answered now
    acts = mc.take_actions()
    assert mc.phase == "match" and mc.sticky.dropped == {"newcomer": 1}
    assert [a.to.node_id for a in of(acts, Notify)] == [follower.node_id] * 2  # DISBAND, twice
    assert of(acts, Put)[0].key == b"run/2/-"  # matchmaking through the DHT, newcomer included


def test_a_node_alone_under_a_round_the_run_has_finished_moves_to_the_runs_round() -> None:
    """A joiner whose round is stale (a kept group's rounds take milliseconds) announces its presence and,
    alone under a key nobody reads, moves to the round after the latest one the run finished at once."""
    mc, founder = machine(window_s=2.0), peer(1)
    mc.round, mc.synced = 5, True  # taken from the swarm's progress when the run opened
    mc.start_round(now=T0)
    acts = mc.take_actions()
    puts = of(acts, Put)
    assert [p.key for p in puts] == [b"run/5/-", b"run/progress"] and msgpack.unpackb(puts[1].value) == 4
    poll, expect = of(acts, Get)
    mc.on_records(poll.token, [announce(mc.me, T0 + 2.0)], T0 + 0.02)
    mc.on_records(expect.token, [progress(founder, 4, T0)], T0 + 0.02)  # nobody ahead yet
    assert mc.round == 5 and mc.get_timer() <= T0 + 0.02 + 0.5
    t = T0 + 0.52
    mc.handle_timer(t)  # alone: it reads the run's progress again
    (again,) = [g for g in of(mc.take_actions(), Get) if g.key == b"run/progress"]
    mc.on_records(again.token, [progress(founder, 30, t)], t + 0.02)
    acts = mc.take_actions()
    assert mc.phase == "match" and mc.round == 31 and mc.key == mc.keys.group_key(31)
    assert of(acts, Put)[0].key == b"run/31/-"
    mc.handle_timer(t + 0.03)
    assert not mc.done


def test_a_node_with_a_follower_does_not_move_to_another_round() -> None:
    mc, other, ahead = machine(window_s=2.0), peer(1), peer(2)
    mc.round, mc.synced = 5, True
    mc.start_round(now=T0)
    poll, expect = of(mc.take_actions(), Get)
    mc.on_records(poll.token, [announce(mc.me, T0 + 2.0), announce(other, T0 + 2.1)], T0 + 0.02)
    assert mc.on_join(Candidate(T0 + 2.1, other.node_id, other.public_key, other.addr), 5, "-", T0 + 0.03)[0]
    mc.on_records(expect.token, [progress(ahead, 30, T0)], T0 + 0.04)
    assert mc.round == 5 and mc.phase == "match"  # its follower looks under this round's key: it stays


def test_a_follower_whose_leader_does_not_answer_matchmakes_at_once() -> None:
    a, b = peer(0), peer(1)
    leader = min((a, b), key=lambda c: c.node_id)
    mc = machine(1 if leader is a else 0, window_s=2.0)
    _kept(mc, [a, b], leader.node_id)
    mc.start_round(now=T0)
    (ask,) = of(mc.take_actions(), Request)
    assert ask.to.node_id == leader.node_id and ask.fields["key"] == RENEW_KEY
    mc.on_reply(ask.token, leader.node_id, False, "busy", T0 + 0.1)  # busy: asked again 0.3 s later
    assert mc.get_timer() - T0 == pytest.approx(0.4, abs=1e-6)
    mc.handle_timer(T0 + 0.4)
    (again,) = of(mc.take_actions(), Request)
    mc.on_failed(again.token, T0 + 1.4)
    acts = mc.take_actions()
    assert mc.phase == "match" and mc.sticky.dropped == {"unreachable": 1}
    assert of(acts, Put) and [n.to.node_id for n in of(acts, Notify)] == [leader.node_id] * 2


def test_strangers_far_ahead_do_not_move_a_node_that_averaged() -> None:
    mc = machine()
    mc.note_members([peer(1).node_id], 41)
    mc.round = 42
    strangers = [progress(peer(10 + i), 2**31, T0 - 1) for i in range(64)]
    near = progress(peer(5), 42 + STRANGER_AHEAD, T0 - 1)
    mc.apply_sync([*strangers, near, progress(peer(1), 41, T0 - 1)], T0)
    assert mc.round == 43 + STRANGER_AHEAD
    assert Count("ignored_records", ("progress", "ahead"), 64) in mc.take_actions()
    bad = SimRecord(b"", b"\xc1", T0, peer(3).public_key)
    mc.apply_sync([bad, progress(peer(4), -1 % 2**64, T0)], T0)
    acts = mc.take_actions()
    assert Count("ignored_records", ("progress", "malformed"), 1) in acts
    assert Count("ignored_records", ("progress", "range"), 1) in acts


def test_an_abandoned_round_is_started_again_under_the_same_number() -> None:
    mc = machine()
    mc.round = 3
    mc.start_round(now=T0)
    with pytest.raises(RuntimeError, match="still match"):
        mc.start_round(now=T0)
    gets = of(mc.take_actions(), Get)
    mc.abandon()
    mc.on_records(gets[0].token, [announce(peer(1), T0 + 2)], T0)  # an answer for the abandoned round
    assert mc.take_actions() == [] and mc.round == 3
    mc.start_round(now=T0 + 1)
    assert of(mc.take_actions(), Put)[0].key == b"run/3/-"


def test_numbered_rounds_far_apart_expect_the_peers_of_the_last_one() -> None:
    """DiLoCo numbers its outer rounds by the step (40, 80, ...): the peers whose progress says they finished the
    round this node last ran are expected in the next, though that is 40 rounds back; older ones are not."""
    mc = machine(window_s=1.0)
    mc.synced = True
    others = [peer(1), peer(2), peer(3)]

    def run(round_no: int, t: float, records: list) -> None:
        mc.round = round_no
        mc.start_round(numbered=True, now=t)
        gets = of(mc.take_actions(), Get)
        assert [g.key for g in gets] == [b"run/%d/-" % round_no, b"run/progress"]
        mc.on_records(gets[1].token, records, t + 0.01)

    run(40, T0, [progress(o, 0, T0 - 50) for o in others])
    assert mc._mm is not None and mc._mm.expected is None  # round 0 is too far back, and nothing ran before
    while not mc.done:
        mc.handle_timer(mc.get_timer())
        mc.take_actions()
    assert mc.outcome == "alone"
    records = [progress(others[0], 40, T0 + 2), progress(others[1], 40, T0 + 2), progress(others[2], 12, T0 - 30),
               progress(mc.me, 40, T0 + 1)]
    run(80, T0 + 20, records)
    assert mc._mm.expected == {others[0].node_id, others[1].node_id, mc.me.node_id}


@pytest.mark.parametrize(("chain_from", "window"), [
    (T0 + 0.5, 1.5),  # the last round ended half a window in: this one ends a window after that
    (T0 - 5.0, 1.0),  # long ago: a whole window from now, as unchained
    (T0 + 9.0, 2.0),  # far ahead (a wrong clock): at most two windows from now
])
def test_a_chained_round_ends_its_window_one_window_after_the_last_one(chain_from: float, window: float) -> None:
    """A DiLoCo outer step's second round chains its window to the first's (``chain_from``): a member that
    averaged at once waits until one window after the first round's end, when a member that was alone in
    the first round (its whole window) arrives; counted from its own start, its window had ended by then."""
    mc = machine(window_s=1.0)
    mc.synced = True
    mc.round = 41
    mc.start_round(numbered=True, chain_from=chain_from, now=T0)
    (put,) = of(mc.take_actions(), Put)
    assert msgpack.unpackb(put.value)[0] - T0 == pytest.approx(window, abs=1e-6)
    assert put.ttl == pytest.approx(window + 10.0) and mc.window_end - T0 == pytest.approx(window, abs=1e-6)
    t = T0
    while not mc.done:  # nobody comes: the round gives up at the chained expiry, not a window after T0
        t = mc.get_timer()
        mc.handle_timer(t)
        mc.take_actions()
    assert t - T0 == pytest.approx(window, abs=1e-6) and mc.outcome == "alone"
    mc.round = 42
    mc.start_round(numbered=True, now=t)  # the next step's first round is not chained
    (put,) = of(mc.take_actions(), Put)
    assert msgpack.unpackb(put.value)[0] == pytest.approx(t + 1.0) and mc.window_end == pytest.approx(t + 1.0)


def test_the_members_of_a_step_are_those_whose_progress_reached_its_first_round() -> None:
    from peerd.moshpit.records import finished_since

    ps = [peer(i) for i in range(4)]
    records = [progress(ps[0], 41, T0), progress(ps[1], 40, T0), progress(ps[2], 39, T0),
               SimRecord(ps[3].node_id, b"\xc1", T0 + PROGRESS_TTL_S, ps[3].public_key)]  # malformed
    assert finished_since(records, 40) == {ps[0].node_id, ps[1].node_id}
    assert finished_since(records, 0) == {ps[0].node_id, ps[1].node_id, ps[2].node_id}
