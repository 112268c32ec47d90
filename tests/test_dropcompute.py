"""DropCompute: the auto threshold from logged micro-batch times (deterministic timings), and the helper's
accounting of samples and dropped micro-batches under a fake clock."""

from __future__ import annotations

import math

import pytest

from peerd.torch.dropcompute import INF, DropCompute, choose_threshold, expected_max

from .support.dropcompute import FakeClock, run_step  # noqa: E402


def test_expected_max_is_the_empirical_order_statistic() -> None:
    assert expected_max([1.0, 2.0], 1) == pytest.approx(1.5)
    # max of 2 draws from {1, 2}: 2 unless both are 1 (prob 1/4)
    assert expected_max([1.0, 2.0], 2) == pytest.approx(1.75)
    assert expected_max([3.0] * 5, 8) == pytest.approx(3.0)
    assert expected_max([1, 2, 3, 4], 100) == pytest.approx(4.0, abs=1e-9)


def test_no_threshold_when_times_do_not_vary() -> None:
    """Dropping a fraction d of equal micro-batches saves exactly d of the time: no gain, so no threshold."""
    steps = [[0.01] * 8 for _ in range(30)]
    choice = choose_threshold(steps, workers=4)
    assert choice.tau == INF and choice.speedup == 0.0


def test_threshold_cuts_off_stragglers() -> None:
    """8 micro-batches of 10 ms; one step in five has a 200 ms straggler at the end; each step also spends
    100 ms communicating. With 16 workers nearly every synchronous step waits for a straggler, so stopping
    after the 7th micro-batch pays; stopping earlier drops more work than it saves time."""
    steps = []
    for k in range(40):
        times = [0.010] * 8
        if k % 5 == 0:
            times[-1] = 0.200
        steps.append(times)
    choice = choose_threshold(steps, workers=16, overhead_s=0.1)
    # stop once 7 micro-batches (70 ms) are done: start the 8th only before 70 ms
    assert choice.tau == pytest.approx(0.070)
    assert choice.drop_rate == pytest.approx(1 / 8)
    full = expected_max([sum(s) for s in steps], 16) + 0.1
    assert choice.time_saved == pytest.approx(1 - 0.170 / full)
    assert choice.speedup == pytest.approx((1 - 1 / 8) / (0.170 / full) - 1)
    assert choice.speedup > 0.5
    # with a single worker stragglers cost little: the same logs gain far less
    single = choose_threshold(steps, workers=1, overhead_s=0.1)
    assert single.speedup < choice.speedup / 3
    # without communication, pure compute throughput favours cutting right after the first micro-batch
    assert choose_threshold(steps, workers=16).tau == pytest.approx(0.010)


def test_overhead_that_a_threshold_cannot_shorten_makes_dropping_less_attractive() -> None:
    steps = [[0.010] * 7 + ([0.200] if k % 5 == 0 else [0.010]) for k in range(40)]
    fast = choose_threshold(steps, workers=16, overhead_s=0.1)
    slow_network = choose_threshold(steps, workers=16, overhead_s=1.0)
    assert slow_network.speedup < fast.speedup
    assert math.isinf(choose_threshold([], workers=4).tau)






def test_auto_logs_warmup_then_thresholds_and_counts_samples() -> None:
    clock = FakeClock()
    dc = DropCompute("auto", workers=16, estimate="steps", warmup_steps=10, probe_every=5, overhead_s=0.1,
                     clock=clock)
    pattern = lambda k: [0.010] * 7 + ([0.200] if k % 5 == 0 else [0.010])  # noqa: E731
    for k in range(10):  # warm-up: full steps, no threshold yet
        assert run_step(dc, clock, pattern(k)) == 64
    assert dc.tau == pytest.approx(0.070) and dc.dropped == 0
    assert run_step(dc, clock, pattern(0)) == 64  # step 10 is a probe: it runs in full, to be logged
    assert run_step(dc, clock, pattern(0)) == 56  # step 11 is not: the straggler is never started
    assert len(dc.log) == 11
    assert dc.dropped == 1
    # the first micro-batch always runs, however slow
    dc.start_step()
    assert dc.keep_going()


def test_fixed_budget_and_off() -> None:
    clock = FakeClock()
    dc = DropCompute(0.025, clock=clock)
    assert run_step(dc, clock, [0.01] * 8) == 24  # starts at 0, 10, 20 ms; not at 30 ms
    off = DropCompute(None, clock=clock)
    assert run_step(off, clock, [0.5] * 8) == 64
    with pytest.raises(ValueError):
        DropCompute(-1)
