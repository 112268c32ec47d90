"""A byte budget by the calendar (sans-I/O, injected time): what a node used of this UTC day's, week's or month's
bytes, what it may still use, when it would run out, and the small record that carries the count across restarts.

Periods are the provider's: a ``/day`` budget starts again at 00:00 UTC, a ``/week`` one on Monday 00:00 UTC, a
``/month`` one on the first of the month 00:00 UTC. The pacer runs on the node's monotonic clock; the wall clock is
an input (``receive_wall``), given once when the node starts, so that the period's bounds are known in monotonic time
and a clock step later cannot move them. The count is saved (``SavedBudget``, at most ``MAX_SAVED_BYTES``) and read
back at the next start: a record of the same period carries its bytes over, any other is ignored.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from .rates import PERIODS, Budget

TICK_S = 1.0  # the allowance's floor of time left (a period's last second still spreads over a second)
RECENT_S = 60.0  # the rate a budget's run-out time is projected at: the average over this long
MAX_SAVED_BYTES = 4096  # a budget state file larger than this is not read (it is not one peerd wrote)
MAX_USED = 10**18  # bytes: a saved count above this is not believed
SAVED_VERSION = 1


def period_bounds(period: str, wall: float) -> tuple[float, float]:
    """The UTC calendar period (``day``, ``week``: ISO, from Monday, or ``month``) holding unix time ``wall``, as
    unix times (start, end)."""
    if period not in PERIODS:
        raise ValueError(f"period must be one of {sorted(PERIODS)}, got {period!r}")
    t = datetime.fromtimestamp(wall, tz=UTC)
    day = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        start, end = day, day + timedelta(days=1)
    elif period == "week":
        start = day - timedelta(days=day.weekday())
        end = start + timedelta(days=7)
    else:
        start = day.replace(day=1)
        end = (start + timedelta(days=32)).replace(day=1)
    return start.timestamp(), end.timestamp()


@dataclass(frozen=True)
class SavedBudget:
    """What a budget's state file holds: which period (its kind and UTC start) and the bytes used in it."""

    period: str
    period_start: float  # unix time
    used_bytes: int

    def encode(self) -> bytes:
        return json.dumps({"peerd_budget": SAVED_VERSION, "period": self.period, "period_start": self.period_start,
                           "used_bytes": self.used_bytes}).encode()

    @classmethod
    def decode(cls, data: bytes) -> SavedBudget:
        """Raises ValueError for anything but a record peerd writes (the file may be truncated or another's)."""
        if len(data) > MAX_SAVED_BYTES:
            raise ValueError(f"{len(data)} bytes, more than a budget record's {MAX_SAVED_BYTES}")
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(d, dict) or d.get("peerd_budget") != SAVED_VERSION:
            raise ValueError("not a peerd budget record of this version")
        period, start, used = d.get("period"), d.get("period_start"), d.get("used_bytes")
        if period not in PERIODS:
            raise ValueError(f"unknown period {period!r}")
        if type(start) not in (int, float) or not math.isfinite(start) or not 0 <= start < 2**40:
            raise ValueError("period_start must be a unix time")
        if type(used) is not int or not 0 <= used <= MAX_USED:
            raise ValueError("used_bytes must be a count of bytes")
        return cls(period, float(start), used)


@dataclass(frozen=True)
class BudgetStatistics:
    budget_bytes: float
    period: str  # day, week or month (UTC calendar)
    period_s: float  # this period's length
    period_start: float  # unix time
    used_bytes: float  # this period, both directions, restarts included
    remaining_bytes: float
    period_left_s: float
    allowance: float  # bytes/s: what is left spread over what is left of the period
    recent_rate: float  # bytes/s, both directions, over the last RECENT_S
    runs_out_in_s: float | None  # at recent_rate; None: not before the period ends
    runs_out_at: float | None  # the same as a unix time
    on_track: bool


class BudgetPacer:
    """A calendar period's bytes, spread over what is left of it (module docstring). Inputs: ``receive_wall`` (the
    wall clock, and the count saved by an earlier run), ``receive_total`` (bytes both ways since the node started,
    every tick)."""

    def __init__(self, budget: Budget, now: float) -> None:
        self.budget = budget
        self.offset = 0.0  # wall clock - monotonic clock (receive_wall)
        self.start, self.end = period_bounds(budget.period, now)
        self.base = 0  # the node's byte count when this period (or this run of it) began
        self.carried = 0  # bytes of this period used by earlier runs (a saved count)
        self.used = 0
        self.total = 0
        self.rolled = False  # a new period began at the last receive_total
        self._recent: deque[tuple[float, int]] = deque([(now, 0)])

    def receive_wall(self, wall: float, saved: SavedBudget | None, now: float) -> bool:
        """The wall clock reads ``wall`` at ``now``; ``saved``: what the state file held (None: nothing). Returns
        whether the saved count was carried over (it was of this period)."""
        self.offset = wall - now
        self.start, self.end = period_bounds(self.budget.period, wall)
        self.carried = 0
        if saved is not None and saved.period == self.budget.period and saved.period_start == self.start:
            self.carried = saved.used_bytes
        self.used = self.carried + self.total - self.base
        return self.carried > 0

    def receive_total(self, total: int, now: float) -> None:
        """``total``: bytes both ways since the node started."""
        self.total = total
        wall = now + self.offset
        self.rolled = wall >= self.end
        if self.rolled:  # a new period: its bytes start from what was used so far
            self.start, self.end = period_bounds(self.budget.period, wall)
            self.base, self.carried = total, 0
        self.used = self.carried + total - self.base
        self._recent.append((now, total))
        while len(self._recent) > 2 and self._recent[1][0] <= now - RECENT_S:
            self._recent.popleft()

    def allowance(self, now: float) -> float:
        left_s = max(TICK_S, self.end - (now + self.offset))
        return max(0.0, self.budget.nbytes - self.used) / left_s

    def saved(self) -> SavedBudget:
        """This period's count, as the state file keeps it."""
        return SavedBudget(self.budget.period, self.start, int(self.used))

    def statistics(self, now: float) -> BudgetStatistics:
        (t0, b0), (t1, b1) = self._recent[0], self._recent[-1]
        recent = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        remaining = max(0.0, self.budget.nbytes - self.used)
        wall = now + self.offset
        left_s = max(0.0, self.end - wall)
        runs_out = remaining / recent if recent > 0 else math.inf
        on_track = runs_out >= left_s
        return BudgetStatistics(self.budget.nbytes, self.budget.period, self.end - self.start, self.start,
                                float(self.used), remaining, left_s, self.allowance(now), recent,
                                None if on_track else runs_out, None if on_track else wall + runs_out, on_track)
