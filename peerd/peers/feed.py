"""The trio shell of the per-peer view: takes the endpoint's traffic hooks into the PeerTable, ticks its timer, and
publishes the view to Prometheus (the busiest peers, the rest summed) and to whoever asks for a snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import trio

from ..localsock.phases import PHASES
from ..metrics import OTHER_PEER, PEER_LABEL_HEX, TOP_PEERS, Metrics
from .natview import nat_view
from .table import KINDS, PeerTable, TableStatistics

log = logging.getLogger("peerd.peers")

REPORT = 0x10
NETWORK_PHASES = ("matchmaking", "members", "transfer", "agree")
MAX_PENDING = 1024  # (peer, address, type) sums held between ticks; more flushes early


def _fmt(addr: tuple[str, int]) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PeerFeed:
    """Implements the endpoint's TrafficHooks (peerd/transport/traffic.py) over a PeerTable."""

    def __init__(self, endpoint: Any, metrics: Metrics, nat: Any = None, *, table: PeerTable | None = None,
                 on_tick: Callable[[], None] | None = None) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.nat = nat
        self.table = table if table is not None else PeerTable()
        self.on_tick = on_tick  # called after each tick (the status page's snapshot)
        self._labels: dict[str, set[tuple[str, ...]]] = {}
        self._published_kinds: dict[tuple[str, str], int] = {}
        self._addr_text: dict[tuple[str, int], str] = {}
        self._pending_out: dict[tuple, int] = {}
        self._pending_in: dict[tuple, list] = {}

    def _addr(self, addr: tuple[str, int]) -> str:
        text = self._addr_text.get(addr)
        if text is None:
            if len(self._addr_text) >= 4 * self.table.capacity:
                self._addr_text.clear()
            text = self._addr_text[addr] = _fmt(addr)
        return text

    # -- TrafficHooks (the endpoint calls these; never await, never raise) ------------------------
    # Datagrams are summed per (peer, address, type) in a small dict and handed to the table at each tick (and before
    # each statistics()): about 0.4 us a datagram on the receive path instead of the table's 1.8 us.
    def sent(self, addr: tuple[str, int], mtype: int, nbytes: int, relay: bytes | None) -> None:
        key = (addr, mtype, relay)
        pending = self._pending_out
        total = pending.get(key)
        if total is None and len(pending) >= MAX_PENDING:
            self.flush(trio.current_time())
            pending = self._pending_out  # (a new dict)
        pending[key] = (total or 0) + nbytes

    def received(self, source: tuple[str, int], peer: bytes | None, mtype: int, nbytes: int, relayed: bool,
                 now: float, fields: dict[str, Any] | None = None) -> None:
        key = (source, peer, mtype, relayed)
        pending = self._pending_in
        acc = pending.get(key)
        if acc is None:
            if len(pending) >= MAX_PENDING:
                self.flush(now)
                pending = self._pending_in  # (a new dict)
            pending[key] = [nbytes, now]
        else:
            acc[0] += nbytes
            acc[1] = now
        if fields is not None and mtype == REPORT:
            self._report(peer or self.endpoint.node_id_at(source), fields, False, now)

    def flush(self, now: float) -> None:
        """Hand the summed datagrams to the table."""
        table, node_id_at = self.table, self.endpoint.node_id_at
        pending_out, self._pending_out = self._pending_out, {}
        for (addr, mtype, relay), nbytes in pending_out.items():
            table.receive_sent(node_id_at(addr), self._addr(addr), mtype, nbytes, relay, now)
        pending_in, self._pending_in = self._pending_in, {}
        for (source, peer, mtype, relayed), (nbytes, at) in pending_in.items():
            table.receive_received(peer or node_id_at(source), self._addr(source), mtype, nbytes, relayed, at)

    def statistics(self) -> TableStatistics:
        """The table's statistics with every datagram counted, as of now (so ``rates_age_s`` says how old the
        rates' window is when someone reads it)."""
        try:
            now = max(self.table.now, trio.current_time())
        except RuntimeError:  # outside trio (a test's snapshot): the latest input's time
            now = self.table.now
        self.flush(now)
        self.table.handle_timer(now)
        return self.table.statistics()

    def _report(self, peer: bytes | None, fields: dict[str, Any], outgoing: bool, now: float) -> None:
        expected, received = fields.get("expected"), fields.get("received")
        if peer is not None and isinstance(expected, Integral) and isinstance(received, Integral):
            if not self.table.tracks(peer):
                self.flush(now)  # its first datagrams may still be pending
            self.table.receive_report(peer, int(expected), int(received), outgoing, now)  # (numpy ints too)

    def control(self, peer: bytes, mtype: int, fields: dict[str, Any], outgoing: bool) -> None:
        if mtype == REPORT:
            self._report(peer, fields, outgoing, trio.current_time())

    def answered(self, addr: tuple[str, int], peer: bytes, rtt: float | None, now: float) -> None:
        if rtt is not None:
            if not self.table.tracks(peer):
                self.flush(now)
            self.table.receive_rtt(peer, rtt, now)

    def unanswered(self, addr: tuple[str, int], now: float) -> None:
        node = self.endpoint.node_id_at(addr)
        if node is not None:
            if not self.table.tracks(node):
                self.flush(now)
            self.table.receive_unanswered(node, now)

    # -- the timer ---------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            at = self.table.get_timer()
            await trio.sleep_until(at if at is not None else trio.current_time() + 1.0)
            try:
                self.tick(trio.current_time())
            except Exception:  # the view is informative: its failure never takes the daemon down
                self.metrics.background_errors.labels("peers").inc()
                log.exception("the per-peer view's tick failed")

    def tick(self, now: float) -> None:
        self.flush(now)
        self.table.handle_timer(now)
        if self.nat is not None:
            view = nat_view(self.nat)
            for node, path in view.paths.items():
                self.table.receive_path(node, path, None, now)
        self.publish(self.table.statistics())
        if self.on_tick is not None:
            self.on_tick()

    # -- metrics -------------------------------------------------------------------------------------
    def _set(self, name: str, gauge: Any, values: dict[tuple[str, ...], float]) -> None:
        """Set ``gauge``'s children to ``values`` and remove the ones no longer there (bounded series)."""
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        old = self._labels.get(name, set())
        for labels in old - values.keys():
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
        self._labels[name] = set(values)

    def publish(self, stats: TableStatistics) -> None:
        mt = self.metrics
        top, rest = stats.peers[:TOP_PEERS], stats.peers[TOP_PEERS:]
        send: dict[tuple[str, ...], float] = {(p.peer[:PEER_LABEL_HEX],): p.send_bps for p in top}
        recv: dict[tuple[str, ...], float] = {(p.peer[:PEER_LABEL_HEX],): p.recv_bps for p in top}
        if rest:
            send[(OTHER_PEER,)] = sum(p.send_bps for p in rest)
            recv[(OTHER_PEER,)] = sum(p.recv_bps for p in rest)
        rtt: dict[tuple[str, ...], float] = {}
        loss: dict[tuple[str, ...], float] = {}
        for p in top:
            label = p.peer[:PEER_LABEL_HEX]
            if p.rtt_s is not None:
                rtt[(label, "smoothed")] = p.rtt_s
                rtt[(label, "p99")] = p.rtt_p99_s or p.rtt_s
            if p.loss_out is not None:
                loss[(label, "out")] = p.loss_out
            if p.loss_in is not None:
                loss[(label, "in")] = p.loss_in
        self._set("send", mt.peer_send_rate, send)
        self._set("recv", mt.peer_receive_rate, recv)
        self._set("rtt", mt.peer_rtt, rtt)
        self._set("loss", mt.peer_loss, loss)
        mt.peers_tracked.set(stats.tracked)
        for direction, by_kind in (("out", stats.sent_by_kind), ("in", stats.received_by_kind)):
            for kind in KINDS:
                total = by_kind.get(kind, 0)
                done = self._published_kinds.get((direction, kind), 0)
                if total > done:
                    mt.traffic_bytes.labels(direction, kind).inc(total - done)
                    self._published_kinds[(direction, kind)] = total
        total = stats.sent_bytes + stats.received_bytes
        mt.relayed_fraction.set(stats.relayed_bytes / total if total else 0.0)
        swarm = swarm_view(mt)
        if swarm.averages_received_fraction is not None:
            mt.averages_received_fraction.set(swarm.averages_received_fraction)
        if swarm.step_network_share is not None:
            mt.step_network_share.set(swarm.step_network_share)


@dataclass(frozen=True, slots=True)
class SwarmView:
    """The swarm-level figures the view derives from the daemon's own counters (None: nothing to say yet)."""

    averages_received_fraction: float | None
    step_network_share: float | None


def _sums(metric: Any, suffix: str, label: str | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                key = sample.labels.get(label, "") if label else ""
                out[key] = out.get(key, 0.0) + sample.value
    return out


def swarm_view(mt: Metrics) -> SwarmView:
    """The received fraction of this node's averages and the trainers' share of step time on the network."""
    expected = sum(_sums(mt.allreduce_expected, "_total").values())
    received = sum(_sums(mt.allreduce_received, "_total").values())
    phases = _sums(mt.step_phase_seconds, "_sum", "phase")
    step = sum(phases.get(p, 0.0) for p in PHASES)
    network = sum(phases.get(p, 0.0) for p in NETWORK_PHASES)
    return SwarmView(min(1.0, received / expected) if expected else None, network / step if step > 0 else None)
