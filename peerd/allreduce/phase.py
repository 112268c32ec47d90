"""One group's receive phases: their states and transitions (a table, as h11 keeps its connection's), the
per-stream bookkeeping of each phase, and the phase deadline computed from the arrivals (protocol/allreduce.md).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

IN_ORDER_GRACE_S = 0.002  # an END of a stream that came in order so far: the wait for the rest (Phase.note_end)
REORDER_SAFETY = 3.0  # ... and of one seen reordered, this many times more its latest datagram's lateness (grace_s)
# a receive phase's last datagrams (over all its streams) are read as they come, not let queue
# (GroupAverage.awaits_tail): about what one coalescing pause lets in from three senders at 100 Mbit/s
TAIL_DATAGRAMS = 128
# A repair round's wait (protocol/allreduce.md, "Repair"): at least this (a round trip on a loaded path, its queue
# included), plus ``safety`` times the ranges asked for at the rate their owner's stream arrived.
REPAIR_FLOOR_S = 0.03
COMPLETION = "completion"
DEADLINE = "deadline"


class State(enum.Enum):
    """Where a member's group stands, as its receiving sees it."""

    REDUCE_SCATTER = "reduce_scatter"  # contributions to the own shard arrive
    ALL_GATHER = "all_gather"  # the own shard is final; the other owners' averages arrive
    DONE = "done"  # both receive phases have ended: the result may be taken


class Event(enum.Enum):
    """What moves a group from one State to the next."""

    REDUCE_SCATTER_ENDED = "reduce_scatter_ended"  # every stream complete, or the phase deadline
    ALL_GATHER_ENDED = "all_gather_ended"


# (state, event) -> the next state; any other pair is a bug in the core, never the network's doing
TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.REDUCE_SCATTER, Event.REDUCE_SCATTER_ENDED): State.ALL_GATHER,
    (State.ALL_GATHER, Event.ALL_GATHER_ENDED): State.DONE,
}


class Sending(enum.Enum):
    """Where a member's own sending stands: its contributions first, then the average (its ranges as they become
    final; the rest once its own shard's reduce-scatter has ended)."""

    REDUCE_SCATTER = "reduce_scatter"  # the own contributions go out to their owners
    HOLDING = "holding"  # every contribution is out; the own shard's reduce-scatter has not ended yet
    ALL_GATHER = "all_gather"  # the own shard's average goes out to every other member
    SENT = "sent"  # nothing more to send


class SendEvent(enum.Enum):
    EXHAUSTED = "exhausted"  # the current phase's blocks are all handed out
    SHARD_FINAL = "shard_final"  # the own shard's reduce-scatter ended: the rest of its average may go out


SEND_TRANSITIONS: dict[tuple[Sending, SendEvent], Sending] = {
    (Sending.REDUCE_SCATTER, SendEvent.EXHAUSTED): Sending.HOLDING,
    (Sending.HOLDING, SendEvent.SHARD_FINAL): Sending.ALL_GATHER,
    (Sending.ALL_GATHER, SendEvent.EXHAUSTED): Sending.SENT,
    (Sending.HOLDING, SendEvent.EXHAUSTED): Sending.SENT,  # the whole average went out before the phase ended
}


def advance(table: dict, state: enum.Enum, event: enum.Enum) -> enum.Enum:
    """The state after ``event`` in ``state``: RuntimeError for a transition the table does not have."""
    try:
        return table[(state, event)]
    except KeyError:
        raise RuntimeError(f"{event} in {state}: no such transition") from None


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """One receive phase as this member saw it.

    Datagram counts are data datagrams (END markers not included). Weights are summed per data datagram:
    reduce-scatter counts this member's own weight for each of its ranges in both columns, and expects
    each other sender's weight once it has heard from that sender (a sender never heard from is in
    ``silent`` and adds nothing to ``weight_expected``). All-gather datagrams carry the total weight that
    arrived at the owner; its ``weight_expected`` assumes every range could reach the weight of all
    members this member heard from, so it is an approximation.
    """

    datagrams_expected: int
    datagrams_received: int
    weight_expected: float
    weight_received: float
    ends_received: int  # streams whose END marker arrived
    silent: tuple[int, ...]  # live senders from which nothing at all arrived in this phase (of those with data for it)
    datagrams_sent: int  # data datagrams this member produced for this phase
    started_at: float | None
    ended_at: float | None
    ended_by: str | None  # "completion", "deadline", or None while running

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at


@dataclass(frozen=True, slots=True)
class GroupStats:
    group_id: int
    n: int
    index: int
    reduce_scatter: PhaseStats
    all_gather: PhaseStats
    drops: dict[str, int]  # reason -> count: group, sender, duplicate, late, malformed, type
    # END markers that arrived when no longer needed (a repeat, or after their phase ended), and AG_NACK copies
    # asking for nothing new: the driver sends each 3 times, so these are routine and not counted as drops
    ends_ignored: int
    # Contributions refused or limited (reason -> count): nonfinite (ranges, both phases), weight_capped
    # (members), clipped, weight_bounded and opposed (members, robust only), solo (ranges). The driver adds them to
    # contributions_refused.
    refused: dict[str, int] = field(default_factory=dict)
    # the weight this member's average stands for: its own and every member's it heard from (each capped at
    # max_weight, and with robust at the median bound): a later Moshpit round on another grid axis averages with
    # this weight
    weight_total: float = 0.0
    # robust clip: the members (indices) this owner left out of its shard for pointing against the others
    opposed: tuple[int, ...] = ()
    # (robust clip, 3 or more heard) per member tested: (index, cosine with the others' sum, elements)
    cosines: tuple[tuple[int, float, int], ...] = ()
    # Repair of lost all-gather ranges (protocol/allreduce.md, "Repair"): ranges this member asked its owners for in
    # its first round, how many of them arrived after it asked, and ranges this member resent as an owner
    repair_asked: int = 0
    repair_received: int = 0
    repair_resent: int = 0
    # every range of every other owner's shard arrived here (repairs included) with finite values: this member's
    # result is the one every member that completed its all-gather holds (a lost reduce-scatter contribution only
    # lowers a range's weight, alike for all); a range that never arrived keeps this member's own values
    complete: bool = False
    # members this node found dead mid-average (their daemons did not answer PINGs: allreduce/liveness.py) and stopped
    # waiting for, as a deadline would have; what they delivered before counts
    dead: tuple[int, ...] = ()


class Phase:
    """Stream bookkeeping for one receive phase: which streams are still open, how many data datagrams
    are still expected from them, and the arrival times the deadline is computed from."""

    __slots__ = (
        "expected",
        "received",
        "top",
        "reordered",
        "top_at",
        "late_s",
        "first_at",
        "last_at",
        "done",
        "end_seen",
        "open",
        "remaining",
        "t0",
        "t_first",
        "t_last",
        "data",
        "weight_received",
        "sent",
        "ended_at",
        "ended_by",
        "ending",
        "grace",
        "rounds",
        "round",
        "repairing",
        "want_last",
        "ask",
        "settled",
        "passed",
        "safety",
        "alive_at",
        "behind",
    )

    def __init__(self, expected: list[int], me: int, t0: float | None) -> None:
        self.expected = expected
        self.received = [0] * len(expected)
        self.top = [0] * len(expected)  # per sender: one past the highest datagram index that arrived
        self.reordered = [False] * len(expected)  # per sender: a datagram arrived after one sent later
        self.top_at = [0.0] * len(expected)  # per sender: when its top last rose
        # per sender: the longest a datagram was seen to arrive after one sent later (now - top_at: at least that)
        self.late_s = [0.0] * len(expected)
        self.first_at = [0.0] * len(expected)  # per sender: when its first data arrived
        self.last_at = [0.0] * len(expected)  # per sender: when its latest data arrived
        # a stream with nothing to carry (empty shard, or this member itself) is complete from the start
        self.done = [s == me or e == 0 for s, e in enumerate(expected)]
        self.end_seen = [False] * len(expected)
        self.open = self.done.count(False)
        self.remaining = sum(e for s, e in enumerate(expected) if not self.done[s])
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.data = 0
        self.weight_received = 0.0
        self.sent = 0
        self.ended_at: float | None = None
        self.ended_by: str | None = None
        # Streams whose END overtook some of their data: sender -> when to stop waiting for the rest.
        self.ending: dict[int, float] = {}
        self.grace = 0.0
        # Repair (the all-gather only; ``rounds`` 0: off): per sender the rounds asked so far, the streams waiting for
        # a round's ranges (sender -> when to stop waiting), the highest range the round asked for, the senders to ask
        # now (the core sends their AG_NACK), the streams that ended since the core last looked (it tells their
        # owners), and whether the phase deadline passed (then only the rounds it started still run).
        self.rounds = 0
        self.round = [0] * len(expected)
        self.repairing: dict[int, float] = {}
        self.want_last = [0] * len(expected)
        self.ask: list[int] = []
        self.settled: list[int] = []
        self.passed = False
        self.safety = 2.0
        # when a member this phase has had nothing of yet last proved alive (GroupAverage.note_alive): the silence
        # that ends the phase counts from it as from an arrival
        self.alive_at = -math.inf
        # per sender: its latest datagram here lay below the stream's top (a resend, or reordered), so the time the
        # socket last heard from it is not when its top arrived (the REPORT then leaves ``arrived`` unknown)
        self.behind = [False] * len(expected)

    def _progress(self, now: float) -> None:
        if self.t_first is None:
            self.t_first = now
        if self.t_last is None or now > self.t_last:
            self.t_last = now

    def note_data(self, s: int, k: int, now: float) -> bool:
        """One new data datagram, index k, of stream s. True when it started a grace (``last_arrived``)."""
        self.data += 1
        self._progress(now)
        received = self.received[s] = self.received[s] + 1
        self.behind[s] = k < self.top[s]
        if k >= self.top[s]:
            self.top[s] = k + 1
            self.top_at[s] = now
        elif s not in self.repairing:  # (resent ranges come below the top, as asked)
            self._reordered(s, now)
        if received == 1:
            self.first_at[s] = now
        self.last_at[s] = now
        if not self.done[s]:
            self.remaining -= 1
            if self.received[s] >= self.expected[s]:
                self._complete(s)
            elif s in self.repairing:
                return self._repaired_through(s, k, now)
            elif k + 1 >= self.expected[s]:
                return self.last_arrived(s, now)
        return False

    def _reordered(self, s: int, now: float) -> None:
        self.reordered[s] = True
        self.late_s[s] = max(self.late_s[s], now - self.top_at[s])

    def grace_s(self, s: int) -> float:
        """How long stream s's END (or last datagram) waits for data still missing: IN_ORDER_GRACE_S for a stream
        that came in index order (what is missing was sent before it: lost, not late), plus REORDER_SAFETY times
        the longest a datagram of it arrived after one sent later where it reordered; at most ``grace``: a path
        that reorders by microseconds (a host's per-CPU queues) need not wait the full grace every phase."""
        return min(self.grace, IN_ORDER_GRACE_S + REORDER_SAFETY * self.late_s[s])

    def _complete(self, s: int) -> None:
        self.done[s] = True
        self.open -= 1
        self.ending.pop(s, None)
        if self.rounds:
            self.repairing.pop(s, None)
            self.settled.append(s)

    def _repaired_through(self, s: int, k: int, now: float) -> bool:
        """Range ``k`` of a stream in repair arrived: the owner is sending the round, in index order, so the rest of
        what it asked for (what the stream still misses: a round asks for all of it) comes within ``safety`` times
        that many datagrams at the stream's rate; where ``k`` is the last one the round asked for, what is still
        missing is lost. The round ends after that and the grace (``grace_s``), not after its own wait, whose
        floor is for a round of which nothing came. True when the wait moved earlier."""
        until = now + self.grace_s(s)
        if k < self.want_last[s]:
            rate = self._stream_rate(s)
            until += self.safety * (self.expected[s] - self.received[s]) / rate if rate else math.inf
        if until < self.repairing[s]:
            self.repairing[s] = until
            return True
        return False

    def settle(self, s: int, now: float) -> None:
        """Stream s is over as far as its sender goes (its END, or its last datagram, and the grace): with ranges
        missing and repair rounds left, ask for them (``ask``) and wait for the round (``repair_wait``); else close
        it."""
        if self.done[s]:
            return
        missing = self.expected[s] - self.received[s]
        if self.round[s] < self.rounds and missing > 0 and (self.received[s] > 0 or self.end_seen[s]):
            self.ending.pop(s, None)
            self.round[s] += 1
            self.ask.append(s)
            self.repairing[s] = now + self.repair_wait(s, missing)
            return
        self.close(s)

    def repair_wait(self, s: int, missing: int) -> float:
        """REPAIR_FLOOR_S plus ``safety`` times ``missing`` datagrams at the rate stream s arrived (the phase's rate
        where the stream's own span is too short to tell)."""
        rate = self._stream_rate(s)
        return REPAIR_FLOOR_S + (self.safety * missing / rate if rate else 0.0)

    def _stream_rate(self, s: int) -> float | None:
        """Datagrams per second stream s arrived at (the phase's rate where its own span is too short to tell)."""
        span = self.last_at[s] - self.first_at[s]
        rate = (self.received[s] - 1) / span if self.received[s] > 1 and span > 0 else self.rate()
        return rate if rate and math.isfinite(rate) else None

    def expire_repairs(self, now: float) -> None:
        """Rounds whose wait is over: the next round, or the stream closes with what it has."""
        for s, until in list(self.repairing.items()):
            if now >= until:
                del self.repairing[s]
                self.settle(s, now)

    def repair_open(self, now: float) -> bool:
        """The phase deadline passed: each open stream from a sender heard from, with a round left, is asked for its
        missing ranges, the others close; False (nothing changed) when no stream can be asked."""
        if not self.rounds or self.passed:
            return False
        can = [s for s in range(len(self.done)) if not self.done[s] and s not in self.repairing
               and (self.received[s] > 0 or self.end_seen[s]) and self.round[s] < self.rounds]
        if not can:
            return False
        self.passed = True
        for s in range(len(self.done)):
            if not self.done[s] and s not in self.repairing:
                if s in can:
                    self.settle(s, now)
                else:
                    self.close(s)
        return True

    def last_arrived(self, s: int, now: float) -> bool:
        """The stream's last datagram arrived with some before it missing: it acts as the stream's END (the
        same grace; ``note_end``). Streams go in index order, so what is missing was sent before it. Without this
        a stream whose three END copies were all lost waited out the phase floor (1 s) though its tail had come:
        seen in `bench allreduce --peers 4 --size 5000000 --link 100mbit --link-loss 0.05`, a slow path's stream
        whose last datagram arrived and no END after it. True when a grace started (the deadline moved)."""
        if self.grace <= 0 or self.done[s] or s in self.ending or s in self.repairing:
            return False
        self.ending[s] = now + self.grace_s(s)
        return True

    def close(self, s: int) -> None:
        """Stop waiting for stream s (its END arrived, or its sender was removed)."""
        self.ending.pop(s, None)
        if not self.done[s]:
            self.remaining -= self.expected[s] - self.received[s]
            self.done[s] = True
            self.open -= 1
            if self.rounds:
                self.repairing.pop(s, None)
                self.settled.append(s)

    def note_block(self, s: int, count: int, k_max: int, now: float) -> bool:
        """``note_data`` for ``count`` new datagrams of stream s at once, the highest index ``k_max``."""
        self.data += count
        self._progress(now)
        received = self.received[s] = self.received[s] + count
        self.behind[s] = k_max < self.top[s]
        if k_max - count + 1 < self.top[s] and s not in self.repairing:  # (the block's lowest index is at most this:
            # in order it is not; resent ranges come below the top, as asked)
            self._reordered(s, now)
        if k_max >= self.top[s]:
            self.top[s] = k_max + 1
            self.top_at[s] = now
        if received == count:
            self.first_at[s] = now
        self.last_at[s] = now
        if not self.done[s]:
            self.remaining -= count
            if received >= self.expected[s]:
                self._complete(s)
            elif s in self.repairing:
                return self._repaired_through(s, k_max, now)
            elif k_max + 1 >= self.expected[s]:
                return self.last_arrived(s, now)
        return False

    def note_end(self, s: int, now: float) -> None:
        """An END closes its stream, after a short grace when it overtook some of the stream's data
        (reordering): datagrams sent just before it may still be in flight. On a path that kept the stream in
        order so far, what is missing was sent before the END that arrived, so it is nearly surely lost, not
        late: the wait is IN_ORDER_GRACE_S at most (under random loss nearly every stream misses some, and the
        full grace would cost every phase its length; not waiting at all loses reordered data in the host tests
        with 3 ms of jitter). A stream seen reordered waits longer, by how late its data came (``grace_s``)."""
        self.end_seen[s] = True
        self._progress(now)
        if self.done[s] or s in self.repairing:
            return
        if self.grace > 0 and self.received[s] < self.expected[s]:
            self.ending[s] = now + self.grace_s(s)
        else:
            self.settle(s, now)

    def expire_ending(self, now: float) -> None:
        for s, until in list(self.ending.items()):
            if now >= until:
                del self.ending[s]
                self.settle(s, now)

    def rate(self) -> float | None:
        """New data datagrams per second since the phase started (or since the first arrival, if earlier)."""
        if self.data == 0 or self.t_last is None or self.t_first is None:
            return None
        ref = self.t_first if self.t0 is None else min(self.t0, self.t_first)
        dt = self.t_last - ref
        return math.inf if dt <= 0 else self.data / dt

    def deadline(
        self, floor_s: float, safety: float, cap_s: float | None, prior_rate: float | None, slack_s: float
    ) -> float:
        """max(t0, t_last, alive_at) + slack_s + max(floor_s, safety * remaining / rate), capped at t0 + cap_s.

        It only moves later as data arrives, and fires once the flow has stopped for long enough that the
        rest, at the pace seen so far, would have come by now (times ``safety``)."""
        assert self.t0 is not None
        if self.passed and self.repairing:  # the deadline passed: only the repair rounds it started are waited for
            return min(self.repairing.values())
        rate = self.rate() or prior_rate
        wait = floor_s if rate is None else max(floor_s, safety * self.remaining / rate)
        base = max(self.t0 if self.t_last is None else max(self.t0, self.t_last), self.alive_at)
        d = base + slack_s + wait
        if cap_s is not None:
            d = min(d, self.t0 + cap_s)
        if self.ending:
            d = min(d, min(self.ending.values()))
        if self.repairing:
            d = min(d, min(self.repairing.values()))
        return d

    def snapshot(self, weight_expected: float, weight_received: float, live: list[bool], me: int) -> PhaseStats:
        silent = tuple(
            s
            for s in range(len(self.expected))
            if s != me and live[s] and self.expected[s] and self.received[s] == 0 and not self.end_seen[s]
        )
        return PhaseStats(
            datagrams_expected=sum(self.expected),
            datagrams_received=self.data,
            weight_expected=weight_expected,
            weight_received=weight_received,
            ends_received=sum(self.end_seen),
            silent=silent,
            datagrams_sent=self.sent,
            started_at=self.t0,
            ended_at=self.ended_at,
            ended_by=self.ended_by,
        )

