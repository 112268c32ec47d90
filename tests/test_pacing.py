"""Sender pacing: a token bucket, slowed by congestion, not by random loss."""

from __future__ import annotations

import pytest

from peerd.transport.pacing import BURST_S, Pacer


def test_token_bucket_spaces_sends_at_the_rate() -> None:
    p = Pacer(rate=1e6)
    now = 100.0
    waits = [p.reserve(10_000, now) for _ in range(100)]  # 1 MB at once, at 1 MB/s
    assert waits[0] == 0.0
    assert waits[-1] == pytest.approx(99 * 0.01 - BURST_S, abs=1e-9)
    assert all(b >= a for a, b in zip(waits, waits[1:], strict=False))
    # After idling, only a short burst is allowed ahead of the rate.
    assert p.reserve(10_000, now + 100) == 0.0
    assert p.reserve(10_000, now + 100) == pytest.approx(0.01 - BURST_S, abs=1e-9)


def test_random_loss_does_not_throttle_but_congestion_does() -> None:
    p = Pacer(rate=100e6, max_rate=1e9)
    for _ in range(12):  # a path with a steady 10 % random loss: rate grows to the cap
        p.on_report(1000, 900, 0.1, 0, 1200)
    assert p.rate == pytest.approx(1e9)
    assert p.decreases == 0
    p.on_report(1000, 500, 0.1, 0, 1200)  # well below the path's usual fraction: congestion
    assert p.rate == pytest.approx(500 * 1200 / 0.1 * 0.8)
    before = p.rate
    p.on_report(1000, 1000, 0.1, 25, 1200)  # kernel drops at the receiver: congestion
    assert p.rate < before
    for _ in range(200):
        p.on_report(1000, 0, 1.0, 10, 1200)
    assert p.rate == p.min_rate
