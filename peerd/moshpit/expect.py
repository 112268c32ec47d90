"""Whom a round's matchmaking waits for (sans-I/O): the run's peers that finished a recent round, read from their
progress records, and among them the doubtful ones, members of this node's last group that did not publish
finishing it: dead, or a moment behind, so the leader waits for them only briefly (``RoundMachine.doubt_s``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

RECENT_ROUNDS = 3  # a peer that finished one of this many rounds before this one is expected


@dataclass(frozen=True)
class Expected:
    """``recent``: peers to wait for (the whole window); ``doubtful``: those of them to wait for only briefly;
    ``latest``: the latest round another peer finished at or past this one (-1: none: this node is not behind)."""

    recent: frozenset[bytes]
    doubtful: frozenset[bytes]
    latest: int


def expected_peers(progress: Iterable[tuple[bytes, int, float]], *, me: bytes, round_no: int,
                   last_round: int | None, lagging_s: float | None, known: Mapping[bytes, int],
                   now: float) -> Expected:
    """From believable progress records ``(owner, round finished, stored at)``: who finished a recent round (or,
    with ``lagging_s``, refreshed its record that recently: a joiner chasing a kept group), and who of those this
    node averaged with in its last round (``known``: node id -> last round averaged with it) without the record
    of finishing it, or with no record at all (expected and doubtful too). Each owner's own signed record is the
    only input about it, so a member can make only itself doubtful."""
    # Rounds the caller numbers may be far apart (DiLoCo's outer steps: round 40, then 80): a peer that finished
    # the last one this node ran is as recent as one three rounds back in a run of every round.
    recent_from = round_no - RECENT_ROUNDS if last_round is None else min(round_no - RECENT_ROUNDS, last_round)
    recent: set[bytes] = set()
    finished: dict[bytes, int] = {}
    latest = -1
    for owner, value, stored in progress:
        finished[owner] = max(finished.get(owner, -1), value)
        if value >= recent_from or (lagging_s is not None and stored > now - lagging_s):
            recent.add(owner)
        if value >= round_no and owner != me:
            latest = max(latest, value)
    if last_round is None:
        return Expected(frozenset(recent), frozenset(), latest)
    # A member of my last group with no record at all (in a run's second round, one that has not finished its
    # first yet: a capped member, say) is as doubtful as one whose record is older; else the others would expect
    # only each other and close the group a moment before it comes.
    unrecorded = {p for p, r in known.items() if r == last_round and p != me and p not in finished}
    doubtful = frozenset(p for p in recent | unrecorded if p != me and known.get(p) == last_round
                         and finished.get(p, -1) < last_round)
    return Expected(frozenset(recent | unrecorded), doubtful, latest)
