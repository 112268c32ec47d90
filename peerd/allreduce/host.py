"""The averaging host: every group this node is averaging in, and what they share (sans-I/O).

One ``GroupAverage`` is one group's arithmetic. The host is what sits around all of them: which group a
tensor body belongs to, which member sent it, data kept for a group this node has not started yet or from a
sealing token not bound yet, how long a phase waits for such data, the delivery meters behind each REPORT
this node sends, what REPORTs it accepts, and when each paced part of a block may go out. It takes the
sender's token and, once the transport has bound that token, its node id (the transport resolves tokens to
peers; data datagrams carry no node id), an injected ``now`` on every call, and queues typed actions for
``take_actions``. It never waits, reads a clock or touches a socket, so the trio driver (service.py), the
simulator and the tests run the same decisions; nothing here draws random numbers.

A driver's loop for one group, in outline (service.py is the real one)::

    host.start(group_id, peers, index, vector, weight, now)       # take_actions(): a Bind per member to PING
    while not host.finished(group_id) and not host.can_release(group_id):
        while host.wants_to_send(group_id):
            for block in host.datagrams_to_send(now, group_id=group_id):
                for each part of host.part_rows(block) rows:
                    sleep until host.pace(block, rows, nbytes, now); seal the part and send it
        sleep until a Wake(group_id) action
    if finished: host.finish(group_id, kernel_drops, now)        # final REPORTs, Completed
    else: host.release(group_id, kernel_drops, now)              # the same, then in the background: the loop above
                                                                 # until finished (repairs served), host.finish
    # meanwhile: every REPORT_INTERVAL_S (host.next_report) send host.reports(...)
    # and one timer for the node: at host.get_timer(), host.handle_timer(now); run(host.take_actions())

and for everything that arrives: ``receive_data``, ``receive_block``, ``receive_bind``, ``receive_report``, each
followed by ``take_actions()``. The host's one timer (``get_timer()``, ``handle_timer(now)``) expires held data and
ends each group's phases at their deadlines, opens its send gates and releases its spaced END copies, waking the
group's driver (Wake) for what follows. What a member may make this
node spend is bounded here (protocol/PROTOCOL.md 17.3): held bytes (HeldData), accepted REPORTs (members of running
or recent groups), remembered token bindings and the pacer's paths (both LRU).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..transport.pacing import Pacer, Report
from ..wire.errors import WireError
from .actions import Action, Bind, Completed, Dropped, HeldTimer, PacerVerdict, SendBlock, SendReport, Wake, merged
from .frames import DATA_TYPES, BodyType, peek_group
from .group import GroupAverage, Outcome, stage_elements
from .held import HeldData, bodies_in
from .liveness import SilenceWatch
from .options import DEFAULT_OPTIONS, AverageOptions
from .recent import RecentMembers
from .running import GATE_BYTES, RunningGroup, gate, hear, releasable, release, watch, watch_timer

BATCH = 128  # datagrams per slice of sending work at least (a slice is one block or more)
# A block is built in one pass, then sealed and sent in GSO parts. Each block costs the sender a
# send loop's round in Python per part and the receiver its merged receive blocks, so larger blocks cost less CPU
# an average; 1 MB costs less than 512 KB (`peerd bench allreduce --peers 4 --size 25000000`, cpu_s_per_peer).
BLOCK_BYTES = 1024 * 1024
GSO_BYTES = 65000  # one GSO send is at most 64 segments, 64 KB ...
PART_S = 0.001  # ... and a paced part about this long at the pacer's rate (as Linux sizes TCP's TSO bursts) ...
MIN_PART = 2  # ... but at least this many datagrams
REPORT_INTERVAL_S = 0.025  # a receiver reports delivery to each sender about this often while data flows
RECENT_GROUPS = 4  # finished groups whose members' last REPORTs still count
MAX_BINDINGS = 4096  # token -> node id bindings remembered for data held before its group started
MAX_LATEST = 4096  # senders whose latest data's group is remembered (for REPORT's ``arrived``)
IDLE_WAIT_S = 1.0  # a group's driver looks again this often unwoken (a safety net: Wake actions wake it)
# Finished groups' stages (~one vector of float32 each) are kept for the next groups up to this many bytes in all:
# a node averaging 100 MB again and again then reuses warm pages instead of faulting in 75-100 MB of fresh ones
# per average, and so do groups that run at once (a step's overlap buckets: one group each) ...
SPARE_STAGE_BYTES = 1 << 30
MAX_SPARES = 16  # ... and at most this many of them (the smallest go first)
# The daemon's END spacing (AveragingHost ``end_spacing_s``): the second and third copies of each END this long
# after the first, past a full 20 ms queue's drain (the link lab's tbf) and still far inside a phase's 1 s floor.
END_SPACING_S = (0.008, 0.03)
_NONE: tuple[()] = ()
_AG_NACK = int(BodyType.AG_NACK)


@dataclass(frozen=True, slots=True)
class HostStatistics:
    """What the host holds now: groups running and recently finished, held data (bodies, bytes), token bindings
    remembered, finished groups' stages kept for reuse (bytes) and the pacer's rate (bytes/s)."""

    running: int
    recent: int
    held_bodies: int
    held_bytes: int
    bindings: int
    spare_stage_bytes: int
    pacing_rate: float


def send_shape(mtu: int, gso: bool) -> tuple[int, int]:
    """(rows per paced send, rows per block) for datagrams of ``mtu`` bytes. Blocks are built whole (numpy calls
    cost per block, not per datagram) and go out one paced part at a time, each sealed as it goes (service.py);
    without GSO, 16 datagrams keep bursts short."""
    part = max(1, min(64 if gso else 16, GSO_BYTES // mtu))
    rows = max(part, BLOCK_BYTES // mtu // part * part)
    return part, rows


class AveragingHost:
    """The groups of one node and the data, meters and pacing they share; see the module docstring.

    ``max_body``: the largest tensor body this node's groups take (its payload size: a larger one is
    dropped at once, never held); ``mtu``: datagram size, for block shapes and REPORT byte counts.
    ``group_factory``: what builds each group's core (GroupAverage's signature; a lab's fault injector wraps it)."""

    def __init__(
        self,
        *,
        max_body: int,
        mtu: int,
        pacer: Pacer | None = None,
        held: HeldData | None = None,
        group_factory: Callable[..., GroupAverage] = GroupAverage,
        report_interval_s: float = REPORT_INTERVAL_S,
        recent_groups: int = RECENT_GROUPS,
        max_bindings: int = MAX_BINDINGS,
        spare_stage_bytes: int = SPARE_STAGE_BYTES,
        split_values: bool = False,
        end_spacing_s: Sequence[float] | None = None,
    ) -> None:
        if max_body < 1 or mtu < max_body:
            raise ValueError(f"need 1 <= max_body <= mtu, got max_body={max_body}, mtu={mtu}")
        self.max_body = max_body
        self.mtu = mtu
        self.pacer = pacer or Pacer(datagram=mtu)
        self.held = held or HeldData()
        self.group_factory = group_factory
        self.report_interval_s = report_interval_s
        self.recent_groups = recent_groups
        self.max_bindings = max_bindings
        self.spare_stage_bytes = spare_stage_bytes
        # SendBlocks of float32 data carry their values apart (SendBlock.values) for a driver that seals them in
        # place (Sealer.seal_split); off, each block's bodies are whole.
        self.split_values = split_values
        # END markers: with None each END's copies go out together; else copy i goes ``end_spacing_s[i - 1]``
        # seconds after the first (``due_copies``). Copies sent together die together when a queue on the path
        # is full as they arrive (a tbf's tail drop at the end of a burst: all three were lost about once in 700
        # streams of the 5 %-loss link lab, and the receiver then waited out its phase floor, 1 s).
        if end_spacing_s is not None and not all(math.isfinite(d) and d >= 0 for d in end_spacing_s):
            raise ValueError(f"end_spacing_s must be finite delays >= 0, got {end_spacing_s!r}")
        self.end_spacing_s = None if end_spacing_s is None else tuple(float(d) for d in end_spacing_s)
        self._copy_order = 0
        self._spares: list[np.ndarray] = []  # finished groups' stages, for the next groups that fit in them
        self._groups: dict[int, RunningGroup] = {}
        self._recent: OrderedDict[int, RunningGroup] = OrderedDict()  # finished groups, for their last REPORTs
        # Tokens whose binding this host was told about: data held for a group not started yet carries the
        # peer it had on arrival (None: unbound), and is resolved through this when the group starts.
        self._bound: OrderedDict[int, bytes] = OrderedDict()
        # Per sender, the group of the latest tensor data it handed over. The socket's arrival time is per source
        # address, not per group: once a sender has moved on to its next group (arc-topk's next phase, the next
        # average), that time is a later datagram's, and a REPORT of the earlier group must not carry it (the
        # sender's pacer read it as a queue that grew by the gap: a startup cut to 1 MB/s on loopback).
        self._latest: OrderedDict[bytes, int] = OrderedDict()
        self._protected: dict[int, None] | None = None  # protected_tokens' answer, until a group or binding changes
        self._protected_until = math.inf  # ... or until then (a recent member drops out)
        self._recent_members = RecentMembers()
        self._actions: list[Action] = []  # what the inputs asked for, until take_actions
        self._woken: dict[int, float] = {}  # running group -> when the timer last woke its driver

    def take_actions(self) -> list[Action]:
        """What the inputs since the last call asked the driver to do, in order (drained)."""
        actions = self._actions
        if not actions:
            return []
        self._actions = []
        return actions

    def statistics(self) -> HostStatistics:
        return HostStatistics(len(self._groups), len(self._recent), self.held.count, self.held.nbytes,
                              len(self._bound), self.spare_stage_nbytes(), self.pacer.rate)

    # ---- groups ---------------------------------------------------------------------------------------

    def start(
        self,
        group_id: int,
        peers: Sequence[bytes],
        index: int,
        vector: np.ndarray,
        weight: float,
        now: float,
        *,
        options: AverageOptions = DEFAULT_OPTIONS,
        kernel_drops: int = 0,
        gso: bool = False,
        out: np.ndarray | None = None,
        center: np.ndarray | None = None,
        rtts: Sequence[float | None] | None = None,
    ) -> None:
        """Start averaging ``vector`` (weight: its sample count) as member ``index`` of ``peers`` (node ids,
        in the group's order), as ``options`` say. Queues a Bind per other member, and what the data held for
        this group did. ``options.absent``: members (indices) this node neither waits for nor sends to
        (GroupAverage.remove_member), e.g. one silent in an earlier part of the same Moshpit round.
        ``options.probe_silent``: members gone silent are probed (ProbeMember; ``rtts``: each one's round trip).
        ValueError: a group of that id is running here, the members are not distinct, or GroupAverage's own
        argument checks (weight, ``out``, ``center``)."""
        if group_id in self._groups:
            if not self._groups[group_id].released:
                raise ValueError(f"group {group_id:#x} is already averaging on this node")
            self.finish(group_id, 0, now)  # (an id used again ends the old group's serving)
        peers = list(peers)
        if len(set(peers)) != len(peers):
            raise ValueError("a group's members must be distinct nodes")
        if type(index) is not int or not 0 <= index < len(peers):
            raise ValueError(f"index must be in 0..{len(peers) - 1}, got {index!r}")
        absent = set(options.absent)
        if any(not 0 <= a < len(peers) or a == index for a in absent):
            raise ValueError(f"absent members must be other members' indices in 0..{len(peers) - 1}")
        spare = self._take_spare(stage_elements(len(vector), len(peers), options.shares))
        core = self.group_factory(group_id, len(peers), index, vector, weight, now, options=options,
                                  max_payload=self.max_body, out=out, center=center, stage=spare)
        core.split_values = self.split_values
        part, rows = send_shape(self.mtu, gso)
        g = RunningGroup(core, peers, now, kernel_drops, options.floor_s, part, rows, now + self.report_interval_s)
        g.gate_rows = max(1, GATE_BYTES // self.mtu)
        g.watch = SilenceWatch(peers, index, rtts) if options.probe_silent else None
        self._recent.pop(group_id, None)  # (a group id used again: its old REPORTs no longer count)
        self._groups[group_id] = g
        self._protected = None
        actions: list[Action] = [Bind(group_id, i, p) for i, p in enumerate(peers) if i != index and i not in absent]
        drops: Counter[str] = Counter()
        for mtype, token, body, peer in self.held.pop_group(group_id):
            if peer is None:
                peer = self._bound.get(token)
            self._deliver_held(g, peer, token, mtype, body, now, drops, actions)
        self._actions.extend(merged(actions, drops))

    def protected_tokens(self, now: float) -> dict[int, None]:
        """The tokens an overloaded receive pass never sheds (UdpSocket.recv_screened's ``protected``), so that a
        flood does not cost this node's averages their data: those bound to members of the groups running here or
        ended here within RECENT_MEMBER_S (RecentMembers: the next average's data comes before it starts here), and
        tokens holding data for a group not started here yet, unless data they held went unused lately
        (HeldData.wasting: else a member's flood of data for groups that never start keeps all its tokens' datagrams
        from being shed, and the queue fills behind them past the groups' phase deadlines; `peerd bench soak`:
        deepest_queue_kb, averages_failed). Without held data, the same dict until the members change."""
        if self._protected is None or now >= self._protected_until:
            members, until = self._recent_members.within(now)
            members.update(p for g in self._groups.values() for p in g.peers)
            self._protected, self._protected_until = {t: None for t, p in self._bound.items() if p in members}, until
        held = self.held.tokens()
        trusted = [t for t in held if not self.held.wasting(t, now)] if held else None
        return {**self._protected, **dict.fromkeys(trusted)} if trusted else self._protected

    def running(self, group_id: int) -> bool:
        return group_id in self._groups

    def awaits_tail(self) -> bool:
        """A group here waits on what arrives next (GroupAverage.awaits_tail): the receive loop reads it at once."""
        return any(g.core.awaits_tail for g in self._groups.values())

    def wants_to_send(self, group_id: int) -> bool:
        """``datagrams_to_send`` may have something (it may still return nothing for a slice: call it again)."""
        g = self._groups[group_id]
        return g.core.wants_to_send or releasable(g)

    def finished(self, group_id: int) -> bool:
        """Both receive phases have ended and everything is sent (but what waits for a member never heard
        from: it never ran the group, or its gate would have opened): call ``finish``."""
        g = self._groups[group_id]
        return g.core.finished and not releasable(g)

    def can_release(self, group_id: int) -> bool:
        """The group's result is final and this member's own data is all out: ``release`` may hand the result on
        while the group goes on serving members' repair requests until ``finished``."""
        g = self._groups[group_id]
        return not g.released and g.core.own_part_done

    def serving(self, group_id: int) -> bool:
        """The group's result was handed on (``release``) and it is still here, serving repairs."""
        g = self._groups.get(group_id)
        return g is not None and g.released

    def release(self, group_id: int, kernel_drops: int, now: float, *, arrivals: Sequence[float] | None = None) -> None:
        """Hand the result on before the group is finished (``can_release``): queues its last REPORTs and its
        Completed now; the group stays, serving repairs from a copy of its own shard, until ``finish``. A step
        then pays for its own missing ranges, not for its slowest member's."""
        g = self._groups[group_id]
        if not self.can_release(group_id):
            raise RuntimeError(f"group {group_id:#x} has no result to hand on yet")
        g.core.keep_shard(self._take_spare)
        g.released = True
        # gated blocks (members not heard from yet) may be views of the caller's buffer, which it may reuse: copies
        for to, blocks in g.waiting.items():
            g.waiting[to] = [b if b.values is None else replace(b, values=b.values.copy()) for b in blocks]
        self._actions.extend(self._reports(g, now, kernel_drops, final=True, arrivals=arrivals))
        self._actions.append(Completed(group_id, g.core.result(), g.core.statistics()))

    def send_window(self, group_id: int) -> int:
        """A ``datagrams_to_send`` limit that yields about one block per destination, for a driver that sends their
        parts in turn: every member's downlink gets an even share of each sender's uplink all the time, not one
        sender's whole uplink for a block (~40 ms at 100 Mbit/s: over the 20 ms a link's queue holds)."""
        g = self._groups[group_id]
        return max(BATCH, g.rows * (len(g.peers) - 1))

    def datagrams_to_send(self, now: float, limit: int = BATCH, *, group_id: int) -> list[SendBlock]:
        """About ``limit`` datagrams' worth of group ``group_id``'s blocks, reduce-scatter first (may be empty for
        a slice of robust work: the driver's turn to let other tasks run)."""
        g = self._groups[group_id]
        out = release(g, limit) if g.waiting else []
        if out and sum(len(b.bodies) for b in out) >= limit:
            return out
        self._gated(group_id, g, g.core.blocks_to_send(g.rows, limit, now), out)
        return out

    def note_sent(self, group_id: int, now: float) -> None:
        """The driver has sent every block it was handed by ``now`` (GroupAverage.note_sent; gated ones go later)."""
        if not (g := self._groups[group_id]).waiting:
            g.core.note_sent(now)

    def repair_to_send(self, group_id: int, caught_up: Callable[[float], bool], now: float) -> list[SendBlock]:
        """The group's repair requests, done messages and resends due by ``now`` (GroupAverage.take_repair), for a
        driver mid-send: they go to the front of their member's queue. A grace or repair round that is over ends
        only where ``caught_up(at)`` says the receive loop has read what reached the socket before it."""
        g = self._groups.get(group_id)
        out: list[SendBlock] = []
        if g is not None:
            at = g.core.repair_timer
            expire = at is not None and at <= now and caught_up(at)
            self._gated(group_id, g, g.core.take_repair(now, expire=expire), out)
        return out

    def _gated(self, group_id: int, g: RunningGroup, blocks: list, out: list[SendBlock]) -> None:
        """The core's blocks as SendBlocks (repeated bodies: the first copy now, the others spaced), those for
        members not heard from yet held at their send gate, the rest appended to ``out``."""
        spacing = self.end_spacing_s
        for b in blocks:
            if b.repeat == 1:
                sb = SendBlock(group_id, b.to, g.peers[b.to], b.type, b.bodies, g.part, b.values)
            elif spacing is None:
                sb = SendBlock(group_id, b.to, g.peers[b.to], b.type, np.repeat(b.bodies, b.repeat, axis=0),
                               g.part, b.values)
            else:  # the first copy now, the others once ``pace`` knows when it goes
                later = min(b.repeat - 1, len(spacing))
                first = np.repeat(b.bodies, b.repeat - later, axis=0)
                sb = SendBlock(group_id, b.to, g.peers[b.to], b.type, first, g.part, b.values, later)
            go, wait = gate(g, sb)
            if go is not None:
                out.append(go)
            if wait is not None:
                g.waiting.setdefault(sb.to, []).append(wait)

    def due_copies(self, group_id: int, now: float) -> list[SendBlock]:
        """The spaced END copies due by ``now`` (``math.inf``: all of them, for a driver whose group is done:
        nothing waits for them, they go at once)."""
        g = self._groups[group_id]
        out = []
        while g.copies and g.copies[0][0] <= now:
            out.append(heapq.heappop(g.copies)[2])
        return out

    def _take_spare(self, elements: int) -> np.ndarray | None:
        """The smallest kept stage of at least ``elements`` float32 (taken out of the pool), or None: a larger one
        stays for a larger group."""
        fits = [i for i, s in enumerate(self._spares) if s.size >= elements]
        if not fits:
            return None
        return self._spares.pop(min(fits, key=lambda i: self._spares[i].size))

    def _keep_spare(self, *stages: np.ndarray | None) -> None:
        """Keep a finished group's stage (and its kept shard's buffer) for later groups; past SPARE_STAGE_BYTES or
        MAX_SPARES in all, the smallest go (a larger stage serves every group a smaller one would)."""
        self._spares += [s for s in stages if s is not None and s.nbytes <= self.spare_stage_bytes
                         and not any(k is s for k in self._spares)]
        self._spares.sort(key=lambda s: s.nbytes, reverse=True)
        while self._spares and (len(self._spares) > MAX_SPARES
                                or sum(s.nbytes for s in self._spares) > self.spare_stage_bytes):
            self._spares.pop()

    def spare_stage_nbytes(self) -> int:
        """Bytes of finished groups' stages kept for later groups."""
        return sum(s.nbytes for s in self._spares)

    def part_rows(self, block: SendBlock) -> int:
        """Rows of ``block`` for its next paced send: about PART_S at the pacer's rate, in whole GSO sends
        (``block.part`` rows each) where that is one or more, else fewer rows than one GSO send. A GSO send
        enters the bottleneck's queue at once, and a 64 KB one is 5 ms of a 100 Mbit/s link: whole GSO sends
        there cause pacer decreases and leave part of the link unused, and much smaller parts cost more CPU
        (`peerd bench allreduce --peers 4 --size 5000000 --link 100mbit`, link_utilization). Above about 130 MB/s
        (loopback) a part is several GSO sends: each part costs a reservation, a sleep and a send's bookkeeping
        in Python, which one part per GSO send would pay thousands of times an average."""
        cap = int(self.pacer.rate * PART_S / self.mtu)
        if cap >= block.part:
            return cap // block.part * block.part
        return max(min(MIN_PART, block.part), cap)

    def pace(self, block: SendBlock, rows: int, nbytes: int, now: float) -> float:
        """When ``rows`` datagrams (``nbytes`` sealed) of ``block`` may go out: the pacer's reservation,
        noted with the stream positions they take (what REPORTs from the member are matched against)."""
        at = now + max(0.0, self.pacer.reserve(nbytes, block.peer, now))
        if block.later and self.end_spacing_s is not None:
            g = self._groups.get(block.group_id)
            if g is not None:
                copy = replace(block, later=0)
                for delay in self.end_spacing_s[: block.later]:
                    self._copy_order += 1
                    heapq.heappush(g.copies, (at + delay, self._copy_order, copy))
        if block.type in DATA_TYPES:
            g = self._groups.get(block.group_id) or self._recent.get(block.group_id)
            if g is not None:
                g.sent_to[block.to] += rows
                g.positions[block.to].note(g.sent_to[block.to], at, self.pacer.spacing(nbytes // max(1, rows)))
        return at

    def sent(self, block: SendBlock, at: float) -> None:
        """The datagrams ``pace`` placed last for ``block``'s member really went out at ``at`` (a sender woken
        late sends after its time: the queue its REPORTs show must be measured from then)."""
        if block.type in DATA_TYPES:
            g = self._groups.get(block.group_id) or self._recent.get(block.group_id)
            if g is not None:
                g.positions[block.to].settle(g.sent_to[block.to], at)

    def _group_timer(self, group_id: int, g: RunningGroup) -> float | None:
        """When the group next needs the timer: its phase deadline (while data from a token not bound yet is held
        for it, once the deadline has passed, ``hold_until``), its send gates' opening, its next spaced END copy."""
        at = g.core.get_timer()
        if at is not None and g.hold_until is not None and self.held.holds(group_id):
            at = max(at, g.hold_until)
        if g.waiting and g.gate_until < math.inf:
            at = g.gate_until if at is None else min(at, g.gate_until)
        if g.copies and g.copies[0][0] > self._woken.get(group_id, -math.inf):  # (else its driver takes it now)
            at = g.copies[0][0] if at is None else min(at, g.copies[0][0])
        return at

    def _handle_group_timer(self, group_id: int, g: RunningGroup, now: float) -> None:
        """The group's time came: its gates open, and whichever phase's deadline has passed ends. While data from a
        token not bound yet is held for it, its sender's binding is still in flight (the handshake retries): the
        deadline waits up to one more ``floor_s`` for it, or that sender would turn up as silence. Queues a Wake:
        the driver sends what is due (gates, copies, the next phase)."""
        self._woken[group_id] = now
        if now >= g.gate_until:
            g.gate_until = math.inf  # every gate open: what waits goes (the driver asks wants_to_send again)
        if self.held.holds(group_id):
            deadline = g.core.get_timer()
            if g.hold_until is None and deadline is not None and now >= deadline:
                g.hold_until = now + g.floor_s
            if g.hold_until is None or now < g.hold_until:
                self._actions.append(Wake(group_id))
                return
        g.core.handle_timer(now)
        self._actions.append(Wake(group_id))

    def receive_probe(self, group_id: int, token: int, sender: bytes | None, now: float) -> None:
        """A ProbeMember's PING was answered by ``sender`` (None: no answer within its timeout)."""
        g = self._groups.get(group_id)
        if g is not None and g.watch is not None:
            g.watch.receive_answer(token, sender, now)
            self._actions.extend(watch(g, now))

    def next_report(self, group_id: int) -> float:
        """When to call ``reports`` for the group next."""
        return self._groups[group_id].report_at

    def reports(self, group_id: int, kernel_drops: int, now: float, *,
                arrivals: Sequence[float] | None = None) -> list[SendReport]:
        """A REPORT to each sender from which enough arrived since the last one (``kernel_drops``: the
        socket's cumulative counter; ``arrivals``: per member, the kernel's receive time of its latest data,
        unix seconds, 0 where unknown: UdpSocket.arrivals)."""
        g = self._groups[group_id]
        g.report_at = now + self.report_interval_s
        return self._reports(g, now, kernel_drops, final=False, arrivals=arrivals)

    def finish(self, group_id: int, kernel_drops: int, now: float, *, arrivals: Sequence[float] | None = None) -> None:
        """The group's driver is done with it (finished, or cancelled: then nothing to send). Queues a finished
        group's last REPORTs (what arrived since the last one, and the lost tail) and its Completed; the
        group's REPORTs keep counting while it is among the ``recent_groups`` latest, and what is still held
        for it (from tokens never bound) is dropped (``unbound``)."""
        g = self._groups.pop(group_id)
        self._woken.pop(group_id, None)
        self._protected = None
        actions = self._actions
        if g.core.finished and not g.released:
            actions.extend(self._reports(g, now, kernel_drops, final=True, arrivals=arrivals))
            actions.append(Completed(group_id, g.core.result(), g.core.statistics()))
        # Nothing reads the group's stage any more (its result is taken; data for it is late from now on).
        self._keep_spare(g.core.stage_buffer, g.core.kept_buffer)
        self._recent[group_id] = g
        while len(self._recent) > self.recent_groups:
            self._recent.popitem(last=False)
        self._recent_members.ended(g.peers, now)
        # (END copies from a token still unbound are repeats the finished group no longer needs: not data lost)
        unbound = sum(bodies_in(item[2]) for item in self.held.pop_group(group_id) if item[0] in DATA_TYPES)
        if unbound:
            actions.append(Dropped("unbound", unbound))

    # ---- what arrives ---------------------------------------------------------------------------------

    def receive_data(self, peer: bytes | None, token: int, mtype: int, body: bytes, now: float) -> None:
        """One tensor body from ``token`` (``peer``: the node id it is bound to, None while unbound).
        WireError for a body no group of this node takes (malformed, oversized) or from a node that is not
        a member of its group; ``Dropped("unbound")`` for one from an unbound token that holds too much."""
        actions = self._data(peer, token, mtype, body, now)
        if actions:
            self._actions.extend(actions)

    def _data(self, peer: bytes | None, token: int, mtype: int, body: bytes, now: float) -> Sequence[Action]:
        group = peek_group(body)
        self._note_latest(peer, group)
        if len(body) > self.max_body:  # no group of this node takes it: do not even hold it
            raise WireError("malformed", f"tensor body of {len(body)} bytes; this node's bodies are at most"
                            f" {self.max_body}")
        g = self._groups.get(group)
        if g is None:
            if mtype == _AG_NACK:  # a request is for a running group's owner: never held (copies of one routinely
                return _NONE if group in self._recent else (Dropped("nack"),)  # outlive the owner's serving)
            return self._hold(group, token, peer, mtype, body, now)
        return self._deliver(g, peer, token, mtype, body, now)

    def receive_block(self, peer: bytes | None, token: int, mtype: int, bodies: np.ndarray, now: float) -> None:
        """A GRO block of one sender's data (``bodies``: rows x body bytes): handed to its group whole when
        it is a clean run of its ranges, else body by body (which counts whatever is wrong with each)."""
        actions = self._block(peer, token, mtype, bodies, now)
        if actions:
            self._actions.extend(actions)

    def _block(self, peer: bytes | None, token: int, mtype: int, bodies: np.ndarray, now: float
               ) -> Sequence[Action]:
        if not len(bodies):
            return _NONE
        self._note_latest(peer, int.from_bytes(bodies[-1, :4].tobytes(), "little"))
        group = int.from_bytes(bodies[0, :4].tobytes(), "little")
        g = self._groups.get(group)
        index = self._index(g, token, peer) if g is not None else None
        if g is not None and index is not None:
            taken = self._take_block(g, index, mtype, bodies, now)
            if taken is not None:
                return taken
        if bodies.shape[1] > self.max_body:
            raise WireError("malformed", f"tensor bodies of {bodies.shape[1]} bytes")
        actions: list[Action] = []
        # held whole: data for a group not started here, or from a member whose binding has not arrived yet
        if len(bodies) > 1 and mtype in DATA_TYPES and (
                (g is None and group not in self._recent) or (g is not None and peer is None)) and (
                bodies[:, :4].tobytes() == bodies[0, :4].tobytes() * len(bodies)
        ) and self._hold_block(group, token, peer, mtype, bodies, now, actions):
            return actions
        drops: Counter[str] = Counter()
        for row in bodies:
            body = row.tobytes()
            try:
                actions.extend(self._data(peer, token, mtype, body, now))
            except WireError as e:
                drops[e.reason] += 1
        return merged(actions, drops)

    def _take_block(self, g: RunningGroup, index: int, mtype: int, bodies: np.ndarray, now: float
                    ) -> list[Action] | None:
        """A block of member ``index``'s bodies to its group whole (GroupAverage.receive_block); None when it is
        not a clean run of the group's ranges (the caller then feeds it body by body)."""
        core = g.core
        before = core.phase_changes
        result = core.receive_block(index, mtype, bodies, now)
        if result is None:
            return None
        actions: list[Action] = []
        if result[2]:
            actions.append(Dropped(Outcome.LATE.reason, result[2]))
        if core.phase_changes != before or (not g.heard[index] and hear(g, index)):
            actions.append(Wake(core.group_id))
        return actions

    def _hold_block(self, group: int, token: int, peer: bytes | None, mtype: int, bodies: np.ndarray, now: float,
                    actions: list[Action]) -> bool:
        """Hold a block of one group's tensor bodies whole (a copy: the receive arena is reused), charged as that
        many bodies: a group that starts takes it as one block, not body by body (a member that starts a few ms
        after the others finds up to GATE_BYTES from each held: thousands of bodies). False when
        it does not fit its token's bound: the caller then holds what fits body by body, as before. What was
        dropped to make room, and the expiry timer, go to ``actions``."""
        rows, width = bodies.shape
        was_empty = self.held.count == 0
        kept, dropped = self.held.add(group, token, (mtype, token, bodies.copy(), peer), rows * width, now, count=rows)
        if dropped:
            actions.append(Dropped("held", dropped))
        if kept and was_empty:
            at = self.held.next_expiry()
            if at is not None:
                actions.append(HeldTimer(at))
        return kept

    def receive_bind(self, token: int, peer: bytes, now: float) -> None:
        """``token`` was just bound to node ``peer``: what running groups held from it is delivered."""
        self._bound[token] = peer
        self._bound.move_to_end(token)
        self._protected = None
        while len(self._bound) > self.max_bindings:
            self._bound.popitem(last=False)
        actions: list[Action] = []
        drops: Counter[str] = Counter()
        for g in list(self._groups.values()):
            held = self.held.pop(g.core.group_id, token)
            if held:
                actions.append(Wake(g.core.group_id))
                for mtype, tok, body, _ in held:
                    self._deliver_held(g, peer, tok, mtype, body, now, drops, actions)
        self._actions.extend(merged(actions, drops))

    def receive_report(self, peer: bytes, fields: dict[str, Any], now: float) -> None:
        """A REPORT (decoded, so its numbers are in range) from node ``peer``. Only a member of a running or
        recent group with that id speaks for a path this node sends on: anyone else (every member holds
        the swarm key) could throttle this node's sending."""
        self._actions.extend(self._report(peer, fields, now))

    def _report(self, peer: bytes, fields: dict[str, Any], now: float) -> list[Action]:
        b = fields
        g = self._groups.get(b["group"]) or self._recent.get(b["group"])
        i = g.by_peer.get(peer) if g is not None else None
        if g is None or i is None or i == g.core.index:
            return [Dropped("report")]
        g.said[i] = now
        report = Report(b["expected"], b["received"], b["bytes"], b["seconds"], b["kernel_drops"], b["position"],
                        b.get("arrived", 0.0))
        span = None
        if report.expected > 0:
            first = report.position - report.expected
            if report.position > g.sent_to[i]:
                # A receiver that gave up on the phase (its deadline) counts what this member has not sent
                # yet as lost: that is not the path's loss.
                top = max(first, g.sent_to[i])
                report = replace(report, expected=top - first, received=min(report.received, top - first),
                                 position=top, arrived=0.0)
            if report.expected > 0:
                span = g.positions[i].span(max(0, first - 1), report.position - 1)
        placed = g.positions[i].placed(report.position - 1) if span is not None else 0.0
        verdict = self.pacer.receive_report(peer, report, span, placed, now)
        if not g.heard[i] and hear(g, i) and b["group"] in self._groups:
            return [PacerVerdict(verdict.rate, verdict), Wake(b["group"])]
        return [PacerVerdict(verdict.rate, verdict)]

    # ---- held data ------------------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The host's one timer: the earliest of when the oldest held bucket expires and each running group's next
        time (``_group_timer``); None: nothing scheduled."""
        at = self.held.next_expiry()
        for group_id, g in self._groups.items():
            for t in (self._group_timer(group_id, g), watch_timer(g)):
                if t is not None and (at is None or t < at):
                    at = t
        return at

    def handle_timer(self, now: float) -> None:
        """Drop the held data that has expired by ``now`` (queues the count), and handle every running group whose
        time has come (queues a Wake for each)."""
        dropped = self.held.expire(now)
        if dropped:
            self._actions.append(Dropped("held", dropped))
        for group_id, g in list(self._groups.items()):
            if g.watch is not None:  # silent members: probes, verdicts
                self._actions.extend(watch(g, now))
            t = self._group_timer(group_id, g)
            if t is not None and now >= t:
                self._handle_group_timer(group_id, g, now)

    # ---- internals ------------------------------------------------------------------------------------

    def _note_latest(self, peer: bytes | None, group: int) -> None:
        """``peer``'s latest tensor data was of ``group`` (an unbound sender's is not known: nothing noted)."""
        if peer is None:
            return
        latest = self._latest
        if latest.get(peer) != group:
            latest[peer] = group
            latest.move_to_end(peer)
            while len(latest) > MAX_LATEST:
                latest.popitem(last=False)

    def _index(self, g: RunningGroup, token: int, peer: bytes | None) -> int | None:
        """The member index behind a token; None while the token is not bound (or not to a member)."""
        index = g.by_token.get(token)
        if index is None and peer is not None:
            index = g.by_peer.get(peer)
            if index is not None:
                if len(g.by_token) >= 4 * len(g.peers):  # members rotate tokens rarely; bound the cache
                    g.by_token.clear()
                g.by_token[token] = index
        return index

    def _hold(self, group: int, token: int, peer: bytes | None, mtype: int, body: bytes, now: float
              ) -> Sequence[Action]:
        """Keep data for a group this node has not started yet: its members may start first. A group that
        finished here takes nothing more: its stragglers are late, not worth holding for 10 s."""
        if group in self._recent:  # (END repeats routinely outlive their phase: not worth a count either)
            return (Dropped(Outcome.LATE.reason),) if mtype in DATA_TYPES else _NONE
        kept, dropped, timer = self._keep(group, token, peer, mtype, body, now)
        if not kept:
            dropped += 1
        if not dropped:
            return (timer,) if timer is not None else _NONE
        return [Dropped("held", dropped), *((timer,) if timer is not None else ())]

    def _keep(self, group: int, token: int, peer: bytes | None, mtype: int, body: bytes, now: float
              ) -> tuple[bool, int, HeldTimer | None]:
        """Hold a body within the bounds: (held, bodies dropped to make room or expired, timer to set)."""
        was_empty = self.held.count == 0
        kept, dropped = self.held.add(group, token, (mtype, token, body, peer), len(body), now)
        timer = None
        if kept and was_empty:
            at = self.held.next_expiry()
            timer = HeldTimer(at) if at is not None else None
        return kept, dropped, timer

    def _deliver(self, g: RunningGroup, peer: bytes | None, token: int, mtype: int, body: bytes, now: float
                 ) -> Sequence[Action]:
        index = self._index(g, token, peer)
        if index is None:
            if peer is None and mtype == _AG_NACK:  # a request is never held (its sender's data bound it first)
                return (Dropped("nack"),)
            if peer is None:  # its sender's PING has not arrived yet: keep it until it does
                kept, dropped, timer = self._keep(g.core.group_id, token, None, mtype, body, now)
                if kept and not dropped and timer is None:
                    return _NONE
                out: list[Action] = [] if kept else [Dropped("unbound")]  # its token holds too much already
                if dropped:
                    out.append(Dropped("held", dropped))
                if timer is not None:
                    out.append(timer)
                return out
            raise WireError("sender", "data from a node that is not in this group")
        core = g.core
        before = core.phase_changes
        outcome = core.receive(index, mtype, body, now)
        if outcome is Outcome.ACCEPTED or outcome is Outcome.DUPLICATE or (
            outcome is Outcome.LATE and mtype not in DATA_TYPES  # END repeats routinely outlive their phase
        ):
            opened = outcome is Outcome.ACCEPTED and not g.heard[index] and hear(g, index)
            return (Wake(core.group_id),) if core.phase_changes != before or opened else _NONE
        if core.phase_changes != before:
            return (Dropped(outcome.reason), Wake(core.group_id))
        return (Dropped(outcome.reason),)

    def _deliver_held(self, g: RunningGroup, peer: bytes | None, token: int, mtype: int, body: bytes | np.ndarray,
                      now: float, drops: Counter[str], actions: list[Action]) -> None:
        """A held item to its group: a body, or a block (``_hold_block``) whole where it is a clean run of the
        group's ranges from a bound member, else body by body."""
        if not isinstance(body, np.ndarray):
            self._deliver_counted(g, peer, token, mtype, body, now, drops, actions)
            return
        index = self._index(g, token, peer)
        taken = self._take_block(g, index, mtype, body, now) if index is not None else None
        if taken is not None:
            actions.extend(taken)
            return
        for row in body:
            self._deliver_counted(g, peer, token, mtype, row.tobytes(), now, drops, actions)

    def _deliver_counted(self, g: RunningGroup, peer: bytes | None, token: int, mtype: int, body: bytes, now: float,
                         drops: Counter[str], actions: list[Action]) -> None:
        try:
            actions.extend(self._deliver(g, peer, token, mtype, body, now))
        except WireError as e:
            drops[e.reason] += 1

    def _reports(self, g: RunningGroup, now: float, kernel_drops: int, *, final: bool,
                 arrivals: Sequence[float] | None = None) -> list[SendReport]:
        """One sender's flow to this member is its reduce-scatter stream and its all-gather stream, counted by the
        sender as one run of positions in the order sent. Without ``overlap`` the all-gather follows the whole
        reduce-scatter; with it, its blocks go between the reduce-scatter's as the sender's ranges become final, and
        the position of the latest arrival is about the highest index that arrived in each stream, summed (less
        only the other stream's datagrams lost just before it)."""
        core = g.core
        rs_expected, rs_received, rs_top, rs_first, rs_at = core.progress(0)
        ag_expected, ag_received, ag_top, ag_first, ag_at = core.progress(1)
        size = self.mtu
        out = []
        for i, peer in enumerate(g.peers):
            if i == core.index:
                continue
            received = rs_received[i] + ag_received[i]
            phase = 1 if ag_top[i] else 0
            # (without overlap the all-gather follows the whole reduce-scatter: its tail, lost or not, went before)
            sequential = rs_expected[i] + ag_top[i] if ag_top[i] else rs_top[i]
            top = rs_top[i] + ag_top[i] if core.overlaps else sequential
            last_at = max(rs_at[i], ag_at[i])
            first_at = rs_first[i] if rs_received[i] else ag_first[i]
            meter = g.meters[i]
            # The latest data from the member arrived then: its top position's datagram, in order (a later one
            # lost after the socket only makes the sender's queue look deeper). 0, unknown, where that data was
            # another group's, or a resend or reordered datagram (below the top): the time is not the top's
            arrived = arrivals[i] if (arrivals is not None and i < len(arrivals) and not core.latest_behind(i)
                                      and self._latest.get(peer) == core.group_id) else 0.0
            if final:
                total = rs_expected[i] + ag_expected[i]
                # (only a stream whose last datagram arrived: else its top is not what arrived last)
                rep = meter.final(total, received, received * size, first_at, last_at, kernel_drops, now,
                                  arrived if ag_top[i] >= ag_expected[i] > 0 else 0.0)
            else:
                rep = meter.sample(received, top, received * size, first_at, last_at, kernel_drops, now, arrived)
            if rep is None:
                continue
            fields = {"group": core.group_id, "phase": phase, "expected": min(rep.expected, 2**32 - 1),
                      "received": min(rep.received, 2**32 - 1), "bytes": min(rep.nbytes, 2**64 - 1),
                      "seconds": min(86400.0, rep.seconds), "kernel_drops": min(rep.kernel_drops, 2**32 - 1),
                      "position": min(rep.position, 2**32 - 1), "arrived": rep.arrived}
            out.append(SendReport(core.group_id, i, peer, fields))
        return out
