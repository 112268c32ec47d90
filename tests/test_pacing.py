"""Sender pacing: a token bucket slowed by congestion, not by random loss (transport/pacing.py).

The scenarios run the sans-I/O Pacer and DeliveryMeter against deterministic models of a path in
virtual time: a token-bucket bottleneck like `tc qdisc tbf` (queue limit by latency, tail drop), random
loss independent of the rate, and a receiver that processes datagrams at a fixed rate with a bounded
socket buffer (kernel drops). Each asserts what a user of the link would see: the rate settles near what
the path can carry, little is lost, and random loss does not collapse the rate.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from peerd.allreduce.host import MIN_PART, PART_S
from peerd.transport import pacing, pacing_judge
from peerd.transport.pacing import (
    BURST_S,
    CYCLE,
    FIRST_REPORT,
    START_RATE,
    DeliveryMeter,
    Pacer,
    Report,
    SendPositions,
    Verdict,
)
from peerd.transport.pacing_params import LOSS_MARGIN, PHASE_S, Q_HIGH, THIN_Z, Z
from peerd.transport.pacing_records import Floor, _Record, above_floor


def test_token_bucket_spaces_sends_at_the_rate() -> None:
    p = Pacer(rate=1e6)
    now = 100.0
    waits = [p.reserve(10_000, None, now) for _ in range(100)]  # 1 MB at once, at 1 MB/s
    assert waits[0] == 0.0
    assert waits[-1] == pytest.approx(99 * 0.01 - BURST_S, abs=1e-9)
    assert all(b >= a for a, b in zip(waits, waits[1:], strict=False))
    # After idling, only a short burst is allowed ahead of the rate.
    assert p.reserve(10_000, None, now + 100) == 0.0
    assert p.reserve(10_000, None, now + 100) == pytest.approx(0.01 - BURST_S, abs=1e-9)


def test_a_backlogged_sender_that_wakes_late_catches_up() -> None:
    """A sender held back by the rate sleeps until its time and, on a loaded CPU, wakes 5 ms late each time:
    the bucket lets it make up for up to CATCHUP_S, so it still sends at the rate (with BURST_S alone it
    lost what it overslept: 64 KB parts at 32 MB/s, 2 ms each, took 7 ms each, 29 % of the rate)."""
    rate, part = 32e6, PART * DATAGRAM
    p = Pacer(rate=rate)
    p.btl = rate / 0.97  # (out of startup: a rate the path carried; a startup rate gets BURST_S only)
    t, sent = 10.0, 0
    while t < 11.0:
        wait = p.reserve(part, None, t)
        sent += part
        t += wait + (0.005 if wait > 0 else 0.0)  # sleeps until its time, and wakes late
    assert p.sent_rate(10.1, 10.9) >= 0.95 * rate, p.sent_rate(10.1, 10.9)
    assert sent / 1.0 >= 0.95 * rate
    # an idle sender still gets only BURST_S ahead (of its rate, aged by the idle time)
    assert p.reserve(part, None, 20.0) == 0.0 and p.reserve(part, None, 20.0) == pytest.approx(part / p.rate - BURST_S)


def test_a_report_spanning_a_pause_counts() -> None:
    """The sender pauses 0.1 s for data (between reduce-scatter and all-gather): no phase runs then. A REPORT
    whose datagrams went out on both sides of the pause, its middle in it, is pooled into the phase after the
    pause, not dropped as stale (a third of the lab's REPORTs were); one about a judged phase still is."""
    p = Pacer(rate=10e6)
    t = 0.0
    while t < 0.03:
        t += p.reserve(12_000, "a", t) + 0.001
    t = 0.15
    while t < 0.18:
        t += p.reserve(12_000, "a", t) + 0.001
    assert p.receive_report("a", Report(40, 40, 48_000, 0.1, 0, 40), (0.0, 0.17), 0.0, 0.19).action == "pooled"
    assert p.receive_report("a", Report(10, 10, 12_000, 0.1, 0, 50), (0.17, 0.18), 0.0, 2.0).action != "pooled"
    assert p.receive_report("a", Report(10, 10, 12_000, 0.1, 0, 60), (0.0, 0.02), 0.0, 2.1).action == "stale"


def test_sent_rate_is_what_was_really_sent_per_destination() -> None:
    p = Pacer(rate=10e6)
    t = 0.0
    while t < 1.0:  # 1 MB/s to "a", 3 MB/s to "b": well under the rate, so nothing waits
        p.reserve(1000, "a", t)
        p.reserve(3000, "b", t)
        t += 0.001
    assert p.sent_rate(0.5, 1.0, "a") == pytest.approx(1e6, rel=0.02)
    assert p.sent_rate(0.5, 1.0, "b") == pytest.approx(3e6, rel=0.02)
    assert p.sent_rate(0.5, 1.0) == pytest.approx(4e6, rel=0.02)
    assert p.sent_rate(2.0, 3.0, "a") == 0.0 and p.sent_rate(0.5, 1.0, "nobody") == 0.0


def test_a_phases_rate_counts_the_share_of_each_part_sent_inside_it() -> None:
    """Backlogged 64 KB parts at 12 MB/s: every 50 ms window reads 12 MB/s within 1 %, wherever its edges cut the
    parts. (Counted whole at their starts, windows held 8, 9 or 10 parts: 10.4-13.0 MB/s, and probes that sent
    the link's rate read "not above btl".)"""
    p = Pacer(rate=12e6)
    t = 0.0
    while t < 1.0:
        t += max(0.0, p.reserve(PART * DATAGRAM, "a", t))
    rates = [p.sent_rate(a / 1000, a / 1000 + 0.05) for a in range(100, 900, 7)]
    assert min(rates) >= 0.99 * 12e6 and max(rates) <= 1.01 * 12e6, (min(rates), max(rates))
    assert p.sent_rate(0.3, 0.35, "a") == pytest.approx(12e6, rel=0.01)


def test_delivery_meter_infers_what_was_sent_from_the_highest_index() -> None:
    meter = DeliveryMeter(0.0, kernel_drops=7, interval_s=0.05, min_datagrams=10)
    assert meter.sample(0, FIRST_REPORT - 1, 0, 0.01, 0.05, 7, 0.06) is None  # too few datagrams yet
    # The first report comes as soon as FIRST_REPORT positions are in, however short the interval: a sender
    # far above its path's rate must hear it early.
    rep = meter.sample(120, FIRST_REPORT + 2, 144_000, 0.01, 0.03, 9, 0.04)
    assert rep == Report(expected=FIRST_REPORT + 2, received=120, nbytes=144_000, seconds=pytest.approx(0.02),
                         kernel_drops=2, position=FIRST_REPORT + 2)
    assert meter.sample(200, 230, 240_000, 0.01, 0.06, 9, 0.07) is None  # too soon after it
    rep = meter.sample(210, FIRST_REPORT + 102, 252_000, 0.01, 0.13, 9, 0.14)
    assert (rep.expected, rep.received, rep.kernel_drops, rep.position) == (100, 90, 0, FIRST_REPORT + 102)
    assert rep.seconds == pytest.approx(0.1)  # arrival span: from the last arrival already reported
    # The stream ends: a lost tail (50 positions, 5 of them arrived) counts as lost.
    rep = meter.final(FIRST_REPORT + 152, 215, 258_000, 0.01, 0.15, 9, 0.3)
    assert (rep.expected, rep.received, rep.position) == (50, 5, FIRST_REPORT + 152)
    assert meter.final(FIRST_REPORT + 152, 215, 258_000, 0.01, 0.15, 9, 0.4) is None  # nothing more to say


# ---- a swarm of senders on shaped links, in virtual time -------------------------------------------------

DATAGRAM = 1200
PART = 54  # datagrams per paced send: one 64 KB GSO send, as the driver does at mtu 1200
MBIT = 1e6 / 8  # bytes/s


@dataclass
class Tbf:
    """`tc qdisc tbf rate R burst B limit L` (GCRA): a packet that conforms to the bucket passes at once,
    others wait in a FIFO queue of at most ``limit`` bytes beyond the burst; a packet that finds it full is
    dropped. Departures are counted in 10 ms bins for utilization."""

    rate: float  # bytes/s
    burst: float = 12_500  # 1 ms of 100 Mbit/s, as the lab's tbf
    limit: float = 250_000  # 20 ms of 100 Mbit/s, as the lab's tbf
    tat: float = 0.0
    drops: int = 0
    bins: dict = field(default_factory=dict)

    def admit(self, t: float, size: int) -> float | None:
        depart = max(t, self.tat - self.burst / self.rate)
        if (depart - t) * self.rate > self.limit:
            self.drops += 1
            return None
        self.tat = max(self.tat, depart) + size / self.rate
        b = int(depart * 100)
        self.bins[b] = self.bins.get(b, 0) + size
        return depart

    def carried(self, start: float, stop: float) -> float:
        """Bytes that left in [start, stop) (10 ms resolution)."""
        return sum(n for b, n in self.bins.items() if start * 100 <= b < stop * 100)


class Swarm:
    """``n`` nodes, each with an uplink and a downlink tbf at ``rate`` and random loss ``loss`` on its input
    (after its downlink, as nftables drops there); every node streams to every other, destinations in turn
    one part at a time (as the driver does), each part when its Pacer says. Receivers sample a
    DeliveryMeter per sender every 25 ms (each at its own offset) and their REPORTs land ``report_delay``
    later (plus an exponential ``report_jitter`` of that mean: loaded event loops answer late and unevenly).
    ``rx_capacity``/``rx_buffer``: a receiver that takes that many datagrams/s off a socket buffer of that
    many (kernel drops beyond). ``stall=(every, length)``: each receiver's CPU stops for ``length`` seconds
    every ``every`` (at its own offset), as a daemon descheduled on 2 loaded cores: nothing is taken off its
    socket buffer and no REPORT leaves until it runs again. ``volume``/``idle``: each sender stops after
    ``volume`` bytes (an average), idles ``idle`` seconds, and starts the next. ``driver_parts``: parts sized as
    the driver sizes them (about 1 ms at the pacer's rate, 2 datagrams at least), not one 64 KB GSO send each.
    Deterministic for a seed."""

    def __init__(self, n: int, rate: float, loss: float = 0.0, *, seed: int = 0, queue: float = 250_000,
                 report_delay: float = 0.002, rx_capacity: float | None = None, rx_buffer: int = 0,
                 pacer_rate: float | None = None, report_jitter: float = 0.0,
                 stall: tuple[float, float] | None = None, volume: float | None = None, idle: float = 0.0,
                 timestamps: bool = True, send_stall: tuple[float, float] | None = None,
                 driver_parts: bool = False, late_reader: tuple[int, float] | None = None,
                 patches: tuple[float, float, float] | None = None) -> None:
        self.n = n
        # (receiver, mean seconds): that receiver's arrival times read late by an exponential delay of that mean,
        # as a daemon's on a loaded machine did in the lab (6-50 ms where the others read under 3 ms)
        self.late_reader = late_reader
        # (every, length, extra): the random loss is ``extra`` higher for ``length`` seconds every ``every`` (a
        # lossy patch: the lab's random drop read 6.5-7.7 % over a phase where it was set to 5 %)
        self.patches = patches
        self.driver_parts = driver_parts
        self.loss = loss
        self.rng = random.Random(seed)
        self.jitter_rng = random.Random(seed + 1000)  # (its own stream: the loss draws stay as without it)
        self.report_jitter = report_jitter
        self.timestamps = timestamps
        self.stall = stall
        self.send_stall = send_stall
        self.volume = volume
        self.idle = idle
        self.sent_bytes = [0] * n  # in the current average
        self.averages: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # (start, end) per sender
        self.started = [0.0] * n
        self.up = [Tbf(rate, limit=queue) for _ in range(n)]
        self.down = [Tbf(rate, limit=queue) for _ in range(n)]
        self.pacers = [Pacer() if pacer_rate is None else Pacer(rate=pacer_rate) for _ in range(n)]
        self.report_delay = report_delay
        self.rx_capacity = rx_capacity
        self.rx_buffer = rx_buffer
        self.events: list = []
        self.seq = 0
        self.positions = [[SendPositions() for _ in range(n)] for _ in range(n)]  # [sender][dest]
        self.sent_pos = [[0] * n for _ in range(n)]
        self.turn = [(i + 1) % n for i in range(n)]
        # receiver state, [receiver][sender]: received, top, first_at, last_at, arrival of the top
        self.rx = [[[0, 0, None, 0.0, 0.0] for _ in range(n)] for _ in range(n)]
        self.meters = [[DeliveryMeter(0.0, 0) for _ in range(n)] for _ in range(n)]
        self.kernel_drops = [0] * n
        self.rx_busy = [0.0] * n  # when each receiver's CPU is free again
        self.rx_queue: list[deque] = [deque() for _ in range(n)]  # processing finish times in its buffer
        self.sent_bins: dict[int, int] = {}  # by send time, 10 ms bins: datagrams sent ...
        self.got_bins: dict[int, int] = {}  # ... and of those, delivered
        self.verdicts: list[list[tuple[float, Verdict]]] = [[] for _ in range(n)]
        self.rates: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.changes: list[tuple[float, float]] = []  # (at, new rate) for every link

    def push(self, t: float, kind: str, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def run(self, seconds: float) -> None:
        for i in range(self.n):
            self.push(0.0, "send", i)
            self.push(0.025 * (1 + i) / self.n, "tick", i)
        for at, rate in self.changes:
            self.push(at, "rate", rate)
        while self.events and self.events[0][0] < seconds:
            t, _, kind, args = heapq.heappop(self.events)
            getattr(self, "_" + kind)(t, *args)

    def _rate(self, t: float, rate: float) -> None:
        for link in self.up + self.down:
            link.rate = rate

    def _stalled_until(self, t: float, d: int, stall: tuple[float, float] | None = None) -> float:
        """When receiver ``d``'s CPU runs again (``t`` if it is not stalled then); ``stall``: another pattern
        than the receivers' (a sender's)."""
        stall = stall or self.stall
        if stall is None:
            return t
        every, length = stall
        offset = every * d / self.n
        k = (t - offset) // every
        start = offset + k * every
        return start + length if start <= t < start + length else t

    def _send(self, t: float, i: int) -> None:
        if self.send_stall is not None:
            resume = self._stalled_until(t, i, self.send_stall)
            if resume > t:  # a sender descheduled: it sends when it runs again, what its pacer lets it catch up
                self.push(resume, "send", i)
                return
        if self.volume is not None and self.sent_bytes[i] >= self.volume:
            self.averages[i].append((self.started[i], t))
            self.sent_bytes[i] = 0
            self.started[i] = t + self.idle
            self.push(t + self.idle, "send", i)
            return
        part = self._part(i)
        if self.volume is not None:
            self.sent_bytes[i] += part * DATAGRAM
        d = self.turn[i]
        self.turn[i] = (d + 1) % self.n if (d + 1) % self.n != i else (d + 2) % self.n
        wait = self.pacers[i].reserve(part * DATAGRAM, d, t)
        self.push(t + max(0.0, wait), "fire", i, d, part)

    def _part(self, i: int) -> int:
        if not self.driver_parts:
            return PART
        return max(MIN_PART, min(PART, int(self.pacers[i].rate * PART_S / DATAGRAM)))

    def _fire(self, t: float, i: int, d: int, part: int) -> None:
        b = int(t * 100)
        self.sent_bins[b] = self.sent_bins.get(b, 0) + part
        for _ in range(part):
            k = self.sent_pos[i][d]
            self.sent_pos[i][d] = k + 1
            up = self.up[i].admit(t, DATAGRAM)
            if up is not None:
                self.push(up, "down", i, d, k, b)
        self.positions[i][d].note(self.sent_pos[i][d], t, self.pacers[i].spacing(DATAGRAM))
        self.rates[i].append((t, self.pacers[i].rate))
        self.push(t, "send", i)

    def _down(self, t: float, i: int, d: int, k: int, b: int) -> None:
        at = self.down[d].admit(t, DATAGRAM)
        loss = self.loss
        if self.patches is not None and t % self.patches[0] < self.patches[1]:
            loss += self.patches[2]
        if at is None or (loss and self.rng.random() < loss):
            return
        if self.rx_capacity is not None:  # the receiver's socket buffer, emptied at its CPU's pace
            q = self.rx_queue[d]
            while q and q[0] <= at:
                q.popleft()
            if len(q) >= self.rx_buffer:
                self.kernel_drops[d] += 1
                return
            start = self._stalled_until(max(at, self.rx_busy[d]), d)
            at = self.rx_busy[d] = start + 1.0 / self.rx_capacity
            q.append(at)
        self.push(at, "arrive", i, d, k, b)

    def _arrive(self, t: float, i: int, d: int, k: int, b: int) -> None:
        st = self.rx[d][i]
        st[0] += 1
        if k + 1 > st[1]:
            st[1], st[4] = k + 1, t
        if st[2] is None:
            st[2] = t
        st[3] = t
        self.got_bins[b] = self.got_bins.get(b, 0) + 1

    def _tick(self, t: float, d: int) -> None:
        resume = self._stalled_until(t, d)
        if resume > t:  # a stalled receiver samples (and reports) when it runs again
            self.push(resume, "tick", d)
            return
        for i in range(self.n):
            if i == d:
                continue
            received, top, first, last, top_at = self.rx[d][i]
            if first is None:
                continue
            if self.late_reader is not None and self.late_reader[0] == d and top_at:
                top_at += self.jitter_rng.expovariate(1.0 / self.late_reader[1])
            rep = self.meters[d][i].sample(received, top, received * DATAGRAM, first, last,
                                           self.kernel_drops[d], t, top_at if self.timestamps else 0.0)
            if rep is not None:
                jitter = self.jitter_rng.expovariate(1.0 / self.report_jitter) if self.report_jitter else 0.0
                self.push(t + self.report_delay + jitter, "report", i, d, rep)
        self.push(t + 0.025, "tick", d)

    def _report(self, t: float, i: int, d: int, rep: Report) -> None:
        first = max(0, rep.position - rep.expected - 1)
        span = self.positions[i][d].span(first, rep.position - 1)
        placed = self.positions[i][d].placed(rep.position - 1)
        self.verdicts[i].append((t, self.pacers[i].receive_report(d, rep, span, placed, t)))

    # -- what a user of the links sees ---------------------------------------------------------------
    def utilization(self, start: float, stop: float, rate: float) -> float:
        """Mean over the uplinks of the bytes they carried in [start, stop) over what ``rate`` allows."""
        return sum(u.carried(start, stop) for u in self.up) / (self.n * rate * (stop - start))

    def excess_loss(self, start: float, stop: float) -> float:
        """Of the datagrams sent in [start, stop), the fraction lost beyond the random loss."""
        sent = sum(v for b, v in self.sent_bins.items() if start * 100 <= b < stop * 100)
        got = sum(v for b, v in self.got_bins.items() if start * 100 <= b < stop * 100)
        return 1.0 - got / sent - self.loss


def lossy_swarm(loss: float, seed: int, seconds: float = 3.0) -> Swarm:
    sw = Swarm(4, 100 * MBIT, loss, seed=seed)
    sw.run(seconds)
    return sw


def feed(pacer: Pacer, seconds: float, loss_of, *, t0: float = 0.0, dests=("a", "b", "c"), drops_of=None,
         lag: float = 0.01, seed: int = 0, burst: int = 0, gap: float = 0.0, queue_of=None,
         datagram: int = DATAGRAM, part: int | None = None) -> float:
    """Drive one Pacer with no link model: it sends all the time, destinations in turn, a part at a time when
    its bucket says; every 25 ms each destination reports what was sent to it up to ``lag`` ago, of which
    ``loss_of(dest, t)`` was lost at random (and ``drops_of(dest, t)`` kernel drops). ``burst``/``gap``: after
    every ``burst`` parts the sender waits ``gap`` seconds for data. ``queue_of(dest, t)``: the seconds the
    interval's last datagram (sent at t) waited in queues; its arrival time is in each REPORT (None: REPORTs
    without arrival times). ``part``: datagrams per send (default: one GSO send's). Returns the end time."""
    rng = random.Random(seed)
    if part is None:
        part = PART if datagram == DATAGRAM else max(2, 65000 // datagram)  # (one GSO send's datagrams)
    t, tick = t0, t0 + 0.025
    sent = {d: [] for d in dests}  # per destination: send time of every datagram
    reported = dict.fromkeys(dests, 0)
    k = 0
    while t < t0 + seconds:
        d = dests[k % len(dests)]
        k += 1
        if burst and k % burst == 0:
            t += gap
        t += max(0.0, pacer.reserve(part * datagram, d, t))
        sent[d].extend([t] * part)
        while tick <= t:
            for dd in dests:
                times = sent[dd]
                top = reported[dd]
                while top < len(times) and times[top] <= tick - lag:
                    top += 1
                n = top - reported[dd]
                if n:
                    p = loss_of(dd, times[top - 1])
                    got = sum(1 for _ in range(n) if rng.random() >= p)
                    drops = drops_of(dd, times[top - 1]) if drops_of else 0
                    arrived = 0.0 if queue_of is None else 1e6 + times[top - 1] + 0.002 + queue_of(dd, times[top - 1])
                    rep = Report(n, got, got * datagram, 0.025, drops, top, arrived)
                    span = (times[max(0, reported[dd] - 1)], times[top - 1])
                    pacer.receive_report(dd, rep, span, 0.0, tick)
                    reported[dd] = top
            tick += 0.025
    return t


# ---- what the tests ask of the pacer ----------------------------------------------------------------------


@pytest.mark.parametrize("loss", [0.0, 0.01, 0.05, 0.10])
def test_four_senders_fill_their_links_and_do_not_overrun_them(loss: float) -> None:
    """The lab's shape: 4 nodes, 100 Mbit/s tbf up and down (1 ms burst, 20 ms queue), random loss on every
    node's input, every node streaming to the 3 others from a low start, receivers giving arrival times. Once
    started (after 1 s), the uplinks carry >= 93 % of their rate (0.935-0.965 measured, seeds 1-3), and the
    loss the pacer adds to the random loss is under the issue's 0.01: 0.0000-0.0032 in steady state (seeds 1-3;
    0.0013 / 0.0025 / 0.0000 / 0.0012 at seed 1: a probe that queues its own margin is not clean, Q_PROBE; judged
    against Q_HIGH it was 0.0044 / 0.0032 / 0.0002 / 0.0010), 0.0055-0.0105 with the startup overshoot (the queue
    turns probes back before they overflow it)."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, loss, seed=1)
    sw.run(5.0)
    util = sw.utilization(1.0, 4.8, rate)
    excess = sw.excess_loss(1.0, 4.7)
    assert util >= 0.93, (util, excess)
    assert excess <= 0.003, (util, excess)
    assert sw.excess_loss(0.0, 4.7) <= 0.015  # with startup
    assert all(p.btl is not None and 0.7 * rate <= p.btl <= 1.2 * rate for p in sw.pacers), [p.btl for p in sw.pacers]


@pytest.mark.parametrize("loss", [0.0, 0.01, 0.05, 0.10])
def test_by_loss_alone_four_senders_fill_their_links(loss: float) -> None:
    """The same without arrival times (receivers whose sockets give none, REPORTs of older peers): loss alone
    steers. The uplinks carry >= 90 % of their rate (0.90-0.95 measured, seeds 1-3); the loss the pacer adds,
    its probes' and overshoots' tail drops, is 0.009-0.017 in steady state and 0.013-0.022 with the startup
    overshoot, asserted as measured with a margin so a regression shows."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, loss, seed=1, timestamps=False)
    sw.run(5.0)
    util = sw.utilization(1.0, 4.8, rate)
    excess = sw.excess_loss(1.0, 4.7)
    assert util >= 0.9, (util, excess)
    assert excess <= 0.02, (util, excess)
    assert sw.excess_loss(0.0, 4.7) <= 0.03  # with startup
    assert all(p.btl is not None and 0.6 * rate <= p.btl <= 1.3 * rate for p in sw.pacers), \
        [p.btl for p in sw.pacers]  # (0.63-1.03 at 10 % loss, seed 1)


def test_random_loss_alone_does_not_slow_the_sender() -> None:
    """10 % random loss at every rate (nftables `numgen random` drop), no bottleneck: startup runs the rate up
    to the cap and nothing reads the loss as congestion."""
    pacer = Pacer(max_rate=200e6)
    feed(pacer, 2.0, lambda d, t: 0.10)
    assert pacer.decreases == 0
    assert pacer.rate == pytest.approx(200e6)


def test_a_thin_floor_that_read_low_does_not_cut_a_cruise_for_random_loss() -> None:
    """In the cycle the clean phases under FLOOR_RATE of a cruise are few (an average's tail, a drain after a
    cut): in the lab at 10 Mbit/s under 5 % random loss one such tail of 103 datagrams lost none, and judged at Z
    it cut a cruise that lost 7 of 109 (1.0 -> 0.77 MB/s). A floor of under FLOOR_SAMPLE datagrams asks THIN_Z
    sigma, of the two samples' pooled loss; an overflow above a floor of many datagrams is still congestion."""
    assert not above_floor(7 / 109, 109, Floor(0.0, 103, THIN_Z), LOSS_MARGIN, Z)
    assert above_floor(7 / 109, 109, Floor(0.0, 103), LOSS_MARGIN, Z)  # (the same floor at Z)
    assert above_floor(0.15, 100, Floor(0.04, 800), LOSS_MARGIN, Z)  # (a probe's overflow)
    assert not above_floor(0.06, 100, Floor(), LOSS_MARGIN, Z)  # (no floor: nothing to judge by)
    pacer = Pacer(max_rate=1.25e6)  # (a cap: no link model; every loss below is random)
    pacer.btl = 1.2e6
    pacer.rate = 0.98 * pacer.btl
    t = feed(pacer, 0.5, lambda d, t: 0.05, t0=1.0, part=2)
    assert pacer._floor(pacer.rate).n == 0  # (sending all the time, a cruise has no floor of its own)
    pacer._history.append(_Record(0.3e6, 110, 0, {}))  # an average's tail that lost nothing by chance
    assert pacer._floor(pacer.rate) == Floor(0.0, 110, THIN_Z)
    feed(pacer, 1.0, lambda d, t: 0.05, t0=t, seed=1, part=2)
    assert pacer.decreases == 0


def test_a_probe_at_a_thin_links_rate_proves_it_a_little_short_of_its_phase() -> None:
    """At 10 Mbit/s a phase lasts PHASE_BYTES at its rate, and a sender a little behind its rate (waiting for data
    now and then) holds 97-109 KB of its 115 in the lab: asked for all of it, probe after probe raised nothing,
    and btl took seconds back up after a cut. PHASE_FILL of it proves the probe's rate."""
    pacer = Pacer(max_rate=2e6)
    pacer.btl = 1.0e6
    pacer.rate = 0.98 * pacer.btl
    # two-datagram parts (the driver's at this rate), a 15 ms wait for data after every 40 (96 KB)
    feed(pacer, 6.0, lambda d, t: 0.0, t0=1.0, part=2, burst=40, gap=0.015, queue_of=lambda d, t: 0.0)
    assert pacer.decreases == 0
    assert pacer.increases >= 2 and pacer.btl is not None and pacer.btl >= 1.05e6, (pacer.increases, pacer.btl)


def test_a_probe_in_a_long_phase_is_judged_by_its_queues_growth() -> None:
    """Q_PROBE is what a probe's phase_s of overshoot queues: a probe 6.5 % over the link (btl 0.97 of it) queues
    3.25 ms in a 50 ms phase, clean. At 10 Mbit/s a phase lasts PHASE_BYTES (0.1 s): the same overshoot queues
    twice that by its end, and judged against Q_PROBE alone, probes failed from 0.94 of the link on."""
    pacer = Pacer(max_rate=2e6)
    pacer.btl = 1.0e6
    pacer.rate = 0.98 * pacer.btl

    def queue_of(dest, t: float) -> float:  # only a probe queues, 6.5 % of the time it has run
        for ph in pacer._phases:
            if ph.start <= t and (ph.end is None or t < ph.end):
                return 0.065 * (t - ph.start) if ph.kind == "probe" else 0.0
        return 0.0

    feed(pacer, 3.0, lambda d, t: 0.0, t0=1.0, part=2, queue_of=queue_of)
    assert pacer.decreases == 0
    assert pacer.btl is not None and pacer.btl >= 1.05e6, pacer.btl


def test_loss_that_grows_with_the_rate_is_congestion() -> None:
    """Above 12 MB/s everything beyond it is lost (plus 5 % random loss at every rate): the pacer leaves
    startup near the bottleneck and stays near it, instead of taking the 5 % for its floor and the overrun
    for noise."""
    cap = 12e6

    def loss_of(d, t):
        over = max(0.0, 1.0 - cap / pacer.sent_rate(t - 0.02, t)) if pacer.sent_rate(t - 0.02, t) else 0.0
        return 1.0 - (1.0 - over) * 0.95

    pacer = Pacer()
    feed(pacer, 4.0, loss_of)
    assert pacer.decreases >= 1 and pacer.btl is not None
    assert 0.7 * cap <= pacer.btl <= 1.25 * cap, pacer.btl


def test_loss_with_the_queue_shallow_is_the_links_not_congestion() -> None:
    """A burst of 30 % loss for 0.3 s while the queue stays empty: a queue overflows only once full, so that is
    the link losing datagrams, and the rate stays. Without arrival times the same loss is congestion."""
    def loss_of(d, t):
        return 0.3 if 1.0 <= t < 1.3 else 0.0

    shallow = Pacer(max_rate=50e6)
    feed(shallow, 2.0, loss_of, queue_of=lambda d, t: 0.0005)
    assert shallow.decreases == 0 and shallow.rate == pytest.approx(50e6)
    blind = Pacer(max_rate=50e6)
    feed(blind, 2.0, loss_of)
    assert blind.decreases >= 1


@pytest.mark.parametrize("queue_ms", [1.0, 2.5])
def test_a_bottleneck_with_no_queue_to_speak_of_is_not_taken_for_random_loss(queue_ms: float) -> None:
    """A policer, or a switch with a shallow buffer: the 4 senders' 100 Mbit/s uplinks drop above their rate with
    at most ``queue_ms`` queued, so the queue never reads deep. Loss above the floor at a rate the path never
    carried is that bottleneck, not the link's random loss: startup ends and the rate stays near the link. (Loss
    with a shallow queue excused at every rate, startup ran on to MAX_RATE, 99 % lost: 0.989 / 0.988 here.)"""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.01, seed=1, queue=rate * queue_ms / 1000, driver_parts=True)
    sw.run(3.0)
    excess = sw.excess_loss(0.0, 2.7)
    assert excess <= 0.05, excess  # 0.031 / 0.015 measured, startup's overshoot included
    # 0.73 / 0.93 (seeds 1 and 2 at 1 ms: 0.73 / 0.71; a cut per probe that overflows a 1 ms queue)
    assert sw.utilization(1.0, 2.8, rate) >= (0.65 if queue_ms < 2 else 0.85), sw.utilization(1.0, 2.8, rate)
    assert all(p.btl is not None and p.btl <= 1.3 * rate for p in sw.pacers), [p.btl for p in sw.pacers]


def test_a_shallow_bottleneck_that_halves_is_not_overrun_for_good() -> None:
    """Cross traffic halves what a 2.5 ms-queue bottleneck leaves this swarm: the loss at the old rate is the
    link's only while a recent phase still delivered that rate (CARRIED_PHASES), so the pacers cut within a second
    and then lose next to nothing. (Excused while any of the last 32 clean phases had delivered it, 13-16 % was
    lost from 1 to 2.7 s after the change; the first second after it loses 22 % either way.)"""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.01, seed=1, queue=rate * 0.0025, driver_parts=True)
    sw.changes = [(1.5, rate / 2)]
    sw.run(4.5)
    excess = sw.excess_loss(2.5, 4.2)
    assert excess <= 0.03, excess  # 0.007 / 0.009 measured (seeds 1 and 2)
    assert sw.utilization(2.5, 4.3, rate / 2) >= 0.9, sw.utilization(2.5, 4.3, rate / 2)  # 0.95


def test_a_link_thinner_than_the_start_rate_is_not_overrun_for_good() -> None:
    """10 Mbit/s uplinks with 20 ms of queue, under START_RATE (16 Mbit/s): the queue fills in the first phase.
    The first REPORT comes after two datagrams, so its arrival time gives the path's base delay before the queue
    filled and the full queue reads as one; startup ends and the rate settles at the link. (With the first
    REPORT after 32 datagrams the base was the full queue: btl 1.03-1.22x the link, 18-24 % lost for good.)"""
    rate = 10 * MBIT
    sw = Swarm(4, rate, 0.01, seed=1, queue=rate * 0.02, driver_parts=True)
    sw.run(4.0)
    excess = sw.excess_loss(1.0, 3.7)
    assert excess <= 0.02, excess  # 0.007 measured (seeds 1 and 2)
    assert sw.utilization(1.0, 3.8, rate) >= 0.9, sw.utilization(1.0, 3.8, rate)  # 0.96
    assert all(p.btl is not None and p.btl <= 1.1 * rate for p in sw.pacers), [p.btl / rate for p in sw.pacers]


def test_a_queue_that_builds_slows_the_sender_before_anything_is_lost() -> None:
    """Above 12 MB/s the bottleneck's queue fills (its delay grows by what the sender sends beyond the rate) but
    nothing is lost yet: the pacer leaves startup and settles near the rate on the queue alone. By loss alone it
    would run on to its maximum."""
    cap = 12e6
    queue = {"q": 0.0, "t": 0.0}

    def queue_of(d, t):
        dt, queue["t"] = max(0.0, t - queue["t"]), max(t, queue["t"])
        sent = pacer.sent_rate(t - 0.02, t)
        queue["q"] = min(0.2, max(0.0, queue["q"] + dt * (sent - cap) / cap))
        return queue["q"]

    pacer = Pacer(max_rate=50e6)
    feed(pacer, 4.0, lambda d, t: 0.0, queue_of=queue_of)
    assert pacer.decreases >= 1 and pacer.btl is not None
    assert 0.7 * cap <= pacer.btl <= 1.15 * cap, pacer.btl
    # (a probe a phase in six at 1.1 btl: 1.06 measured) and the queue does not run away (6 ms measured)
    assert pacer.sent_rate(3.0, 4.0) <= 1.1 * cap, pacer.sent_rate(3.0, 4.0)
    assert queue["q"] <= 0.02, queue


def test_send_positions_place_a_bursts_datagrams_at_the_bottlenecks_rate() -> None:
    pos = SendPositions()
    pos.note(10, 1.0, 0.001)  # positions 0-9 sent at 1.0 as one burst, 1 ms each through the bottleneck
    pos.note(20, 2.0)  # 10-19 at 2.0, not placed (startup: the rate is not known)
    assert pos.time_of(0) == pytest.approx(1.0) and pos.time_of(9) == pytest.approx(1.009)
    assert pos.placed(9) == pytest.approx(0.009) and pos.placed(15) == 0.0
    assert pos.span(5, 15) == pytest.approx((1.005, 2.0))
    assert pos.time_of(20) is None
    pos.settle(20, 2.5)  # the last batch went out late
    assert pos.time_of(15) == pytest.approx(2.5)
    pos.settle(10, 9.0)  # (only the last batch can be re-timed)
    assert pos.time_of(5) == pytest.approx(1.005)
    pacer = Pacer()
    assert pacer.spacing(1200) == 0.0  # startup
    pacer.btl = 12e6
    assert pacer.spacing(1200) == pytest.approx(1e-4)


def test_the_delivery_meter_passes_the_arrival_time_on() -> None:
    meter = DeliveryMeter(0.0, 0)
    rep = meter.sample(FIRST_REPORT + 2, FIRST_REPORT + 2, 1000, 0.001, 0.02, 0, 0.03, 1700000000.5)
    assert rep is not None and rep.arrived == 1700000000.5
    rep = meter.final(FIRST_REPORT + 10, FIRST_REPORT + 8, 2000, 0.001, 0.05, 0, 0.06)
    assert rep is not None and rep.arrived == 0.0
    assert meter.sample(500, 500, 9000, 0.0, 0.1, 0, 1.0, math.nan).arrived == 0.0


def test_kernel_drops_are_congestion() -> None:
    """A receiver whose socket overflows (kernel drops) is a bottleneck even with no loss beyond the floor."""
    pacer = Pacer(max_rate=50e6)
    end = feed(pacer, 1.0, lambda d, t: 0.0)
    assert pacer.decreases == 0 and pacer.rate == pytest.approx(50e6)
    feed(pacer, 0.5, lambda d, t: 0.0, t0=end, drops_of=lambda d, t: 200)
    assert pacer.decreases >= 1 and pacer.rate < 50e6


def test_one_destination_congested_alone_gets_its_own_cap() -> None:
    """The uplink is clean to a and c, but b's path loses 30 % above 4 MB/s of b's share (its downlink): b gets
    a cap near what its path delivers, a and c are not capped, and the uplink rate is not cut for b: the queue
    toward a and c stayed shallow, so the uplink did not overflow."""
    def loss_of(d, t):
        if d != "b":
            return 0.0
        share = pacer.sent_rate(t - 0.05, t, "b")
        return 0.3 if share > 4e6 else 0.0

    pacer = Pacer(max_rate=30e6)
    end = feed(pacer, 2.0, loss_of, queue_of=lambda d, t: 0.010 if d == "b" else 0.0)
    cap = pacer.cap("b")
    assert cap is not None and cap < 10e6, cap
    assert pacer.cap("a") is None and pacer.cap("c") is None
    assert pacer.btl is None or pacer.btl >= 20e6
    # a capped destination waits for its own bucket; the others only for the uplink's (right away: after an
    # idle gap the cap relaxes with its age, test_memory_between_averages_ages)
    t = end + 0.01
    waits_b = [pacer.reserve(PART * DATAGRAM, "b", t) for _ in range(20)]
    assert waits_b[-1] >= 19 * PART * DATAGRAM / cap * 0.9


def test_eight_senders_on_loaded_cores_do_not_overrun_their_uplinks() -> None:
    """8 nodes, each sender descheduled 25 ms in every 40 (daemons sharing 2 cores), averages of 7 MB with 0.3 s
    between them. Destinations go in turn, so a full uplink queue drops into whichever destination's part is
    crossing it: a different one each phase. Excused as that destination's own path at its first phase, the
    overruns never counted against the uplink: btl rose to 1.7x the link and 3.5 % was lost beyond the random
    loss (3.7-4.6 % in the lab's 8-peer bench). Counted, 0.19 % (seed 1)."""
    rate = 100 * MBIT
    sw = Swarm(8, rate, 0.0, seed=1, volume=7e6, idle=0.3, send_stall=(0.04, 0.025))
    sw.run(6.0)
    excess = sw.excess_loss(1.0, 5.7)
    assert excess <= 0.01, excess
    assert sw.excess_loss(0.0, 5.7) <= 0.025  # with startup


def test_clean_probes_in_a_row_start_startup_again() -> None:
    """Startup that ended far under the path (a sender stalled 9 ms on loopback read as a queue growing
    0.32 s/s at 2.6 MB/s): probes of at most 10 % a 0.3 s cycle would take seconds back to the link; after
    RESTART_PROBES clean probes in a row startup runs again from btl and doubles on clean phases."""
    pacer = Pacer(max_rate=200e6)
    feed(pacer, 0.3, lambda d, t: 0.0, queue_of=lambda d, t: 0.0)
    pacer.btl = 2e6  # as the false queue left it
    pacer.rate = 0.98 * pacer.btl
    feed(pacer, 4.0, lambda d, t: 0.0, t0=1.0, queue_of=lambda d, t: 0.0)
    assert pacer.decreases == 0
    # (probes alone: at most 1.02 * 1.04 * 1.08**3 * 1.1**8, 2.8x in 4 s)
    assert pacer.rate >= 50e6, pacer.rate


def test_a_probe_raises_btl_no_higher_than_it_sent() -> None:
    """A sender held under its rate (a loaded CPU: a pause after every part) proves only what it sends: btl
    ends within a few percent of that, with no restart of startup, where probes of 2-10 % a cycle took it past
    the link in the lab (4 daemons on 2 cores: probes that sent 11.7 MB/s raised btl to 12.3, the link carrying
    12.1, and the cruise at 0.98 of it queued until a cut)."""
    pacer = Pacer(max_rate=200e6)
    feed(pacer, 0.3, lambda d, t: 0.0, queue_of=lambda d, t: 0.0)
    pacer.btl = 8e6
    pacer.rate = 0.98 * pacer.btl
    most = 9e6  # what the sender manages: a part, then a pause
    feed(pacer, 4.0, lambda d, t: 0.0, t0=1.0, queue_of=lambda d, t: 0.0, burst=1, gap=PART * DATAGRAM / most)
    assert pacer.decreases == 0
    assert pacer.btl is not None and 0.97 * most <= pacer.btl <= 1.05 * most, pacer.btl


def test_a_standing_queue_does_not_cut_a_sender_held_under_its_rate() -> None:
    """A sender its CPU holds at about 0.7 of its rate meets a queue that stands at 8 ms without growing (other
    senders' traffic, its own catch-up bursts): not its uplink filling, so no cut. The same queue growing still
    cuts (test_a_queue_that_builds_slows_the_sender_before_anything_is_lost, the virtual-time swarms)."""
    pacer = Pacer(max_rate=200e6)
    feed(pacer, 0.3, lambda d, t: 0.0, queue_of=lambda d, t: 0.0)
    pacer.btl = 10e6
    pacer.rate = 0.98 * pacer.btl
    most = 6.5e6
    feed(pacer, 3.0, lambda d, t: 0.0, t0=1.0, queue_of=lambda d, t: 0.008, burst=1, gap=PART * DATAGRAM / most)
    assert pacer.decreases == 0 and pacer.btl >= 0.95 * 10e6, (pacer.decreases, pacer.btl)


def test_a_queue_that_drains_does_not_cut() -> None:
    """A deep queue that shrinks while the sender sends (others' traffic that met it at a downlink, leaving) is
    not its uplink's overrun: no cut. The same queue growing cuts."""
    def run(direction: float) -> Pacer:
        pacer = Pacer(max_rate=200e6)
        pacer.btl = 10e6
        pacer.rate = 0.98 * pacer.btl
        # no queue for 0.3 s (the path's base delay), then 60 ms of it, moving 0.05 s/s
        feed(pacer, 1.3, lambda d, t: 0.0,
             queue_of=lambda d, t: 0.0 if t < 0.3 else 0.06 + direction * 0.05 * (t - 0.3))
        return pacer

    draining, growing = run(-1.0), run(1.0)
    assert draining.decreases == 0 and draining.btl is not None and draining.btl >= 10e6, draining.btl
    assert growing.decreases >= 1


def test_startup_resumes_at_the_rate_it_proved() -> None:
    """An average that ended right after startup doubled its rate (no clean phase at the new one): the next one
    starts at the rate two clean phases were judged at, not the doubled one nothing has carried yet."""
    pacer = Pacer(max_rate=100e6)
    end = feed(pacer, 0.6, lambda d, t: 0.0)
    assert pacer.btl is None and pacer.increases >= 2
    pacer.reserve(1200, "a", end + 1.0)  # the next average, a second later (its last phases judged first)
    proven = pacer._proven
    assert pacer.resumes == 1 and START_RATE < pacer.rate <= proven < 100e6, (pacer.rate, proven)


def _time_to_reach(rate: float, queue_of, gap: float = 0.0) -> tuple[float, float]:
    """A startup from START_RATE with nothing lost: (when the rate first reached ``rate``, or inf; the highest)."""
    pacer = Pacer(max_rate=100e6)
    t, reached = 0.0, math.inf
    while t < 1.5 and reached == math.inf:
        t = feed(pacer, 0.05, lambda d, t: 0.0, t0=t, queue_of=queue_of, burst=1 if gap else 0, gap=gap)
        if pacer.rate >= rate:
            reached = t
    return reached, pacer.rate


def test_startup_doubles_after_one_phase_that_left_the_queue_empty() -> None:
    """Two clean phases at a rate double it, as a queue may hide the first one's overshoot; where arrival times
    show the queue empty at a phase's end, that one phase proved the rate (lab: 1 Gbit/s ... 16 Mbit/s in 0.45 s)."""
    empty, _ = _time_to_reach(16e6, lambda d, t: 0.0)
    blind, _ = _time_to_reach(16e6, None)  # REPORTs without arrival times: two phases a rate, as before
    # 0.62 s against 0.75 (64 KB parts): the first phase holds only each path's first sample, which sets its base
    # and so reads an empty queue whatever it holds: it proves nothing (Judgement._seen_empty)
    assert empty < 0.85 * blind, (empty, blind)


def test_startup_above_a_fast_rate_runs_shorter_phases(monkeypatch) -> None:
    """Above FAST_STARTUP_RATE a startup phase and its least judging lag shrink with the rate: each doubling costs a
    phase and its lag, and at such rates a phase holds megabytes (loopback, 4 daemons: 64 MB/s to 1 GB/s in 0.24-0.26 s
    against 105 ms a doubling before). Paths at or under it (every thin link the tests model) keep the full PHASE_S."""
    assert Pacer._span(pacing.FAST_STARTUP_RATE, pacing.PHASE_S, "startup") == pacing.PHASE_S
    assert Pacer._span(4 * pacing.FAST_STARTUP_RATE, pacing.PHASE_S, "startup") == pytest.approx(pacing.PHASE_S / 4)
    assert Pacer._span(1e12, pacing.PHASE_S, "startup") == pytest.approx(pacing.FAST_STARTUP_MIN * pacing.PHASE_S)
    assert Pacer._span(1e12, pacing.PHASE_S, "cruise") == pacing.PHASE_S  # (only startup)

    start = pacing.FAST_STARTUP_RATE

    def climb() -> float:
        pacer = Pacer(rate=start, max_rate=2e9)
        t = 0.0
        while t < 2.0 and pacer.rate < 1e9:
            t = feed(pacer, 0.025, lambda d, t: 0.0, t0=t, queue_of=lambda d, t: 0.0)
        assert pacer.decreases == 0 and pacer.btl is None
        return t

    fast = climb()
    monkeypatch.setattr(pacing, "FAST_STARTUP_RATE", math.inf)
    full = climb()
    assert fast < 0.8 * full, (fast, full)  # 0.35 s against 0.51 (REPORTs every 25 ms bound it)


def test_big_datagrams_start_at_the_same_datagram_rate() -> None:
    """The first average starts at START_RATE's datagrams a second (start_rate): at START_RATE in 8 KB datagrams a
    phase held too few to be judged, and startup took about 0.4 s a doubling there."""
    assert pacing.start_rate(1200) == pacing.start_rate(576) == START_RATE == Pacer().rate
    assert pacing.start_rate(8192) == pytest.approx(START_RATE * 8192 / 1200)
    assert Pacer(datagram=8192).rate == pacing.start_rate(8192)

    def climb(pacer: Pacer) -> float:
        feed(pacer, 0.6, lambda d, t: 0.0, queue_of=lambda d, t: 0.0, datagram=8192)
        return pacer.rate

    scaled, fixed = climb(Pacer(datagram=8192)), climb(Pacer(rate=START_RATE, datagram=8192))
    assert scaled > 4 * fixed, (scaled, fixed)


def test_startup_does_not_double_a_rate_the_sender_did_not_send() -> None:
    """A sender that sends under its rate (its CPU, or a socket the link pushes back on) proved what it sent, not
    the rate: doubling on it took the lab's senders from 16 MB/s (sending 12) to 32, 2.6x their link. Where the
    queue stays empty it is the sender alone: its rate goes to twice what it sent (4 daemons on loopback stayed
    at 256 MB/s, under what their bursts could send)."""
    part_s = PART * DATAGRAM / START_RATE
    # a sender that waits 1.4 parts' time for data before each part sends 0.72 of START_RATE (half of 4 MB/s):
    # with a queue building up to 20 ms (a socket the link pushes back on) it never goes up
    reached, top = _time_to_reach(4e6, lambda d, t: min(0.02, 0.05 * t), gap=1.4 * part_s)
    assert reached == math.inf and top <= START_RATE, (reached, top)
    # with the queue empty only the sender held it: the rate goes to twice the most a phase sent (a phase of a
    # part or two reads up to 0.8 of START_RATE), no further
    reached, top = _time_to_reach(4e6, lambda d, t: 0.0, gap=1.4 * part_s)
    assert reached == math.inf and START_RATE < top <= 2 * 0.85 * START_RATE, (reached, top)
    assert _time_to_reach(4e6, lambda d, t: 0.0, gap=0.9 * part_s)[0] < 0.5  # a wait the bucket hides: it does


def test_a_sender_its_cpu_holds_at_a_high_rate_goes_up_after_one_full_phase(monkeypatch) -> None:
    """A phase that sent megabytes (dozens of parts) under its rate with the queue empty measured the sender's CPU,
    not a part's timing: one such phase takes the rate to twice its fill (4 daemons on loopback: 128 to 500 MB/s in
    0.3-0.5 s, against 0.6-1.1 s when it took two), never past that."""

    def climb() -> tuple[float, float]:
        pacer = Pacer(rate=128e6, max_rate=1e9)
        cpu = PART * DATAGRAM / 100e6  # the sender's CPU sends at most 100 MB/s
        t = 0.0
        while t < 1.0 and pacer.rate < 150e6:
            t = feed(pacer, 0.025, lambda d, t: 0.0, t0=t, queue_of=lambda d, t: 0.0, burst=1, gap=cpu)
        return t, pacer.rate

    # (startup's phases at full length: with the shorter ones above FAST_STARTUP_RATE both cases end within one
    # REPORT interval of this driver)
    monkeypatch.setattr(pacing, "FAST_STARTUP_RATE", math.inf)
    one, top = climb()
    assert one < 0.13 and 150e6 <= top <= 2 * 100e6 * 1.02, (one, top)
    monkeypatch.setattr(pacing_judge, "CPU_HELD_BYTES", 1 << 40)  # two phases, as for a phase of a part or two
    two, _ = climb()
    assert two > one + 0.04, (one, two)


def test_several_reports_of_one_congested_phase_cut_once() -> None:
    """Three receivers report the same overrun: the REPORTs pool into their phase, judged once."""
    pacer = Pacer(rate=8e6)
    t = 0.0
    while t < 0.2:  # clean phases at 8 MB/s first (the floor), then 16 MB/s that loses 40 %
        for d in "abc":
            t += pacer.reserve(PART * DATAGRAM, d, t)
    rate0 = pacer.rate
    end = feed(pacer, 0.6, lambda d, t: 0.0, t0=t)
    assert pacer.rate > rate0  # startup went on
    decreases = pacer.decreases
    feed(pacer, 0.12, lambda d, t: 0.4, t0=end)
    assert pacer.decreases == decreases + 1


def test_converges_after_the_link_rate_changes() -> None:
    """The links drop from 100 to 50 Mbit/s at 2.5 s and come back at 5 s: the pacer follows both ways, down
    at once (a deep queue sets btl to what the link carried), up by probes (+2 %, +4 %, +8 %, then +10 % a cycle
    of 0.3 s): at half the rate 0.93-0.96 full, and 0.92-0.96 of the full rate in 8-8.9 s (seeds 1-3; the loss-only
    pacer: 0.90, and 0.82-0.87 after 8 s). Seeds 1-3: where the probes restart startup (after 5 s) is chance, and the
    loss after 6 s is mostly that startup's overshoot (0.017-0.023 a seed)."""
    rate = 100 * MBIT
    late_loss = []
    for seed in (1, 2, 3):
        sw = Swarm(4, rate, 0.01, seed=seed)
        sw.changes = [(2.5, rate / 2), (5.0, rate)]
        sw.run(9.0)
        assert sw.utilization(3.0, 5.0, rate / 2) >= 0.9
        assert sw.excess_loss(3.0, 4.9) <= 0.025
        assert sw.utilization(8.0, 8.9, rate) >= 0.8
        late_loss.append(sw.excess_loss(6.0, 8.7))
    assert max(late_loss) <= 0.025 and sum(late_loss) / 3 <= 0.02, late_loss


def test_the_same_inputs_give_the_same_run() -> None:
    a, b = Swarm(3, 50 * MBIT, 0.05, seed=7), Swarm(3, 50 * MBIT, 0.05, seed=7)
    a.run(1.5)
    b.run(1.5)
    assert [v for _, v in a.verdicts[0]] == [v for _, v in b.verdicts[0]] and a.up[0].bins == b.up[0].bins


# ---- late REPORTs, stalled receivers, and memory between averages (issue 16) --------------------------------


def test_late_jittery_reports_still_catch_the_overflow() -> None:
    """REPORTs 50 ms late plus an exponential jitter of 100 ms more (the lab's loaded event loops: ~60 % came
    after a fixed 50 ms judging lag), 5 % random loss. The judging lag follows the measured REPORT delay, a
    phase is judged once every destination has reported past it (in order: a gap waits), a clear overflow is
    judged at once, and no probe goes out before the last one was heard of. Measured (seeds 1-2): uplinks
    0.87-0.90 full, excess loss 0.018-0.019, 3-7 % of REPORTs stale. The fixed lag: excess 0.037-0.091 (the
    overflow's REPORTs mostly came too late to count), 85 % stale."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.05, seed=1, report_delay=0.05, report_jitter=0.1)
    sw.run(5.0)
    util, excess = sw.utilization(1.0, 4.8, rate), sw.excess_loss(1.0, 4.7)
    stale = sum(v.action == "stale" for _, v in sw.verdicts[0]) / len(sw.verdicts[0])
    assert util >= 0.82 and excess <= 0.025 and stale <= 0.2, (util, excess, stale)
    assert all(0.15 <= p.judge_lag() <= 1.0 for p in sw.pacers), [p.judge_lag() for p in sw.pacers]


def test_cpu_stalled_receivers_with_room_do_not_slow_the_sender() -> None:
    """Each receiver's CPU stops 60 ms in every 200 ms (descheduled on 2 loaded cores): its REPORTs wait, its
    socket buffer (4000 datagrams) absorbs what arrives meanwhile. Nothing is lost to it: the links stay full
    (measured 0.92-0.95, excess 0.009-0.011)."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.01, seed=1, stall=(0.2, 0.06), rx_capacity=40_000, rx_buffer=4000, report_delay=0.01,
               report_jitter=0.02)
    sw.run(5.0)
    util, excess = sw.utilization(1.0, 4.8, rate), sw.excess_loss(1.0, 4.7)
    assert sw.kernel_drops == [0] * 4
    assert util >= 0.88 and excess <= 0.015, (util, excess)


def test_receivers_overflowing_while_stalled_slow_the_sender() -> None:
    """The same stalls with a 300-datagram socket buffer (29 ms of the link): the buffers overflow while their
    receiver is stalled. That is congestion (kernel drops in REPORTs), not random loss: the senders slow down
    (measured: btl 1-11 MB/s, 0.4 of the link on average) and keep what receivers' kernels drop small."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.0, seed=1, stall=(0.2, 0.06), rx_capacity=40_000, rx_buffer=300, report_delay=0.01,
               report_jitter=0.02)
    sw.run(5.0)
    sent = sum(sw.sent_bins.values())
    btls = [p.btl for p in sw.pacers]
    assert all(b is not None for b in btls) and sum(btls) / len(btls) < 0.7 * rate, btls
    assert sum(sw.kernel_drops) / sent <= 0.04, (sw.kernel_drops, sent)


def test_an_average_starts_where_the_last_one_left_off() -> None:
    """Averages of 4 MB per sender with 1 s idle between them (a bench's repeats): the first starts at
    START_RATE and pays for startup, the next ones start at what the path carried (the remembered btl, a
    cruise phase), so they take close to the link's time for 4 MB."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.01, seed=3, volume=4e6, idle=1.0)
    sw.run(7.0)
    for i, avgs in enumerate(sw.averages):
        assert len(avgs) >= 3, avgs
        first, later = avgs[0][1] - avgs[0][0], [b - a for a, b in avgs[1:]]
        assert max(later) < 0.75 * first, (first, later)
        assert max(later) <= 1.7 * 4e6 / rate, later  # (0.96-1.54x the link time measured, seed 3; first 1.96-2.11x)
        assert sw.pacers[i].resumes >= 2


def test_memory_between_averages_ages() -> None:
    """What a sender learnt decays with the time it has been idle: a minute later the rate it starts at is
    half-way back to START_RATE, ten minutes later it is START_RATE; a destination's cap relaxes as much."""
    cap = 12e6

    def loss_of(d, t):
        over = max(0.0, 1.0 - cap / pacer.sent_rate(t - 0.02, t)) if pacer.sent_rate(t - 0.02, t) else 0.0
        return over

    pacer = Pacer()
    end = feed(pacer, 4.0, loss_of) + 1.0
    pacer.reserve(1200, "a", end)  # a new average a second later (the last phases are judged first)
    btl = pacer.btl
    assert pacer.resumes == 1 and btl is not None and 0.6 * cap <= btl <= 1.25 * cap, btl
    pacer.reserve(1200, "a", end + 60.0)  # and one a minute after that
    assert pacer.resumes == 2
    half = START_RATE + (btl - START_RATE) / 2
    assert pacer.btl == pytest.approx(half, rel=1e-6)
    assert pacer.rate == pytest.approx(CYCLE[-1] * half, rel=1e-6)  # it starts with a cruise phase, not a probe
    pacer.reserve(1200, "a", end + 660.0)  # ten minutes more: all but forgotten
    assert pacer.btl == pytest.approx(START_RATE, rel=0.01)

    def path_loss(d, t):  # b's own path loses 30 % above 4 MB/s of b's share: b gets a cap
        return 0.3 if d == "b" and capped.sent_rate(t - 0.05, t, "b") > 4e6 else 0.0

    capped = Pacer(max_rate=30e6)
    # (queues stay empty: b's loss is its own path's from its first phase, not the uplink's)
    end = feed(capped, 2.0, path_loss, queue_of=lambda d, t: 0.0) + 1.0
    capped.reserve(1200, "a", end - 0.5)
    capped.reserve(1200, "a", end)  # (the last phases judged: a clean one loosens the cap 1.25-fold)
    cap_b = capped.cap("b")
    assert cap_b is not None and cap_b < 10e6
    capped.reserve(1200, "a", end + 30.0)  # half a minute later the cap is sqrt(2) looser
    assert capped.cap("b") is None or capped.cap("b") == pytest.approx(2 ** 0.5 * cap_b, rel=1e-6)
    capped.reserve(1200, "a", end + 300.0)  # and gone once it no longer binds
    assert capped.cap("b") is None


def test_a_bursty_sender_is_judged_by_its_bursts() -> None:
    """A sender that waits for data and then sends what it has (the all-gather waits for the reduce-scatter):
    a phase's send rate is measured up to its last send, so a burst that opens a phase counts at the rate it
    went out at and clean phases raise the rate (measured over the whole phase, the pauses made it look
    application-limited: on loopback the rate stayed at 32 MB/s). A rule that also counted bytes the bucket
    held back as binding was tried and dropped: in the lab its bursts overran the tbf queues
    (tests/test_pacer_lab.py failed 3 of 16 runs, a phase ended by deadline; 0 of 7 without)."""
    pacer = Pacer(max_rate=200e6)
    feed(pacer, 4.0, lambda d, t: 0.0, burst=12, gap=0.1)
    assert pacer.decreases == 0
    assert pacer.rate >= 100e6, pacer.rate


def test_a_standing_queue_that_does_not_drain_after_a_cut_is_an_offset_not_congestion() -> None:
    """One early sample read low (a receive timestamp taken before a descheduling, clock noise on loaded cores):
    every later sample reads about 9.5 ms queued, at any rate. A real queue drains once the rate is cut under
    the link; this one stays as it was, so after at most one cut the pacer takes it for the base's offset, not
    its uplink filling, and does not ratchet its rate down cut after cut (the bench: 8.4 -> 1.7 MB/s on a
    12 MB/s link over six averages)."""
    pacer = Pacer(max_rate=200e6)
    feed(pacer, 0.3, lambda d, t: 0.0, queue_of=lambda d, t: 0.0)
    pacer.btl = 10e6
    pacer.rate = 0.98 * pacer.btl
    feed(pacer, 4.0, lambda d, t: 0.0, t0=0.3, queue_of=lambda d, t: 0.0095)
    # (no link in this model: past the offset, clean probes in a row take the pacer back to startup, btl unknown)
    assert pacer.decreases <= 1 and pacer.rate >= 0.8 * 10e6, (pacer.decreases, pacer.rate, pacer.btl)


def test_an_offset_that_hovers_at_the_queue_threshold_is_still_an_offset() -> None:
    """The same offset reading about Q_HIGH (6 ms), a little over it in two phases of three and a little under in
    the third, as samples on loaded cores scatter (the GPT demo without loss: one daemon's rate went 10.9 -> 5.6
    MB/s in five cuts at "queue 6.1 ms, growing 0.00 s/s", then to 1.9 MB/s, and every round waited for it). A
    phase just under the threshold is no drain: the queue stood as deep as at the cut, so the pacer still takes
    it for the base's offset after at most one cut."""
    pacer = Pacer(max_rate=200e6)
    feed(pacer, 0.3, lambda d, t: 0.0, queue_of=lambda d, t: 0.0)
    pacer.btl = 10e6
    pacer.rate = 0.98 * pacer.btl
    feed(pacer, 4.0, lambda d, t: 0.0, t0=0.3,
         queue_of=lambda d, t: Q_HIGH - 0.0002 if int(t / PHASE_S) % 3 == 0 else Q_HIGH + 0.0002)
    assert pacer.decreases <= 1 and pacer.rate >= 0.8 * 10e6, (pacer.decreases, pacer.rate, pacer.btl)


@pytest.mark.parametrize("seed", [1, 2])
def test_one_receiver_reading_its_arrivals_late_cuts_nobody_under_random_loss(seed: int) -> None:
    """The GPT demo's shape: 4 nodes on 100 Mbit/s links losing 5 % at random (10 % in a patch of 0.1 s every
    0.5 s), averaging in rounds (0.6 MB per sender, then 0.13 s of compute), and one receiver whose arrival times
    read 10 ms late on average (a daemon on a loaded machine). That one receiver's deep-looking queue must not
    make the others' lossy patches read as congestion: excused only where every destination's queue read under
    Q_HIGH, two of the senders were cut to 66-75 % of the link here (seeds 1 and 2), and in the lab, cut after
    cut, to 1-3 MB/s for seconds while every average waited for them. Now nobody is cut (every rate >= 85 % of
    the link from 2 s on), and nothing overflows for it: the loss beyond the random loss stays about 1 %, the
    patches' own share."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.05, seed=seed, volume=0.6e6, idle=0.13, driver_parts=True, late_reader=(3, 0.010),
               patches=(0.5, 0.1, 0.05))
    sw.run(8.0)
    lowest = [min((r for t, r in sw.rates[i] if t >= 2.0), default=0.0) for i in range(sw.n)]
    assert min(lowest) >= 0.8 * rate, [round(x / MBIT, 1) for x in lowest]
    assert sw.excess_loss(2.0, 7.8) <= 0.015


def test_sporadic_short_averages_keep_the_rate_the_path_carries() -> None:
    """Short averages seconds apart (DiLoCo's outer steps: ~1 MB per sender every few seconds, too short for a
    probe cycle): each starts from what the last one carried. The memory's aging must not compound from one
    average to the next, each re-confirming only the aged rate, until the rate sinks toward START_RATE."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.05, seed=5, volume=1.2e6, idle=4.0)
    for p in sw.pacers:  # (in its cycle, near the link: what the first averages of a run leave)
        p.btl = p.rate = 0.95 * rate
    sw.run(60.0)
    for i, avgs in enumerate(sw.averages):
        assert len(avgs) >= 12, avgs
        took = [(b - a) / (1.2e6 / rate) for a, b in avgs]
        assert max(took[len(took) // 2:]) <= 1.2, took  # (aging compounded: 1.0x the link's time, then 1.68x)
        btl = sw.pacers[i].btl
        assert btl is not None and btl >= 0.85 * rate, btl  # (compounded: 0.58x the link after 15 averages)


def test_averages_shorter_than_a_cycle_still_take_their_turn_at_a_probe() -> None:
    """Each short average starts from a cruise phase, but the probe cycle goes on where the last one left it: a
    btl under the link rises over sporadic averages (each only 4 phases long, a cycle being 6), where restarting
    the cycle at every average never reached a probe (one raise per sender in 15 averages, btl stuck)."""
    rate = 100 * MBIT
    sw = Swarm(4, rate, 0.05, seed=5, volume=1.2e6, idle=4.0)
    for p in sw.pacers:
        p.btl = p.rate = 0.65 * rate
    sw.run(60.0)
    assert sum(p.increases for p in sw.pacers) >= 10, [p.increases for p in sw.pacers]


@pytest.mark.parametrize(("mbit", "loss", "most_lost"), [(10, 0.0, 0.12), (10, 0.05, 0.12), (8, 0.0, 0.3)])
def test_a_thin_links_first_average_leaves_startup_at_its_second_phase(mbit: int, loss: float,
                                                                        most_lost: float) -> None:
    """A link under START_RATE reports once or twice a phase per destination: the first phase holds only each path's
    first sample (its base: it reads 0 whatever the queue), so it proves no empty queue and the rate is not doubled
    on it; the second sees the queue that rose from empty and ends startup at what the link carried (its own share
    of a growth measured from the first phase). Beyond the random loss, 0.08-0.09 of the first second's datagrams
    are lost at 10 Mbit/s and 0.20 at 8 (0.28-0.30 and 0.42 where the first phase passed for empty and the rate
    doubled into a 70 % loss), and the links carry 0.90-0.97 of their rate over the first 2.3 s."""
    rate = mbit * MBIT
    sw = Swarm(4, rate, loss, seed=1, queue=rate * 0.02, driver_parts=True)
    sw.run(2.5)
    assert all(v.rate <= START_RATE for p in sw.verdicts for _, v in p), "startup doubled above the link"
    assert sw.excess_loss(0.0, 1.0) <= most_lost, sw.excess_loss(0.0, 1.0)
    assert sw.utilization(0.0, 2.3, rate) >= 0.87, sw.utilization(0.0, 2.3, rate)


def test_a_cut_far_under_what_the_path_carried_is_won_back_by_recovery_probes() -> None:
    """The links drop to 0.4 of 100 Mbit/s for 0.4 s and come back: the pacers cut far under what their paths carried
    just before, and the history still holds those phases, so their probes go at RECOVER_PROBE and a clean one raises
    btl to what it sent (up to RECOVER_TO of that rate) instead of 2-10 % a cycle: the uplinks carry 0.87-0.92 of the
    link 1.6-3.4 s after it came back (0.71-0.73 with the cycle's probes alone), for 0.013-0.029 lost beyond the
    random loss."""
    rate = 100 * MBIT
    for seed in (1, 2):
        sw = Swarm(4, rate, 0.01, seed=seed)
        sw.changes = [(2.0, rate * 0.4), (2.4, rate)]
        sw.run(6.0)
        assert sw.utilization(4.0, 5.8, rate) >= 0.85, sw.utilization(4.0, 5.8, rate)
        assert sw.excess_loss(2.5, 5.7) <= 0.035, sw.excess_loss(2.5, 5.7)
        assert any("recovery probe" in v.reason for p in sw.verdicts for _, v in p)


def test_a_recovery_probe_that_overruns_the_path_ends_the_recovery() -> None:
    """A path that did drop (to half, and stays there): the cut leaves btl far under what the history says the path
    carried, so the pacers probe at RECOVER_PROBE; the first such probe overruns the halved link, and the phases
    before it stop counting (``_recover_after``): by 2.4 s after the drop no pacer is recovering, and each one's btl is
    within 0.92-1.08 of the new rate (seeds 1 and 2)."""
    rate = 100 * MBIT
    for seed in (1, 2):
        sw = Swarm(4, rate, 0.01, seed=seed)
        sw.changes = [(2.5, rate / 2)]
        sw.run(4.9)
        assert any("recovery probe" in v.reason for p in sw.verdicts for _, v in p)
        assert all(p._recover_after > 2.5 and not p.recovering() for p in sw.pacers), [
            p._recover_after for p in sw.pacers]
        assert all(0.85 * rate / 2 <= p.btl <= 1.1 * rate / 2 for p in sw.pacers), [p.btl / rate for p in sw.pacers]
