"""The deadline tuner (peerd/deadlines.py) in virtual time: each deadline is max(floor, k * measured) under the cap
its caller gives, today's value while nothing is measured; a slow but live member stretches the deadlines, a dead
one does not; hostile or broken measurements never become a deadline."""

from __future__ import annotations

import dataclasses
import math

import pytest

from peerd.deadlines import (
    DEFAULT_STEP_WAIT_S,
    DEFAULT_SYNC_TIMEOUT_S,
    DEFAULT_WINDOW_S,
    MAX_AGE_S,
    MAX_PEERS,
    MIN_SAMPLES,
    PHASE_FLOOR_S,
    PHASE_K,
    SILENCE_K,
    STEP_FLOOR_S,
    WINDOW_FLOOR_S,
    WINDOW_K,
    DeadlineStatistics,
    DeadlineTuner,
)

ME, A, B, C = "00" * 32, "aa" * 32, "bb" * 32, "cc" * 32
GROUP = (ME, A, B, C)
MB = 1_000_000


def _round(t: DeadlineTuner, now: float, *, gather_s: float | None = 0.4, window_s: float = DEFAULT_WINDOW_S,
           at_end: bool = False, members: tuple[str, ...] = GROUP, nbytes: int = 4 * MB, transfer_s: float = 0.5,
           clean: bool = True) -> None:
    t.receive_round(gather_s=gather_s, window_s=window_s, at_window_end=at_end, members=members, nbytes=nbytes,
                    transfer_s=transfer_s, clean=clean, now=now)


def test_with_nothing_measured_every_deadline_is_todays_value() -> None:
    st = DeadlineTuner().statistics()
    assert isinstance(st, DeadlineStatistics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.window = st.phase  # type: ignore[misc]
    assert (st.window.seconds, st.phase_silence.seconds, st.step_wait.seconds, st.state_sync.seconds) == (
        DEFAULT_WINDOW_S, 1.0, DEFAULT_STEP_WAIT_S, DEFAULT_SYNC_TIMEOUT_S)
    assert all(getattr(st, f.name).basis == "default" and getattr(st, f.name).measured is None
               for f in dataclasses.fields(st))
    t = DeadlineTuner()
    assert t.window(7.0).seconds == 7.0 and t.step_wait(12.0).seconds == 12.0 and t.phase(MB, 9.0).seconds == 9.0


def test_the_window_is_k_times_how_long_groups_took_to_gather_between_floor_and_cap() -> None:
    t = DeadlineTuner()
    for i in range(10):
        _round(t, 100.0 + i, gather_s=0.2)
    w = t.window(DEFAULT_WINDOW_S)
    assert (w.seconds, w.basis, w.measured, w.samples) == (WINDOW_FLOOR_S, "floor", 0.2, 10)
    for i in range(10):
        _round(t, 200.0 + i, gather_s=1.2)
    w = t.window(DEFAULT_WINDOW_S)
    assert w.basis == "measured" and w.seconds == pytest.approx(WINDOW_K * 1.2)
    assert t.window(2.0).seconds == 2.0 and t.window(2.0).basis == "cap"  # the run's window stays the upper bound
    assert t.window(0.5).seconds == 0.5  # a cap under the floor wins too


def test_nothing_is_tuned_on_fewer_than_min_samples() -> None:
    t = DeadlineTuner()
    for i in range(MIN_SAMPLES - 1):
        _round(t, float(i), gather_s=0.2)
    w = t.window()
    assert (w.seconds, w.basis, w.samples, w.measured) == (DEFAULT_WINDOW_S, "default", MIN_SAMPLES - 1, 0.2)
    _round(t, 10.0, gather_s=0.2)
    assert t.window().seconds == WINDOW_FLOOR_S


def test_a_round_alone_at_the_windows_end_while_the_last_group_is_live_stretches_the_window() -> None:
    t = DeadlineTuner()
    for i in range(8):
        _round(t, 10.0 + i, gather_s=0.3)
    _round(t, 18.0, gather_s=WINDOW_FLOOR_S, window_s=WINDOW_FLOOR_S, at_end=True, members=(ME,), transfer_s=0.0)
    assert t.window().seconds == pytest.approx(WINDOW_K * WINDOW_FLOOR_S)
    for i in range(2):  # alone again: the group it compares with is still the last one it averaged in
        _round(t, 19.0 + i, gather_s=2.0, window_s=2.0, at_end=True, members=(ME,), transfer_s=0.0)
    assert t.window().seconds == DEFAULT_WINDOW_S


def test_a_kept_groups_round_says_nothing_about_gathering() -> None:
    t = DeadlineTuner()
    _round(t, 1.0, gather_s=None)
    assert t.window().samples == 0 and t.phase(4 * MB, 60.0).samples == 1


def test_a_slow_but_live_member_missing_at_the_windows_end_stretches_the_window() -> None:
    t = DeadlineTuner()
    for i in range(8):
        _round(t, 10.0 + i, gather_s=0.3)
    assert t.window().seconds == WINDOW_FLOOR_S
    # C became slow: the group closed at the end of the 1 s window without it, but C was heard a moment ago
    t.receive_heard(C, 17.5)
    _round(t, 18.0, gather_s=WINDOW_FLOOR_S, window_s=WINDOW_FLOOR_S, at_end=True, members=(ME, A, B))
    assert t.window().seconds == pytest.approx(WINDOW_K * WINDOW_FLOOR_S)  # waited for next time
    for i in range(2):  # and it made it in: its lateness holds the window open for it
        _round(t, 19.0 + i, gather_s=1.4, window_s=2.0, members=GROUP)
    assert t.window().seconds == pytest.approx(WINDOW_K * 1.4)


def test_a_dead_member_missing_at_the_windows_end_leaves_the_window_short() -> None:
    t = DeadlineTuner()
    for i in range(8):
        _round(t, 10.0 + i, gather_s=0.3)
    # C died at t=17 (last heard in the round that ended then); much later the group closes at the window's end
    for i in range(5):
        _round(t, 40.0 + i, gather_s=WINDOW_FLOOR_S, window_s=WINDOW_FLOOR_S, at_end=True, members=(ME, A, B))
    assert t.window().seconds == WINDOW_FLOOR_S  # never waited for again
    assert t.window().samples == 8


def test_the_phase_is_k_times_an_average_at_the_slowest_recent_rate() -> None:
    t = DeadlineTuner()
    for i in range(10):
        _round(t, float(i), nbytes=4 * MB, transfer_s=1.0)  # 4 MB/s
    d = t.phase(4 * MB, 60.0)
    assert d.basis == "measured" and d.measured == pytest.approx(1.0) and d.seconds == pytest.approx(PHASE_K * 1.0)
    assert t.phase(MB, 60.0).seconds == PHASE_FLOOR_S and t.phase(MB, 60.0).basis == "floor"
    # one member's link becomes 5x slower: the group's average takes 5 s and stretches the phase at once
    _round(t, 11.0, nbytes=4 * MB, transfer_s=5.0)
    assert t.phase(4 * MB, 60.0).seconds == pytest.approx(PHASE_K * 5.0)
    assert t.phase(4 * MB, 20.0).seconds == 20.0  # the round's budget stays the cap


def test_a_round_that_waited_for_a_silent_member_is_not_a_rate() -> None:
    t = DeadlineTuner()
    for i in range(10):
        _round(t, float(i), transfer_s=0.5)
    _round(t, 11.0, transfer_s=20.0, clean=False)  # a dead member held the phase to its deadline
    assert t.phase(4 * MB, 60.0).seconds == pytest.approx(PHASE_K * 0.5)
    assert t.phase(4 * MB, 60.0).samples == 10


def test_the_silence_that_ends_a_phase_is_a_few_round_trips() -> None:
    t = DeadlineTuner()
    for i, peer in enumerate((A, B, C)):
        t.receive_rtt(peer, 0.05 + 0.05 * i, 0.1, 1.0)
    d = t.phase_silence(1.0)
    assert d.samples == 3 and d.measured == pytest.approx(0.15) and d.seconds == pytest.approx(SILENCE_K * 0.15)
    t.receive_rtt(B, 0.001, 0.0, 2.0)  # a peer's newer p99 replaces its older one
    t.receive_rtt(C, 0.001, 0.0, 2.0)
    t.receive_rtt(A, 0.001, 0.0, 2.0)
    assert t.phase_silence(1.0).seconds == 0.5 and t.phase_silence(1.0).basis == "floor"
    t.receive_rtt(A, 2.0, 0.0, 3.0)
    assert t.phase_silence(1.0).seconds == 1.0  # today's 1 s is the cap


def test_the_step_wait_covers_recent_rounds_and_a_steps_compute() -> None:
    t = DeadlineTuner()
    for i in range(10):
        t.receive_step(round_s=0.8, compute_s=0.3, now=float(i))
    d = t.step_wait(30.0)
    assert d.seconds == STEP_FLOOR_S and d.basis == "floor" and d.samples == 10
    for i in range(10):
        t.receive_step(round_s=4.0, compute_s=0.3, now=20.0 + i)
    assert t.step_wait(30.0).seconds == pytest.approx(12.0)
    assert t.step_wait(10.0).seconds == 10.0  # the trainer's timeout_s stays the upper bound
    t2 = DeadlineTuner()
    for i in range(MIN_SAMPLES):
        t2.receive_step(round_s=1.0, compute_s=20.0, now=float(i))  # a step's compute is longer still
    assert t2.step_wait(60.0).seconds == pytest.approx(20.0)
    t2.receive_step(round_s=None, compute_s=None, now=9.0)  # a failed step, a session's first: nothing measured
    assert t2.step_wait(60.0).samples == MIN_SAMPLES


def test_the_state_sync_timeout_is_the_largest_snapshot_at_the_slowest_rate() -> None:
    t = DeadlineTuner()
    t.receive_transfer(100 * MB, 5.0, 1.0)  # 20 MB/s
    d = t.state_sync(60.0)
    assert d.measured == pytest.approx(5.0) and d.seconds == pytest.approx(20.0) and d.basis == "measured"
    t.receive_transfer(10 * MB, 5.0, 2.0)  # 2 MB/s: 100 MB would take 50 s
    assert t.state_sync(60.0).seconds == 60.0 and t.state_sync(60.0).basis == "cap"


def test_samples_age_out_and_the_deadlines_return_to_todays() -> None:
    t = DeadlineTuner()
    assert t.get_timer() is None
    _round(t, 100.0, gather_s=0.2)
    t.receive_rtt(A, 0.01, 0.0, 150.0)
    t.receive_step(round_s=1.0, compute_s=1.0, now=120.0)
    assert t.get_timer() == 100.0 + MAX_AGE_S
    t.handle_timer(100.0 + MAX_AGE_S - 1)
    assert t.window().samples == 1
    t.handle_timer(100.0 + MAX_AGE_S + 1)
    assert t.window().basis == "default" and t.get_timer() == 120.0 + MAX_AGE_S
    t.handle_timer(200.0 + MAX_AGE_S)
    st = t.statistics()
    assert all(getattr(st, f.name).basis == "default" for f in dataclasses.fields(st)) and t.get_timer() is None


def test_statistics_report_each_deadline_against_the_cap_it_was_last_asked_with() -> None:
    t = DeadlineTuner()
    for i in range(MIN_SAMPLES):
        _round(t, float(i), gather_s=1.0)
    t.window(2.5)
    t.step_wait(15.0)
    st = t.statistics()
    assert st.window.cap_s == 2.5 and st.window.seconds == 2.0 and st.step_wait.cap_s == 15.0
    assert st.phase.measured == pytest.approx(0.5)  # for this node's last vector
    assert t.statistics() == st  # reading them changes nothing


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
def test_non_finite_or_negative_measurements_are_ignored_hostile(bad: float) -> None:
    t = DeadlineTuner()
    _round(t, 1.0, gather_s=bad)
    _round(t, 1.0, transfer_s=bad)
    _round(t, 1.0, window_s=bad)
    t.receive_rtt(A, bad, bad, 1.0)
    t.receive_step(round_s=bad, compute_s=bad, now=1.0)
    t.receive_transfer(MB, bad, 1.0)
    t.receive_transfer(-MB, 1.0, 1.0)
    st = t.statistics()
    for f in dataclasses.fields(st):
        d = getattr(st, f.name)
        assert d.basis == "default" and math.isfinite(d.seconds), (f.name, d)


def test_a_flood_of_peers_is_bounded_hostile() -> None:
    t = DeadlineTuner()
    for i in range(10 * MAX_PEERS):
        t.receive_rtt(f"{i:064x}", 0.5, 0.0, float(i))
        t.receive_heard(f"{i:064x}", float(i))
    assert t.phase_silence(1.0).samples == MAX_PEERS
    assert len(t._heard) == MAX_PEERS  # noqa: SLF001 - the bound is the point
    huge = tuple(f"{i:064x}" for i in range(10 * MAX_PEERS))
    _round(t, 1e5, members=huge)
    assert len(t._heard) == MAX_PEERS and len(t._last_group) == MAX_PEERS  # noqa: SLF001


def test_fixed_mode_measures_but_answers_every_question_with_its_cap() -> None:
    auto, fixed = DeadlineTuner(), DeadlineTuner("fixed")
    for t in (auto, fixed):
        for i in range(10):
            _round(t, 100.0 + i, gather_s=0.2)
            t.receive_rtt(A, 0.01, 0.0, 100.0 + i)
            t.receive_step(round_s=0.5, compute_s=0.1, now=100.0 + i)
    assert auto.window().seconds == WINDOW_FLOOR_S and auto.step_wait().seconds == STEP_FLOOR_S
    assert fixed.mode == "fixed" and auto.mode == "auto"
    w, s, p, st = fixed.window(), fixed.phase_silence(), fixed.phase(4 * MB, 9.0), fixed.step_wait()
    assert (w.seconds, s.seconds, p.seconds, st.seconds) == (DEFAULT_WINDOW_S, 1.0, 9.0, DEFAULT_STEP_WAIT_S)
    assert {w.basis, s.basis, p.basis, st.basis} == {"fixed"}
    assert (w.measured, w.samples) == (0.2, 10)  # (what it would have tuned from, still shown)
    with pytest.raises(ValueError):
        DeadlineTuner("adaptive")  # type: ignore[arg-type]


def test_bucket_and_outer_waits_follow_their_own_rounds() -> None:
    t = DeadlineTuner()
    for i in range(10):
        t.receive_bucket(2.0, float(i))
        t.receive_outer(8.0, float(i))
        t.receive_step(round_s=0.5, compute_s=None, now=float(i))
    b, o, s = t.bucket_wait(30.0), t.outer_wait(60.0), t.step_wait(30.0)
    assert (b.seconds, b.basis, b.measured) == (6.0, "measured", 2.0)
    assert (o.seconds, o.basis, o.measured) == (24.0, "measured", 8.0)
    assert s.seconds == STEP_FLOOR_S  # (a step's own rounds, not its buckets')
    assert t.outer_wait(12.0).seconds == 12.0  # the trainer's timeout_s stays the cap
    t.receive_bucket(math.nan, 11.0)
    t.receive_outer(-1.0, 11.0)
    assert t.bucket_wait(30.0).samples == 10 and t.outer_wait(60.0).samples == 10
