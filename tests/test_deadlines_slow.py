"""A member that slows, then dies, in virtual time: the window a live member missed stretches at once (within its
cap), and matchmaking waits for a member of the last group that did not finish it only ``doubt`` (peerd/deadlines.py,
moshpit/expect.py, moshpit/matchmaking.py, moshpit/rounds.py)."""

from __future__ import annotations

import hashlib
import math
import random

import msgpack
import pytest

from peerd.deadlines import DOUBT_FLOOR_S, MIN_SAMPLES, SPREAD_K, STRETCH_K, WINDOW_FLOOR_S, DeadlineTuner
from peerd.moshpit.expect import expected_peers
from peerd.moshpit.keys import Grid, KeyManager
from peerd.moshpit.matchmaking import Candidate, Matchmaker
from peerd.moshpit.records import PROGRESS_TTL_S, encode_announce
from peerd.moshpit.rounds import Get, Request, RoundMachine
from peerd.tools.sim.moshpit import SimRecord
from peerd.wire import messages as m
from peerd.wire.identity import node_id_of

MEMBERS = ("00" * 32, "aa" * 32, "bb" * 32, "cc" * 32)  # this node first; "cc" slows, then dies
T0 = 1_800_000_000.0


def _warm(t: DeadlineTuner, now: float = 100.0) -> float:
    """Quick rounds of the four: the window at its floor (enough of them that one slow sample is no p90)."""
    for _ in range(4 * MIN_SAMPLES):
        now += 1.0
        t.receive_round(gather_s=0.05, window_s=3.0, at_window_end=False, members=MEMBERS, nbytes=4000,
                        transfer_s=0.4, clean=True, now=now)
    assert t.window(3.0).seconds == (WINDOW_FLOOR_S if t.mode == "auto" else 3.0)
    return now


def _at_end(t: DeadlineTuner, members: tuple[str, ...], window_s: float, now: float) -> None:
    t.receive_round(gather_s=window_s, window_s=window_s, at_window_end=True, members=members, nbytes=4000,
                    transfer_s=0.4, clean=True, now=now)


def test_a_window_a_live_member_missed_is_twice_as_long_next_round_then_follows_its_arrivals() -> None:
    t = DeadlineTuner()
    now = _warm(t)
    t.receive_heard(MEMBERS[3], now + 0.5)  # the slow member's traffic: it is alive
    _at_end(t, MEMBERS[:3], WINDOW_FLOOR_S, now + 1.0)
    w = t.window(3.0)
    assert (w.seconds, w.basis) == (STRETCH_K * WINDOW_FLOOR_S, "stretched"), w
    assert t.doubt(w.seconds).seconds == DOUBT_FLOOR_S  # (gathering was quick: a doubtful member waits little)
    # in the stretched window the slow member came after 0.8 s: the next window is k times that
    t.receive_round(gather_s=0.8, window_s=w.seconds, at_window_end=False, members=MEMBERS, nbytes=4000,
                    transfer_s=0.6, clean=True, now=now + 3.0)
    assert t.window(3.0).seconds == pytest.approx(1.6)
    # it recovered: quick gatherings halve the stretch away, back to the floor
    for i in range(2):
        t.receive_round(gather_s=0.05, window_s=1.6, at_window_end=False, members=MEMBERS, nbytes=4000,
                        transfer_s=0.4, clean=True, now=now + 4.0 + i)
    assert (t.window(3.0).seconds, t.window(3.0).basis) == (WINDOW_FLOOR_S, "floor")


def test_the_window_after_a_long_average_is_at_least_twice_its_length() -> None:
    """A member's link slowed mid-run: the group's average took 1.2 s instead of 0.4, and the member behind the slow
    link ends it up to that much after the others. The next window waits twice the average (within the cap), before
    any window ran out without it; once averages are quick again the window is back at its floor."""
    t = DeadlineTuner()
    now = _warm(t)
    t.receive_round(gather_s=0.05, window_s=WINDOW_FLOOR_S, at_window_end=False, members=MEMBERS, nbytes=4000,
                    transfer_s=1.2, clean=True, now=now + 1.0)
    w = t.window(3.0)
    assert (w.seconds, w.basis) == (pytest.approx(SPREAD_K * 1.2), "stretched"), w
    t.receive_round(gather_s=0.05, window_s=w.seconds, at_window_end=False, members=MEMBERS, nbytes=4000,
                    transfer_s=2.0, clean=True, now=now + 3.0)
    assert (t.window(3.0).seconds, t.window(3.0).basis) == (3.0, "cap")  # (the run's window stays the bound)
    t.receive_round(gather_s=0.05, window_s=3.0, at_window_end=False, members=MEMBERS, nbytes=4000,
                    transfer_s=0.3, clean=True, now=now + 6.0)
    assert (t.window(3.0).seconds, t.window(3.0).basis) == (WINDOW_FLOOR_S, "floor")
    alone = DeadlineTuner()  # (a round alone says nothing about how far apart a group's members end)
    now = _warm(alone)
    alone.receive_round(gather_s=WINDOW_FLOOR_S, window_s=WINDOW_FLOOR_S, at_window_end=True, members=MEMBERS[:1],
                        nbytes=4000, transfer_s=1.5, clean=True, now=now + 1.0)
    assert alone.window(3.0).seconds == STRETCH_K * WINDOW_FLOOR_S  # (the live group it missed: not 2 x 1.5 s)


def test_a_window_run_out_alone_while_the_last_group_lives_is_stretched() -> None:
    """The survivors of a death found nobody in a short window (the DHT was slow): the next one is longer."""
    t = DeadlineTuner()
    now = _warm(t)
    for p in MEMBERS[1:3]:
        t.receive_heard(p, now + 0.5)
    _at_end(t, MEMBERS[:1], WINDOW_FLOOR_S, now + 1.0)
    assert t.window(3.0).seconds == STRETCH_K * WINDOW_FLOOR_S


def test_a_silent_missing_member_stretches_nothing() -> None:
    t = DeadlineTuner()
    now = _warm(t)
    _at_end(t, MEMBERS[:3], WINDOW_FLOOR_S, now + 60.0)  # "cc" last heard in the warm-up, a minute ago
    assert t.window(3.0).seconds == WINDOW_FLOOR_S


def test_a_member_late_round_after_round_doubles_the_window_each_time_up_to_its_cap() -> None:
    t = DeadlineTuner()
    now = _warm(t)
    windows = []
    for _ in range(4):
        window = t.window(3.0).seconds
        windows.append(window)
        now += window + 0.5
        t.receive_heard(MEMBERS[3], now - 0.1)
        _at_end(t, MEMBERS[:3], window, now)
    assert windows == [1.0, 2.0, 3.0, 3.0]


def test_a_member_that_is_never_there_stretches_the_window_to_its_cap_at_most_hostile() -> None:
    """A member that keeps talking but never comes in time costs every round the run's window, never more, and
    under --deadlines fixed nothing changes."""
    for mode, cap in (("auto", 3.0), ("auto", 1.5), ("fixed", 3.0)):
        t = DeadlineTuner(mode)
        now = _warm(t)
        window = t.window(cap).seconds
        for _ in range(40):
            now += window + 0.5
            t.receive_heard(MEMBERS[3], now - 0.1)
            _at_end(t, MEMBERS[:3], window, now)
            window = t.window(cap).seconds
            assert window <= cap and t.doubt(window).seconds <= window
            assert math.isfinite(window)
        assert window == cap, (mode, cap)


# -- whom matchmaking waits for ---------------------------------------------------------------------------------
def _peer(i: int, expiry: float = 0.0) -> Candidate:
    pk = hashlib.sha256(b"pk%d" % i).digest()
    return Candidate(expiry, node_id_of(pk), pk, (f"10.0.0.{i + 1}", 7411))


def test_a_member_of_the_last_group_without_its_progress_is_doubtful_one_that_missed_it_is_expected() -> None:
    me, a, dead, late = (_peer(i).node_id for i in range(4))
    known = {a: 9, dead: 9, late: 7}  # a and the dead one averaged with this node in round 9; late missed it
    progress = [(me, 9, 1.0), (a, 9, 1.0), (dead, 8, 0.5), (late, 8, 0.9)]
    seen = expected_peers(progress, me=me, round_no=10, last_round=9, lagging_s=None, known=known, now=2.0)
    assert seen.recent == {me, a, dead, late} and seen.doubtful == {dead} and seen.latest == -1
    # (a node's first round knows no last group: nobody is doubtful)
    assert not expected_peers(progress, me=me, round_no=10, last_round=None, lagging_s=None, known=known,
                              now=2.0).doubtful


def test_a_member_of_the_last_group_with_no_progress_yet_is_expected_and_doubtful() -> None:
    """In a run's second round a member that has not finished its first (a capped member, a moment behind) has no
    record yet: the others must not expect only each other."""
    me, a, slow, stranger = (_peer(i).node_id for i in range(4))
    known = {a: 0, slow: 0, stranger: -5}
    progress = [(me, 0, 1.0), (a, 0, 1.0)]
    seen = expected_peers(progress, me=me, round_no=1, last_round=0, lagging_s=None, known=known, now=2.0)
    assert seen.recent == {me, a, slow} and seen.doubtful == {slow}


def test_a_stale_copy_of_a_members_progress_does_not_make_it_doubtful_hostile() -> None:
    """A holder that also serves an older signed record of an honest member cannot get it waited for less: the
    newest round each owner finished counts."""
    me, a = _peer(0).node_id, _peer(1).node_id
    progress = [(a, 8, 0.5), (a, 9, 1.0), (me, 9, 1.0)]
    seen = expected_peers(progress, me=me, round_no=10, last_round=9, lagging_s=None, known={a: 9}, now=2.0)
    assert seen.doubtful == frozenset() and a in seen.recent


def _leader_with_two(doubt_until: float | None) -> tuple[Matchmaker, float]:
    """This node leads (earliest expiry); two followers join at once; a third expected member never comes."""
    me = _peer(0, T0 + 3.0)
    mm = Matchmaker(me, target=4, min_size=2, now=T0)
    f1, f2, dead = _peer(1, T0 + 3.1), _peer(2, T0 + 3.1), _peer(3, T0 + 2.0)
    mm.on_entries([me, f1, f2], T0 + 0.05)
    mm.set_expected(frozenset(c.node_id for c in (me, f1, f2, dead)), T0 + 0.05)
    if doubt_until is not None:
        mm.receive_doubtful(frozenset([dead.node_id]), doubt_until, T0 + 0.05)
    for f in (f1, f2):
        assert mm.on_join_request(f, T0 + 0.1) == (True, "ok")
    now = T0 + 0.1
    while not mm.done:
        now = mm.get_timer()
        mm.handle_timer(now)
    assert mm.group is not None and len(mm.group.members) == 3
    return mm, now


def test_matchmaking_waits_for_a_doubtful_member_only_until_its_doubt_deadline() -> None:
    _, closed = _leader_with_two(T0 + 0.6)
    assert closed - T0 == pytest.approx(0.6, abs=1e-6)
    _, closed = _leader_with_two(None)  # (a member that missed a round, or no tuner: the whole window)
    assert closed - T0 == pytest.approx(3.0, abs=1e-6)


def _records(mc: RoundMachine, acts: list, shown: list[SimRecord], progress: list[SimRecord], now: float) -> None:
    for g in [a for a in acts if isinstance(a, Get)]:
        mc.on_records(g.token, progress if g.key.endswith(b"progress") else shown, now)


def test_the_round_after_a_death_closes_one_doubt_after_it_starts_not_at_the_windows_end() -> None:
    """Round 10 of a node that averaged round 9 with three others: one of them never published finishing it (it
    died mid-round). The two survivors join at once; the group closes at doubt_s, not at the 3 s window's end."""
    grid = Grid(1, 4)
    me = _peer(0)
    rng = random.Random(0)
    mc = RoundMachine("run", grid, KeyManager(grid, me.node_id, rng=rng), me, rng=rng, window_s=3.0)
    others = [_peer(i) for i in (1, 2, 3)]
    mc.note_members([c.node_id for c in others], 9)
    mc.round, mc._last_round, mc.synced, mc.doubt_s = 10, 9, True, 0.6
    mc.start_round(now=T0)
    key = mc.key
    shown = [SimRecord(c.node_id, encode_announce(T0 + 3.1, c.addr[0], c.addr[1]), T0 + 3.1, c.public_key)
             for c in others[:2]] + [SimRecord(me.node_id, encode_announce(T0 + 3.0, *me.addr), T0 + 3.0,
                                               me.public_key)]
    progress = [SimRecord(c.node_id, msgpack.packb(r), T0 - 1 + PROGRESS_TTL_S, c.public_key)
                for c, r in ((me, 9), (others[0], 9), (others[1], 9), (others[2], 8))]
    _records(mc, mc.take_actions(), shown, progress, T0 + 0.05)
    for c in others[:2]:
        assert mc.on_join(c, 10, key, T0 + 0.1) == (True, "ok")
    now = T0 + 0.1
    while mc.phase == "match":
        now = mc.get_timer()
        mc.handle_timer(now)
        acts = mc.take_actions()
        _records(mc, acts, shown, progress, now)
    begins = [a for a in acts if isinstance(a, Request) and a.mtype == m.MsgType.MM_BEGIN]
    assert mc.phase == "average" and now - T0 == pytest.approx(0.6, abs=1e-6) and len(begins) == 2


def test_a_full_read_of_the_key_does_not_hold_up_the_quick_polls() -> None:
    """Every fourth poll also reads every holder (one holder dead: that read waits its query out); the quick
    polls go on meanwhile, so the announcements that land are seen."""
    grid = Grid(1, 4)
    me = _peer(0)
    rng = random.Random(0)
    mc = RoundMachine("run", grid, KeyManager(grid, me.node_id, rng=rng), me, rng=rng, window_s=3.0)
    mc.synced = True
    mc.start_round(now=T0)
    full: list[Get] = []
    quick_after = 0
    now = T0
    for _ in range(8):
        for g in [a for a in mc.take_actions() if isinstance(a, Get) and a.key.endswith(b"/-")]:
            if g.enough is None:
                full.append(g)  # never answered (a dead holder)
                continue
            quick_after += bool(full)
            mc.on_records(g.token, [], now)
        now = mc.get_timer()
        assert now < T0 + 3.0
        mc.handle_timer(now)
    assert len(full) == 1 and quick_after >= 4  # one full read at a time, and the quick polls went on
