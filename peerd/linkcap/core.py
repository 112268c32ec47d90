"""The caps' core (sans-I/O, injected time): a token bucket every outgoing datagram passes, the gates of the traffic
a node does for others (state snapshots it serves, what it relays) and of the state it downloads, the download side's
accounting, and a budget pacer that spreads what is left of a period's bytes over what is left of the period.

The bucket counts bytes as the link does: each datagram's payload plus its IP/UDP/Ethernet headers
(``WIRE_OVERHEAD``), so a cap of 20 Mbit/s is 20 Mbit/s on the operator's meter. A send reserves its bytes and is told
how long to wait (generic cell rate algorithm: at most ``BURST_S`` of the rate ahead of time). The averaging pacer's
own ceiling sits ``PACER_SHARE`` under the cap, so its judgement runs below it and DHT, state sync and relayed
traffic fit in the rest; the bucket is what guarantees the cap for all of them together.

Traffic for others has shares of the limits, so that it never crowds out the node's own averaging: answers to
state-sync requests pass ``admit_serving`` (at most ``SERVE_SHARE`` of the upload limit; an answer over it is not
sent, and the joiner's retransmission timer slows it down), relaying is held to ``RELAY_SHARE`` of the lower limit
(``relay_rate``: RELAYs arrive and leave, so both count). A download cap is kept the only way a receiver can, by
what it asks for: each state-sync request waits for ``fetch`` (the download limit less what else arrived in the last
tick); averaging senders are held to it by the caps a node publishes (advert.sender_rate).

A budget (``--budget 200GB/month``) counts both directions, as a metered plan bills, per UTC calendar period
(linkcap.budget). Every ``TICK_S`` the pacer recomputes an allowance, remaining bytes / remaining seconds of the
period, and gives each direction half of it as a limit under its flag; it reports when the budget would run out at
the rate of the last ``RECENT_S`` seconds, and asks for its count to be saved every ``SAVE_S`` (``take_actions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .advert import WIRE_OVERHEAD, CapAdvert
from .budget import RECENT_S, TICK_S, BudgetPacer, BudgetStatistics, SavedBudget
from .rates import Budget

__all__ = ["RECENT_S", "TICK_S", "BudgetPacer", "BudgetStatistics", "CapConfig", "CapStatistics", "LinkCap",
           "SaveBudget", "SavedBudget"]

BURST_S = 0.02  # how far ahead of the rate a send may go (and a datagram or two at the least)
PACER_SHARE = 0.97  # of the upload cap: the averaging pacer's ceiling
BUDGET_SHARE = 0.5  # of a budget's allowance: each direction's
SERVE_SHARE = 0.5  # of the upload limit: the most that state snapshots served to joiners take
SERVE_BURST_S = 0.05  # how much of SERVE_SHARE's rate may go at once
RELAY_SHARE = 0.5  # of the lower of the two limits: the most that relaying for others takes
FETCH_SHARE = 0.97  # of the download limit: the most a state-sync download asks for, less what else arrives
SAVE_S = 60.0  # a budget's count is saved this often (and when a period ends)


@dataclass(frozen=True)
class CapConfig:
    """``max_upload``/``max_download``: bytes/s on the wire (None: uncapped)."""

    max_upload: float | None = None
    max_download: float | None = None
    budget: Budget | None = None
    budget_state: str | None = None  # the file that keeps the budget's count across restarts (None: not kept)

    @property
    def active(self) -> bool:
        return self.max_upload is not None or self.max_download is not None or self.budget is not None


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
    serve_refused: int = 0  # state-sync answers not sent: over SERVE_SHARE of the upload limit
    fetch_held_s: float = 0.0  # how long state-sync requests waited for the download limit, in all


@dataclass(frozen=True)
class SaveBudget:
    """Write the budget's count to its state file (the shell does, atomically)."""

    saved: SavedBudget


class LinkCap:
    """Upload bucket, gates, download accounting, budget (module docstring). Inputs: ``send`` (before each send),
    ``admit_serving`` and ``fetch`` (before a state-sync answer or request), ``receive_total`` (the socket's
    received byte and datagram counts), ``receive_wall`` (the wall clock and the saved budget, once);
    ``handle_timer`` every ``TICK_S``; ``take_actions`` says when to save the budget."""

    def __init__(self, config: CapConfig, now: float, *, datagram: int = 1200) -> None:
        self.config = config
        self.datagram = datagram
        self.budget = BudgetPacer(config.budget, now) if config.budget is not None else None
        self.upload_limit = config.max_upload
        self.download_limit = config.max_download
        self._next = -math.inf  # when the bucket is empty again
        self._fetch_next = -math.inf  # the same for state-sync requests' answers
        self._serve_tokens = math.inf  # (a full burst to start with: min() in admit_serving)
        self._serve_at = now
        self._tick_at = now + TICK_S
        self._tick_from = now
        self._save_at = now + SAVE_S
        self._actions: list[SaveBudget] = []
        self.uploaded = 0
        self.downloaded = 0
        self.fetched = 0  # bytes state-sync requests asked for (on the wire)
        self._up_at_tick = 0
        self._down_at_tick = 0
        self._fetched_at_tick = 0
        self.upload_rate = 0.0
        self.download_rate = 0.0
        self.fetch_rate = 0.0
        self.upload_peak = 0.0
        self.held_s = 0.0
        self.held_sends = 0
        self.serve_refused = 0
        self.fetch_held_s = 0.0
        self._recompute(now)

    # -- inputs ----------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """The clock the node runs on starts (the core may be made before it): ticks and the budget's period from
        ``now``."""
        self._tick_at, self._tick_from, self._save_at = now + TICK_S, now, now + SAVE_S
        self._serve_at = now
        if self.budget is not None:
            self.budget = BudgetPacer(self.budget.budget, now)
        self._recompute(now)

    def receive_wall(self, wall: float, saved: SavedBudget | None, now: float) -> bool:
        """The wall clock reads ``wall`` (unix time) at ``now``, and the budget's state file held ``saved``: the
        budget's period follows the calendar, and a count of this period carries over. Returns whether it did."""
        if self.budget is None:
            return False
        carried = self.budget.receive_wall(wall, saved, now)
        self._recompute(now)
        return carried

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

    def admit_serving(self, nbytes: int, now: float) -> bool:
        """Whether an answer of ``nbytes`` payload bytes to another node's state-sync request may go now (within
        SERVE_SHARE of the upload limit); one that may not is not sent (counted in ``serve_refused``)."""
        if self.upload_limit is None:
            return True
        rate = SERVE_SHARE * self.upload_limit
        burst = max(SERVE_BURST_S * rate, 2.0 * (self.datagram + WIRE_OVERHEAD))
        self._serve_tokens = min(burst, self._serve_tokens + max(0.0, now - self._serve_at) * rate)
        self._serve_at = max(self._serve_at, now)
        cost = nbytes + WIRE_OVERHEAD
        if cost > self._serve_tokens:
            self.serve_refused += 1
            return False
        self._serve_tokens -= cost
        return True

    def fetch(self, nbytes: int, now: float) -> float:
        """A state-sync request is about to ask for ``nbytes`` payload bytes (one datagram's answer): how long to
        wait first, so that what arrives stays within the download limit with what else arrives (0: at once)."""
        cost = nbytes + WIRE_OVERHEAD
        self.fetched += cost
        rate = self.fetch_limit()
        if rate is None:
            return 0.0
        ahead = max(BURST_S, 2 * (self.datagram + WIRE_OVERHEAD) / rate)
        start = max(self._fetch_next, now - ahead)
        self._fetch_next = start + cost / rate
        wait = max(0.0, start - now)
        self.fetch_held_s += wait
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
        self.fetch_rate = (self.fetched - self._fetched_at_tick) / dt
        self.upload_peak = max(self.upload_peak, self.upload_rate)
        self._up_at_tick, self._down_at_tick, self._tick_from = self.uploaded, self.downloaded, now
        self._fetched_at_tick = self.fetched
        self._tick_at = now + TICK_S
        self._recompute(now)
        if self.budget is not None and (self.budget.rolled or now >= self._save_at):
            self._save_at = now + SAVE_S
            self._actions.append(SaveBudget(self.budget.saved()))

    def _recompute(self, now: float) -> None:
        if self.budget is None:
            return
        self.budget.receive_total(self.uploaded + self.downloaded, now)
        share = BUDGET_SHARE * self.budget.allowance(now)
        floor = 2 * (self.datagram + WIRE_OVERHEAD)  # (a spent budget still lets a datagram or two a second out)
        self.upload_limit = max(floor, min(self.config.max_upload or math.inf, share))
        self.download_limit = max(floor, min(self.config.max_download or math.inf, share))

    # -- outputs -----------------------------------------------------------------------------------
    def take_actions(self) -> list[SaveBudget]:
        actions, self._actions = self._actions, []
        return actions

    def saved_budget(self) -> SavedBudget | None:
        """The budget's count as of now, for a save when the node stops (None: no budget)."""
        return None if self.budget is None else self.budget.saved()

    def pacer_ceiling(self) -> float | None:
        """The averaging pacer's highest rate, payload bytes/s (None: no upload limit)."""
        if self.upload_limit is None:
            return None
        return PACER_SHARE * self.upload_limit * self.datagram / (self.datagram + WIRE_OVERHEAD)

    def fetch_limit(self) -> float | None:
        """Bytes/s on the wire that state-sync requests may ask for: FETCH_SHARE of the download limit less what
        else arrived in the last tick, never under a datagram or two a second (None: no download limit)."""
        if self.download_limit is None:
            return None
        other = max(0.0, self.download_rate - self.fetch_rate)
        return max(2.0 * (self.datagram + WIRE_OVERHEAD), FETCH_SHARE * self.download_limit - other)

    def relay_rate(self, default: float) -> float:
        """Bytes/s this node relays for others at most: RELAY_SHARE of the lower limit, else ``default``."""
        limits = [x for x in (self.upload_limit, self.download_limit) if x is not None]
        return min(default, RELAY_SHARE * min(limits)) if limits else default

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
            round(self.held_s, 6), self.held_sends, None if self.budget is None else self.budget.statistics(now),
            self.serve_refused, round(self.fetch_held_s, 6))
