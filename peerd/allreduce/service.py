"""The trio driver of GroupAverage: routes tensor datagrams to running groups, paces what it sends.

Data datagrams carry the sender's sealing token, never a node id: a group maps tokens to member
indices through the token's binding (a signed control message). So before sending any data, a member
pings every other member: the request binds its token at them, the response theirs at it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import trio

from ..metrics import Metrics
from ..transport.endpoint import Address, Endpoint, Incoming, RpcError
from ..transport.pacing import DeliveryMeter, Pacer, Report, SendPositions
from ..wire import messages as m
from ..wire.envelope import Header
from ..wire.errors import WireError
from ..wire.identity import node_id_of
from ..wire.seal import TokenState
from .codec import BodyType, peek_group
from .group import BYZANTINE_MODES, GroupAverage, GroupStats, OutBlock, Outcome
from .held import HeldData
from .robust import Robust

log = logging.getLogger("peerd.allreduce")

BATCH = 128  # datagrams per slice of sending work at least (a slice is one block or more)
BLOCK_BYTES = 512 * 1024  # a block is built and sealed in one pass (~1 ms sealed), then sent in GSO parts
GSO_BYTES = 65000  # one GSO send (and one pacing reservation) is at most 64 segments, 64 KB
_DATA_TYPES = frozenset({int(BodyType.RS_DATA), int(BodyType.AG_DATA)})
REPORT_INTERVAL_S = 0.025  # a receiver reports delivery to each sender about this often while data flows
RECENT_GROUPS = 4  # finished groups whose members' last REPORTs still count


@dataclass(frozen=True)
class Member:
    public_key: bytes | None  # None: unknown yet, bound through the handshake
    node_id: bytes
    addr: Address


@dataclass
class AverageResult:
    vector: np.ndarray
    stats: GroupStats
    seconds: float
    handshake_s: float
    bytes_sent: int
    datagrams_sent: int


class _Running:
    def __init__(self, core: GroupAverage, members: list[Member]) -> None:
        self.core = core
        self.members = members
        self.by_node = {mb.node_id: i for i, mb in enumerate(members)}
        self.by_token: dict[int, int] = {}
        self.handshake_s = 0.0
        self.hold_until: float | None = None
        self.wake = trio.Event()
        # Per member: data datagrams sent to it so far (its reduce-scatter stream, then its all-gather
        # stream: the positions a receiver's REPORT counts in) and when each batch of them went out.
        self.positions = [SendPositions() for _ in members]
        self.sent_to = [0] * len(members)


class AllreduceService:
    """``byzantine``: a fault-injection hook for demos and benches ONLY. Set to one of "scale", "signflip",
    "nan", "random", this node corrupts its own reduce-scatter contributions before sending them (x1000,
    x-1, NaN, gaussian noise of 100x the vector's RMS); its own shard and its all-gather stay honest."""

    def __init__(
        self, endpoint: Endpoint, metrics: Metrics, *, pacer: Pacer | None = None, byzantine: str | None = None
    ) -> None:
        if byzantine is not None and byzantine not in BYZANTINE_MODES:
            raise ValueError(f"byzantine must be one of {', '.join(BYZANTINE_MODES)} (or None), got {byzantine!r}")
        self.endpoint = endpoint
        self.metrics = metrics
        self.pacer = pacer or Pacer()
        self.byzantine = byzantine
        if byzantine is not None:
            log.warning("!!! BYZANTINE FAULT INJECTION ON: this node corrupts every reduce-scatter contribution it"
                        " sends (%s). For demos and benchmarks only; never in a real swarm !!!", byzantine)
        self._groups: dict[int, _Running] = {}
        # Bodies for groups this node has not started yet, and from tokens not bound yet: bounded in bytes
        # (total and per token) and in time (a timer task, ``_expire_held``, frees them).
        self._held = HeldData()
        self._expiring = False  # the expiry timer task is running
        self._recent: OrderedDict[int, _Running] = OrderedDict()  # finished groups, for their last REPORTs
        for t in BodyType:
            endpoint.on_raw(int(t), self._on_data)
        for t in _DATA_TYPES:
            endpoint.on_raw_block(t, self._on_block)
        endpoint.on_message(m.MsgType.REPORT, self._on_report)
        endpoint.on_bind(self._on_bind)

    # -- receiving ------------------------------------------------------------------------------
    def _on_data(self, header: Header, body: bytes, state: TokenState, source: Address) -> None:
        group = peek_group(body)
        if len(body) > self.endpoint.max_body:  # no group of this node takes it: do not even hold it
            raise WireError("malformed", f"tensor body of {len(body)} bytes; this node's bodies are at most"
                            f" {self.endpoint.max_body}")
        run = self._groups.get(group)
        if run is None:
            self._hold(group, header.type, header.token, body, state)
            return
        self._deliver(run, header.type, header.token, body, state)

    def _on_block(self, mtype: int, token: int, state: TokenState, bodies: np.ndarray, source: Address) -> None:
        """A GRO block of one sender's data: handed to the group whole when it is a clean run of its
        ranges, else body by body (which counts whatever is wrong with each)."""
        run = self._groups.get(int.from_bytes(bodies[0, :4].tobytes(), "little"))
        index = self._sender_index(run, token, state) if run is not None else None
        result = None
        if run is not None and index is not None:
            core = run.core
            before = core.phase_changes
            result = core.receive_block(index, mtype, bodies, trio.current_time())
            if result is not None:
                if result[2]:
                    self.metrics.datagrams_dropped.labels(Outcome.LATE.value).inc(result[2])
                if core.phase_changes != before:
                    run.wake.set()
                return
        if bodies.shape[1] > self.endpoint.max_body:
            raise WireError("malformed", f"tensor bodies of {bodies.shape[1]} bytes")
        for row in bodies:
            body = row.tobytes()
            run = self._groups.get(peek_group(body))
            if run is None:
                self._hold(peek_group(body), mtype, token, body, state)
            else:
                self._deliver_counted(run, mtype, token, body, state)

    def _sender_index(self, run: _Running, token: int, state: TokenState) -> int | None:
        """The member index behind a token; None while the token is not bound (or not a member)."""
        index = run.by_token.get(token)
        if index is None and state.peer_key is not None:
            index = run.by_node.get(node_id_of(state.peer_key))
            if index is not None:
                run.by_token[token] = index
        return index

    def _deliver(self, run: _Running, mtype: int, token: int, body: bytes, state: TokenState) -> None:
        index = self._sender_index(run, token, state)
        if index is None:
            if state.peer_key is None:  # its sender's PING has not arrived yet: keep it until it does
                if not self._keep(run.core.group_id, mtype, token, body, state):
                    raise WireError("unbound", "too much held data from this token")
                return
            raise WireError("sender", "data from a node that is not in this group")
        core = run.core
        before = core.phase_changes
        outcome = core.receive(index, mtype, body, trio.current_time())
        if outcome is not Outcome.ACCEPTED and outcome is not Outcome.DUPLICATE:
            self.metrics.datagrams_dropped.labels(outcome.value).inc()
        if core.phase_changes != before:
            run.wake.set()

    def _deliver_counted(self, run: _Running, mtype: int, token: int, body: bytes, state: TokenState) -> None:
        try:
            self._deliver(run, mtype, token, body, state)
        except WireError as e:
            self.metrics.datagrams_dropped.labels(e.reason).inc()

    def _on_bind(self, token: int, public_key: bytes) -> None:
        for run in list(self._groups.values()):
            held = self._held.pop(run.core.group_id, token)
            if held:
                run.wake.set()
                for item in held:
                    self._deliver_counted(run, *item)

    def _hold(self, group: int, mtype: int, token: int, body: bytes, state: TokenState) -> None:
        """Keep data for a group this node has not started yet: its members may start first."""
        if not self._keep(group, mtype, token, body, state):
            self.metrics.datagrams_dropped.labels("held").inc()

    def _keep(self, group: int, mtype: int, token: int, body: bytes, state: TokenState) -> bool:
        """Hold a body within the bounds (False: refused, its token holds too much already)."""
        kept, dropped = self._held.add(group, token, (mtype, token, body, state), len(body), trio.current_time())
        if dropped:
            self.metrics.datagrams_dropped.labels("held").inc(dropped)
        if kept and not self._expiring:
            # A timer frees held data on an idle node too; it runs while anything is held. (A system task:
            # this service has no nursery of its own, and the task must outlive the one that received.)
            self._expiring = True
            trio.lowlevel.spawn_system_task(self._expire_held, name="peerd.allreduce.expire_held")
        return kept

    async def _expire_held(self) -> None:
        """Expire held bodies on a timer, not only when the next one arrives; ends when nothing is held."""
        try:
            while (at := self._held.next_expiry()) is not None:
                await trio.sleep_until(at)
                dropped = self._held.expire(trio.current_time())
                if dropped:
                    self.metrics.datagrams_dropped.labels("held").inc(dropped)
        except Exception:  # never take the daemon down (a system task's error would end the whole run)
            log.exception("allreduce: expiring held data failed")
            self.metrics.background_errors.labels("allreduce_held").inc()
        finally:
            self._expiring = False

    def _on_report(self, incoming: Incoming) -> None:
        b = incoming.body
        report = Report(b["expected"], b["received"], b["bytes"], b["seconds"], b["kernel_drops"], b["position"])
        node = incoming.peer.node_id
        run = self._groups.get(b["group"]) or self._recent.get(b["group"])
        i = run.by_node.get(node) if run is not None else None
        if run is None or i is None or i == run.core.index:
            # Only a member of a running or recent group with that id speaks for a path this node sends on:
            # anyone else (every member holds the swarm key) could throttle this node's sending.
            self.metrics.datagrams_dropped.labels("report").inc()
            return None
        span = None
        if report.expected > 0:
            first = report.position - report.expected
            if report.position > run.sent_to[i]:
                # A receiver that gave up on the phase (its deadline) counts what this member has not sent
                # yet as lost: that is not the path's loss.
                top = max(first, run.sent_to[i])
                report = replace(report, expected=top - first, received=min(report.received, top - first),
                                 position=top)
            if report.expected > 0:
                span = run.positions[i].span(max(0, first - 1), report.position - 1)
        verdict = self.pacer.on_report(node, report, trio.current_time(), span)
        self.metrics.pacing_rate.set(verdict.rate)
        if verdict.action == "decrease":
            log.debug("pacing: %.1f MB/s (%s)", verdict.rate / 1e6, verdict.reason)
        return None

    # -- one group's average --------------------------------------------------------------------
    async def average(
        self,
        group_id: int,
        members: list[Member],
        index: int,
        vector: np.ndarray,
        weight: float,
        *,
        floor_s: float = 1.0,
        max_phase_s: float | None = 60.0,
        end_grace_s: float = 0.05,
        out: np.ndarray | None = None,
        max_weight: float | None = None,
        robust: Robust | None = None,
        center: np.ndarray | None = None,
    ) -> AverageResult:
        """Average ``vector`` (weight: its sample count) with ``members`` as member ``index`` of group
        ``group_id``. ``max_weight``: the most samples any member's weight counts for (None: 2**24), from
        the local trainer's ``max_samples``. ``robust``: norm clipping at the shard owner (robust.py; it
        bounds how far one member moves the average, it does not stop a sign-flipped gradient of normal
        size); ``center``: the previous round's average, for ``centered`` (None: clip around zero)."""
        if group_id in self._groups:
            raise ValueError(f"group {group_id:#x} is already averaging on this node")
        wall0 = time.perf_counter()
        core = GroupAverage(
            group_id, len(members), index, vector, weight, trio.current_time(),
            max_payload=self.endpoint.max_body, floor_s=floor_s, max_phase_s=max_phase_s, out=out,
            end_grace_s=end_grace_s, max_weight=max_weight, robust=robust, center=center, byzantine=self.byzantine,
        )
        run = self._groups[group_id] = _Running(core, members)
        sent_bytes = sent = 0
        try:
            async with trio.open_nursery() as nursery:
                # Bind tokens while data already flows: data from a token not bound yet waits for it.
                nursery.start_soon(self._handshake, run)
                meters = [DeliveryMeter(trio.current_time(), self._kernel_drops()) for _ in members]
                nursery.start_soon(self._reporter, run, meters)
                for item in self._held.pop_group(group_id):
                    self._deliver_counted(run, *item)
                # Blocks are built and sealed whole (numpy calls cost per block, not per datagram) and go
                # out one GSO send at a time, each paced; without GSO, 16 datagrams keep bursts short.
                gso = getattr(self.endpoint.sock, "gso", False)
                part = max(1, min(64 if gso else 16, GSO_BYTES // self.endpoint.mtu))
                rows = max(part, BLOCK_BYTES // self.endpoint.mtu // part * part)
                while not core.finished:
                    while core.wants_to_send:
                        nbytes, count = await self._send_blocks(run, core.next_blocks(rows, BATCH), part)
                        sent_bytes += nbytes
                        sent += count
                    if core.finished:
                        break
                    run.wake = trio.Event()
                    deadline = core.next_deadline()
                    if deadline is not None and self._held.holds(group_id):
                        # Data from a sender whose binding is still in flight would turn up as silence:
                        # give the handshake's retries up to one more floor before the deadline counts.
                        if run.hold_until is None:
                            run.hold_until = trio.current_time() + floor_s
                        deadline = max(deadline, run.hold_until)
                    with trio.move_on_at(deadline if deadline is not None else trio.current_time() + 1.0):
                        await run.wake.wait()
                    if not self._held.holds(group_id) or (
                        run.hold_until is not None and trio.current_time() >= run.hold_until
                    ):
                        core.handle_timer(trio.current_time())
                nursery.cancel_scope.cancel()  # pings to members that never answered; the reporter
            await self._report(run, meters, final=True)  # what arrived since the last report, and the lost tail
        finally:
            del self._groups[group_id]
            self._recent[group_id] = run
            while len(self._recent) > RECENT_GROUPS:
                self._recent.popitem(last=False)
            unbound = len(self._held.pop_group(group_id))
            if unbound:
                self.metrics.datagrams_dropped.labels("unbound").inc(unbound)
        seconds = time.perf_counter() - wall0
        stats = core.statistics()
        self._record(stats, seconds, sent_bytes)
        return AverageResult(core.result(), stats, seconds, run.handshake_s, sent_bytes, sent)

    async def _handshake(self, run: _Running) -> None:
        start = trio.current_time()

        async def ping(mb: Member) -> None:
            try:  # quick retries: until both sides are bound, their data waits
                await self.endpoint.request(mb.addr, m.MsgType.PING, {}, timeout=0.15, attempts=6)
            except RpcError as e:
                log.info("group member %s unreachable: %s", mb.node_id.hex()[:12], e)

        async with trio.open_nursery() as nursery:
            for i, mb in enumerate(run.members):
                if i != run.core.index:
                    nursery.start_soon(ping, mb)
        run.handshake_s = trio.current_time() - start

    async def _send_blocks(self, run: _Running, blocks: list[OutBlock], part: int) -> tuple[int, int]:
        """Seal each block whole, then send it ``part`` datagrams (one GSO send) at a time, paced."""
        nbytes = count = 0
        for b in blocks:
            bodies = b.bodies if b.repeat == 1 else np.repeat(b.bodies, b.repeat, axis=0)
            member = run.members[b.to]
            datagrams = self.endpoint.data_sealer(member.node_id).seal_block(b.type, bodies, member.node_id)
            for i in range(0, len(datagrams), part):
                chunk = datagrams[i : i + part]
                rows = len(chunk)
                wait = self.pacer.reserve(chunk.size, trio.current_time(), member.node_id)
                if wait > 0:
                    await trio.sleep(wait)
                if b.type in _DATA_TYPES:
                    run.sent_to[b.to] += rows
                    run.positions[b.to].note(run.sent_to[b.to], trio.current_time())
                try:
                    await self.endpoint.send_sealed(member.addr, chunk)
                except RpcError as e:
                    log.debug("%s", e)
                    break
                nbytes += chunk.size
                count += rows
        await trio.lowlevel.checkpoint()  # let receives and DHT requests in between slices
        return nbytes, count

    def _kernel_drops(self) -> int:
        return getattr(self.endpoint.sock, "kernel_drops", 0)

    async def _reporter(self, run: _Running, meters: list[DeliveryMeter]) -> None:
        """Every REPORT_INTERVAL_S, tell each sender what arrived from it since the last report."""
        while True:
            await trio.sleep(REPORT_INTERVAL_S)
            await self._report(run, meters, final=False)

    async def _report(self, run: _Running, meters: list[DeliveryMeter], *, final: bool) -> None:
        """One sender's flow to this member is its reduce-scatter stream, then its all-gather stream (it
        sends them one after the other), so the two phases count as one run of datagram indices."""
        core = run.core
        rs_expected, rs_received, rs_top, rs_first, rs_at = core.progress(0)
        ag_expected, ag_received, ag_top, ag_first, ag_at = core.progress(1)
        drops = self._kernel_drops()
        now = trio.current_time()
        size = self.endpoint.mtu
        for i, mb in enumerate(run.members):
            if i == core.index:
                continue
            received = rs_received[i] + ag_received[i]
            phase = 1 if ag_top[i] else 0
            top = rs_expected[i] + ag_top[i] if ag_top[i] else rs_top[i]
            last_at = max(rs_at[i], ag_at[i])
            first_at = rs_first[i] if rs_received[i] else ag_first[i]
            meter = meters[i]
            total = rs_expected[i] + ag_expected[i]
            if final:
                rep = meter.final(total, received, received * size, first_at, last_at, drops, now)
            else:
                rep = meter.sample(received, top, received * size, first_at, last_at, drops, now)
            if rep is None:
                continue
            fields = {"group": core.group_id, "phase": phase, "expected": min(rep.expected, 2**32 - 1),
                      "received": min(rep.received, 2**32 - 1), "bytes": rep.nbytes,
                      "seconds": min(86400.0, rep.seconds), "kernel_drops": min(rep.kernel_drops, 2**32 - 1),
                      "position": min(rep.position, 2**32 - 1)}
            try:
                await self.endpoint.notify(mb.addr, m.MsgType.REPORT, fields)
            except RpcError:
                pass

    def _record(self, stats: GroupStats, seconds: float, sent_bytes: int) -> None:
        mt = self.metrics
        mt.allreduce_seconds.observe(seconds)
        mt.allreduce_bytes_sent.inc(sent_bytes)
        for reason, count in stats.refused.items():
            mt.contributions_refused.labels(reason).inc(count)
        for phase, ph in (("reduce_scatter", stats.reduce_scatter), ("all_gather", stats.all_gather)):
            mt.allreduce_expected.labels(phase).inc(ph.datagrams_expected)
            mt.allreduce_received.labels(phase).inc(ph.datagrams_received)
