"""Hypothesis settings shared by the property tests."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def repeatable(max_examples: int) -> settings:
    """A property test that tries the same ``max_examples`` examples every run (derandomized, no example database)
    and is never failed for being slow."""
    return settings(derandomize=True, database=None, deadline=None, max_examples=max_examples,
                    suppress_health_check=[HealthCheck.too_slow])
