"""Keeping a formed group for several rounds (peerd/moshpit/sticky.py), sans-I/O."""

from __future__ import annotations

import pytest

from peerd.moshpit.matchmaking import Candidate, Group
from peerd.moshpit.sticky import MAX_EARLY, StickyGroups, is_complete


def cand(i: int) -> Candidate:
    return Candidate(100.0 + i, bytes([i]) * 32, bytes([i]) * 32, ("127.0.0.1", 9000 + i))


A, B, C, D = (cand(i) for i in range(1, 5))
IDS = frozenset(c.node_id for c in (A, B, C))


def group(members=(A, B, C), me: Candidate = A, leader: Candidate = A, gid: int = 7) -> Group:
    return Group(gid, tuple(members), list(members).index(me), leader.node_id)


def test_complete_groups_only() -> None:
    g = group()
    assert is_complete(g, seen=3, expected=IDS)
    assert not is_complete(g, seen=4, expected=IDS)  # someone under the key was left out
    assert not is_complete(g, seen=3, expected=IDS | {D.node_id})  # a peer the run expects is missing
    assert not is_complete(g, seen=3, expected=None)  # who the run expects is unknown
    assert not is_complete(g, seen=3, expected=frozenset())  # a new run: nobody has finished a round yet
    assert not is_complete(group((A,)), seen=1, expected=frozenset([A.node_id]))


def test_a_kept_group_is_renewed_for_keep_rounds_minus_one_rounds() -> None:
    s = StickyGroups(A.node_id, keep_rounds=3)
    s.after_matchmaking(group(), 10, 3, IDS)
    assert s.kept is not None and s.leads(s.kept)
    assert s.usable(10) is None is s.kept  # the formation round itself is not a renewal: dropped
    s.after_matchmaking(group(), 10, 3, IDS)
    assert s.usable(11) is not None
    assert s.usable(12) is not None
    renewed = s.renewal(99, 12)
    assert renewed.group_id == 99 and renewed.members == (A, B, C) and renewed.index == 0
    assert s.usable(13) is None  # used up: back to matchmaking
    assert s.dropped == {"round": 1, "used_up": 1}


def test_keep_rounds_one_never_keeps_and_incomplete_groups_are_not_kept() -> None:
    s = StickyGroups(A.node_id, keep_rounds=1)
    s.after_matchmaking(group(), 1, 3, IDS)
    assert s.kept is None
    s = StickyGroups(A.node_id, keep_rounds=5)
    s.after_matchmaking(group(), 1, 4, IDS)
    assert s.kept is None
    s.after_matchmaking(None, 2, 1, IDS)
    assert s.kept is None


@pytest.mark.parametrize("bad", [0, 1001, 2.5, "3", None])
def test_bad_keep_rounds(bad) -> None:
    with pytest.raises(ValueError, match="keep_rounds"):
        StickyGroups(A.node_id, keep_rounds=bad)


def test_silence_breaks_the_group_for_the_next_round() -> None:
    s = StickyGroups(A.node_id, keep_rounds=10)
    s.after_matchmaking(group(), 1, 3, IDS)
    s.after_round(silent=False)
    assert s.usable(2) is not None
    s.after_round(silent=True)
    assert s.broken == "silent"
    assert s.usable(3) is None
    assert s.dropped == {"silent": 1}


def test_a_late_break_does_not_touch_a_newer_kept_group() -> None:
    s = StickyGroups(A.node_id, keep_rounds=10)
    s.after_matchmaking(group(), 1, 3, IDS)
    old = s.kept
    s.after_matchmaking(group(gid=8), 5, 3, IDS)
    s.break_("refused", old)  # an answer about the old group
    assert not s.broken
    s.break_("refused", s.kept)
    assert s.broken == "refused"


def test_follower_takes_the_leaders_renewal_even_before_its_round() -> None:
    s = StickyGroups(B.node_id, keep_rounds=10)
    s.after_matchmaking(group(me=B), 4, 3, IDS)
    assert s.kept is not None and not s.leads(s.kept)
    assert s.take_begin(5) is None
    # from the leader, for the round this node is in (5) or about to start (6), with the same members
    assert s.offer_begin(A.node_id, 6, 5, 123, [A, B, C])
    assert s.offer_begin(A.node_id, 5, 5, 122, [A, B, C])
    g = s.take_begin(5)
    assert g is not None and g.group_id == 122 and g.index == 1 and g.leader == A.node_id
    assert s.take_begin(5) is None
    assert s.begun == 5
    assert s.take_begin(6).group_id == 123
    assert s.begun == 6  # a late refusal of an ask for round 5 or 6 no longer breaks the group


def test_follower_refuses_renewals_it_cannot_trust() -> None:
    s = StickyGroups(B.node_id, keep_rounds=3)
    assert not s.offer_begin(A.node_id, 5, 5, 1, [A, B, C])  # nothing kept
    s.after_matchmaking(group(me=B), 4, 3, IDS)
    assert not s.offer_begin(C.node_id, 5, 5, 1, [A, B, C])  # not the leader
    assert not s.offer_begin(A.node_id, 5, 5, 1, [A, B, C, D])  # another member list
    assert not s.offer_begin(A.node_id, 5, 5, 1, [B, A, C])  # another order: another shard layout
    assert not s.offer_begin(A.node_id, 8, 5, 1, [A, B, C])  # too far ahead
    assert not s.offer_begin(A.node_id, 4, 5, 1, [A, B, C])  # a round already done
    assert not s.offer_begin(A.node_id, 7, 6, 1, [A, B, C])  # past the kept rounds (4 + 2)
    s.break_("disbanded")
    assert not s.offer_begin(A.node_id, 5, 5, 1, [A, B, C])  # broken: re-forming


def test_early_renewals_are_bounded_and_forgotten() -> None:
    s = StickyGroups(B.node_id, keep_rounds=1000)
    s.after_matchmaking(group(me=B), 0, 3, IDS)
    for r in range(1, 3 * MAX_EARLY):
        assert s.offer_begin(A.node_id, r, r, r, [A, B, C])
    assert len(s._early) <= MAX_EARLY
    s.after_matchmaking(group(me=B), 10_000, 3, IDS)
    assert not s._early
    assert s.statistics().kept.formed == 10_000


def test_leader_waits_until_every_follower_asked_for_the_round() -> None:
    s = StickyGroups(A.node_id, keep_rounds=5)
    s.after_matchmaking(group(), 4, 3, IDS)
    assert s.missing(5) == {B.node_id, C.node_id}
    assert s.offer_join(B.node_id, 5, 5)
    assert s.missing(5) == {C.node_id}
    # C is still finishing round 4 elsewhere ... its ask for round 6 (early: this node is in 5) is held
    assert s.offer_join(C.node_id, 6, 5)
    assert s.missing(5) == {C.node_id} and s.missing(6) == {B.node_id}
    assert s.offer_join(C.node_id, 5, 5)
    assert not s.missing(5)
    assert s.renewal(42, 5).members == (A, B, C)
    # asks for rounds this node has finished are forgotten as it moves on
    assert s.offer_join(B.node_id, 6, 6) and s.offer_join(B.node_id, 7, 6)
    assert 5 not in s._ready and not s.missing(6)


def test_leader_refuses_asks_it_cannot_serve() -> None:
    s = StickyGroups(A.node_id, keep_rounds=3)
    assert not s.offer_join(B.node_id, 5, 5)  # nothing kept
    s.after_matchmaking(group(), 4, 3, IDS)
    assert not s.offer_join(D.node_id, 5, 5)  # not a member
    assert not s.offer_join(A.node_id, 5, 5)  # myself
    assert not s.offer_join(B.node_id, 4, 5)  # a round already done
    assert not s.offer_join(B.node_id, 7, 5)  # too far ahead
    assert not s.offer_join(B.node_id, 7, 6)  # past the kept rounds (4 + 2)
    assert s.offer_join(B.node_id, 6, 6)
    s.break_("silent")
    assert not s.offer_join(C.node_id, 6, 6)  # broken: the follower matchmakes at once
    s.drop("silent")
    assert s.missing(6) == frozenset()  # nothing kept, nothing to wait for
    # a follower never leads the renewal: asks sent to it are refused
    f = StickyGroups(B.node_id, keep_rounds=3)
    f.after_matchmaking(group(me=B), 4, 3, IDS)
    assert not f.offer_join(C.node_id, 5, 5)


def test_a_new_group_forgets_asks_for_the_old_one() -> None:
    s = StickyGroups(A.node_id, keep_rounds=10)
    s.after_matchmaking(group(), 1, 3, IDS)
    assert s.offer_join(B.node_id, 2, 2) and s.offer_join(C.node_id, 2, 2)
    s.after_matchmaking(group(gid=9), 1, 3, IDS)  # re-formed through the DHT (same round number: a restart)
    assert s.missing(2) == {B.node_id, C.node_id}
    s.drop("silent")
    s.after_matchmaking(group(), 1, 3, IDS)
    assert s.missing(2) == {B.node_id, C.node_id}


def test_a_numbered_run_renews_its_kept_group_at_rounds_whose_numbers_skip() -> None:
    """A DiLoCo outer step is numbered by the trainer's step (rounds 80, 160, 240, ...): its kept group is
    renewed for the next keep_rounds - 1 rounds whatever their numbers, and asks and BEGINs for a later round
    are held while this node is still past the last one (its next round is the caller's to number)."""
    leader, follower = StickyGroups(A.node_id, keep_rounds=3), StickyGroups(B.node_id, keep_rounds=3)
    for s, me in ((leader, A), (follower, B)):
        s.numbered = True
        s.after_matchmaking(group(me=me), 80, 3, IDS)
    # the leader finished round 80 (its current round is 81); the follower asks for round 160 already
    assert leader.offer_join(B.node_id, 160, 81) and leader.offer_join(C.node_id, 160, 81)
    assert leader.usable(160) is not None and not leader.missing(160)
    assert leader.renewal(5, 160).members == (A, B, C)
    assert follower.offer_begin(A.node_id, 160, 81, 5, [A, B, C])
    assert follower.usable(160) is not None and follower.take_begin(160).group_id == 5
    # a round already done is still refused; the renewals run out after keep_rounds - 1 of them
    assert not leader.offer_join(B.node_id, 160, 161) and not follower.offer_begin(A.node_id, 80, 161, 6, [A, B, C])
    assert leader.offer_join(B.node_id, 400, 161)
    assert leader.usable(400) is not None
    leader.renewal(6, 400)
    assert not leader.offer_join(B.node_id, 480, 401)  # used up
    assert leader.usable(480) is None and leader.dropped == {"used_up": 1}
    # the same skip in a run whose rounds the daemon numbers is refused: there the next round is current + 1
    plain = StickyGroups(A.node_id, keep_rounds=1000)
    plain.after_matchmaking(group(), 80, 3, IDS)
    assert not plain.offer_join(B.node_id, 160, 81)


def test_a_numbered_runs_asks_for_later_rounds_are_bounded() -> None:
    """A member may name any later round in a numbered run: what the leader holds stays bounded, the nearest
    rounds kept."""
    s = StickyGroups(A.node_id, keep_rounds=1000)
    s.numbered = True
    s.after_matchmaking(group(), 10, 3, IDS)
    for r in range(11, 11 + 5 * MAX_EARLY):
        s.offer_join(B.node_id, r * 7, 11)
    assert len(s._ready) <= MAX_EARLY and min(s._ready) == 77
