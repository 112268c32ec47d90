"""A kept group's late member, in virtual time (moshpit/liveness.py, moshpit/rounds.py): real round machines, a
transport modelled as the endpoint's (each request resent at the RTO with doubling waits until ``timeout * (2 **
attempts - 1)``), datagrams lost at random where a test says so.

The window is the tuned one (1 s) under its 3 s cap. A member whose daemon answers the PINGs of the side that waits
for it is waited for up to half the round's budget (only up to the cap once it held a group so in vain) and the kept
group averages complete; one whose daemon is silent is given up on after three probes, well inside the window
(before: at the window's end)."""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable

import msgpack
import pytest

from peerd.moshpit.keys import Grid, KeyManager
from peerd.moshpit.liveness import (
    GRACE_FLOOR_S,
    OVERSTAY_ROUNDS,
    PROBE_FLOOR_S,
    PROBES,
    REPROBE_S,
    grace_s,
    probe_timeout_s,
)
from peerd.moshpit.matchmaking import FOLLOW_SLACK_S, SETTLE_S, Candidate, Group
from peerd.moshpit.records import PROGRESS_TTL_S, encode_announce
from peerd.moshpit.rounds import Average, Get, Notify, Request, RoundMachine
from peerd.moshpit.sticky import RENEW_KEY
from peerd.tools.sim.moshpit import SimRecord
from peerd.wire import messages as m
from peerd.wire.identity import node_id_of

T0 = 1_800_000_000.0
LINE = Grid(1, 4)
WINDOW, CAP = 1.0, 3.0  # the tuned window and its cap
MIN_RTO = 0.02  # the endpoint's floor under its retransmission timeout


def peer(i: int) -> Candidate:
    pk = hashlib.sha256(b"late%d" % i).digest()
    return Candidate(0.0, node_id_of(pk), pk, (f"10.0.1.{i + 1}", 7411))


class Swarm:
    """A kept group of ``n`` (formed in round 0, renewed from round 1), its machines driven by one event queue."""

    def __init__(self, n: int = 4, *, loss: float = 0.0, seed: int = 0, rtt: float = 0.002,
                 rtt_known: bool = False) -> None:
        self.members = tuple(sorted((peer(i) for i in range(n)), key=lambda c: c.node_id))
        self.leader = self.members[0].node_id
        self.loss, self.rtt, self.rng = loss, rtt, random.Random(seed)
        self.now = T0
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.machines: dict[bytes, RoundMachine] = {}
        self.up = {c.node_id for c in self.members}  # daemons alive (a late trainer's daemon is)
        self.averaged: dict[bytes, tuple[float, Average]] = {}
        self.matchmaking: dict[bytes, float] = {}  # when each node gave up on the kept group
        self.pinged: Counter[bytes] = Counter()  # PINGs that reached each node
        self._timers: dict[bytes, int] = {}
        ids = frozenset(c.node_id for c in self.members)
        for i, c in enumerate(self.members):
            rng = random.Random(i)
            mc = RoundMachine("run", LINE, KeyManager(LINE, c.node_id, rng=rng), c, rng=rng, window_s=WINDOW,
                              keep_rounds=4)
            mc.window_cap_s = CAP
            if rtt_known:
                mc.rtt = lambda addr: rtt
            mc.sticky.after_matchmaking(Group(7, self.members, i, self.leader), 0, n, ids)
            mc.round, mc.synced = 1, True
            self.machines[c.node_id] = mc

    def id_of(self, role: str) -> bytes:
        return self.leader if role == "leader" else self.members[1].node_id

    # -- the event queue -----------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn, args))

    def run(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._queue)
            self.now = t
            fn(*args)

    def start(self, node_id: bytes, t: float, timeout_s: float = 30.0) -> None:
        self.at(t, self._start, node_id, timeout_s)

    def _start(self, node_id: bytes, timeout_s: float) -> None:
        self.machines[node_id].start_round(timeout_s=timeout_s, now=self.now)
        self.process(node_id)

    def _timer(self, node_id: bytes, version: int) -> None:
        if self._timers.get(node_id) == version:
            self.machines[node_id].handle_timer(self.now)
            self.process(node_id)

    def process(self, node_id: bytes) -> None:
        if node_id not in self.up:
            return
        mc = self.machines[node_id]
        for a in mc.take_actions():
            if isinstance(a, Request):
                self._send(node_id, a)
            elif isinstance(a, Notify) and a.to.node_id in self.up and not self._lost():
                self.at(self.now + self.rtt / 2, self._disband, a.to.node_id, node_id, a.fields["round"])
            elif isinstance(a, Get):  # nobody else under the run's keys
                self.at(self.now + self.rtt, self._records, node_id, a.token)
            elif isinstance(a, Average):
                self.averaged[node_id] = (self.now, a)
        if mc.phase == "match":
            self.matchmaking.setdefault(node_id, self.now)
        timer = mc.get_timer()
        self._timers[node_id] = version = self._timers.get(node_id, 0) + 1
        if timer is not None:
            self.at(timer, self._timer, node_id, version)

    def _records(self, node_id: bytes, token: int) -> None:
        self.machines[node_id].on_records(token, [], self.now)
        self.process(node_id)

    def _disband(self, to: bytes, sender: bytes, round_no: int) -> None:
        self.machines[to].on_disband(sender, round_no, self.now)
        self.process(to)

    # -- requests, as the endpoint sends them ----------------------------------------------------------------
    def _lost(self) -> bool:
        return self.loss > 0 and self.rng.random() < self.loss

    def _send(self, sender: bytes, req: Request) -> None:
        """Transmissions at 0, w, 3w, ... (w the RTO, doubling) until the request's deadline; the target handles
        the first one that reaches it, the sender hears the first answer that comes back."""
        deadline = req.timeout * (2**req.attempts - 1)
        wait, t = min(req.timeout, max(MIN_RTO, 2 * self.rtt)), 0.0
        reached = answered = None
        while t < deadline:
            if req.to.node_id in self.up and not self._lost():
                reached = t if reached is None else reached
                if not self._lost():
                    answered = t
                    break
            t += wait
            wait *= 2
        if reached is None:
            self.at(self.now + deadline, self._failed, sender, req.token)
            return
        self.at(self.now + reached + self.rtt / 2, self._serve, sender, req, self.now, answered, deadline)

    def _serve(self, sender: bytes, req: Request, sent: float, answered: float | None, deadline: float) -> None:
        target = self.machines[req.to.node_id]
        f = req.fields
        if req.mtype is m.MsgType.PING:
            self.pinged[req.to.node_id] += 1
            ok, reason = True, ""
        elif req.mtype is m.MsgType.MM_JOIN:
            me = self.machines[sender].me
            ok, reason = target.on_join(Candidate(f["expiry"], me.node_id, me.public_key, me.addr), f["round"],
                                        f["key"], self.now)
        else:
            ok, reason = target.on_begin(sender, f["round"], f["group"], list(f["members"]), self.now), ""
        self.process(req.to.node_id)
        if answered is None:
            self.at(sent + deadline, self._failed, sender, req.token)
        else:
            self.at(max(self.now, sent + answered) + self.rtt / 2, self._reply, sender, req.to.node_id, req.token,
                    ok, reason)

    def _reply(self, sender: bytes, by: bytes, token: int, ok: bool, reason: str) -> None:
        if sender in self.up:
            self.machines[sender].on_reply(token, by, ok, reason, self.now)
            self.process(sender)

    def _failed(self, sender: bytes, token: int) -> None:
        if sender in self.up:
            self.machines[sender].on_failed(token, self.now)
            self.process(sender)

    # -- what the tests read ---------------------------------------------------------------------------------
    def complete(self) -> bool:
        """Every member averaged round 1 in the kept group, all of it."""
        return len(self.averaged) == len(self.members) and all(
            a.kept and a.group.members == self.members for _, a in self.averaged.values())

    def dropped(self) -> dict[bytes, dict[str, int]]:
        return {n: mc.sticky.dropped for n, mc in self.machines.items() if mc.sticky.dropped}


@pytest.mark.parametrize(("late", "late_s"), [("follower", 2 * WINDOW), ("leader", 4 * WINDOW)])
def test_a_live_member_late_past_the_window_is_waited_for_and_the_kept_group_averages_complete(late: str,
                                                                                                late_s: float) -> None:
    """A follower 2 s late (twice the window: its evaluation ran long) is PINGed, answers, and is waited for; a
    leader 4 s late (past the followers' window plus slack) likewise. Before, the leader gave up at 1 s (the
    follower's case: it then averaged alone) and the followers at 3.5 s (the leader's case)."""
    s = Swarm()
    slow = s.id_of(late)
    for c in s.members:
        s.start(c.node_id, T0 + (late_s if c.node_id == slow else 0.0))
    s.run(T0 + 10.0)
    assert s.complete() and not s.matchmaking and not s.dropped()
    t, _ = s.averaged[s.leader]
    assert T0 + late_s <= t < T0 + late_s + 0.01  # the BEGIN went as soon as the late one was there
    if late == "follower":
        assert 1 <= s.pinged[slow] <= late_s / REPROBE_S + 1  # found alive, then re-probed every REPROBE_S
    else:
        assert s.pinged[slow] >= len(s.members) - 1  # each follower re-probed its leader while it waited
    assert sum(s.pinged.values()) <= 3 * (late_s / REPROBE_S + 2)


@pytest.mark.parametrize("rtt", [None, 0.05])
def test_a_dead_follower_is_left_out_after_its_probes_well_inside_the_window(rtt: float | None) -> None:
    """A follower died right after round 0: the leader PINGs it once it is a grace late, three probes go
    unanswered, and the leader renews the group without it at once (the others had asked), not at its window's
    end and not through the DHT; the followers take the shorter list."""
    s = Swarm(rtt=rtt or 0.002, rtt_known=rtt is not None)
    dead = s.members[2].node_id
    s.up.discard(dead)
    for c in s.members:
        s.start(c.node_id, T0)
    s.run(T0 + 0.99 * WINDOW)
    assert not s.matchmaking and set(s.averaged) == {c.node_id for c in s.members if c.node_id != dead}
    began = s.averaged[s.leader][0] - T0
    assert began == pytest.approx(grace_s(rtt) + PROBES * probe_timeout_s(rtt), abs=1e-6)
    if rtt is None:
        assert GRACE_FLOOR_S + PROBES * PROBE_FLOOR_S == pytest.approx(0.35) == pytest.approx(began, abs=1e-6)
    assert began < 0.8 * WINDOW
    for n, (_, avg) in s.averaged.items():
        assert avg.kept and dead not in {c.node_id for c in avg.group.members} and len(avg.group.members) == 3
        assert s.dropped().get(n, {}) == {} and s.machines[n].sticky.statistics().shrunk == 1
        assert dead in s.machines[n].gone or n != s.leader


def test_a_dead_follower_of_a_pair_breaks_the_kept_group() -> None:
    """Of a kept pair, the leader alone would remain: it re-forms through the DHT instead."""
    s = Swarm(n=2)
    dead = next(c.node_id for c in s.members if c.node_id != s.leader)
    s.up.discard(dead)
    for c in s.members:
        s.start(c.node_id, T0)
    s.run(T0 + 0.99 * WINDOW)
    assert s.leader in s.matchmaking and not s.averaged and s.dropped()[s.leader] == {"dead": 1}


def test_followers_whose_leader_died_give_up_after_their_probes() -> None:
    """The leader died right after round 0: each follower's ask goes unanswered, so its PINGs do too; it gives
    up after three (0.35 s), not when its renewal request's retries run out or its window plus slack (3.5 s)."""
    s = Swarm()
    s.up.discard(s.leader)
    for c in s.members:
        s.start(c.node_id, T0)
    s.run(T0 + 1.0)
    followers = [c.node_id for c in s.members[1:]]
    assert [s.matchmaking[f] - T0 for f in followers] == pytest.approx([0.35] * 3, abs=1e-6)
    assert all(s.dropped()[f] == {"dead": 1} for f in followers)


def test_a_live_member_late_past_the_cap_is_waited_for_within_half_the_budget() -> None:
    """A follower 5 s late (its evaluation on a loaded machine: past the window's 3 s cap) is waited for while its
    daemon answers, up to half the round's budget, and the kept group averages complete."""
    s = Swarm()
    slow = s.id_of("follower")
    for c in s.members:
        s.start(c.node_id, T0 + (5.0 if c.node_id == slow else 0.0), 30.0)
    s.run(T0 + 20.0)
    assert s.complete() and not s.matchmaking and not s.dropped()
    assert T0 + 5.0 <= s.averaged[s.leader][0] < T0 + 5.01


@pytest.mark.parametrize("timeout_s", [30.0, 4.0])
@pytest.mark.parametrize("role", ["follower", "leader"])
@pytest.mark.parametrize("overstayed", [False, True])
def test_a_member_that_answers_probes_but_never_comes_holds_the_group_only_once_hostile(
        role: str, timeout_s: float, overstayed: bool) -> None:
    """A member whose daemon answers every PING (and a leader every ask) but never asks for the renewal, or never
    sends its BEGIN: the others wait for it up to half the round's budget, then re-form without it and remember it;
    a member that so held a group in the last OVERSTAY_ROUNDS rounds is waited for no longer than the window's cap
    (a follower: plus its slack), or half the budget if that is shorter."""
    s = Swarm()
    hostile = s.id_of(role)
    waiting = [s.leader] if role == "follower" else [c.node_id for c in s.members if c.node_id != hostile]
    if overstayed:
        for n in waiting:
            s.machines[n]._overstays.note(frozenset([hostile]), s.machines[n].round - OVERSTAY_ROUNDS + 1)
    for c in s.members:
        if c.node_id != hostile:
            s.start(c.node_id, T0, timeout_s)
    s.run(T0 + 20.0)
    cap = CAP + (FOLLOW_SLACK_S if role == "leader" else 0.0)
    bound = min(cap, timeout_s / 2) if overstayed else timeout_s / 2
    assert [s.matchmaking[n] - T0 for n in waiting] == pytest.approx([bound] * len(waiting), abs=1e-6)
    assert all(s.dropped()[n] == {"not_ready" if role == "follower" else "no_begin": 1} for n in waiting)
    assert not s.averaged
    assert s.pinged[hostile] <= len(waiting) * (bound / REPROBE_S + 1)  # one probe at a time, every REPROBE_S
    if not overstayed and bound > WINDOW + FOLLOW_SLACK_S:  # waited for past the window in vain: remembered
        assert all(hostile in s.machines[n]._overstays for n in waiting)


@pytest.mark.parametrize("refreshed", [False, True])
def test_the_matchmaking_after_a_dead_member_does_not_wait_for_it(refreshed: bool) -> None:
    """The follower the probes found dead finished round 0 (its progress record says so), yet the matchmaking that
    follows (here the kept group's next round re-forms through the DHT for a newcomer) does not expect it: its
    record predates its death, and the group closes once the live ones are in
    (before: the doubt_s wait for it, 0.6 s, and the rounds after waited out their window for it while its record
    was recent). A record it stores after it was found dead (it came back) makes it expected again: the window."""
    s = Swarm()
    mc = s.machines[s.leader]
    mc.doubt_s = 0.6
    live, dead = s.members[1:3], s.members[3]
    mc.start_round(now=T0)
    for c in live:
        assert mc.on_join(c, 1, RENEW_KEY, T0 + 0.01) == (True, "ok")
    mc.take_actions()
    now = mc.get_timer()
    mc.handle_timer(now)
    while mc.phase == "renew":
        (ping,) = [a for a in mc.take_actions() if isinstance(a, Request)]
        assert ping.to.node_id == dead.node_id and ping.mtype is m.MsgType.PING
        now += ping.timeout
        mc.on_failed(ping.token, now)
    assert now - T0 == pytest.approx(0.35, abs=1e-6) and mc.phase == "average" and len(mc.group.members) == 3
    assert set(mc.gone) == {dead.node_id}  # (the renewal went on without it)
    mc.on_averaged(averaged=True, members=[c.node_id for c in mc.group.members], now=now + 0.1)
    mc.sticky.break_("outsider")  # the next round matchmakes through the DHT
    now += 0.2
    mc.start_round(now=now)
    started = now
    shown = [SimRecord(c.node_id, encode_announce(e, *c.addr), e, c.public_key)
             for c, e in ((mc.me, started + WINDOW), *((c, started + WINDOW + 0.1) for c in live))]
    stored = {c.node_id: T0 - 1 for c in s.members}
    if refreshed:
        stored[dead.node_id] = started + 0.005
    progress = [SimRecord(c.node_id, msgpack.packb(0), stored[c.node_id] + PROGRESS_TTL_S, c.public_key)
                for c in s.members]

    def answer(acts: list, at: float) -> None:
        for g in [a for a in acts if isinstance(a, Get)]:
            mc.on_records(g.token, progress if g.key.endswith(b"progress") else shown, at)

    answer(mc.take_actions(), now + 0.01)
    for c in live:
        follower = Candidate(started + WINDOW + 0.1, c.node_id, c.public_key, c.addr)
        assert mc.on_join(follower, mc.round, mc.key, now + 0.02) == (True, "ok")
    while mc.phase == "match":
        now = mc.get_timer()
        mc.handle_timer(now)
        answer(mc.take_actions(), now)
    assert mc.phase == "average" and len(mc.group.members) == 3
    if refreshed:
        assert now - started == pytest.approx(WINDOW, abs=1e-6)  # expected again: waited for to the window
    else:
        assert now - started == pytest.approx(0.02 + SETTLE_S, abs=0.02)  # the live ones in, a settle: closed


def test_a_probe_answered_by_another_node_id_does_not_prove_the_member_alive_hostile() -> None:
    """Answers are sealed, so the shell reports who answered; an answer from anyone but the member (someone else
    at its address, or a peer answering for it) counts as no answer: three of them and it is dead."""
    s = Swarm()
    mc = s.machines[s.leader]
    impostor = peer(9).node_id
    mc.start_round(now=T0)
    mc.take_actions()
    now = mc.get_timer()
    assert now == T0 + GRACE_FLOOR_S
    mc.handle_timer(now)
    for _ in range(PROBES):  # each wrong answer: the next probe goes at once
        assert mc.phase == "renew"
        pings = [a for a in mc.take_actions() if isinstance(a, Request) and a.mtype is m.MsgType.PING]
        assert len(pings) == len(s.members) - 1 and all(p.attempts == 1 and p.timeout == PROBE_FLOOR_S for p in pings)
        now += 0.001
        for p in pings:
            mc.on_reply(p.token, impostor, True, "", now)
    assert mc.phase == "match" and mc.sticky.dropped == {"dead": 1}


def test_at_five_percent_loss_a_live_late_member_is_never_taken_for_dead() -> None:
    """Lost datagrams cost resends inside a probe (the endpoint resends at the RTO), never a verdict: a follower
    2 s late at 5 % loss each way is averaged in, seed after seed."""
    complete = 0
    for seed in range(40):
        s = Swarm(loss=0.05, seed=seed)
        slow = s.id_of("follower")
        for c in s.members:
            s.start(c.node_id, T0 + (2 * WINDOW if c.node_id == slow else 0.0))
        s.run(T0 + 10.0)
        assert all("dead" not in d for d in s.dropped().values()), (seed, s.dropped())
        complete += s.complete()
    assert complete == 40


def test_grace_and_probe_timeouts_follow_the_members_round_trip() -> None:
    assert grace_s(None) == GRACE_FLOOR_S and probe_timeout_s(None) == PROBE_FLOOR_S
    assert grace_s(0.001) == GRACE_FLOOR_S and probe_timeout_s(0.001) == PROBE_FLOOR_S
    assert grace_s(0.1) == pytest.approx(0.3) and probe_timeout_s(0.1) == pytest.approx(0.4)
    assert probe_timeout_s(5.0) == 1.0  # bounded: an inflated estimate does not stretch the verdict
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        assert grace_s(bad) == GRACE_FLOOR_S and probe_timeout_s(bad) == PROBE_FLOOR_S
    assert FOLLOW_SLACK_S + WINDOW < 4 * WINDOW < FOLLOW_SLACK_S + CAP  # (the late leader's case above)


def _average_round_1(s: Swarm, dead: bytes | None, *, silent: bool = False) -> float:
    """Round 1, renewed by all; ``dead`` dies during its average, which each survivor reports (``silent``: the
    survivors heard nothing from it, alive as far as they know, instead). Returns when the average ended."""
    for c in s.members:
        s.start(c.node_id, T0)
    s.run(T0 + 0.5)
    assert s.complete() and not s.matchmaking
    ended = T0 + 1.0
    if dead is not None:
        s.up.discard(dead)
    for c in s.members:
        if c.node_id != dead:
            s.machines[c.node_id].on_averaged(averaged=True, silent=silent, now=ended,
                                              members=[m.node_id for m in s.members],
                                              dead=frozenset() if dead is None or silent else frozenset([dead]))
    s.averaged.clear()
    return ended


@pytest.mark.parametrize("silent", [False, True])
def test_a_member_found_dead_mid_average_leaves_the_kept_group_and_the_others_go_on_at_once(silent: bool) -> None:
    """A follower whose daemon died during round 1's average (the survivors gave up on it after its PINGs): the
    others keep the group without it, and round 2 is a renewal of the three, with no matchmaking through the DHT;
    each survivor remembers it as gone. A member silent but not found dead (it may be stalled) breaks the group
    instead, and stays expected: the group re-forms through the DHT."""
    s = Swarm()
    dead = s.members[2].node_id
    ended = _average_round_1(s, dead, silent=silent)
    survivors = [c.node_id for c in s.members if c.node_id != dead]
    for n in survivors:
        mc = s.machines[n]
        assert mc.sticky.broken == ("silent" if silent else "")
        assert (dead in mc.gone) is not silent and mc.gone.get(dead, ended) == ended
        s.start(n, ended + 0.01)
    s.run(ended + 0.5)
    if silent:
        assert not s.averaged and set(s.matchmaking) == set(survivors)
        return
    assert set(s.averaged) == set(survivors) and not s.matchmaking
    for n in survivors:
        _, avg = s.averaged[n]
        assert avg.kept and [c.node_id for c in avg.group.members] == survivors
        assert s.machines[n].sticky.statistics().shrunk == 1


def test_a_follower_that_did_not_see_the_death_takes_the_shorter_list_and_no_other() -> None:
    """Only the leader found the member dead: its renewal BEGIN lists the formation without it, which a follower
    takes; a list with a stranger, another order, or without the follower or the leader is refused."""
    s = Swarm()
    leader = s.leader
    f = next(c.node_id for c in s.members if c.node_id != leader)
    mc = s.machines[f]
    mc.sticky.after_matchmaking(Group(7, s.members, [c.node_id for c in s.members].index(f), leader), 0, 4,
                                frozenset(c.node_id for c in s.members))
    gone = next(c for c in s.members if c.node_id not in (leader, f))
    short = [c for c in s.members if c is not gone]
    assert not mc.sticky.offer_begin(leader, 1, 1, 9, [*short, peer(9)])
    assert not mc.sticky.offer_begin(leader, 1, 1, 9, short[::-1])
    assert not mc.sticky.offer_begin(leader, 1, 1, 9, [c for c in short if c.node_id != f])
    assert not mc.sticky.offer_begin(leader, 1, 1, 9, [c for c in short if c.node_id != leader])
    assert not mc.sticky.offer_begin(f, 1, 1, 9, short)  # (not from the leader)
    assert mc.sticky.offer_begin(leader, 1, 1, 9, short)
    group = mc.sticky.take_begin(1)
    assert group is not None and group.members == tuple(short) and group.members[group.index].node_id == f
    assert mc.sticky.kept is not None and mc.sticky.kept.members == tuple(short)


def test_a_record_stored_before_the_group_formed_is_not_an_outsider() -> None:
    """A group the survivors formed through the DHT after a member died, led by one that never PINGed it (it had
    no entry in ``gone``): the dead member's last record, stored before that matchmaking began, was accounted for
    when the group formed (it was not expected, or the group would not have been kept), so the leader's watch does
    not re-form the group for it at every round for OUTSIDER_S; a peer that stores a record after the group formed
    is training outside it, and does."""
    s = Swarm(n=3)
    mc = s.machines[s.leader]
    ids = frozenset(c.node_id for c in s.members)
    formed_at = T0 - 1.0
    mc.sticky.after_matchmaking(Group(7, s.members, 0, s.leader), 0, 3, ids, formed_at)
    other = peer(7)
    for stored, breaks in ((formed_at - 0.5, False), (formed_at + 0.5, True)):
        record = SimRecord(other.node_id, msgpack.packb(0), stored + PROGRESS_TTL_S, other.public_key)
        mc.start_round(now=T0)
        for a in mc.take_actions():
            if isinstance(a, Get):
                mc.on_records(a.token, [record] if a.key.endswith(b"progress") else [], T0 + 0.01)
        broke = mc.sticky.broken == "outsider" or mc.sticky.dropped.get("outsider", 0) == 1
        assert broke is breaks, (stored, mc.sticky.broken, mc.sticky.dropped)
        mc.abandon()


@pytest.mark.parametrize("in_group", [True, False])
def test_a_member_of_the_first_group_that_finishes_later_is_waited_for_in_the_second_round(in_group: bool) -> None:
    """Round 0's group was not kept (nobody was expected yet). The member that finishes round 0 last (a capped
    member: the others have its share before it has theirs) has no progress record when the others' round-1
    matchmaking reads the run's progress; it is expected and doubtful, so the leader waits for it (``doubt_s``, the
    window until deadlines are tuned) instead of closing the group without it as the live ones come in."""
    members = sorted((peer(i) for i in range(4)), key=lambda c: c.node_id)
    me = members[0]
    rng = random.Random(0)
    mc = RoundMachine("run", LINE, KeyManager(LINE, me.node_id, rng=rng), me, rng=rng, window_s=WINDOW,
                      keep_rounds=4)
    mc.round, mc.synced, mc.doubt_s = 1, True, WINDOW
    if in_group:  # (else this node's round 0 was alone: the slow member is nobody it knows, and is not expected)
        mc._last_round = 0
        mc.note_members([c.node_id for c in members[1:]], 0)
    live, slow = members[1:3], members[3]
    mc.start_round(now=T0)
    shown = [SimRecord(c.node_id, encode_announce(T0 + WINDOW + 0.1, *c.addr), T0 + WINDOW + 0.1, c.public_key)
             for c in (me, *live)]
    progress = [SimRecord(c.node_id, msgpack.packb(0), T0 - 0.1 + PROGRESS_TTL_S, c.public_key) for c in (me, *live)]

    def answer(acts: list, at: float) -> None:
        for g in [a for a in acts if isinstance(a, Get)]:
            mc.on_records(g.token, progress if g.key.endswith(b"progress") else shown, at)

    answer(mc.take_actions(), T0 + 0.01)
    for c in live:
        assert mc.on_join(Candidate(T0 + WINDOW + 0.1, c.node_id, c.public_key, c.addr), 1, mc.key, T0 + 0.02)[0]
    now = T0 + 0.02
    while mc.phase == "match" and now < T0 + 0.6:
        now = min(mc.get_timer(), T0 + 0.6)
        mc.handle_timer(now)
        answer(mc.take_actions(), now)
    if not in_group:
        assert mc.phase == "average" and len(mc.group.members) == 3  # closed without it
        return
    assert mc.phase == "match"
    assert mc.on_join(Candidate(T0 + 0.6 + WINDOW, slow.node_id, slow.public_key, slow.addr), 1, mc.key, now)[0]
    while mc.phase == "match":
        now = mc.get_timer()
        mc.handle_timer(now)
        answer(mc.take_actions(), now)
    assert mc.phase == "average" and {c.node_id for c in mc.group.members} == {c.node_id for c in members}


@pytest.mark.parametrize("answers", [True, False])
def test_a_doubtful_member_is_pinged_waited_for_while_it_lives_dropped_once_dead(answers: bool) -> None:
    """A member of the last group with no record of finishing it is PINGed once it is a few round trips late: a
    daemon that answers is slow, not gone, and is waited for past ``doubt_s`` (up to the window); one silent to
    its probes is dropped as soon as they fail (well inside ``doubt_s``) and remembered as gone."""
    members = sorted((peer(i) for i in range(4)), key=lambda c: c.node_id)
    me, live, slow = members[0], members[1:3], members[3]
    rng = random.Random(0)
    mc = RoundMachine("run", LINE, KeyManager(LINE, me.node_id, rng=rng), me, rng=rng, window_s=WINDOW,
                      keep_rounds=4)
    mc.round, mc.synced, mc.doubt_s = 1, True, 0.6
    mc._last_round = 0
    mc._last_group = {c.node_id: c for c in members[1:]}
    mc.note_members([c.node_id for c in members[1:]], 0)
    mc.start_round(now=T0)
    shown = [SimRecord(c.node_id, encode_announce(T0 + WINDOW + 0.1, *c.addr), T0 + WINDOW + 0.1, c.public_key)
             for c in (me, *live)]
    progress = [SimRecord(c.node_id, msgpack.packb(0), T0 - 0.1 + PROGRESS_TTL_S, c.public_key) for c in (me, *live)]
    pinged = 0

    def drive(now: float, until: float) -> float:
        nonlocal pinged
        for _ in range(1000):  # (a timer that never moves on fails the test, not hangs it)
            if mc.phase != "match":
                break
            acts = mc.take_actions()
            for g in [a for a in acts if isinstance(a, Get)]:
                mc.on_records(g.token, progress if g.key.endswith(b"progress") else shown, now)
            pings = [a for a in acts if isinstance(a, Request) and a.mtype is m.MsgType.PING]
            for p in pings:
                assert p.to.node_id == slow.node_id
                pinged += 1
                if answers:
                    mc.on_reply(p.token, slow.node_id, True, "", now + 0.002)
                else:
                    now += p.timeout
                    mc.on_failed(p.token, now)
            if pings:
                continue
            t = mc.get_timer()
            if t is None or t > until:
                return now
            now = t
            mc.handle_timer(now)
        else:
            raise AssertionError("the round machine's timer does not move on")
        return now

    now = drive(T0 + 0.01, T0 + 0.01)
    for c in live:
        assert mc.on_join(Candidate(T0 + WINDOW + 0.1, c.node_id, c.public_key, c.addr), 1, mc.key, T0 + 0.02)[0]
    now = drive(T0 + 0.02, T0 + 0.8)
    if not answers:
        assert pinged == PROBES and mc.phase == "average" and len(mc.group.members) == 3
        assert now - T0 < 0.6 and slow.node_id in mc.gone
        return
    assert pinged == 1 and mc.phase == "match"  # past doubt_s: it lives
    assert mc.on_join(Candidate(T0 + 0.8 + WINDOW, slow.node_id, slow.public_key, slow.addr), 1, mc.key, T0 + 0.8)[0]
    drive(T0 + 0.8, T0 + 2 * WINDOW)
    assert mc.phase == "average" and len(mc.group.members) == 4 and not mc.gone
