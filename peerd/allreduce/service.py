"""The trio shell of the averaging host: it waits, seals, sends and counts; host.py decides.

Data datagrams carry the sender's sealing token, never a node id: the host maps tokens to member indices
through the token's binding (a signed control message). So before sending any data, a member pings every
other member (the host's Bind actions): the request binds its token at them, the response theirs at it.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import trio

from ..metrics import Metrics
from ..transport.endpoint import Address, Endpoint, Incoming, RpcError
from ..transport.pacing import Pacer
from ..wire import messages as m
from ..wire.envelope import Header
from ..wire.identity import node_id_of
from ..wire.seal import TokenState
from .actions import ProbeMember
from .frames import BodyType
from .group import GroupAverage, GroupStats
from .host import (
    DATA_TYPES,
    END_SPACING_S,
    IDLE_WAIT_S,
    Action,
    AveragingHost,
    Bind,
    Completed,
    Dropped,
    HeldTimer,
    PacerVerdict,
    SendBlock,
    SendReport,
    Wake,
)
from .options import DEFAULT_OPTIONS, AverageOptions

log = logging.getLogger("peerd.allreduce")
# A send loop that never waits for its pacer lets other tasks in (the receive loop, the DHT) once its socket holds
# SEND_YIELD_QUEUED bytes (about one receive pass: the receive loop takes an arena of 1 MB a pass) or SEND_YIELD_S
# passed. Each yield is a receive pass: yielding after every part (about 1 MB) makes more, smaller passes and costs
# more CPU than yielding every few ms; but time alone lets receivers' socket buffers overflow where a slice brings
# in several passes' worth (`peerd bench allreduce --peers 8 --size 25000000 --insecure`: kernel drops).
SEND_YIELD_QUEUED = 2 * 1024 * 1024  # bytes the kernel accounts, about 1 MB of datagrams (skb overhead included)
SEND_YIELD_S = 0.005
TEND_S = 0.002  # while a group's blocks go out, its due END copies are looked at this often (``_tend``)

_node_id = functools.lru_cache(maxsize=4096)(node_id_of)  # a token's key -> node id, once per key


@dataclass(frozen=True)
class Member:
    public_key: bytes | None  # None: unknown yet, bound through the handshake
    node_id: bytes
    addr: Address


@dataclass(frozen=True, slots=True)
class AverageResult:
    """One finished group average: the vector, the core's statistics, and what it cost this node."""

    vector: np.ndarray
    stats: GroupStats
    seconds: float
    handshake_s: float
    bytes_sent: int
    datagrams_sent: int


class Averager(Protocol):
    """What Moshpit and the benches use of a node's averaging: AllreduceService, or a wrapper around one that
    does something first (moshpit.averager.PathsFirst: a path to every member)."""

    @property
    def pacer(self) -> Pacer: ...

    @property
    def max_body(self) -> int: ...

    async def average(self, group_id: int, members: list[Member], index: int, vector: np.ndarray, weight: float,
                      options: AverageOptions = DEFAULT_OPTIONS, *, out: np.ndarray | None = None,
                      center: np.ndarray | None = None) -> AverageResult: ...


class AllreduceService:
    """This node's averages over its endpoint. ``group_factory``: what builds each group's core (GroupAverage by
    default; a lab passes a fault injector's, peerd.tools.faults)."""

    def __init__(
        self, endpoint: Endpoint, metrics: Metrics, *, pacer: Pacer | None = None,
        group_factory: Callable[..., GroupAverage] = GroupAverage,
    ) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.host = AveragingHost(max_body=endpoint.max_body, mtu=endpoint.mtu, pacer=pacer,
                                  group_factory=group_factory, split_values=True, end_spacing_s=END_SPACING_S)
        self._wake: dict[int, trio.Event] = {}
        self._floor_s: dict[int, float] = {}  # running group -> its phase floor (how long a deadline waits to catch up)
        self._probing: dict[int, tuple[trio.Nursery, list[Member]]] = {}  # running group -> where its probes run
        self._timer: trio.CancelScope | None = None  # the host's timer task's sleep, while it runs
        self._rate_shown: float | None = None  # the pacing rate the gauge shows
        for t in BodyType:
            endpoint.on_raw(int(t), self._on_data)
        for t in DATA_TYPES:
            endpoint.on_raw_block(t, self._on_block)
        endpoint.on_message(m.MsgType.REPORT, self._on_report)
        endpoint.on_bind(self._on_bind)
        endpoint.protected_tokens = self.host.protected_tokens  # running groups' data is never shed
        endpoint.reads_now = self.host.awaits_tail  # a phase's tail is read as it comes

    @property
    def pacer(self) -> Pacer:
        return self.host.pacer

    @property
    def max_body(self) -> int:
        """The largest tensor body this node's groups take (its datagram payload)."""
        return self.host.max_body

    # -- what arrives (the endpoint's handlers: synchronous) --------------------------------------
    def _on_data(self, header: Header, body: bytes, state: TokenState, source: Address) -> None:
        key = state.peer_key
        host = self.host
        host.receive_data(None if key is None else _node_id(key), header.token, header.type, body,
                          trio.current_time())
        actions = host.take_actions()
        if actions:  # (most bodies: none; this path runs per datagram)
            self._run(actions)

    def _on_block(self, mtype: int, token: int, state: TokenState, bodies: np.ndarray, source: Address) -> None:
        key = state.peer_key
        self.host.receive_block(None if key is None else _node_id(key), token, mtype, bodies, trio.current_time())
        self._run(self.host.take_actions())

    def _on_bind(self, token: int, public_key: bytes) -> None:
        self.host.receive_bind(token, _node_id(public_key), trio.current_time())
        self._run(self.host.take_actions())

    def _on_report(self, incoming: Incoming) -> None:
        self.host.receive_report(incoming.peer.node_id, incoming.body, trio.current_time())
        self._run(self.host.take_actions())

    def _run(self, actions: Iterable[Action]) -> None:
        """Carry out the actions that need no waiting."""
        for a in actions:
            if type(a) is Dropped:
                self.metrics.datagrams_dropped.labels(a.reason).inc(a.count)
            elif type(a) is Wake:
                event = self._wake.get(a.group_id)
                if event is not None:
                    event.set()
            elif type(a) is HeldTimer:
                self._arm_timer()
            elif type(a) is ProbeMember:
                probing = self._probing.get(a.group_id)
                if probing is not None:  # (else the group's average is over: nothing waits for the answer)
                    probing[0].start_soon(self._probe, a, probing[1][a.to].addr)
            elif type(a) is PacerVerdict:
                if a.rate != self._rate_shown:  # (a verdict per REPORT, the rate changes at a few: a lock each)
                    self._rate_shown = a.rate
                    self.metrics.pacing_rate.set(a.rate)
                if a.verdict.action == "decrease":
                    log.debug("pacing: %.1f MB/s (%s)", a.rate / 1e6, a.verdict.reason)
                if a.verdict.action in ("decrease", "increase"):
                    self.metrics.pacing_changes.labels(a.verdict.action).inc()
            else:
                raise TypeError(f"the allreduce host asked for {a!r} where only counts and wake-ups are expected")

    def _arm_timer(self) -> None:
        """The host's timer may have moved: the timer task sleeps until its new time (started where none runs)."""
        if self._timer is not None:
            at = self.host.get_timer()
            self._timer.deadline = math.inf if at is None else at
            return
        # A system task: this service has no nursery of its own, and the timer must outlive the task that armed
        # it (it frees held data on an idle node too). It ends when the host has nothing scheduled.
        self._timer = trio.CancelScope()
        trio.lowlevel.spawn_system_task(self._run_timer, self._timer, name="peerd.allreduce.timer")

    async def _run_timer(self, scope: trio.CancelScope) -> None:
        """At the host's timer: first what reached the socket before it (a running group's deadline must not call
        data late that a loaded node has not read yet), then ``handle_timer``: held data expires, groups' phases
        end, their drivers are woken."""
        try:
            while (at := self.host.get_timer()) is not None:
                scope.deadline = at
                with scope:
                    await trio.sleep_forever()
                at = scope.deadline  # (it may have moved while this task slept)
                scope = self._timer = trio.CancelScope()
                if self._floor_s:
                    await self._wait_caught_up(at, max(self._floor_s.values()))
                self.host.handle_timer(trio.current_time())
                self._run(self.host.take_actions())
        except Exception:  # never take the daemon down (a system task's error would end the whole run)
            log.exception("allreduce: the host's timer failed")
            self.metrics.background_errors.labels("allreduce_held").inc()
        finally:
            if self._timer is scope:
                self._timer = None

    def _kernel_drops(self) -> int:
        return self.endpoint.kernel_drops

    def _arrivals(self, members: list[Member]) -> list[float] | None:
        """Per member, when the kernel received its latest data (UdpSocket.arrivals; 0: unknown)."""
        table = getattr(self.endpoint.sock, "arrivals", None)
        if not table:
            return None
        return [table.get(m.addr, 0.0) for m in members]

    def _gso(self) -> bool:
        """Whether the socket sends GSO batches now (its declared capabilities: it may lose GSO at a send)."""
        return self.endpoint.caps.gso

    # -- one group's average --------------------------------------------------------------------
    async def average(
        self,
        group_id: int,
        members: list[Member],
        index: int,
        vector: np.ndarray,
        weight: float,
        options: AverageOptions = DEFAULT_OPTIONS,
        *,
        out: np.ndarray | None = None,
        center: np.ndarray | None = None,
    ) -> AverageResult:
        """Average ``vector`` (weight: its sample count) with ``members`` as member ``index`` of group
        ``group_id``, as ``options`` say (options.py: deadlines, the weight cap, robust clipping, the codec,
        absent members). ``out``: where the result goes (``vector`` itself: in place); ``center``: the previous
        round's average, for robust ``centered`` (None: clip around zero)."""
        host = self.host
        floor_s = options.floor_s
        wall0 = time.perf_counter()
        host.start(
            group_id, [mb.node_id for mb in members], index, vector, weight, trio.current_time(), options=options,
            kernel_drops=self._kernel_drops(), gso=self._gso(), out=out, center=center,
            rtts=[self.endpoint.rto.srtt(mb.addr) for mb in members] if options.probe_silent else None,
        )
        actions = host.take_actions()
        self._wake[group_id] = trio.Event()
        self._floor_s[group_id] = floor_s
        handshake = [0.0]
        sent = [0, 0]  # bytes, datagrams
        completed: Completed | None = None
        serve = False
        try:
            async with trio.open_nursery() as nursery:
                self._probing[group_id] = (nursery, members)
                # Bind tokens while data already flows: data from a token not bound yet waits for it.
                nursery.start_soon(self._handshake, [a for a in actions if type(a) is Bind], members, handshake)
                nursery.start_soon(self._reporter, group_id, members)
                self._run(a for a in actions if type(a) is not Bind)
                await self._drive(group_id, members, sent, release=True)
                # END copies not due yet: nothing here waits for them, and members may still (they go at once)
                await self._send_blocks(host.due_copies(group_id, math.inf), members, sent)
                nursery.cancel_scope.cancel()  # pings to members that never answered; the reporter
            if host.finished(group_id):
                host.finish(group_id, self._kernel_drops(), trio.current_time(), arrivals=self._arrivals(members))
            else:  # only repair is left (requests may have come meanwhile): this member's step does not wait for it
                host.release(group_id, self._kernel_drops(), trio.current_time(), arrivals=self._arrivals(members))
                serve = True
            done = host.take_actions()
            # what arrived since the last report, and the lost tail
            await self._send_reports([a for a in done if type(a) is SendReport], members)
            self._run(a for a in done if type(a) is Dropped)
            completed = next(a for a in done if type(a) is Completed)
        finally:
            self._floor_s.pop(group_id, None)
            self._probing.pop(group_id, None)
            if serve and host.serving(group_id):
                trio.lowlevel.spawn_system_task(self._serve, group_id, members, name="peerd.allreduce.serve")
            else:
                self._wake.pop(group_id, None)
                if host.running(group_id):  # cancelled or failed: nothing more to send for it
                    host.finish(group_id, self._kernel_drops(), trio.current_time())
                    self._run(a for a in host.take_actions() if type(a) is Dropped)
        assert completed is not None  # (a finished group's finish always completes it)
        seconds = time.perf_counter() - wall0
        self._record(completed.stats, seconds, sent[0])
        return AverageResult(completed.vector, completed.stats, seconds, handshake[0], sent[0], sent[1])

    async def _drive(self, group_id: int, members: list[Member], sent: list[int], *, release: bool) -> None:
        """Send what the group has to send, when its pacing and timers say, until it is finished (``release``: or
        until its result can be handed on while it goes on serving repairs)."""
        host = self.host

        def over() -> bool:
            if release:
                return host.finished(group_id) or host.can_release(group_id)
            return not host.serving(group_id) or host.finished(group_id)  # (serving: an id used again ends it)

        while not over():
            wake = self._wake[group_id] = trio.Event()  # (before the work: a Wake during it is kept)
            while host.wants_to_send(group_id):
                await self._send_blocks(host.datagrams_to_send(trio.current_time(), host.send_window(group_id),
                                                                group_id=group_id), members, sent, group_id=group_id)
                host.note_sent(group_id, trio.current_time())
            copies = host.due_copies(group_id, trio.current_time())
            if copies:
                await self._send_blocks(copies, members, sent)
            if over():
                break
            self._arm_timer()  # the host's timer wakes this loop at the group's deadlines, gates and copies
            with trio.move_on_after(IDLE_WAIT_S):
                await wake.wait()

    async def _serve(self, group_id: int, members: list[Member]) -> None:
        """A released group's last work, in the background: resend the ranges members ask for until every member
        is done with this owner's stream or its serving time is over (repair.SERVE_S), then forget the group."""
        host = self.host
        sent = [0, 0]
        try:
            await self._drive(group_id, members, sent, release=False)
        except Exception:  # never take the daemon down (a system task's error would end the whole run)
            log.exception("allreduce: serving group %#x's repairs failed", group_id)
            self.metrics.background_errors.labels("allreduce_serve").inc()
        finally:
            self.metrics.allreduce_bytes_sent.inc(sent[0])
            if host.serving(group_id):  # (else an average of the same id has ended it: that one owns its entry)
                self._wake.pop(group_id, None)
                host.finish(group_id, self._kernel_drops(), trio.current_time())
                self._run(a for a in host.take_actions() if type(a) is Dropped)

    async def _wait_caught_up(self, at: float, most_s: float) -> None:
        """Until the receive loop has handled what reached the socket before ``at`` (``Endpoint.caught_up``), at
        most ``most_s`` longer than ``at`` or than now, whichever is later: a node behind on its own queue must not
        call its members' data late, and a node whose process was not scheduled until well past ``at`` (starved of
        CPU) has had no time to read what came before it."""
        await self.endpoint.wait_caught_up(at, max(at, trio.current_time()) + most_s)

    async def _probe(self, a: ProbeMember, addr: Address) -> None:
        """PING a member whose stream went silent (the host's ProbeMember) and tell the host who answered. The PING
        stays open past its timeout until the receive loop has read what reached the socket before it: on a node
        short of CPU, a PONG still queued there is an answer, not a failure (three failures make a member dead)."""
        at = trio.current_time() + a.timeout
        most = a.timeout + max(self._floor_s.values(), default=a.timeout)
        sender: bytes | None = None
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                nonlocal sender
                try:
                    reply = await self.endpoint.request(addr, m.MsgType.PING, {}, node_id=a.peer, timeout=most,
                                                        attempts=1)
                    sender = reply.peer.node_id
                except RpcError:
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(ask)
            await trio.sleep_until(at)
            await self._wait_caught_up(at, most - a.timeout)
            nursery.cancel_scope.cancel()
        self.host.receive_probe(a.group_id, a.token, sender, trio.current_time())
        self._run(self.host.take_actions())
        self._arm_timer()  # (an answer sets the member's next probe: the timer may sleep past it)

    async def _handshake(self, binds: list[Bind], members: list[Member], took: list[float]) -> None:
        start = trio.current_time()

        async def ping(mb: Member) -> None:
            try:  # quick retries: until both sides are bound, their data waits
                await self.endpoint.request(mb.addr, m.MsgType.PING, {}, timeout=0.15, attempts=6)
            except RpcError as e:
                log.info("group member %s unreachable: %s", mb.node_id.hex()[:12], e)

        async with trio.open_nursery() as nursery:
            for b in binds:
                nursery.start_soon(ping, members[b.to])
        took[0] = trio.current_time() - start

    async def _send_blocks(self, blocks: list[SendBlock], members: list[Member], sent: list[int], *,
                           group_id: int | None = None) -> None:
        """Send parts (``AveragingHost.part_rows``: about 1 ms at the pacer's rate, in whole GSO sends where that is
        one or more) of each destination's blocks in turn, each part when the host's pacing says: the destinations
        share the uplink evenly at every moment (see ``AveragingHost.send_window``). One destination's blocks go
        strictly in order: its END markers must not overtake its data (a receiver ends the phase on them).

        Each part is sealed when it goes, with no wait between sealing and sending, so sequence numbers follow the
        send order and a receiver's replay window only sees the gaps other destinations' parts leave. (Sealed a
        slice ahead, a block that went out last lagged the sender's REPORTs to its receiver, sealed later, by the
        whole slice: the slice had to stay within half the window, which cut 8-peer blocks to 486 rows.)

        With ``group_id``, the group's own business goes on while its blocks go (the all-gather follows the
        reduce-scatter at once, for a fraction of a second): END copies that fall due go first to their member
        (``_tend``), not left until the blocks are out."""
        queues: dict[int, list[list]] = {}
        for b in blocks:
            member = members[b.to]
            body = b.bodies.shape[1] + (b.values.shape[1] * b.values.itemsize if b.values is not None else 0)
            queues.setdefault(b.to, []).append([b, member, body, 0])  # ..., the next part's first row
        yielded = trio.current_time()
        tend_at = yielded + TEND_S if group_id is not None else math.inf
        while queues:
            if trio.current_time() >= tend_at:
                tend_at = trio.current_time() + TEND_S
                self._tend(group_id, queues, members)  # type: ignore[arg-type]
            for to in list(queues):
                queue = queues[to]
                entry = queue[0]
                b, member, body, row = entry
                rows = min(self.host.part_rows(b), len(b.bodies) - row)
                entry[3] = row + rows
                if entry[3] >= len(b.bodies):
                    queue.pop(0)
                if not queue:
                    del queues[to]
                if rows <= 0:
                    continue
                sealer = self.endpoint.data_sealer(member.node_id)
                now = trio.current_time()
                at = self.host.pace(b, rows, rows * (body + sealer.overhead), now)
                if at > now:
                    await trio.sleep_until(at)
                    yielded = trio.current_time()
                    self.host.sent(b, yielded)
                    sealer = self.endpoint.data_sealer(member.node_id)  # (it may have rotated meanwhile)
                heads = b.bodies[row : row + rows]
                if b.values is None:
                    chunk = sealer.seal_block(b.type, heads, member.node_id)
                else:  # tensor headers, then values sealed straight from the vector or result
                    chunk = sealer.seal_split(b.type, heads, b.values[row : row + rows], member.node_id)
                try:
                    await self.endpoint.send_sealed(member.addr, chunk)
                except RpcError as e:
                    log.debug("%s", e)
                    queues.pop(to, None)  # the rest for this member (as before: its blocks are abandoned)
                    continue
                sent[0] += chunk.size
                sent[1] += len(chunk)
                if (trio.current_time() - yielded >= SEND_YIELD_S
                        or self.endpoint.receive_backlog() >= SEND_YIELD_QUEUED):
                    await trio.lowlevel.checkpoint()
                    yielded = trio.current_time()
        await trio.lowlevel.checkpoint()  # let receives and DHT requests in between slices

    def _tend(self, group_id: int, queues: dict[int, list[list]], members: list[Member]) -> None:
        """While ``_send_blocks`` sends the group's blocks: repair requests and resends now due, and END copies
        now due, go to the front of their member's queue (an END's data went before it; a request or resend
        concerns a stream that has ended). The host's timer waits until the blocks are out: a phase deadline
        handled while this member is still sending (a capped uplink) would end phases its own data has not
        reached yet (`peerd bench caps --cap-upload`: members then averaged without it)."""
        host = self.host
        if not host.running(group_id):
            return
        now = trio.current_time()
        for b in [*host.repair_to_send(group_id, self.endpoint.caught_up, now), *host.due_copies(group_id, now)]:
            body = b.bodies.shape[1] + (b.values.shape[1] * b.values.itemsize if b.values is not None else 0)
            queues.setdefault(b.to, []).insert(0, [b, members[b.to], body, 0])

    async def _reporter(self, group_id: int, members: list[Member]) -> None:
        """Tell each sender what arrived from it, when the host says (every REPORT_INTERVAL_S)."""
        while True:
            await trio.sleep_until(self.host.next_report(group_id))
            await self._send_reports(self.host.reports(group_id, self._kernel_drops(), trio.current_time(),
                                                       arrivals=self._arrivals(members)), members)

    async def _send_reports(self, reports: list[SendReport], members: list[Member]) -> None:
        for r in reports:
            try:
                await self.endpoint.notify(members[r.to].addr, m.MsgType.REPORT, r.fields, node_id=r.peer)
            except RpcError:
                pass

    def _record(self, stats: GroupStats, seconds: float, sent_bytes: int) -> None:
        mt = self.metrics
        mt.allreduce_seconds.observe(seconds)
        mt.allreduce_bytes_sent.inc(sent_bytes)
        for reason, count in stats.refused.items():
            mt.contributions_refused.labels(reason).inc(count)
        if stats.dead:
            mt.allreduce_dead.inc(len(stats.dead))
            log.info("group %#x: stopped waiting for member(s) %s: their daemons did not answer", stats.group_id,
                     list(stats.dead))
        for phase, ph in (("reduce_scatter", stats.reduce_scatter), ("all_gather", stats.all_gather)):
            mt.allreduce_expected.labels(phase).inc(ph.datagrams_expected)
            mt.allreduce_received.labels(phase).inc(ph.datagrams_received)
