"""The pacer's judgement of a phase (transport/pacing.py's docstring says what it is for): explicit states and the
transitions between them, and the steps of one judgement, each small enough to read on its own.

States: ``STARTUP`` (no bottleneck estimate: the rate doubles on clean phases) and ``CYCLE`` (``btl`` known: probe,
drain and cruise phases around it). What a judgement may do to them is ``TRANSITIONS``; each event's effect on the
pacer's bookkeeping is ``Judgement._transition``'s, the one place where the state changes.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from typing import Any

from .pacing_params import (
    APP_LIMITED,
    CARRIED_PHASES,
    CARRIED_SLACK,
    CPU_HELD,
    CPU_HELD_BYTES,
    CUT_MARGIN,
    CYCLE,
    DEEP_PHASES,
    DELAY_MARGIN,
    DRAIN,
    DRAINING,
    EARLY_SAMPLE,
    EARLY_Z,
    FAST_PROBES,
    FLAT_GROWTH,
    FLOOR_PHASES,
    FLOOR_RATE,
    FLOOR_SAMPLE,
    HELD_BACK,
    KERNEL_DROPS,
    LOSS_MARGIN,
    MAX_CUT,
    MAX_FAST_STEP,
    MAX_JUDGE_LAG_S,
    MAX_PROBE_STEP,
    MIN_SAMPLE,
    PATH_GROWTH,
    PATH_MARGIN,
    PATH_PERSIST,
    PATH_Z,
    PHASE_BYTES,
    PHASE_FILL,
    PROBE_FAIL_CUT,
    PROBE_STEP,
    Q_EXCUSE,
    Q_FLAT,
    Q_HIGH,
    Q_PROBE,
    Q_SPAN,
    RECOVER_BELOW,
    RECOVER_TO,
    RESTART_PROBES,
    STANDING_KEEP,
    STARTUP_GROWTH,
    STARTUP_GROWTH_MIN,
    STARTUP_MARGIN,
    STARTUP_PHASES,
    STARTUP_Z,
    THIN_Z,
    Z,
)
from .pacing_records import Floor, QueueSignal, Verdict, _Cap, _Phase, _Record, _var, above_floor


class State(enum.Enum):
    STARTUP = "startup"  # no bottleneck estimate: clean phases double the rate
    CYCLE = "cycle"  # btl known: probe, drain and cruise phases around it


class Event(enum.Enum):
    CUT = "cut"  # congestion: btl goes to what the path delivered; a drain phase next
    PROBE_QUEUED = "probe_queued"  # a probe filled the queue: no raise; a drain phase next
    CLEAN_PROBE = "clean_probe"  # a clean probe raised btl
    RESTART = "restart"  # RESTART_PROBES clean probes in a row: btl is far under the path, startup again from it
    STEP_UP = "step_up"  # startup proved its rate: the next one


# What each state may do on each event (h11's shape: anything not here is a bug, PacerStateError). A probe phase
# opened before a RESTART may still be judged in STARTUP, so PROBE_QUEUED is allowed there too.
TRANSITIONS: dict[State, dict[Event, State]] = {
    State.STARTUP: {
        Event.CUT: State.CYCLE,
        Event.STEP_UP: State.STARTUP,
        Event.PROBE_QUEUED: State.STARTUP,
    },
    State.CYCLE: {
        Event.CUT: State.CYCLE,
        Event.PROBE_QUEUED: State.CYCLE,
        Event.CLEAN_PROBE: State.CYCLE,
        Event.RESTART: State.STARTUP,
    },
}


class PacerStateError(RuntimeError):
    """An event the pacer's state has no transition for."""


def next_state(state: State, event: Event) -> State:
    """Where ``event`` takes ``state`` (TRANSITIONS)."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise PacerStateError(f"no transition from {state.name} on {event.name}") from None


class Judgement:
    """The Pacer's judging methods (a base class of Pacer, which holds the state they use)."""

    state: State
    _btl: float | None
    rate: float
    _cycle_at: int
    _step: float
    _clean_probes: int
    _clean_at_level: int
    _proven: float
    _recall: float | None
    _recover_after: float
    increases: int
    _restart: Any  # Pacer._restart(now): the current phase ends, a new one starts at the rate

    def _transition(self, event: Event, now: float) -> None:
        """Take ``event``: the new state (TRANSITIONS) and the bookkeeping it brings. ``btl`` (``_btl``) and, for
        STEP_UP, the new rate are set by the caller first."""
        state = next_state(self.state, event)
        if event is Event.CUT or event is Event.RESTART:
            self._recall = None  # (the path has spoken since the gap)
        if event is Event.CUT or event is Event.PROBE_QUEUED:
            self._cycle_at = DRAIN
            self._step = PROBE_STEP
            self._clean_probes = 0
            self.state = state
            self._restart(now)
        elif event is Event.CLEAN_PROBE:
            self._clean_probes += 1
            cap = MAX_PROBE_STEP if self._clean_probes < FAST_PROBES else MAX_FAST_STEP
            self._step = min(cap, 2 * self._step)
            self.increases += 1
        elif event is Event.RESTART:
            assert self._btl is not None
            self._proven = max(self._proven, self._btl)
            self.rate, self._btl = self._btl, None
            self._clean_at_level = 0
            self._clean_probes = 0
            self._step = PROBE_STEP
            self.state = state
            self._restart(now)
        else:  # STEP_UP
            self._restart(now)
            self.increases += 1
        self.state = state


    # -- floors and due phases -----------------------------------------------------------------------------
    def _carried(self, rate: float) -> bool:
        """One of the last CARRIED_PHASES clean phases delivered about ``rate`` bytes/s or more (what it sent less
        what it lost)."""
        need = rate / CARRIED_SLACK
        recent = list(self._history)[-CARRIED_PHASES:]
        return any(rec.sent * (1.0 - rec.lost / rec.expected) >= need for rec in recent if rec.expected > 0)

    def _floor(self, sent: float, dest: Hashable = None) -> Floor:
        """The random-loss floor for a phase sent at ``sent`` bytes/s (to ``dest``; None: all destinations): the
        pooled loss of recent clean phases sent at most FLOOR_RATE of that, judged at THIN_Z in the cycle where they
        hold under FLOOR_SAMPLE datagrams. (In the cycle the phases under FLOOR_RATE of a cruise are few, an
        average's tail or a drain after a cut: at 10 Mbit/s such floors read 0.000-0.014 under 5 % random loss,
        and at Z they cut cruise after cruise that lost only the link's 5 %.) Empty without any."""
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
            return Floor()
        thin = self.btl is not None and expected < FLOOR_SAMPLE  # (startup's floors are all thin: STARTUP_MARGIN)
        return Floor(lost / expected, expected, THIN_Z if thin else 0.0)

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
        margin = STARTUP_MARGIN if self.btl is None else LOSS_MARGIN
        return above_floor(ph.lost / ph.expected, ph.expected, self._floor(sent), margin, EARLY_Z)

    # -- one phase's judgement ---------------------------------------------------------------------------------
    def _judge(self, ph: _Phase, now: float) -> Verdict | None:
        """Judge a phase whose REPORTs are in (or overdue): its destinations first, then the uplink's loss against
        its floor and its queue. A congested phase cuts (``_congested``), a clean one may raise (``_clean``);
        what changes the pacer's state goes through TRANSITIONS."""
        assert ph.end is not None
        # (at low rates a phase holds a part or two: the log's count may overstate its rate, never the bucket)
        sent = min(ph.rate, self.sent_rate(ph.start, ph.stop()))
        if ph.expected < MIN_SAMPLE or sent <= 0:
            return None
        margin, z = (STARTUP_MARGIN, STARTUP_Z) if self.btl is None else (LOSS_MARGIN, Z)
        paths, hot, (expected, lost, drops) = self._judge_paths(ph, margin, z)
        loss = lost / expected
        floors = self._floor(sent)
        floor = floors.loss
        reason = ""
        if drops > KERNEL_DROPS * expected:
            reason = f"{drops} datagrams dropped by receivers' kernels"
        elif above_floor(loss, expected, floors, margin, z):
            reason = f"loss {loss:.3f} above the floor {floor:.3f} ({ph.kind} at {sent / 1e6:.2f} MB/s)"
        delay_cut = None
        signal = self._queue_signal(ph)
        if signal is not None:
            self.queue_delay = signal.level
            if reason.startswith("loss") and signal.typical < Q_EXCUSE and self._carried(sent * (1.0 - floor)):
                # A queue overflows only once full, and the datagrams that got through then waited in it: loss
                # above the floor with the queue shallow toward most destinations, at a rate the path has carried
                # lately, is the link's (its random loss's noise, a lossy patch, a receiver's downlink). (Most: one
                # member that lies about its arrival times must not hide an overflow, nor one read late excuse
                # none.) Not at a rate it has not carried:
                # a bottleneck with little or no queue (a policer, a shallow switch buffer) drops above its rate
                # with the queue empty, and excused so, startup ran on to the maximum rate, 98 % lost (virtual
                # time: 100 Mbit/s with 1-2.5 ms of queue, 1 Gbit/s with 2 ms).
                reason = ""
        if not reason and signal is not None and ph.kind != "drain":
            queued = self._judge_queue(ph, sent, loss, floor, signal, now)
            if isinstance(queued, Verdict):
                return queued
            if queued is not None:
                reason, delay_cut = queued
        if reason:
            return self._congested(ph, sent, loss, floor, reason, delay_cut, signal, now)
        path_verdict = self._judge_caps(paths, hot)
        if ph.start >= self._quiet_until:
            # (a phase sent while the last overshoot's queue drained lost what that queue overflowed: as a floor
            # it would hide the next overrun; after a cut on a link that had halved, such phases at a third of
            # their data lost would pass for clean, no floor being known at their rate yet)
            self._history.append(_Record(sent, ph.expected, ph.lost,
                                         {d: v for d, v in paths.items() if d not in hot}, ph.kind, ph.start))
        if hot:  # (the aggregate floor keeps them: their loss is part of what this uplink's phases see)
            return path_verdict
        return self._clean(ph, sent, signal, now)

    def _judge_paths(self, ph: _Phase, margin: float, z: float) -> tuple[
            dict[Hashable, tuple[int, int, float]], dict[Hashable, tuple[float, float]], tuple[int, int, int]]:
        """Destinations first: one whose own path congests while the rest of the uplink's traffic is clean has a
        bottleneck of its own (its downlink, its CPU): a cap for it, not a cut of the uplink's rate. Returns each
        destination's (expected, lost, sent rate), the destinations clearly lossier than the rest (their loss,
        what their path delivered), and the (expected, lost, kernel drops) the uplink is judged by."""
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
        return paths, hot, (expected, lost, drops)

    def _queue_growth(self, ph: _Phase, signal: QueueSignal) -> float:
        """The uplink queue's growth over the phase, seconds per second: measured, or where no destination's
        samples spanned enough of the phase, where a probe's queue stood late in it tells its growth (the cruise
        before a probe left the queue empty), or a drain the phase before it measured."""
        level, growth, at = signal.level, signal.growth, signal.at
        assert ph.end is not None
        if growth is not None:
            self._growth = (at, growth)
            return growth
        late = ph.kind == "probe" and at - ph.start > Q_SPAN * (ph.end - ph.start)
        if late and level > Q_HIGH:
            return level / (at - ph.start)
        if ph.kind != "probe" and self._growth is not None and at - self._growth[0] <= 3 * self.phase_s:
            return min(0.0, self._growth[1])  # (a short phase: a drain the phase before it measured)
        return 0.0

    def _judge_queue(self, ph: _Phase, sent: float, loss: float, floor: float,
                     signal: QueueSignal, now: float
                     ) -> Verdict | tuple[str, float] | None:
        """A phase clean by its loss, judged by its queue: a probe that filled it (a Verdict: no raise, a drain
        next), congestion before any overflow (its reason, and what the link carried: btl's new value before the
        margin), or None."""
        level = signal.level
        growth = self._queue_growth(ph, signal)
        # what the link carried while the queue grew (a full queue grows no more: its overflow is the rest); of a
        # growth measured from a sample before the phase, the phase's own share
        added = signal.added if signal.added is not None and signal.growth is not None else growth
        measured = sent / (1.0 + max(0.0, added)) * min(1.0, (1.0 - loss) / max(1e-9, 1.0 - floor))
        # (a phase sent before the last cut drained shows that overshoot's queue, acted on already; one that
        # used little of its rate, the tail of an average, shows the queue of the bursts before it)
        fresh = ph.start >= self._quiet_until and sent >= APP_LIMITED * ph.rate
        self._deep = self._deep + 1 if level > Q_HIGH else 0
        if fresh and ph.kind == "probe" and level > Q_PROBE * max(1.0, (signal.at - ph.start) / self.phase_s):
            # A probe above the link filled the queue: no raise, and a drain empties what it left. (Taken as a
            # measurement of the link, sent / (1 + growth), it read low in the lab: a sender woken late on
            # loaded cores bursts, and its bursts queue below the link's rate.) Q_PROBE is what a phase_s of
            # probing queues: a longer phase (a thin link's, which must hold PHASE_BYTES) queues in proportion,
            # and judged against Q_PROBE alone, probes at 10 Mbit/s failed from 0.94 of the link on.
            self._recovery_failed(ph, now)
            self._transition(Event.PROBE_QUEUED, now)
            return Verdict("hold", f"probe at {sent / 1e6:.2f} MB/s: queue {1e3 * level:.1f} ms", self.rate)
        if ph.kind == "startup":
            # (in startup a burst's datagrams are not placed in time, btl being unknown: each sample may sit a
            # burst late, so a deep queue ends it only where it grows, or where it stood deep DEEP_PHASES
            # judged phases in a row while the sender could not send its rate: a socket the link pushed back
            # on. Without that, a startup above the link holds a deep queue until it overflows, and ends far
            # under the link. The deep queue alone would end startup early on 64 KB bursts with late REPORTs
            # (tests/test_pacing.py).)
            pushed_back = self._deep >= DEEP_PHASES and sent < HELD_BACK * ph.rate
            # (A thin link's phases hold a REPORT or two per destination, too few to see the queue grow in:
            # one that rose from empty since the last phase filled it, and one that stood deep DEEP_PHASES
            # phases in a row while they lost beyond STARTUP_MARGIN is full and overflowing. Held there, a
            # first average at 1.6x a 10 Mbit/s link lost 35-40 % until it ended.)
            overflowing = self._deep >= DEEP_PHASES and loss > STARTUP_MARGIN + STARTUP_Z * math.sqrt(
                _var(loss, max(1, ph.expected)))
            congested = fresh and level > Q_HIGH and (growth > STARTUP_GROWTH_MIN or pushed_back or overflowing
                                                      or self._rose_from_empty(ph))
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
            if congested and growth <= 0.0 and self._offset(ph, level, sent, now):
                congested = False
        if self._standing is not None and level < STANDING_KEEP * self._standing[0]:
            self._standing = None  # it drained: a real queue (one that only dipped under Q_HIGH did not)
        if not congested:
            return None
        self._standing = (level, sent) if growth <= 0.0 else None
        # The uplink's queue filled while the phase sent at ``sent``: no loss yet, and what the link carried is
        # known (a standing queue that did not grow: ``sent`` was at most that).
        return f"queue {1e3 * level:.1f} ms, growing {growth:.2f} s/s ({ph.kind} at {sent / 1e6:.2f} MB/s)", measured

    @staticmethod
    def _seen_empty(ph: _Phase) -> bool:
        """A sample of the phase, not a path's first (which sets its base: it reads 0 whatever the queue), read the
        queue empty (``Q_FLAT``). A thin link's first phase may hold only the first REPORTs: at 1.6x a 10 Mbit/s
        link it filled the queue unseen, passed for flat, and startup doubled into a 70 % loss."""
        first: set[Hashable] = {d for d, lead in ph.lead.items() if lead is None}
        for _, q, dest in sorted(ph.queue, key=lambda s: s[0]):
            if dest in first:
                first.discard(dest)
            elif q <= Q_FLAT:
                return True
        return False

    @staticmethod
    def _rose_from_empty(ph: _Phase) -> bool:
        """Toward every destination the queue stood empty (``Q_FLAT``) at its last sample before the phase, no more
        than a phase before it, and deep (``Q_HIGH``) in the phase's second half: a thin link's startup phase
        filled it. (Its growth, measured from that sample, is capped by the queue's size: 16 ms over 83 ms read
        0.19 s/s at 1.6x a 10 Mbit/s link with 20 ms of queue.)"""
        assert ph.end is not None
        length = ph.end - ph.start
        mid = ph.start + length / 2
        by_dest: dict[Hashable, list[tuple[float, float]]] = {}
        for t, q, dest in ph.queue:
            by_dest.setdefault(dest, []).append((t, q))
        for dest, samples in by_dest.items():
            samples.sort()
            lead = ph.lead.get(dest)
            if lead is None or not (ph.start - length <= lead[0] < samples[0][0]) or lead[1] > Q_FLAT:
                return False
            late = [q for t, q in samples if t >= mid] or [samples[-1][1]]
            if min(late) <= Q_HIGH:
                return False
        return bool(by_dest)

    def _offset(self, ph: _Phase, level: float, sent: float, now: float) -> bool:
        """A queue that stood as deep as at the last cut it caused, neither growing nor draining, while this sender
        sent less than then: a real queue drains under the link's rate, so this is an offset in the base delay
        (one sample that read low, a receive timestamp taken before a descheduling). The base is raised by it on
        every destination's path and nothing is cut: without that, each cut to what was sent lowered btl
        again (the bench: 8.4 -> 1.7 MB/s on a 12 MB/s link, a 9.5 ms queue standing through six averages)."""
        if self._standing is None:
            return False
        was_level, was_sent = self._standing
        if level < STANDING_KEEP * was_level or sent >= was_sent:
            return False
        for dest in {d for _, _, d in ph.queue}:
            self._queues.rebase(dest, level, now)
        self._standing = None
        return True

    def _congested(self, ph: _Phase, sent: float, loss: float, floor: float, reason: str, delay_cut: float | None,
                   signal: QueueSignal | None, now: float) -> Verdict:
        """A congested phase: nothing for a drain or a phase of an overshoot already cut for; else btl goes to what
        the path delivered beyond its random loss (the CUT transition)."""
        if ph.kind == "drain":
            # The probe before it filled the queue (or the overshoot before the last cut did): says nothing
            # against btl. (A path too slow even for the drain rate congests the cruise phases after it.)
            return Verdict("hold", "the probe's queue: " + reason, self.rate)
        if ph.start < self._quiet_until and (self.btl is None or sent < self.btl):
            # Sent below the new estimate while the queue the last overshoot filled was still draining:
            # its loss is that overshoot's, already acted on. (One sent at or above it says how far the
            # overshoot really went: a phase the queue filled only late in understates it. What it sent counts,
            # not its rate: a startup phase at 16 MB/s that sent 9.7 cut a btl of 10.2 to 7.4 in the lab.)
            return Verdict("stale", "sent before the last decrease drained: " + reason, self.rate)
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
        btl = delivered if self.btl is None else min(self.btl, delivered)
        if ph.kind == "probe" and delay_cut is None:
            # A probe that overflowed says the queue was not empty, so the cruise rate under it was too
            # high as well (what it delivered is no bound on that: a probe's gain is on top).
            btl = max(self.min_rate, btl * PROBE_FAIL_CUT)
        self._btl = btl
        self._recovery_failed(ph, now)
        if ph.drops > KERNEL_DROPS * max(1, ph.expected):
            # (receivers' sockets overflowed: their CPU, not the path, set what they take; no fast way back)
            self._recover_after = now
        self._transition(Event.CUT, now)
        self._quiet_until = now + self._span(self.rate, self.phase_s)
        if signal is not None:
            # (the queue it found drains at the drain phase's margin under the link: no phase before it has
            # had the time to is held against the new rate; also after an overflow, whose full queue a
            # phase sent at 0.7 of the link still met and cut for, 0.6 of the link after it halved)
            self._quiet_until += min(MAX_JUDGE_LAG_S, signal.level / (1.0 - CYCLE[DRAIN]))
        self.decreases += 1
        return Verdict("decrease", reason, self.rate)

    def _judge_caps(self, paths: dict[Hashable, tuple[int, int, float]],
                    hot: dict[Hashable, tuple[float, float]]) -> Verdict | None:
        """Per destination in a phase the uplink passed: a cap for one lossier than the rest PATH_PERSIST phases in
        a row, a cap that grows for one that is clean again."""
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
        return path_verdict

    def _clean(self, ph: _Phase, sent: float, signal: QueueSignal | None,
               now: float) -> Verdict:
        """A clean phase: it raises the rate only where it used its rate and sent enough to prove it."""
        startup = self.btl is None
        if sent < APP_LIMITED * ph.rate:
            # (also a bursty sender held back by the rate in its bursts: raising its rate on that lets its bursts
            # overrun a 20 ms queue, and its btl grow past the link on clean probes)
            return Verdict("hold", f"sender used {sent / ph.rate:.2f} of its rate", self.rate)
        if (startup or ph.kind == "probe") and ph.nbytes < PHASE_BYTES * PHASE_FILL:
            # A part or two, measured up to its last send, is sent at a rate only for a moment a queue absorbs: it
            # proves no headroom: doubling on single 64 KB parts takes 16 daemons on 2 cores to 5x the link. (Where
            # a phase at its rate holds PHASE_BYTES only if sent to the full, at START_RATE or a thin link's rate,
            # PHASE_FILL of it: a phase's parts go out a few ms late and fall a little short. Asked for all of
            # it, one probe in two at 10 Mbit/s raised nothing, and btl took seconds back up after a cut.)
            return Verdict("hold", f"too little sent to prove a rate ({ph.nbytes} bytes)", self.rate)
        if startup:
            return self._clean_startup(ph, sent, signal, now)
        if self._recall is not None and ph.kind != "drain" and sent >= HELD_BACK * ph.rate:
            return self._recalled(sent, now)
        if ph.kind == "probe":
            return self._clean_probe(sent, now, ph.recovery)
        return Verdict("hold", "clean", self.rate)

    def _recalled(self, sent: float, now: float) -> Verdict:
        """A clean phase sent at its rate after an idle gap aged btl: the path carries what it did, so btl goes back
        toward its value before the gap (``_recall``), at most doubling what the phase sent, never above it."""
        assert self._btl is not None and self._recall is not None
        btl = min(self._recall, max(self._btl, 2.0 * sent))
        if btl >= self._recall:
            self._recall = None
        if btl <= self._btl:
            return Verdict("hold", "clean", self.rate)
        self._btl = btl
        self._restart(now)
        return Verdict("increase", f"clean after an idle gap: btl back to {btl / 1e6:.2f} MB/s", self.rate)

    def _clean_startup(self, ph: _Phase, sent: float, signal: QueueSignal | None,
                       now: float) -> Verdict:
        """A clean startup phase: two at one rate (or one with its queue seen empty) double it (STEP_UP)."""
        if ph.rate < self.rate:  # an older level: the current one has not been judged yet
            return Verdict("hold", "startup: an older rate", self.rate)
        if signal is not None and signal.level > Q_HIGH:
            # (a deep queue that is not seen growing does not end startup, since a sample may sit a burst late,
            # but it is no proof of headroom either: doubling on it took 16 daemons' rates to 5x the link; nor do
            # the clean phases before it count toward a doubling: at 8 Mbit/s a later phase with no sample of the
            # queue doubled the rate on them)
            self._clean_at_level = 0
            return Verdict("hold", f"startup: queue {1e3 * signal.level:.1f} ms at this rate", self.rate)
        # (measured from its first part: the part before the doubling, reserved at half the rate, may take
        # the phase's first ms; a 64 KB part at 2 MB/s is 32 ms)
        began = max(ph.start, ph.first_at)
        fill = min(ph.rate, self.sent_rate(began, ph.stop())) if ph.stop() - began > 0.5 * (ph.stop() - ph.start) \
            else sent
        # The queue may have hidden the first clean phase's overshoot, unless it was seen empty at its end
        flat = signal is not None and signal.level <= Q_FLAT and self._seen_empty(ph) and (
            signal.growth is None or signal.growth <= FLAT_GROWTH)
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

    def recovering(self) -> bool:
        """Probes go at RECOVER_PROBE (``_recover_to``)."""
        return self._recover_to() is not None

    def _recover_to(self) -> float | None:
        """What the path delivered in a clean phase of the cycle lately (the history: 1.6 s at 100 Mbit/s, several
        seconds on a thin link), times RECOVER_TO, where btl stands under RECOVER_BELOW of it (else None): a cut went
        far under a rate the path carried (a lossy burst, downlinks that several senders' overshoots met at once).
        Probes then go at RECOVER_PROBE and a clean one raises btl to what it sent, up to that: at the usual 10 % a
        cycle, and a thin link's cycle is 0.6-1.4 s, one member cut to 0.4-0.5 of a 10 Mbit/s link held 8 peers'
        rounds at 2-3x for 20-30 s. Where the path did drop, the first recovery probe overruns it and the phases
        before it stop counting (``_recovery_failed``)."""
        if self._btl is None:
            return None
        since = self._recover_after
        carried = max((r.delivered() for r in self._history if r.kind != "startup" and r.at >= since), default=0.0)
        # (up to a little under it: a clean phase's delivered rate reads high by what a queue absorbed of it)
        return RECOVER_TO * carried if self._btl < RECOVER_BELOW * carried else None

    def _recovery_failed(self, ph: _Phase, now: float) -> None:
        """A recovery probe overran the path: it no longer carries what it did before the cut, so the phases
        before now no longer say what it carries (probes go back to CYCLE's gain)."""
        if ph.recovery:
            self._recover_after = now

    def _clean_probe(self, sent: float, now: float, recovery: bool = False) -> Verdict:
        """A clean probe raises btl by a step that grows with clean probes in a row (CLEAN_PROBE); RESTART_PROBES in
        a row run startup again from btl (RESTART). A clean recovery probe (``recovering``) raises it to what it
        sent."""
        assert self.btl is not None
        # A clean probe proved the rate it sent, no more: one that a loaded CPU held at or under btl raises
        # nothing and does not count toward a restart (in the lab, 4 daemons on 2 cores, probes that sent
        # 11.7 MB/s took btl to 12.3, above the link's 12.1, and the cruise after them queued until cut).
        if sent <= self.btl * (1.0 + PROBE_STEP / 2):
            # (nor one that sent a hair above it: a sender its CPU holds at some rate would creep up to it
            # probe by probe, each counted clean, until startup restarted)
            return Verdict("hold", f"probe sent {sent / 1e6:.2f} MB/s, not above btl", self.rate)
        carried = self._recover_to()
        raised = min(sent, carried) if carried is not None else self.btl * (1.0 + self._step)
        self._btl = min(self.max_rate, raised, sent)
        self._transition(Event.CLEAN_PROBE, now)
        if self._clean_probes >= RESTART_PROBES:
            # Clean probe after clean probe: btl is far under the path (a false queue signal, such as a
            # sender stalled a few ms, ended startup early, and probes of at most 10 % a cycle take seconds
            # back to the link). Startup again from btl: it doubles only on clean phases and ends on the same
            # queue and loss signals.
            self._transition(Event.RESTART, now)
            return Verdict("increase", f"{RESTART_PROBES} clean probes in a row: startup again", self.rate)
        if recovery and carried is not None:
            return Verdict("increase", f"clean recovery probe: btl {self.btl / 1e6:.2f} MB/s", self.rate)
        return Verdict("increase", f"clean probe: btl {self.btl / 1e6:.2f} MB/s", self.rate)

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
        self._transition(Event.STEP_UP, now)
        return Verdict("increase", reason, self.rate)

    def _queue_signal(self, ph: _Phase) -> QueueSignal | None:
        """The uplink's queue over a phase from its REPORTs' queueing delays: (seconds queued at its end, growth
        in seconds per second or None where no destination's samples span enough of it, when that level was
        sent, the destinations' upper median level), or None without samples. Every destination's datagrams cross
        the uplink's queue, only one destination's its own downlink: so the uplink's is the least over
        destinations. The upper median (of three: the middle one) is what no single destination sets: not one that
        lies low about its arrival times, nor one whose receiver read its samples late on a loaded CPU (10-50 ms
        seen in the lab where the others read under 3 ms).

        In startup on a thin link a destination reports once or twice a phase (every MIN_SAMPLE datagrams): where its
        samples in the phase span too little, its growth runs from its last sample before the phase (``lead``, if
        it is no older than a phase). Otherwise a first phase far above a 10 Mbit/s link filled the queue unseen
        (its only samples were the first REPORTs' base) and the next one overflowed it without a growth to end
        startup on."""
        if not ph.queue:
            return None
        by_dest: dict[Hashable, list[tuple[float, float]]] = {}
        for t, q, dest in ph.queue:
            by_dest.setdefault(dest, []).append((t, q))
        length = (ph.end if ph.end is not None else ph.start) - ph.start
        span = Q_SPAN * length
        # Each sample may sit up to a burst's length late (the receiver reports wherever its top falls in a
        # batch, placed at the pacer's guess of the link rate): the least samples of each half of the phase.
        mid = (ph.start + (ph.end if ph.end is not None else ph.start)) / 2
        level, at, growths, levels, added = math.inf, ph.start, [], [], []
        for dest, samples in by_dest.items():
            samples.sort()
            early = [s for s in samples if s[0] < mid] or samples[:1]
            late = [s for s in samples if s[0] >= mid] or samples[-1:]
            (t0, q0), (t1, q1) = min(early, key=lambda s: s[1]), min(late, key=lambda s: s[1])
            levels.append(q1)
            if q1 < level:
                level, at = q1, t1
            lead = ph.lead.get(dest)
            if t1 - t0 <= max(span, 1e-6) and lead is not None and ph.start - length <= lead[0] < t0:
                t0, q0 = lead
            if t1 - t0 > max(span, 1e-6):
                growths.append((q1 - q0) / (t1 - t0))
                # (spread evenly over its span: what of it fell in the phase, per second of the phase)
                added.append(growths[-1] * max(0.0, t1 - max(t0, ph.start)) / max(length, 1e-6)
                             if t0 < ph.start else growths[-1])
        return QueueSignal(level, min(growths) if growths else None, at, sorted(levels)[len(levels) // 2],
                           min(added) if added else None)

    def _path_congested(self, dest: Hashable, expected: int, lost: int, drops: int, sent: float, margin: float,
                        z: float) -> tuple[float, float] | None:
        """One destination's share of a phase: (its loss, what its path delivered, a little under) when it
        is lossier than that destination's own floor or its receiver's kernel dropped; else None."""
        loss = lost / expected
        floors = self._floor(sent, dest)
        floor = floors.loss
        if drops > KERNEL_DROPS * expected or above_floor(loss, expected, floors, margin, z):
            return loss, max(self.min_rate, sent * (1.0 - loss) / max(1e-9, 1.0 - floor) * CUT_MARGIN)
        return None
