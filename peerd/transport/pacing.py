"""Sender pacing and receiver delivery reports (sans-I/O: every call takes ``now``).

Two halves of one feedback loop:

* ``DeliveryMeter`` (receiver side) turns cumulative per-sender counters of a running phase into
  interval reports: over the last ``seconds``, of the data datagrams the sender sent (inferred from the
  highest datagram index that arrived: streams are sent in index order), ``received`` arrived, carrying
  ``nbytes`` bytes. It is sampled from a timer every ~50 ms, so it costs nothing per datagram.
* ``Pacer`` (sender side) is a token bucket whose rate follows those reports.

Why not just "loss means slow down": a lossy link (random drops, independent of the rate) must not
collapse the rate, while an overrun bottleneck (a token-bucket link, a slow receiver) must. One report
cannot tell them apart: in both, delivered ~= sent x (1 - loss). What differs is how loss depends on the
rate: random loss stays at p at every rate, congestion loss vanishes below the bottleneck. So the pacer
keeps, per path, a random-loss floor (from recent clean reports; 0 until there are some) and treats only
loss clearly above the floor, or receive-buffer overflow (kernel drops), as congestion. The loss that caused
a decrease is a suspect: if the next report, sent at the lower rate, shows the same loss, it was random
loss: it joins the floor and the decrease is undone. On a bottleneck the back-off goes below it, the next
reports come in clean, and the floor stays near 0. (The old heuristic took the first report's fraction as
the floor, so it learned congestion as random loss and never backed off.)

Arrivals lagging behind sends (a queue building at a receiver) are not a signal on their own: measured
with 4 daemons on 2 cores over loopback, receivers short of CPU lag all the time, the 32 MB socket buffers
absorb it, and backing off on it cut throughput several-fold. The lag does shape how far a decrease goes.

On congestion the rate drops to what the path delivered (the delivered fraction beyond the random loss,
and the arrival rate against the send rate of the same datagrams, times a margin), once per interval:
reports about datagrams sent before the last decrease are stale and ignored. Clean reports raise the rate:
doubling it every 0.1 s until the first congestion (slow start), then by 30 % a second (a constant step
would take minutes to recover from a deep cut). A sender that does not use its rate (CPU-bound) does not
raise it.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

DEFAULT_RATE = 100e6  # bytes/s: a fast start (slow start doubles it every 0.1 s); a receiver reports early
MIN_RATE = 0.5e6
MAX_RATE = 20e9
BURST_S = 0.002  # a burst may run this far ahead of the average rate

SLOW_START_DOUBLING_S = 0.1  # until the first congestion, clean reports double the rate this often
ADDITIVE_PER_S = 0.3  # afterwards they add this fraction of the rate per second (recovers from a deep cut)
MAX_STEP_S = 0.1  # an increase covers at most this much time since the last one
BACKOFF_MARGIN = 0.9  # go this far below what the path delivered
MAX_BACKOFF = 0.85  # a decrease is at least this much
MIN_FACTOR = 0.02  # and at most this much, in one step (an 8x overrun loses ~7/8: that says how far to go)
MIN_LAG_FACTOR = 0.5
LOSS_MARGIN = 0.02  # loss this far above the path's floor (plus 3 sigma of sampling noise) is congestion
MIN_SAMPLE = 32  # datagrams: fewer carry too little information about loss
EPISODE_S = 1.0  # decreases closer together than this are one episode (undone together)
FIRST_REPORT = 4 * MIN_SAMPLE  # positions: a stream's first report comes this early, whatever the interval
MIN_RATE_SPAN_S = 0.04  # intervals shorter than this say little about rates
MIN_SPAN_S = 0.002  # ... and shorter than this nothing
FLOOR_SAMPLES = 8  # reports per path the random-loss floor is taken over
LOG_QUANTUM_S = 0.005
LOG_HISTORY_S = 4.0
APP_LIMITED = 0.5  # a sender using less than this fraction of its rate (over the last APP_WINDOW_S) does not
APP_WINDOW_S = 0.1  # raise it: an unused rate says nothing about the path
MAX_PATHS = 1024  # per-destination state kept (reports, send logs); the least recently used goes first


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


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a report did to the rate (for tests, metrics and logs)."""

    action: str  # "decrease", "increase", "hold", "stale", "small"
    reason: str
    rate: float


class _Path:
    __slots__ = ("losses", "suspect")

    def __init__(self) -> None:
        self.losses: deque[tuple[float, int]] = deque(maxlen=FLOOR_SAMPLES)  # (loss, datagrams)
        # The loss that caused the last decrease: congestion if the next report (at the lower rate) shows
        # less, the path's random loss if it shows as much.
        self.suspect: tuple[float, int, float, float] | None = None  # loss, datagrams, rate and ssthresh before

    def floor(self) -> tuple[float, int]:
        """(the path's random-loss estimate, the sample size behind it); (0, 0) before any report.

        The lowest upper confidence bound (Wilson, 2 sigma) over recent clean reports: a lower estimate
        would let the noise of small samples (at low rates) read as congestion and spiral the rate down;
        taking the lowest keeps mild congestion that slipped under the threshold from ratcheting the floor
        up. (A plain loss + 2 sigma bound gave a small sample with no loss a bound near 0.06, and a 10 %
        random-loss path then read as congested every few reports.)"""
        best, best_n = 0.0, 0
        for loss, n in self.losses:
            bound = _upper_bound(loss, n)
            if not best_n or bound < best:
                best, best_n = bound, n
        return min(best, 1.0), best_n


def _upper_bound(p: float, n: int, z: float = 2.0) -> float:
    """Wilson score upper bound of a loss fraction p measured over n datagrams."""
    z2n = z * z / n
    return (p + z2n / 2 + z * math.sqrt(p * (1 - p) / n + z2n / (4 * n))) / (1 + z2n)


def _sigma(p: float, n: int) -> float:
    """Standard deviation of a loss fraction measured over n datagrams (at least that of 1 in n)."""
    return math.sqrt(max(p, 1.0 / n) * (1.0 - min(p, 0.999)) / n)


class _SendLog:
    """Bytes sent, in LOG_QUANTUM_S buckets, over the last LOG_HISTORY_S: what rate did I really send at."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: deque[list] = deque()  # [bucket index, bytes]

    def add(self, t: float, nbytes: int) -> None:
        b = math.floor(t / LOG_QUANTUM_S)
        buckets = self.buckets
        if buckets and buckets[-1][0] >= b:  # (a time before the last bucket cannot happen: times only grow)
            buckets[-1][1] += nbytes
        else:
            buckets.append([b, nbytes])
            horizon = b - LOG_HISTORY_S / LOG_QUANTUM_S
            while buckets[0][0] < horizon:
                buckets.popleft()

    def rate(self, start: float, stop: float) -> float:
        """Bytes per second sent in [start, stop)."""
        if stop <= start:
            return 0.0
        b0, b1 = math.floor(start / LOG_QUANTUM_S), math.floor(stop / LOG_QUANTUM_S)
        total = 0
        for b, n in reversed(self.buckets):
            if b < b0:
                break
            if b < b1:
                total += n
        return total / ((b1 - b0) * LOG_QUANTUM_S) if b1 > b0 else 0.0


class Pacer:
    """A token bucket whose rate follows receivers' reports (see the module docstring)."""

    def __init__(
        self,
        rate: float = DEFAULT_RATE,
        *,
        min_rate: float = MIN_RATE,
        max_rate: float = MAX_RATE,
        max_paths: int = MAX_PATHS,
    ) -> None:
        self.rate = float(rate)
        self.min_rate = min_rate
        self.max_rate = max_rate
        self.ssthresh = math.inf  # rate found at the last congestion; slow start below it
        self._next = 0.0  # when the bucket is empty again
        self._last_decrease = -math.inf
        self._last_increase: float | None = None
        self._undo_rate = 0.0  # the rate before the current episode of decreases (restored if random loss)
        # Per destination, bounded (the driver only feeds reports from group members, but a node meets many
        # over its life): the least recently used destination's state goes first.
        self.max_paths = max_paths
        self._paths: OrderedDict[Hashable, _Path] = OrderedDict()
        self._sent: OrderedDict[Hashable, _SendLog] = OrderedDict()
        self._total = _SendLog()
        self.decreases = 0
        self.increases = 0

    # -- sending -----------------------------------------------------------------------------------
    def reserve(self, nbytes: int, now: float, dest: Hashable = None) -> float:
        """Account for sending ``nbytes`` to ``dest`` now; returns how long to wait before sending them."""
        start = max(self._next, now - BURST_S)
        self._next = start + nbytes / self.rate
        at = max(start, now)
        self._total.add(at, nbytes)
        log = self._sent.get(dest)
        if log is None:
            log = self._sent[dest] = _SendLog()
            while len(self._sent) > self.max_paths:
                self._sent.popitem(last=False)
        else:
            self._sent.move_to_end(dest)
        log.add(at, nbytes)
        return at - now

    def sent_rate(self, start: float, stop: float, dest: Hashable = None) -> float:
        """What this sender really sent to ``dest`` (all destinations: None) in [start, stop), bytes/s."""
        if dest is None:
            return self._total.rate(start, stop)
        log = self._sent.get(dest)
        return 0.0 if log is None else log.rate(start, stop)

    # -- feedback ----------------------------------------------------------------------------------
    def on_report(
        self, dest: Hashable, report: Report, now: float, sent_span: tuple[float, float] | None = None
    ) -> Verdict:
        """Adapt the rate to one receiver's interval report, received at ``now``.

        ``sent_span``: when this sender sent the first and the last datagram of the interval (the driver
        knows from ``report.position``). Without it the interval is taken to be the last ``seconds``.
        """
        r = report
        if r.expected < MIN_SAMPLE and r.kernel_drops == 0:
            return Verdict("small", f"{r.expected} datagrams", self.rate)
        path = self._paths.get(dest)
        if path is None:
            path = self._paths[dest] = _Path()
            while len(self._paths) > self.max_paths:
                self._paths.popitem(last=False)
        else:
            self._paths.move_to_end(dest)
        expected = max(r.expected, r.received, 1)
        delivered_fraction = r.received / expected
        loss = 1.0 - delivered_fraction
        floor, floor_n = path.floor()
        if not floor_n:  # a new path: the lowest floor other paths have shown (a lossy link is often all links)
            floor = min((f for f, n in (q.floor() for q in self._paths.values()) if n), default=0.0)
        sigma = _sigma(floor, expected)
        if sent_span is not None:
            start, stop = sent_span
        else:
            start, stop = now - r.seconds, now
        # The datagrams of a report sent before the last decrease say nothing about the new rate.
        if start < self._last_decrease:
            return Verdict("stale", "sent before the last decrease", self.rate)
        excess = r.expected >= MIN_SAMPLE and loss > floor + LOSS_MARGIN + 3 * sigma
        undone = False
        if excess and path.suspect is not None:
            before, before_n, rate_before, ssthresh_before = path.suspect
            noise = 3 * _sigma(before, min(expected, before_n))
            if abs(loss - before) <= LOSS_MARGIN + noise:  # backing off did not change it: rate-independent
                path.losses.append((before, before_n))
                floor = min(loss, before)
                excess = False
                # Undo the decrease it caused (it was spurious), as TCP undoes one after a spurious timeout.
                self.rate = max(self.rate, rate_before, self._undo_rate)
                self.ssthresh = max(self.ssthresh, ssthresh_before)
                undone = True
        path.suspect = None
        reason = ""
        if r.kernel_drops > 0:
            reason = f"{r.kernel_drops} datagrams dropped by the receiver's kernel"
        elif excess:
            reason = f"loss {loss:.3f} above the path's floor {floor:.3f}"
            path.suspect = (loss, expected, self.rate, self.ssthresh)
        if reason:
            # Down to what the path delivered: the fraction that arrived beyond the random loss, and (over
            # a long enough span) the arrival rate against the send rate of the same datagrams.
            # Arrival times are when the receiver got round to the datagrams, so a receiver short of CPU
            # stretches them: the time-based factor alone never cuts deeper than MIN_LAG_FACTOR.
            factor = delivered_fraction / max(1e-9, 1.0 - floor)
            if stop - start >= MIN_SPAN_S and r.seconds > 0:
                factor = min(factor, max(MIN_LAG_FACTOR, (stop - start) / r.seconds) * factor)
            if r.kernel_drops:  # as if this sender's datagrams were all that the kernel dropped
                factor = min(factor, r.received / (r.received + r.kernel_drops))
            factor = min(MAX_BACKOFF, max(MIN_FACTOR, factor * BACKOFF_MARGIN))
            base = self.rate
            actual = self.sent_rate(start, stop) if stop - start >= MIN_RATE_SPAN_S else 0.0
            if 0 < actual < base:
                base = actual  # back off from what was really sent, not from an unused nominal rate
            if now - self._last_decrease > EPISODE_S:  # the rate before this episode of decreases
                self._undo_rate = self.rate
            self.rate = max(self.min_rate, base * factor)
            self.ssthresh = self.rate
            self._last_decrease = now
            self.decreases += 1
            return Verdict("decrease", reason, self.rate)

        if r.expected >= MIN_SAMPLE:
            path.losses.append((loss, expected))
        if self.sent_rate(now - APP_WINDOW_S, now) < APP_LIMITED * self.rate:
            return Verdict("hold", "sender did not use its rate", self.rate)
        dt = MIN_RATE_SPAN_S if self._last_increase is None else now - self._last_increase
        dt = min(MAX_STEP_S, max(0.0, dt))
        self._last_increase = now
        if self.rate < self.ssthresh:
            self.rate = min(self.rate * 2 ** (dt / SLOW_START_DOUBLING_S), max(self.ssthresh, self.rate))
        else:
            self.rate += ADDITIVE_PER_S * dt * self.rate
        self.rate = min(self.max_rate, self.rate)
        self.increases += 1
        return Verdict("increase", "random loss: last decrease undone" if undone else "clean", self.rate)


class SendPositions:
    """When each datagram of one stream was sent, in checkpoints (one per batch): the driver records
    ``(position after the batch, time)`` and looks up the send span of a report's positions."""

    __slots__ = ("_ends", "_times")

    def __init__(self) -> None:
        self._ends: list[int] = []
        self._times: list[float] = []

    def note(self, end: int, t: float) -> None:
        if self._ends and self._ends[-1] >= end:
            return
        self._ends.append(end)
        self._times.append(t)

    def time_of(self, position: int) -> float | None:
        i = bisect.bisect_right(self._ends, position)
        return self._times[i] if i < len(self._times) else None

    def span(self, first: int, last: int) -> tuple[float, float] | None:
        a, b = self.time_of(first), self.time_of(last)
        return None if a is None or b is None else (a, b)


class DeliveryMeter:
    """Receiver side: interval reports from one sender's cumulative counters.

    ``sample(received, top, nbytes, first_at, last_at, kernel_drops, now)`` takes the cumulative data
    datagrams received from the sender, one past the highest stream position that arrived, the bytes
    received, when the first and the latest one arrived, and the socket's cumulative kernel drop counter;
    it returns a Report once enough has happened since the last one, else None. ``final(total, ...)``
    closes the stream: every position up to ``total`` counts as sent.
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
        self, received: int, top: int, nbytes: int, first_at: float, last_at: float, kernel_drops: int, now: float
    ) -> Report | None:
        if self._last_at is None:  # the first report comes as soon as it means something: a sender that
            if top < FIRST_REPORT:  # starts far above its path loses most of what it sends until then
                return None
        elif now - self._t < self.interval_s or top - self._top < self.min_datagrams:
            return None
        return self._take(received, top, nbytes, first_at, last_at, kernel_drops, now)

    def final(
        self, total: int, received: int, nbytes: int, first_at: float, last_at: float, kernel_drops: int, now: float
    ) -> Report | None:
        """The rest of the stream up to ``total`` positions (a tail that never arrived counts as lost)."""
        if total <= self._top and received <= self._received:
            return None
        return self._take(received, max(total, self._top), nbytes, first_at, last_at, kernel_drops, now)

    def _take(
        self, received: int, top: int, nbytes: int, first_at: float, last_at: float, kernel_drops: int, now: float
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
        )
        self._received, self._top, self._bytes, self._drops, self._t = received, top, nbytes, kernel_drops, now
        self._last_at = max(last_at, since)
        return rep
