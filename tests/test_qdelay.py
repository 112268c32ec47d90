"""Queueing delay from one-way delay samples (transport/qdelay.py): the base is the least sample of the window,
a clock step starts a path over, modelled samples never lower the base, and paths are bounded."""

from __future__ import annotations

import math

import pytest

from peerd.transport.qdelay import BASE_BUCKET_S, BASE_BUCKETS, MAX_QUEUE_S, QueueDelay


def test_queueing_delay_is_above_the_least_sample_whatever_the_clock_offset() -> None:
    q = QueueDelay()
    offset = -1234.5  # the receiver's clock against this sender's: unknown, constant
    assert q.sample("a", offset + 0.010, 100.0) == pytest.approx(0.0)
    assert q.sample("a", offset + 0.018, 100.1) == pytest.approx(0.008)
    assert q.sample("a", offset + 0.009, 100.2) == pytest.approx(0.0)  # a new least
    assert q.sample("a", offset + 0.012, 100.3) == pytest.approx(0.003)
    assert q.base("a") == pytest.approx(offset + 0.009)
    assert q.sample("b", 5.0, 100.3) == 0.0  # every path has its own base


def test_the_base_forgets_after_the_window() -> None:
    """A route that got longer: after BASE_BUCKETS seconds its new delay is the base, not a standing queue."""
    q = QueueDelay()
    q.sample("a", 0.010, 0.0)
    t = 0.5
    while t < BASE_BUCKETS * BASE_BUCKET_S + 1:
        got = q.sample("a", 0.030, t)
        t += 0.25
    assert got == pytest.approx(0.0)
    assert q.base("a") == pytest.approx(0.030)


def test_a_clock_step_starts_the_path_over() -> None:
    q = QueueDelay()
    q.sample("a", 0.010, 0.0)
    assert q.sample("a", 0.010 + MAX_QUEUE_S + 5.0, 0.1) == 0.0  # no 5 s queue: the receiver's clock stepped
    assert q.sample("a", 0.010 + MAX_QUEUE_S + 5.004, 0.2) == pytest.approx(0.004)


def test_modelled_samples_are_measured_but_never_set_the_base() -> None:
    """A datagram deep in a burst is placed at a guess of the link's rate: placed too late it would read below the
    base, and every later sample would look queued."""
    q = QueueDelay()
    assert q.sample("a", 0.010, 0.0, base=False) is None  # no base yet
    q.sample("a", 0.010, 0.0)
    assert q.sample("a", 0.004, 0.1, base=False) == pytest.approx(-0.006)
    assert q.base("a") == pytest.approx(0.010)
    assert q.sample("a", 0.012, 0.2) == pytest.approx(0.002)


def test_not_numbers_and_many_paths() -> None:
    q = QueueDelay(max_paths=4)
    assert q.sample("a", math.nan, 0.0) is None and q.sample("a", 0.0, math.inf) is None
    for i in range(10):
        q.sample(i, 0.01, 0.0)
    assert len(q._paths) == 4 and q.base(0) is None and q.base(9) == pytest.approx(0.01)


def test_rebase_raises_the_base_by_an_offset_and_a_lower_sample_still_lowers_it() -> None:
    """A level every sample stood at whatever was sent is an offset in the base: raised by it, those samples
    read unqueued; a later sample lower than the raised base is the path's and lowers it again."""
    q = QueueDelay()
    q.sample("a", 0.010, 0.0)  # the one sample that read low
    assert q.sample("a", 0.0195, 0.5) == pytest.approx(0.0095)
    q.rebase("a", 0.0095, 0.6)
    assert q.base("a") == pytest.approx(0.0195)
    assert q.sample("a", 0.0205, 0.7) == pytest.approx(0.001)
    assert q.sample("a", 0.015, 0.8) == pytest.approx(0.0) and q.base("a") == pytest.approx(0.015)
    for bad in (math.nan, -1.0, 0.0):
        q.rebase("a", bad, 0.9)
    q.rebase("unknown", 0.01, 0.9)
    assert q.base("a") == pytest.approx(0.015) and q.base("unknown") is None
