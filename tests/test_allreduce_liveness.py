"""A running average's silent member, in virtual time (allreduce/liveness.py, and the host that acts on it): the
watch alone with the test playing the PINGs, then several nodes' AveragingHosts over the in-memory network of
test_allreduce_host, whose harness also answers the host's ProbeMember PINGs as the network would.

A member that crashed mid-average is found dead after three unanswered PINGs and the phases stop waiting for it at
once (before: a phase silence each, or more); one whose daemon answers and has sent nothing yet is waited for a few
floors (a late start), and an answer from another node id is no answer."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from peerd.allreduce.actions import ProbeMember
from peerd.allreduce.group import LATE_START_FLOORS
from peerd.allreduce.liveness import (
    GRACE_FLOOR_S,
    MAX_PROBES,
    PHASE_REPROBE_S,
    PROBE_FLOOR_S,
    PROBE_MAX_S,
    PROBES,
    Alive,
    Dead,
    Probe,
    SilenceWatch,
    grace_s,
    probe_timeout_s,
    probes_needed,
)
from peerd.allreduce.options import AverageOptions
from peerd.tools.sim.net import Link

from .support.groups import AG_DATA, RS_DATA, inputs
from .support.host_lab import PER, HostNode, Lab

PEERS = [bytes([i + 1]) * 32 for i in range(4)]
OTHER = b"\xee" * 32


def watch(rtts: list[float | None] | None = None) -> SilenceWatch:
    return SilenceWatch(PEERS, 0, rtts)


def timer(w: SilenceWatch, waiting: dict[int, float]) -> float | None:
    w.note_waiting(waiting)
    return w.get_timer()


def tick(w: SilenceWatch, waiting: dict[int, float], now: float,
         counts: dict[int, tuple[int, int]] | None = None) -> tuple[list[Probe], list[int]]:
    """The watch's look at ``now``: (the probes it sends, the members it found dead)."""
    w.note_waiting(waiting, counts)
    w.handle_timer(now)
    actions = w.take_actions()
    return [a for a in actions if isinstance(a, Probe)], [a.member for a in actions if isinstance(a, Dead)]


# ---- the watch alone ----------------------------------------------------------------------------------------------


def test_grace_and_probe_timeout_follow_the_round_trip_within_their_bounds() -> None:
    assert grace_s(None) == GRACE_FLOOR_S and probe_timeout_s(None) == PROBE_FLOOR_S
    assert grace_s(0.001) == GRACE_FLOOR_S and probe_timeout_s(0.001) == PROBE_FLOOR_S
    assert grace_s(0.1) == pytest.approx(0.3) and probe_timeout_s(0.1) == pytest.approx(0.4)
    assert probe_timeout_s(5.0) == PROBE_MAX_S
    assert grace_s(math.nan) == GRACE_FLOOR_S and probe_timeout_s(-1.0) == PROBE_FLOOR_S


def test_a_member_silent_for_its_grace_is_probed_and_three_failures_make_it_dead() -> None:
    """Heard at 1.0 and then nothing: probed at 1.0 + grace; each unanswered PING is followed by the next at once;
    the third makes the verdict, given once."""
    w = watch()
    waiting = {1: 1.0}
    assert timer(w, waiting) == pytest.approx(1.0 + GRACE_FLOOR_S)
    assert tick(w, waiting, 1.0 + GRACE_FLOOR_S / 2) == ([], [])  # not silent long enough yet
    now = 1.0 + GRACE_FLOOR_S
    for _ in range(PROBES):
        (p,), dead = tick(w, waiting, now)
        assert p.member == 1 and p.timeout == PROBE_FLOOR_S and dead == []
        assert timer(w, waiting) is None  # one in flight at a time: the answer (or its timeout) comes back
        now += p.timeout
        w.receive_answer(p.token, None, now)
        assert w.take_actions() == []  # (the verdict is the watch's next look, with what was heard meanwhile)
        assert timer(w, waiting) == now
    assert tick(w, waiting, now) == ([], [1])
    assert tick(w, waiting, now + 10) == ([], []) and timer(w, waiting) is None
    assert w.statistics().probes_sent == PROBES and w.statistics().dead == (1,)


def test_more_probes_must_go_unanswered_where_the_members_data_arrived_with_loss() -> None:
    """A probe and its answer take the member's path: on a clean one (or unknown) three failures decide; the more
    of its data was lost, the more failures, up to MAX_PROBES."""
    assert probes_needed(None) == probes_needed(1.0) == probes_needed(0.97) == PROBES
    assert probes_needed(0.9) == 5  # (0.81 of probes answered: 0.19**5 < 1e-3 <= 0.19**4)
    assert probes_needed(0.2) == probes_needed(0.0) == probes_needed(-1.0) == MAX_PROBES
    assert probes_needed(math.nan) == PROBES
    needs = [probes_needed(d / 20) for d in range(21)]
    assert needs == sorted(needs, reverse=True)


def test_a_member_whose_data_arrived_with_heavy_loss_is_not_found_dead_after_three_probes() -> None:
    """Member 1's stream lost 70 % on the way (a link it overruns: its queue drops PINGs as it drops data): three
    unanswered PINGs are no verdict; MAX_PROBES are."""
    w = watch()
    waiting, counts = {1: 0.0}, {1: (30, 100)}
    now = GRACE_FLOOR_S
    for _ in range(MAX_PROBES):
        (p,), dead = tick(w, waiting, now, counts)
        assert dead == []
        now += p.timeout
        w.receive_answer(p.token, None, now)
    assert tick(w, waiting, now, counts) == ([], [1])
    assert w.statistics().probes_sent == MAX_PROBES


def test_the_loss_that_counts_is_the_latest_of_the_stream() -> None:
    """A stream that lost half its first 400 datagrams and none of its last 100 (its sender found the path's rate):
    it stopped on a clean path, so three unanswered probes decide; a new phase's stream starts its own reading, the
    phase before's in force until it has MIN_RECENT datagrams."""
    w = watch()
    waiting = {1: 0.0}
    for top in range(2, 401, 2):
        w.note_waiting(waiting, {1: (top // 2, top)})
    assert probes_needed(w._members[1].delivered) > PROBES  # (lossy so far)
    for top in range(401, 501):
        w.note_waiting(waiting, {1: (200 + top - 400, top)})
    assert w._members[1].delivered == 1.0
    w.note_waiting(waiting, {1: (3, 6)})  # the all-gather: 6 datagrams in, half lost: too few to tell yet
    assert w._members[1].delivered == 1.0
    w.note_waiting(waiting, {1: (10, 20)})
    assert w._members[1].delivered == 0.5
    now = GRACE_FLOOR_S
    w2 = watch()
    for top in range(1, 101):
        w2.note_waiting(waiting, {1: (top, top)})
    for _ in range(PROBES):
        (p,), dead = tick(w2, waiting, now)
        now += p.timeout
        w2.receive_answer(p.token, None, now)
    assert tick(w2, waiting, now) == ([], [1])


def test_a_member_whose_daemon_answers_is_probed_again_later_and_never_found_dead() -> None:
    w = watch()
    waiting = {2: 0.0}
    now = GRACE_FLOOR_S
    for _ in range(10):
        (p,), _ = tick(w, waiting, now)
        w.receive_answer(p.token, PEERS[2], now + 0.01)
        assert w.take_actions() == [Alive(2, now + 0.01)]  # (the phase counts its silence from the answer)
        assert timer(w, waiting) == pytest.approx(now + 0.01 + PHASE_REPROBE_S)
        now += 0.01 + PHASE_REPROBE_S
    assert tick(w, waiting, now)[1] == [] and w.statistics().dead == ()


def test_another_nodes_pong_is_no_answer_hostile() -> None:
    """Someone else lives at the member's address (or answers in its stead): its PONGs count as silence."""
    w = watch()
    waiting = {3: 0.0}
    now = GRACE_FLOOR_S
    for _ in range(PROBES):
        (p,), _ = tick(w, waiting, now)
        w.receive_answer(p.token, OTHER, now + 0.002)
        now += 0.002
    assert tick(w, waiting, now) == ([], [3])


def test_a_member_that_speaks_between_probes_has_its_failures_forgotten() -> None:
    w = watch()
    waiting = {1: 0.0}
    now = GRACE_FLOOR_S
    for _ in range(PROBES - 1):
        (p,), _ = tick(w, waiting, now)
        now += p.timeout
        w.receive_answer(p.token, None, now)
    waiting[1] = now  # its data came
    assert tick(w, waiting, now) == ([], [])
    assert timer(w, waiting) == pytest.approx(now + GRACE_FLOOR_S)
    for _ in range(PROBES - 1):  # a new silence: as many failures again before a verdict
        now = timer(w, waiting)
        (p,), _ = tick(w, waiting, now)
        w.receive_answer(p.token, None, now + p.timeout)
    probes, dead = tick(w, waiting, now + 1.0)
    assert dead == [] and [p.member for p in probes] == [1]  # (the third probe of this silence)


def test_only_members_waited_for_are_probed_and_answers_to_unknown_tokens_change_nothing() -> None:
    w = watch(rtts=[None, 0.1, None, None])
    assert timer(w, {}) is None
    assert tick(w, {}, 100.0) == ([], [])
    w.receive_answer(12345, PEERS[1], 1.0)
    waiting = {1: 0.0}  # member 1's round trip is 100 ms: its grace 0.3 s, its PING's timeout 0.4 s
    assert timer(w, waiting) == pytest.approx(0.3)
    (p,), _ = tick(w, waiting, timer(w, waiting))
    assert p.timeout == pytest.approx(0.4)
    with pytest.raises(ValueError):
        SilenceWatch(PEERS, 0, [None])


# ---- the host acting on it, over the in-memory network -----------------------------------------------------------


class ProbeLab(Lab):
    """test_allreduce_host's Lab, also carrying out the hosts' ProbeMember PINGs: answered one round trip later by
    whatever ``answer(node)`` says lives at that node's address (default: the node itself while it is up), else
    reported unanswered at the PING's timeout."""

    def __init__(self, n: int, *, answer: Callable[[int], bytes | None] | None = None, rtt: float = 0.02,
                 **kw: Any) -> None:
        super().__init__(n, **kw)
        self.answer = answer or (lambda node: self.nodes[node].peer if self.net.alive(node) else None)
        self.rtt = rtt
        self.probes: Counter[tuple[int, int]] = Counter()  # (prober, probed) -> PINGs

    def apply(self, node: HostNode, actions: Any = None) -> None:
        rest = []
        for a in node.host.take_actions() if actions is None else actions:
            if isinstance(a, ProbeMember):
                dst = self.members[a.group_id][a.to]
                assert self.nodes[dst].peer == a.peer
                self.probes[(node.i, dst)] += 1
                who = self.answer(dst)
                self.at(self.now + (self.rtt if who is not None else a.timeout), self._probed, node.i, a, who,
                        owner=node.i)
            else:
                rest.append(a)
        super().apply(node, rest)

    def _probed(self, i: int, a: ProbeMember, who: bytes | None) -> None:
        self.nodes[i].host.receive_probe(a.group_id, a.token, who, self.now)
        self.apply(self.nodes[i])
        self._arm(i)


def crashed_run(probe: bool, **lab_kw: Any) -> tuple[ProbeLab, list[np.ndarray], list[float]]:
    """Node 3 dies 5 ms in, its reduce-scatter on the wire and its all-gather not sent yet (floor 1 s)."""
    xs, ws = inputs(4, 60 * PER, seed=5)
    lab = ProbeLab(4, link=Link(latency=0.01), **lab_kw)
    lab.start(0.0, 95, [0, 1, 2, 3], xs, ws, floor_s=1.0, probe_silent=probe)
    lab.at(0.005, lab.net.crash, 3)
    lab.run()
    return lab, xs, ws


def test_a_member_that_dies_mid_average_is_given_up_on_after_three_probes_not_a_deadline() -> None:
    """With probes the survivors' phases stop waiting for the dead member about grace + 3 PING timeouts after it
    fell silent, and finish by completion; without, they wait out the all-gather's deadline (its floor and the owner
    lag). Either way the results are what arrived, and its contributions that did arrive count."""
    lab, xs, ws = crashed_run(True)
    lab.check(95, xs, ws, skip=(3,))
    before, _, _ = crashed_run(False)
    for i in range(3):
        st, old = lab.nodes[i].done[95].stats, before.nodes[i].done[95].stats
        assert st.dead == (3,) and old.dead == ()
        assert st.all_gather.ended_by == "completion" and old.all_gather.ended_by == "deadline"
        # silent from ~0.02 s (its last data): probed at +0.05, found dead after three 0.1 s PINGs
        assert st.all_gather.ended_at < 0.02 + GRACE_FLOOR_S + PROBES * PROBE_FLOOR_S + 0.1
        assert old.all_gather.ended_at > 1.0
        assert lab.probes[(i, 3)] == PROBES
        assert not any(lab.probes[(i, j)] for j in range(3))  # the live members never fell silent
    assert any(s == 3 for s, _, t, _ in lab.delivered(95) if t == RS_DATA)  # (what it sent before dying counts)
    assert not any(s == 3 for s, _, t, _ in lab.delivered(95) if t == AG_DATA)


def test_a_member_behind_an_overrun_link_is_waited_for_not_found_dead() -> None:
    """Node 3's link drops 70 % both ways and for its first second its daemon's PINGs go unanswered (the full queue a
    member meets when its link slows under it): the others do not take it for dead, they wait for it, and what
    arrived of it counts. (Before: three unanswered PINGs made it dead, and it left the group.)"""
    xs, ws = inputs(4, 60 * PER, seed=5)
    lab = ProbeLab(4, link=Link(latency=0.01),
                   answer=lambda node: None if node == 3 and lab.now < 1.0 else lab.nodes[node].peer)
    lossy = Link(latency=0.01, loss=0.7)
    for i in range(3):
        lab.net.set_link(i, 3, lossy)
        lab.net.set_link(3, i, lossy)
    lab.start(0.0, 96, [0, 1, 2, 3], xs, ws, floor_s=0.5, probe_silent=True)
    lab.run()
    for i in range(4):
        st = lab.nodes[i].done[96].stats
        assert st.dead == (), (i, st.dead)
    for i in range(3):
        assert lab.probes[(i, 3)] >= PROBES  # (it was probed, and the probes went unanswered)
    assert any(s == 3 for s, _, t, _ in lab.delivered(96) if t == RS_DATA)


def test_a_member_that_answers_pings_but_sends_nothing_holds_a_phase_only_a_few_floors_hostile() -> None:
    """Node 2's daemon runs (it answers every PING) but it never starts the group: it is probed again and again and
    never given up on as dead; its answers hold each phase at most LATE_START_FLOORS floors past the phase's start
    (then the usual silence), whatever it answers, and the phase cap is not reached."""
    xs, ws = inputs(4, 24 * PER)
    ended = {}
    for probe in (True, False):
        lab = ProbeLab(4)
        lab.start({0: 0.0, 1: 0.0, 2: None, 3: 0.0}, 71, [0, 1, 2, 3], xs, ws, floor_s=0.3, max_phase_s=5.0,
                  probe_silent=probe)
        lab.run()
        for i in (0, 1, 3):
            st = lab.nodes[i].done[71].stats
            assert st.dead == () and 2 in st.reduce_scatter.silent and st.reduce_scatter.ended_by == "deadline"
            ended[(probe, i)] = st.reduce_scatter, st.all_gather
            assert (lab.probes[(i, 2)] >= 2) == probe  # probed while silent (answered: again after PHASE_REPROBE_S)
    for i in (0, 1, 3):
        (rs, ag), (rs0, ag0) = ended[(True, i)], ended[(False, i)]
        for ph, before in ((rs, rs0), (ag, ag0)):
            held, held0 = ph.ended_at - ph.started_at, before.ended_at - before.started_at
            extra = held0 - 0.3  # without probes: one silence (and the all-gather's owner lag)
            assert extra < 0.3 + 0.05
            assert held0 < held <= (LATE_START_FLOORS + 1) * 0.3 + extra + 1e-9


def test_a_live_member_late_to_start_is_waited_for_not_averaged_out() -> None:
    """Node 2 starts 0.6 s late (its paths still opening on a loaded CPU), past a 0.3 s silence after the others'
    data: without probes the others end their reduce-scatter without it; with probes its PONGs say it lives, they
    wait, and every contribution counts (the results are the exact average)."""
    xs, ws = inputs(4, 24 * PER, seed=3)
    for probe in (True, False):
        lab = ProbeLab(4)
        lab.start({0: 0.0, 1: 0.0, 2: 0.6, 3: 0.0}, 72, [0, 1, 2, 3], xs, ws, floor_s=0.3, max_phase_s=5.0,
                  probe_silent=probe)
        lab.run()
        late = {r for s, r, t, _ in lab.delivered(72) if s == 2 and t == RS_DATA}
        for i in (0, 1, 3):
            st = lab.nodes[i].done[72].stats
            if probe:
                assert st.reduce_scatter.ended_by == "completion" and st.reduce_scatter.silent == ()
                assert st.complete and i in late
            else:
                assert st.reduce_scatter.ended_by == "deadline" and 2 in st.reduce_scatter.silent
        if probe:
            lab.check(72, xs, ws)
            exact = sum(w * x.astype(np.float64) for w, x in zip(ws, xs, strict=True)) / sum(ws)
            for i in range(4):
                np.testing.assert_allclose(lab.nodes[i].done[72].vector, exact, rtol=0, atol=1e-5)


def test_pongs_from_another_node_at_a_dead_members_address_do_not_keep_it_alive_hostile() -> None:
    """Node 3 crashed and another node now answers at its address: three PINGs answered by the wrong node id are
    three failures, and the survivors give up on node 3 as fast as on silence."""
    lab, xs, ws = crashed_run(True, answer=lambda node: OTHER if node == 3 else None)
    lab.check(95, xs, ws, skip=(3,))
    for i in range(3):
        st = lab.nodes[i].done[95].stats
        assert st.dead == (3,) and st.all_gather.ended_by == "completion"
        assert st.all_gather.ended_at < 0.02 + GRACE_FLOOR_S + PROBES * 0.02 + 0.1


def test_without_probe_silent_the_host_sends_no_probes() -> None:
    lab, _, _ = crashed_run(False)
    assert not lab.probes
    with pytest.raises(ValueError):
        AverageOptions(probe_silent=1)  # type: ignore[arg-type]
