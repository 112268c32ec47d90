"""A group running at the averaging host: its core, members, delivery meters and send positions, and the gate
that holds a member's data back until it shows it runs the group (all sans-I/O, driven by host.py)."""

from __future__ import annotations

import math
from dataclasses import replace

from ..transport.pacing import DeliveryMeter, SendPositions
from .actions import Action, ProbeMember, SendBlock, Wake
from .frames import DATA_TYPES
from .group import GroupAverage
from .held import MAX_TOKEN_BYTES
from .liveness import Alive, Dead, SilenceWatch

# Until a member shows it runs the group (its data or a REPORT of this group came), it gets at most this much of
# it: a member that starts the group after this node holds what comes before up to HeldData's MAX_TOKEN_BYTES per
# sender and drops the rest: on loopback, at 0.5-0.7 GB/s a sender, a member that starts 50-100 ms late would lose
# thousands of datagrams that way (`peerd bench allreduce --peers 4 --size 25000000`, received_fraction).
# The rest waits for the member (a quarter of that hold: REPORTs and its own data come within ~25 ms of its
# start), or GATE_S at most: then it goes anyway (a member that only receives, or whose datagrams to this node
# are all lost, still gets it).
GATE_BYTES = MAX_TOKEN_BYTES // 4
GATE_S = 1.0


def gate(g: RunningGroup, block: SendBlock) -> tuple[SendBlock | None, SendBlock | None]:
    """(what of ``block`` goes now, what waits for its member): a member not heard from gets GATE_BYTES of
    data in all (a data block that crosses that is cut there), and once something of it waits, the rest of
    its blocks wait behind it (its order is kept)."""
    to = block.to
    if to in g.waiting:
        return None, block
    if g.heard[to] or g.gate_until == math.inf:
        return block, None
    rows = len(block.bodies)
    room = g.gate_rows - g.given[to]
    if rows <= room:
        g.given[to] += rows
        return block, None
    if room <= 0 or block.type not in DATA_TYPES:
        return None, block
    g.given[to] += room
    cut = block.values[:room] if block.values is not None else None
    rest = block.values[room:] if block.values is not None else None
    return replace(block, bodies=block.bodies[:room], values=cut), replace(block, bodies=block.bodies[room:],
                                                                              values=rest)


def hear(g: RunningGroup, index: int) -> bool:
    """Member ``index`` runs the group: its gate opens. True if blocks wait for it."""
    g.heard[index] = True
    return index in g.waiting


def releasable(g: RunningGroup) -> bool:
    return bool(g.waiting) and (g.gate_until == math.inf or any(g.heard[to] for to in g.waiting))


def release(g: RunningGroup, limit: int) -> list[SendBlock]:
    """Waiting blocks of members whose gates opened, about ``limit`` datagrams, a block per member in turn."""
    out: list[SendBlock] = []
    count = 0
    while count < limit:
        ready = [to for to in g.waiting if g.heard[to] or g.gate_until == math.inf]
        if not ready:
            break
        for to in ready:
            queue = g.waiting[to]
            block = queue.pop(0)
            if not queue:
                del g.waiting[to]
            out.append(block)
            count += len(block.bodies)
    return out


def silences(g: RunningGroup) -> dict[int, float]:
    """The members whose stream the group's running phase waits for -> when each was last heard from (its data in
    either phase, its REPORTs; the group's start if never)."""
    core, said, started = g.core, g.said, g.started
    return {i: max(started, said[i], core.heard_at(i)) for i in core.waiting_for()}


def stream_counts(g: RunningGroup) -> dict[int, tuple[int, int]]:
    """The members the running phase waits for -> (datagrams of theirs received, one past the highest index)."""
    return {i: g.core.stream_counts(i) for i in g.core.waiting_for()}


def watch_timer(g: RunningGroup) -> float | None:
    """When the group's silent members next need a probe or a verdict (None: no watch, or nothing due)."""
    if g.watch is None:
        return None
    g.watch.note_waiting(silences(g), stream_counts(g))
    return g.watch.get_timer()


def watch(g: RunningGroup, now: float) -> list[Action]:
    """Probe the group's silent members as its watch says (ProbeMember); a dead one is given up on at once
    (GroupAverage.give_up: its streams close as a deadline would close them; nothing more goes to it), and the
    group's driver is woken (Wake)."""
    w = g.watch
    if w is None:
        return []
    w.note_waiting(silences(g), stream_counts(g))
    w.handle_timer(now)
    out: list[Action] = []
    for a in w.take_actions():
        if isinstance(a, Dead):
            g.core.give_up(a.member, now)
            g.waiting.pop(a.member, None)  # (blocks gated for it: it will never be heard)
            out.append(Wake(g.core.group_id))
        elif isinstance(a, Alive):
            g.core.note_alive(a.member, a.at)
            out.append(Wake(g.core.group_id))  # (the phase deadline may have moved)
        else:
            out.append(ProbeMember(g.core.group_id, a.member, g.peers[a.member], a.token, a.timeout))
    return out


class RunningGroup:
    __slots__ = ("core", "peers", "by_peer", "by_token", "meters", "positions", "sent_to", "hold_until",
                 "floor_s", "report_at", "part", "rows", "copies", "heard", "given", "waiting", "gate_until",
                 "gate_rows", "released", "started", "said", "watch")

    def __init__(self, core: GroupAverage, peers: list[bytes], now: float, kernel_drops: int, floor_s: float,
                 part: int, rows: int, report_at: float) -> None:
        self.core = core
        self.peers = peers
        self.by_peer = {p: i for i, p in enumerate(peers)}
        self.by_token: dict[int, int] = {}  # tokens seen bound to a member (a cache of the transport's answer)
        self.meters = [DeliveryMeter(now, kernel_drops) for _ in peers]
        # Per member: data datagrams sent to it so far (its reduce-scatter and all-gather streams in the order sent:
        # the positions a receiver's REPORT counts in) and when each part of them went out.
        self.positions = [SendPositions() for _ in peers]
        self.sent_to = [0] * len(peers)
        self.hold_until: float | None = None
        self.floor_s = floor_s
        self.report_at = report_at
        self.part = part
        self.rows = rows
        self.copies: list[tuple[float, int, SendBlock]] = []  # END copies due later: (when, order, block), a heap
        # The gate (GATE_BYTES): members heard from in this group, datagrams handed out to each before that, and
        # the blocks waiting for each member (in its order); every gate opens at ``gate_until`` (inf: open).
        self.heard = [i == core.index for i in range(len(peers))]
        self.given = [0] * len(peers)
        self.waiting: dict[int, list[SendBlock]] = {}
        self.gate_until = now + GATE_S
        self.gate_rows = 0  # GATE_BYTES in datagrams (set by the host, which knows their size)
        self.released = False  # its result was handed on (AveragingHost.release); it only serves repairs now
        self.started = now
        self.said = [now] * len(peers)  # per member: when its latest REPORT of this group came
        self.watch: SilenceWatch | None = None  # (options.probe_silent) whether silent members live
