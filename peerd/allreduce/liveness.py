"""Whether a silent member of a running average lives (sans-I/O; protocol/allreduce.md, "Phases at a receiver").

A phase that waits for a member's stream waits until its deadline, a silence of ``floor_s`` after the last arrival,
also for a member whose daemon died: the kill's round then costs a silence per phase and then some. This core tells
a dead member from a slow one the way a kept group's renewal does (PROTOCOL.md section 16, step 7): once a member
whose stream the phase still waits for has sent nothing for ``grace_s`` of its round trips, its daemon is sent a
PING, one at a time, each with an RTT-derived timeout (the transport resends within it at the member's
retransmission timeout, so a lost datagram costs a resend, not a verdict). A PONG from the member's own node id
means it lives (``Alive``: a phase that has had nothing of it yet counts its silence from the answer, within a few
floors of its start; a member late to start is not taken for lost), and it is PINGed again every ``PHASE_REPROBE_S``
while it stays silent. ``PROBES`` PINGs in a row unanswered, or answered by another node id (someone else lives at
that address), mean it is dead: the phases stop waiting for it at once, its contribution counted as lost exactly as
a deadline would count it. Anything the member sends in between ends the silence being judged (its failures are
forgotten). A probe and its answer take the member's path, so where its latest data arrived with loss (over the
last ``RECENT_DATAGRAMS`` of its stream: a link it overruns the moment it slows, whose full queue drops PINGs as
it drops data) more probes must go unanswered (``probes_needed``): a member slowed by its own congested link is
waited for, not taken for dead, while one whose stream stopped on a clean path is given up on after three.

The core contract: ``note_waiting(waiting, counts)`` (each member the phase waits for, and when it was last heard
from: arrivals move it, so the caller tells it before ``get_timer()`` or ``handle_timer(now)``; the counts of each
one's stream in the phase, where known); ``take_actions()``
drains the PINGs to send (``Probe``, each reported back with ``receive_answer``) and the verdicts (``Alive``,
``Dead``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

GRACE_FLOOR_S = 0.05  # a member is probed once it is this silent (or GRACE_RTTS of its round trips, if longer)
GRACE_RTTS = 3.0
PROBE_FLOOR_S = 0.1  # a probe's timeout: PROBE_RTTS of the member's round trips, at least this ...
PROBE_RTTS = 4.0
PROBE_MAX_S = 1.0  # ... and at most this (an RTT estimate that grew under loss must not stretch the verdict)
PROBES = 3  # unanswered probes in a row: the member is dead (on a path that lost none of its data; see probes_needed)
FALSE_VERDICT = 1e-3  # on a lossy path, enough probes that a live member leaves them all unanswered this rarely ...
MAX_PROBES = 32  # ... up to this many (a path that lossy is left to the phase's own deadline)
RECENT_DATAGRAMS = 64  # a member's path loss is read over about the last this many datagrams of its stream ...
MIN_RECENT = 8  # ... and from this many on (fewer: the stream so far, or the phase before's reading)
REPROBE_S = 0.5  # a late member that answered is probed again this long after (a kept group's renewal)
PHASE_REPROBE_S = 0.2  # ... a silent one a phase waits for: within the phase's silence (0.5 s or more), see Alive


def grace_s(rtt: float | None) -> float:
    """How late (or silent) a member may be before its daemon is probed (``rtt``: its smoothed round trip, None:
    unknown)."""
    return max(GRACE_FLOOR_S, GRACE_RTTS * rtt) if _usable(rtt) else GRACE_FLOOR_S


def probe_timeout_s(rtt: float | None) -> float:
    """One probe's timeout: a few round trips, within [PROBE_FLOOR_S, PROBE_MAX_S]."""
    return min(PROBE_MAX_S, max(PROBE_FLOOR_S, PROBE_RTTS * rtt)) if _usable(rtt) else PROBE_FLOOR_S


def probes_needed(delivered: float | None) -> int:
    """Unanswered probes in a row that make a member dead, given the part of its data that arrived (``delivered``,
    None: nothing yet): ``PROBES`` on a clean path; on a lossy one, with a probe or its answer lost as often as the
    data, enough that a live member leaves every one unanswered with at most ``FALSE_VERDICT`` chance, up to
    ``MAX_PROBES``."""
    if delivered is None or not math.isfinite(delivered) or delivered >= 1.0:
        return PROBES
    answered = max(0.0, delivered) ** 2  # the probe there and its answer back
    if answered <= 0.0:
        return MAX_PROBES
    need = math.ceil(math.log(FALSE_VERDICT) / math.log1p(-answered)) if answered < 1.0 else PROBES
    return min(MAX_PROBES, max(PROBES, need))


def _usable(rtt: float | None) -> bool:
    return isinstance(rtt, int | float) and math.isfinite(rtt) and rtt > 0


@dataclass(frozen=True, slots=True)
class Probe:
    """PING member ``member``'s daemon (``timeout`` seconds, resent within it); report ``receive_answer(token,
    the answering node id or None, now)``."""

    member: int
    token: int
    timeout: float


@dataclass(frozen=True, slots=True)
class Alive:
    """Member ``member``'s own daemon answered at ``at`` while the phase waited for its stream (GroupAverage.note_alive:
    a phase that had nothing of it yet counts its silence from there)."""

    member: int
    at: float


@dataclass(frozen=True, slots=True)
class Dead:
    """Member ``member`` is dead: stop waiting for it (given once per member)."""

    member: int


Action = Probe | Alive | Dead


@dataclass(frozen=True, slots=True)
class WatchStatistics:
    probes_sent: int
    dead: tuple[int, ...]


@dataclass(slots=True)
class _Watched:
    """One member's probes: the last word of it the current judgement began from, when the next probe may go,
    the probe in flight, and how many in a row went unanswered; and the counts of its stream that tell its path's
    recent loss."""

    grace: float
    timeout: float
    since: float = -math.inf
    next_at: float = 0.0
    token: int | None = None
    failures: int = 0
    samples: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=RECENT_DATAGRAMS))
    delivered: float | None = None  # the part of its recent datagrams that arrived (None: not known yet)

    def count(self, received: int, top: int) -> None:
        """Its stream now: ``received`` datagrams, the highest index ``top - 1`` (a lower top: a new phase's)."""
        s = self.samples
        if s and top < s[-1][1]:
            s.clear()  # (the phase before's reading stays in ``delivered`` until this one has enough)
        if s and top == s[-1][1]:
            s[-1] = (received, top)
            return
        s.append((received, top))
        while len(s) > 2 and top - s[1][1] >= RECENT_DATAGRAMS:
            s.popleft()
        r0, t0 = s[0] if top - s[0][1] >= MIN_RECENT else (0, 0)
        if top - t0 >= MIN_RECENT:
            self.delivered = min(1.0, max(0.0, (received - r0) / (top - t0)))


class SilenceWatch:
    """The probes of one running average's members (``peers``: their node ids in the group's order, ``index``:
    this node's; ``rtts``: each one's smoothed round trip, None: unknown)."""

    def __init__(self, peers: Sequence[bytes], index: int, rtts: Sequence[float | None] | None = None) -> None:
        if rtts is not None and len(rtts) != len(peers):
            raise ValueError(f"rtts must have one entry per member ({len(peers)}), got {len(rtts)}")
        self.peers = list(peers)
        self._members = {i: _Watched(grace_s(r), probe_timeout_s(r))
                         for i, r in enumerate(rtts if rtts is not None else [None] * len(peers)) if i != index}
        self._waiting: dict[int, float] = {}
        self._next_token = 1
        self._actions: list[Action] = []
        self.gone: list[int] = []  # members found dead, in order (never probed again)
        self.probes_sent = 0

    def note_waiting(self, waiting: Mapping[int, float],
                     counts: Mapping[int, tuple[int, int]] | None = None) -> None:
        """What the running phase waits for now: member -> when it was last heard from (the caller tells this before
        it reads ``get_timer`` or calls ``handle_timer``: arrivals move it); ``counts``: member -> its stream's
        (datagrams received, one past the highest index arrived) in the phase (absent: a clean path assumed)."""
        self._waiting = dict(waiting)
        for i, (received, top) in (counts or {}).items():
            w = self._members.get(i)
            if w is not None and top > 0:
                w.count(received, top)

    def get_timer(self) -> float | None:
        """When a member waited for may next need a probe or a verdict; None: never (nothing waited for, or every
        probe in flight)."""
        at = math.inf
        for i, heard in self._waiting.items():
            w = self._members.get(i)
            if w is None or i in self.gone or w.token is not None:
                continue
            due = heard + w.grace if heard > w.since else w.next_at
            if due < at:
                at = due
        return None if at == math.inf else at

    def handle_timer(self, now: float) -> None:
        """For each member waited for: one that spoke since its judgement began starts a new one (its failures
        forgotten) once it is silent for its grace; ``probes_needed`` failures make it dead; else its next probe goes
        when due (one in flight at most)."""
        for i, heard in self._waiting.items():
            w = self._members.get(i)
            if w is None or i in self.gone:
                continue
            if heard > w.since:
                w.failures = 0
                if now < heard + w.grace:
                    continue
                w.since, w.next_at = heard, now
            if w.failures >= probes_needed(w.delivered):
                self.gone.append(i)
                self._actions.append(Dead(i))
                continue
            if w.token is None and now >= w.next_at:
                w.token = self._next_token
                self._next_token += 1
                w.next_at = math.inf
                self.probes_sent += 1
                self._actions.append(Probe(i, w.token, w.timeout))

    def receive_answer(self, token: int, sender: bytes | None, now: float) -> None:
        """The probe ``token`` was answered by ``sender`` (None: not at all, after its timeout). Only the member's
        own node id proves it alive (answers are sealed: the sender is authenticated); anything else is a failure,
        and the next probe is due at once (``handle_timer`` sends it, or gives the verdict)."""
        i = next((i for i, w in self._members.items() if w.token == token), None)
        if i is None:
            return
        w = self._members[i]
        w.token = None
        if sender == self.peers[i]:
            w.failures, w.next_at = 0, now + PHASE_REPROBE_S
            self._actions.append(Alive(i, now))
        else:
            w.failures += 1
            w.next_at = now

    def take_actions(self) -> list[Action]:
        """The probes to send and the verdicts, in order (drained)."""
        actions, self._actions = self._actions, []
        return actions

    def statistics(self) -> WatchStatistics:
        return WatchStatistics(self.probes_sent, tuple(self.gone))
