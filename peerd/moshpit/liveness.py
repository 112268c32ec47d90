"""Whether a kept group's late member lives (sans-I/O): its daemon is PINGed, and the renewal waits for it or not.

A kept round's renewal waits for every follower's ask (the leader) or for the leader's BEGIN (a follower). A member
that has not come within a few of its round trips (``grace_s``) and that this node has not heard from this round is
sent a PING, one at a time, each with an RTT-derived timeout (``probe_timeout_s``; within it the transport resends
at the member's retransmission timeout, so a lost datagram costs a resend, not a verdict). An answer from the
member's own node id means its daemon lives and its trainer is busy (evaluating, checkpointing): the renewal may
wait for it up to the longer bound the round machine gives (half the round's budget, or the window's cap for a member
that lately held a group so in vain), re-probing every ``REPROBE_S`` so that
a death meanwhile is caught. ``PROBES`` probes in a row unanswered, or answered by another node id (someone else
lives at that address), mean it is dead: the renewal gives up at once instead of waiting out its window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# the same rule tells a running average's dead member from a slow one (allreduce/liveness.py)
from ..allreduce.liveness import GRACE_FLOOR_S, PROBE_FLOOR_S, PROBES, REPROBE_S, grace_s, probe_timeout_s
from .matchmaking import Candidate

__all__ = ["GRACE_FLOOR_S", "OVERSTAY_ROUNDS", "PROBES", "PROBE_FLOOR_S", "REPROBE_S", "DoubtfulMembers",
           "LateMembers", "Overstays", "grace_s", "probe_timeout_s"]

# A kept round waits for a late member whose daemon answers (its trainer evaluating, checkpointing) up to half the
# round's budget, past the window's cap: four evaluations on two cores end seconds apart. A member that was waited
# for so long and still did not come is waited for only up to the cap in the next OVERSTAY_ROUNDS rounds, so one that
# answers probes and never comes cannot hold every round.
OVERSTAY_ROUNDS = 10
MAX_OVERSTAYS = 256  # members remembered so (bounded)


@dataclass
class _Probed:
    """One member's probes: when the next one goes (inf while one is in flight), their timeout, the one in flight,
    how many in a row went unanswered, and whether it answered one (or otherwise spoke) this round."""

    member: Candidate
    next_at: float
    timeout: float
    token: int | None = None
    failures: int = 0
    alive: bool = False


class LateMembers:
    """One kept round's probes of the members its renewal may wait for (the followers, or the leader), and how long
    it waits: until ``base`` (the window) while any member waited for is unproven, until ``long`` (the round
    machine's longer bound) once every one of them answered, not at all once one of them is dead."""

    def __init__(self, members: Iterable[Candidate], *, started: float, base: float, long: float,
                 rtt: Callable[[tuple[str, int]], float | None]) -> None:
        self.base, self.long = base, max(base, long)
        self._members: dict[bytes, _Probed] = {}
        for c in members:
            r = rtt(c.addr)
            self._members[c.node_id] = _Probed(c, started + grace_s(r), probe_timeout_s(r))

    def _of(self, waiting: Iterable[bytes]) -> list[_Probed]:
        return [p for n in waiting if (p := self._members.get(n)) is not None]

    def dead(self, waiting: Iterable[bytes]) -> frozenset[bytes]:
        """The members waited for that are dead (any: give up now)."""
        return frozenset(p.member.node_id for p in self._of(waiting) if p.failures >= PROBES)

    def deadline(self, waiting: Iterable[bytes]) -> float:
        """When the wait for ``waiting`` ends: the cap once every one of them is known alive, else the window."""
        probed = self._of(waiting)
        return self.long if probed and all(p.alive for p in probed) else self.base

    def get_timer(self, waiting: Iterable[bytes]) -> float:
        """The next probe due for a member of ``waiting``, or the wait's end, whichever comes first."""
        return min([self.deadline(waiting), *(p.next_at for p in self._of(waiting))])

    def alive(self, waiting: Iterable[bytes]) -> frozenset[bytes]:
        """The members of ``waiting`` whose daemons answered (or otherwise spoke) this round."""
        return frozenset(p.member.node_id for p in self._of(waiting) if p.alive)

    def next_probe(self, waiting: Iterable[bytes]) -> float:
        """When the next probe of a member of ``waiting`` not yet found dead is due (inf: none is)."""
        return min((p.next_at for p in self._of(waiting) if p.failures < PROBES), default=math.inf)

    def to_probe(self, waiting: Iterable[bytes], now: float) -> list[tuple[Candidate, float]]:
        """The members of ``waiting`` to PING now, each with its probe's timeout (the caller reports ``sent``)."""
        return [(p.member, p.timeout) for p in self._of(waiting) if p.token is None and now >= p.next_at]

    def sent(self, node_id: bytes, token: int) -> None:
        p = self._members[node_id]
        p.token, p.next_at = token, math.inf

    def receive_answer(self, node_id: bytes, token: int, sender: bytes | None, now: float) -> None:
        """The probe ``token`` of ``node_id`` was answered by ``sender`` (None: not at all, after its timeout).
        Only the member's own node id proves it alive (answers are sealed: the sender is authenticated)."""
        p = self._members.get(node_id)
        if p is None or p.token != token:
            return
        p.token = None
        if sender == node_id:
            p.alive, p.failures, p.next_at = True, 0, now + REPROBE_S
        else:
            p.failures += 1
            p.next_at = now  # probe again at once (the next one goes with the round machine's next check)

    def receive_heard(self, node_id: bytes, now: float) -> None:
        """The member spoke to this node this round (the leader answered an ask): alive, probed later."""
        p = self._members.get(node_id)
        if p is not None:
            p.alive, p.failures = True, 0
            if p.token is None:
                p.next_at = max(p.next_at, now + REPROBE_S)


class Overstays:
    """The members a kept round's renewal waited for to its longer bound in vain, with that round."""

    def __init__(self) -> None:
        self._at: dict[bytes, int] = {}

    def __contains__(self, node_id: bytes) -> bool:
        return node_id in self._at

    def bound(self, waiting: frozenset[bytes], round_no: int, long_s: float, cap_s: float) -> float:
        """How long round ``round_no`` may wait for ``waiting`` once they answer: ``long_s``, or at most ``cap_s``
        where one of them overstayed in the last OVERSTAY_ROUNDS rounds."""
        self._at = {n: r for n, r in self._at.items() if round_no - r < OVERSTAY_ROUNDS}
        return long_s if waiting.isdisjoint(self._at) else min(cap_s, long_s)

    def note(self, members: frozenset[bytes], round_no: int) -> None:
        for n in members:
            if n in self._at or len(self._at) < MAX_OVERSTAYS:
                self._at[n] = round_no


class DoubtfulMembers:
    """One matchmaking's doubtful members (of this node's last group, with no record of finishing that round),
    PINGed as a kept round's late members are: ``settle`` takes out those found alive (waited for as any expected
    peer: slow, not gone) and those found dead (not waited for at all); the rest are waited for only briefly."""

    def __init__(self, members: Iterable[Candidate], *, started: float,
                 rtt: Callable[[tuple[str, int]], float | None]) -> None:
        self.probes = LateMembers(members, started=started, base=math.inf, long=math.inf, rtt=rtt)
        self.doubtful: frozenset[bytes] = frozenset()

    def waits(self, joined: Iterable[bytes]) -> frozenset[bytes]:
        """The doubtful members still to come (one that joined needs no probe)."""
        return self.doubtful - set(joined)

    def settle(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(dead, alive) among the doubtful members; both leave the doubtful set."""
        dead, alive = self.probes.dead(self.doubtful), self.probes.alive(self.doubtful)
        self.doubtful -= dead | alive
        return dead, alive
