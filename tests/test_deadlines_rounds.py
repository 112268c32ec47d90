"""What a Moshpit round tells the deadline tuner (peerd/moshpit/tuning.py), and `peerd bench deadlines`'s figures
from step records (peerd/tools/bench/deadlines.py), without a lab: a kept group's clean renewal is a gathering
sample (so the window a broken group regathers in is tuned), a kept round with a silent member is not; the bench
counts rounds that left the slow member out and times the move past a killed one."""

from __future__ import annotations

import numpy as np

from peerd.deadlines import MIN_SAMPLES, WINDOW_FLOOR_S, DeadlineTuner
from peerd.moshpit.runstate import RoundResult
from peerd.moshpit.tuning import note_round
from peerd.tools.bench.deadlines import SLOW, DeadlinesBenchConfig, summarize

MEMBERS = ["00" * 32, "aa" * 32, "bb" * 32, "cc" * 32]


def _kept(mm_s: float, **kw) -> RoundResult:
    return RoundResult(np.zeros(1000, np.float32), "averaged", "ab" * 8, 4, list(MEMBERS), 1.0, 1, 0.5,
                       matchmaking_s=mm_s, kept=True, transfer_s=0.4, **kw)


def test_a_kept_groups_clean_renewal_tunes_the_window() -> None:
    t = DeadlineTuner()
    for i in range(MIN_SAMPLES):
        note_round(t, _kept(0.05), 3.0, 100.0 + i, 100.5 + i)
    w = t.window(3.0)
    assert (w.samples, w.measured, w.seconds, w.basis) == (MIN_SAMPLES, 0.05, WINDOW_FLOOR_S, "floor"), w


def test_a_kept_round_with_a_silent_member_says_nothing_about_gathering() -> None:
    t = DeadlineTuner()
    for i in range(MIN_SAMPLES):
        note_round(t, _kept(2.5, silent=True, out=(3,)), 3.0, 100.0 + i, 103.0 + i)
    assert t.window(3.0).samples == 0 and t.window(3.0).seconds == 3.0


def _rec(t0: float, t1: float, size: int = 4, outcome: str = "averaged", mm: float = 0.0) -> dict:
    return {"t0": t0, "t1": t1, "outcome": outcome, "group_size": size, "received_fraction": 1.0,
            "phases": {"matchmaking": mm}}


def test_the_bench_counts_rounds_without_the_slow_member_and_times_the_move_past_a_dead_one() -> None:
    cfg = DeadlinesBenchConfig()
    slow, kill = 10.0, 20.0
    survivor = [_rec(8.0, 9.0), _rec(10.0, 12.0), _rec(12.0, 14.0, size=3), _rec(14.0, 16.0),
                _rec(16.0, 18.0, outcome="failed"), _rec(18.0, 19.9), _rec(19.9, 23.0), _rec(23.0, 26.0, 3, mm=1.5)]
    records = [survivor] * 4
    records[SLOW] = survivor[:3]
    r = summarize(records, cfg, "auto", slow, kill, silence_s=0.5, window_s=1.0)
    assert (r["steps_while_slow"], r["failed_while_slow"]) == (3 * 5, 3 * 2), r  # a smaller group, a failed one
    assert r["round_s"] == 1.0 and r["slow_round_s"] == 2.0, r
    assert r["in_flight_round_s"] == 3.1 and r["in_flight_extra_s"] == 1.1, r
    assert r["in_flight_extra_over_silence"] == 2.2 and r["kill_to_round_s"] == 6.0, r
    assert r["next_matchmaking_s"] == 1.5, r
    assert r["kill_to_start_s"] == 4.5, r  # the first round without it began to move data at 23.0 + 1.5
    assert r["kill_to_start_over_silence"] == 9.0, r
    assert r["death_cost_s"] == 2.6 and r["death_cost_over_silence"] == 5.2, r  # 1.1 over a slow round + 1.5
    assert summarize([[]] * 4, cfg, "fixed", slow, kill, None, None)["kill_to_round_s"] is None
