"""Self-tuning deadlines on real shaped links (root: a LinkLab of network namespaces and tc tbf): `peerd bench
deadlines` in short, self-tuned only (the comparison with today's constants is the bench's second run:
docs/benchmarks.md). 4 daemons average continuously on 100 Mbit/s links; one member's link is cut to a fifth, then
the member is killed. While it is slow every round still has it; the round the kill caught ends a few phase
silences (a few round trips) after its last datagram; the survivors regather in a window their kept group's
renewals tuned, under today's 3 s."""

from __future__ import annotations

import os

import pytest

from peerd.deadlines import DEFAULT_WINDOW_S
from peerd.tools.bench.deadlines import DeadlinesBenchConfig, run_deadlines_bench

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the link lab needs root (network namespaces, tc, nft)")


def test_a_slow_member_is_waited_for_and_a_dead_one_dropped_within_a_few_round_trips() -> None:
    cfg = DeadlinesBenchConfig(before_s=4.0, slow_s=6.0, after_s=7.0, modes=("auto",))
    r = run_deadlines_bench(cfg, say=lambda *a: None)["auto"]
    assert r["steps_while_slow"] >= 3 and r["failed_while_slow"] == 0, r
    # the round trips on the lab are the queue's (milliseconds): the silence is its floor, half of today's 1 s
    assert r["silence_s"] is not None and r["silence_s"] < 1.0, r
    # the round the kill caught waits out one silence per phase (two), not a fixed timeout. Measured 1.2-1.3 s over
    # a slow round (some 2.5 silences: the slow round itself varies on a loaded machine); today's constants: 4.2 s.
    assert r["in_flight_extra_s"] is not None and r["in_flight_extra_s"] <= 5 * r["silence_s"], r
    # the survivors regather in the tuned window (1 s, measured), not today's 3 s, and average again. Measured: the
    # next average 4.8 s after the kill (today's constants: 7.8 s).
    assert r["window_s"] < DEFAULT_WINDOW_S and r["kill_to_round_s"] is not None, r
    assert r["next_matchmaking_s"] < DEFAULT_WINDOW_S, r
