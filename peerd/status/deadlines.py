"""The daemon's shell around the deadline tuner (peerd/deadlines.py): it hears the per-peer view's round-trip times
once a second, and its deadlines go to the metrics and to ``peerd status`` (text.py renders them)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..deadlines import DeadlineStatistics, DeadlineTuner
from ..metrics import Metrics

if TYPE_CHECKING:
    from ..peers import TableStatistics


def feed_deadlines(tuner: DeadlineTuner, view: TableStatistics, now: float) -> None:
    """Each tracked peer's p99 RTT and last-heard time into the tuner; age its samples out when due."""
    for p in view.peers:
        tuner.receive_rtt(p.peer, p.rtt_p99_s, p.last_heard_s, now)
    at = tuner.get_timer()
    if at is not None and now >= at:
        tuner.handle_timer(now)


def publish_deadlines(stats: DeadlineStatistics, metrics: Metrics) -> None:
    """One gauge per deadline (peerd_deadline_seconds) and one for the measurement behind it."""
    for name, d in _items(stats):
        metrics.deadline_seconds.labels(name).set(d.seconds)
        if d.measured is not None:
            metrics.deadline_measured.labels(name, d.measurement).set(d.measured)


def deadlines_json(stats: DeadlineStatistics) -> dict[str, Any]:
    """``peerd status --json``'s ``deadlines``: each deadline with its measurement, sample count and bounds."""
    return {name: dataclasses.asdict(d) for name, d in _items(stats)}


def _items(stats: DeadlineStatistics) -> list[tuple[str, Any]]:
    return [(f.name, getattr(stats, f.name)) for f in dataclasses.fields(stats)]
