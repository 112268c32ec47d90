"""Finding this round's group (sans-I/O, injected wall-clock time).

Every peer looking under one key announces ``(expiry, node id)`` in the DHT. Peers are ordered by
that pair; a peer asks the earliest peer before it to lead it. Reachability comes first (``lead_key``): a
public peer leads before a peer behind a cone NAT, which leads before the rest, so that followers behind NATs
can reach their leader (NAT traversal); who is in a group stays the key's. A leader closes its group when it
reaches the target size, or at its own expiry with at least the minimum size, else disbands. Only the
leader's ordered member list (sent in BEGIN) defines the group, so peers that saw different DHT
contents can never average with different lists.

The driver feeds in what the DHT showed, the JOIN/BEGIN/DISBAND messages and their answers, and
timer ticks; it performs the actions the matchmaker queues (``take_actions``).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..entropy import default_rng

BUSY_RETRY_S = 0.3  # a candidate that was busy (its own JOIN in flight) is asked again after this
FOLLOW_SLACK_S = 2.5  # a follower waits this long past its leader's expiry for BEGIN (covers its retries)
SETTLE_S = 0.3  # a leader that has everyone looking under its key closes once the DHT showed no newcomer this long
UNEXPECTED_SETTLE_S = 1.5  # ... this long when the matchmaker does not know whom the run expects
# A follower asks its leader again (the same MM_JOIN) this long after each answer while it waits for BEGIN: no
# answer at all means the leader is gone, and the follower looks again at once. Without it the followers of a
# leader that died before closing would wait until its expiry plus FOLLOW_SLACK_S, past their own expiries, and
# all give up alone (`peerd sim moshpit --fail 0.1`: most of the peers alone in a failed leader's rounds).
PROBE_S = 0.5


@dataclass(frozen=True, order=True)
class Candidate:
    """A peer looking for a group: ordered by (expiry, node id); earlier peers lead (after ``reach``:
    ``lead_key``)."""

    expiry: float  # wall clock, as announced
    node_id: bytes
    public_key: bytes = field(compare=False)
    addr: tuple[str, int] = field(compare=False)
    reach: int = field(default=2, compare=False)  # REACH_*, as announced: who may lead first
    capped: bool = field(default=False, compare=False)  # it announced bandwidth caps: a smaller shard (Begin)


REACH_PUBLIC, REACH_CONE, REACH_UNKNOWN, REACH_SYMMETRIC = 0, 1, 2, 3
REACH_RANK = {"public": REACH_PUBLIC, "cone-nat": REACH_CONE, "unknown": REACH_UNKNOWN,
              "symmetric-nat": REACH_SYMMETRIC}


def lead_key(c: Candidate) -> tuple[int, float, bytes]:
    """Who leads whom: reachable peers first (anyone can reach a public one; a symmetric NAT's peer only
    through a relay), then the earliest expiry, then the node id. Every peer sees the same announced values,
    so all agree on it."""
    return (c.reach, c.expiry, c.node_id)


@dataclass(frozen=True)
class Group:
    group_id: int
    members: tuple[Candidate, ...]  # the leader's authoritative order
    index: int  # this peer's position in ``members``
    leader: bytes  # node id


@dataclass(frozen=True)
class Join:
    leader: Candidate


@dataclass(frozen=True)
class Begin:
    group: Group
    to: tuple[Candidate, ...]


@dataclass(frozen=True)
class Disband:
    to: tuple[Candidate, ...]


@dataclass(frozen=True)
class Probe:
    """Send ``leader`` my MM_JOIN again: an answer says it is alive and whether it still leads me
    (``on_probe_answered``), none says it is gone (``on_probe_failed``)."""

    leader: Candidate


Action = Join | Begin | Disband | Probe


class State(enum.Enum):
    LEADING = "leading"  # nobody earlier to follow (yet); accepts followers
    JOINING = "joining"  # a JOIN to ``leader`` is in flight
    FOLLOWING = "following"  # accepted by ``leader``; waiting for BEGIN
    DONE = "done"  # in a group, or alone


class Matchmaker:
    def __init__(
        self,
        me: Candidate,
        *,
        target: int,
        min_size: int = 2,
        now: float,
        rng: random.Random | None = None,
        settle_s: float | None = SETTLE_S,
        capped_of: Callable[[bytes], bool] | None = None,
    ) -> None:
        """``settle_s``: close below the target once every peer looking under the key has joined and the DHT
        showed nobody new for that long (None: wait for the target or the deadline, as on an exact grid).
        ``capped_of``: whether a node's latest matchmaking record, of any round, carried caps (a follower's JOIN
        carries none; this matchmaking's reads may not have shown its record yet)."""
        if not 2 <= min_size <= target:
            raise ValueError(f"need 2 <= min_size <= target, got min_size={min_size} target={target}")
        self.me = me
        self.target = target
        self.min_size = min_size
        self.started = now
        self.rng = default_rng(rng)
        self.state = State.LEADING
        self.leader: Candidate | None = None
        self.follow_deadline = math.inf
        self._probe_at = math.inf  # when to probe the leader I follow (inf: not following, or a probe is out)
        self.followers: list[Candidate] = []
        self.group: Group | None = None
        self.seen = 1  # the most peers (me included) seen announced under the key
        self.seen_ids: frozenset[bytes] = frozenset([me.node_id])  # who they were (the read that showed most)
        self._candidates: list[Candidate] = []
        self._refused: dict[bytes, float] = {}  # node id -> until when not to ask it again
        self._actions: list[Action] = []
        self.settle_s = settle_s
        self.capped_of = capped_of
        self._looking: frozenset[bytes] = frozenset([me.node_id])  # live peers the DHT shows under the key
        self._changed_at = now  # when the set of peers looking last changed
        self._joined_at = now  # when a follower last joined
        self._now = now
        self.expected: frozenset[bytes] | None = None  # peers recently active in the run, if known
        self._doubtful: frozenset[bytes] = frozenset()  # ... of them, waited for only until _doubt_until
        self._doubt_until = math.inf

    # -- what the driver reads ------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state is State.DONE

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def get_timer(self) -> float | None:
        """When ``handle_timer`` is due next (absolute; the matchmaker always has one: its expiry)."""
        if self.state is State.LEADING:
            settled_at = self._settled_at()
            if self.settle_s is not None and self.followers and settled_at > self._now:
                return min(self.me.expiry, settled_at)
            return self.me.expiry
        if self.state is State.FOLLOWING:
            return min(self.follow_deadline, self._probe_at)
        return self.me.expiry + FOLLOW_SLACK_S

    # -- inputs ---------------------------------------------------------------------------------
    def on_entries(self, entries: list[Candidate], now: float) -> None:
        """What a DHT read of the key showed (any order, may include me and stale peers)."""
        ids = frozenset([self.me.node_id, *(c.node_id for c in entries)])
        if len(ids) > self.seen:
            self.seen, self.seen_ids = len(ids), ids
        self._candidates = sorted((c for c in entries if c.node_id != self.me.node_id and c.expiry > now),
                                  key=lead_key)
        looking = frozenset([self.me.node_id, *(c.node_id for c in self._candidates)])
        if looking != self._looking:
            self._looking = looking
            self._changed_at = now
        self._now = max(self._now, now)
        self._look(now)
        self._close_if_all_in(now)

    def on_join_request(self, peer: Candidate, now: float) -> tuple[bool, str]:
        """A peer asks me to lead it. Answers (accepted, reason): ``closed`` only to a member of the group I
        closed (its BEGIN is on the way), ``disbanded`` to anyone else once I am done."""
        if peer.node_id == self.me.node_id:
            return False, "self"
        if self.state is State.DONE:
            return False, "closed" if self.in_group(peer.node_id) else "disbanded"
        if self.state is State.FOLLOWING:
            return False, "following"
        if self.state is State.JOINING:
            return False, "busy"
        if all(f.node_id != peer.node_id for f in self.followers):
            self.followers.append(peer)
            self._joined_at = now
        if 1 + len(self.followers) >= self.target:
            self._close()
        else:
            self._close_if_all_in(now)
        return True, "ok"

    def on_join_response(self, leader: bytes, accepted: bool, reason: str, now: float) -> None:
        if self.state is not State.JOINING or self.leader is None or self.leader.node_id != leader:
            return  # an answer we stopped waiting for
        if accepted or reason == "closed":
            # ``closed`` to a JOIN: the leader closed a group that holds me (my JOIN got in, its answer was lost and
            # the retransmission came after the close): its BEGIN, sent with retries, is on the way. Taken as a
            # refusal, the BEGIN found me leading and was refused, and the group waited out my silence.
            self.state = State.FOLLOWING
            self.follow_deadline = self.leader.expiry + FOLLOW_SLACK_S
            self._probe_at = now + PROBE_S
            return
        self._refused[leader] = now + BUSY_RETRY_S if reason in ("busy", "not_ready") else math.inf
        self._lead(now)

    def on_join_failed(self, leader: bytes, now: float) -> None:
        """The JOIN got no answer after its retries: that peer is gone."""
        self.on_join_response(leader, False, "unreachable", now)

    def on_probe_answered(self, leader: bytes, reason: str, now: float) -> None:
        """The leader I follow answered a probe: ``ok`` (it still leads me) or ``closed`` (I am in the group it
        closed: its BEGIN, sent with retries, is on the way) say keep waiting. Any other answer says it no longer
        leads me: it follows or joins someone else, or closed without me, so it sent me an MM_DISBAND, which is
        one datagram and may have been lost (under 10 % loss, followers waited out the leader's expiry plus
        FOLLOW_SLACK_S, about 5.5 s, and ended alone): look again, as on that DISBAND."""
        if self.state is State.FOLLOWING and self.leader is not None and self.leader.node_id == leader:
            if reason in ("ok", "closed"):
                self._probe_at = now + PROBE_S
            else:
                self.on_disband(leader, now)

    def on_probe_failed(self, leader: bytes, now: float) -> None:
        """The leader I follow did not answer a probe after its retries: it is gone. Look again (or give up,
        past my own expiry)."""
        if self.state is State.FOLLOWING and self.leader is not None and self.leader.node_id == leader:
            self._refused[leader] = math.inf
            if now < self.me.expiry:
                self._lead(now)
            else:
                self._give_up()

    def on_begin(self, leader: bytes, group_id: int, members: list[Candidate]) -> bool:
        """The leader closed its group. Accepted only from the leader I follow (or am joining)."""
        if self.state not in (State.FOLLOWING, State.JOINING) or self.leader is None:
            return False
        if self.leader.node_id != leader:
            return False
        index = next((i for i, c in enumerate(members) if c.node_id == self.me.node_id), None)
        if index is None or (members[index].capped and not self.me.capped):
            return False  # (a leader that calls me capped would give my shard to others: it is not my leader)
        self.group = Group(group_id, tuple(members), index, leader)
        self.state = State.DONE
        return True

    def on_disband(self, leader: bytes, now: float) -> None:
        if self.state in (State.FOLLOWING, State.JOINING) and self.leader is not None and self.leader.node_id == leader:
            self._refused[leader] = math.inf
            self._lead(now)

    def handle_timer(self, now: float) -> None:
        self._now = max(self._now, now)
        self._close_if_all_in(now)
        if self.state is State.LEADING and now >= self.me.expiry:
            if 1 + len(self.followers) >= self.min_size:
                self._close()
            else:
                self._give_up()
        elif self.state is State.FOLLOWING and now >= self.follow_deadline:
            assert self.leader is not None
            self._refused[self.leader.node_id] = math.inf  # it died or forgot me
            if now < self.me.expiry:
                self._lead(now)
            else:
                self._give_up()
        elif self.state is State.FOLLOWING and now >= self._probe_at:
            assert self.leader is not None
            self._probe_at = math.inf  # until it answers
            self._actions.append(Probe(self.leader))
        elif self.state is State.JOINING and now >= self.me.expiry + FOLLOW_SLACK_S:
            self._give_up()

    # -- internals ------------------------------------------------------------------------------
    @property
    def alone(self) -> bool:
        """Leading nobody and following nobody: leaving this key now strands no one."""
        return self.state is State.LEADING and not self.followers

    def seen_rank(self) -> int:
        """My place among the peers seen under the key, by node id: the index a group of them all gives me."""
        return sorted(self.seen_ids).index(self.me.node_id)

    def in_group(self, node_id: bytes) -> bool:
        """Whether ``node_id`` is a member of the group this peer closed or joined."""
        return self.group is not None and any(c.node_id == node_id for c in self.group.members)

    def _lead(self, now: float) -> None:
        self.state = State.LEADING
        self.leader = None
        self.follow_deadline = math.inf
        self._probe_at = math.inf
        self._look(now)

    def _look(self, now: float) -> None:
        """As a leader, follow the earliest peer before me that has not refused me."""
        if self.state is not State.LEADING:
            return
        mine = lead_key(self.me)
        for c in self._candidates:
            if lead_key(c) >= mine:
                break
            if self._refused.get(c.node_id, 0.0) > now:
                continue
            if self.followers:  # someone earlier leads this key: hand my followers over
                self._actions.append(Disband(tuple(self.followers)))
                self.followers = []
            self.state = State.JOINING
            self.leader = c
            self._actions.append(Join(c))
            return

    def set_expected(self, node_ids: frozenset[bytes], now: float) -> None:
        """Peers the run expects this round (they finished a recent round): wait longer for a missing one."""
        self.expected = node_ids
        self._now = max(self._now, now)
        self._close_if_all_in(now)

    def receive_doubtful(self, node_ids: frozenset[bytes], until: float, now: float) -> None:
        """Expected peers that may be gone (they were in this node's last group and did not publish finishing it):
        once every other expected peer is in, a missing one of these is waited for only until ``until``."""
        self._doubtful, self._doubt_until = node_ids, until
        self._now = max(self._now, now)
        self._close_if_all_in(now)

    def _settled_at(self) -> float:
        if self.expected is None:
            # nobody told us who to expect: a pause without newcomers will do, counting a follower's JOIN as one
            # (it often comes before the DHT shows its announcement: DiLoCo's first outer step closed 70 ms
            # after the second of three trainers joined, and the third, 0.3 s behind, averaged alone)
            return max(self._changed_at, self._joined_at) + UNEXPECTED_SETTLE_S
        missing = self.expected - {self.me.node_id, *(f.node_id for f in self.followers)}
        if not missing:
            return self._changed_at + (self.settle_s or 0.0)
        if missing <= self._doubtful:  # only peers that may have died are missing: wait for them a little
            return max(self._changed_at + (self.settle_s or 0.0), self._doubt_until)
        # a peer the run expects is missing (a slow step, usually): wait for it, up to the deadline
        return math.inf

    def _close_if_all_in(self, now: float) -> None:
        """Everyone looking under the key follows me: waiting for the target would only wait out the deadline."""
        if (self.settle_s is None or self.state is not State.LEADING or not self.followers
                or 1 + len(self.followers) < self.min_size or now < self._settled_at()):
            return
        if self._looking <= {self.me.node_id, *(f.node_id for f in self.followers)}:
            self._close()

    def _close(self) -> None:
        # a follower's caps are what its record said (a JOIN carries none): capped members own smaller shards
        capped = {c.node_id for c in self._candidates if c.capped}
        followers = [replace(f, capped=f.node_id in capped or bool(self.capped_of and self.capped_of(f.node_id)))
                     for f in self.followers]
        members = tuple(sorted([self.me, *followers], key=lambda c: c.node_id))
        index = members.index(self.me)
        group_id = self.rng.randrange(1, 2**32)
        self.group = Group(group_id, members, index, self.me.node_id)
        self.state = State.DONE
        if self.followers:
            self._actions.append(Begin(self.group, tuple(self.followers)))

    def _give_up(self) -> None:
        if self.followers:
            self._actions.append(Disband(tuple(self.followers)))
            self.followers = []
        self.group = None
        self.state = State.DONE
