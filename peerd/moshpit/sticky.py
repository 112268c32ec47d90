"""Keeping a formed group for several rounds (sans-I/O).

Matchmaking through the DHT costs a few DHT reads and JOIN round trips per round, which under loss is
most of a small model's round. A group that formed *complete* (everyone the DHT showed under the key,
and everyone the run expects, is in it) is therefore kept for up to ``keep_rounds`` rounds: in a kept
round the leader sends the same member list in a fresh MM_BEGIN and nobody touches the DHT's group key.
A kept round synchronises like matchmaking: every follower, once it starts the round, asks the leader
(MM_JOIN with key ``RENEW_KEY``), and the leader sends the renewal BEGIN only when all of them have asked.
Without that, a leader that started averaging at once found a follower still busy elsewhere (its other
run's round, a slow step) and averaged it out as silent, which broke the group every few rounds.

The group goes back to DHT matchmaking (so newcomers get in and a changed swarm re-forms) when

- its rounds are used up,
- a member did not acknowledge the renewal, or refused it,
- anyone heard nothing from a member during the averaging (unless it gave up on that member as dead),
- the leader saw a peer outside the group announce under the run's key (a newcomer) or publish
  progress in the run lately (an outsider still training),
- a follower waited the renewal window without a BEGIN (the leader died), or the leader waited its
  window for a follower's renewal request (the follower died or dropped the group), unless the member
  waited for is alive (below),
- the leader waited for is dead: its daemon did not answer three PINGs (below; a dead follower is left out
  instead, as one found dead mid-average),
- or a member did not keep the group at all (its view of who was looking differed): it tells the leader.

A late member is told apart from a dead one by asking its daemon, which answers while its trainer is busy
(evaluating on the whole validation split, checkpointing). Once a member the renewal waits for (a follower
that has not asked, or the leader whose BEGIN has not come) is a few round trips late and this node has not
heard from it this round, the waiting side PINGs its daemon (``liveness.LateMembers``; each probe's timeout is
a few of its round trips, resent inside at the transport's RTO, so loss costs a resend, not a verdict). A
member whose own node id answers is alive: the renewal waits for it past the tuned window and the window's cap, up
to half the round's budget, re-probing it every half second, so a trainer whose evaluation ran seconds long (four
evaluations on two shared cores end seconds apart) is averaged in instead of averaging alone while the others
re-form without it. A member waited for so long in vain is waited for only up to the window's cap in the next
``liveness.OVERSTAY_ROUNDS`` rounds. A member
whose daemon leaves three probes in a row unanswered (or answered by another node id) is dead: a dead follower
is left out and the others renewed at once, a dead leader makes its followers drop the group ("dead", about
0.35 s on a LAN), instead of at the window's end; the matchmakings that
follow do not expect it while its latest progress record predates that verdict (``RoundMachine.gone``). A member
that answers probes but never asks holds the group no longer than half the budget once, then the cap. A member
that dies mid-average is found the same way (the averaging PINGs a member whose stream went silent,
``allreduce/liveness.py``) and is not waited for in the matchmaking that follows either.

A member found dead mid-average (its daemon stopped answering the PINGs the averaging sends a member whose stream
went silent) leaves the kept group instead: the others keep it without that member, so the round after a death
starts at once, without a matchmaking through the DHT (a member that was alive after all announces under the key
and the leader re-forms the group with it). The leader's renewal BEGIN then lists the formation's members without
those it found dead, in the same order; a follower takes any such list that holds it and the leader. Where the
leader is the one found dead, the first member left (in the group's order) leads the renewals from then on: every
survivor that found it dead names the same successor, and one that did not yet asks the dead leader, finds it dead
by its PINGs, and re-forms through the DHT as before. Two members at least must remain, else the group re-forms
through the DHT.

Every case ends in ordinary matchmaking, whose waits are bounded, so a failure costs at most one
round's deadlines and never hangs. This module holds the per-run decision state; the trio driver
(``service.MoshpitService``) does the sending and waiting.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace

from .matchmaking import Candidate, Group

MAX_EARLY = 64  # renewal BEGINs held for rounds this node has not started yet (bounded)
RENEW_KEY = "kept"  # the key a renewal MM_JOIN carries: no group key looks like it, so a leader that is
# matchmaking through the DHT this round refuses it ("key") instead of taking the follower in by mistake


@dataclass(frozen=True)
class KeptStatistics:
    """The group kept now: its size, the round it formed in, the round it is kept until, its leader (hex) and
    whether it is broken (it matchmakes at its next round)."""

    size: int
    formed: int
    until: int
    leader: str
    broken: bool


@dataclass(frozen=True)
class StickyStatistics:
    """A run's kept groups: ``keep_rounds``, the group kept now (None: none), kept rounds renewed so far, groups
    dropped by reason, groups that went on without members found dead, and of those, without their leader."""

    keep_rounds: int
    kept: KeptStatistics | None
    renewed: int
    dropped: dict[str, int]
    shrunk: int = 0
    succeeded: int = 0


@dataclass(frozen=True)
class Kept:
    """A group kept from round ``formed`` for rounds ``formed + 1 .. formed + rounds``."""

    members: tuple[Candidate, ...]
    index: int
    leader: bytes  # node id
    formed: int  # the round it formed in (through the DHT)
    rounds: int  # how many further rounds it may be renewed for
    formed_at: float = 0.0  # when (wall clock): a progress record stored before it was accounted for in forming it
    formation: tuple[Candidate, ...] = ()  # the members it formed with (a renewal may list fewer: some found dead)

    @property
    def leader_candidate(self) -> Candidate:
        return self.members[next(i for i, c in enumerate(self.members) if c.node_id == self.leader)]

    def node_ids(self) -> frozenset[bytes]:
        return frozenset(c.node_id for c in self.members)


def is_complete(group: Group, seen: int, expected: frozenset[bytes] | None) -> bool:
    """A group worth keeping holds every peer seen under its key and every peer the run expects
    (the peers that finished a recent round, from their progress records; unknown or none: not kept).

    A group that closed without some of them (a slow peer, a split key) must not be kept: the peers
    outside would never meet it while it skips the DHT, and the two halves would drift apart."""
    ids = {c.node_id for c in group.members}
    if len(group.members) < 2 or len(ids) < seen or not expected:
        return False
    return expected <= ids


class StickyGroups:
    """Per run: the kept group, if any, and renewal BEGINs that arrived before their round."""

    def __init__(self, me: bytes, keep_rounds: int) -> None:
        if type(keep_rounds) is not int or not 1 <= keep_rounds <= 1000:
            raise ValueError(f"keep_rounds must be an integer in [1, 1000], got {keep_rounds!r}")
        self.me = me
        self.keep_rounds = keep_rounds
        self.kept: Kept | None = None
        # the caller numbers the run's rounds and may skip numbers (a DiLoCo outer step is numbered by the trainer's
        # step): a kept group is renewed for its next ``keep_rounds - 1`` rounds, whatever their numbers, and a
        # member may ask for (or be sent) any later round, not only the next one (set by each round's start)
        self.numbered = False
        self._renewals = 0  # renewals of the kept group (what a numbered run's limit counts)
        self.broken: str = ""  # why the kept group will not be renewed next round ("" while it may be)
        self._early: OrderedDict[int, tuple[int, tuple[Candidate, ...]]] = OrderedDict()  # round -> begin
        self._ready: dict[int, set[bytes]] = {}  # as the leader: round -> followers that asked for it
        self.renewed = 0  # rounds averaged in a kept group
        self.begun = -1  # the latest round whose renewal BEGIN this node (a follower) took
        self.dropped: dict[str, int] = {}  # why kept groups ended, counted
        self.shrunk = 0  # kept groups that went on without members found dead
        self.succeeded = 0  # ... of which their leader (the first member left leads)

    # -- decisions ------------------------------------------------------------------------------
    def usable(self, round_no: int) -> Kept | None:
        """The kept group, if round ``round_no`` may reuse it; drops it otherwise."""
        kept = self.kept
        if kept is None:
            return None
        if self.broken:
            self.drop(self.broken)
            return None
        if not self._in_reach(kept, round_no):
            self.drop("used_up" if round_no > kept.formed else "round")
            return None
        return kept

    def _in_reach(self, kept: Kept, round_no: int) -> bool:
        """Whether round ``round_no`` may renew ``kept``: one of the ``rounds`` after its formation (a numbered
        run: any later round while renewals are left)."""
        if round_no <= kept.formed:
            return False
        return self._renewals < kept.rounds if self.numbered else round_no <= kept.formed + kept.rounds

    def _soon(self, round_no: int, current: int) -> bool:
        """Whether ``round_no`` is the round this node is in or about to start (its ``current`` one or the next;
        in a numbered run, any later one: its number is the caller's)."""
        return current <= round_no and (self.numbered or round_no <= current + 1)

    def leads(self, kept: Kept) -> bool:
        return kept.leader == self.me

    def after_matchmaking(self, group: Group | None, round_no: int, seen: int,
                          expected: frozenset[bytes] | None, now: float = 0.0) -> None:
        """A round matchmade through the DHT (its matchmaking started at ``now``): keep its group if it is
        complete."""
        self._forget_before(round_no + 1)
        self._ready.clear()  # asks were for the group this matchmaking replaces
        if self.keep_rounds <= 1 or group is None or not is_complete(group, seen, expected):
            self.kept, self.broken = None, ""
            return
        self.kept = Kept(group.members, group.index, group.leader, round_no, self.keep_rounds - 1, now,
                         group.members)
        self.broken, self._renewals = "", 0

    def after_round(self, silent: bool, dead: frozenset[bytes] = frozenset()) -> None:
        """An averaging (kept or fresh) ended; ``silent``: some member not found dead was never heard from (or the
        average failed): the group is not kept, it re-forms through the DHT. ``dead``: members this node gave up
        on mid-average because their daemons stopped answering its PINGs: the group is kept without them while two
        members remain, the first of them leading where the leader is among them (else it re-forms, where a member
        found dead is not waited for: ``RoundMachine.gone``)."""
        kept = self.kept
        if kept is None:
            return
        gone = dead & kept.node_ids()
        if silent:
            self.broken = self.broken or "silent"
        elif gone:
            self._shrink(tuple(c for c in kept.members if c.node_id not in gone), succeed=kept.leader in gone)

    def without(self, dead: frozenset[bytes]) -> bool:
        """As the leader whose renewal found followers ``dead`` (their daemons did not answer its PINGs): go on
        without them (see ``after_round``). Whether the group is still kept."""
        kept = self.kept
        if kept is None or self.broken or kept.leader in dead or not dead & kept.node_ids():
            return False
        self._shrink(tuple(c for c in kept.members if c.node_id not in dead))
        return not self.broken

    def _shrink(self, members: tuple[Candidate, ...], succeed: bool = False) -> None:
        """Keep the group with ``members`` (a part of its formation, in its order); too few left: not kept.
        ``succeed``: the leader was found dead, and the first of ``members`` leads the renewals from now on."""
        kept = self.kept
        assert kept is not None
        me = next((i for i, c in enumerate(members) if c.node_id == self.me), None)
        if len(members) < 2 or me is None:
            self.broken = self.broken or "dead"
            return
        self.kept = replace(kept, members=members, index=me,
                            leader=members[0].node_id if succeed else kept.leader)
        self.shrunk += 1
        self.succeeded += succeed

    def break_(self, reason: str, kept: Kept | None = None) -> None:
        """Do not renew the kept group again (a refused or unacknowledged renewal, a newcomer); with
        ``kept``, only if that is still the kept group (a late answer must not break a newer one)."""
        if self.kept is not None and not self.broken and (kept is None or kept is self.kept):
            self.broken = reason

    def drop(self, reason: str) -> None:
        if self.kept is not None:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.kept, self.broken = None, ""
        self._ready.clear()

    # -- renewal requests as the leader ---------------------------------------------------------
    def offer_join(self, sender: bytes, round_no: int, current: int) -> bool:
        """A follower of my kept group is ready for round ``round_no`` (it asked for the renewal).

        Held for the round this node is in or about to start; refused (the follower then matchmakes
        through the DHT at once) when I do not lead a kept group holding it, or it is broken or used up."""
        kept = self.kept
        if kept is None or self.broken or kept.leader != self.me or sender == self.me:
            return False
        if sender not in kept.node_ids() or not self._soon(round_no, current) or not self._in_reach(kept, round_no):
            return False
        self._ready.setdefault(round_no, set()).add(sender)
        for r in [r for r in self._ready if r < current]:
            del self._ready[r]
        while len(self._ready) > MAX_EARLY:  # (a numbered run's members may name any later round: bounded)
            del self._ready[max(self._ready)]
        return True

    def missing(self, round_no: int) -> frozenset[bytes]:
        """As the leader: the kept group's followers that have not asked for round ``round_no`` yet."""
        kept = self.kept
        if kept is None:
            return frozenset()
        return kept.node_ids() - {self.me} - self._ready.get(round_no, set())

    # -- renewal BEGINs as a follower -----------------------------------------------------------
    def offer_begin(self, sender: bytes, round_no: int, current: int, group_id: int,
                    members: list[Candidate]) -> bool:
        """A BEGIN that no matchmaking of mine is waiting for: a renewal of my kept group?

        Accepted (and held until the round starts) only from the kept group's leader, for the round
        this node is in or about to start, with the kept group's formation list, or that list without members the
        leader found dead (the same order, this node and the leader in it: the group goes on without them)."""
        kept = self.kept
        if kept is None or self.broken or sender != kept.leader:
            return False
        if not self._soon(round_no, current) or not self._in_reach(kept, round_no):
            return False
        listed = [c.node_id for c in members]
        part = tuple(c for c in kept.formation if c.node_id in set(listed))
        if (tuple(c.node_id for c in part) != tuple(listed) or len(part) < 2 or self.me not in listed
                or kept.leader not in listed):
            return False
        self._early[round_no] = (group_id, part)
        while len(self._early) > MAX_EARLY:
            self._early.popitem(last=False)
        return True

    def take_begin(self, round_no: int) -> Group | None:
        """The renewal for ``round_no`` if its BEGIN has arrived."""
        kept = self.kept
        begin = self._early.pop(round_no, None)
        if kept is None or begin is None:
            return None
        group_id, members = begin
        self.begun = max(self.begun, round_no)
        self._renewals += 1
        if members != kept.members:  # the leader went on without members it found dead
            self.kept = kept = replace(kept, members=members,
                                       index=next(i for i, c in enumerate(members) if c.node_id == self.me))
            self.shrunk += 1
        return Group(group_id, members, kept.index, kept.leader)

    def renewal(self, group_id: int, round_no: int) -> Group:
        """As the leader: the kept group under a fresh group id for ``round_no``."""
        kept = self.kept
        assert kept is not None and kept.leader == self.me
        self._renewals += 1
        return Group(group_id, kept.members, kept.index, self.me)

    def _forget_before(self, round_no: int) -> None:
        for r in [r for r in self._early if r < round_no]:
            del self._early[r]

    def statistics(self) -> StickyStatistics:
        kept = self.kept
        return StickyStatistics(
            self.keep_rounds,
            None if kept is None else KeptStatistics(len(kept.members), kept.formed, kept.formed + kept.rounds,
                                                     kept.leader.hex(), self.broken),
            self.renewed, dict(self.dropped), self.shrunk, self.succeeded,
        )


@dataclass(frozen=True)
class Watch:
    """One of a kept group's leader's reads for peers outside it: ``purpose`` "progress" or "key"."""

    kept: Kept
    started: float
    purpose: str
    round_no: int


@dataclass
class Ask:
    """A kept group's follower asking its leader to renew round ``round_no``."""

    kept: Kept
    round_no: int
    expiry: float
    deadline: float
    token: int | None = None  # the request in flight
    retry_at: float = math.inf
