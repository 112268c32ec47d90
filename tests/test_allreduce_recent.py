"""RecentMembers: the members a node averaged with lately, by time, bounded in number."""

from __future__ import annotations

import math

from peerd.allreduce.recent import RecentMembers


def test_a_member_is_recent_for_the_window_after_its_latest_group_ended() -> None:
    recent = RecentMembers(window_s=10.0)
    assert recent.within(0.0) == (set(), math.inf)
    recent.ended([b"a", b"b"], 1.0)
    recent.ended([b"a", b"c"], 5.0)  # a's latest group
    assert recent.within(6.0) == ({b"a", b"b", b"c"}, 11.0)  # b drops out first
    assert recent.within(11.0) == ({b"a", b"c"}, 15.0)
    assert recent.within(15.0) == (set(), math.inf)


def test_members_remembered_are_bounded_the_oldest_go_first() -> None:
    recent = RecentMembers(window_s=10.0, max_members=3)
    for i in range(5):
        recent.ended([bytes([i])], float(i))
    assert recent.within(5.0)[0] == {b"\x02", b"\x03", b"\x04"}
