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
clean phases sent at a clearly lower rate (``FLOOR_RATE``); the sampling noise is that of both samples' pooled
loss (a floor that read low by chance does not make the noise look small too), and in the cycle, where such
phases are few (an average's tail, a drain), a floor of under ``FLOOR_SAMPLE`` datagrams asks ``THIN_Z`` sigma.
That is the first distinction between random loss and congestion: random loss is the same at every rate,
overflow at the bottleneck appears only above its rate. A phase lossier than its floor (beyond its sampling
noise) is congestion; a phase no lossier is clean, whatever its loss. Random loss alone never slows it.

The second is the **queue** (where receivers give arrival times: REPORT's ``arrived``, the kernel's receive
time of the interval's last datagram). Against when this sender sent it, that is the path's one-way delay
plus a constant clock offset; above the least of recent samples (transport.qdelay), time spent in queues.
A phase's uplink queue is the least over its destinations (every destination's datagrams cross the uplink's
queue, only one its own downlink) of the least late sample (a sample may sit a burst late). So:

* loss above the floor with the destinations' typical queue (their upper median: no one destination sets it,
  neither one lying low nor one whose receiver reads late on a loaded CPU) under ``Q_EXCUSE`` at a rate the path
  delivered lately is random (a queue overflows only once full, and what got through then waited in it):
  nothing is cut; at a rate it has not delivered, it is a bottleneck with no queue to speak of (a policer, a
  shallow switch buffer), congestion;
* a queue above ``Q_HIGH`` in ``DEEP_PHASES`` judged phases in a row is congestion before any overflow: btl
  goes to what the link carried (the phase's rate / (1 + the queue's growth), less what it lost beyond the
  floor), ``DELAY_MARGIN`` under; unless it is draining (``DRAINING``): the path then carries more than was sent;
* a probe that takes the queue above ``Q_PROBE`` per ``PHASE_S`` it has run (a thin link's phases, which must
  hold ``PHASE_BYTES``, are longer) is not clean (no raise; a drain follows), and startup ends on a queue that
  is deep and growing, before it overflows.

A burst (one GSO send) crosses the bottleneck datagram by datagram: SendPositions places each at btl's rate
after the burst's time (a sample deep in a burst never sets the base: the rate may be wrong), and a batch
that went out late (a sender woken late on a loaded CPU) is re-timed to when it went.

The rate follows a bottleneck estimate ``btl`` (bytes/s the uplink carries):

* **Startup** at ``START_RATE`` (low: 16 Mbit/s): two clean phases at the current rate double it (a queue
  absorbs a first phase's overshoot: it looks clean; the second shows it), or one whose queue was seen empty at
  its end (``Q_FLAT``: nothing absorbed; a path's first sample, which sets its base, proves nothing). Only a phase
  that sent at least ``HELD_BACK`` of its rate counts: one held back proved what it sent, not the rate. The first
  congested phase ends it. On a link under START_RATE a destination reports once or twice a phase: a phase's queue
  growth then runs from the destination's last sample before it, a queue that rose from empty to deep since then
  ends startup, and so does one that stood deep two phases while they lost beyond ``STARTUP_MARGIN``.
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
  Where a cut left btl under ``RECOVER_BELOW`` of what a clean phase of the cycle delivered lately (the history),
  probes go at ``RECOVER_PROBE`` and a clean one raises btl to what it sent (up to ``RECOVER_TO`` of that rate): a
  lossy burst or a downlink several senders met at once cuts deep, and at 10 % a cycle a thin link's member took
  20-30 s back. A recovery probe that overruns the path (it did drop) ends that: the phases before it stop counting.
  So does a cut for receivers' kernel drops (their CPU sets what they take).
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
phase; only a sender's first average starts at START_RATE. The aging is caution, not evidence: the new
average's first clean phase (sent at its rate) brings ``btl`` back toward the rate before the gap, at most
doubling it per phase. Otherwise short averages seconds apart (DiLoCo's outer steps, too short for a probe)
would each confirm only the aged rate, and the aging compounded them down toward START_RATE.

tests/test_pacing.py holds it to its goals in virtual time (4 nodes on 100 Mbit/s tbf links with a 20 ms queue,
random loss 0-10 %, late and jittery REPORTs, receivers stalled 60 ms in every 200 ms): the uplinks over 90 %
full after startup, and well under 1 % lost beyond the links' random loss in steady state. In the lab:
`peerd bench allreduce --peers 4 --size 5000000 --link 100mbit --json` (``link_utilization``, ``excess_loss``).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

from .pacing_judge import Judgement, State
from .pacing_params import (
    BASE_PLACED,
    BURST_S,
    CATCHUP_S,
    CYCLE,
    DELAY_GAIN,
    DELAY_K,
    DEV_GAIN,
    DRAIN,
    FAST_STARTUP_MIN,
    FAST_STARTUP_RATE,
    FIRST_REPORT,
    HISTORY,
    IDLE_S,
    JUDGE_LAG_S,
    MAX_JUDGE_LAG_S,
    MAX_PATHS,
    MAX_PENDING,
    MAX_RATE,
    MEMORY_HALF_LIFE_S,
    MIN_RATE,
    PHASE_BYTES,
    PHASE_S,
    PROBE,
    PROBE_STEP,
    RECOVER_PROBE,
    START_DATAGRAM,
    START_RATE,
    start_rate,
)
from .pacing_records import DeliveryMeter, Report, SendPositions, Verdict, _Cap, _Frontier, _Phase, _Record, _SendLog
from .qdelay import QueueDelay

__all__ = ["BURST_S", "CYCLE", "FAST_STARTUP_MIN", "FAST_STARTUP_RATE", "FIRST_REPORT", "PHASE_S", "START_RATE",
           "DeliveryMeter", "Pacer", "PacerStatistics", "Report", "SendPositions", "State", "Verdict", "start_rate"]


@dataclass(frozen=True, slots=True)
class PacerStatistics:
    """A snapshot of the pacer: its rate and bottleneck estimate (bytes/s; btl None in startup), its state, the last
    judged phase's uplink queue (seconds; None before one), and how often it cut, raised and resumed."""

    rate: float
    btl: float | None
    state: str
    queue_delay: float | None
    decreases: int
    increases: int
    resumes: int


class Pacer(Judgement):
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
        self._btl: float | None = None  # the bottleneck estimate; None during startup
        self.state = State.STARTUP  # (pacing_judge.TRANSITIONS)
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
        self._last_q: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # dest -> its last (sent, queue)
        self._deep = 0  # judged phases in a row whose queue stood above Q_HIGH
        self._growth: tuple[float, float] | None = None  # (when, growth) the last phase that spanned enough measured
        self._standing: tuple[float, float] | None = None  # (level, sent) at the last cut a non-growing queue caused
        self.queue_delay: float | None = None  # the last judged phase's uplink queue, seconds
        self.decreases = 0
        self.increases = 0
        self.resumes = 0  # averages started from memory after an idle gap
        self._recall: float | None = None  # btl before the last idle gap aged it, until a clean phase brings it back
        self._recover_after = -math.inf  # clean phases before this say nothing of what the path carries now

    @property
    def mode(self) -> str:
        return self.state.value

    def statistics(self) -> PacerStatistics:
        return PacerStatistics(self.rate, self._btl, self.state.value, self.queue_delay, self.decreases,
                               self.increases, self.resumes)

    @property
    def btl(self) -> float | None:
        """The bottleneck estimate, bytes/s (None in startup)."""
        return self._btl

    @btl.setter
    def btl(self, value: float | None) -> None:
        """Set from outside (a test placing the pacer in its cycle): the state follows."""
        self._btl = value
        self._recall = None
        self.state = State.STARTUP if value is None else State.CYCLE

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
    def reserve(self, nbytes: int, dest: Hashable, now: float) -> float:
        """Account for sending ``nbytes`` to ``dest`` (None: no destination to report on it) now; returns how long to
        wait before sending them."""
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
        recovery = False
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
            recovery = i == PROBE and self.recovering()
            self.rate = min(self.max_rate, max(self.min_rate, (RECOVER_PROBE if recovery else CYCLE[i]) * self.btl))
        self._phases.append(_Phase(now, self.rate, kind))
        self._phases[-1].recovery = kind == "probe" and recovery
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
            # (what a clean phase of this average brings btl back to: aged too, so an average with none to show
            # recalls less, but not compounded with what the path has carried since)
            self._recall = self.btl if self._recall is None else max(self.btl, aged(self._recall))
            self._btl = max(self.min_rate, aged(self.btl))
            # The cycle goes on where the last average left it, but from a cruise phase (an idle gap drained the
            # queue: no drain is due, and no probe before the first phase is judged): averages shorter than a
            # cycle each still take their turn at a probe, and btl can rise.
            self._cycle_at = len(CYCLE) - 1 if self._cycle_at == PROBE else max(self._cycle_at, DRAIN + 1)
        else:
            # (startup's last doubling was not judged clean yet: an average that ended first, its phases short of
            # data, proved nothing at it. Resumed there, a backlogged sender overran the queue at once: 16
            # daemons on 2 cores lost 7 % of a Moshpit round's second average, sent at twice the link.)
            self.rate = min(self.max_rate, max(self.min_rate, aged(min(self.rate, max(self.start_rate, self._proven)))))
        for dest, cap in list(self._caps.items()):
            cap.rate /= decay
            if cap.rate >= (self.btl if self.btl is not None else self.rate):
                del self._caps[dest]
        self._recover_after = now  # (the phases before the gap are the recall's business, not recovery's)
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

    # -- feedback ----------------------------------------------------------------------------------
    def receive_report(
        self, dest: Hashable, report: Report, sent_span: tuple[float, float] | None, placed: float, now: float,
    ) -> Verdict:
        """Pool one receiver's interval report, received at ``now``, into the phase its datagrams were
        sent in; judge the phases whose reports are all in.

        ``sent_span``: when this sender sent the first and the last datagram of the interval (the driver
        knows from ``report.position``). Without it (None) the interval is taken to end ``now``. ``placed``: how
        far into its batch the last one was placed (SendPositions.placed; 0.0 where unknown): a sample placed more
        than BASE_PLACED into a burst does not set the path's base delay."""
        self._advance(now)
        r = report
        if sent_span is not None and r.expected > 0:
            self._note_delay(dest, sent_span, r.position == r.expected, now)
            if r.arrived > 0:
                # the datagram at the top of the interval: sent at sent_span[1], arrived at r.arrived
                q = self._queues.sample(dest, r.arrived - sent_span[1], sent_span[1], base=placed <= BASE_PLACED)
                at = self._phase_at(sent_span[1])
                if q is not None:
                    if at is not None:
                        if at.kind == "startup" and dest not in at.lead:
                            at.lead[dest] = self._last_q.get(dest)
                        at.queue.append((sent_span[1], q, dest))
                    last = self._last_q.get(dest)
                    if last is None or last[0] <= sent_span[1]:
                        self._last_q[dest] = (sent_span[1], q)
                    self._last_q.move_to_end(dest)
                    while len(self._last_q) > self.max_paths:
                        self._last_q.popitem(last=False)
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
