"""Sender pacing and receiver delivery reports (sans-I/O: every call takes ``now``).

Two halves of one feedback loop:

* ``DeliveryMeter`` (receiver side) turns cumulative per-sender counters of a running phase into
  interval reports: over the last ``seconds``, of the data datagrams the sender sent (inferred from the
  highest datagram index that arrived: streams are sent in index order), ``received`` arrived, carrying
  ``nbytes`` bytes. It is sampled from a timer every ~25 ms, so it costs nothing per datagram.
* ``Pacer`` (sender side) is a token bucket for the node's whole uplink (every destination shares it: the
  bottleneck is usually the sender's own uplink) plus, for a destination whose own path congests while the
  uplink does not, a second bucket capping that destination alone.

What the pacer knows: no usable RTT (a tbf bottleneck with no delay), only what receivers' REPORTs say,
25-50 ms late on a quiet machine and hundreds of ms late, out of order or never on a loaded one, and what it
sent when. So it runs in **phases** of ``PHASE_S`` (two REPORT intervals) at one rate each, pools every
REPORT into the phase its datagrams were sent in, and judges a phase once its REPORTs are in: at least
``JUDGE_LAG_S`` after it ends, then as soon as every destination it sent to has reported past its last send
in it without a gap (``_Frontier``), or else once the **judging lag** has passed: the measured REPORT delay
(smoothed mean + ``DELAY_K`` deviations, as TCP's RTO; at most ``MAX_JUDGE_LAG_S``). A later phase whose
REPORTs so far already show an overflow beyond doubt (``EARLY_Z`` sigma) is judged at once, and no probe
goes out while the last one is unjudged: late REPORTs must not leave an overflow running. A phase is judged
by its loss, over all destinations, against the **random-loss floor**, which is the pooled loss of recent
clean phases sent at a clearly lower rate (``FLOOR_RATE``).
That is the first distinction between random loss and congestion: random loss is the same at every rate,
overflow at the bottleneck appears only above its rate. A phase lossier than its floor (beyond its sampling
noise) is congestion; a phase no lossier is clean, whatever its loss. Random loss alone never slows it.

The second is the **queue** (where receivers give arrival times: REPORT's ``arrived``, the kernel's receive
time of the interval's last datagram). Against when this sender sent it, that is the path's one-way delay
plus a constant clock offset; above the least of recent samples (transport.qdelay), time spent in queues.
A phase's uplink queue is the least over its destinations (every destination's datagrams cross the uplink's
queue, only one its own downlink) of the least late sample (a sample may sit a burst late). So:

* loss above the floor with the queue under ``Q_HIGH`` at a rate the path delivered lately is random (a queue
  overflows only once full, and what got through then waited in it): nothing is cut; at a rate it has not
  delivered, it is a bottleneck with no queue to speak of (a policer, a shallow switch buffer), congestion;
* a queue above ``Q_HIGH`` in ``DEEP_PHASES`` judged phases in a row is congestion before any overflow: btl
  goes to what the link carried (the phase's rate / (1 + the queue's growth), less what it lost beyond the
  floor), ``DELAY_MARGIN`` under; unless it is draining (``DRAINING``): the path then carries more than was sent;
* a probe that takes the queue above ``Q_PROBE`` is not clean (no raise; a drain follows), and startup ends on
  a queue that is deep and growing, before it overflows.

A burst (one GSO send) crosses the bottleneck datagram by datagram: SendPositions places each at btl's rate
after the burst's time (a sample deep in a burst never sets the base: the rate may be wrong), and a batch
that went out late (a sender woken late on a loaded CPU) is re-timed to when it went.

The rate follows a bottleneck estimate ``btl`` (bytes/s the uplink carries):

* **Startup** at ``START_RATE`` (low: 16 Mbit/s): two clean phases at the current rate double it (a queue
  absorbs a first phase's overshoot: it looks clean; the second shows it), or one whose queue was seen empty at
  its end (``Q_FLAT``: nothing absorbed). Only a phase that sent at least ``HELD_BACK`` of its rate counts: one
  held back proved what it sent, not the rate. The first congested phase ends it.
  An average that ends in startup leaves the next one the highest rate it proved so (not a doubling that no
  clean phase has carried yet). Above ``FAST_STARTUP_RATE`` (320 Mbit/s: faster than any thin link) its phases
  and their least judging lag shrink with the rate, to a fifth: a phase there holds megabytes, and each doubling
  costs a phase and its lag (4 daemons on loopback go from 64 MB/s to 1 GB/s in about a quarter of a second).
* **Congestion** sets ``btl`` to what the congested phase delivered beyond random loss: its actual send rate
  x (1 - loss) / (1 - floor), ``CUT_MARGIN`` under (a phase the queue filled only late understates its
  loss). Unlike a multiplicative cut this is right however far the rate overshot, and a false alarm costs
  only the few percent it measured. It never raises ``btl`` (a late judgement of an older phase cannot undo
  a newer cut); a phase sent below the new ``btl`` while the overshoot's queue drained is not held against
  it; a drain phase's loss is the probe's queue, not evidence against ``btl``; a probe that overflowed
  takes ``btl`` a further ``PROBE_FAIL_CUT`` down (its cruise rate was too high too). Then a drain phase.
* **Probe cycle** afterwards, one phase each: x1.1 (probe), x0.9 (drain: empties what the probe queued),
  then four at x0.98 (a little under, so a slightly high ``btl`` does not fill the queue). (A larger probe fills
  so much of the queue at the link's rate that it never comes back clean, and btl settles well under the link.)
  A clean probe raises ``btl`` by a step that starts at 2 % and
  doubles with each clean probe in a row, up to 8 % (an overshoot then costs a phase of tail drops) and,
  after five clean probes in a row, up to the probe's own 10 % (a clean probe shows no more headroom than
  that: a 50 % step overran the queue when the link came back in the virtual-time tests). Congestion restarts
  it at 2 %. A probe raises ``btl`` no higher than the rate it actually sent, and one that sent no more than
  1 % above ``btl`` (a sender held back by its CPU) raises nothing and is not counted. After ``RESTART_PROBES`` clean
  probes in a row btl is far under the path (startup ended on a false signal): startup runs again from btl.
* A phase in which the sender used under ``APP_LIMITED`` of its rate (CPU-bound, or out of data) raises
  nothing: an unused rate says nothing about the path. (Also a bursty sender's, held back by the rate in
  its bursts: raising it on that overran the lab's queues.) A phase's send rate is measured up to its last
  send (the end of an average leaves a phase half empty).
* Kernel drops at a receiver (its socket buffer overflowed) above ``KERNEL_DROPS`` of a phase's datagrams are
  congestion too.

Event-loop arrival times are not used (REPORT's ``seconds``): receivers see datagrams when their event loop
gets to them, and on the lab's 2 loaded cores the ratio of send to arrival time read 0.7 at a third of the link
rate (no queue at all). The kernel's receive times (``arrived``) do not wait for the event loop.

Per destination: a destination clearly lossier than the rest of a phase (its downlink or its CPU is the
bottleneck, not this uplink) gets a cap of what its path delivered once it stays so for ``PATH_PERSIST``
phases, raised ``PATH_GROWTH``-fold per clean phase until it no longer binds. It is left out of the uplink's
judgement from its second phase in a row, or at once where the queue toward every other destination stayed
under ``Q_HIGH`` (the uplink's queue then did not overflow). A tail drop at a full uplink queue takes a part or
two, all of one destination, a different one each phase: at its first phase such a destination's loss is the
uplink's. The driver sends destinations in turn, so a capped destination slows
the others too; an average needs all its destinations' data anyway.

**Between averages** the pacer keeps what it learnt: ``btl`` (or the rate startup proved) and each
destination's cap. A send after ``IDLE_S`` without one starts a new average from them, aged by the idle
time (``MEMORY_HALF_LIFE_S``: a rate's excess over START_RATE halves, a cap loosens as much), with a cruise
phase; only a sender's first average starts at START_RATE.

tests/test_pacing.py holds it to its goals in virtual time (4 nodes on 100 Mbit/s tbf links with a 20 ms queue,
random loss 0-10 %, late and jittery REPORTs, receivers stalled 60 ms in every 200 ms): the uplinks over 90 %
full after startup, and well under 1 % lost beyond the links' random loss in steady state. In the lab:
`peerd bench allreduce --peers 4 --size 5000000 --link 100mbit --json` (``link_utilization``, ``excess_loss``).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

from .qdelay import QueueDelay

START_RATE = 2e6  # bytes/s (16 Mbit/s): low, so a thin link is not overrun 8x at the first average ...
START_DATAGRAM = 1200  # ... in datagrams of this size (1,667 a second); see start_rate
DEFAULT_RATE = START_RATE
MIN_RATE = 0.25e6
MAX_RATE = 20e9
BURST_S = 0.002  # a burst may run this far ahead of the average rate ...
CATCHUP_S = 0.008  # ... and this far for a sender the rate held back, whose wake-up came late (a loaded CPU:
# what it slept through past its time would otherwise be lost for good; 8 ms is under half the lab's queue)

MIN_SAMPLE_BYTES = 32 * 1200  # MIN_SAMPLE datagrams of the default payload
STARTUP_GROWTH = 2.0  # startup's step: an overshoot past the bottleneck is at most this much ...
STARTUP_PHASES = 2  # ... for a phase or two: a rate is raised after this many clean phases at it (a queue
# absorbs a first phase's overshoot: it looks clean)
PHASE_S = 0.05  # one phase of the cycle: two REPORT intervals (a phase needs a few REPORTs per destination)
PHASE_BYTES = 3 * MIN_SAMPLE_BYTES  # at least a report from each of three destinations
FAST_STARTUP_RATE = 40e6  # bytes/s: a startup phase above this rate (and its least judging lag) is shorter ...
FAST_STARTUP_MIN = 0.2  # ... in proportion, down to this fraction of PHASE_S (JUDGE_LAG_S)
JUDGE_LAG_S = 0.05  # a phase waits at least this long after it ended for its REPORTs (unless all are in) ...
MAX_JUDGE_LAG_S = 1.0  # ... and at most this long (a receiver that stopped reporting holds nothing up longer)
DELAY_K = 4.0  # the wait: the REPORT delay's smoothed mean plus this many smoothed deviations (as TCP's RTO)
DELAY_GAIN, DEV_GAIN = 0.125, 0.25  # the smoothing of both (RFC 6298's alpha and beta)
MAX_PENDING_REPORTS = 16  # REPORTs beyond a gap kept per destination (more: the gap is given up on)
EARLY_SAMPLE = 64  # datagrams reported of a phase before it may be judged early (congested) ...
EARLY_Z = 4.0  # ... when its loss is this many sigma above its floor
IDLE_S = 0.25  # a sender idle this long ended an average (or waited for data in one: aged by next to nothing)
MEMORY_HALF_LIFE_S = 60.0  # an idle sender's remembered rates lose half their excess over START_RATE this often
CYCLE = (1.1, 0.9, 0.98, 0.98, 0.98, 0.98)  # gains on btl: probe, drain, four cruise phases a little under
PROBE, DRAIN = 0, 1
PROBE_STEP = 0.02  # a clean probe raises btl this much at first, doubling with every clean probe in a row ...
MAX_PROBE_STEP = 0.08  # ... up to this (the overshoot a cruise phase then pays for), and after FAST_PROBES
FAST_PROBES = 5  # clean probes in a row (+28 % in all: the link got faster), then steps up to MAX_FAST_STEP
MAX_FAST_STEP = CYCLE[PROBE] - 1.0  # (a clean probe shows that much headroom, no more)
RESTART_PROBES = 8  # clean probes in a row (+77 % in all) before startup runs again from btl
MAX_CUT = 0.25  # one decrease goes at most this far below the phase's send rate
CUT_MARGIN = 0.92  # congestion sets btl this far under what the congested phase delivered
PROBE_FAIL_CUT = 0.95  # a probe that overflowed the queue takes btl this much lower
LOSS_MARGIN = 0.005  # loss this far over the floor (plus Z sigma of both samples' noise) is congestion
Z = 2.0
STARTUP_MARGIN = 0.05  # in startup, floors rest on a few small phases: ask for more
STARTUP_Z = 3.0
PATH_MARGIN = 0.02  # one destination's share of a phase is a third of the sample (with 3 destinations), and
PATH_Z = 3.0  # there are as many chances of a false alarm as destinations: a cap needs clearer evidence
FLOOR_RATE = 0.85  # clean phases sent at most this fraction of a judged phase's rate give its floor
FLOOR_PHASES = 8  # pooled over at most this many
HISTORY = 32  # clean phases remembered (1.6 s)
MAX_PENDING = 64  # phases waiting for their judgement (more: the oldest go unjudged)
MIN_SAMPLE = 32  # datagrams: a phase (or a destination's share of one) with fewer says too little
# positions: a stream's first report comes this early, whatever the interval. Its arrival time is the path's base
# delay before this sender's queue filled: with a later first report (at MIN_SAMPLE) a sender that started above a
# thin link (START_RATE on 10 Mbit/s) first hears of its path with the queue full, takes that for the base, and
# never sees a queue again (tests/test_pacing.py's link under START_RATE).
FIRST_REPORT = 2
KERNEL_DROPS = 0.005  # receivers' kernel drops above this fraction of a phase's datagrams are congestion
HELD_BACK = 0.9  # a phase that sent under this fraction of its rate was held back (CPU), not paced
APP_LIMITED = 0.5  # a phase that used less of its rate than this raises nothing (a 64 KB part is 30 ms at
# 2 MB/s: a phase's own send rate is coarse at low rates)
PATH_PERSIST = 2  # judged phases in a row a destination must be clearly lossier than the rest to get a cap
PATH_GROWTH = 1.25  # a capped destination's cap grows this much per clean phase
LOG_HISTORY_S = 2.0
MAX_PATHS = 1024  # per-destination state kept (caps, send logs); the least recently used goes first
Q_HIGH = 0.006  # seconds of queue at a phase's end that say its rate is above what the uplink carries
# A probe whose queue ends above this found no headroom: at btl = the link, a phase at CYCLE[PROBE] queues its 10 %
# margin, 5 ms of a 50 ms phase; at 5 % under the link, 2.25 ms. (Judged against Q_HIGH, probes at the link's rate
# come back clean, btl creeps past the link and the queue cuts it back: more loss beyond random loss and less of
# the link used, in tests/test_pacing.py's swarm.)
Q_PROBE = 0.0035
STARTUP_GROWTH_MIN = 0.2  # startup ends on a queue above Q_HIGH that grew this many seconds per second of the phase
STARTUP_FILL = 0.75  # of PHASE_BYTES: what a startup phase must hold to prove its rate (a phase that sent
# under HELD_BACK of its rate proves nothing either)
Q_FLAT = 0.001  # a startup phase whose queue ended under this (and grew no faster than FLAT_GROWTH) had headroom:
FLAT_GROWTH = 0.02  # its rate doubles after it alone (an overshoot of x queues (x - 1) x 50 ms in one phase)
CPU_HELD = 2  # startup phases in a row held back under HELD_BACK with the queue flat: the rate goes to twice their fill
CPU_HELD_BYTES = 2 << 20  # ... or one such phase that sent this much (dozens of parts: its fill is no part's timing)
DRAINING = 0.03  # a deep queue shrinking faster than this (s/s) is not cut for: it drains at the rate sent
DEEP_PHASES = 2  # judged phases in a row with a queue above Q_HIGH before a cruise phase's rate is cut
Q_SPAN = 0.3  # a destination's queue growth is measured over samples this much of a phase apart at least
BASE_PLACED = 0.001  # seconds into a burst a datagram's modelled send time may be and still set the base delay
DELAY_MARGIN = 0.98  # a queue that grew sets btl this far under the rate the uplink carried (exact, unlike loss)
CARRIED_SLACK = 1.02  # a rate within this factor of what a recent phase delivered counts as carried before ...
# ... by one of the last this many judged clean phases (0.6 s). With all 32 kept, a shallow bottleneck that cross
# traffic halved would pass for the link losing at random for seconds; with fewer (8), a 0.3 s burst of random
# loss would cut. The price: a lasting step of random loss at a shallow queue costs a cut or two (virtual time,
# tests/test_pacing.py).
CARRIED_PHASES = 12


def start_rate(datagram: int) -> float:
    """Where a sender of ``datagram``-byte datagrams starts: START_RATE's datagrams a second, never fewer bytes than
    START_RATE (as TCP's initial window counts segments). A phase must hold MIN_SAMPLE datagrams to be judged: at
    START_RATE in 8 KB datagrams a 50 ms phase holds 12, so startup would stall there, about 0.4 s a doubling
    (`peerd bench allreduce --peers 4 --size 25000000 --mtu 8192`: the first average's time). Datagrams above
    1200 bytes are for LANs: on a 1500-byte path an 8 KB datagram travels as 6 IP fragments, lost whole with any
    one of them."""
    return START_RATE * max(1.0, datagram / START_DATAGRAM)


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


class _Phase:
    """An interval sent at one rate, and what the REPORTs about its datagrams said."""

    __slots__ = ("start", "end", "rate", "kind", "expected", "lost", "drops", "paths", "last_sent", "nbytes",
                 "busy_until", "pause_from", "queue", "first_at")

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

    def stop(self) -> float:
        """Where the phase's send rate is measured to: its end, or its last send if the sender ran out of data
        before (the end of an average: a phase half empty is not one sent at half its rate)."""
        assert self.end is not None
        return self.end if self.busy_until <= self.start else min(self.end, self.busy_until)


class _Record:
    """A clean, judged phase: what floors are pooled from."""

    __slots__ = ("sent", "expected", "lost", "paths")

    def __init__(self, sent: float, expected: int, lost: int, paths: dict[Hashable, tuple[int, int, float]]) -> None:
        self.sent = sent  # bytes/s actually sent, all destinations
        self.expected = expected
        self.lost = lost
        self.paths = paths  # dest -> (expected, lost, bytes/s actually sent to it)


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


class Pacer:
    """The uplink's token bucket, per-destination caps, and the phases that set them (module docstring)."""

    def __init__(
        self,
        rate: float | None = None,
        *,
        min_rate: float = MIN_RATE,
        max_rate: float = MAX_RATE,
        max_paths: int = MAX_PATHS,
        phase_s: float = PHASE_S,
        judge_lag_s: float = JUDGE_LAG_S,
        datagram: int = START_DATAGRAM,
    ) -> None:
        """``rate``: where the first average starts (None: ``start_rate(datagram)``); ``datagram``: the sender's
        datagram size, bytes (its --mtu)."""
        self.min_rate = min_rate
        self.max_rate = max_rate
        self.start_rate = start_rate(datagram)  # (what a long idle decays back toward)
        self.rate = min(max_rate, max(min_rate, float(self.start_rate if rate is None else rate)))
        self.btl: float | None = None  # the bottleneck estimate; None during startup
        self.phase_s = phase_s
        self.judge_lag_s = judge_lag_s
        self.max_paths = max_paths
        self._cycle_at = PROBE
        self._step = PROBE_STEP
        self._clean_probes = 0  # clean probes since the last congestion
        self._clean_at_level = 0  # startup: clean phases judged at the current rate
        self._cpu_held = 0  # startup: phases in a row at the current rate that its CPU held back, queue empty
        self._cpu_fill = 0.0  # the most those sent, bytes/s
        self._proven = 0.0  # startup: the highest rate STARTUP_PHASES clean phases were judged at
        self._next = 0.0  # when the uplink bucket is empty again
        self._quiet_until = -math.inf  # phases that started before this drain the last overshoot's queue
        self._phases: deque[_Phase] = deque()  # not judged yet; the current one last
        self._history: deque[_Record] = deque(maxlen=HISTORY)
        self._caps: OrderedDict[Hashable, _Cap] = OrderedDict()
        self._limits: OrderedDict[Hashable, tuple[_Cap, float]] = OrderedDict()  # dest -> (stated limit, slack s)
        self._hot: dict[Hashable, int] = {}  # destinations lossier than the rest, phases in a row
        self._sent: OrderedDict[Hashable, _SendLog] = OrderedDict()
        self._total = _SendLog()
        self._last_send: float | None = None  # when the last reserved part goes out
        self._held = False  # the last reservation had to wait: the sender is backlogged
        self._reported: OrderedDict[Hashable, _Frontier] = OrderedDict()  # dest -> what its REPORTs cover
        self._delay: float | None = None  # smoothed REPORT delay: from a report's last send to its arrival
        self._delay_dev = 0.0
        self._queues = QueueDelay(max_paths)  # per destination: queueing delay from REPORTs' arrival times
        self._deep = 0  # judged phases in a row whose queue stood above Q_HIGH
        self._growth: tuple[float, float] | None = None  # (when, growth) the last phase that spanned enough measured
        self.queue_delay: float | None = None  # the last judged phase's uplink queue, seconds
        self.decreases = 0
        self.increases = 0
        self.resumes = 0  # averages started from memory after an idle gap

    @property
    def mode(self) -> str:
        return "startup" if self.btl is None else "cycle"

    def cap(self, dest: Hashable) -> float | None:
        """The destination's own cap, bytes/s (None: only the uplink's rate binds)."""
        c = self._caps.get(dest)
        return None if c is None else c.rate

    def limit(self, dest: Hashable, key: Hashable | None = None, rate: float = 0.0, burst: float = 0.0) -> None:
        """Send to ``dest`` at most ``rate`` bytes/s, one bucket shared by every destination limited under
        ``key``: a limit the path states (a relay grants each sender ``rate``, ``burst`` at once), not one learnt
        from loss, so it is neither judged nor aged. ``key`` None lifts ``dest``'s limit."""
        if key is None:
            self._limits.pop(dest, None)
            return
        shared = next((c for c, _ in self._limits.values() if c.key == key), None) if self._limits else None
        if shared is None:
            shared = _Cap(rate)
            shared.key = key
        shared.rate = rate
        self._limits[dest] = (shared, 0.5 * burst / rate)  # (a late wake-up may catch up half the burst)
        self._limits.move_to_end(dest)
        while len(self._limits) > self.max_paths:
            self._limits.popitem(last=False)

    def reserve_cross(self, nbytes: int, now: float) -> float:
        """Bytes this node sends for others on the same uplink (a relay's RELAYEDs) while it sends its own: they
        take the uplink's rate like its own, but no destination reports on them. Idle, it does not hold them
        (a relay that averages nothing has no rate learnt). Returns how long to wait."""
        if self._last_send is None or now - self._last_send >= IDLE_S:
            return 0.0
        self._advance(now)
        start = max(self._next, now - BURST_S)
        self._next = start + nbytes / self.rate
        return max(0.0, start - now)

    # -- sending -----------------------------------------------------------------------------------
    def reserve(self, nbytes: int, now: float, dest: Hashable = None) -> float:
        """Account for sending ``nbytes`` to ``dest`` now; returns how long to wait before sending them."""
        if self._last_send is not None and now - self._last_send >= IDLE_S:
            self._resume(now, now - self._last_send)
        self._advance(now)
        # (only at a rate the path is known to carry: in startup a catch-up burst at twice the last clean
        # rate is 16 ms of a link's rate, most of its queue)
        credit = CATCHUP_S if self._held and self.btl is not None and now - self._next < IDLE_S else BURST_S
        start = max(self._next, now - credit)
        self._next = start + nbytes / self.rate
        cap = self._caps.get(dest) if self._caps else None
        if cap is not None:
            start = max(start, cap.next, now - BURST_S)
            cap.next = start + nbytes / cap.rate
        limit = self._limits.get(dest) if self._limits else None
        if limit is not None:
            lim, slack = limit
            start = max(start, lim.next, now - slack)
            lim.next = start + nbytes / lim.rate
        at = max(start, now)
        self._held = at > now
        self._last_send = at if self._last_send is None else max(self._last_send, at)
        cur = self._phases[-1]
        cur.last_sent[dest] = at
        cur.first_at = min(cur.first_at, at)
        cur.nbytes += nbytes
        cur.busy_until = max(cur.busy_until, at + nbytes / self.rate)
        seconds = nbytes / self.rate
        self._total.add(at, nbytes, seconds)
        log = self._sent.get(dest)
        if log is None:
            log = self._sent[dest] = _SendLog()
            while len(self._sent) > self.max_paths:
                self._sent.popitem(last=False)
        else:
            self._sent.move_to_end(dest)
        log.add(at, nbytes, seconds)
        return at - now

    def spacing(self, nbytes: int) -> float:
        """Seconds a datagram of ``nbytes`` takes through the bottleneck, as far as the pacer knows (0 in
        startup, where it does not): what places a burst's datagrams in time (SendPositions)."""
        return nbytes / self.btl if self.btl else 0.0

    def sent_rate(self, start: float, stop: float, dest: Hashable = None) -> float:
        """What this sender really sent to ``dest`` (all destinations: None) in [start, stop), bytes/s."""
        if dest is None:
            return self._total.rate(start, stop)
        log = self._sent.get(dest)
        return 0.0 if log is None else log.rate(start, stop)

    # -- phases ------------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        """Close the current phase once it has run ``phase_s`` (a gap with nothing sent: at its end)."""
        phases = self._phases
        if phases:
            cur = phases[-1]
            length = self._span(cur.rate, self.phase_s, cur.kind)
            if now < cur.start + length:
                return
            cur.end = min(now, cur.start + length)
        self._open(now)
        if len(phases) > 1 and phases[-2].end is not None and phases[-2].end < now:
            phases[-1].pause_from = phases[-2].end

    @staticmethod
    def _span(rate: float, seconds: float, kind: str = "") -> float:
        """A phase (or judging lag) at ``rate``: ``seconds``, or long enough for PHASE_BYTES, whichever is
        longer. At low rates a receiver needs longer to see MIN_SAMPLE datagrams per sender and report them:
        a phase shorter than that is judged before its REPORTs come in, and they find it judged (stale).
        A startup phase above FAST_STARTUP_RATE is shorter, in proportion to its rate (FAST_STARTUP_MIN of
        ``seconds`` at least): it holds more than enough datagrams, and each doubling costs a phase and its lag."""
        if kind == "startup" and rate > FAST_STARTUP_RATE:
            seconds *= max(FAST_STARTUP_MIN, FAST_STARTUP_RATE / rate)
        return max(seconds, PHASE_BYTES / rate)

    def _open(self, now: float) -> None:
        if self.btl is None:
            kind = "startup"
        else:
            i = self._cycle_at
            if i == PROBE and any(ph.kind in ("probe", "drain") for ph in self._phases):
                # The last probe is not judged yet (REPORTs run late): another on top of it would add its
                # queue to the first's before either is heard of. Cruise until it is.
                i = len(CYCLE) - 1
            else:
                self._cycle_at = (i + 1) % len(CYCLE)
            kind = "probe" if i == PROBE else "drain" if i == DRAIN else "cruise"
            self.rate = min(self.max_rate, max(self.min_rate, CYCLE[i] * self.btl))
        self._phases.append(_Phase(now, self.rate, kind))
        while len(self._phases) > MAX_PENDING:
            self._phases.popleft()

    def _restart(self, now: float) -> None:
        """The rate changed: the current phase ends now and a new one starts at the new rate."""
        pause_from = now
        if self._phases and self._phases[-1].end is None:
            cur = self._phases[-1]
            if cur.start >= now and not cur.nbytes:  # (opened just now, nothing in it: replaced)
                self._phases.pop()
                pause_from = cur.pause_from
            else:
                cur.end = max(cur.start, now)
        self._open(now)
        self._phases[-1].pause_from = pause_from

    def _resume(self, now: float, idle: float) -> None:
        """A new average after ``idle`` seconds without sending: start from what the paths carried last time
        (the uplink's ``btl``, or the rate startup reached; each destination's cap), aged: what was learnt
        long ago is less sure, so a remembered rate decays toward START_RATE (a cap relaxes away from it:
        the path may have got faster). The first phase is a cruise phase, not a probe."""
        self._advance(now)  # (the last phase ends where it ran out, not after the pause)
        self._judge_due(now)  # the last average's phases whose REPORTs are in or overdue
        decay = 0.5 ** (idle / MEMORY_HALF_LIFE_S)

        def aged(rate: float) -> float:
            start = self.start_rate
            return rate if rate <= start else start + (rate - start) * decay

        if self.btl is not None:
            self.btl = max(self.min_rate, aged(self.btl))
            self._cycle_at = DRAIN + 1
        else:
            # (startup's last doubling was not judged clean yet: an average that ended first, its phases short of
            # data, proved nothing at it. Resumed there, a backlogged sender overran the queue at once: 16
            # daemons on 2 cores lost 7 % of a Moshpit round's second average, sent at twice the link.)
            self.rate = min(self.max_rate, max(self.min_rate, aged(min(self.rate, max(self.start_rate, self._proven)))))
        for dest, cap in list(self._caps.items()):
            cap.rate /= decay
            if cap.rate >= (self.btl if self.btl is not None else self.rate):
                del self._caps[dest]
        self.resumes += 1
        self._restart(now)

    def judge_lag(self) -> float:
        """How long a phase waits after its end for REPORTs still missing: scaled with the REPORT delay
        measured (receivers and this sender on loaded CPUs answer late), between JUDGE_LAG_S and
        MAX_JUDGE_LAG_S. A phase whose destinations have all reported past its last send waits no longer."""
        lag = self.judge_lag_s
        if self._delay is not None:
            lag = max(lag, self._delay + DELAY_K * self._delay_dev)
        return min(max(self.judge_lag_s, MAX_JUDGE_LAG_S), lag)

    def _complete(self, ph: _Phase) -> bool:
        """Every destination sent to in the phase has reported past the last part sent to it in it."""
        reported = self._reported
        for d, t in ph.last_sent.items():
            f = reported.get(d)
            if f is None or f.top < t:
                return False
        return True

    def _note_delay(self, dest: Hashable, span: tuple[float, float], first: bool, now: float) -> None:
        f = self._reported.get(dest)
        if f is None:
            f = self._reported[dest] = _Frontier()
            while len(self._reported) > self.max_paths:
                self._reported.popitem(last=False)
        else:
            self._reported.move_to_end(dest)
        f.add(span, first, now, now - self.judge_lag())
        d = max(0.0, now - span[1])
        if not math.isfinite(d):
            return
        if self._delay is None:
            self._delay, self._delay_dev = d, d / 2
        else:
            self._delay_dev += DEV_GAIN * (abs(d - self._delay) - self._delay_dev)
            self._delay += DELAY_GAIN * (d - self._delay)

    def _carried(self, rate: float) -> bool:
        """One of the last CARRIED_PHASES clean phases delivered about ``rate`` bytes/s or more (what it sent less
        what it lost)."""
        need = rate / CARRIED_SLACK
        recent = list(self._history)[-CARRIED_PHASES:]
        return any(rec.sent * (1.0 - rec.lost / rec.expected) >= need for rec in recent if rec.expected > 0)

    def _floor(self, sent: float, dest: Hashable = None) -> tuple[float, float, int]:
        """(random-loss floor, its sampling variance, datagrams behind it) for a phase sent at ``sent``
        bytes/s (to ``dest``; None: all destinations): the pooled loss of recent clean phases sent at
        most FLOOR_RATE of that. (0, 0, 0) when there are none."""
        limit = FLOOR_RATE * sent
        expected = lost = used = 0
        for rec in reversed(self._history):
            if dest is None:
                e, lo, s = rec.expected, rec.lost, rec.sent
            else:
                p = rec.paths.get(dest)
                if p is None:
                    continue
                e, lo, s = p
            if s <= limit and e > 0:
                expected += e
                lost += lo
                used += 1
                if used >= FLOOR_PHASES:
                    break
        if not expected:
            return 0.0, 0.0, 0
        f = lost / expected
        return f, _var(f, expected), expected

    # -- feedback ----------------------------------------------------------------------------------
    def on_report(
        self, dest: Hashable, report: Report, now: float, sent_span: tuple[float, float] | None = None,
        placed: float = 0.0,
    ) -> Verdict:
        """Pool one receiver's interval report, received at ``now``, into the phase its datagrams were
        sent in; judge the phases whose reports are all in.

        ``sent_span``: when this sender sent the first and the last datagram of the interval (the driver
        knows from ``report.position``). Without it the interval is taken to end ``now``. ``placed``: how far
        into its batch the last one was placed (SendPositions.placed): a sample placed more than BASE_PLACED
        into a burst does not set the path's base delay."""
        self._advance(now)
        r = report
        if sent_span is not None and r.expected > 0:
            self._note_delay(dest, sent_span, r.position == r.expected, now)
            if r.arrived > 0:
                # the datagram at the top of the interval: sent at sent_span[1], arrived at r.arrived
                q = self._queues.sample(dest, r.arrived - sent_span[1], sent_span[1], placed <= BASE_PLACED)
                at = self._phase_at(sent_span[1])
                if q is not None and at is not None:
                    at.queue.append((sent_span[1], q, dest))
        if r.expected <= 0:
            verdict = Verdict("small", "no datagrams", self.rate)
        else:
            mid = (sent_span[0] + sent_span[1]) / 2 if sent_span is not None else now - r.seconds / 2
            phase = self._phase_at(mid)
            if phase is None:
                # Its middle may have fallen in a pause (the sender waited for data, as between reduce-scatter
                # and all-gather, and no phase ran): its datagrams went out around it, the last ones in the
                # phase after the pause. (Not a phase judged early: its REPORTs are stale.)
                nxt = next((ph for ph in self._phases if ph.start > mid), None)
                if nxt is not None and nxt.pause_from <= mid:
                    phase = nxt
            if phase is None:
                verdict = Verdict("stale", "its phase was judged already", self.rate)
            else:
                expected = max(r.expected, r.received)
                lost = expected - r.received
                phase.expected += expected
                phase.lost += lost
                phase.drops += r.kernel_drops
                p = phase.paths.get(dest)
                if p is None:
                    phase.paths[dest] = [expected, lost, r.kernel_drops]
                else:
                    p[0] += expected
                    p[1] += lost
                    p[2] += r.kernel_drops
                verdict = Verdict("pooled", "waits for its phase's judgement", self.rate)
        judged = self._judge_due(now)
        return judged if judged is not None else verdict

    def _phase_at(self, t: float) -> _Phase | None:
        """The unjudged phase that was running at ``t`` (None: judged already, or a pause before a phase)."""
        for ph in reversed(self._phases):
            if ph.start <= t:
                return ph if ph.end is None or t < ph.end else None
        return None

    def _judge_due(self, now: float) -> Verdict | None:
        out: Verdict | None = None
        phases = self._phases
        lag = self.judge_lag()
        while phases and phases[0].end is not None:
            ph = phases[0]
            # At least the base judging lag (a REPORT spanning two phases is pooled into one of them: a phase
            # "complete" at once may still miss some), longer while REPORTs are missing and run late.
            if now < ph.end + self._span(ph.rate, self.judge_lag_s, ph.kind) or (
                    now < ph.end + self._span(ph.rate, lag) and not self._complete(ph)):
                break
            v = self._judge(phases.popleft(), now)
            if v is not None and (out is None or out.action != "decrease"):
                out = v
        for ph in phases:
            # A later phase whose REPORTs so far already show an overflow beyond doubt is judged now, out of
            # order: waiting for its stragglers (the scaled lag) would keep the queue overflowing that long.
            if ph.end is None or now < ph.end + self._span(ph.rate, self.judge_lag_s, ph.kind):
                break
            if self._clearly_congested(ph):
                phases.remove(ph)
                v = self._judge(ph, now)
                if v is not None and (out is None or out.action != "decrease"):
                    out = v
                break
        return out

    def _clearly_congested(self, ph: _Phase) -> bool:
        """What is in of a phase's REPORTs says congestion with EARLY_Z sigma (the whole phase's judgement
        uses Z): its loss above the floor, or receivers' kernels dropping."""
        if ph.expected < EARLY_SAMPLE or ph.kind == "drain":
            return False
        if ph.drops > KERNEL_DROPS * ph.expected:
            return True
        sent = min(ph.rate, self.sent_rate(ph.start, ph.stop()))
        floor, floor_var, floor_n = self._floor(sent)
        loss = ph.lost / ph.expected
        margin = STARTUP_MARGIN if self.btl is None else LOSS_MARGIN
        return floor_n > 0 and loss > floor + margin + EARLY_Z * math.sqrt(floor_var + _var(floor, ph.expected))

    def _judge(self, ph: _Phase, now: float) -> Verdict | None:
        assert ph.end is not None
        # (at low rates a phase holds a part or two: the log's count may overstate its rate, never the bucket)
        sent = min(ph.rate, self.sent_rate(ph.start, ph.stop()))
        if ph.expected < MIN_SAMPLE or sent <= 0:
            return None
        startup = self.btl is None
        margin, z = (STARTUP_MARGIN, STARTUP_Z) if startup else (LOSS_MARGIN, Z)
        # Destinations first: one whose own path congests while the rest of the uplink's traffic is clean has
        # a bottleneck of its own (its downlink, its CPU): a cap for it, not a cut of the uplink's rate.
        paths: dict[Hashable, tuple[int, int, float]] = {}
        hot: dict[Hashable, tuple[float, float]] = {}  # dest -> (its loss, what its path delivered)
        for dest, (e, lo, drops) in ph.paths.items():
            s = self.sent_rate(ph.start, ph.stop(), dest)
            paths[dest] = (e, lo, s)
            if e >= MIN_SAMPLE and s > 0:
                found = self._path_congested(dest, e, lo, drops, s, max(margin, PATH_MARGIN), max(z, PATH_Z))
                if found is not None:
                    hot[dest] = found
        expected, lost, drops = ph.expected, ph.lost, ph.drops
        if hot and len(hot) < sum(1 for e, _, s in paths.values() if e >= MIN_SAMPLE and s > 0):
            rest_e = expected - sum(ph.paths[d][0] for d in hot)
            rest = (lost - sum(ph.paths[d][1] for d in hot)) / rest_e
            # Only a destination clearly lossier than the rest of the phase is a path of its own: an uplink
            # overflow hits every destination alike, and one of them crossing its threshold is noise.
            hot = {d: v for d, v in hot.items() if ph.paths[d][2] > KERNEL_DROPS * ph.paths[d][0]
                   or v[0] > rest + PATH_MARGIN + PATH_Z * math.sqrt(_var(rest, ph.paths[d][0]) + _var(rest, rest_e))}
            # Capped only once it stays so, and left out of the uplink's judgement only from its second phase
            # in a row: a tail drop at a full uplink queue takes a part or two, all of one destination (the
            # driver sends destinations in turn), and which one is chance. Excused at the first, an overrun
            # whose drops move from destination to destination is never the uplink's: with 7 destinations on
            # loaded cores btl would rise well past the link (tests/test_pacing.py; `peerd bench allreduce --peers 8
            # --link 100mbit`, excess_loss).
            for d in hot:
                self._hot[d] = self._hot.pop(d, 0) + 1
                if len(self._hot) > self.max_paths:
                    del self._hot[next(iter(self._hot))]
            # (Where the other destinations' queues are known and all shallow, the uplink's queue did not overflow:
            # the first phase is excused too.)
            levels = self._late_levels(ph)
            others = [q for d, q in levels.items() if d not in hot]
            shallow = bool(others) and max(others) < Q_HIGH
            excused = [d for d in hot if shallow or self._hot[d] >= PATH_PERSIST]
            for dest in excused:  # judge the uplink by the rest
                expected -= ph.paths[dest][0]
                lost -= ph.paths[dest][1]
                drops -= ph.paths[dest][2]
        else:
            hot = {}
        for d in list(self._hot):
            if d in ph.paths and d not in hot and ph.paths[d][0] >= MIN_SAMPLE:
                del self._hot[d]
        loss = lost / expected
        floor, floor_var, floor_n = self._floor(sent)
        reason = ""
        if drops > KERNEL_DROPS * expected:
            reason = f"{drops} datagrams dropped by receivers' kernels"
        elif floor_n and loss > floor + margin + z * math.sqrt(floor_var + _var(floor, expected)):
            reason = f"loss {loss:.3f} above the floor {floor:.3f} ({ph.kind} at {sent / 1e6:.2f} MB/s)"
        delay_cut = None
        signal = self._queue_signal(ph)
        if signal is not None:
            self.queue_delay = signal[0]
            if reason.startswith("loss") and signal[3] < Q_HIGH and self._carried(sent * (1.0 - floor)):
                # A queue overflows only once full, and the datagrams that got through then waited in it: loss
                # above the floor with the queue shallow toward every destination, at a rate the path has carried
                # lately, is the link's (its random loss's noise, a lossy patch). (Every destination: a member
                # that lies about its arrival times must not hide an overflow.) Not at a rate it has not carried:
                # a bottleneck with little or no queue (a policer, a shallow switch buffer) drops above its rate
                # with the queue empty, and excused so, startup ran on to the maximum rate, 98 % lost (virtual
                # time: 100 Mbit/s with 1-2.5 ms of queue, 1 Gbit/s with 2 ms).
                reason = ""
        if not reason and signal is not None and ph.kind != "drain":
            level, growth, at, _ = signal
            if growth is None:
                # (no destination's samples spanned enough of the phase: where a probe's queue stood late in it
                # tells its growth, the cruise before a probe having left the queue empty)
                late = ph.kind == "probe" and at - ph.start > Q_SPAN * (ph.end - ph.start)
                if late and level > Q_HIGH:
                    growth = level / (at - ph.start)
                elif ph.kind != "probe" and self._growth is not None and at - self._growth[0] <= 3 * self.phase_s:
                    growth = min(0.0, self._growth[1])  # (a short phase: a drain the phase before it measured)
                else:
                    growth = 0.0
            else:
                self._growth = (at, growth)
            # what the link carried while the queue grew (a full queue grows no more: its overflow is the rest)
            measured = sent / (1.0 + max(0.0, growth)) * min(1.0, (1.0 - loss) / max(1e-9, 1.0 - floor))
            # (a phase sent before the last cut drained shows that overshoot's queue, acted on already; one that
            # used little of its rate, the tail of an average, shows the queue of the bursts before it)
            fresh = ph.start >= self._quiet_until and sent >= APP_LIMITED * ph.rate
            self._deep = self._deep + 1 if level > Q_HIGH else 0
            if fresh and ph.kind == "probe" and level > Q_PROBE:
                # A probe above the link filled the queue: no raise, and a drain empties what it left. (Taken as a
                # measurement of the link, sent / (1 + growth), it read low in the lab: a sender woken late on
                # loaded cores bursts, and its bursts queue below the link's rate.)
                self._cycle_at = DRAIN
                self._step = PROBE_STEP
                self._clean_probes = 0
                self._restart(now)
                return Verdict("hold", f"probe at {sent / 1e6:.2f} MB/s: queue {1e3 * level:.1f} ms", self.rate)
            if ph.kind == "startup":
                # (in startup a burst's datagrams are not placed in time, btl being unknown: each sample may sit a
                # burst late, so a deep queue ends it only where it grows, or where it stood deep DEEP_PHASES
                # judged phases in a row while the sender could not send its rate: a socket the link pushed back
                # on. Without that, a startup above the link holds a deep queue until it overflows, and ends far
                # under the link. The deep queue alone would end startup early on 64 KB bursts with late REPORTs
                # (tests/test_pacing.py).)
                pushed_back = self._deep >= DEEP_PHASES and sent < HELD_BACK * ph.rate
                congested = fresh and level > Q_HIGH and (growth > STARTUP_GROWTH_MIN or pushed_back)
            else:  # (a deep queue in two judged phases in a row: one may be a burst's, or a receiver's stall)
                congested = fresh and self._deep >= DEEP_PHASES
                if congested and growth <= 0.0 and sent < HELD_BACK * ph.rate:
                    # A standing queue while this sender sent under its rate (its CPU held it back) is not its
                    # uplink filling: that would grow, or drain below the link's rate. Its catch-up bursts and
                    # the other senders' traffic leave such queues on loaded cores; cutting to what it managed to
                    # send took rates to 0.6 of the link for seconds (lab, 4 daemons on 2 cores).
                    congested = False
                if congested and growth < -DRAINING:
                    # A queue that drains while this sender sends at ``sent`` is not its uplink's overrun: the
                    # path carries more than that. (Downlinks that two senders met at once, the rotations
                    # drifted apart: in the lab, 4 peers at 50 Mbit/s, 29 of 71 queue cuts were on draining
                    # queues, each a cut and a drain phase under a rate the link carried.)
                    congested = False
            if congested:
                # The uplink's queue filled while the phase sent at ``sent``: no loss yet, and what the link
                # carried is known (a standing queue that did not grow: ``sent`` was at most that).
                reason = f"queue {1e3 * level:.1f} ms, growing {growth:.2f} s/s ({ph.kind} at {sent / 1e6:.2f} MB/s)"
                delay_cut = measured
        if reason and ph.kind == "drain":
            # The probe before it filled the queue (or the overshoot before the last cut did): says nothing
            # against btl. (A path too slow even for the drain rate congests the cruise phases after it.)
            return Verdict("hold", "the probe's queue: " + reason, self.rate)
        if reason and ph.start < self._quiet_until and (self.btl is None or sent < self.btl):
            # Sent below the new estimate while the queue the last overshoot filled was still draining:
            # its loss is that overshoot's, already acted on. (One sent at or above it says how far the
            # overshoot really went: a phase the queue filled only late in understates it. What it sent counts,
            # not its rate: a startup phase at 16 MB/s that sent 9.7 cut a btl of 10.2 to 7.4 in the lab.)
            return Verdict("stale", "sent before the last decrease drained: " + reason, self.rate)
        if reason:
            # What the path delivered beyond its random loss (exact when the queue stayed full all phase; a
            # phase it filled only late understates its loss: hence the margin).
            # A sender short of CPU (it used under APP_LIMITED of its rate) sends in bursts at its paced rate:
            # those overran the queue, so what they delivered is a share of that rate, not of the phase's
            # average (which took btl to a fifth of the link in the lab, 2 loaded cores, 4 daemons).
            base = ph.rate if sent < APP_LIMITED * ph.rate else sent
            if delay_cut is not None:
                delivered = delay_cut * DELAY_MARGIN
            else:
                delivered = base * (1.0 - loss) / max(1e-9, 1.0 - floor) * CUT_MARGIN
            # (at most MAX_CUT in one step: a phase that lost nearly everything, as one a receiver's bogus
            # or misaligned REPORT makes, would otherwise take the rate to the floor in one go)
            delivered = min(self.max_rate, max(self.min_rate, MAX_CUT * base, delivered))
            if self.btl is not None and delivered >= self.btl and ph.start < self._quiet_until:
                # (a phase of the same overshoot, judged after the cut it caused: short startup phases at high
                # rates are judged several at one REPORT, and this one says no lower)
                return Verdict("hold", "the last decrease covers it: " + reason, self.rate)
            self.btl = delivered if self.btl is None else min(self.btl, delivered)
            if ph.kind == "probe" and delay_cut is None:
                # A probe that overflowed says the queue was not empty, so the cruise rate under it was too
                # high as well (what it delivered is no bound on that: a probe's gain is on top).
                self.btl = max(self.min_rate, self.btl * PROBE_FAIL_CUT)
            self._cycle_at = DRAIN
            self._step = PROBE_STEP
            self._clean_probes = 0
            self._restart(now)
            self._quiet_until = now + self._span(self.rate, self.phase_s)
            if signal is not None:
                # (the queue it found drains at the drain phase's margin under the link: no phase before it has
                # had the time to is held against the new rate; also after an overflow, whose full queue a
                # phase sent at 0.7 of the link still met and cut for, 0.6 of the link after it halved)
                self._quiet_until += min(MAX_JUDGE_LAG_S, signal[0] / (1.0 - CYCLE[DRAIN]))
            self.decreases += 1
            return Verdict("decrease", reason, self.rate)
        path_verdict = None
        for dest in paths:
            cap = self._caps.get(dest)
            if dest in hot and self._hot.get(dest, 0) < PATH_PERSIST:
                path_verdict = Verdict("hold", f"destination {dest!r} lossier than the rest", self.rate)
            elif dest in hot:
                path_loss, rate = hot[dest]
                if cap is None:
                    self._caps[dest] = _Cap(rate)
                    while len(self._caps) > self.max_paths:
                        self._caps.popitem(last=False)
                else:
                    cap.rate = min(cap.rate, rate)
                    self._caps.move_to_end(dest)
                self.decreases += 1
                path_verdict = Verdict("decrease", f"destination {dest!r}: loss {path_loss:.3f} above its floor",
                                       self.rate)
            elif cap is not None:
                cap.rate *= PATH_GROWTH
                if cap.rate >= self.rate:
                    del self._caps[dest]
        if ph.start >= self._quiet_until:
            # (a phase sent while the last overshoot's queue drained lost what that queue overflowed: as a floor
            # it would hide the next overrun; after a cut on a link that had halved, such phases at a third of
            # their data lost would pass for clean, no floor being known at their rate yet)
            self._history.append(_Record(sent, ph.expected, ph.lost,
                                         {d: v for d, v in paths.items() if d not in hot}))
        if hot:  # (the aggregate floor keeps them: their loss is part of what this uplink's phases see)
            return path_verdict
        if sent < APP_LIMITED * ph.rate:
            # (also a bursty sender held back by the rate in its bursts: raising its rate on that lets its bursts
            # overrun a 20 ms queue, and its btl grow past the link on clean probes)
            return Verdict("hold", f"sender used {sent / ph.rate:.2f} of its rate", self.rate)
        if (startup or ph.kind == "probe") and ph.nbytes < PHASE_BYTES * (STARTUP_FILL if startup else 1.0):
            # A part or two, measured up to its last send, is sent at a rate only for a moment a queue absorbs: it
            # proves no headroom: doubling on single 64 KB parts takes 16 daemons on 2 cores to 5x the link. (In
            # startup, where a phase at START_RATE holds PHASE_BYTES only if sent to the full, STARTUP_FILL of it:
            # the first phases go out a few ms late and fall a little short.)
            return Verdict("hold", f"too little sent to prove a rate ({ph.nbytes} bytes)", self.rate)
        if startup:
            if ph.rate < self.rate:  # an older level: the current one has not been judged yet
                return Verdict("hold", "startup: an older rate", self.rate)
            if signal is not None and signal[0] > Q_HIGH:
                # (a deep queue that is not seen growing does not end startup, since a sample may sit a burst late,
                # but it is no proof of headroom either: doubling on it took 16 daemons' rates to 5x the link)
                return Verdict("hold", f"startup: queue {1e3 * signal[0]:.1f} ms at this rate", self.rate)
            # (measured from its first part: the part before the doubling, reserved at half the rate, may take
            # the phase's first ms; a 64 KB part at 2 MB/s is 32 ms)
            began = max(ph.start, ph.first_at)
            fill = min(ph.rate, self.sent_rate(began, ph.stop())) if ph.stop() - began > 0.5 * (ph.stop() - ph.start) \
                else sent
            # The queue may have hidden the first clean phase's overshoot, unless it was seen empty at its end.
            flat = signal is not None and signal[0] <= Q_FLAT and (signal[1] is None or signal[1] <= FLAT_GROWTH)
            if fill < HELD_BACK * ph.rate:
                # It proved what it sent, not its rate (its CPU, or a socket the link pushed back on, held it):
                # doubling on phases at 16 MB/s that sent 12 would take the lab's senders to 2.6x the link. Where
                # its queue stayed empty, the path took all it sent with room to spare, and only the sender's CPU
                # held it: after CPU_HELD such phases in a row the rate goes to twice the most they sent (never
                # lower). Holding instead would keep 4 daemons on loopback under what their bursts can send, and
                # their averages slower. (One such phase is often a part's timing at a low rate: a 64 KB
                # part at 2 MB/s is 32 ms of a 50 ms phase.)
                self._cpu_held = self._cpu_held + 1 if flat else 0
                self._cpu_fill = max(self._cpu_fill, fill) if flat else 0.0
                held = self._cpu_held >= (1 if ph.nbytes >= CPU_HELD_BYTES else CPU_HELD)
                if held and STARTUP_GROWTH * self._cpu_fill > self.rate:
                    return self._startup_raise(STARTUP_GROWTH * self._cpu_fill, now, "startup: its CPU held it")
                return Verdict("hold", f"startup: sent {fill / ph.rate:.2f} of its rate", self.rate)
            self._cpu_held, self._cpu_fill = 0, 0.0
            self._clean_at_level += STARTUP_PHASES if flat else 1
            if self._clean_at_level < STARTUP_PHASES:
                return Verdict("hold", "startup: one clean phase at this rate", self.rate)
            return self._startup_raise(self.rate * STARTUP_GROWTH, now, "startup: clean")
        if ph.kind == "probe":
            assert self.btl is not None
            # A clean probe proved the rate it sent, no more: one that a loaded CPU held at or under btl raises
            # nothing and does not count toward a restart (in the lab, 4 daemons on 2 cores, probes that sent
            # 11.7 MB/s took btl to 12.3, above the link's 12.1, and the cruise after them queued until cut).
            if sent <= self.btl * (1.0 + PROBE_STEP / 2):
                # (nor one that sent a hair above it: a sender its CPU holds at some rate would creep up to it
                # probe by probe, each counted clean, until startup restarted)
                return Verdict("hold", f"probe sent {sent / 1e6:.2f} MB/s, not above btl", self.rate)
            self.btl = min(self.max_rate, self.btl * (1.0 + self._step), sent)
            self._clean_probes += 1
            cap = MAX_PROBE_STEP if self._clean_probes < FAST_PROBES else MAX_FAST_STEP
            self._step = min(cap, 2 * self._step)
            self.increases += 1
            if self._clean_probes >= RESTART_PROBES:
                # Clean probe after clean probe: btl is far under the path (a false queue signal, such as a
                # sender stalled a few ms, ended startup early, and probes of at most 10 % a cycle take seconds
                # back to the link). Startup again from btl: it doubles only on clean phases and ends on the same
                # queue and loss signals.
                self._proven = max(self._proven, self.btl)
                self.rate, self.btl = self.btl, None
                self._clean_at_level = 0
                self._clean_probes = 0
                self._step = PROBE_STEP
                self._restart(now)
                return Verdict("increase", f"{RESTART_PROBES} clean probes in a row: startup again", self.rate)
            return Verdict("increase", f"clean probe: btl {self.btl / 1e6:.2f} MB/s", self.rate)
        return Verdict("hold", "clean", self.rate)

    @staticmethod
    def _late_levels(ph: _Phase) -> dict[Hashable, float]:
        """Per destination, the least queueing delay sampled in the second half of the phase (or its last)."""
        mid = (ph.start + (ph.end if ph.end is not None else ph.start)) / 2
        out: dict[Hashable, tuple[float, float]] = {}  # dest -> (latest sample time before mid, level)
        late: dict[Hashable, float] = {}
        for t, q, dest in ph.queue:
            if t >= mid:
                late[dest] = min(late.get(dest, math.inf), q)
            elif dest not in late and (dest not in out or t > out[dest][0]):
                out[dest] = (t, q)
        return {**{d: q for d, (_, q) in out.items()}, **late}

    def _startup_raise(self, rate: float, now: float, reason: str) -> Verdict:
        """Startup's step up from a proven rate (the current one) to ``rate``."""
        self._clean_at_level = self._cpu_held = 0
        self._cpu_fill = 0.0
        self._proven = max(self._proven, self.rate)
        if min(self.max_rate, rate) <= self.rate:
            # (at max_rate: no new phase, which would be one more short one, its rate measured over a few parts)
            return Verdict("hold", "startup: at the highest rate", self.rate)
        self.rate = min(self.max_rate, rate)
        self._restart(now)
        self.increases += 1
        return Verdict("increase", reason, self.rate)

    def _queue_signal(self, ph: _Phase) -> tuple[float, float | None, float, float] | None:
        """The uplink's queue over a phase from its REPORTs' queueing delays: (seconds queued at its end, growth
        in seconds per second or None where no destination's samples span enough of it, when that level was
        sent, the deepest destination's level), or None without samples. Every destination's datagrams cross the
        uplink's queue, only one destination's its own downlink: so the uplink's is the least over destinations."""
        if not ph.queue:
            return None
        by_dest: dict[Hashable, list[tuple[float, float]]] = {}
        for t, q, dest in ph.queue:
            by_dest.setdefault(dest, []).append((t, q))
        span = Q_SPAN * ((ph.end if ph.end is not None else ph.start) - ph.start)
        # Each sample may sit up to a burst's length late (the receiver reports wherever its top falls in a
        # batch, placed at the pacer's guess of the link rate): the least samples of each half of the phase.
        mid = (ph.start + (ph.end if ph.end is not None else ph.start)) / 2
        level, at, growths, deepest = math.inf, ph.start, [], 0.0
        for samples in by_dest.values():
            samples.sort()
            early = [s for s in samples if s[0] < mid] or samples[:1]
            late = [s for s in samples if s[0] >= mid] or samples[-1:]
            (t0, q0), (t1, q1) = min(early, key=lambda s: s[1]), min(late, key=lambda s: s[1])
            deepest = max(deepest, q1)
            if q1 < level:
                level, at = q1, t1
            if t1 - t0 > max(span, 1e-6):
                growths.append((q1 - q0) / (t1 - t0))
        return level, min(growths) if growths else None, at, deepest

    def _path_congested(self, dest: Hashable, expected: int, lost: int, drops: int, sent: float, margin: float,
                        z: float) -> tuple[float, float] | None:
        """One destination's share of a phase: (its loss, what its path delivered, a little under) when it
        is lossier than that destination's own floor or its receiver's kernel dropped; else None."""
        loss = lost / expected
        floor, floor_var, floor_n = self._floor(sent, dest)
        if drops > KERNEL_DROPS * expected or (
                floor_n > 0 and loss > floor + margin + z * math.sqrt(floor_var + _var(floor, expected))):
            return loss, max(self.min_rate, sent * (1.0 - loss) / max(1e-9, 1.0 - floor) * CUT_MARGIN)
        return None


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
