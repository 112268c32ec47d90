"""The trio driver of GroupAverage: routes tensor datagrams to running groups, paces what it sends.

Data datagrams carry the sender's sealing token, never a node id: a group maps tokens to member
indices through the token's binding (a signed control message). So before sending any data, a member
pings every other member: the request binds its token at them, the response theirs at it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import trio

from ..metrics import Metrics
from ..transport.endpoint import Address, Endpoint, Incoming, RpcError
from ..transport.pacing import Pacer
from ..wire import messages as m
from ..wire.envelope import Header
from ..wire.errors import WireError
from ..wire.identity import node_id_of
from ..wire.seal import TokenState
from .codec import BodyType, peek_group
from .group import GroupAverage, GroupStats, Outcome

log = logging.getLogger("peerd.allreduce")

BATCH = 64  # datagrams per slice of sending work (~0.2-0.5 ms of CPU)
PENDING_MAX = 200_000  # datagrams held for groups this node has not started yet
PENDING_AGE_S = 10.0


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
        self.unbound: dict[int, list[tuple[Header, bytes, TokenState]]] = {}
        self.unbound_count = 0
        self.handshake_s = 0.0
        self.hold_until: float | None = None
        self.wake = trio.Event()


class AllreduceService:
    def __init__(self, endpoint: Endpoint, metrics: Metrics, *, pacer: Pacer | None = None) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.pacer = pacer or Pacer()
        self._groups: dict[int, _Running] = {}
        self._pending: OrderedDict[int, list[tuple[float, Header, bytes, TokenState]]] = OrderedDict()
        self._pending_count = 0
        for t in BodyType:
            endpoint.on_raw(int(t), self._on_data)
        endpoint.on_message(m.MsgType.REPORT, self._on_report)
        endpoint.on_bind(self._on_bind)

    # -- receiving ------------------------------------------------------------------------------
    def _on_data(self, header: Header, body: bytes, state: TokenState, source: Address) -> None:
        group = peek_group(body)
        run = self._groups.get(group)
        if run is None:
            self._hold(group, header, body, state)
            return
        self._deliver(run, header, body, state)

    def _deliver(self, run: _Running, header: Header, body: bytes, state: TokenState) -> None:
        index = run.by_token.get(header.token)
        if index is None:
            if state.peer_key is None:  # its sender's PING has not arrived yet: keep it until it does
                if run.unbound_count >= PENDING_MAX:
                    raise WireError("unbound", "too much data from tokens no control message has bound")
                run.unbound.setdefault(header.token, []).append((header, body, state))
                run.unbound_count += 1
                return
            index = run.by_node.get(node_id_of(state.peer_key))
            if index is None:
                raise WireError("sender", "data from a node that is not in this group")
            run.by_token[header.token] = index
        core = run.core
        before = (core.wants_to_send, core.finished)
        outcome = core.receive(index, header.type, body, trio.current_time())
        if outcome is not Outcome.ACCEPTED and outcome is not Outcome.DUPLICATE:
            self.metrics.datagrams_dropped.labels(outcome.value).inc()
        if (core.wants_to_send, core.finished) != before:
            run.wake.set()

    def _deliver_counted(self, run: _Running, header: Header, body: bytes, state: TokenState) -> None:
        try:
            self._deliver(run, header, body, state)
        except WireError as e:
            self.metrics.datagrams_dropped.labels(e.reason).inc()

    def _on_bind(self, token: int, public_key: bytes) -> None:
        for run in self._groups.values():
            held = run.unbound.pop(token, None)
            if held:
                run.unbound_count -= len(held)
                run.wake.set()
                for header, body, state in held:
                    self._deliver_counted(run, header, body, state)

    def _hold(self, group: int, header: Header, body: bytes, state: TokenState) -> None:
        """Keep data for a group this node has not started yet: its members may start first."""
        now = trio.current_time()
        while self._pending and (
            self._pending_count >= PENDING_MAX or next(iter(self._pending.values()))[0][0] < now - PENDING_AGE_S
        ):
            _, dropped = self._pending.popitem(last=False)
            self._pending_count -= len(dropped)
            self.metrics.datagrams_dropped.labels("group").inc(len(dropped))
        self._pending.setdefault(group, []).append((now, header, body, state))
        self._pending_count += 1

    def _on_report(self, incoming: Incoming) -> None:
        b = incoming.body
        self.pacer.on_report(b["expected"], b["received"], b["seconds"], b["kernel_drops"], self.endpoint.mtu)
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
    ) -> AverageResult:
        if group_id in self._groups:
            raise ValueError(f"group {group_id:#x} is already averaging on this node")
        wall0 = time.perf_counter()
        core = GroupAverage(
            group_id, len(members), index, vector, weight, trio.current_time(),
            max_payload=self.endpoint.max_body, floor_s=floor_s, max_phase_s=max_phase_s, out=out,
            end_grace_s=end_grace_s,
        )
        run = self._groups[group_id] = _Running(core, members)
        kernel_drops_before = getattr(self.endpoint.sock, "kernel_drops", 0)
        sent_bytes = sent = 0
        try:
            async with trio.open_nursery() as nursery:
                # Bind tokens while data already flows: data from a token not bound yet waits for it.
                nursery.start_soon(self._handshake, run)
                for _, header, body, state in self._pending.pop(group_id, []):
                    self._pending_count -= 1
                    self._deliver_counted(run, header, body, state)
                rs_reported = False
                while not core.finished:
                    while core.wants_to_send:
                        nbytes, count = await self._send_batch(run, core.next_datagrams(BATCH))
                        sent_bytes += nbytes
                        sent += count
                    if core.reduce_scatter_done and not rs_reported:
                        rs_reported = True
                        await self._report(run, 0, kernel_drops_before)
                    if core.finished:
                        break
                    run.wake = trio.Event()
                    deadline = core.next_deadline()
                    if deadline is not None and run.unbound:
                        # Data from a sender whose binding is still in flight would turn up as silence:
                        # give the handshake's retries up to one more floor before the deadline counts.
                        if run.hold_until is None:
                            run.hold_until = trio.current_time() + floor_s
                        deadline = max(deadline, run.hold_until)
                    with trio.move_on_at(deadline if deadline is not None else trio.current_time() + 1.0):
                        await run.wake.wait()
                    if not run.unbound or (run.hold_until is not None and trio.current_time() >= run.hold_until):
                        core.handle_timer(trio.current_time())
                await self._report(run, 1, kernel_drops_before)
                nursery.cancel_scope.cancel()  # pings to members that never answered
        finally:
            del self._groups[group_id]
            unbound = sum(len(v) for v in run.unbound.values())
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

    async def _send_batch(self, run: _Running, batch: list) -> tuple[int, int]:
        by_dest: dict[tuple[int, int], list[bytes]] = {}
        for o in batch:
            by_dest.setdefault((o.to, int(o.type)), []).extend([o.body] * o.repeat)
        overhead = self.endpoint.sealer.overhead
        nbytes = count = 0
        for (to, mtype), bodies in by_dest.items():
            size = sum(map(len, bodies)) + overhead * len(bodies)
            wait = self.pacer.reserve(size, trio.current_time())
            if wait > 0:
                await trio.sleep(wait)
            try:
                await self.endpoint.send_raw(run.members[to].addr, mtype, bodies)
            except RpcError as e:
                log.debug("%s", e)
                continue
            nbytes += size
            count += len(bodies)
        await trio.lowlevel.checkpoint()  # let receives and DHT requests in between slices
        return nbytes, count

    async def _report(self, run: _Running, phase: int, kernel_drops_before: int) -> None:
        """Tell each sender what arrived from it in this phase, so it can pace the next one."""
        stats = run.core.statistics()
        ph = stats.reduce_scatter if phase == 0 else stats.all_gather
        drops = max(0, getattr(self.endpoint.sock, "kernel_drops", 0) - kernel_drops_before)
        per_sender = run.core.received_per_sender(phase)
        for i, mb in enumerate(run.members):
            expected, received = per_sender[i]
            if i == run.core.index or expected == 0:
                continue
            fields = {"group": run.core.group_id, "phase": phase, "expected": expected, "received": received,
                      "seconds": min(86400.0, ph.duration_s or 0.0), "kernel_drops": min(drops, 2**32 - 1)}
            try:
                await self.endpoint.notify(mb.addr, m.MsgType.REPORT, fields)
            except RpcError:
                pass

    def _record(self, stats: GroupStats, seconds: float, sent_bytes: int) -> None:
        mt = self.metrics
        mt.allreduce_seconds.observe(seconds)
        mt.allreduce_bytes_sent.inc(sent_bytes)
        for phase, ph in (("reduce_scatter", stats.reduce_scatter), ("all_gather", stats.all_gather)):
            mt.allreduce_expected.labels(phase).inc(ph.datagrams_expected)
            mt.allreduce_received.labels(phase).inc(ph.datagrams_received)
