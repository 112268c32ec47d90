"""Deadlines that tune themselves (sans-I/O): the matchmaking window, the averaging phase deadline, the trainer's
waits for a step, a bucket and an outer average, and the state-sync timeout, each derived from what this node
measured.

Every deadline is ``max(floor, k * measured)`` capped by the constant or flag it replaces (the caller passes that
cap with each question), so a flag stays an upper bound and a node with no measurements yet waits exactly as long
as before. The measurements are the ones the node already takes: round-trip times from the per-peer view, how long
a round's matchmaking took to gather its group, the rates its averages and snapshot downloads achieved, the
seconds a step's round and its compute took. Samples are recent ones only (the last ``SAMPLES``, none older than
``MAX_AGE_S``), so a member that becomes slow stretches the deadlines within a few rounds and one that recovers
releases them.

``DeadlineTuner(mode="fixed")`` measures the same but answers every question with its cap: today's constants, for
comparing a run with and without tuning (``peerd join --deadlines fixed``).

A slow but live member is waited for: its late arrivals and its low rate are samples, and a round that ran to the end
of its window while a member of the last group was missing, and heard from within a few round periods
(``LIVE_ROUNDS``), stretches the next window at once to twice the one it ran out (``STRETCH_K``; a percentile of
recent samples would take several missed rounds to move). The stretch follows the members' arrivals down again, by
half a round at most. The window is also at least twice the latest average's length (``SPREAD_K``): a member that
just slowed ends its average that much after the others, and its first late round must not leave it out.
A dead one is dropped fast: a silent missing member stretches nothing, and a member of this
node's last group that did not publish finishing it is waited for only ``doubt`` (k times how long groups took to
gather), not the whole window.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal, get_args

DeadlineMode = Literal["auto", "fixed"]  # tuned from measurements, or today's constants (the caps)
DEADLINE_MODES: tuple[str, ...] = get_args(DeadlineMode)

SAMPLES = 32  # each measurement keeps its latest this many samples
MIN_SAMPLES = 5  # ... and tunes nothing before it has this many (one quick round says little about the next)
MAX_AGE_S = 600.0  # ... none older than this
MAX_PEERS = 256  # peers whose last-heard time is kept (least recently heard evicted)

# the matchmaking window: k times the 90th percentile of how long recent groups took to gather
WINDOW_FLOOR_S = 1.0
WINDOW_K = 2.0
WINDOW_END_SLACK_S = 0.05  # a group that closed within this of its window's end ran the window out
LIVE_ROUNDS = 3.0  # a member missing from a group is live if heard within this many round periods
# the next window is at least this many times the latest average's length: the member behind the group's slowest
# path ends an average last, up to about an average's length after the others (it receives every owner's part over
# its own link), so a member that just slowed is not left out of the next group while the stretch has yet to learn
SPREAD_K = 2.0
STRETCH_K = 2.0  # a window a live member missed: the next one is this many times as long (up to its cap)
# a member of the last group that did not finish it (dead, or just behind): k times the gather p90, at least this
# (a DHT put and a read: the time its announcement takes to be seen)
DOUBT_FLOOR_S = 0.6
# the averaging phase: silence after the last datagram that ends it (RTT-derived), and its longest
SILENCE_FLOOR_S = 0.5
SILENCE_K = 4.0  # round trips (p99) of silence
# (a live member's trickle keeps a phase open by itself: the phase's own deadline follows the arrivals; this is the
# most it may, so it is generous)
PHASE_FLOOR_S = 5.0
PHASE_K = 10.0  # times a whole average's time at the slowest recent rate
# the trainer's wait for a step's reply: k times the 90th percentile of recent rounds, at least a step's compute
STEP_FLOOR_S = 5.0
STEP_K = 3.0
# an overlapped step's bucket and a DiLoCo outer average: k times the 90th percentile of their own recent rounds
OUTER_FLOOR_S = 10.0
# a state-sync download: k times the largest recent snapshot at the slowest recent download rate
SYNC_FLOOR_S = 10.0
SYNC_K = 4.0

# today's constants: the caps when a caller gives none
DEFAULT_WINDOW_S = 3.0
DEFAULT_SILENCE_S = 1.0
DEFAULT_STEP_WAIT_S = 30.0
DEFAULT_OUTER_WAIT_S = 60.0
DEFAULT_SYNC_TIMEOUT_S = 60.0


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _finite(*xs: float) -> bool:
    return all(isinstance(x, int | float) and math.isfinite(x) for x in xs)


@dataclass(frozen=True, slots=True)
class Derived:
    """One deadline as it stands: its value, the measurement behind it and the bounds it was held within."""

    seconds: float
    # "measured", "floor", "cap" (the flag or constant won), "default" (nothing measured yet), "fixed" (the mode) or
    # "stretched" (the window: a live member missed the last one)
    basis: str
    measurement: str  # what was measured, with its unit
    measured: float | None  # its value (None: no samples yet)
    samples: int
    floor_s: float
    cap_s: float


@dataclass(frozen=True, slots=True)
class DeadlineStatistics:
    """Every derived deadline (``phase_silence``: the quiet after the last datagram that ends an averaging phase;
    ``phase``: an averaging phase's longest, for this node's last vector size; ``doubt``: matchmaking's wait for a
    member of this node's last group that did not finish it; ``bucket_wait``: an overlapped step's
    bucket; ``outer_wait``: a DiLoCo outer average)."""

    window: Derived
    doubt: Derived
    phase_silence: Derived
    phase: Derived
    step_wait: Derived
    state_sync: Derived
    bucket_wait: Derived
    outer_wait: Derived


class _Series:
    """The latest samples of one measurement, with the time each was taken."""

    def __init__(self) -> None:
        self.values: deque[tuple[float, float]] = deque(maxlen=SAMPLES)

    def add(self, value: float, now: float) -> None:
        self.values.append((now, value))

    def expire(self, now: float) -> None:
        while self.values and self.values[0][0] < now - MAX_AGE_S:
            self.values.popleft()

    def quantile(self, q: float) -> float | None:
        return _quantile([v for _, v in self.values], q) if self.values else None

    def oldest(self) -> float | None:
        return self.values[0][0] if self.values else None

    def __len__(self) -> int:
        return len(self.values)


def _derive(measured: float | None, samples: int, k: float, floor: float, cap: float, measurement: str,
            least: int = MIN_SAMPLES, fixed: bool = False) -> Derived:
    """max(floor, k * measured) capped at ``cap``; ``cap`` itself while fewer than ``least`` samples were taken, and
    always when ``fixed``."""
    if fixed:
        return Derived(cap, "fixed", measurement, measured, samples, floor, cap)
    if measured is None or samples < least:
        return Derived(cap, "default", measurement, measured, samples, floor, cap)
    want = k * measured
    if want >= cap or floor >= cap:
        return Derived(cap, "cap", measurement, measured, samples, floor, cap)
    if want <= floor:
        return Derived(floor, "floor", measurement, measured, samples, floor, cap)
    return Derived(want, "measured", measurement, measured, samples, floor, cap)


class DeadlineTuner:
    """The deadlines core: measurements in (``receive_*``, each with ``now`` last), deadlines out (``*_s`` with the
    caller's cap), ``get_timer``/``handle_timer`` to age samples out, ``statistics()`` for status and metrics.

    Inputs that are not finite or are negative are ignored: they come from peers' traffic and timers, and a NaN
    must never become a deadline. ``mode="fixed"``: every deadline is its cap (the measurements still shown)."""

    def __init__(self, mode: DeadlineMode = "auto") -> None:
        if mode not in DEADLINE_MODES:
            raise ValueError(f"deadline mode must be one of {DEADLINE_MODES}")
        self.mode: DeadlineMode = mode
        self._rtts: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer (hex) -> (when, its p99 RTT, s)
        self._gather = _Series()  # matchmaking: round start to group known, s
        self._rate = _Series()  # vector bytes per second an average achieved (both phases)
        self._round = _Series()  # a step's round as the trainer waits for it, s
        self._compute = _Series()  # a step's compute, s
        self._bucket = _Series()  # an overlapped step's bucket round as the trainer waits for it, s
        self._outer = _Series()  # a DiLoCo outer average's rounds, s
        self._sync_rate = _Series()  # bytes per second a snapshot download achieved
        self._sync_size = _Series()  # bytes of a snapshot
        self._heard: OrderedDict[str, float] = OrderedDict()  # peer (hex) -> when last heard
        self._last_group: tuple[str, ...] = ()
        self._stretch = 0.0  # the next window's least: a live member missed the last one (0: none)
        self._spread = 0.0  # ... and SPREAD_K times the latest group average's length
        self._missed: set[str] = set()  # live members the last window ran out without (at most MAX_PEERS: a group)
        self._caps = {"window": DEFAULT_WINDOW_S, "silence": DEFAULT_SILENCE_S, "phase": 60.0,
                      "step": DEFAULT_STEP_WAIT_S, "sync": DEFAULT_SYNC_TIMEOUT_S, "bucket": DEFAULT_STEP_WAIT_S,
                      "outer": DEFAULT_OUTER_WAIT_S}
        self._phase_bytes = 0
        self._now = 0.0

    def _series(self) -> tuple[_Series, ...]:
        return (self._gather, self._rate, self._round, self._compute, self._sync_rate, self._sync_size, self._bucket,
                self._outer)

    def _at(self, now: float) -> None:
        self._now = max(self._now, now)

    # -- inputs ----------------------------------------------------------------------------------
    def receive_rtt(self, peer: str, rtt_p99_s: float | None, last_heard_s: float | None, now: float) -> None:
        """The per-peer view's figures for ``peer`` (hex id): its p99 round-trip time and how long ago it was last
        heard from (None: never, or not measured)."""
        self._at(now)
        if _finite(rtt_p99_s) and 0 <= rtt_p99_s <= MAX_AGE_S:
            self._rtts[peer] = (now, rtt_p99_s)
            self._rtts.move_to_end(peer)
            while len(self._rtts) > MAX_PEERS:
                self._rtts.popitem(last=False)
        if last_heard_s is not None and _finite(last_heard_s) and last_heard_s >= 0:
            self._hear(peer, now - last_heard_s)

    def receive_heard(self, peer: str, now: float) -> None:
        """``peer`` (hex id) was heard from now (e.g. it was in the group just averaged)."""
        self._at(now)
        self._hear(peer, now)

    def _hear(self, peer: str, at: float) -> None:
        if at <= self._heard.get(peer, -math.inf):
            return
        self._heard[peer] = at
        self._heard.move_to_end(peer)
        while len(self._heard) > MAX_PEERS:
            self._heard.popitem(last=False)

    def receive_round(self, *, gather_s: float | None, window_s: float, at_window_end: bool,
                      members: tuple[str, ...], nbytes: int, transfer_s: float, clean: bool, now: float) -> None:
        """A round: ``gather_s`` from its start to the group being known (None: a kept group, no matchmaking), in
        a window of ``window_s`` (``at_window_end``: it ran the window out); ``members`` (hex ids, this node's
        among them; this node alone: no group formed); a vector of ``nbytes`` averaged in ``transfer_s``
        (``clean``: every member was heard, so the rate is the group's pace, not a wait for a dead one)."""
        self._at(now)
        if not _finite(window_s, transfer_s) or window_s <= 0 or transfer_s < 0:
            return
        if gather_s is not None and not (_finite(gather_s) and gather_s >= 0):
            return
        if gather_s is not None and not at_window_end:
            self._gather.add(gather_s, now)
            # the stretch follows the arrivals down: the members came within gather_s, so k times that will do
            self._stretch = max(WINDOW_K * gather_s, self._stretch / 2)
            if self._stretch <= WINDOW_FLOOR_S:
                self._stretch = 0.0
            self._missed -= set(members)
        elif gather_s is not None:
            # the window ran out: if someone of the last group (or a live one that missed an earlier window) is
            # missing but live, it is slow: let it in next time
            missing = (set(self._last_group) | self._missed) - set(members)
            period = self._round.quantile(0.5) or window_s
            since = now - LIVE_ROUNDS * max(period, window_s)
            self._missed = {p for p in missing if self._heard.get(p, -math.inf) >= since}
            if self._missed:
                self._gather.add(window_s, now)  # (k * this: the window grows, up to its cap)
                # ... and at once: the next window is twice this one (window() holds it within its cap)
                self._stretch = min(max(self._stretch, STRETCH_K * window_s), MAX_AGE_S)
        for p in members:
            self._hear(p, now)
        if len(members) > 1:  # (a round alone keeps the group it missed as the one to compare with)
            self._last_group = tuple(members)[:MAX_PEERS]
            self._spread = min(SPREAD_K * transfer_s, MAX_AGE_S)
        if clean and nbytes > 0 and transfer_s > 0:
            self._rate.add(nbytes / transfer_s, now)
            self._phase_bytes = int(nbytes)

    def receive_step(self, *, round_s: float | None, compute_s: float | None, now: float) -> None:
        """A trainer's step: the seconds its round took (None: it did not average) and the seconds of compute
        between its previous reply and this request (None: the session's first step)."""
        self._at(now)
        if round_s is not None and _finite(round_s) and round_s >= 0:
            self._round.add(round_s, now)
        if compute_s is not None and _finite(compute_s) and 0 <= compute_s <= MAX_AGE_S:
            self._compute.add(compute_s, now)

    def receive_bucket(self, round_s: float, now: float) -> None:
        """An overlapped step's bucket averaged in ``round_s`` (from its request: a deferred one's wait included)."""
        self._at(now)
        if _finite(round_s) and 0 <= round_s <= MAX_AGE_S:
            self._bucket.add(round_s, now)

    def receive_outer(self, round_s: float, now: float) -> None:
        """A DiLoCo outer average's rounds took ``round_s``."""
        self._at(now)
        if _finite(round_s) and 0 <= round_s <= MAX_AGE_S:
            self._outer.add(round_s, now)

    def receive_transfer(self, nbytes: int, seconds: float, now: float) -> None:
        """A snapshot of ``nbytes`` downloaded in ``seconds``."""
        self._at(now)
        if _finite(seconds) and seconds > 0 and nbytes > 0:
            self._sync_rate.add(nbytes / seconds, now)
            self._sync_size.add(float(nbytes), now)

    # -- timer -----------------------------------------------------------------------------------
    def get_timer(self) -> float | None:
        """When the oldest sample ages out."""
        oldest = [t for t in (s.oldest() for s in self._series()) if t is not None]
        if self._rtts:
            oldest.append(next(iter(self._rtts.values()))[0])
        return min(oldest) + MAX_AGE_S if oldest else None

    def handle_timer(self, now: float) -> None:
        self._at(now)
        for s in self._series():
            s.expire(now)
        while self._rtts and next(iter(self._rtts.values()))[0] < now - MAX_AGE_S:
            self._rtts.popitem(last=False)

    # -- the deadlines ---------------------------------------------------------------------------
    def _derive(self, measured: float | None, samples: int, k: float, floor: float, cap: float, measurement: str,
                least: int = MIN_SAMPLES) -> Derived:
        return _derive(measured, samples, k, floor, cap, measurement, least, fixed=self.mode == "fixed")

    def window(self, cap_s: float = DEFAULT_WINDOW_S) -> Derived:
        self._caps["window"] = cap_s
        d = self._derive(self._gather.quantile(0.9), len(self._gather), WINDOW_K, min(WINDOW_FLOOR_S, cap_s), cap_s,
                         "gather_p90_s")
        least = max(self._stretch, self._spread)
        if d.basis == "fixed" or least <= d.seconds:
            return d
        if least >= cap_s:
            return Derived(cap_s, "cap", d.measurement, d.measured, d.samples, d.floor_s, cap_s)
        return Derived(least, "stretched", d.measurement, d.measured, d.samples, d.floor_s, cap_s)

    def doubt(self, window_s: float) -> Derived:
        """How long matchmaking waits for a member of this node's last group that did not publish finishing it
        (dead, or a moment behind): k times how long recent groups took to gather, within the window in use."""
        return self._derive(self._gather.quantile(0.9), len(self._gather), WINDOW_K, min(DOUBT_FLOOR_S, window_s),
                            window_s, "gather_p90_s")

    def phase_silence(self, cap_s: float = DEFAULT_SILENCE_S) -> Derived:
        self._caps["silence"] = cap_s
        rtts = [rtt for _, rtt in self._rtts.values()]
        measured = _quantile(rtts, 0.9) if rtts else None
        return self._derive(measured, len(rtts), SILENCE_K, min(SILENCE_FLOOR_S, cap_s), cap_s, "peers_rtt_p99_p90_s",
                       least=1)

    def phase(self, nbytes: int, cap_s: float) -> Derived:
        """The longest an averaging phase of a vector of ``nbytes`` waits: k times the time a whole average of it took
        at the slowest recent rate (a phase is about half of that: the rest is headroom for a member that slows)."""
        self._caps["phase"] = cap_s
        slow = self._rate.quantile(0.0)
        measured = None if slow is None or nbytes <= 0 else nbytes / slow
        return self._derive(measured, len(self._rate), PHASE_K, min(PHASE_FLOOR_S, cap_s), cap_s,
                            "average_at_rate_min_s")

    def step_wait(self, cap_s: float = DEFAULT_STEP_WAIT_S) -> Derived:
        self._caps["step"] = cap_s
        rounds, compute = self._round.quantile(0.9), self._compute.quantile(0.9)
        measured = None if rounds is None else max(rounds, (compute or 0.0) / STEP_K)
        return self._derive(measured, len(self._round), STEP_K, min(STEP_FLOOR_S, cap_s), cap_s, "round_p90_s")

    def bucket_wait(self, cap_s: float = DEFAULT_STEP_WAIT_S) -> Derived:
        self._caps["bucket"] = cap_s
        return self._derive(self._bucket.quantile(0.9), len(self._bucket), STEP_K, min(STEP_FLOOR_S, cap_s), cap_s,
                            "bucket_round_p90_s")

    def outer_wait(self, cap_s: float = DEFAULT_OUTER_WAIT_S) -> Derived:
        self._caps["outer"] = cap_s
        return self._derive(self._outer.quantile(0.9), len(self._outer), STEP_K, min(OUTER_FLOOR_S, cap_s), cap_s,
                            "outer_rounds_p90_s")

    def state_sync(self, cap_s: float = DEFAULT_SYNC_TIMEOUT_S) -> Derived:
        self._caps["sync"] = cap_s
        slow, size = self._sync_rate.quantile(0.1), self._sync_size.quantile(1.0)
        measured = None if slow is None or size is None else size / slow
        return self._derive(measured, len(self._sync_rate), SYNC_K, min(SYNC_FLOOR_S, cap_s), cap_s,
                       "snapshot_at_rate_p10_s", least=1)

    # -- output ----------------------------------------------------------------------------------
    def statistics(self) -> DeadlineStatistics:
        """Each deadline against the cap it was last asked with (today's constant before any)."""
        caps = dict(self._caps)
        stats = DeadlineStatistics(
            window=self.window(caps["window"]), doubt=self.doubt(self.window(caps["window"]).seconds),
            phase_silence=self.phase_silence(caps["silence"]),
            phase=self.phase(self._phase_bytes, caps["phase"]), step_wait=self.step_wait(caps["step"]),
            state_sync=self.state_sync(caps["sync"]), bucket_wait=self.bucket_wait(caps["bucket"]),
            outer_wait=self.outer_wait(caps["outer"]),
        )
        self._caps = caps
        return stats
