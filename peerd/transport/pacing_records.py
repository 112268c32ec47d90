"""What the pacer records and what the receivers send it: REPORTs and their meter, the phases and their send logs,
the clean phases floors are pooled from, and where each datagram of a stream was sent (transport/pacing.py)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from .pacing_params import FIRST_REPORT, LOG_HISTORY_S, MAX_PENDING_REPORTS, MIN_SAMPLE


@dataclass(frozen=True, slots=True)
class Report:
    """One receiver's account of one sender's stream over an interval (the REPORT message's numbers)."""

    expected: int  # data datagrams the sender sent in the interval (by the highest index that arrived)
    received: int  # of those (and stragglers), how many arrived
    nbytes: int  # bytes of tensor data that arrived
    seconds: float  # arrival span: from the last arrival before the interval to the last one in it
    kernel_drops: int  # datagrams the receiver's kernel dropped at its socket in the interval (all senders)
    position: int = 0  # one past the highest stream position that arrived (the interval is the `expected`
    # positions before it); lets the sender find when it sent them
    arrived: float = 0.0  # when (the receiver's clock, unix seconds) the datagram at ``position - 1`` arrived; 0:
    # not known. Against its send time, the path's one-way delay plus a constant clock offset (transport.qdelay)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a report did to the rate (for tests, metrics and logs)."""

    action: str  # "decrease", "increase", "hold" (judged, nothing to change), "pooled" (waits for its
    # phase's judgement), "stale" (its phase was judged or forgotten), "small" (nothing in it)
    reason: str
    rate: float


def _var(p: float, n: int) -> float:
    """Sampling variance of a loss fraction measured over n datagrams (at least that of 1 in n)."""
    return max(p, 1.0 / n) * (1.0 - min(p, 0.999)) / n


class Floor(NamedTuple):
    """A random-loss floor: the pooled loss of recent clean phases, the datagrams behind it, and the least sigma a
    phase's loss must stand above it by (a floor from few datagrams asks more)."""

    loss: float = 0.0
    n: int = 0
    z: float = 0.0


def above_floor(loss: float, n: int, floor: Floor, margin: float, z: float) -> bool:
    """Loss over ``n`` datagrams is above ``floor`` by ``margin`` plus ``z`` (at least ``floor.z``) sigma of their
    difference, the sigma of two samples of one loss rate (their pooled loss): a floor that read low by chance would
    otherwise make the noise look small too, and cut a phase for the link's own loss. False without a floor."""
    if floor.n <= 0 or n <= 0:
        return False
    total = n + floor.n
    pooled = (loss * n + floor.loss * floor.n) / total
    sigma = math.sqrt(max(pooled, 1.0 / total) * (1.0 - min(pooled, 0.999)) * (1.0 / n + 1.0 / floor.n))
    return loss > floor.loss + margin + max(z, floor.z) * sigma


class QueueSignal(NamedTuple):
    """The uplink's queue over a phase (Judgement._queue_signal): seconds queued at its end (``level``), its growth
    in seconds per second (None where no destination's samples span enough), when that level was sent, the
    destinations' upper median level (``typical``), and of a growth measured from a sample before the phase, the
    phase's own share per second of it (``added``; the growth itself where measured within the phase)."""

    level: float
    growth: float | None
    at: float
    typical: float
    added: float | None = None


class _Phase:
    """An interval sent at one rate, and what the REPORTs about its datagrams said."""

    __slots__ = ("start", "end", "rate", "kind", "expected", "lost", "drops", "paths", "last_sent", "nbytes",
                 "busy_until", "pause_from", "queue", "first_at", "lead", "recovery")

    def __init__(self, start: float, rate: float, kind: str) -> None:
        self.start = start
        self.end: float | None = None  # None: the current phase
        self.rate = rate
        self.kind = kind  # startup, probe, drain, cruise
        self.expected = 0
        self.lost = 0
        self.drops = 0
        self.paths: dict[Hashable, list[int]] = {}  # dest -> [expected, lost, kernel drops]
        self.last_sent: dict[Hashable, float] = {}  # dest -> when its last part reserved in this phase goes out
        self.nbytes = 0  # bytes reserved in the phase
        self.busy_until = start  # when the last part reserved in the phase is through the bucket
        self.pause_from = start  # when the phase before ended, if nothing ran in between (a pause)
        self.first_at = math.inf  # when its first part goes out (a part reserved before it may still be going)
        self.queue: list[tuple[float, float, Hashable]] = []  # (sent at, queueing delay, dest) of its datagrams
        # startup: per destination, its last sample before its first in this phase, (sent at, queueing delay) or
        # None (see Judgement._queue_signal)
        self.lead: dict[Hashable, tuple[float, float] | None] = {}
        self.recovery = False  # a probe at RECOVER_PROBE (Judgement.recovering)

    def stop(self) -> float:
        """Where the phase's send rate is measured to: its end, or its last send if the sender ran out of data
        before (the end of an average: a phase half empty is not one sent at half its rate)."""
        assert self.end is not None
        return self.end if self.busy_until <= self.start else min(self.end, self.busy_until)


class _Record:
    """A clean, judged phase: what floors are pooled from."""

    __slots__ = ("sent", "expected", "lost", "paths", "kind", "at")

    def __init__(self, sent: float, expected: int, lost: int, paths: dict[Hashable, tuple[int, int, float]],
                 kind: str = "cruise", at: float = 0.0) -> None:
        self.sent = sent  # bytes/s actually sent, all destinations
        self.expected = expected
        self.lost = lost
        self.paths = paths  # dest -> (expected, lost, bytes/s actually sent to it)
        self.kind = kind  # the phase's: startup, probe, drain, cruise
        self.at = at  # when the phase started

    def delivered(self) -> float:
        """What the path delivered of it, bytes/s."""
        return self.sent * (1.0 - self.lost / self.expected) if self.expected > 0 else 0.0


class _Cap:
    __slots__ = ("rate", "next", "key")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.next = 0.0
        self.key: Hashable = None  # a stated limit's: the destinations sharing it


class _SendLog:
    """Bytes sent over the last LOG_HISTORY_S: what rate did I really send at. Each part counts as spread over
    the time the rate gives it (counted whole at its start, a 50 ms phase at 100 Mbit/s held 8, 9 or 10 64 KB
    parts: its rate read 10.4, 11.7 or 13.0 MB/s against a bucket at 12)."""

    __slots__ = ("starts", "spans", "sizes", "before", "total")

    def __init__(self) -> None:
        self.starts: list[float] = []  # when each part began (never decreasing)
        self.spans: list[float] = []  # over how many seconds it went
        self.sizes: list[int] = []
        self.before: list[float] = []  # bytes of all parts before it
        self.total = 0.0

    def add(self, t: float, nbytes: int, seconds: float = 0.0) -> None:
        starts = self.starts
        if starts and t < starts[-1]:  # (cannot happen: reservations only move forward)
            t = starts[-1]
        if len(starts) >= 512 and t - starts[256] > LOG_HISTORY_S:  # forget the oldest half, now and then
            for xs in (starts, self.spans, self.sizes, self.before):
                del xs[:256]
        starts.append(t)
        self.spans.append(max(0.0, seconds))
        self.sizes.append(nbytes)
        self.before.append(self.total)
        self.total += nbytes

    def _through(self, t: float) -> float:
        """Bytes sent before ``t`` (a part that overran the next one's start counts as done at that start)."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i < 0:
            return self.before[0] if self.before else 0.0
        span, size = self.spans[i], self.sizes[i]
        done = t - self.starts[i]
        return self.before[i] + (size if span <= done else size * done / span)

    def rate(self, start: float, stop: float) -> float:
        """Bytes per second sent in [start, stop)."""
        if stop <= start or not self.starts:
            return 0.0
        return (self._through(stop) - self._through(start)) / (stop - start)


class _Frontier:
    """How far one destination's REPORTs have covered this sender's sends without a gap: REPORTs may come out
    of order (jitter) or not at all (they cross lossy links). A gap waits for its REPORT until the pending one
    after it is older than the judging lag, then it is given up on."""

    __slots__ = ("top", "pending")

    def __init__(self) -> None:
        self.top = -math.inf  # every send up to this time is covered
        self.pending: list[tuple[float, float, float]] = []  # (first send, last send, arrival) beyond a gap

    def add(self, span: tuple[float, float], first: bool, now: float, give_up_before: float) -> None:
        """A REPORT covering sends from ``span[0]`` (the send before its first datagram's) to ``span[1]``;
        ``first``: it starts a stream (a new average: nothing before it is missing)."""
        if first:
            self.top = max(self.top, span[1]) if span[0] <= self.top else span[1]
            self.pending = [p for p in self.pending if p[1] > self.top]
        elif span[1] > self.top:
            self.pending.append((span[0], span[1], now))
            if len(self.pending) > MAX_PENDING_REPORTS:
                self.pending.sort()
                first_pending = self.pending.pop(0)  # (the oldest gap is given up on)
                self.top = max(self.top, first_pending[1])
        pending = self.pending
        while pending:
            pending.sort()
            a, b, at = pending[0]
            if a <= self.top or at < give_up_before:
                self.top = max(self.top, b)
                pending.pop(0)
            else:
                break


class SendPositions:
    """When each datagram of one stream was sent, in checkpoints (one per batch): the driver records
    ``(position after the batch, time, seconds per datagram)`` and looks up the send span of a report's
    positions. A batch goes out as one burst and crosses the bottleneck at its rate (``per``: seconds per
    datagram there, ``Pacer.spacing``), so a position inside one is placed that far after the batch's time:
    what a burst queues behind itself is not the path's queue (transport.qdelay)."""

    __slots__ = ("_ends", "_times", "_per")

    def __init__(self) -> None:
        self._ends: list[int] = []
        self._times: list[float] = []
        self._per: list[float] = []

    def note(self, end: int, t: float, per: float = 0.0) -> None:
        if self._ends and self._ends[-1] >= end:
            return
        self._ends.append(end)
        self._times.append(t)
        self._per.append(max(0.0, per))

    def settle(self, end: int, t: float) -> None:
        """The batch that ends at ``end`` really went out at ``t`` (a sender woken late sends after its time)."""
        if self._ends and self._ends[-1] == end and t > self._times[-1]:
            self._times[-1] = t

    def time_of(self, position: int) -> float | None:
        i = bisect.bisect_right(self._ends, position)
        if i >= len(self._times):
            return None
        start = self._ends[i - 1] if i else 0
        return self._times[i] + (position - start) * self._per[i]

    def placed(self, position: int) -> float:
        """How far into its batch ``time_of`` placed ``position`` (seconds; 0: the batch's own time)."""
        i = bisect.bisect_right(self._ends, position)
        if i >= len(self._times):
            return 0.0
        return (position - (self._ends[i - 1] if i else 0)) * self._per[i]

    def span(self, first: int, last: int) -> tuple[float, float] | None:
        a, b = self.time_of(first), self.time_of(last)
        return None if a is None or b is None else (a, b)


class DeliveryMeter:
    """Receiver side: interval reports from one sender's cumulative counters.

    ``sample(received, top, nbytes, first_at, last_at, kernel_drops, now, arrived)`` takes the cumulative data
    datagrams received from the sender, one past the highest stream position that arrived, the bytes
    received, when the first and the latest one arrived, the socket's cumulative kernel drop counter, and when
    (unix seconds, the kernel's receive time where the socket gives it; 0: unknown) the datagram at ``top - 1``
    arrived; it returns a Report once enough has happened since the last one, else None. ``final(total, ...)``
    closes the stream: every position up to ``total`` counts as sent (``arrived``: of position ``total - 1``,
    0 unless it arrived).
    """

    __slots__ = ("_received", "_top", "_bytes", "_drops", "_t", "_last_at", "interval_s", "min_datagrams")

    def __init__(self, now: float, kernel_drops: int, *, interval_s: float = 0.025, min_datagrams: int = MIN_SAMPLE):
        self._received = 0
        self._top = 0
        self._bytes = 0
        self._drops = kernel_drops
        self._t = now
        self._last_at: float | None = None  # arrival of the last datagram counted so far
        self.interval_s = interval_s
        self.min_datagrams = min_datagrams

    def sample(
        self, received: int, top: int, nbytes: int, first_at: float, last_at: float, kernel_drops: int, now: float,
        arrived: float = 0.0,
    ) -> Report | None:
        if self._last_at is None:  # the first report comes as soon as it means something: a sender that
            if top < FIRST_REPORT:  # starts far above its path loses most of what it sends until then
                return None
        elif now - self._t < self.interval_s or top - self._top < self.min_datagrams:
            return None
        return self._take(received, top, nbytes, first_at, last_at, kernel_drops, now, arrived)

    def final(
        self, total: int, received: int, nbytes: int, first_at: float, last_at: float, kernel_drops: int, now: float,
        arrived: float = 0.0,
    ) -> Report | None:
        """The rest of the stream up to ``total`` positions (a tail that never arrived counts as lost)."""
        if total <= self._top and received <= self._received:
            return None
        return self._take(received, max(total, self._top), nbytes, first_at, last_at, kernel_drops, now, arrived)

    def _take(
        self, received: int, top: int, nbytes: int, first_at: float, last_at: float, kernel_drops: int, now: float,
        arrived: float = 0.0,
    ) -> Report:
        # The arrival span runs from the last arrival already reported (the first report's from the first
        # arrival), as the sender's span runs from the send of the position before the interval's first.
        since = first_at if self._last_at is None else self._last_at
        rep = Report(
            expected=top - self._top,
            received=received - self._received,
            nbytes=nbytes - self._bytes,
            seconds=max(0.0, last_at - since),
            kernel_drops=max(0, kernel_drops - self._drops),
            position=top,
            arrived=arrived if arrived > 0 and math.isfinite(arrived) else 0.0,
        )
        self._received, self._top, self._bytes, self._drops, self._t = received, top, nbytes, kernel_drops, now
        self._last_at = max(last_at, since)
        return rep
