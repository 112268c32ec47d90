"""The caps' core (sans-I/O, injected time): a token bucket every outgoing datagram passes, the download side's
accounting, and a budget pacer that spreads what is left of a period's bytes over what is left of the period.

The bucket counts bytes as the link does: each datagram's payload plus its IP/UDP/Ethernet headers
(``WIRE_OVERHEAD``), so a cap of 20 Mbit/s is 20 Mbit/s on the operator's meter. A send reserves its bytes and is told
how long to wait (generic cell rate algorithm: at most ``BURST_S`` of the rate ahead of time). The averaging pacer's
own ceiling sits ``PACER_SHARE`` under the cap, so its judgement runs below it and DHT, state sync and relayed
traffic fit in the rest; the bucket is what guarantees the cap for all of them together.

A budget (``--budget 200GB/month``) counts both directions, as a metered plan bills. Every ``TICK_S`` the pacer
recomputes an allowance, remaining bytes / remaining seconds of the period, and gives each direction half of it as a
limit under its flag; it reports when the budget would run out at the rate of the last ``RECENT_S`` seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .advert import WIRE_OVERHEAD, CapAdvert
from .rates import Budget

BURST_S = 0.02  # how far ahead of the rate a send may go (and a datagram or two at the least)
TICK_S = 1.0  # rates measured and the budget's allowance recomputed this often
RECENT_S = 60.0  # the rate a budget's run-out time is projected at: the average over this long
PACER_SHARE = 0.97  # of the upload cap: the averaging pacer's ceiling
BUDGET_SHARE = 0.5  # of a budget's allowance: each direction's


@dataclass(frozen=True)
class CapConfig:
    """``max_upload``/``max_download``: bytes/s on the wire (None: uncapped)."""

    max_upload: float | None = None
    max_download: float | None = None
    budget: Budget | None = None

    @property
    def active(self) -> bool:
        return self.max_upload is not None or self.max_download is not None or self.budget is not None


@dataclass(frozen=True)
class BudgetStatistics:
    budget_bytes: float
    period_s: float
    used_bytes: float  # this period, both directions
    remaining_bytes: float
    period_left_s: float
    allowance: float  # bytes/s: what is left spread over what is left of the period
    recent_rate: float  # bytes/s, both directions, over the last RECENT_S
    runs_out_in_s: float | None  # at recent_rate; None: not before the period ends
    on_track: bool


@dataclass(frozen=True)
class CapStatistics:
    max_upload: float | None  # bytes/s as configured
    max_download: float | None
    upload_limit: float | None  # bytes/s in force (the budget's share applied)
    download_limit: float | None
    upload_rate: float  # bytes/s on the wire over the last tick
    download_rate: float
    upload_peak: float  # the largest tick's rate so far
    uploaded: int  # bytes on the wire since start
    downloaded: int
    held_s: float  # how long sends waited for the bucket, in all
    held_sends: int
    budget: BudgetStatistics | None


class BudgetPacer:
    """A period's bytes, spread over the period (module docstring)."""

    def __init__(self, budget: Budget, now: float) -> None:
        self.budget = budget
        self.start = now
        self.base = 0  # the cumulative byte count when the period began
        self.used = 0
        self._recent: deque[tuple[float, int]] = deque([(now, 0)])

    def note(self, total: int, now: float) -> None:
        """``total``: bytes both ways since the node started."""
        if now >= self.start + self.budget.period_s:  # a new period: its bytes start from what was used so far
            self.start += self.budget.period_s * math.floor((now - self.start) / self.budget.period_s)
            self.base = total
        self.used = total - self.base
        self._recent.append((now, total))
        while len(self._recent) > 2 and self._recent[1][0] <= now - RECENT_S:
            self._recent.popleft()

    def allowance(self, now: float) -> float:
        left_s = max(TICK_S, self.start + self.budget.period_s - now)
        return max(0.0, self.budget.nbytes - self.used) / left_s

    def statistics(self, now: float) -> BudgetStatistics:
        (t0, b0), (t1, b1) = self._recent[0], self._recent[-1]
        recent = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        remaining = max(0.0, self.budget.nbytes - self.used)
        left_s = max(0.0, self.start + self.budget.period_s - now)
        runs_out = remaining / recent if recent > 0 else math.inf
        return BudgetStatistics(self.budget.nbytes, self.budget.period_s, float(self.used), remaining, left_s,
                                self.allowance(now), recent, None if runs_out >= left_s else runs_out,
                                runs_out >= left_s)


class LinkCap:
    """Upload bucket, download accounting, budget (module docstring). Inputs: ``send`` (before each send),
    ``receive_total`` (the socket's received byte and datagram counts); ``handle_timer`` every ``TICK_S``."""

    def __init__(self, config: CapConfig, now: float, *, datagram: int = 1200) -> None:
        self.config = config
        self.datagram = datagram
        self.budget = BudgetPacer(config.budget, now) if config.budget is not None else None
        self.upload_limit = config.max_upload
        self.download_limit = config.max_download
        self._next = -math.inf  # when the bucket is empty again
        self._tick_at = now + TICK_S
        self._tick_from = now
        self.uploaded = 0
        self.downloaded = 0
        self._up_at_tick = 0
        self._down_at_tick = 0
        self.upload_rate = 0.0
        self.download_rate = 0.0
        self.upload_peak = 0.0
        self.held_s = 0.0
        self.held_sends = 0
        self._recompute(now)

    # -- inputs ----------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """The clock the node runs on starts (the core may be made before it): ticks and the budget's period from
        ``now``."""
        self._tick_at, self._tick_from = now + TICK_S, now
        if self.budget is not None:
            self.budget = BudgetPacer(self.budget.budget, now)
        self._recompute(now)

    def send(self, nbytes: int, datagrams: int, now: float) -> float:
        """Account for sending ``datagrams`` datagrams of ``nbytes`` payload bytes in all; returns how long to wait
        before sending them (0: at once)."""
        cost = nbytes + WIRE_OVERHEAD * datagrams
        self.uploaded += cost
        rate = self.upload_limit
        if rate is None:
            return 0.0
        ahead = max(BURST_S, 2 * (self.datagram + WIRE_OVERHEAD) / rate)
        start = max(self._next, now - ahead)
        self._next = start + cost / rate
        wait = max(0.0, start - now)
        if wait > 0:
            self.held_s += wait
            self.held_sends += 1
        return wait

    def receive_total(self, nbytes: int, datagrams: int, now: float) -> None:
        """The socket's counts of what arrived since the node started (payload bytes, datagrams)."""
        self.downloaded = max(self.downloaded, nbytes + WIRE_OVERHEAD * datagrams)

    # -- timer -------------------------------------------------------------------------------------
    def get_timer(self) -> float | None:
        return self._tick_at

    def handle_timer(self, now: float) -> None:
        if now < self._tick_at:
            return
        dt = max(1e-6, now - self._tick_from)
        self.upload_rate = (self.uploaded - self._up_at_tick) / dt
        self.download_rate = (self.downloaded - self._down_at_tick) / dt
        self.upload_peak = max(self.upload_peak, self.upload_rate)
        self._up_at_tick, self._down_at_tick, self._tick_from = self.uploaded, self.downloaded, now
        self._tick_at = now + TICK_S
        self._recompute(now)

    def _recompute(self, now: float) -> None:
        if self.budget is None:
            return
        self.budget.note(self.uploaded + self.downloaded, now)
        share = BUDGET_SHARE * self.budget.allowance(now)
        floor = 2 * (self.datagram + WIRE_OVERHEAD)  # (a spent budget still lets a datagram or two a second out)
        self.upload_limit = max(floor, min(self.config.max_upload or math.inf, share))
        self.download_limit = max(floor, min(self.config.max_download or math.inf, share))

    # -- outputs -----------------------------------------------------------------------------------
    def pacer_ceiling(self) -> float | None:
        """The averaging pacer's highest rate, payload bytes/s (None: no upload limit)."""
        if self.upload_limit is None:
            return None
        return PACER_SHARE * self.upload_limit * self.datagram / (self.datagram + WIRE_OVERHEAD)

    def advert(self) -> CapAdvert | None:
        """What this node's matchmaking records say of its caps (None: uncapped)."""
        up = int(self.upload_limit or 0)
        down = int(self.download_limit or 0)
        return CapAdvert(up, down) if up or down else None

    def statistics(self) -> CapStatistics:
        """As of the last tick."""
        now = self._tick_from
        return CapStatistics(
            self.config.max_upload, self.config.max_download, self.upload_limit, self.download_limit,
            self.upload_rate, self.download_rate, self.upload_peak, self.uploaded, self.downloaded,
            round(self.held_s, 6), self.held_sends, None if self.budget is None else self.budget.statistics(now))
